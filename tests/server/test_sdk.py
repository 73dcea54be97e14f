"""The official `openai` and `anthropic` SDKs against a real uvicorn server with the scripted FakeEngine."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
from server_harness import LiveServer, live_server

from kapitsa.engine.types import ModelInfo, ThinkingPrompt
from kapitsa.testing.fake_engine import FakeEngine

BASH = {
    "type": "object",
    "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}},
    "required": ["command"],
}
CHAT_TOOLS = [{"type": "function", "function": {"name": "Bash", "description": "run", "parameters": BASH}}]
XML_CALL = "<tool_call>\n<function=Bash>\n<parameter=command>\necho hi > out.txt\n</parameter>\n<parameter=timeout>\n30\n</parameter>\n</function>\n</tool_call>"


@pytest.fixture
def oai(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.v1, api_key="x", max_retries=0, timeout=10)


@pytest.fixture
def claude(live: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=live.url, api_key="x", max_retries=0, timeout=10)


def test_models_lists_the_engine_model(oai: openai.OpenAI) -> None:
    assert [m.id for m in oai.models.list()] == ["fake"]


def test_chat_non_stream_shape_and_cached_usage(live: LiveServer, oai: openai.OpenAI) -> None:
    live.engine.enqueue("Hello world", cached_tokens=5)
    out = oai.chat.completions.create(
        model="fake",
        messages=[{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}],
        max_completion_tokens=50,
    )
    assert out.object == "chat.completion"
    assert out.choices[0].message.content == "Hello world"
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.prompt_tokens_details.cached_tokens == 5
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    sent = live.engine.requests[-1]
    assert sent.messages[0] == {"role": "system", "content": "be brief"}  # developer → system
    assert sent.sampling.max_tokens == 50


def test_chat_stream_order_with_reasoning_tool_call_and_usage(live: LiveServer, oai: openai.OpenAI) -> None:
    live.engine.enqueue(["<thi", "nk>let me", " think</th", "ink>\n\nOK ", XML_CALL[:20], XML_CALL[20:]])
    stream = oai.chat.completions.create(
        model="fake",
        messages=[{"role": "user", "content": "go"}],
        tools=CHAT_TOOLS,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    reasoning = "".join(
        getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices
    )
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert reasoning == "let me think"
    assert content == "OK "
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert len(calls) == 1 and calls[0].id and calls[0].function.name == "Bash"
    assert json.loads(calls[0].function.arguments) == {"command": "echo hi > out.txt", "timeout": 30}
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["tool_calls"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    # The fake counts a token a character; the event that crosses </think> counts all but its answer.
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == len(
        "<think>let me think</think>\n\n"
    )


def test_chat_tool_round_trip_reaches_the_template(live: LiveServer, oai: openai.OpenAI) -> None:
    oai.chat.completions.create(
        model="fake",
        tools=CHAT_TOOLS,
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "go"}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "Bash", "arguments": '{"command":"ls"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "a.txt"},
        ],
    )
    sent = live.engine.requests[-1]
    assert sent.messages[1]["tool_calls"][0]["function"]["arguments"] == {"command": "ls"}
    assert sent.messages[2] == {"role": "tool", "content": "a.txt", "tool_call_id": "c1"}
    assert sent.tools[0]["function"]["name"] == "Bash"


def test_chat_logprobs_and_json_mode(live: LiveServer, oai: openai.OpenAI) -> None:
    live.engine.enqueue('{"a": 1}')
    out = oai.chat.completions.create(
        model="fake",
        messages=[{"role": "user", "content": "json"}],
        logprobs=True,
        top_logprobs=2,
        response_format={"type": "json_object"},
    )
    assert json.loads(out.choices[0].message.content) == {"a": 1}
    assert live.engine.requests[-1].sampling.logprobs == 2
    assert "JSON" in live.engine.requests[-1].messages[0]["content"]


def test_ignore_eos_reaches_the_engine_on_both_apis(live: LiveServer, oai: openai.OpenAI) -> None:
    """vLLM's `ignore_eos` extension (benchmark clients send it) goes through; absent, EOS stops."""
    live.engine.enqueue("a")
    oai.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "go"}], extra_body={"ignore_eos": True}
    )
    assert live.engine.requests[-1].sampling.ignore_eos is True
    live.engine.enqueue("b")
    oai.completions.create(model="fake", prompt="Say", max_tokens=5, extra_body={"ignore_eos": True})
    assert live.engine.requests[-1].sampling.ignore_eos is True
    live.engine.enqueue("c")
    oai.chat.completions.create(model="fake", messages=[{"role": "user", "content": "go"}])
    assert live.engine.requests[-1].sampling.ignore_eos is False


