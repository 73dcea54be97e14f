"""Every safetensors format round-trips: HF float (single, sharded, bf16), MLX quantized as mlx-lm
writes it, and float checkpoints quantized on load."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import pytest

from kapitsa.engine.loading.loader import load_model
from kapitsa.engine.loading.quantize import QUANT_SPECS
from kapitsa.errors import UnsupportedModel
from tests.loading.conftest import logits_of


def _max_diff(a, b):
    return mx.abs(a - b).max().item()


def _cosine(a, b):
    a, b = a.reshape(-1), b.reshape(-1)
    return (mx.sum(a * b) / mx.sqrt(mx.sum(a * a) * mx.sum(b * b))).item()


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe", "qwen3_next", "nemotron_h", "nemotron_h_dense"])
def test_sharded_checkpoint_gives_the_same_logits_as_single_file(tiny, kind):
    single = logits_of(load_model(tiny(kind, "single")))
    sharded = logits_of(load_model(tiny(kind, "sharded", shards=3)))
    assert mx.array_equal(single, sharded).item()


@pytest.mark.parametrize(
    ("kind", "stored", "loaded_name"),
    [
        (
            "qwen3_5",
            "model.language_model.layers.3.self_attn.q_proj.weight",
            "language_model.model.layers.3.self_attn.q_proj.weight",
        ),
        (
            "nemotron_h_dense",
            "backbone.layers.0.mixer.in_proj.weight",
            "backbone.layers.0.mixer.in_proj.weight",
        ),
    ],
)
def test_bf16_checkpoint_keeps_its_stored_values_exactly(tiny, kind, stored, loaded_name):
    from mlx.utils import tree_flatten

    folder = tiny(kind, "bf16", dtype="bfloat16")
    loaded = load_model(folder)
    params = dict(tree_flatten(loaded.model.parameters()))
    on_disk = mx.load(str(folder / "model.safetensors"))[stored]
    assert params[loaded_name].dtype == mx.bfloat16
    assert mx.array_equal(params[loaded_name], on_disk).item()
    reference = logits_of(load_model(tiny(kind, "f32")))
    assert _cosine(logits_of(loaded), reference) > 0.999


@pytest.mark.parametrize(
    ("mode", "bits", "group_size"),
    [
        ("mxfp4", 4, 32),
        ("nvfp4", 4, 16),
        ("affine", 2, 64),
        ("affine", 3, 64),
        ("affine", 6, 64),
        ("affine", 8, 32),
    ],
)
def test_mlx_checkpoints_of_every_mode_from_mlx_lm_convert(tiny, tmp_path, mode, bits, group_size):
    from mlx_lm import convert

    source = tiny("nemotron_h_dense")
    converted = tmp_path / mode
    convert(
        str(source),
        str(converted),
        quantize=True,
        q_mode=mode,
        q_bits=bits,
        q_group_size=group_size,
        dtype="float32",
    )
    loaded = load_model(converted)
    name = mode if mode != "affine" else f"{bits}bit"
    assert loaded.info.quantization == name
    layer = loaded.model.layers[0].mixer.in_proj
    assert (layer.mode, layer.bits, layer.group_size) == (mode, bits, group_size)
    if group_size == QUANT_SPECS[name].group_size:  # same recipe as quantizing on load
        assert mx.array_equal(logits_of(loaded), logits_of(load_model(source, quantize=name))).item()


def test_mtp_weights_are_kept(tiny):
    loaded = load_model(tiny("qwen3_5", mtp=True))
    assert loaded.model.mtp is not None


@pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h", "qwen3_5_moe"])
def test_mlx_4bit_checkpoint_from_mlx_lm_convert(tiny, tmp_path, kind):
    from mlx_lm import convert

    source = tiny(kind)
    converted = tmp_path / "mlx-4bit"
    convert(str(source), str(converted), quantize=True, q_bits=4, q_group_size=64, dtype="float32")
    block = json.loads((converted / "config.json").read_text())["quantization"]
    loaded = load_model(converted)
    assert loaded.info.quantization == "4bit"
    reference = logits_of(load_model(source))
    quantized = logits_of(loaded)
    assert _cosine(quantized, reference) > 0.75  # 4-bit error is large at width 64 with random weights
    if kind == "qwen3_5_moe":  # mlx-lm keeps routers at 8 bits: per-module overrides
        gate = loaded.model.language_model.model.layers[0].mlp.gate
        assert block["language_model.model.layers.0.mlp.gate"]["bits"] == 8
        assert isinstance(gate, nn.QuantizedLinear) and gate.bits == 8
    else:  # same modules, same mx.quantize: identical to quantizing on load
        assert mx.array_equal(quantized, logits_of(load_model(source, quantize="4bit"))).item()


def test_mixed_bit_mlx_checkpoint_with_its_table_in_checkpoint_names(tiny, tmp_path):
    """Intel's AutoRound MLX builds of Qwen3.5/3.6 store tensors and key the per-module table by the
    checkpoint's names (`model.language_model.layers...`); each module takes its stored width."""
    from mlx_lm import convert

    converted = tmp_path / "mixed"
    convert(str(tiny("qwen3_5")), str(converted), quantize=True, q_group_size=32, quant_predicate="mixed_4_6")
    reference = logits_of(load_model(converted))

    def hf_name(key: str) -> str:
        return "model.language_model." + key.removeprefix("language_model.model.")

    for path in converted.glob("*.safetensors"):
        stored = mx.load(str(path))
        renamed = {hf_name(k) if k.startswith("language_model.model.") else k: v for k, v in stored.items()}
        mx.save_safetensors(str(path), renamed, metadata={"format": "mlx"})
    config = json.loads((converted / "config.json").read_text())
    table = {
        hf_name(k) if k.startswith("language_model.model.") else k: v
        for k, v in config["quantization"].items()
    }
    assert {v["bits"] for v in table.values() if isinstance(v, dict)} == {4, 6}
    config["quantization"] = config["quantization_config"] = table
    (converted / "config.json").write_text(json.dumps(config))
    loaded = load_model(converted)
    assert mx.array_equal(logits_of(loaded), reference).item()


@pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h_dense"])
def test_8bit_is_within_quantization_error_and_4bit_is_coarser(tiny, kind):
    # dense kinds: in tiny random MoE models a small error can flip a near-tied top-k routing
    source = tiny(kind)
    reference = logits_of(load_model(source))
    logits8 = logits_of(load_model(source, quantize="8bit"))
    err8 = _max_diff(logits8, reference)
    err4 = _max_diff(logits_of(load_model(f"{source}:4bit")), reference)
    assert _cosine(logits8, reference) > 0.995
    assert err8 < err4 / 4  # 8-bit steps are 16x finer than 4-bit ones


@pytest.mark.parametrize("name", ["mxfp4", "nvfp4", "6bit", "3bit"])
def test_other_quantization_modes_on_load(tiny, name):
    loaded = load_model(tiny("nemotron_h_dense"), quantize=name)
    assert loaded.info.quantization == name
    layer = loaded.model.layers[0].mixer.in_proj
    assert isinstance(layer, nn.QuantizedLinear)
    assert layer.mode == ("affine" if name.endswith("bit") else name)
    assert mx.isfinite(logits_of(loaded)).all().item()


def test_model_info(tiny):
    qwen = load_model(tiny("qwen3_5"))
    assert (qwen.info.family, qwen.info.tool_call_format, qwen.info.context_length) == (
        "qwen3_5",
        "qwen3_coder",
        262144,
    )
    assert qwen.info.supports_thinking and qwen.info.id == "qwen3_5" and qwen.info.quantization is None
    assert load_model(tiny("qwen3_next")).info.tool_call_format == "hermes"
    nemotron = load_model(tiny("nemotron_h"), model_id="my-nemo")
    assert (nemotron.info.id, nemotron.info.family, nemotron.info.tool_call_format) == (
        "my-nemo",
        "nemotron_h",
        "nemotron",
    )
    assert nemotron.tokenizer.eos_token_ids == (2, 11)
    assert qwen.generation_config["temperature"] == 0.6 and qwen.generation_config["top_k"] == 20


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe"])
def test_published_qwen3_5_layout_with_vision_tower_and_mtp(tiny, kind):
    # Qwen publishes the vision tower and the MTP block in the same files as the language model
    full = load_model(tiny(kind, "full", vision=True, mtp=True, shards=2))
    text_only = load_model(tiny(kind, "text"))
    assert full.model.mtp is not None
    assert mx.array_equal(logits_of(full), logits_of(text_only)).item()


def test_tied_embeddings(tiny):
    loaded = load_model(tiny("qwen3_5", tie_word_embeddings=True))
    assert "lm_head" not in loaded.model.language_model
    assert mx.isfinite(logits_of(loaded)).all().item()


