"""Wire models (pydantic, `extra="ignore"`) for OpenAI chat completions and completions requests."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from kapitsa.server.settings import MAX_CHOICES, MAX_MESSAGES
from kapitsa.server.wire import WireModel


class ContentPart(WireModel):
    type: str
    text: str | None = None
    image_url: str | dict[str, Any] | None = None  # `image_url` parts: {"url": "data:..." | "file://..."}


class FunctionCallIn(WireModel):
    name: str
    arguments: str | dict[str, Any] = ""


class ToolCallIn(WireModel):
    id: str | None = None
    type: str = "function"
    function: FunctionCallIn


class ChatMessage(WireModel):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class FunctionDef(WireModel):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(WireModel):
    type: str = "function"
    function: FunctionDef | None = None


class StreamOptions(WireModel):
    include_usage: bool = False


class ResponseFormat(WireModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class SamplingFields(WireModel):
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)  # 0: the most likely token only
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    seed: int | None = None  # any integer (the engine reduces it modulo 2**64)
    stop: str | list[str] | None = None
    logit_bias: dict[str, float] | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)  # choices from one prefill
    ignore_eos: bool | None = None  # vLLM's extension: decode past the end-of-sequence tokens (benchmarks)


class Prediction(WireModel):
    """Predicted Outputs: text the answer is expected to repeat much of (drafted from, never forced)."""

    type: Literal["content"]
    content: str | list[ContentPart]


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    reasoning_effort: str | None = None
    enable_thinking: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: variables for the model's chat template
    # vLLM's prefill: the output continues the final assistant message (not with add_generation_prompt)
    continue_final_message: bool = False
    add_generation_prompt: bool | None = None
    prediction: Prediction | None = None
    # The deprecated function-calling fields: refused with the current spelling rather than dropped
    # (dropped, the model would answer as if it had no tools).
    functions: Any = None
    function_call: Any = None
    modalities: list[str] | None = None  # "text" only: no audio output here
    audio: Any = None

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and any(m != "text" for m in value):
            raise ValueError("only the `text` output modality is supported")
        return value

    @field_validator("audio")
    @classmethod
    def _no_audio(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError("audio output is not supported")
        return value

    @field_validator("functions", "function_call")
    @classmethod
    def _deprecated_functions(cls, value: Any, info: ValidationInfo) -> Any:
        if value not in (None, [], "none", "auto"):  # (those change nothing without functions)
            current = "tools" if info.field_name == "functions" else "tool_choice"
            raise ValueError(f"`{info.field_name}` is deprecated and not supported: send `{current}`")
        return value


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)  # only as many as `n`: no server-side ranking of candidates
