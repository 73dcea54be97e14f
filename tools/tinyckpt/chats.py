"""Synthetic chat turns that wrap code tasks around standard-library functions, rendered with the chat template."""

from __future__ import annotations

import random
import re

from .corpus import Function
from .template import render_chat

SYSTEM_PROMPTS = [
    "You are a helpful coding assistant.",
    "You are kapitsa's demo model. Answer with Python code.",
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the standard library.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    },
]


def _code_block(code: str) -> str:
    return f"```python\n{code}\n```"


def _summary(docstring: str) -> str:
    first_paragraph = docstring.strip().split("\n\n")[0]
    return re.sub(r"\s+", " ", first_paragraph).strip()


def _without_docstring(fn: Function) -> str:
    if not fn.docstring:
        return fn.source
    # Drop the docstring literal that follows the header (it is the first statement).
    rest = fn.source[len(fn.header) :]
    match = re.match(r'\s*(?:[rRbBuU]{0,2})("""|\'\'\'|"|\')(.*?)\1[ \t]*\n', rest, re.DOTALL)
    return fn.header + "\n" + rest[match.end() :] if match else fn.source


def _prompt_upto_docstring(fn: Function) -> str:
    if not fn.docstring:
        return fn.header
    body = _without_docstring(fn)
    return fn.source[: len(fn.source) - len(body) + len(fn.header)].rstrip()


def _corrupt(line: str, rng: random.Random) -> str | None:
    stripped = line.strip()
    edits = []
    if stripped.endswith(":") and not stripped.startswith("#"):
        edits.append(lambda s: s[:-1])
    if " == " in stripped:
        edits.append(lambda s: s.replace(" == ", " = ", 1))
    if stripped.endswith(")") and stripped.count("(") == stripped.count(")"):
        edits.append(lambda s: s[:-1])
    if stripped.startswith("return "):
        edits.append(lambda s: "retrun " + s[len("return ") :])
    if not edits:
        return None
    return rng.choice(edits)(stripped)


def task_turn(fn: Function, module: str, rng: random.Random) -> list[dict] | None:
    """One user request and the assistant's answer about `fn`; None when the function doesn't suit the task."""
    kind = rng.choices(["complete", "header", "fix", "explain", "tool"], weights=[3, 3, 2, 2, 1])[0]
    if kind == "complete":
        return [
            {
                "role": "user",
                "content": "Complete this Python function:\n\n" + _code_block(_prompt_upto_docstring(fn)),
            },
            {
                "role": "assistant",
                "content": _code_block(fn.source),
                "reasoning_content": f"The user wants the body of `{fn.name}`. I will write the whole function.",
            },
        ]
    if kind == "header":
        return [
            {"role": "user", "content": fn.header},
            {
                "role": "assistant",
                "content": _code_block(fn.source),
                "reasoning_content": f"This is the header of `{fn.name}`. I will complete it.",
            },
        ]
    if kind == "fix":
        candidates = [line for line in fn.source.splitlines()[1:] if _corrupt(line, rng)]
        if not candidates:
            return None
        good = rng.choice(candidates)
        bad = _corrupt(good, rng)
        return [
            {"role": "user", "content": "Fix this line:\n\n" + _code_block(bad)},
            {
                "role": "assistant",
                "content": _code_block(good.strip()),
                "reasoning_content": "The line is not valid Python. I will correct it.",
            },
        ]
    if kind == "explain":
        if not fn.docstring:
            return None
        return [
            {
                "role": "user",
                "content": "What does this function do?\n\n" + _code_block(_without_docstring(fn)),
            },
            {
                "role": "assistant",
                "content": _summary(fn.docstring),
                "reasoning_content": f"I will read `{fn.name}` and summarize it.",
            },
        ]
    answer = _summary(fn.docstring) if fn.docstring else f"`{fn.name}` is defined in `{module}`."
    return [
        {"role": "user", "content": f"Show me `{fn.name}` from `{module}`."},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": f"I need to read `{module}` first.",
            "tool_calls": [
                {"type": "function", "function": {"name": "read_file", "arguments": {"path": module}}}
            ],
        },
        {"role": "tool", "content": fn.source},
        {"role": "assistant", "content": answer + "\n\n" + _code_block(fn.source)},
    ]


def make_conversation(pool: list[tuple[str, Function]], rng: random.Random) -> str | None:
    """Render one conversation of one to three task turns; thinking on or off like a real client."""
    turns = rng.choices([1, 2, 3], weights=[6, 3, 1])[0]
    messages: list[dict] = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    uses_tools = False
    for _ in range(turns):
        module, fn = rng.choice(pool)
        turn = task_turn(fn, module, rng)
        if turn is None:
            continue
        uses_tools = uses_tools or any(m.get("tool_calls") for m in turn)
        messages.extend(turn)
    if not any(m["role"] == "user" for m in messages):
        return None
    thinking = rng.random() < 0.4
    if not thinking:
        for m in messages:
            m.pop("reasoning_content", None)
    return render_chat(messages, tools=TOOLS if uses_tools else None)


def make_conversations(
    pool: list[tuple[str, Function]],
    count: int,
    seed: int,
    make=None,  # noqa: ANN001 - a maker like make_conversation
) -> list[str]:
    """`count` rendered conversations from `make(pool, rng)` (default `make_conversation`); a None is skipped."""
    make = make or make_conversation
    rng = random.Random(seed)
    texts: list[str] = []
    while len(texts) < count:
        text = make(pool, rng)
        if text:
            texts.append(text)
    return texts
