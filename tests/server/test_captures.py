"""Real requests captured from Claude Code, Codex, opencode and pi, replayed against the server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_harness import LiveServer

# Trimmed copies of shared/docs/agent-captures (strings over 120 characters cut): the agents' real request
# shapes (fields, roles, blocks, tools, schemas) without their long prompt texts.
CAPTURES = Path(__file__).parent / "captures"
POSTS = sorted(CAPTURES.glob("*.POST_*.json"))


@pytest.fixture(autouse=True)
def model_named_local(live: LiveServer) -> None:
    live.engine.with_model(id="local")  # the probe configured every agent with model "local"


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def final_event(path: str, raw: str) -> str:
    data = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
    if path.startswith("/v1/chat"):
        return data[-1]
    return json.loads(data[-1])["type"]


@pytest.mark.parametrize(
    "capture", POSTS, ids=[p.name.split(".POST")[0] + p.name.split("json")[0][-12:] for p in POSTS]
)
def test_captured_request_streams_to_a_clean_end(live: LiveServer, http: httpx.Client, capture: Path) -> None:
    record = load(capture)
    headers = {
        k: v
        for k, v in record["headers"].items()
        if k.lower() in ("anthropic-version", "anthropic-beta", "authorization", "content-type")
    }
    response = http.post(
        record["path"],
        json=record["body"],
        headers=headers,
        params={k: v[0] for k, v in record["query"].items()},
    )
    assert response.status_code == 200, response.text[:500]
    expected = {
        "/v1/messages": "message_stop",
        "/v1/responses": "response.completed",
        "/v1/chat/completions": "[DONE]",
    }
    assert final_event(record["path"], response.text) == expected[record["path"]]
    sent = live.engine.requests[-1]
    assert sent.messages and sum(m["role"] == "system" for m in sent.messages) <= 1
    assert sent.messages[0]["role"] in ("system", "user")


def test_claude_attribution_line_never_reaches_the_prompt(live: LiveServer, http: httpx.Client) -> None:
    record = load(CAPTURES / "chatty-sniff-claude-text.002.POST_v1_messages.json")
    body = record["body"]
    assert body["system"][0]["text"].startswith("x-anthropic-billing-header:")
    http.post("/v1/messages", json=body)
    first = live.engine.requests[-1].messages[0]["content"]
    other = json.loads(json.dumps(body))
    other["system"][0]["text"] = (
        "x-anthropic-billing-header: cc_version=9.9.9.999; cc_entrypoint=cli; cch=abc12;"
    )
    http.post("/v1/messages", json=other)
    assert "billing-header" not in first
    assert live.engine.requests[-1].messages == live.engine.requests[-2].messages  # same prefix → cache hit


def test_claude_mid_conversation_system_message_is_folded(live: LiveServer, http: httpx.Client) -> None:
    record = load(CAPTURES / "claude-tool.003.POST_v1_messages.tool-result.json")
    http.post("/v1/messages", json=record["body"])
    messages = live.engine.requests[-1].messages
    assert [m["role"] for m in messages][:2] == ["system", "user"]
    assert "Available agent types" in messages[0]["content"]
    assert messages[-1]["role"] == "tool" and messages[-2]["tool_calls"][0]["function"]["name"] == "Bash"


def test_codex_tools_namespace_flattened_and_web_search_dropped(live: LiveServer, http: httpx.Client) -> None:
    record = load(CAPTURES / "codex-tool.002.POST_v1_responses.tool-result.json")
    http.post("/v1/responses", json=record["body"])
    sent = live.engine.requests[-1]
    names = [t["function"]["name"] for t in sent.tools]
    assert "exec_command" in names and "close_agent" in names and "web_search" not in names
    assert sent.messages[0]["role"] == "system" and "Codex" in sent.messages[0]["content"]
    assert sent.messages[-1]["role"] == "tool" and "tool-ok" in sent.messages[-1]["content"]
