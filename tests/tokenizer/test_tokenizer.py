"""Tokenizer over a checkpoint folder, and the streaming detokenizer."""

from __future__ import annotations

import json

import pytest

from kapitsa.engine.text.tokenizer import Tokenizer
from kapitsa.errors import CheckpointError, InvalidRequest
from kapitsa.testing.tiny import write_tiny_checkpoint


@pytest.fixture(scope="module")
def qwen_folder(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("qwen"), "qwen3_5")


@pytest.fixture(scope="module")
def nemotron_folder(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("nemo"), "nemotron_h")


def _config(folder):
    return json.loads((folder / "config.json").read_text())


def test_eos_ids_come_from_config_generation_config_and_tokenizer_config(qwen_folder, nemotron_folder):
    qwen = Tokenizer.from_folder(qwen_folder, _config(qwen_folder))
    assert qwen.eos_token_ids == tuple(
        sorted({qwen.token_to_id("<|im_end|>"), qwen.token_to_id("<|endoftext|>")})
    )
    nemo = Tokenizer.from_folder(nemotron_folder, _config(nemotron_folder))
    assert nemo.eos_token_ids == (2, 11)
    assert nemo.bos_token_id == 1


def test_encode_decode_round_trip_with_special_tokens(qwen_folder):
    tok = Tokenizer.from_folder(qwen_folder)
    text = "<|im_start|>user\nprint('héllo') 日本語 🚀<|im_end|>"
    ids = tok.encode(text)
    assert ids[0] == tok.token_to_id("<|im_start|>")
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == "user\nprint('héllo') 日本語 🚀"
    assert tok.token_to_id("<|im_end|>") in tok.special_token_ids
    assert tok.token_to_id("<think>") not in tok.special_token_ids  # Qwen: an ordinary added token


def test_encode_chat_matches_encoding_the_rendered_text(qwen_folder):
    tok = Tokenizer.from_folder(qwen_folder)
    messages = [{"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(messages, enable_thinking=False)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert tok.encode_chat(messages, enable_thinking=False) == tok.encode(text)


def test_chat_template_file_takes_precedence(tmp_path):
    folder = write_tiny_checkpoint(tmp_path, "qwen3_5", chat_template_file=True)
    assert "chat_template" not in json.loads((folder / "tokenizer_config.json").read_text())
    assert (
        Tokenizer.from_folder(folder)
        .apply_chat_template([{"role": "user", "content": "x"}])
        .endswith("<think>\n")
    )


def test_named_templates_pick_tool_use_when_tools_are_given(qwen_folder, tmp_path):
    folder = write_tiny_checkpoint(tmp_path, "qwen3_5")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "default", "template": "plain"},
        {"name": "tool_use", "template": "tools"},
    ]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_folder(folder)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "plain"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], tools=[{"name": "f"}]) == "tools"


def test_missing_or_corrupt_tokenizer_is_a_checkpoint_error(tmp_path):
    folder = write_tiny_checkpoint(tmp_path, "qwen3_5")
    (folder / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        Tokenizer.from_folder(folder)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="no tokenizer.json"):
        Tokenizer.from_folder(folder)


def test_no_template_means_invalid_request_for_chat(tmp_path):
    folder = write_tiny_checkpoint(tmp_path, "qwen3_5")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_folder(folder)
    assert not tok.has_chat_template
    with pytest.raises(InvalidRequest, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


TEXTS = ["héllo wörld", "日本語のテキスト", "emoji 🙂🚀👍🏽 mix", "code:\n    return x  # é", "→≤≥∑ ü"]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("family_folder", ["qwen_folder", "nemotron_folder"])
def test_detokenizer_streams_whole_characters_only(text, family_folder, request):
    tok = Tokenizer.from_folder(request.getfixturevalue(family_folder))
    ids = tok.encode(text)
    detok = tok.detokenizer()
    pieces = [detok.add(i) for i in ids]
    pieces.append(detok.flush())
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text == detok.text


def test_detokenizer_holds_a_split_character_until_it_completes(qwen_folder):
    tok = Tokenizer.from_folder(qwen_folder)
    ids = tok.encode("🙂")
    assert len(ids) > 1, "the emoji must be split over byte tokens for this test"
    detok = tok.detokenizer()
    assert [detok.add(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add(ids[-1]) == "🙂"


def test_detokenizer_flushes_an_unfinished_character_as_replacement(qwen_folder):
    tok = Tokenizer.from_folder(qwen_folder)
    ids = tok.encode("a🙂")
    detok = tok.detokenizer()
    assert detok.add(ids[:-1]) == "a"
    assert detok.flush() == "\ufffd"


def test_detokenizer_can_skip_special_tokens(qwen_folder):
    tok = Tokenizer.from_folder(qwen_folder)
    ids = tok.encode("ok<|im_end|>")
    detok = tok.detokenizer(skip_special_tokens=True)
    assert "".join(detok.add(i) for i in ids) + detok.flush() == "ok"
