"""From a `GenerationRequest` to prompt token ids plus the positions worth checkpointing.

Message boundaries come from rendering the chat template on prefixes of the conversation: the
system part (shared by every conversation with the same system prompt and tools) and the end of the
last message before the generation prompt (where the next turn diverges when the template re-renders
the assistant's reply differently, e.g. dropping its reasoning).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kapitsa.engine.runner.sequence import Boundary
from kapitsa.engine.types import MAX_CHARS_PER_TOKEN, GenerationRequest
from kapitsa.engine.vision.media import PromptMedia
from kapitsa.errors import InvalidRequest, KapitsaError

Encode = Callable[[str], list[int]]


class PromptTokenizer(Protocol):
    """What the engine needs from a tokenizer (kapitsa.engine.text.tokenizer provides it)."""

    def encode(self, text: str) -> list[int]: ...

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str: ...


@dataclass(slots=True, frozen=True)
class PreparedPrompt:
    ids: list[int]
    boundaries: list[Boundary]
    media: PromptMedia | None = None  # the prompt's images, when it has any


class ImagePrompter(Protocol):
    """Expands image placeholders and preprocesses images (kapitsa.engine.vision provides it)."""

    def expand(self, ids: list[int], images: Sequence[bytes]) -> tuple[list[int], PromptMedia]: ...


def prepare_prompt(
    tokenizer: PromptTokenizer,
    request: GenerationRequest,
    *,
    encode: Encode | None = None,
    images: ImagePrompter | None = None,
) -> PreparedPrompt:
    """Render and tokenize a request. Raises `InvalidRequest` for prompts that cannot be rendered,
    and for images sent to a model without `images` (a text-only model).

    `encode` replaces `tokenizer.encode` (e.g. a caching `PromptEncoder`); it must give the same ids.
    """
    encode = encode or tokenizer.encode
    if request.images:
        if images is None:
            raise InvalidRequest("the served model reads text only; it cannot take images")
        return _prepare_with_images(tokenizer, request, encode, images)
    if request.prompt_token_ids is not None:
        return PreparedPrompt(list(request.prompt_token_ids), [])
    if request.prompt is not None:
        return PreparedPrompt(encode(request.prompt), [])
    chat = conversation(request)
    ids = encode(chat.text(tokenizer, request))
    return PreparedPrompt(ids, message_boundaries(tokenizer, request, chat, ids, encode=encode))


def prediction_ids(encode: Encode, text: str, *, window: int, longest: int | None) -> tuple[int, ...]:
    """A predicted output's tokens, as far as an answer could repeat them: no answer is longer than
    the `window`, so no more of the prediction is kept, and no more text is tokenized than the
    window's worth of the longest tokens (`longest` characters; a 30 MB prediction is not tokenized
    whole, as a prompt that long is refused before it is)."""
    return tuple(encode(text[: window * (longest or MAX_CHARS_PER_TOKEN)])[:window])


def _prepare_with_images(
    tokenizer: PromptTokenizer, request: GenerationRequest, encode: Encode, images: ImagePrompter
) -> PreparedPrompt:
    chat = conversation(request)
    rendered = encode(chat.text(tokenizer, request))
    boundaries = message_boundaries(tokenizer, request, chat, rendered, encode=encode)
    ids, media = images.expand(rendered, request.images)
    moved = [Boundary(media.expanded(b.pos), b.kind) for b in boundaries]
    return PreparedPrompt(ids, moved, media)


def _render(
    tokenizer: PromptTokenizer,
    request: GenerationRequest,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages,
            tools=[dict(t) for t in request.tools] if request.tools else None,
            add_generation_prompt=add_generation_prompt,
            **dict(request.chat_template_kwargs),
        )
    except KapitsaError:
        raise
    except Exception as err:  # noqa: BLE001 - jinja raises all sorts; the template's message is the useful part
        raise InvalidRequest(f"the chat template could not render these messages: {err}") from err


@dataclass(slots=True, frozen=True)
class Conversation:
    """The messages a request renders, and how its prompt ends: with the template's generation prompt
    (`add_generation_prompt`), after the last message, or inside the last one (`open_final`: a
    continued assistant message, cut right after its text as Hugging Face's `continue_final_message`
    cuts it)."""

    messages: list[dict[str, Any]]
    add_generation_prompt: bool
    open_final: bool = False

    def text(self, tokenizer: PromptTokenizer, request: GenerationRequest) -> str:
        if not self.open_final:
            return _render(tokenizer, request, self.messages, self.add_generation_prompt)
        tagged = [*self.messages[:-1], _tagged(self.messages[-1])]
        rendered = _render(tokenizer, request, tagged, self.add_generation_prompt)
        return _cut_at_tag(rendered, final_text(self.messages[-1]))

    @property
    def closed_part(self) -> list[dict[str, Any]]:
        """The messages whose turns are complete (what the next turn shares)."""
        return self.messages[:-1] if self.open_final else self.messages


def conversation(request: GenerationRequest) -> Conversation:
    """What `request` renders. Raises `InvalidRequest` for a continuation the conversation can't make."""
    messages = [dict(m) for m in request.messages or ()]
    if not request.continue_final_message:
        return Conversation(messages, request.add_generation_prompt)
    if not messages or messages[-1].get("role") != "assistant":
        raise InvalidRequest("only an assistant message can be continued: the conversation must end with one")
    if messages[-1].get("tool_calls"):
        raise InvalidRequest("a final assistant message with tool calls cannot be continued")
    if not final_text(messages[-1]).strip():
        # nothing to continue from: the model writes the turn afresh
        return Conversation(messages[:-1], add_generation_prompt=True)
    return Conversation(messages, add_generation_prompt=False, open_final=True)