def test_quantizing_on_load_never_holds_the_whole_float_model(tmp_path):
    from kapitsa.testing.tiny import write_tiny_checkpoint

    sizes = {"hidden_size": 512, "intermediate_size": 2048, "linear_num_key_heads": 4, "linear_num_value_heads": 8,
             "linear_key_head_dim": 64, "linear_value_head_dim": 64, "num_hidden_layers": 8}  # fmt: skip
    folder = write_tiny_checkpoint(tmp_path, "qwen3_5", dtype="bfloat16", **sizes)
    float_bytes = (folder / "model.safetensors").stat().st_size
    mx.clear_cache()
    mx.reset_peak_memory()
    held_before = mx.get_active_memory()  # arrays other tests keep cached count toward the peak
    load_model(folder, quantize="4bit")
    assert mx.get_peak_memory() - held_before < 0.9 * float_bytes


def _per_expert(stored: dict, kind: str) -> dict:
    """mlx-lm's stacked `switch_mlp` tensors written back one expert at a time under the published
    names, quantized parts included, as AutoRound's MLX export stores MoE experts."""
    names = {"fc1": "up_proj", "fc2": "down_proj"} if kind == "nemotron_h" else {}
    out = {}
    for key, value in stored.items():
        head, sep, tail = key.partition(".switch_mlp.")
        if not sep:
            out[key] = value
            continue
        proj, part = tail.split(".")
        for e in range(value.shape[0]):
            out[f"{head}.experts.{e}.{names.get(proj, proj)}.{part}"] = value[e]
    return out


def _fused_gate_up(stored: dict) -> dict:
    """The same experts fused as `experts.gate_up_proj.*` (gate rows first) and `experts.down_proj.*`."""
    out = {}
    for key, value in stored.items():
        head, sep, tail = key.partition(".switch_mlp.")
        if not sep:
            out[key] = value
        elif tail.startswith("gate_proj."):
            part = tail.split(".")[1]
            out[f"{head}.experts.gate_up_proj.{part}"] = mx.concatenate(
                [value, stored[f"{head}.switch_mlp.up_proj.{part}"]], axis=-2
            )
        elif tail.startswith("down_proj."):
            out[f"{head}.experts.{tail}"] = value
    return out


@pytest.mark.parametrize(
    "kind, layout", [("qwen3_5_moe", "per_expert"), ("qwen3_5_moe", "fused"), ("nemotron_h", "per_expert")]
)
def test_autoround_mlx_export_with_quantized_experts(tiny, tmp_path, kind, layout):
    """AutoRound's MLX export: MLX-packed tensors, experts stored quantized one Linear each (or
    fused), and a `quantization_config` naming auto-round with `packing_format: mlx` beside the MLX
    `quantization` block (top level and in `text_config`). mlx-lm loads it; so does kapitsa, exactly."""
    from mlx_lm import convert

    converted = tmp_path / "autoround"
    convert(str(tiny(kind)), str(converted), quantize=True, q_bits=4, q_group_size=32)
    reference = logits_of(load_model(converted))
    for path in converted.glob("*.safetensors"):
        stored = mx.load(str(path))
        rewritten = _per_expert(stored, kind) if layout == "per_expert" else _fused_gate_up(stored)
        assert rewritten.keys() != stored.keys()
        mx.save_safetensors(str(path), rewritten, metadata={"format": "mlx"})
    (converted / "model.safetensors.index.json").unlink(missing_ok=True)
    config = json.loads((converted / "config.json").read_text())
    autoround = {
        "quant_method": "auto-round",
        "packing_format": "mlx",
        "bits": 4,
        "group_size": 32,
        "sym": True,
    }
    config["quantization_config"] = autoround
    if "text_config" in config:
        config["text_config"]["quantization_config"] = autoround
    (converted / "config.json").write_text(json.dumps(config))
    loaded = load_model(converted)
    assert loaded.info.quantization == "4bit"
    assert mx.array_equal(logits_of(loaded), reference).item()


def test_autoround_in_another_packing_is_refused(tiny):
    folder = tiny("qwen3_5")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "auto-round",
        "packing_format": "auto_round:auto_gptq",
        "bits": 4,
        "group_size": 128,
    }
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModel, match="quantized with 'auto-round'"):
        load_model(folder)
