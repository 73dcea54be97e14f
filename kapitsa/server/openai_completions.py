"""`POST /v1/completions`: raw text in, raw text out (no chat template, no reasoning or tool parsing)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kapitsa.engine.types import ErrorEvent, FinishEvent, GenerationRequest, ModelInfo, TokenLogprob
from kapitsa.errors import InvalidRequest
from kapitsa.server.common import (
    CLIENT_GONE_STATUS,
    SSE_COMMENT,
    SSE_HEADERS,
    choice_usage,
    collect_steps,
    now,
    openai_sampling,
    resolve_model,
    sse,
    start_run,
    state_of,
    steps,
)
from kapitsa.server.errors import param_error
from kapitsa.server.input_checks import check_prompt_ids
from kapitsa.server.json_body import WellFormedJsonRoute
from kapitsa.server.openai_chat import failure_frames, openai_usage
from kapitsa.server.openai_models import CompletionRequest
from kapitsa.server.output import TextPart
from kapitsa.server.streaming import ClientGone, GenerationRun

router = APIRouter(route_class=WellFormedJsonRoute)


class RawParser:
    """The model's text as is."""

    reasoning_tokens = 0

    def feed(self, text: str, tokens: int = 0) -> list[TextPart]:
        return [TextPart(text)] if text else []

    def finish(self, *, truncated: bool = False) -> list[TextPart]:
        return []


def to_generation_request(body: CompletionRequest, model: ModelInfo) -> GenerationRequest:
    if body.suffix:
        raise InvalidRequest("`suffix` (fill-in-the-middle) is not supported.")
    if body.best_of is not None and body.best_of > body.n:
        raise param_error(
            "best_of", "`best_of` larger than `n` (ranking candidates on the server) is not supported."
        )
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise InvalidRequest("Only one prompt per request is supported.")
        prompt = prompt[0]
    if not prompt:
        raise InvalidRequest("`prompt` is empty.")
    sampling = openai_sampling(model, body, max_tokens=body.max_tokens or 16, logprobs=body.logprobs)
    request_id = f"cmpl-{uuid.uuid4().hex[:24]}"
    if isinstance(prompt, str):
        return GenerationRequest(
            prompt=prompt, sampling=sampling, model=model.id, request_id=request_id, n=body.n
        )
    check_prompt_ids(prompt, model)
    if body.echo:
        raise param_error("echo", "`echo` needs a text prompt (this one is token ids).")
    return GenerationRequest(
        prompt_token_ids=tuple(prompt), sampling=sampling, model=model.id, request_id=request_id, n=body.n
    )  # type: ignore[arg-type]


def legacy_logprobs(items: list[TokenLogprob]) -> dict[str, Any] | None:
    if not items:
        return None
    offsets, pos = [], 0
    for lp in items:
        offsets.append(pos)
        pos += len(lp.token)
    return {
        "tokens": [lp.token for lp in items],
        "token_logprobs": [lp.logprob for lp in items],
        "top_logprobs": [{t: p for _, t, p in lp.top} for lp in items],
        "text_offset": offsets,
    }


def _finish(finish: FinishEvent) -> str:
    return "length" if finish.finish_reason == "length" else "stop"


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Any:
    model = resolve_model(state_of(request).client, body.model)
    gen = to_generation_request(body, model)
    echo = gen.prompt if body.echo and gen.prompt is not None else ""
    run = await start_run(request, gen)
    base = {"id": gen.request_id, "object": "text_completion", "created": now(), "model": model.id}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            _stream(run, base, echo, include_usage), media_type="text/event-stream", headers=SSE_HEADERS
        )
    return await _collect(run, base, echo)


async def _collect(run: GenerationRun, base: dict[str, Any], echo: str) -> JSONResponse:
    done = await collect_steps(run, RawParser())
    if done is None:
        return JSONResponse({}, status_code=CLIENT_GONE_STATUS)
    finals = sorted((s for s in done if isinstance(s.final, FinishEvent)), key=lambda s: s.index)
    choices = []
    for final in finals:
        mine = [step for step in done if step.index == final.index]
        choices.append(
            {
                "index": final.index,
                "text": echo + "".join(p.text for step in mine for p in step.parts),
                "logprobs": legacy_logprobs([e for step in mine for e in step.logprobs or ()]),
                "finish_reason": _finish(final.final),
            }
        )
    usage = choice_usage([s.final for s in finals])
    return JSONResponse({**base, "choices": choices, "usage": openai_usage(usage)})


async def _stream(
    run: GenerationRun, base: dict[str, Any], echo: str, include_usage: bool
) -> AsyncIterator[bytes]:
    def frame(text: str, finish: str | None = None, logprobs: Any = None, index: int = 0) -> bytes:
        body = {
            **base,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}],
        }
        return sse({**body, "usage": None} if include_usage else body)

    finishes: list[FinishEvent] = []
    try:
        for index in range(run.request.n if echo else 0):
            yield frame(echo, index=index)
        async for step in steps(run, RawParser()):
            if step.keepalive:
                yield SSE_COMMENT
            for part in step.parts:
                yield frame(part.text, logprobs=legacy_logprobs(list(step.logprobs or ())), index=step.index)
            if isinstance(step.final, FinishEvent):
                yield frame("", _finish(step.final), index=step.index)
                finishes.append(step.final)
                if len(finishes) < run.request.n:
                    continue
                if include_usage:
                    yield sse({**base, "choices": [], "usage": openai_usage(choice_usage(finishes))})
                yield b"data: [DONE]\n\n"
            elif isinstance(step.final, ErrorEvent):
                for chunk in failure_frames(step.final.error):
                    yield chunk
    except ClientGone:
        return
    finally:
        await run.close()
