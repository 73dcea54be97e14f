"""Config parsing, sanitize (HF and MLX names), MTP weights, quantization hooks, hidden states."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from kapitsa.engine.models import get_model_module, nemotron_h, qwen3_5
from kapitsa.errors import CheckpointError, UnsupportedModel
from tests.models.builders import build_mlx_lm, build_ours, config_and_weights
from tests.models.hf_weights import nemotron_config, qwen_config, qwen_weights


def test_unknown_model_type_names_the_supported_ones():
    with pytest.raises(UnsupportedModel, match="nemotron_h"):
        get_model_module("llama")


def test_qwen_config_forms():
    nested = qwen3_5.ModelArgs.from_dict(qwen_config("dense"))
    assert nested.wrapped and nested.hidden_size == 64 and nested.partial_rotary_factor == 0.5
    flat = qwen3_5.ModelArgs.from_dict(qwen_config("dense")["text_config"])
    assert not flat.wrapped and flat.model_type == "qwen3_5_text"
    custom = dict(qwen_config("next"), layer_types=["linear_attention"] * 3 + ["full_attention"])
    model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict(custom))
    assert [layer.is_linear for layer in model.layers] == [True, True, True, False]
    derived = {k: v for k, v in qwen_config("next").items() if k != "layer_types"}
    assert qwen3_5.ModelArgs.from_dict(derived).layer_types[1] == "full_attention"
    with pytest.raises(CheckpointError):
        qwen3_5.ModelArgs.from_dict(dict(custom, layer_types=["linear_attention"]))
    with pytest.raises(CheckpointError):
        qwen3_5.ModelArgs.from_dict(dict(custom, layer_types=["sliding"] * 4))


@pytest.mark.parametrize(
    "spelling",
    [
        {"hybrid_override_pattern": "M*-E"},
        {"hybrid_override_pattern": ["M", "*", "-", "E"]},
        {"layers_block_type": ["linear_attention", "full_attention", "mlp", "moe"]},
        {"layer_types": ["mamba", "attention", "mlp", "moe"]},
    ],
)
def test_nemotron_pattern_spellings(spelling):
    base = {k: v for k, v in nemotron_config("moe").items() if k != "layers_block_type"}
    assert nemotron_h.ModelArgs.from_dict({**base, **spelling}).pattern == "M*-E"


def test_nemotron_null_fields_fall_back():
    cfg = dict(
        nemotron_config("dense"),
        n_group=None,
        topk_group=None,
        routed_scaling_factor=None,
        n_routed_experts=None,
        norm_topk_prob=None,
        moe_latent_size=None,
        head_dim=None,
    )
    args = nemotron_h.ModelArgs.from_dict(cfg)
    assert (args.n_group, args.routed_scaling_factor, args.head_dim) == (1, 1.0, 16)


def test_nemotron_absent_head_dim_is_transformers_default():
    cfg = {k: v for k, v in nemotron_config("dense").items() if k != "head_dim"}
    assert nemotron_h.ModelArgs.from_dict(cfg).head_dim == 128


def test_nemotron_bad_patterns():
    base = {k: v for k, v in nemotron_config("dense").items() if k != "hybrid_override_pattern"}
    with pytest.raises(CheckpointError):
        nemotron_h.ModelArgs.from_dict(base)
    with pytest.raises(CheckpointError):
        nemotron_h.ModelArgs.from_dict({**base, "layers_block_type": ["conv2d"]})
    with pytest.raises(CheckpointError):  # MoE layer without experts configured
        nemotron_h.ModelArgs.from_dict({**base, "hybrid_override_pattern": "ME"})


@pytest.mark.parametrize(
    "arch", ["qwen3_5_dense", "qwen3_5_moe", "qwen3_next", "nemotron_moe", "nemotron_latent"]
)
def test_mlx_format_weights_load_unchanged(arch):
    """mlx-lm's converted weights (what mlx-community publishes) load strictly, same logits."""
    ref = build_mlx_lm(arch)
    cfg, _ = config_and_weights(arch)
    module = get_model_module(cfg["model_type"])
    ours = module.Model(module.ModelArgs.from_dict(cfg))
    mlx_weights = dict(tree_flatten(ref.parameters()))
    ours.load_weights(list(ours.sanitize(dict(mlx_weights)).items()), strict=True)
    x = mx.array([[4, 8, 15, 16, 23, 42]])
    assert mx.abs(ours(x) - ref(x)).max().item() < 1e-4


