"""What a checkpoint folder's tokenizer files say, read the way transformers reads them: named
templates under additional_chat_templates/, the legacy special_tokens_map.json, every named special
token the templates may use, and nested model configs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kapitsa.engine.text.tokenizer import Tokenizer
from kapitsa.testing.tiny import write_tiny_checkpoint

transformers = pytest.importorskip("transformers")

MESSAGES = [{"role": "user", "content": "x"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def _reference(folder: Path):
    return transformers.AutoTokenizer.from_pretrained(str(folder))


def _edit_config(folder: Path, **changes: object) -> None:
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def test_additional_chat_templates_are_named_templates(tmp_path: Path) -> None:
    folder = write_tiny_checkpoint(tmp_path, "qwen3_5", chat_template_file=True)
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "tool_use.jinja").write_text(
        "{% for t in tools %}{{ t.function.name }}{% endfor %}|{{ messages[0].content }}"
    )
    ours, theirs = Tokenizer.from_folder(folder), _reference(folder)
    for tools in (None, TOOLS):
        expected = theirs.apply_chat_template(
            MESSAGES, tools=tools, tokenize=False, add_generation_prompt=True
        )
        assert ours.apply_chat_template(MESSAGES, tools=tools) == expected
    assert ours.apply_chat_template(MESSAGES, tools=TOOLS) == "f|x"


def test_additional_templates_keep_the_tokenizer_config_default(tmp_path: Path) -> None:
    folder = write_tiny_checkpoint(tmp_path, "qwen3_5")
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "tool_use.jinja").write_text("tools")
    tok = Tokenizer.from_folder(folder)
    assert tok.apply_chat_template(MESSAGES, tools=TOOLS) == "tools"
    assert tok.apply_chat_template(MESSAGES).startswith("<|im_start|>user\nx")


def test_legacy_special_tokens_map_names_the_special_tokens(tmp_path: Path) -> None:
    folder = write_tiny_checkpoint(tmp_path, "qwen3_5")
    # a tokenizer_config.json from before added_tokens_decoder: the names live in special_tokens_map.json
    _edit_config(folder, added_tokens_decoder=None, eos_token=None, chat_template="{{ eos_token }}")
    (folder / "special_tokens_map.json").write_text(
        json.dumps(
            {
                "eos_token": {
                    "content": "<|endoftext|>",
                    "lstrip": False,
                    "normalized": False,
                    "rstrip": False,
                    "single_word": False,
                }
            }
        )  # fmt: skip
    )
    ours, theirs = Tokenizer.from_folder(folder), _reference(folder)
    assert theirs.eos_token == "<|endoftext|>"
    assert ours.apply_chat_template(MESSAGES) == "<|endoftext|>"
    assert ours.token_to_id("<|endoftext|>") in ours.eos_token_ids


def test_every_named_special_token_reaches_the_template(tmp_path: Path) -> None:
    folder = write_tiny_checkpoint(tmp_path, "qwen3_5")
    template = "{{ sep_token }},{{ cls_token }},{{ mask_token }},{{ eos_token }}"
    _edit_config(
        folder,
        sep_token="<|im_end|>",
        cls_token="<|im_start|>",
        mask_token="<|endoftext|>",
        chat_template=template,
    )
    expected = _reference(folder).apply_chat_template(MESSAGES, tokenize=False)
    assert Tokenizer.from_folder(folder).apply_chat_template(MESSAGES) == expected
    assert expected == "<|im_end|>,<|im_start|>,<|endoftext|>,<|im_end|>"


@pytest.mark.parametrize(
    "config", [{"text_config": None, "eos_token_id": 3}, {"text_config": {"eos_token_id": [3]}}]
)
def test_a_nested_text_config_may_be_null_or_carry_the_eos(tmp_path: Path, config: dict) -> None:
    folder = write_tiny_checkpoint(tmp_path, "qwen3_5")
    assert 3 in Tokenizer.from_folder(folder, config).eos_token_ids
