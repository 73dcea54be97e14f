"""Agent-shaped conversations: a long system prompt and many tool definitions before one short task.

Coding agents open with 9k-30k tokens of instructions and JSON-schema tools, then the user's
request; the demo must read that much and still answer briefly and stop. These conversations give
it that shape from the same standard-library material: prose from docstrings, code listings and
tools made from function signatures, then one task from chats.task_turn.
"""

from __future__ import annotations

import random
import re

from .chats import TOOLS, make_conversations, task_turn
from .corpus import Function
from .template import render_chat

PREAMBLES = [
    "You are an interactive coding agent working in the user's repository.",
    "You are a software engineering assistant. Use the tools to read and change files.",
    "You are kapitsa's demo model, driven by a coding agent.",
]
RULES = [
    "Answer briefly.",
    "Prefer small, focused changes.",
    "Read a file before you change it.",
    "Never invent file contents.",
    "When you are done, say so in one line.",
]


def _arguments(header: str) -> list[str]:
    inside = header[header.find("(") + 1 : header.rfind(")")]
    names = []
    for part in inside.split(","):
        name = re.split(r"[:=\s]", part.strip().lstrip("*"), maxsplit=1)[0]
        if name.isidentifier() and name not in ("self", "cls"):
            names.append(name)
    return names


def tool_for(fn: Function) -> dict:
    """A function tool named after `fn`, its parameters its arguments (strings), as agents send them."""
    summary = re.sub(r"\s+", " ", (fn.docstring or f"Run {fn.name}.").strip().split("\n\n")[0])
    arguments = _arguments(fn.header)
    return {
        "type": "function",
        "function": {
            "name": fn.name,
            "description": summary,
            "parameters": {
                "type": "object",
                "properties": {a: {"type": "string", "description": f"The {a}."} for a in arguments},
                "required": arguments[:1],
            },
        },
    }


def _instructions(pool: list[tuple[str, Function]], rng: random.Random, sections: int) -> str:
    parts = [rng.choice(PREAMBLES), " ".join(rng.sample(RULES, 3))]
    for _ in range(sections):
        module, fn = rng.choice(pool)
        if fn.docstring and rng.random() < 0.6:
            parts.append(f"# {fn.name} ({module})\n\n{fn.docstring.strip()}")
        else:
            parts.append(f"Example from `{module}`:\n\n```python\n{fn.source}\n```")
    return "\n\n".join(parts)


def make_agent_conversation(pool: list[tuple[str, Function]], rng: random.Random) -> str | None:
    """Render one agent-shaped conversation (no thinking, as agents ask by default)."""
    module, fn = rng.choice(pool)
    turn = task_turn(fn, module, rng)
    if turn is None:
        return None
    for message in turn:
        message.pop("reasoning_content", None)
    tools = [tool_for(f) for _, f in rng.sample(pool, rng.randint(4, 40))] + TOOLS
    rng.shuffle(tools)
    system = {"role": "system", "content": _instructions(pool, rng, rng.randint(10, 160))}
    return render_chat([system, *turn], tools=tools)


def make_agent_conversations(pool: list[tuple[str, Function]], count: int, seed: int) -> list[str]:
    return make_conversations(pool, count, seed, make_agent_conversation)