def test_fused_and_per_expert_qwen_tensors_agree():
    cfg = qwen_config("moe")
    args = qwen3_5.ModelArgs.from_dict(cfg)
    fused = qwen_weights(cfg, fused_experts=True)
    per_expert = dict(fused)
    for key in [k for k in fused if k.endswith("experts.gate_up_proj")]:
        p = key[: -len("gate_up_proj")]
        gate_up, down = per_expert.pop(key), per_expert.pop(p + "down_proj")
        mid = gate_up.shape[1] // 2
        for e in range(gate_up.shape[0]):
            per_expert[f"{p}{e}.gate_proj.weight"] = gate_up[e, :mid]
            per_expert[f"{p}{e}.up_proj.weight"] = gate_up[e, mid:]
            per_expert[f"{p}{e}.down_proj.weight"] = down[e]
    a, b = qwen3_5.Model(args).sanitize(fused), qwen3_5.Model(args).sanitize(per_expert)
    assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]).item() for k in a)
    del per_expert["model.language_model.layers.0.mlp.experts.3.up_proj.weight"]
    with pytest.raises(CheckpointError, match="expert"):
        qwen3_5.Model(args).sanitize(per_expert)


def test_qwen_mtp_weights_are_kept_and_run():
    model = build_ours("qwen3_5_dense", mtp=True)
    _, hf = config_and_weights("qwen3_5_dense", mtp=True)
    assert model.mtp is not None and len(model.mtp.layers) == 1
    # zero-centred norm convention applied to the MTP norms as to the rest
    assert mx.allclose(model.mtp.norm.weight, hf["mtp.norm.weight"] + 1.0).item()
    out = model.forward(mx.array([[5, 6, 7, 8]]))
    post_norm = model.final_norm(out.hidden)
    cache = model.make_mtp_cache()
    h = model.mtp_forward(mx.array([[6, 7, 8, 9]]), post_norm, cache)
    logits = model.mtp_logits(h)
    assert logits.shape == (1, 4, 256) and cache.offsets == [4]
    step = model.mtp_logits(model.mtp_forward(mx.array([[10]]), post_norm[:, -1:], cache))
    assert step.shape == (1, 1, 256) and cache.offsets == [5]
    cache.rollback(1)  # attention only: no record needed
    again = model.mtp_logits(model.mtp_forward(mx.array([[10]]), post_norm[:, -1:], cache))
    assert mx.abs(again - step).max().item() < 1e-5
    plain = build_ours("qwen3_5_dense")
    assert plain.mtp is None  # without mtp tensors nothing extra is built


def test_nemotron_mtp_head_loads_every_tensor_and_predicts_from_the_fused_state():
    """The head's first step is eh_proj(concat(enorm(embed(t+1)), hnorm(hidden_t))), then the
    step's blocks and its final_layernorm; the target's LM head reads it."""
    from tests.models.builders import config_and_weights

    model = build_ours("nemotron_moe", mtp=True)  # build_ours loads strictly: every mtp.* is used
    assert model.mtp is not None and [layer.block.block_type for layer in model.mtp.layers] == ["*", "E"]
    _, weights = config_and_weights("nemotron_moe", mtp=True)
    ids, hidden = mx.array([[5, 7]]), mx.random.normal((1, 2, 64))
    w = {k: v for k, v in weights.items() if k.startswith("mtp.layers.0.")}

    def rms(x, weight):
        return x * mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + 1e-5) * weight

    embed = weights["backbone.embeddings.weight"][ids]
    fused = mx.concatenate(
        [rms(embed, w["mtp.layers.0.enorm.weight"]), rms(hidden, w["mtp.layers.0.hnorm.weight"])], -1
    )
    want = fused @ w["mtp.layers.0.eh_proj.weight"].T
    assert mx.abs(model.mtp.combine(model.backbone.embeddings(ids), hidden) - want).max().item() < 1e-4
    cache = model.make_mtp_cache(1)
    full = model.mtp_logits(model.mtp_forward(ids, hidden, cache))
    assert full.shape == (1, 2, weights["lm_head.weight"].shape[0])
    cache.rollback(1)  # attention and MoE only: no record needed
    again = model.mtp_logits(model.mtp_forward(ids[:, 1:], hidden[:, 1:], cache))
    assert mx.abs(again[0, -1] - full[0, -1]).max().item() < 1e-4


def _nemotron_without_mtp_config(weights_edit=None):  # noqa: ANN001, ANN202
    from kapitsa.engine.models import get_model_module
    from tests.models.builders import config_and_weights

    cfg, weights = config_and_weights("nemotron_moe", mtp=True)
    configured = cfg.pop("mtp_hybrid_override_pattern")
    weights = dict(weights) if weights_edit is None else weights_edit(dict(weights))
    module = get_model_module(cfg["model_type"])
    model = module.Model(module.ModelArgs.from_dict(cfg))
    model.load_weights(list(model.sanitize(weights).items()), strict=True)
    return model, configured


