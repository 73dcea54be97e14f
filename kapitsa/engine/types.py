"""Values that cross the `EngineClient` boundary: requests in, events and stats out.

Plain frozen dataclasses (no pydantic): the server translates its wire models into these.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length", "abort", "error", "tool_calls"]
ConstraintKind = Literal["json_schema", "lark", "regex"]


@dataclass(slots=True, frozen=True)
class Constraint:
    """A grammar the output must follow, enforced on every token (kapitsa.engine.text.constraint).

    `json_schema`: `value` is the schema as JSON text (`{"type": "object"}`: any JSON object);
    `lark`: an llguidance Lark grammar, which may embed schemas as `%json {...}`; `regex`: a regex.
    """

    kind: ConstraintKind
    value: str


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """How to pick tokens. `temperature == 0` means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None  # any integer; the sampler reduces it modulo 2**64 (what `mx.random.key` takes)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    max_tokens: int | None = None  # None = up to the context window
    logprobs: int | None = None  # number of top alternatives to report per token (0 = only the chosen)
    ignore_eos: bool = False
    # Hugging Face's `exponential_decay_length_penalty` (start, factor): past `start` generated tokens
    # the end-of-sequence logits grow by |logit| * (factor ** (n - start) - 1), so answers end
    eos_decay: tuple[int, float] | None = None
    constraint: Constraint | None = None  # the grammar the output follows (None: free text)
    # (most tokens, the token that ends reasoning): an output that starts in reasoning and is still
    # there after that many tokens gets the closing token next (Anthropic's `thinking.budget_tokens`)
    reasoning_budget: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError("min_p must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise ValueError("repetition_penalty must be > 0")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError("logprobs must be between 0 and 20")
        if self.eos_decay is not None and (self.eos_decay[0] < 0 or self.eos_decay[1] < 1.0):
            raise ValueError("eos_decay needs a start >= 0 and a factor >= 1")
        if self.reasoning_budget is not None and min(self.reasoning_budget) < 0:
            raise ValueError("reasoning_budget needs a token count and a token id, both >= 0")


MAX_CHOICES = 16  # most choices (`n`) one request may ask for

MAX_CHARS_PER_TOKEN = 64
"""The longest token's size where the model does not report its own (`ModelInfo.max_token_bytes`). A
token decodes to at most that many bytes, and a character is at least one byte, so a text of more
than `context_length * longest` characters cannot fit a window: the server refuses such a prompt
without tokenizing it, and the engine tokenizes no more of a prediction."""


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex[:16]}"


@dataclass(slots=True, frozen=True)
class GenerationRequest:
    """One generation. Exactly one of `prompt`, `prompt_token_ids` or `messages` is set.

    `messages`/`tools` are rendered by the model's own chat template (Hugging Face semantics);
    `chat_template_kwargs` carries extras such as `enable_thinking`. `images` are encoded image
    files (PNG, JPEG...), one per `{"type": "image"}` content part of `messages`, in order.
    `continue_final_message` leaves the final assistant message open, so the output continues its text
    (Hugging Face's `continue_final_message`: a prefilled answer); `add_generation_prompt` then has no say.
    `prediction` is text the output is expected to repeat much of (OpenAI's Predicted Outputs, e.g. a
    file being edited): a speculating engine drafts from it as well as from the context.
    """

    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    tools: tuple[dict[str, Any], ...] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: tuple[tuple[str, Any], ...] = ()
    sampling: SamplingParams = field(default_factory=SamplingParams)
    model: str | None = None  # None = the engine's default model
    request_id: str = field(default_factory=new_request_id)
    priority: int = 0
    # Choices from one prompt: its prefill runs once, then each choice decodes on a fork of its state
    # (seeded requests use seed + index); events carry the choice's `index`.
    n: int = 1
    images: tuple[bytes, ...] = ()
    prediction: str | None = None

    def __post_init__(self) -> None:
        given = [x is not None for x in (self.prompt, self.prompt_token_ids, self.messages)]
        if sum(given) != 1:
            raise ValueError("exactly one of prompt, prompt_token_ids or messages must be given")
        if self.images and self.messages is None:
            raise ValueError("images go with messages (their content parts place them)")
        if self.continue_final_message and self.messages is None:
            raise ValueError("continue_final_message goes with messages (it continues the last one)")
        if not 1 <= self.n <= MAX_CHOICES:
            raise ValueError(f"n must be between 1 and {MAX_CHOICES}")


@dataclass(slots=True, frozen=True)
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    top: tuple[tuple[int, str, float], ...] = ()  # (id, text, logprob) alternatives, best first


@dataclass(slots=True, frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (not recomputed)
    # Prompt tokens that are now cached and were not before this request: from `cached_tokens` to the
    # deepest prompt checkpoint this request made (Anthropic's cache writes; the rest is uncached input)
    cache_write_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0
    # of those drafts, the ones copied from the request's `prediction` (OpenAI's accepted and
    # rejected prediction tokens): 0 without a prediction, or where no drafter reads it
    prediction_tokens_proposed: int = 0
    prediction_tokens_accepted: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True, frozen=True)
