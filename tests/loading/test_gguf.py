"""GGUF: our dequantizers equal gguf-py's reference; files written as llama.cpp writes them load
back to the same model (exactly for F32, within quantization error for Q8_0)."""

from __future__ import annotations

import json
import struct

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT
from gguf import quants as gguf_quants

from kapitsa.engine.gguf.quants import dequantize, dequantize_mx
from kapitsa.engine.loading.loader import load_model
from kapitsa.errors import CheckpointError, ModelNotFound, UnsupportedModel
from tests.loading.conftest import PROMPT, logits_of
from tests.loading.gguf_export import export_gguf

KINDS = ["qwen3_5", "qwen3_5_moe", "qwen3_next", "nemotron_h", "nemotron_h_dense"]
# byte offsets of the f16 scale fields in each block, which must hold finite values
_F16_FIELDS = {
    QT.Q8_0: (0,),
    QT.Q4_0: (0,),
    QT.Q4_K: (0, 2),
    QT.Q5_K: (0, 2),
    QT.Q6_K: (208,),
    QT.Q2_K: (80, 82),
}


def _random_blocks(qtype, rows, blocks_per_row, seed=0):
    rng = np.random.default_rng(seed)
    _, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, blocks_per_row * type_size), dtype=np.uint8)
    blocks = raw.reshape(-1, type_size)
    for offset in _F16_FIELDS[qtype]:
        scales = (rng.standard_normal(blocks.shape[0]) * 0.05).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return raw


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_K, QT.Q6_K, QT.Q5_K, QT.Q4_0, QT.Q2_K])
def test_dequantize_equals_gguf_reference(qtype):
    raw = _random_blocks(qtype, rows=5, blocks_per_row=3)
    ours, reference = dequantize(raw, qtype), gguf_quants.dequantize(raw, qtype)
    assert ours.shape == reference.shape == (5, 3 * GGML_QUANT_SIZES[qtype][0])
    np.testing.assert_array_equal(ours, reference)
    np.testing.assert_array_equal(np.array(dequantize_mx(raw, qtype)), reference)  # the MLX decoders


def test_q8_0_round_trip_error_is_bounded():
    values = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    restored = dequantize(gguf_quants.quantize(values, QT.Q8_0), QT.Q8_0)
    step = np.abs(values).reshape(-1, 32).max(axis=1) / 127
    assert np.all(np.abs(restored - values).reshape(-1, 32) <= step[:, None] * 0.51 + 1e-3)