def test_nemotron_mtp_step_without_a_config_is_read_from_its_tensors():
    model, configured = _nemotron_without_mtp_config()
    assert model.mtp is not None and model.mtp_weights == {}
    assert (
        "".join("*" if hasattr(layer.block.mixer, "q_proj") else "E" for layer in model.mtp.layers)
        == configured
    )


def test_nemotron_mtp_tensors_it_cannot_tell_are_kept_aside():
    def unknown_mixer(w):  # noqa: ANN001, ANN202 - a layer with neither attention nor a router
        return {
            k.replace("mtp.layers.0.mixer.q_proj", "mtp.layers.0.mixer.odd_proj"): v for k, v in w.items()
        }

    model, _ = _nemotron_without_mtp_config(unknown_mixer)
    assert model.mtp is None and "mtp.layers.0.eh_proj.weight" in model.mtp_weights
    assert not any(k.startswith("mtp") for k, _ in tree_flatten(model.parameters()))


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "nemotron_moe"])
def test_quantize_with_the_models_predicate(arch):
    model = build_ours(arch)
    x = mx.array([[3, 1, 4, 1, 5, 9, 2, 6]])
    want = model(x)

    def predicate(path, module):
        return hasattr(module, "to_quantized") and model.quant_predicate(path, module)

    nn.quantize(model, group_size=32, bits=8, class_predicate=predicate)
    names = dict(tree_flatten(model.parameters()))
    assert any(
        k.endswith("switch_mlp.fc1.scales") or k.endswith("switch_mlp.gate_proj.scales") for k in names
    )
    assert not any(".gate.scales" in k or "shared_expert_gate.scales" in k for k in names)
    got = model(x)
    assert mx.abs(got - want).max().item() < 0.1 * mx.abs(want).max().item()
    assert not model.cast_predicate("backbone.layers.0.mixer.A_log")


def test_hidden_states_and_taps():
    model = build_ours("nemotron_dense")
    x = mx.array([[7, 8, 9]])
    last = len(model.layers) - 1
    out = model.forward(x, taps=(0, last))
    assert set(out.taps) == {0, last} and out.hidden.shape == (1, 3, 64)
    assert mx.array_equal(model.logits(out.hidden), model(x)).item()
    assert mx.array_equal(out.taps[last], out.hidden).item()
    assert not mx.array_equal(out.taps[0], out.hidden).item()


def test_mtp_dedicated_embeddings_are_used():
    cfg, hf = config_and_weights("qwen3_5_dense", mtp=True)
    hf["mtp.embed_tokens.weight"] = mx.zeros_like(hf["model.language_model.embed_tokens.weight"])
    model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict(cfg))
    model.load_weights(list(model.sanitize(hf).items()), strict=True)
    assert "embed_tokens" in model.mtp
    hidden = mx.zeros((1, 2, 64))
    a = model.mtp_forward(mx.array([[1, 2]]), hidden)
    b = model.mtp_forward(mx.array([[3, 4]]), hidden)
    assert mx.array_equal(a, b).item()  # zero embeddings: the token no longer matters


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "nemotron_moe"])
def test_bfloat16_and_quantized_models_run_on_cpu(arch):
    from mlx.utils import tree_unflatten

    model = build_ours(arch)
    params = [
        (p, v.astype(mx.bfloat16) if model.cast_predicate(p) else v)
        for p, v in tree_flatten(model.parameters())
    ]
    model.update(tree_unflatten(params))
    cache = model.make_cache(2)
    model(mx.array([[1, 2, 3, 4], [5, 6, 0, 0]]), cache, lengths=[4, 2])
    model(mx.array([[7, 8, 9], [1, 2, 3]]), cache, record=True)
    cache.rollback([1, 2])
    out = model(mx.array([[3], [4]]), cache)
    assert out.dtype == mx.bfloat16 and not mx.isnan(out).any().item()
    recurrent = [c for c in cache.layers if c is not None and hasattr(c, "state")]
    assert all(c.state.dtype == mx.float32 and c.conv.dtype == mx.bfloat16 for c in recurrent)
    nn.quantize(
        model,
        group_size=32,
        bits=4,
        class_predicate=lambda p, m: hasattr(m, "to_quantized") and model.quant_predicate(p, m),
    )
    assert not mx.isnan(model(mx.array([[1, 2, 3]]))).any().item()
