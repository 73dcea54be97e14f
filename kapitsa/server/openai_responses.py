"""`POST /v1/responses` (what Codex speaks): events out in OpenAI's order.

A stream ends with `response.completed`, or `response.incomplete` after a length stop of a request that
set `max_output_tokens` (without one, the stop stays `response.completed` with `status: "incomplete"`,
because Codex sets none and treats `response.incomplete` as a failure); a failure ends with
`response.failed`.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kapitsa.engine.types import ErrorEvent, FinishEvent, GenerationRequest
from kapitsa.server.common import (
    CLIENT_GONE_STATUS,
    SSE_COMMENT,
    SSE_HEADERS,
    collect_steps,
    make_sampling,
    resolve_model,
    start_run,
    state_of,
    steps,
    thinking_active,
    thinking_kwargs,
)
from kapitsa.server.json_body import WellFormedJsonRoute
from kapitsa.server.output import OutputParser
from kapitsa.server.responses_events import ResponseBuilder
from kapitsa.server.responses_input import ResponsesRequest, build_messages, function_tools, thinking_choice
from kapitsa.server.streaming import ClientGone, GenerationRun

router = APIRouter(route_class=WellFormedJsonRoute)


@router.post("/v1/responses")
async def responses(body: ResponsesRequest, request: Request) -> Any:
    model = resolve_model(state_of(request).client, body.model)
    tools, namespaces, custom = function_tools(body)
    thinking = thinking_choice(body)
    gen = GenerationRequest(
        messages=tuple(build_messages(body)),
        tools=tuple(tools) or None,
        model=model.id,
        sampling=make_sampling(
            model, temperature=body.temperature, top_p=body.top_p, max_tokens=body.max_output_tokens
        ),
        chat_template_kwargs=thinking_kwargs(thinking),
        request_id=f"resp_{uuid.uuid4().hex[:24]}",
    )
    parser = OutputParser(thinking=thinking_active(model, thinking), tools=tools or None)
    builder = ResponseBuilder(
        response_id=gen.request_id,
        model=model.id,
        namespaces=namespaces,
        custom=custom,
        client_limit=body.max_output_tokens is not None,
    )
    run = await start_run(request, gen)
    if body.stream:
        return StreamingResponse(
            _stream(run, parser, builder), media_type="text/event-stream", headers=SSE_HEADERS
        )
    return await _collect(run, parser, builder)


async def _collect(run: GenerationRun, parser: OutputParser, builder: ResponseBuilder) -> JSONResponse:
    done = await collect_steps(run, parser)
    if done is None:
        return JSONResponse({}, status_code=CLIENT_GONE_STATUS)
    for step in done:
        builder.parts(step.parts)
    return JSONResponse(builder.finish(done[-1].final, done[-1].reasoning_tokens))


async def _stream(run: GenerationRun, parser: OutputParser, builder: ResponseBuilder) -> AsyncIterator[bytes]:
    try:
        for frame in builder.opening():
            yield frame
        async for step in steps(run, parser):
            if step.keepalive:
                yield SSE_COMMENT
            for frame in builder.parts(step.parts):
                yield frame
            if isinstance(step.final, FinishEvent):
                for frame in builder.closing(step.final, step.reasoning_tokens):
                    yield frame
            elif isinstance(step.final, ErrorEvent):
                for frame in builder.failure(step.final.error):
                    yield frame
    except ClientGone:
        return
    finally:
        await run.close()
