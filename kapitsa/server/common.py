"""Helpers every API module shares: model lookup, sampling validation, SSE framing, and request context."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import Request

from kapitsa.engine.client import EngineClient
from kapitsa.engine.types import GenerationRequest, ModelInfo, SamplingParams, TokenLogprob, Usage
from kapitsa.errors import ContextOverflow, InvalidRequest, ModelNotFound
from kapitsa.server.errors import param_error
from kapitsa.server.input_checks import check_prompt_size, logit_bias_pairs
from kapitsa.server.response_store import ResponseStore
from kapitsa.server.settings import ServerSettings
from kapitsa.server.streaming import ClientGone, GenerationRun

# Claude Code asks for these names in edge cases (haiku side queries, subagents); they mean "the default".
_ANTHROPIC_ALIASES = ("claude", "haiku", "sonnet", "opus")


@dataclass(slots=True)
class ServerState:
    client: EngineClient
    settings: ServerSettings
    responses: ResponseStore = field(default_factory=ResponseStore)


def state_of(request: Request) -> ServerState:
    return request.app.state.kapitsa  # type: ignore[no-any-return]


def resolve_model(client: EngineClient, name: str | None, *, anthropic: bool = False) -> ModelInfo:
    """The served model `name` refers to. Empty means the default; Anthropic model names map to it too."""
    models = client.models()
    if not models:
        raise ModelNotFound("No model is loaded.")
    if not name:
        return models[0]
    for info in models:
        if name == info.id or (info.path is not None and name == info.path):
            return info
    if anthropic and any(alias in name.lower() for alias in _ANTHROPIC_ALIASES):
        return models[0]
    served = ", ".join(m.id for m in models)
    raise ModelNotFound(f"The model `{name}` does not exist here. This server serves: {served}.")


def openai_sampling(
    model: ModelInfo, body: Any, *, max_tokens: int | None, logprobs: int | None
) -> SamplingParams:
    """The sampling fields chat completions and completions share (same names in both bodies)."""
    stop = [body.stop] if isinstance(body.stop, str) else body.stop
    return make_sampling(
        model,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        seed=body.seed,
        stop=stop,
        max_tokens=max_tokens,
        logprobs=logprobs,
        logit_bias=logit_bias_pairs(body.logit_bias, model) or None,
        ignore_eos=body.ignore_eos,
    )


def make_sampling(model: ModelInfo, **fields: Any) -> SamplingParams:
    """`SamplingParams` from request fields (None = default); out-of-range values become a 400."""
    given = {k: v for k, v in fields.items() if v is not None}
    if given.get("top_p") == 0:  # a nucleus of no mass holds the most likely token alone: greedy
        del given["top_p"]
        given["temperature"] = 0.0
    if "stop" in given:
        given["stop"] = tuple(given["stop"])
    try:
        return SamplingParams(**given)
    except ValueError as exc:
        raise param_error(str(exc).split(" ")[0], str(exc)) from None


def thinking_kwargs(enabled: bool | None) -> tuple[tuple[str, Any], ...]:
    return () if enabled is None else (("enable_thinking", enabled),)


async def start_run(request: Request, gen: GenerationRequest) -> GenerationRun:
    """Start generating. A `max_tokens` larger than the room the prompt leaves is clamped to that room
    (the answer then ends with a length stop): agents ask for fixed budgets (Claude Code: 32000) whatever
    the model's window. Only a prompt that does not fit by itself is an error. The in-process engine
    clamps by itself; the retry serves an `EngineClient` that refuses instead."""
    try:
        return await _start(request, gen)
    except ContextOverflow as exc:
        room = exc.max_context - exc.prompt_tokens
        requested = gen.sampling.max_tokens
        if requested is None or room < 1 or room >= requested:
            raise
        return await _start(request, replace(gen, sampling=replace(gen.sampling, max_tokens=room)))


async def _start(request: Request, gen: GenerationRequest) -> GenerationRun:
    state = state_of(request)
    check_prompt_size(gen, resolve_model(state.client, gen.model))
    run = GenerationRun(state.client, gen, request.receive, keepalive_s=state.settings.keepalive_s)
    await run.start(first_event_wait_s=state.settings.first_event_wait_s)
    return run


def sse(data: Any, event: str | None = None) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n".encode()


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SSE_COMMENT = b": keep-alive\n\n"


def now() -> int:
    return int(time.time())


def usage_cached(usage: Usage) -> int:
    return min(usage.cached_tokens, usage.prompt_tokens)


def usage_cache_written(usage: Usage) -> int:
    """Prompt tokens the engine's checkpoints wrote to the prefix cache (none of them read from it)."""
    return max(0, min(usage.cache_write_tokens, usage.prompt_tokens - usage_cached(usage)))