def test_completions_stream_and_not(live: LiveServer, oai: openai.OpenAI) -> None:
    live.engine.enqueue("one two")
    out = oai.completions.create(model="fake", prompt="Say", max_tokens=20)
    assert out.object == "text_completion" and out.choices[0].text == "one two"
    assert live.engine.requests[-1].prompt == "Say"
    live.engine.enqueue("<think>raw</think> text")
    chunks = list(oai.completions.create(model="fake", prompt="Say", max_tokens=50, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == "<think>raw</think> text"  # raw: nothing parsed
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_responses_stream_event_order(live: LiveServer, oai: openai.OpenAI) -> None:
    live.engine.enqueue("<think>hmm</think>Sure. " + XML_CALL, cached_tokens=3)
    tools = [{"type": "function", "name": "Bash", "parameters": BASH, "strict": False}]
    events = list(
        oai.responses.create(
            model="fake",
            input=[
                {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "sys"}]},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "go"}]},
            ],
            tools=tools,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.type for i in done] == ["reasoning", "message", "function_call"]
    assert json.loads(done[2].arguments) == {"command": "echo hi > out.txt", "timeout": 30}
    final = events[-1].response
    assert final.usage.input_tokens_details.cached_tokens == 3
    assert 0 < final.usage.output_tokens_details.reasoning_tokens < final.usage.output_tokens
    assert kinds.index("response.function_call_arguments.done") < kinds.index("response.completed")


def test_responses_non_stream_and_history_items(live: LiveServer, oai: openai.OpenAI) -> None:
    live.engine.enqueue("done")
    out = oai.responses.create(
        model="fake",
        instructions="be nice",
        input=[
            {"type": "message", "role": "user", "content": "go"},
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "earlier thought"},
            {"type": "function_call", "call_id": "c1", "name": "Bash", "arguments": '{"command":"ls"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "a.txt"},
        ],
    )
    assert out.status == "completed" and out.output_text == "done"
    sent = live.engine.requests[-1].messages
    assert sent[0] == {"role": "system", "content": "be nice"}
    assert sent[2]["tool_calls"][0]["function"]["arguments"] == {"command": "ls"}
    assert sent[2]["reasoning_content"] == "earlier thought"
    assert sent[3] == {"role": "tool", "content": "a.txt", "tool_call_id": "c1"}


def test_messages_non_stream_with_thinking_tool_use_and_cache(
    live: LiveServer, claude: anthropic.Anthropic
) -> None:
    live.engine.enqueue("<think>ponder</think>Running it." + XML_CALL, cached_tokens=7)
    msg = claude.messages.create(
        model="claude-kapitsa-test",
        max_tokens=1000,
        system=[{"type": "text", "text": "sys", "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": "go"}],
        tools=[{"name": "Bash", "description": "run", "input_schema": BASH}],
    )
    assert [b.type for b in msg.content] == ["thinking", "text", "tool_use"]
    assert msg.content[2].input == {"command": "echo hi > out.txt", "timeout": 30}
    assert msg.stop_reason == "tool_use"
    assert msg.usage.cache_read_input_tokens == 7
    assert msg.model == "claude-kapitsa-test"  # Claude names map to the default model, and are echoed


def test_messages_stream_event_order(live: LiveServer, claude: anthropic.Anthropic) -> None:
    live.engine.enqueue("<think>a</think>Hello there")
    with claude.messages.stream(
        model="fake", max_tokens=100, messages=[{"role": "user", "content": "hi"}]
    ) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds[-2] == "message_delta"
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[1].text == "Hello there" and final.stop_reason == "end_turn"
    assert final.usage.input_tokens > 0


def test_messages_stop_sequence_and_tool_result_history(
    live: LiveServer, claude: anthropic.Anthropic
) -> None:
    live.engine.enqueue("one two STOP three")
    msg = claude.messages.create(
        model="fake",
        max_tokens=100,
        stop_sequences=["STOP"],
        messages=[
            {"role": "user", "content": "go"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "t", "signature": "s"},
                    {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [{"type": "text", "text": "a.txt"}],
                    },
                    {"type": "text", "text": "next"},
                ],
            },
        ],
    )
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == "STOP"
    assert msg.content[0].text == "one two "
    sent = live.engine.requests[-1].messages
    assert sent[1]["reasoning_content"] == "t" and sent[1]["tool_calls"][0]["function"]["arguments"] == {
        "command": "ls"
    }
    assert sent[2] == {"role": "tool", "tool_call_id": "toolu_1", "content": "a.txt"}
    assert sent[3] == {"role": "user", "content": "next"}


def test_count_tokens(live: LiveServer, claude: anthropic.Anthropic) -> None:
    out = claude.messages.count_tokens(model="fake", messages=[{"role": "user", "content": "hi"}])
    assert out.input_tokens > 0