@pytest.mark.parametrize("kind", KINDS)
def test_f32_gguf_loads_the_same_model(tiny, tmp_path, kind):
    source = tiny(kind)
    gguf_path = export_gguf(source, tmp_path / f"{kind}-F32.gguf", QT.F32)
    loaded = load_model(gguf_path)
    assert loaded.info.quantization is None and loaded.info.id == gguf_path.name
    reference = logits_of(load_model(source))
    np.testing.assert_allclose(np.array(logits_of(loaded)), np.array(reference), atol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_q8_0_gguf_loads_within_quantization_error(tiny, tmp_path, kind):
    source = tiny(kind)
    loaded = load_model(export_gguf(source, tmp_path / f"{kind}-Q8_0.gguf", QT.Q8_0))
    assert loaded.info.quantization == "8bit"  # re-quantized to MLX 8-bit
    reference = load_model(source)
    assert loaded.tokenizer.encode(PROMPT) == reference.tokenizer.encode(PROMPT)
    quantized, exact = logits_of(loaded), logits_of(reference)
    cosine = (mx.sum(quantized * exact) / mx.sqrt(mx.sum(quantized**2) * mx.sum(exact**2))).item()
    # dense models stay close; tiny random MoE models can flip a near-tied expert choice
    assert cosine > (0.99 if kind in ("qwen3_5", "nemotron_h_dense") else 0.9)


@pytest.mark.parametrize(("qtype", "dtype"), [(QT.F16, mx.float16), (QT.BF16, mx.bfloat16)])
def test_float_gguf_keeps_its_precision(tiny, tmp_path, qtype, dtype):
    loaded = load_model(export_gguf(tiny("nemotron_h_dense"), tmp_path / "m.gguf", qtype))
    assert loaded.info.quantization is None
    assert loaded.model.layers[0].mixer.in_proj.weight.dtype == dtype


def test_gguf_quantization_can_be_overridden(tiny, tmp_path):
    path = export_gguf(tiny("qwen3_5"), tmp_path / "m.gguf", QT.Q8_0)
    assert load_model(path, quantize="4bit").info.quantization == "4bit"
    assert load_model(f"{path}:bf16").info.quantization == "bf16"


@pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h"])
def test_gguf_tokenizer_and_template_match_the_checkpoint(tiny, tmp_path, kind):
    source = tiny(kind)
    from_gguf = load_model(export_gguf(source, tmp_path / "m.gguf", QT.Q8_0)).tokenizer
    from_folder = load_model(source).tokenizer
    text = "<|im_start|>user\nüñí 日本語 🙂 code:\n    x = 12345<|im_end|>\n<think>"
    assert from_gguf.encode(text) == from_folder.encode(text)
    messages = [{"role": "user", "content": "hi"}]
    assert from_gguf.apply_chat_template(messages) == from_folder.apply_chat_template(messages)
    assert set(from_folder.eos_token_ids) <= set(from_gguf.eos_token_ids)
    assert from_gguf.token_to_id("<|im_end|>") in from_gguf.special_token_ids


def test_gguf_of_another_architecture_is_refused(tiny, tmp_path):
    path = export_gguf(tiny("qwen3_5"), tmp_path / "llama.gguf", QT.F32, arch_override="llama")
    with pytest.raises(UnsupportedModel, match="architecture 'llama'.*qwen35"):
        load_model(path)


def test_corrupt_gguf(tiny, tmp_path):
    path = export_gguf(tiny("nemotron_h_dense"), tmp_path / "m.gguf", QT.F32)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])
    with pytest.raises(CheckpointError, match="not a readable GGUF"):
        load_model(path)
    path.write_bytes(b"GGUF" + struct.pack("<I", 3) + b"\xff" * 40)
    with pytest.raises(CheckpointError):
        load_model(path)


def test_folder_of_gguf_files_picks_by_tag(tiny, tmp_path):
    source = tiny("nemotron_h_dense")
    repo = tmp_path / "repo"
    repo.mkdir()
    export_gguf(source, repo / "tiny-F32.gguf", QT.F32)
    export_gguf(source, repo / "tiny-Q8_0.gguf", QT.Q8_0)
    assert load_model(f"{repo}:Q8_0").info.quantization == "8bit"
    (repo / "config.json").write_text((source / "config.json").read_text())  # GGUF repos may ship one
    assert load_model(f"{repo}:q8_0").info.quantization == "8bit"
    with pytest.raises(ModelNotFound, match="tiny-F32.gguf, tiny-Q8_0.gguf"):
        load_model(repo)


