"""The model catalog: aliases, quants, user extensions, and architecture numbers from real configs."""

from __future__ import annotations

import pytest

from kapitsa import memory_estimate as me
from kapitsa.catalog import arch_from_config, is_alias, load_catalog, resolve_model
from kapitsa.errors import ModelNotFound, NoRoutedExperts

ALIASES = {"4b", "9b", "27b", "35b", "flint", "flash-next", "lightning", "bolt", "super-vl", "dory", "demo"}
MiB, KiB = 1 << 20, 1 << 10

# Published config.json values (Qwen/Qwen3.5-4B text_config; nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16).
QWEN35_4B = {
    "model_type": "qwen3_5",
    "text_config": {
        "hidden_size": 2560,
        "num_hidden_layers": 32,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 4,
        "vocab_size": 248320,
        "max_position_embeddings": 262144,
    },
}
NEMOTRON_NANO = {
    "model_type": "nemotron_h",
    "hidden_size": 2688,
    "num_hidden_layers": 52,
    "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
    "num_attention_heads": 32,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "mamba_num_heads": 64,
    "mamba_head_dim": 64,
    "ssm_state_size": 128,
    "n_groups": 8,
    "conv_kernel": 4,
    "vocab_size": 131072,
    "max_position_embeddings": 262144,
}


def test_every_alias_is_in_the_catalog_with_its_quants() -> None:
    catalog = load_catalog()
    assert set(catalog.entries) == ALIASES
    for entry in catalog:
        if entry.alias == "demo":
            assert entry.package_path == "demo" and entry.arch is None
            continue
        assert entry.arch is not None and entry.arch.context_length > 0 and entry.arch.max_output > 0
        assert entry.default_quant in {q.name for q in entry.quants}
        assert all("/" in q.repo_id and q.bits_per_weight > 0 for q in entry.quants)


def test_quant_syntax_and_display_names() -> None:
    catalog = load_catalog()
    assert is_alias("27b:6bit", catalog) and is_alias("27B", catalog)
    assert not is_alias("Qwen/Qwen3.5-27B:4bit", catalog)
    six = resolve_model("27b:6bit", catalog)
    assert six.repo_id == "mlx-community/Qwen3.6-27B-6bit" and six.display_name == "27b:6bit"
    default = resolve_model("27b", catalog)
    assert default.quant is not None and default.quant.name == "4bit" and default.display_name == "27b"
    assert resolve_model("27B", catalog).entry is default.entry  # aliases are case-insensitive


def test_unknown_names_say_what_exists() -> None:
    catalog = load_catalog()
    with pytest.raises(ModelNotFound, match="no quant '3bit'.*4bit"):
        resolve_model("27b:3bit", catalog)
    with pytest.raises(ModelNotFound, match="catalog alias"):
        resolve_model("no such model", catalog)
    with pytest.raises(ModelNotFound, match="no @revision"):
        resolve_model("27b@v2", catalog)


def test_repo_ids_and_folders_resolve_without_the_catalog(tmp_path) -> None:
    catalog = load_catalog()
    assert resolve_model("someone/Some-Model-4bit", catalog).repo_id == "someone/Some-Model-4bit"
    folder = resolve_model(str(tmp_path), catalog)
    assert folder.kind == "path" and folder.path == tmp_path.resolve()


def test_demo_points_at_the_package_folder_or_says_it_is_missing() -> None:
    from importlib import resources

    folder = resources.files("kapitsa").joinpath("demo")
    if folder.joinpath("config.json").is_file():
        assert resolve_model("demo", load_catalog()).path is not None
    else:
        with pytest.raises(ModelNotFound, match="not in this kapitsa install"):
            resolve_model("demo", load_catalog())


def test_user_entries_extend_and_override() -> None:
    catalog = load_catalog(
        {
            "27b": {"default_quant": "8bit"},
            "mine": {
                "name": "Mine",
                "params_b": 1.0,
                "active_params_b": 1.0,
                "context_length": 4096,
                "max_output": 512,
                "hidden_size": 64,
                "vocab_size": 100,
                "attention_layers": 2,
                "num_kv_heads": 1,
                "head_dim": 32,
                "quants": {"4bit": "me/mine-4bit", "odd": {"repo": "me/mine-odd", "bits_per_weight": 3.1}},
            },
        }
    )
    assert resolve_model("27b", catalog).repo_id == "mlx-community/Qwen3.6-27B-8bit"
    assert resolve_model("mine:odd", catalog).quant.bits_per_weight == 3.1  # type: ignore[union-attr]
    with pytest.raises(ModelNotFound, match="malformed"):
        load_catalog({"broken": {"name": "x", "quants": {"4bit": "a/b"}}})


def test_architecture_from_published_configs_matches_the_state_sizes() -> None:
    qwen = arch_from_config(QWEN35_4B)
    assert (qwen.attention_layers, qwen.linear_layers) == (8, 24)
    assert me.kv_bytes_per_token(qwen) == 32 * KiB
    assert me.recurrent_state_bytes(qwen) == 24 * (2 * MiB + 48 * KiB)  # 49.1 MiB, hybrid-engine.md §4
    nano = arch_from_config(NEMOTRON_NANO)
    assert (nano.attention_layers, nano.mamba_layers) == (6, 23)
    assert me.kv_bytes_per_token(nano) == 6 * KiB
    assert me.recurrent_state_bytes(nano) == 23 * (2 * MiB + 36 * KiB)  # 46.8 MiB


def test_catalog_numbers_agree_with_the_published_configs() -> None:
    catalog = load_catalog()
    assert me.recurrent_state_bytes(catalog.get("4b").arch) == me.recurrent_state_bytes(
        arch_from_config(QWEN35_4B)
    )  # type: ignore[arg-type]
    lightning = catalog.get("lightning").arch
    assert me.kv_bytes_per_token(lightning) == me.kv_bytes_per_token(arch_from_config(NEMOTRON_NANO))  # type: ignore[arg-type]
    assert me.recurrent_state_bytes(catalog.get("27b").arch) == 48 * (3 * MiB + 60 * KiB)  # type: ignore[arg-type]


def test_small_resolves_a_moe_alias_to_its_bf16_weights_with_the_recipe() -> None:
    catalog = load_catalog()
    flint = resolve_model("flint:small", catalog)
    assert (flint.repo_id, flint.quantize, flint.display_name) == (
        "RecursiveSI/flint",
        "small",
        "flint:small",
    )
    assert resolve_model("35b:small", catalog).repo_id == "Qwen/Qwen3.6-35B-A3B"
    assert resolve_model("flint", catalog).quantize is None  # plain quants load as published


@pytest.mark.parametrize("alias", ["4b", "9b", "27b", "dory"])
def test_small_on_a_dense_alias_says_why(alias: str) -> None:
    with pytest.raises(NoRoutedExperts, match="dense model.*routed experts"):
        resolve_model(f"{alias}:small", load_catalog())


@pytest.mark.parametrize("alias", ["bolt", "flash-next", "super-vl"])
def test_small_on_a_moe_alias_without_its_expert_size_says_so(alias: str) -> None:
    with pytest.raises(NoRoutedExperts, match="size of its routed experts") as refused:
        resolve_model(f"{alias}:small", load_catalog())
    assert "dense" not in str(refused.value)


def test_every_moe_entry_counts_its_routed_experts_below_its_total() -> None:
    for entry in load_catalog():
        if entry.model_type in ("qwen3_5_moe", "flint") or entry.alias == "lightning":
            assert entry.arch is not None and 0 < entry.arch.expert_params_b < entry.arch.params_b, (
                entry.alias
            )