def test_thinking_model_starts_in_reasoning() -> None:
    engine = FakeEngine(
        model=ModelInfo(
            id="q",
            family="fake",
            context_length=4096,
            max_output_tokens=1024,
            supports_thinking=True,
            thinking_prompt=ThinkingPrompt(by_default=True, when_enabled=True),
        )
    )
    engine.enqueue("planning</think>\n\nanswer")
    with live_server(engine) as live:
        out = openai.OpenAI(base_url=live.v1, api_key="x", max_retries=0).chat.completions.create(
            model="q", messages=[{"role": "user", "content": "hi"}]
        )
    assert out.choices[0].message.content == "answer"
    assert out.choices[0].message.reasoning_content == "planning"  # type: ignore[attr-defined]


def test_chat_logprobs_are_reported_stream_and_not(live: LiveServer, oai: openai.OpenAI) -> None:
    live.engine.enqueue("ab")
    out = oai.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=2
    )
    content = out.choices[0].logprobs.content
    assert [t.token for t in content] == ["a", "b"] and content[0].logprob == -0.5
    assert [alt.token for alt in content[0].top_logprobs] == ["b", "c"]
    live.engine.enqueue("ab")
    chunks = list(
        oai.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "x"}], logprobs=True, stream=True
        )
    )
    streamed = [
        t.token for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content
    ]
    assert streamed == ["a", "b"]


def test_completions_logprobs(live: LiveServer, oai: openai.OpenAI) -> None:
    live.engine.enqueue("hi")
    out = oai.completions.create(model="fake", prompt="x", logprobs=1)
    assert out.choices[0].logprobs.tokens == ["h", "i"] and out.choices[0].logprobs.text_offset == [0, 1]


def test_models_list_reads_with_the_anthropic_sdk_too(claude: anthropic.Anthropic) -> None:
    page = claude.models.list()
    assert [m.id for m in page.data] == ["fake"] and page.data[0].type == "model"


def test_responses_freeform_custom_tool_round_trip(live: LiveServer, oai: openai.OpenAI) -> None:
    patch = "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch"
    live.engine.enqueue(
        ["<tool_call>", json.dumps({"name": "apply_patch", "arguments": {"input": patch}}), "</tool_call>"]
    )
    tools = [
        {"type": "custom", "name": "apply_patch", "description": "edit files", "format": {"type": "text"}}
    ]
    out = oai.responses.create(model="fake", input="edit", tools=tools)
    call = out.output[-1]
    assert call.type == "custom_tool_call" and call.name == "apply_patch" and call.input == patch
    oai.responses.create(
        model="fake",
        input=[
            {"type": "message", "role": "user", "content": "edit"},
            {"type": "custom_tool_call", "call_id": call.call_id, "name": "apply_patch", "input": patch},
            {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "Done"},
        ],
        tools=tools,
    )
    sent = live.engine.requests[-1].messages
    assert sent[1]["tool_calls"][0]["function"] == {"name": "apply_patch", "arguments": {"input": patch}}
    assert sent[2] == {"role": "tool", "content": "Done", "tool_call_id": call.call_id}


@pytest.mark.parametrize("parallel", [True, False])
def test_parallel_calls_off_keeps_the_first_call_on_every_api(live: LiveServer, parallel: bool) -> None:
    """An `auto` turn that writes two calls: all three APIs return both, or only the first when the
    request turns parallel calls off (`parallel_tool_calls`, `disable_parallel_tool_use`)."""
    import httpx

    second = XML_CALL.replace("echo hi > out.txt", "pwd")
    bash = {"name": "Bash", "description": "run", "parameters": BASH}
    asks = [
        (
            "/v1/chat/completions",
            {
                "tools": CHAT_TOOLS,
                "parallel_tool_calls": parallel,
                "messages": [{"role": "user", "content": "go"}],
            },
        ),
        (
            "/v1/responses",
            {"tools": [{"type": "function", **bash}], "parallel_tool_calls": parallel, "input": "go"},
        ),
        (
            "/v1/messages",
            {
                "max_tokens": 1000,
                "messages": [{"role": "user", "content": "go"}],
                "tools": [{"name": "Bash", "input_schema": BASH}],
                "tool_choice": {"type": "auto", "disable_parallel_tool_use": not parallel},
            },
        ),
    ]
    with httpx.Client(base_url=live.url, timeout=10) as http:
        for path, body in asks:
            live.engine.enqueue([XML_CALL, "\n", second])
            reply = http.post(path, json={"model": "fake", **body}).json()
            if path == "/v1/chat/completions":
                calls = reply["choices"][0]["message"]["tool_calls"]
            elif path == "/v1/responses":
                calls = [i for i in reply["output"] if i["type"] == "function_call"]
            else:
                calls = [b for b in reply["content"] if b["type"] == "tool_use"]
            assert len(calls) == (2 if parallel else 1), (path, reply)


