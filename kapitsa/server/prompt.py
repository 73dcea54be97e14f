"""Prompt hygiene shared by all three APIs: one leading system message, and no per-request noise in it.

Chat templates (Qwen3.5 raises on it) want at most one system message, first. Claude Code sends a
mid-conversation `system` message and Codex two `developer` messages; they are folded into the first
system message in order, so the prefix stays stable from turn to turn and the prefix cache keeps hitting.
"""

from __future__ import annotations

import json
import re
from typing import Any

# Claude Code (>= 2.1.69) may start the system prompt with a line whose hash changes per conversation:
# "x-anthropic-billing-header: cc_version=…; cc_entrypoint=…; cch=…;". Kept, it defeats the prefix cache.
_BILLING_LINE = re.compile(r"^\s*x-anthropic-billing-header:[^\n]*(\n|$)", re.IGNORECASE)
SYSTEM_ROLES = ("system", "developer")


def strip_attribution(text: str) -> str:
    """`text` without a leading Claude Code billing/attribution line."""
    return (
        _BILLING_LINE.sub("", text, count=1)
        if text.lstrip()[:27].lower() == "x-anthropic-billing-header:"
        else text
    )


def fold_system_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """All system/developer messages merged (in order) into one leading `system` message."""
    system_texts = [strip_attribution(m["content"]) for m in messages if m["role"] in SYSTEM_ROLES]
    rest = [m for m in messages if m["role"] not in SYSTEM_ROLES]
    system_texts = [t for t in system_texts if t.strip()]
    if not system_texts:
        return rest
    return [{"role": "system", "content": "\n\n".join(system_texts)}, *rest]


def parse_arguments(arguments: Any) -> Any:
    """Tool-call arguments as a dict for the chat template (HF convention), from a JSON string when possible."""
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            return arguments
        return parsed if isinstance(parsed, dict) else arguments
    return arguments


def json_mode_instruction(schema: dict[str, Any] | None) -> str:
    """System-prompt text that asks for JSON: beside the grammar a model writes better JSON when told
    to, and beside tools (no grammar holds the answer then) it is all that asks."""
    if schema is None:
        return "Respond with a single valid JSON object and nothing else."
    return (
        "Respond with a single valid JSON value matching this JSON schema, and nothing else:\n"
        + json.dumps(schema)
    )
