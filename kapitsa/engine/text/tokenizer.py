"""The model's tokenizer: `tokenizers` for text <-> ids, plus what the checkpoint says about
special tokens, end-of-sequence ids and the chat template."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer

from kapitsa.engine.text.chat_template import ChatTemplate, pick_template
from kapitsa.engine.text.detokenizer import IncrementalDetokenizer
from kapitsa.errors import CheckpointError, InvalidRequest

# the named special tokens transformers passes to every chat template (its SPECIAL_TOKENS_ATTRIBUTES)
_SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {path.name} in {path.parent}: {e}") from e
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} does not hold a JSON object")
    return value


def _token_text(value: Any) -> str | None:
    """tokenizer_config writes special tokens as strings or as {"content": ...} objects."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _as_ids(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _templates_in(folder: Path, tokenizer_config: Mapping[str, Any]) -> dict[str, str]:
    """Named chat templates: `additional_chat_templates/<name>.jinja` (transformers saves every template
    but the default there), plus the default from chat_template.jinja, else chat_template.json, else
    tokenizer_config (a string, or a list of {name, template})."""
    extra = folder / "additional_chat_templates"
    named = (
        {p.stem: p.read_text(encoding="utf-8") for p in sorted(extra.glob("*.jinja"))}
        if extra.is_dir()
        else {}
    )
    if (folder / "chat_template.jinja").is_file():
        return {**named, "default": (folder / "chat_template.jinja").read_text(encoding="utf-8")}
    if (folder / "chat_template.json").is_file():
        source = _read_json(folder / "chat_template.json").get("chat_template")
    else:
        source = tokenizer_config.get("chat_template")
    if isinstance(source, str):
        return {**named, "default": source}
    if isinstance(source, list):  # [{"name": "default", "template": "..."}, {"name": "tool_use", ...}]
        listed = {
            t["name"]: t["template"]
            for t in source
            if isinstance(t, dict) and "name" in t and "template" in t
        }
        return {**listed, **named}
    return named


def _special_tokens(folder: Path, tokenizer_config: Mapping[str, Any]) -> dict[str, str | None]:
    """The named special tokens. A tokenizer_config.json without `added_tokens_decoder` predates
    transformers 4.34, and its special_tokens_map.json names them (transformers reads it only then)."""
    names = {k: _token_text(tokenizer_config.get(k)) for k in _SPECIAL_TOKEN_KEYS}
    legacy = folder / "special_tokens_map.json"
    if "added_tokens_decoder" not in tokenizer_config and legacy.is_file():
        mapped = _read_json(legacy)
        names.update({k: text for k in _SPECIAL_TOKEN_KEYS if (text := _token_text(mapped.get(k)))})
    return names


def _config_eos_ids(config: Mapping[str, Any]) -> list[int]:
    """config.json's `eos_token_id`, and its text model's (`text_config`, which may be null)."""
    nested = config.get("text_config")
    return _as_ids(config.get("eos_token_id")) + (
        _as_ids(nested.get("eos_token_id")) if isinstance(nested, dict) else []
    )


