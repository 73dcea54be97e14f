"""Hostile input against the real engine (a tiny random checkpoint through the real loading code) behind
a real uvicorn server: every case gets a 4xx in its API's own error shape, or a well-defined 200, and
the server keeps answering afterwards."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_harness import LiveServer, assert_error_shape, live_server, open_tiny_engine

from kapitsa.errors import InvalidRequest
from kapitsa.server.runner import check_bind
from kapitsa.server.settings import ServerSettings

CHAT, MSGS, RESP, CMPL = "/v1/chat/completions", "/v1/messages", "/v1/responses", "/v1/completions"
COUNT = "/v1/messages/count_tokens"
VOCAB = 512  # the tiny checkpoint's embedding rows
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    engine = open_tiny_engine(tmp_path_factory.mktemp("tiny") / "qwen")
    try:
        with live_server(engine, first_event_wait_s=0.5) as server:
            yield server
    finally:
        engine.close()


@pytest.fixture(scope="module")
def http(live: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live.url, timeout=60) as client:
        yield client


def post_raw(http: httpx.Client, path: str, body: Any) -> httpx.Response:
    """POST `body` as JSON text; `json.dumps` escapes lone surrogates as `\\udxxx`, as JS clients do."""
    return http.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})


def assert_still_serving(http: httpx.Client) -> None:
    assert http.get("/health").json()["status"] == "ok"
    out = http.post(CMPL, json={"prompt": "ok", "max_tokens": 1})
    assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 1, out.text


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": USER, "max_tokens": 2, **fields}


def msgs(**fields: Any) -> dict[str, Any]:
    return {"messages": USER, "max_tokens": 2, **fields}


def cmpl(**fields: Any) -> dict[str, Any]:
    return {"prompt": "hi", "max_tokens": 2, **fields}


def resp(**fields: Any) -> dict[str, Any]:
    return {"input": "hi", "max_output_tokens": 2, **fields}


def deep_schema(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def openai_tool(parameters: Any) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


REFUSED = {  # name: (path, body, OpenAI's error.param or None)
    "prompt id beyond the vocabulary": (CMPL, cmpl(prompt=[99_999_999]), "prompt"),
    "prompt id one past the last row": (CMPL, cmpl(prompt=[5, VOCAB]), "prompt"),
    "negative prompt id": (CMPL, cmpl(prompt=[-5]), "prompt"),
    "prompt id beyond int32": (CMPL, cmpl(prompt=[2**40]), "prompt"),
    "prompt id beyond int64": (CMPL, cmpl(prompt=[2**70]), "prompt"),
    "fractional prompt id": (CMPL, cmpl(prompt=[1.5]), None),
    "nested prompt ids": (CMPL, cmpl(prompt=[[1, 2]]), None),
    "logit_bias id beyond the vocabulary": (CHAT, chat(logit_bias={"99999999": 5}), "logit_bias"),
    "negative logit_bias id": (CHAT, chat(logit_bias={"-1": 5}), "logit_bias"),
    "logit_bias id that is no number": (CHAT, chat(logit_bias={"abc": 5}), "logit_bias"),
    "logit_bias beyond 100": (CHAT, chat(logit_bias={"5": 1000}), "logit_bias"),
    "logit_bias key of a non-ASCII digit": (CHAT, chat(logit_bias={"\u00b2": 5}), "logit_bias"),
    "logit_bias key with two signs": (CHAT, chat(logit_bias={"--5": 5}), "logit_bias"),
    "logit_bias key past int's digit limit": (CHAT, chat(logit_bias={"9" * 5000: 5}), "logit_bias"),
    "completions logit_bias id past the vocabulary": (CMPL, cmpl(logit_bias={str(VOCAB): 1}), "logit_bias"),
    "parameters type 5": (CHAT, chat(tools=openai_tool({"type": 5})), "tools"),
    "parameters of type string": (CHAT, chat(tools=openai_tool({"type": "string"})), "tools"),
    "a property that is no schema": (
        CHAT,
        chat(tools=openai_tool({"type": "object", "properties": {"x": 3}})),
        "tools",
    ),
    "an unknown type name": (
        CHAT,
        chat(tools=openai_tool({"type": "object", "properties": {"x": {"type": "strin"}}})),
        "tools",
    ),
    "required that is no list": (CHAT, chat(tools=openai_tool({"type": "object", "required": "x"})), "tools"),
    "a schema nested 100 deep": (CHAT, chat(tools=openai_tool(deep_schema(100))), "tools"),
    "anthropic input_schema x": (MSGS, msgs(tools=[{"name": "f", "input_schema": "x"}]), None),
    "anthropic input_schema type 5": (MSGS, msgs(tools=[{"name": "f", "input_schema": {"type": 5}}]), None),
    "anthropic tool without a name": (MSGS, msgs(tools=[{"input_schema": {"type": "object"}}]), None),
    "count_tokens input_schema x": (
        COUNT,
        {"messages": USER, "tools": [{"name": "f", "input_schema": "x"}]},
        None,
    ),
    "responses parameters 3": (
        RESP,
        resp(tools=[{"type": "function", "name": "f", "parameters": 3}]),
        "tools",
    ),
    "responses parameters anyOf empty": (
        RESP,
        resp(tools=[{"type": "function", "name": "f", "parameters": {"type": "object", "anyOf": []}}]),
        "tools",
    ),
    "responses namespaced parameters x": (
        RESP,
        resp(
            tools=[
                {
                    "type": "namespace",
                    "name": "n",
                    "tools": [{"type": "function", "name": "f", "parameters": "x"}],
                }
            ]
        ),
        "tools",
    ),
    "a seed of 5000 digits": (CHAT, {**chat(), "seed": "SEED"}, None),
}


@pytest.mark.parametrize("name", list(REFUSED))
@pytest.mark.parametrize("stream", [False, True])
def test_hostile_values_are_a_400_in_the_api_shape(http: httpx.Client, name: str, stream: bool) -> None:
    path, body, param = REFUSED[name]
    raw = json.dumps({**body, "stream": stream}).replace('"SEED"', "9" * 5000).encode()
    if path == COUNT and stream:
        raw = json.dumps(body).encode()
    response = http.post(path, content=raw, headers={"content-type": "application/json"})
    assert_error_shape(path, response, 400, param)
    assert_still_serving(http)


def test_a_body_nested_a_hundred_thousand_deep_is_a_400(http: httpx.Client) -> None:
    raw = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert_error_shape(CHAT, http.post(CHAT, content=raw, headers={"content-type": "application/json"}), 400)
    assert_still_serving(http)


@pytest.mark.parametrize("seed", [-1, 2**64, 2**70, -(2**70)])
def test_any_integer_seed_samples_as_its_residue_modulo_2_64(http: httpx.Client, seed: int) -> None:
    def sampled(seed: int) -> str:
        out = post_raw(http, CMPL, cmpl(prompt="Once", max_tokens=8, temperature=1.0, seed=seed))
        assert out.status_code == 200, out.text
        return out.json()["choices"][0]["text"]

    assert sampled(seed) == sampled(seed % 2**64)


LONE = "a\ud800b"
LONE_BODIES = {
    CHAT: chat(messages=[{"role": "user", "content": LONE}]),
    MSGS: msgs(messages=[{"role": "user", "content": [{"type": "text", "text": LONE}]}], system=LONE),
    RESP: resp(input=[{"type": "message", "role": "user", "content": LONE}], instructions="\udfff"),
    CMPL: cmpl(prompt=LONE),
    COUNT: {"messages": [{"role": "user", "content": LONE}]},
}


@pytest.mark.parametrize("path", list(LONE_BODIES))
@pytest.mark.parametrize("stream", [False, True])
def test_a_lone_surrogate_in_any_text_field_reads_as_u_fffd(
    http: httpx.Client, path: str, stream: bool
) -> None:
    body = LONE_BODIES[path] if path == COUNT else {**LONE_BODIES[path], "stream": stream}
    response = post_raw(http, path, body)
    assert response.status_code == 200, response.text
    assert_still_serving(http)


def test_the_replacement_is_u_fffd_everywhere(http: httpx.Client) -> None:
    echo = post_raw(http, CMPL, cmpl(prompt=LONE + "\udc00", echo=True, max_tokens=1)).json()
    assert echo["choices"][0]["text"].startswith("a\ufffdb\ufffd")
    counted = [
        post_raw(http, COUNT, {"messages": [{"role": "user", "content": t}]}) for t in (LONE, "a\ufffdb")
    ]
    assert counted[0].json() == counted[1].json()
    pair = post_raw(http, COUNT, {"messages": [{"role": "user", "content": "a\ud83d\ude00b"}]})
    assert pair.status_code == 200  # a valid pair (an emoji) is kept as it is


def test_a_model_name_with_a_lone_surrogate_is_a_404_not_a_crash(http: httpx.Client) -> None:
    for path, body in ((CHAT, chat(model="x\ud800")), (MSGS, msgs(model="gpt-\ud800"))):
        assert_error_shape(path, post_raw(http, path, body), 404)
    assert_still_serving(http)


@pytest.mark.parametrize("key", ["", " ", "\t\n"])
def test_a_blank_api_key_is_refused_for_a_network_bind(key: str) -> None:
    with pytest.raises(InvalidRequest, match="without a token"):
        check_bind(ServerSettings(host="0.0.0.0", api_key=key))
    check_bind(ServerSettings(host="127.0.0.1", api_key=key))  # loopback: a blank key means no key


def test_an_api_key_is_compared_without_surrounding_whitespace(live: LiveServer) -> None:
    with live_server(live.engine, api_key=" secret\n") as keyed, httpx.Client(base_url=keyed.url) as http:
        assert http.get("/v1/models").status_code == 401
        assert http.get("/v1/models", headers={"Authorization": "Bearer secret"}).status_code == 200


def test_oversized_headers_are_refused_and_the_server_keeps_answering(
    live: LiveServer, http: httpx.Client
) -> None:
    """Headers past the server's cap (64 KiB buffered) are refused before any route reads them, whichever
    HTTP parsers are installed (httptools, which uvicorn prefers, has no cap); the server answers the next
    request."""
    huge = {"X-Padding": "a" * (1024 * 1024)}  # more than one read: the cap applies to what is buffered
    with httpx.Client(base_url=live.url, timeout=30) as fresh:
        try:  # the refusal may close the connection while the client still writes
            refused = fresh.get("/v1/models", headers=huge).status_code in (400, 431)
        except httpx.TransportError:
            refused = True
    assert refused
    assert http.get("/v1/models").status_code == 200
    assert live.server.config.http == "h11"  # the parser with the cap, even where httptools is installed