def test_responses_logprobs_are_reported_stream_and_not(live: LiveServer, oai: openai.OpenAI) -> None:
    """`include: message.output_text.logprobs` fills output_text's logprobs and the stream's text
    deltas (`top_logprobs` alternatives each); without it they stay empty."""
    live.engine.enqueue("ab")
    out = oai.responses.create(
        model="fake", input="x", top_logprobs=2, include=["message.output_text.logprobs"]
    )
    logprobs = out.output[0].content[0].logprobs
    assert [t.token for t in logprobs] == ["a", "b"] and logprobs[0].logprob == -0.5
    assert [alt.token for alt in logprobs[0].top_logprobs] == ["b", "c"]
    live.engine.enqueue("ab")
    events = list(
        oai.responses.create(model="fake", input="x", include=["message.output_text.logprobs"], stream=True)
    )
    streamed = [lp.token for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert streamed == ["a", "b"]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert [lp.token for lp in done.logprobs] == ["a", "b"]
    live.engine.enqueue("ab")
    assert oai.responses.create(model="fake", input="x").output[0].content[0].logprobs == []
    live.engine.enqueue("ab")  # top_logprobs alone sets a count; `include` asks for them
    assert oai.responses.create(model="fake", input="x", top_logprobs=2).output[0].content[0].logprobs == []


@pytest.mark.parametrize(
    "thinking,kwargs",
    [
        (None, (("enable_thinking", False),)),
        ({"type": "adaptive"}, ()),
        ({"type": "enabled", "budget_tokens": 1024}, (("enable_thinking", True),)),
    ],
)
def test_messages_without_thinking_do_not_think(live: LiveServer, thinking, kwargs) -> None:
    """The Messages API's default is no thinking; `adaptive` leaves the template's default."""
    import httpx

    live.engine.enqueue("hi")
    body = {"model": "fake", "max_tokens": 50, "messages": [{"role": "user", "content": "x"}]}
    if thinking is not None:
        body["thinking"] = thinking
    with httpx.Client(base_url=live.url, timeout=10) as http:
        assert http.post("/v1/messages", json=body).status_code == 200
    assert live.engine.requests[-1].chat_template_kwargs == kwargs


def test_responses_allowed_tools_skip_hosted_and_namespace_entries(live: LiveServer) -> None:
    """OpenAI's own example lists hosted tools beside functions; a namespace allows its functions."""
    import httpx

    tools = [
        {"type": "function", "name": "get_weather", "parameters": {"type": "object"}},
        {
            "type": "namespace",
            "name": "agents",
            "tools": [{"type": "function", "name": "spawn", "parameters": {"type": "object"}}],
        },
        {"type": "function", "name": "other", "parameters": {"type": "object"}},
    ]
    allowed = [
        {"type": "function", "name": "get_weather"},
        {"type": "mcp", "server_label": "deepwiki"},
        {"type": "image_generation"},
        {"type": "namespace", "name": "agents", "tools": [{"type": "function", "name": "spawn"}]},
    ]
    live.engine.enqueue("hi")
    with httpx.Client(base_url=live.url, timeout=10) as http:
        body = {
            "model": "fake",
            "input": "x",
            "tools": tools,
            "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": allowed},
        }
        assert http.post("/v1/responses", json=body).status_code == 200
    sent = [t["function"]["name"] for t in live.engine.requests[-1].tools]
    assert sorted(sent) == ["get_weather", "spawn"]


def test_responses_logprobs_of_held_back_text_reach_the_text_that_follows() -> None:
    """A step whose text the parser holds (a split UTF-8 character) gives its logprobs to the next
    answer text; reasoning tokens' logprobs are not the answer's."""
    from kapitsa.engine.types import FinishEvent, TokenLogprob, Usage
    from kapitsa.server.output import ReasoningPart, TextPart
    from kapitsa.server.responses_events import ResponseBuilder

    def lp(token: str) -> tuple[TokenLogprob, ...]:
        return (TokenLogprob(token_id=0, token=token, logprob=-1.0),)

    builder = ResponseBuilder(response_id="r", model="m", namespaces={}, custom=set())
    builder.parts([ReasoningPart("hm")], lp("hm"))
    builder.parts([TextPart("a")], lp("a"))
    builder.parts([], lp("\xe2"))  # held: half a character
    builder.parts([TextPart("€b")], lp("b"))
    response = builder.finish(FinishEvent(request_id="r", finish_reason="stop", usage=Usage(1, 3)), 1)
    text = next(i for i in response["output"] if i["type"] == "message")["content"][0]
    assert text["text"] == "a€b" and [e["token"] for e in text["logprobs"]] == ["a", "\xe2", "b"]
