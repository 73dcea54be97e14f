"""Stand-ins for engine tests: a byte-level tokenizer with a ChatML template, tiny random models.

Import it as `engine_standins` (a unique name: `conftest` clashes across test folders)."""

from __future__ import annotations

import codecs
import json
import re
from typing import Any

import mlx.core as mx

EOS = 1  # "<|im_end|>"
OFFSET = 3  # ids 0..2 are special; byte b is id b + 3
SPECIAL = {"<|im_end|>": 1, "<|im_start|>": 2}
_SPLIT = re.compile("(" + "|".join(re.escape(t) for t in SPECIAL) + ")")


class ByteDetokenizer:
    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def add(self, token_id: int) -> str:
        if token_id < OFFSET or token_id >= OFFSET + 256:
            return ""
        return self._decoder.decode(bytes([token_id - OFFSET]))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


class ByteTokenizer:
    """Bytes as tokens, ChatML markers as single special tokens (as real tokenizers have them)."""

    eos_token_ids = frozenset({EOS})

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for part in _SPLIT.split(text):
            ids += [SPECIAL[part]] if part in SPECIAL else [b + OFFSET for b in part.encode()]
        return ids

    def decode(self, ids: list[int]) -> str:
        return bytes(i - OFFSET for i in ids if OFFSET <= i < OFFSET + 256).decode(errors="replace")

    def detokenizer(self) -> ByteDetokenizer:
        return ByteDetokenizer()

    def apply_chat_template(
        self, messages: list[dict[str, Any]], *, tools=None, add_generation_prompt=True, **kwargs: Any
    ) -> str:
        out = []
        if tools:
            out.append(f"<|im_start|>system\n{json.dumps(tools)}<|im_end|>\n")
        for m in messages:
            out.append(f"<|im_start|>{m['role']}\n{m.get('content') or ''}<|im_end|>\n")
        if add_generation_prompt:
            out.append("<|im_start|>assistant\n")
        return "".join(out)


def tiny_model(kind: str):
    """A tiny random model of `kind`, float32, deterministic."""
    from kapitsa.engine.models import get_model_module
    from kapitsa.testing.tiny import tiny_config

    config = tiny_config(kind)
    module = get_model_module(config["model_type"])
    mx.random.seed(0)
    model = module.Model(module.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    return model