def flatten_text(content: Any, *, allowed: tuple[str, ...] = ("text", "input_text", "output_text")) -> str:
    """Text of a string or a list of content parts; image parts are refused (server.images reads them
    in user messages and tool results)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else getattr(part, "type", None)
        text = part.get("text") if isinstance(part, dict) else getattr(part, "text", None)
        if kind in allowed and isinstance(text, str):
            texts.append(text)
        elif kind in ("image", "image_url", "input_image"):
            raise InvalidRequest(
                f"`{kind}` content is not supported here: images are read in user messages and tool results."
            )
        elif kind in ("input_audio", "file", "input_file", "document"):
            raise InvalidRequest(
                f"`{kind}` content is not supported: the served model reads text and images only."
            )
    return "\n".join(texts)


@dataclass(slots=True)
class Step:
    """What one engine event means for a response: parsed parts, or a keep-alive, or the end."""

    parts: list[Any]
    logprobs: tuple[Any, ...] | None = None
    keepalive: bool = False
    final: Any = None  # FinishEvent | ErrorEvent on the last step (of its choice)
    reasoning_tokens: int = 0  # generated tokens spent inside `<think>`, in total, on the last step
    index: int = 0  # the choice the step belongs to


def choice_usage(finishes: list[Any]) -> Usage:
    """One usage for all choices of a request: the prompt (prefilled once) counted once, outputs summed."""
    first = finishes[0].usage
    return replace(
        first,
        completion_tokens=sum(f.usage.completion_tokens for f in finishes),
        decode_seconds=max(f.usage.decode_seconds for f in finishes),
        draft_tokens_proposed=sum(f.usage.draft_tokens_proposed for f in finishes),
        draft_tokens_accepted=sum(f.usage.draft_tokens_accepted for f in finishes),
        prediction_tokens_proposed=sum(f.usage.prediction_tokens_proposed for f in finishes),
        prediction_tokens_accepted=sum(f.usage.prediction_tokens_accepted for f in finishes),
    )


async def steps(run: GenerationRun, parser: Any) -> Any:
    """Engine events of `run` → `Step`s through `parser` (an `OutputParser`, or a list of them, one per
    choice of an n > 1 request).

    A step is marked `keepalive` whenever nothing has been written for `run.keepalive_s`: during a long
    prefill, and also while the model writes a long tool call, which is held back until its block closes.
    """
    from kapitsa.engine.types import PrefillProgressEvent, TokenEvent

    last_output = time.monotonic()
    async for event in run.events():
        index = getattr(event, "index", 0)
        choice = parser[index] if isinstance(parser, list) else parser
        if event is None or isinstance(event, (PrefillProgressEvent, TokenEvent)):
            parts = choice.feed(event.text, len(event.token_ids)) if isinstance(event, TokenEvent) else []
            now_s = time.monotonic()
            quiet = not parts and now_s - last_output >= run.keepalive_s
            if parts or quiet:
                last_output = now_s
            logprobs = event.logprobs if isinstance(event, TokenEvent) else None
            yield Step(parts, logprobs, keepalive=quiet, index=index)
        else:
            truncated = getattr(event, "finish_reason", None) == "length"
            parts = choice.finish(truncated=truncated)
            yield Step(parts, final=event, reasoning_tokens=choice.reasoning_tokens, index=index)


async def collect_steps(run: GenerationRun, parser: Any) -> list[Step] | None:
    """Every step of a non-streamed generation, the last one of each choice holding its `FinishEvent`;
    None when the client left. An `ErrorEvent` is raised as its error. The run is closed either way."""
    from kapitsa.engine.types import ErrorEvent, FinishEvent

    collected: list[Step] = []
    try:
        async for step in steps(run, parser):
            if isinstance(step.final, ErrorEvent):
                raise step.final.error
            collected.append(step)
    except ClientGone:
        return None
    finally:
        await run.close()
    if not collected or not isinstance(collected[-1].final, FinishEvent):
        raise RuntimeError("generation ended without a final event")  # pragma: no cover
    return collected


CLIENT_GONE_STATUS = 499  # nginx's "client closed request": nobody reads the body


def logprob_entries(items: tuple[TokenLogprob, ...] | None) -> list[dict[str, Any]]:
    """Token logprobs in OpenAI's shape (chat `logprobs.content`, Responses `output_text.logprobs`)."""
    return [
        {
            "token": lp.token,
            "logprob": lp.logprob,
            "bytes": list(lp.token.encode()),
            "top_logprobs": [{"token": t, "logprob": p, "bytes": list(t.encode())} for _, t, p in lp.top],
        }
        for lp in items or ()
    ]
