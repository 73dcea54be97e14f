"""opencode: a provider handed over inline in OPENCODE_CONFIG_CONTENT; no opencode file is written.

opencode merges that JSON over the user's own config files, so their other providers stay usable.
The title request (`small_model`) goes to the same local model.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from kapitsa.agents.base import LaunchContext
from kapitsa.agents.context import default_context
from kapitsa.errors import KapitsaError

BINARY = "opencode"
INSTALL = "npm install -g opencode-ai"
EXTRA_DIRS = ()
PROVIDER = "kapitsa"


def provider_config(ctx: LaunchContext) -> dict[str, Any]:
    model_ref = f"{PROVIDER}/{ctx.model_id}"
    return {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            PROVIDER: {
                "npm": "@ai-sdk/openai-compatible",
                "name": "kapitsa",
                "options": {"baseURL": ctx.openai_base_url, "apiKey": ctx.api_key},
                "models": {
                    ctx.model_id: {
                        "name": ctx.model_name,
                        "limit": {"context": ctx.context_window, "output": ctx.max_output},
                        "reasoning": ctx.reasoning,
                        "tool_call": True,
                    }
                },
            }
        },
        "model": model_ref,
        "small_model": model_ref,
    }


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in over.items():
        merged[key] = (
            _deep_merge(merged[key], value)
            if isinstance(value, dict) and isinstance(merged.get(key), dict)
            else value
        )
    return merged


def build_env(
    server_url: str, model: str, ctx: LaunchContext | None = None, environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The variables to add to the agent's environment; `environ` supplies any inline config to merge over."""
    ctx = ctx or default_context(server_url, model)
    config = provider_config(ctx)
    existing = (os.environ if environ is None else environ).get("OPENCODE_CONFIG_CONTENT")
    if existing:  # the user's own inline overrides stay; ours win where they collide
        try:
            user = json.loads(existing)
        except ValueError as err:
            raise KapitsaError(
                f"OPENCODE_CONFIG_CONTENT in your environment is not valid JSON: {err}"
            ) from err
        if not isinstance(user, dict):
            raise KapitsaError("OPENCODE_CONFIG_CONTENT in your environment is not valid JSON: not an object")
        config = _deep_merge(user, config)
    return {"OPENCODE_CONFIG_CONTENT": json.dumps(config)}


def build_command(args: list[str], ctx: LaunchContext | None = None, binary: str | None = None) -> list[str]:
    return [binary or BINARY, *args]  # the model comes from the inline config