def final_text(message: dict[str, Any]) -> str:
    """A message's text: its string content, or its last text part's."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    at = _last_text_part(content)
    return "" if at is None else content[at]["text"]


def _last_text_part(content: Any) -> int | None:
    parts = list(content or ())
    return next((i for i in reversed(range(len(parts))) if _is_text_part(parts[i])), None)


def _is_text_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)


# Marks where the final message's text ends, as transformers marks it: the template renders the text
# where it likes (after reasoning it re-renders, around tags it adds), and the prompt is cut at the
# mark. Searching the rendered text for the message's own text instead finds a later copy of short
# text: a prefill "<" or "end" matched inside the `<|im_end|>` the template closes the turn with.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _tagged(message: dict[str, Any]) -> dict[str, Any]:
    content = message.get("content")
    if isinstance(content, str):
        return {**message, "content": content + _CONTINUE_TAG}
    parts = list(content or ())
    at = _last_text_part(parts)
    if at is not None:
        parts[at] = {**parts[at], "text": parts[at]["text"] + _CONTINUE_TAG}
    return {**message, "content": parts}


def _cut_at_tag(rendered: str, text: str) -> str:
    """The rendered conversation cut where the final message's text ends. A template that trims the
    text trims the mark's space too: the cut then drops the spacing the template dropped."""
    at = rendered.rfind(_CONTINUE_TAG.strip())
    if at < 0 or text.strip() not in rendered:
        raise InvalidRequest(
            "the model's chat template changes the final assistant message's text, so it cannot be continued"
        )
    if rendered.startswith(_CONTINUE_TAG, at):
        return rendered[:at]
    return rendered[:at].rstrip()


def message_boundaries(
    tokenizer: PromptTokenizer,
    request: GenerationRequest,
    chat: Conversation,
    ids: list[int],
    *,
    encode: Encode | None = None,
) -> list[Boundary]:
    """Checkpoint positions: the end of the system part and the end of the last complete message."""
    encode = encode or tokenizer.encode
    messages = chat.closed_part
    out: list[Boundary] = []
    if messages and messages[0].get("role") in ("system", "developer"):
        # Templates may refuse a conversation without a user turn: render an empty one and keep the
        # common prefix, which ends just inside the first user turn (still shared by every chat).
        probe = _try_ids(tokenizer, request, [messages[0], {"role": "user", "content": ""}], encode)
        if probe is not None:
            out.append(Boundary(_common_prefix(ids, probe), "system"))
    if (chat.add_generation_prompt or chat.open_final) and messages:
        probe = _try_ids(tokenizer, request, messages, encode, add_generation_prompt=False)
        if probe is not None and ids[: len(probe)] == probe:
            out.append(Boundary(len(probe), "turn"))
    valid = {b.pos: b for b in out if 0 < b.pos < len(ids)}
    return sorted(valid.values(), key=lambda b: b.pos)


def _try_ids(
    tokenizer: PromptTokenizer,
    request: GenerationRequest,
    messages: list[dict[str, Any]],
    encode: Encode,
    *,
    add_generation_prompt: bool = False,
) -> list[int] | None:
    try:
        return encode(_render(tokenizer, request, messages, add_generation_prompt))
    except KapitsaError:
        return None


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