def test_gguf_config_matches_the_checkpoint(tiny, tmp_path):
    source = tiny("qwen3_5_moe")
    loaded = load_model(export_gguf(source, tmp_path / "m.gguf", QT.F32))
    original = json.loads((source / "config.json").read_text())["text_config"]
    for key in ("hidden_size", "num_hidden_layers", "layer_types", "num_experts", "num_experts_per_tok",
                "moe_intermediate_size", "linear_num_value_heads", "linear_value_head_dim", "head_dim"):  # fmt: skip
        assert loaded.config[key] == original[key], key
    assert loaded.info.context_length == original["max_position_embeddings"]


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe"])
def test_qwen_gguf_mtp_blocks_become_mtp_weights(tiny, tmp_path, kind):
    from mlx.utils import tree_flatten

    source = tiny(kind, mtp=True)
    from_folder = load_model(source)
    from_gguf = load_model(export_gguf(source, tmp_path / "m.gguf", QT.F32, mtp=True))
    assert from_gguf.config["mtp_num_hidden_layers"] == 1 and from_gguf.model.mtp is not None
    expected = dict(tree_flatten(from_folder.model.mtp.parameters()))
    loaded = dict(tree_flatten(from_gguf.model.mtp.parameters()))
    assert loaded.keys() == expected.keys()
    for name, value in expected.items():
        np.testing.assert_allclose(np.array(loaded[name]), np.array(value), atol=1e-6, err_msg=name)
    np.testing.assert_allclose(np.array(logits_of(from_gguf)), np.array(logits_of(from_folder)), atol=1e-4)


def test_k_quant_gguf_loads_the_values_gguf_reference_decodes(tiny, tmp_path):
    # gguf-py cannot write K-quants, so matrices get random valid Q4_K / Q6_K blocks; the same file
    # with the reference-decoded values stored as F32 must give the identical model.
    source = tiny("nemotron_h_dense", hidden_size=256, intermediate_size=512)
    kinds = {}

    def blocks_for(name, values):
        if values.ndim != 2 or values.shape[-1] % 256 or "ssm_conv1d" in name:
            return None
        qtype = QT.Q4_K if len(kinds) % 2 == 0 else QT.Q6_K
        kinds.setdefault(name, qtype)
        raw = _random_blocks(
            kinds[name], rows=values.shape[0], blocks_per_row=values.shape[1] // 256, seed=len(name)
        )
        _, type_size = GGML_QUANT_SIZES[kinds[name]]
        scale_offsets = _F16_FIELDS[kinds[name]]
        scaled = raw.reshape(-1, type_size)
        for offset in scale_offsets:  # keep weights small: |d| around 1e-3
            d = scaled[:, offset : offset + 2].copy().view(np.float16).astype(np.float32) * 0.02
            scaled[:, offset : offset + 2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
        return raw, kinds[name]

    quantized = export_gguf(source, tmp_path / "k.gguf", QT.F32, raw_tensor=blocks_for)
    assert set(kinds.values()) == {QT.Q4_K, QT.Q6_K}

    def reference_values(name, values):
        supplied = blocks_for(name, values)
        return None if supplied is None else (gguf_quants.dequantize(*supplied).astype(np.float32), QT.F32)

    decoded = export_gguf(source, tmp_path / "ref.gguf", QT.F32, raw_tensor=reference_values)
    # dequantized blocks are held in bf16, so compare both as bf16
    from_k = load_model(quantized, quantize="bf16")
    from_reference = load_model(decoded, quantize="bf16")
    assert load_model(quantized).info.quantization in ("4bit", "6bit")
    np.testing.assert_array_equal(np.array(logits_of(from_k)), np.array(logits_of(from_reference)))


@pytest.mark.parametrize(
    ("kind", "overrides"),
    [
        # a Qwen3.5 checkpoint converted with the YaRN block its model card gives for long context
        ("qwen3_5", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 65536,
                                         "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                                         "mrope_interleaved": True, "mrope_section": [2, 1, 1]}}),
        ("qwen3_next", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "attention_factor": 1.25,
                                         "original_max_position_embeddings": 65536}}),
        # grouped routing: the best 2 of 4 expert groups
        ("nemotron_h", {"n_group": 4, "topk_group": 2}),
    ],
)  # fmt: skip
def test_gguf_keeps_rope_scaling_and_expert_groups(tiny, tmp_path, kind, overrides):
    source = tiny(kind, **overrides)
    loaded = load_model(export_gguf(source, tmp_path / "m.gguf", QT.F32))
    reference = logits_of(load_model(source))
    np.testing.assert_allclose(np.array(logits_of(loaded)), np.array(reference), atol=1e-4)
