"""tiny.py without transformers: determinism, sharding, dtypes, tokenizer files."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tokenizers import Tokenizer

from kapitsa.testing.tiny import KINDS, TINY_VOCAB_SIZE, write_tiny_checkpoint


def _read_all(folder):
    from safetensors.numpy import load_file

    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def test_same_seed_same_bytes_other_seed_other_values(tmp_path):
    a = write_tiny_checkpoint(tmp_path / "a", "qwen3_5", seed=3)
    b = write_tiny_checkpoint(tmp_path / "b", "qwen3_5", seed=3)
    c = write_tiny_checkpoint(tmp_path / "c", "qwen3_5", seed=4)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_sharded_checkpoint_has_an_index_covering_every_tensor(tmp_path):
    single = _read_all(write_tiny_checkpoint(tmp_path / "one", "nemotron_h"))
    folder = write_tiny_checkpoint(tmp_path / "three", "nemotron_h", shards=3)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [
        f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)
    ]
    sharded = _read_all(folder)
    assert set(index["weight_map"]) == set(sharded) == set(single)
    for name in single:
        np.testing.assert_array_equal(single[name], sharded[name])


def test_bfloat16_checkpoint_holds_the_rounded_float32_values(tmp_path):
    import mlx.core as mx

    f32 = write_tiny_checkpoint(tmp_path / "f32", "qwen3_next")
    bf16 = write_tiny_checkpoint(tmp_path / "bf16", "qwen3_next", dtype="bfloat16")
    name = "model.layers.3.self_attn.q_proj.weight"
    exact = mx.load(str(f32 / "model.safetensors"))[name]
    stored = mx.load(str(bf16 / "model.safetensors"))[name]
    assert stored.dtype == mx.bfloat16
    assert mx.array_equal(exact.astype(mx.bfloat16), stored).item()
    assert json.loads((bf16 / "config.json").read_text())["torch_dtype"] == "bfloat16"


@pytest.mark.parametrize("kind", KINDS)
def test_config_is_in_the_published_shape(tmp_path, kind):
    config = json.loads((write_tiny_checkpoint(tmp_path, kind) / "config.json").read_text())
    text = config.get("text_config", config)
    assert text["vocab_size"] == TINY_VOCAB_SIZE
    assert text["hidden_size"] <= 64
    if kind.startswith("qwen3_5"):
        assert config["model_type"] == kind and text["model_type"] == f"{kind}_text"
        assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
        assert "vision_config" in config
    elif kind == "qwen3_next":
        assert "layer_types" not in config and config["full_attention_interval"] == 4
    else:
        assert set(config["hybrid_override_pattern"]) == (
            {"M", "E", "*"} if kind == "nemotron_h" else {"M", "-", "*"}
        )


def test_overrides_reach_the_text_config_and_the_tensors(tmp_path):
    folder = write_tiny_checkpoint(
        tmp_path, "qwen3_5", hidden_size=32, num_hidden_layers=8, tie_word_embeddings=True
    )
    config = json.loads((folder / "config.json").read_text())
    assert config["text_config"]["hidden_size"] == 32
    assert config["text_config"]["layer_types"].count("full_attention") == 2
    weights = _read_all(folder)
    assert "lm_head.weight" not in weights
    assert weights["model.language_model.embed_tokens.weight"].shape == (TINY_VOCAB_SIZE, 32)


@pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h"])
def test_tokenizer_round_trips_text_and_knows_the_chat_tokens(tmp_path, kind):
    folder = write_tiny_checkpoint(tmp_path, kind)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert tok.get_vocab_size() <= TINY_VOCAB_SIZE
    text = "<|im_start|>user\nHi 日本 🙂<|im_end|>\n<think>\nok</think>"
    ids = tok.encode(text).ids
    assert tok.decode(ids, skip_special_tokens=False) == text
    for special in ("<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"):
        assert tok.token_to_id(special) in ids or special in ("<tool_call>", "</tool_call>")
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    assert "enable_thinking" in tokenizer_config["chat_template"]
    generation = json.loads((folder / "generation_config.json").read_text())
    assert tok.token_to_id("<|im_end|>") in generation["eos_token_id"]


def test_unknown_kind_is_refused(tmp_path):
    with pytest.raises(ValueError, match="qwen3_5_moe"):
        write_tiny_checkpoint(tmp_path, "llama")


def test_nemotron_layers_block_type_spelling(tmp_path):
    from safetensors.numpy import load_file

    types = ["mamba", "moe", "attention", "mlp"]
    folder = write_tiny_checkpoint(tmp_path, "nemotron_h", layers_block_type=types)
    config = json.loads((folder / "config.json").read_text())
    assert config["layers_block_type"] == types and "hybrid_override_pattern" not in config
    names = set(load_file(str(folder / "model.safetensors")))
    assert (
        "backbone.layers.3.mixer.up_proj.weight" in names and "backbone.layers.1.mixer.gate.weight" in names
    )
