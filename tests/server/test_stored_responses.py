"""Stored Responses API responses: the store's bounds, the conversation `previous_response_id` continues,
`GET`/`DELETE /v1/responses/{id}` (FakeEngine), and prefix-cache reuse on a tiny real checkpoint."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from server_harness import LiveServer, live_server, open_tiny_engine

from kapitsa.server.errors import ApiError
from kapitsa.server.response_store import ResponseStore, previous_conversation
from kapitsa.server.responses_input import ResponsesRequest, build_messages

RESP = "/v1/responses"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def response(response_id: str) -> dict[str, object]:
    return {"id": response_id, "object": "response", "output": []}


def test_the_store_drops_the_oldest_past_its_count() -> None:
    store = ResponseStore(max_responses=2)
    for rid in ("a", "b", "c"):
        store.put(response(rid), [])
    assert [rid for rid in "abc" if store.get(rid)] == ["b", "c"]
    assert len(store) == 2


def test_the_store_forgets_responses_past_their_age() -> None:
    clock = Clock()
    store = ResponseStore(max_age_s=10, clock=clock)
    store.put(response("old"), [])
    clock.now = 6
    store.put(response("new"), [])
    clock.now = 10
    assert store.get("old") is None and store.get("new") is not None
    clock.now = 16
    assert store.get("new") is None and len(store) == 0


def test_an_unknown_previous_response_is_openais_previous_response_not_found() -> None:
    with pytest.raises(ApiError) as caught:
        previous_conversation(ResponseStore(), "resp_nope")
    err = caught.value
    assert (err.status, err.code, err.param) == (400, "previous_response_not_found", "previous_response_id")
    assert "resp_nope" in err.message
    assert previous_conversation(ResponseStore(), None) == []


def test_history_comes_before_the_input_and_old_instructions_do_not_carry_over() -> None:
    history = [
        {"type": "message", "role": "user", "content": "Name a prime."},
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "small ones"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Seven."}]},
        {"type": "function_call", "call_id": "c1", "name": "ls", "arguments": '{"path": "."}'},
    ]
    body = ResponsesRequest(
        input=[{"type": "function_call_output", "call_id": "c1", "output": "a.txt"}], instructions="Be terse."
    )
    assert build_messages(body, history) == [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Name a prime."},
        {
            "role": "assistant",
            "content": "Seven.",
            "reasoning_content": "small ones",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": {"path": "."}}}
            ],
        },
        {"role": "tool", "content": "a.txt", "tool_call_id": "c1"},
    ]


@pytest.fixture
def fake() -> Iterator[tuple[LiveServer, httpx.Client]]:
    with live_server() as live, httpx.Client(base_url=live.url, timeout=10) as http:
        yield live, http


def test_previous_response_id_continues_the_stored_conversation(
    fake: tuple[LiveServer, httpx.Client],
) -> None:
    live, http = fake
    live.engine.enqueue("Seven.")
    first = http.post(RESP, json={"input": "Name a prime.", "instructions": "Old rules."}).json()
    assert first["store"] is True
    live.engine.enqueue("Eleven.")
    body = {"input": "Another?", "previous_response_id": first["id"], "instructions": "New rules."}
    second = http.post(RESP, json=body).json()
    assert second["previous_response_id"] == first["id"]
    assert list(live.engine.requests[-1].messages) == [
        {"role": "system", "content": "New rules."},
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "Seven."},
        {"role": "user", "content": "Another?"},
    ]
    live.engine.enqueue("Thirteen.")  # a chain: the second response carries the first's conversation
    http.post(RESP, json={"input": "More?", "previous_response_id": second["id"]})
    assert [m["content"] for m in live.engine.requests[-1].messages] == [
        "Name a prime.",
        "Seven.",
        "Another?",
        "Eleven.",
        "More?",
    ]


def test_get_and_delete_a_stored_response(fake: tuple[LiveServer, httpx.Client]) -> None:
    _, http = fake
    created = http.post(RESP, json={"input": "hi", "stream": True})
    assert created.status_code == 200
    rid = next(line for line in created.text.splitlines() if '"response.completed"' in line)
    rid = rid.split('"id":"', 1)[1].split('"', 1)[0]
    got = http.get(f"{RESP}/{rid}")
    assert got.status_code == 200 and got.json()["id"] == rid and got.json()["status"] == "completed"
    assert got.json()["output"][0]["content"][0]["text"] == "Hello from the fake engine."
    assert http.delete(f"{RESP}/{rid}").json() == {"id": rid, "object": "response", "deleted": True}
    for method in (http.get, http.delete):
        gone = method(f"{RESP}/{rid}")
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "not_found"
    again = http.post(RESP, json={"input": "more", "previous_response_id": rid})
    assert again.status_code == 400 and again.json()["error"]["code"] == "previous_response_not_found"


def test_store_false_stores_nothing(fake: tuple[LiveServer, httpx.Client]) -> None:
    _, http = fake
    out = http.post(RESP, json={"input": "hi", "store": False}).json()
    assert out["store"] is False
    assert http.get(f"{RESP}/{out['id']}").status_code == 404


def test_the_continuation_reads_the_stored_prompt_from_the_prefix_cache(tmp_path) -> None:  # noqa: ANN001
    engine = open_tiny_engine(tmp_path / "qwen")
    try:
        with live_server(engine) as live:
            oai = openai.OpenAI(base_url=live.v1, api_key="x", max_retries=0, timeout=60)
            text = "Here is a list of things to remember: apples, pears, plums, figs, dates, limes. " * 3
            first = oai.responses.create(model=engine.info.id, input=text, max_output_tokens=6)
            assert oai.responses.retrieve(first.id).id == first.id
            before = engine.stats()
            second = oai.responses.create(
                model=engine.info.id, input="And now?", previous_response_id=first.id, max_output_tokens=4
            )
            after = engine.stats()
    finally:
        engine.close()
    stored_prompt = first.usage.input_tokens
    reused = after.prompt_tokens_cached - before.prompt_tokens_cached
    assert reused == second.usage.input_tokens_details.cached_tokens
    assert reused >= 0.9 * stored_prompt
    assert after.prompt_tokens_computed - before.prompt_tokens_computed == second.usage.input_tokens - reused
