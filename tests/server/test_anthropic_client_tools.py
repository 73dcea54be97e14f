"""Anthropic-defined client tools (bash, text editor, memory, computer use) on the Messages API: the
client runs them, so the local model sees each as a function with its documented schema under the
request's name, and its calls come back as `tool_use` blocks of that name. Server-run tools (web
search...) stay out of the prompt, with a log line, and a `tool_choice` that forces one is a 400."""

from __future__ import annotations

import json
import logging
from typing import Any

import httpx
import pytest
from server_harness import LiveServer, assert_error_shape

from kapitsa.engine.text.chat_template import ChatTemplate
from kapitsa.testing.tiny_tokenizer import QWEN_HERMES_TEMPLATE

BASH = {"type": "bash_20250124", "name": "bash"}
EDITOR = {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool", "max_characters": 5000}
WEB_SEARCH = {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}
ASK = [{"role": "user", "content": "List the files here."}]


def _post(http: httpx.Client, tools: list[dict[str, Any]], **extra: Any) -> httpx.Response:
    return http.post(
        "/v1/messages", json={"model": "fake", "max_tokens": 200, "messages": ASK, "tools": tools, **extra}
    )


def _functions(live: LiveServer) -> dict[str, dict[str, Any]]:
    """The functions the last request handed to the chat template, by name."""
    tools = live.engine.requests[-1].tools or ()
    return {t["function"]["name"]: t["function"] for t in tools}


def test_bash_and_text_editor_reach_the_prompt_with_their_schemas(
    live: LiveServer, http: httpx.Client
) -> None:
    assert _post(http, [BASH, EDITOR]).status_code == 200
    functions = _functions(live)
    assert list(functions) == ["bash", "str_replace_based_edit_tool"]
    bash = functions["bash"]["parameters"]
    assert bash["properties"]["command"]["type"] == "string"
    assert bash["properties"]["restart"]["type"] == "boolean"
    editor = functions["str_replace_based_edit_tool"]["parameters"]
    assert editor["properties"]["command"]["enum"] == ["view", "create", "str_replace", "insert"]
    assert editor["required"] == ["command", "path"]
    assert editor["properties"]["insert_line"]["type"] == "integer"
    assert {"insert_text", "view_range", "old_str", "new_str", "file_text"} <= set(editor["properties"])
    assert all(f["description"] for f in functions.values())  # models rely on what a tool says it does
    request = live.engine.requests[-1]
    prompt = ChatTemplate(QWEN_HERMES_TEMPLATE).render(list(request.messages or ()), tools=request.tools)
    assert '"name": "bash"' in prompt and '"name": "str_replace_based_edit_tool"' in prompt
    assert '"restart"' in prompt and '"insert_text"' in prompt and '"view_range"' in prompt


def test_a_call_of_bash_comes_back_as_a_tool_use_block(live: LiveServer, http: httpx.Client) -> None:
    call = {"name": "bash", "arguments": {"command": "ls -la"}}
    live.engine.enqueue(f"<tool_call>\n{json.dumps(call)}\n</tool_call>")
    reply = _post(http, [BASH, WEB_SEARCH])
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["stop_reason"] == "tool_use"
    [block] = [b for b in body["content"] if b["type"] == "tool_use"]
    assert block["name"] == "bash" and block["input"] == {"command": "ls -la"}


def test_a_later_dated_client_tool_works(live: LiveServer, http: httpx.Client) -> None:
    assert _post(http, [{"type": "bash_20991231", "name": "bash"}]).status_code == 200
    assert set(_functions(live)["bash"]["parameters"]["properties"]) == {"command", "restart"}


@pytest.mark.parametrize(
    ("tool", "expect"),
    [
        ({"type": "bash_20241022", "name": "bash"}, {"command", "restart"}),
        ({"type": "text_editor_20241022", "name": "str_replace_editor"}, {"undo_edit"}),
        ({"type": "text_editor_20250124", "name": "str_replace_editor"}, {"undo_edit"}),
        ({"type": "text_editor_20250429", "name": "str_replace_based_edit_tool"}, {"insert_text"}),
        ({"type": "memory_20250818", "name": "memory"}, {"delete", "rename", "old_path", "insert_text"}),
        (
            {
                "type": "computer_20241022",
                "name": "computer",
                "display_width_px": 1024,
                "display_height_px": 768,
            },
            {"left_click", "coordinate", "1024x768"},
        ),
        (
            {
                "type": "computer_20250124",
                "name": "computer",
                "display_width_px": 1280,
                "display_height_px": 800,
            },
            {"scroll", "scroll_direction", "start_coordinate", "1280x800"},
        ),
    ],
)
def test_each_client_tool_family_has_its_documented_inputs(
    live: LiveServer, http: httpx.Client, tool: dict[str, Any], expect: set[str]
) -> None:
    assert _post(http, [tool]).status_code == 200
    function = _functions(live)[tool["name"]]
    text = json.dumps(function)
    assert all(word in text for word in expect), (expect, function)


def test_the_editor_before_claude_4_inserts_new_str_and_can_undo(
    live: LiveServer, http: httpx.Client
) -> None:
    assert _post(http, [{"type": "text_editor_20250124", "name": "str_replace_editor"}]).status_code == 200
    properties = _functions(live)["str_replace_editor"]["parameters"]["properties"]
    assert "insert_text" not in properties and "undo_edit" in properties["command"]["enum"]


def test_server_tools_are_still_skipped_and_logged(
    live: LiveServer, http: httpx.Client, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO):
        assert (
            _post(
                http, [WEB_SEARCH, {"type": "code_execution_20250825", "name": "code_execution"}]
            ).status_code
            == 200
        )
        assert live.engine.requests[-1].tools is None
        assert _post(http, [BASH, {"type": "computer_toolset_20260801"}, WEB_SEARCH]).status_code == 200
        assert list(_functions(live)) == ["bash"]
    skipped = [r.getMessage() for r in caplog.records if "Anthropic's servers run" in r.getMessage()]
    assert len(skipped) == 2 and "web_search" in skipped[0] and "code_execution" in skipped[0]


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "web_search"}, {"type": "any"}])
def test_a_forced_server_tool_is_a_400_naming_it(http: httpx.Client, choice: dict[str, Any]) -> None:
    reply = _post(http, [WEB_SEARCH], tool_choice=choice)
    body = assert_error_shape("/v1/messages", reply, 400)
    assert "Anthropic's servers" in body["error"]["message"]
    if choice["type"] == "tool":
        assert "web_search" in body["error"]["message"]


def test_a_forced_client_tool_is_a_required_call(live: LiveServer, http: httpx.Client) -> None:
    call = {"name": "bash", "arguments": {"command": "pwd"}}
    live.engine.enqueue(f"<tool_call>\n{json.dumps(call)}\n</tool_call>")
    reply = _post(http, [BASH, WEB_SEARCH], tool_choice={"type": "tool", "name": "bash"})
    assert reply.status_code == 200, reply.text
    assert live.engine.requests[-1].sampling.constraint is not None
    assert [b["name"] for b in reply.json()["content"] if b["type"] == "tool_use"] == ["bash"]
