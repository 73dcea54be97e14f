"""lab/weight_reads.py: the bytes a batch-1 decode token reads, against sums worked out from the
configs' widths (float32 models, 4 bytes a weight), so the bandwidth figures can't count the
embedding table or the unchosen experts."""

from __future__ import annotations

import mlx.core as mx
import pytest

from kapitsa.engine.models import get_model_module
from kapitsa.testing.tiny import tiny_config
from lab.weight_reads import _lazy_model, image_tower_bytes, read_bytes_per_token, routing, total_bytes

F32 = 4


def _model(kind: str, **overrides):
    config = tiny_config(kind, **overrides)
    module = get_model_module(config["model_type"])
    model = module.Model(module.ModelArgs.from_dict(config))
    model.set_dtype(mx.float32)
    return model, config.get("text_config") or config


def _text_bytes(model) -> int:
    return total_bytes(model) - image_tower_bytes(model)


def _unread_embedding_rows(text: dict) -> int:
    return (text["vocab_size"] - 1) * text["hidden_size"] * F32


def test_tied_dense_model_reads_every_weight() -> None:
    model, text = _model("qwen3_5", tie_word_embeddings=True)
    assert routing(text) is None
    assert read_bytes_per_token(model, None) == _text_bytes(model)


def test_untied_model_reads_one_embedding_row() -> None:
    model, text = _model("qwen3_5", tie_word_embeddings=False)
    assert read_bytes_per_token(model, None) == _text_bytes(model) - _unread_embedding_rows(text)


def test_qwen_moe_reads_top_k_of_the_routed_experts() -> None:
    model, text = _model("qwen3_5_moe")
    experts, top_k = routing(text)
    assert (experts, top_k) == (text["num_experts"], text["num_experts_per_tok"]) and top_k < experts
    # per layer: gate, up [E, I, H] and down [E, H, I]; every Qwen3.5-MoE layer has them
    stacks = text["num_hidden_layers"] * 3 * experts * text["moe_intermediate_size"] * text["hidden_size"]
    unread = stacks * F32 * (experts - top_k) / experts
    want = _text_bytes(model) - _unread_embedding_rows(text) - unread
    assert read_bytes_per_token(model, (experts, top_k)) == pytest.approx(want, abs=1)


def test_nemotron_reads_top_k_of_the_routed_experts() -> None:
    model, config = _model("nemotron_h")
    experts, top_k = routing(config)
    moe_layers = config["hybrid_override_pattern"].count("E")
    assert moe_layers and top_k < experts
    # fc1 [E, I, H] and fc2 [E, H, I] per E layer
    stacks = moe_layers * 2 * experts * config["moe_intermediate_size"] * config["hidden_size"]
    unread = stacks * F32 * (experts - top_k) / experts
    want = _text_bytes(model) - _unread_embedding_rows(config) - unread
    assert read_bytes_per_token(model, (experts, top_k)) == pytest.approx(want, abs=1)


def test_full_shapes_are_sized_without_making_weights() -> None:
    """The bench's 4-bit 27B: its embedding table is 248320 rows of 5120 weights at 4.5 bits
    (4-bit values, a bf16 scale and bias per 64), all but one row unread."""
    model, _ = _lazy_model("qwen3_5", dict(hidden_size=5120, vocab_size=248320, tie_word_embeddings=False))
    table = 248320 * 5120 * 4.5 / 8
    assert _text_bytes(model) - read_bytes_per_token(model, None) == pytest.approx(
        table * (1 - 1 / 248320), rel=1e-9
    )


def test_a_decode_step_reads_no_image_tower_weight() -> None:
    """Qwen3.5's tiny checkpoints carry a vision tower; its bytes are in the total, not in a token's reads."""
    model, _ = _model("qwen3_5", tie_word_embeddings=True)
    tower = image_tower_bytes(model)
    assert tower > 0
    assert read_bytes_per_token(model, None) == total_bytes(model) - tower
