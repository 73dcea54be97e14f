"""Edges of the three APIs that real clients reach (FakeEngine): explicit nulls for optional fields,
`top_p: 0`, `GET /v1/models/{id}`, `GET /v1/responses/{id}/input_items`, usage's cache-write counts."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest
from server_harness import LiveServer

USER = [{"role": "user", "content": "hi"}]


def test_explicit_nulls_mean_the_defaults(live: LiveServer, http: httpx.Client) -> None:
    chat = http.post(
        "/v1/chat/completions", json={"model": "fake", "messages": USER, "n": None, "stream": None}
    )
    assert chat.status_code == 200, chat.text
    assert len(chat.json()["choices"]) == 1
    body = {"model": "fake", "input": "hi", "store": None, "stream": None, "tools": None}
    responses = http.post("/v1/responses", json=body)
    assert responses.status_code == 200, responses.text
    assert http.get(f"/v1/responses/{responses.json()['id']}").status_code == 200  # null store: stored
    required = http.post("/v1/messages", json={"model": "fake", "messages": USER, "max_tokens": None})
    assert required.status_code == 400  # a required field stays required


def test_top_p_zero_is_greedy(live: LiveServer, http: httpx.Client) -> None:
    reply = http.post(
        "/v1/chat/completions", json={"model": "fake", "messages": USER, "top_p": 0, "temperature": 0.8}
    )
    assert reply.status_code == 200, reply.text
    sampling = live.engine.requests[-1].sampling
    assert sampling.temperature == 0.0 and sampling.top_p == 1.0


def test_a_model_is_retrieved_by_its_id_and_a_claude_name_maps_to_it(live: LiveServer) -> None:
    oai = openai.OpenAI(base_url=live.v1, api_key="x", max_retries=0, timeout=10)
    assert oai.models.retrieve("fake").id == "fake"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        oai.models.retrieve("gpt-4o")
    claude = anthropic.Anthropic(base_url=live.url, api_key="x", max_retries=0, timeout=10)
    assert claude.models.retrieve("claude-sonnet-4-5").id == "claude-sonnet-4-5"
    with httpx.Client(base_url=live.url, timeout=10) as http:
        assert http.get("/v1/models/").status_code == 404


def test_input_items_list_what_the_model_saw(live: LiveServer) -> None:
    oai = openai.OpenAI(base_url=live.v1, api_key="x", max_retries=0, timeout=10)
    first = oai.responses.create(model="fake", input="first question")
    second = oai.responses.create(
        model="fake",
        previous_response_id=first.id,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "second question"}]}],
    )
    items = oai.responses.input_items.list(second.id, order="asc")
    kinds = [(i.type, getattr(i, "role", None)) for i in items.data]
    assert kinds == [("message", "user"), ("message", "assistant"), ("message", "user")]
    assert items.data[0].content[0].text == "first question"
    assert items.data[-1].content[0].text == "second question"
    assert len({i.id for i in items.data}) == 3
    newest = oai.responses.input_items.list(second.id, limit=1)
    assert newest.has_more and newest.data[0].id == items.data[-1].id
    after = oai.responses.input_items.list(second.id, limit=5, after=newest.data[0].id)
    assert [i.id for i in after.data] == [i.id for i in reversed(items.data[:-1])]
    with pytest.raises(openai.NotFoundError):
        oai.responses.input_items.list("resp_unknown")


def test_usage_reports_cache_writes_as_the_sdks_type_them(live: LiveServer) -> None:
    oai = openai.OpenAI(base_url=live.v1, api_key="x", max_retries=0, timeout=10)
    usage = oai.responses.create(model="fake", input="hi").usage
    details = usage.input_tokens_details
    assert isinstance(details.cache_write_tokens, int) and isinstance(details.cached_tokens, int)
    assert details.cache_write_tokens + details.cached_tokens <= usage.input_tokens
    chat = oai.chat.completions.create(model="fake", messages=USER).usage
    assert isinstance(chat.prompt_tokens_details.cache_write_tokens, int)


def test_a_required_call_without_tools_is_a_400(http: httpx.Client) -> None:
    chat = http.post(
        "/v1/chat/completions", json={"model": "fake", "messages": USER, "tool_choice": "required"}
    )
    assert chat.status_code == 400 and "declares no tools" in chat.text
    responses = http.post("/v1/responses", json={"model": "fake", "input": "hi", "tool_choice": "required"})
    assert responses.status_code == 400 and "declares no tools" in responses.text
    body = {"model": "fake", "messages": USER, "max_tokens": 8, "tool_choice": {"type": "any"}}
    assert http.post("/v1/messages", json=body).status_code == 400


def test_a_response_echoes_its_tools_and_a_cut_message_is_incomplete(live: LiveServer) -> None:
    oai = openai.OpenAI(base_url=live.v1, api_key="x", max_retries=0, timeout=10)
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}]
    live.engine.enqueue("a long answer", finish_reason="length")
    cut = oai.responses.create(model="fake", input="hi", tools=tools, tool_choice="auto", max_output_tokens=3)
    assert cut.status == "incomplete" and cut.output[-1].status == "incomplete"
    assert [t.name for t in cut.tools] == ["f"] and cut.tool_choice == "auto" and cut.max_output_tokens == 3
    live.engine.enqueue("a long answer", finish_reason="length")
    events = list(oai.responses.create(model="fake", input="hi", max_output_tokens=3, stream=True))
    assert [e.item.status for e in events if e.type == "response.output_item.done"] == ["incomplete"]
    assert events[-1].type == "response.incomplete" and events[-1].response.output[-1].status == "incomplete"
    done = oai.responses.create(model="fake", input="hi")
    assert done.output[-1].status == "completed"
