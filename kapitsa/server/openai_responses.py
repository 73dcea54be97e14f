"""`POST /v1/responses` (what Codex speaks): events out in OpenAI's order.

A stream ends with `response.completed`, or `response.incomplete` after a length stop of a request that
set `max_output_tokens` (without one, the stop stays `response.completed` with `status: "incomplete"`,
because Codex sets none and treats `response.incomplete` as a failure); a failure ends with
`response.failed`.

A response that ends (completed or incomplete) is stored unless the request says `store: false`; `GET` and
`DELETE /v1/responses/{id}` read and forget it, and `previous_response_id` continues it.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kapitsa.engine.types import ErrorEvent, FinishEvent, GenerationRequest
from kapitsa.server.budget import with_reasoning_budget
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
    thinking_kwargs,
)
from kapitsa.server.constraints import responses_constraint
from kapitsa.server.images import take_images
from kapitsa.server.json_body import WellFormedJsonRoute
from kapitsa.server.output import OutputParser
from kapitsa.server.prefill import starts_in_reasoning
from kapitsa.server.response_store import (
    ResponseStore,
    deletion_body,
    input_items_page,
    previous_conversation,
    stored_response,
)
from kapitsa.server.responses_events import ResponseBuilder
from kapitsa.server.responses_input import (
    ResponsesRequest,
    build_messages,
    check_hosted_state,
    function_tools,
    input_items,
    logprobs_wanted,
    thinking_choice,
)
from kapitsa.server.streaming import ClientGone, GenerationRun
from kapitsa.server.truncation import fit_window

router = APIRouter(route_class=WellFormedJsonRoute)


@router.post("/v1/responses")
async def responses(body: ResponsesRequest, request: Request) -> Any:
    check_hosted_state(body)
    state = state_of(request)
    model = resolve_model(state.client, body.model)
    history = previous_conversation(state.responses, body.previous_response_id)
    tools, namespaces, custom = function_tools(body)
    thinking = thinking_choice(body)
    messages, images = take_images(build_messages(body, history), model)
    gen = GenerationRequest(
        messages=tuple(messages),
        images=images,
        tools=tuple(tools) or None,
        model=model.id,
        sampling=make_sampling(
            model,
            temperature=body.temperature,
            top_p=body.top_p,
            max_tokens=body.max_output_tokens,
            logprobs=logprobs_wanted(body),
            constraint=responses_constraint(body, model, tools, thinking),
        ),
        chat_template_kwargs=thinking_kwargs(thinking),
        request_id=f"resp_{uuid.uuid4().hex[:24]}",
    )
    if body.truncation == "auto":
        gen = await fit_window(state.client, gen, model)
    reasoning = starts_in_reasoning(model, thinking, None)
    gen = with_reasoning_budget(gen, model, reasoning=reasoning, budget=state.settings.reasoning_budget)
    parser = OutputParser(
        thinking=reasoning,
        tools=tools or None,
        one_call=body.parallel_tool_calls is False,
    )
    builder = ResponseBuilder(
        response_id=gen.request_id,
        model=model.id,
        namespaces=namespaces,
        custom=custom,
        client_limit=body.max_output_tokens is not None,
    )
    builder.response.update(
        store=body.store,
        previous_response_id=body.previous_response_id,
        instructions=body.instructions,
        parallel_tool_calls=body.parallel_tool_calls is not False,
        truncation=body.truncation or "disabled",
        tools=body.tools or [],  # as the request declared them
        tool_choice=body.tool_choice or "auto",
        max_output_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
    )
    keep = _keeper(state.responses, [*history, *input_items(body)]) if body.store else _keep_nothing
    run = await start_run(request, gen)
    if body.stream:
        return StreamingResponse(
            _stream(run, parser, builder, keep), media_type="text/event-stream", headers=SSE_HEADERS
        )
    return await _collect(run, parser, builder, keep)


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request) -> dict[str, Any]:
    return stored_response(state_of(request).responses, response_id).response


@router.get("/v1/responses/{response_id}/input_items")
async def get_input_items(
    response_id: str, request: Request, limit: int = 20, order: str = "desc", after: str | None = None
) -> dict[str, Any]:
    stored = stored_response(state_of(request).responses, response_id)
    return input_items_page(stored, limit=limit, order=order, after=after)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
    store = state_of(request).responses
    stored_response(store, response_id)  # 404 when unknown
    store.delete(response_id)
    return deletion_body(response_id)


Keep = Callable[[dict[str, Any]], None]


def _keeper(store: ResponseStore, conversation: list[dict[str, Any]]) -> Keep:
    """Stores a finished response with the conversation that continues it (its input, then its output)."""

    def keep(response: dict[str, Any]) -> None:
        store.put(response, [*conversation, *response["output"]])

    return keep


def _keep_nothing(response: dict[str, Any]) -> None:
    return None


async def _collect(
    run: GenerationRun, parser: OutputParser, builder: ResponseBuilder, keep: Keep
) -> JSONResponse:
    done = await collect_steps(run, parser)
    if done is None:
        return JSONResponse({}, status_code=CLIENT_GONE_STATUS)
    for step in done:
        builder.parts(step.parts, step.logprobs)
    response = builder.finish(done[-1].final, done[-1].reasoning_tokens)
    keep(response)
    return JSONResponse(response)


async def _stream(
    run: GenerationRun, parser: OutputParser, builder: ResponseBuilder, keep: Keep
) -> AsyncIterator[bytes]:
    try:
        for frame in builder.opening():
            yield frame
        async for step in steps(run, parser):
            if step.keepalive:
                yield SSE_COMMENT
            for frame in builder.parts(step.parts, step.logprobs):
                yield frame
            if isinstance(step.final, FinishEvent):
                closing = builder.closing(step.final, step.reasoning_tokens)
                keep(builder.response)  # before the last event: a client may continue as soon as it reads it
                for frame in closing:
                    yield frame
            elif isinstance(step.final, ErrorEvent):
                for frame in builder.failure(step.final.error):
                    yield frame
    except ClientGone:
        return
    finally:
        await run.close()