class Tokenizer:
    """Text <-> token ids, end-of-sequence ids, and the chat template of one model."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        special_tokens: Mapping[str, str | None] | None = None,
        eos_token_ids: Iterable[int] = (),
        chat_templates: Mapping[str, str] | None = None,
    ) -> None:
        self.backend = backend
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        eos = set(eos_token_ids)
        if (eos_text := self.special_tokens.get("eos_token")) and (
            eos_id := backend.token_to_id(eos_text)
        ) is not None:
            eos.add(eos_id)
        self.eos_token_ids: tuple[int, ...] = tuple(sorted(eos))
        self._templates = {name: ChatTemplate(src, special_tokens=self.special_tokens)
                           for name, src in (chat_templates or {}).items()}  # fmt: skip
        added = backend.get_added_tokens_decoder()
        self.special_token_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)

    @classmethod
    def from_folder(cls, folder: str | Path, config: Mapping[str, Any] | None = None) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json, the chat template and generation_config.json.

        Args:
            folder: the checkpoint folder.
            config: the model's config.json (its `eos_token_id` counts too; `text_config` is looked into).
        Raises:
            CheckpointError: tokenizer.json is missing or unreadable, or the chat template is broken.
        """
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"{folder} has no tokenizer.json (kapitsa needs the fast tokenizer file)")
        try:
            backend = BackendTokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises plain Exceptions with its parse message
            raise CheckpointError(f"cannot read {path}: {e}") from e
        tok_config = (
            _read_json(folder / "tokenizer_config.json")
            if (folder / "tokenizer_config.json").is_file()
            else {}
        )
        gen_config = (
            _read_json(folder / "generation_config.json")
            if (folder / "generation_config.json").is_file()
            else {}
        )
        eos = _config_eos_ids(config or {}) + _as_ids(gen_config.get("eos_token_id"))
        return cls(
            backend,
            special_tokens=_special_tokens(folder, tok_config),
            eos_token_ids=eos,
            chat_templates=_templates_in(folder, tok_config),
        )

    # -- text <-> ids ------------------------------------------------------------------------
    def max_token_bytes(self) -> int | None:
        """The most UTF-8 bytes one token decodes to (a prompt of N bytes is at least N / this many
        tokens), or None where the vocabulary cannot be decoded token by token."""
        try:
            ids = [[i] for i in range(self.backend.get_vocab_size())]
            texts = self.backend.decode_batch(ids, skip_special_tokens=True)
        except Exception:  # noqa: BLE001 - any backend failure only loses the cheap size bound
            return None
        return max((len(t.encode("utf-8", "surrogatepass")) for t in texts), default=0) or None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special-token strings in it become their ids (as in transformers)."""
        # The batch call releases the GIL while Rust works (`encode` holds it): a long prompt tokenized
        # on a worker thread then leaves the event loop free. The fast variant skips unused offsets.
        encode_batch = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
        return encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    @property
    def bos_token_id(self) -> int | None:
        bos = self.special_tokens.get("bos_token")
        return self.backend.token_to_id(bos) if bos else None

    @property
    def pad_token_id(self) -> int | None:
        pad = self.special_tokens.get("pad_token")
        return self.backend.token_to_id(pad) if pad else None

    def detokenizer(self, *, skip_special_tokens: bool = False) -> IncrementalDetokenizer:
        """A fresh streaming detokenizer over this vocabulary."""
        return IncrementalDetokenizer(lambda ids: self.decode(ids, skip_special_tokens=skip_special_tokens))

    # -- chat --------------------------------------------------------------------------------
    @property
    def has_chat_template(self) -> bool:
        return bool(self._templates)

    @property
    def chat_template(self) -> str | None:
        """Source of the default chat template."""
        template = pick_template({k: t.source for k, t in self._templates.items()}, has_tools=False)
        return template

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render a conversation with the model's template (Hugging Face semantics).

        Args:
            messages: chat messages as the OpenAI / Hugging Face format has them.
            tools: JSON-schema tool definitions, or None.
            add_generation_prompt: end with the opening of the assistant's turn.
            template_kwargs: template variables such as `enable_thinking=False`.
        Returns:
            The prompt text; encode it with `encode` (no extra special tokens).
        Raises:
            InvalidRequest: no chat template, or the template rejects the conversation.
        """
        if not self._templates:
            raise InvalidRequest("this model has no chat template; send a raw prompt instead")
        name = "tool_use" if tools and "tool_use" in self._templates else "default"
        template = self._templates.get(name) or next(iter(self._templates.values()))
        return template.render(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, **template_kwargs
        )

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        """`apply_chat_template` then `encode` (the template carries any BOS itself)."""
        text = self.apply_chat_template(messages, tools, add_generation_prompt, **template_kwargs)
        return self.encode(text)