class TokenEvent:
    """New tokens and the text they complete. `text` may be empty while bytes or a possible stop
    string are held back; the held text arrives in a later event."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] | None = None
    index: int = 0  # the choice (0 <= index < request.n)


@dataclass(slots=True, frozen=True)
class PrefillProgressEvent:
    """Prompt processing advanced: sent once when the prefill starts (after the prefix-cache lookup, so
    servers can report the prompt's size and cached part before the answer), then between chunks."""

    request_id: str
    processed_tokens: int
    total_tokens: int
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache


@dataclass(slots=True, frozen=True)
class FinishEvent:
    request_id: str
    finish_reason: FinishReason
    usage: Usage
    stop_sequence: str | None = None  # the stop string that ended the output, if any
    index: int = 0  # the choice; a request with n choices ends after n FinishEvents (or one ErrorEvent)


@dataclass(slots=True, frozen=True)
class ErrorEvent:
    """An error travels as a value; consumers re-raise `error` where they handle it."""

    request_id: str
    error: Exception


Event = TokenEvent | PrefillProgressEvent | FinishEvent | ErrorEvent


@dataclass(slots=True, frozen=True)
class ThinkingPrompt:
    """Whether the chat template's generation prompt ends inside an open `<think>`, for each value of
    `enable_thinking` (unset, True, False): then the output starts in reasoning, with no open tag."""

    by_default: bool = False
    when_enabled: bool = False
    when_disabled: bool = False
    close_token: int | None = None  # `</think>`'s id, when it is one token (what a reasoning budget forces)

    def starts_in_reasoning(self, enable_thinking: bool | None) -> bool:
        if enable_thinking is None:
            return self.by_default
        return self.when_enabled if enable_thinking else self.when_disabled


@dataclass(slots=True, frozen=True)
class ModelInfo:
    id: str
    family: str  # "qwen3_5" | "nemotron_h" | "fake"
    context_length: int
    max_output_tokens: int
    tool_call_format: str = "hermes"  # "qwen3_coder" | "hermes" | "nemotron"
    supports_thinking: bool = False  # the template can render reasoning (`<think>`, `enable_thinking`)
    thinking_prompt: ThinkingPrompt = field(default_factory=ThinkingPrompt)
    path: str | None = None
    quantization: str | None = None
    vocab_size: int | None = None  # rows of the model's embedding: token ids must lie in [0, vocab_size)
    eos_decay: tuple[int, float] | None = None  # the checkpoint's default SamplingParams.eos_decay
    max_token_bytes: int | None = None  # the longest token's UTF-8 bytes (None: unknown)
    vision: bool = False  # the model reads images in the prompt


@dataclass(slots=True, frozen=True)
class EngineStats:
    alive: bool = True
    model: str | None = None
    prefill_tok_s: float = 0.0
    decode_tok_s: float = 0.0
    active_requests: int = 0
    queued_requests: int = 0
    batch_size: int = 0
    prompt_tokens_cached: int = 0
    prompt_tokens_computed: int = 0
    generated_tokens: int = 0
    checkpoints_in_memory: int = 0
    checkpoint_bytes_in_memory: int = 0
    checkpoints_on_disk: int = 0
    checkpoint_bytes_on_disk: int = 0
    corrupt_checkpoints_deleted: int = 0  # disk files that failed their checksum or shape check
    conversations_in_memory: int = 0  # prefix-cache conversations with state in memory
    resident_conversations: int = 0  # of those, the ones whose newest checkpoints eviction spares
    resident_bytes: int = 0  # their KV and newest checkpoints
    checkpoints_loaded_from_disk: int = 0  # disk-tier files loaded, by lookups and idle preloads
    checkpoints_preloaded: int = 0  # of those, loaded back by an idle engine before a request asked
    checkpoints_read_ahead: int = 0  # files read off the engine thread before the lookup that took them
    memory_in_use_bytes: int = 0
    memory_peak_bytes: int = 0
    memory_limit_bytes: int = 0
    speculative: str = "none"
    draft_acceptance_rate: float = 0.0
    speculative_verifies: int = 0  # verify forwards run (each for the whole batch)
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0
    speculative_pipeline_exits: int = 0  # times drafts took the engine out of pipelined plain steps
    tokens_per_step: float = 0.0
    requests_finished: int = 0
    requests_failed: int = 0
    requests_sent_back: int = 0  # rows an out-of-memory batch sent back to the queue (send_back.py)
    warm_batches_pending: int = 0  # batch sizes and prefill chunks still to warm (runner/warmup.py)
    warmup_seconds: float = 0.0  # spent warming them so far

    @property
    def cache_hit_rate(self) -> float:
        total = self.prompt_tokens_cached + self.prompt_tokens_computed
        return self.prompt_tokens_cached / total if total else 0.0
