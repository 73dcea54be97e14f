"""Codex CLI: `-c` overrides on the command line plus a model catalog in kapitsa's own folder.

No file under ~/.codex is written. The catalog gives Codex the model's real context window and
compaction limit (without one it falls back to 272K and warns). A catalog entry must carry Codex's
base instructions; kapitsa takes Codex's own generic ones, captured once per Codex version by letting
Codex send one request to a throwaway local endpoint. When that fails, kapitsa passes
`model_context_window` instead of a catalog.
"""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from kapitsa.agents.base import LaunchContext, reject_args
from kapitsa.agents.context import default_context
from kapitsa.errors import KapitsaError
from kapitsa.private_files import atomic_write, make_private_dir

BINARY = "codex"
INSTALL = "npm install -g @openai/codex"
EXTRA_DIRS = ()
PROVIDER = "kapitsa"
API_KEY_ENV = "KAPITSA_API_KEY"
_CONFLICTS = ("-m", "--model", "-p", "--profile", "--oss")
_CAPTURE_TIMEOUT_S = 60


def toml_string(value: str) -> str:
    return json.dumps(value)  # a JSON string of printable text is a valid TOML basic string


def provider_overrides(ctx: LaunchContext) -> list[str]:
    pairs = {
        "model_provider": toml_string(PROVIDER),
        f"model_providers.{PROVIDER}.name": toml_string("kapitsa"),
        f"model_providers.{PROVIDER}.base_url": toml_string(ctx.openai_base_url),
        f"model_providers.{PROVIDER}.wire_api": toml_string("responses"),
        f"model_providers.{PROVIDER}.env_key": toml_string(API_KEY_ENV),
        # Long prefills on a laptop: keep the stream open (default 300 s).
        f"model_providers.{PROVIDER}.stream_idle_timeout_ms": "900000",
    }
    return [arg for key, value in pairs.items() for arg in ("-c", f"{key}={value}")]


def catalog_entry(ctx: LaunchContext, base_instructions: str) -> dict[str, Any]:
    """One `ModelInfo` entry as codex-rs deserializes it (protocol/src/openai_models.rs)."""
    return {
        "slug": ctx.model_id,
        "display_name": f"{ctx.model_name} (kapitsa)",
        "description": "Local model served by kapitsa",
        "supported_reasoning_levels": [],
        "shell_type": "shell_command",
        "visibility": "list",
        "supported_in_api": True,
        "priority": 1,
        "base_instructions": base_instructions,
        "supports_reasoning_summaries": False,
        "support_verbosity": False,
        "truncation_policy": {"mode": "tokens", "limit": 10000},
        "supports_parallel_tool_calls": False,
        "context_window": ctx.context_window,
        "max_context_window": ctx.context_window,
        "experimental_supported_tools": [],
        "input_modalities": ["text"],
    }


def write_catalog(ctx: LaunchContext, base_instructions: str) -> Path:
    path = make_private_dir(ctx.state_dir / "codex") / "model-catalog.json"
    atomic_write(path, json.dumps({"models": [catalog_entry(ctx, base_instructions)]}, indent=2).encode())
    return path


def codex_version(binary: str) -> str:
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip().split()[-1] if out.stdout.strip() else "unknown"


def base_instructions(binary: str, state_dir: Path, environ: Mapping[str, str]) -> str | None:
    """Codex's generic instructions for models it has no metadata for, cached per Codex version."""
    cache = state_dir / "codex" / f"base-instructions-{codex_version(binary)}.txt"
    if cache.is_file():
        return cache.read_text("utf-8")
    captured = capture_base_instructions(binary, environ)
    if captured:
        make_private_dir(cache.parent)
        atomic_write(cache, captured.encode())
    return captured


def capture_base_instructions(binary: str, environ: Mapping[str, str]) -> str | None:
    """Run `codex exec` once against a throwaway endpoint and keep the first instructions it sends."""
    captured: list[str] = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _capture_handler(captured))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    probe = LaunchContext(
        base_url=url.removesuffix("/v1"),
        model_id="kapitsa-probe",
        model_name="probe",
        context_window=8192,
        max_output=16,
        api_key="probe",
        state_dir=Path("."),
    )
    cmd = [
        binary,
        "exec",
        "--skip-git-repo-check",
        "--ephemeral",
        "--color",
        "never",
        *provider_overrides(probe),
        "-m",
        probe.model_id,
        "reply with ok",
    ]
    try:
        subprocess.run(
            cmd,
            env={**environ, API_KEY_ENV: "probe"},
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=_CAPTURE_TIMEOUT_S,
            cwd=environ.get("HOME") or Path.home(),
        )
    except (OSError, subprocess.SubprocessError):
        pass
    finally:
        server.shutdown()
        server.server_close()
    return captured[0] if captured else None


def _first_developer_text(body: dict[str, Any]) -> str | None:
    if isinstance(body.get("instructions"), str) and body["instructions"]:
        return body["instructions"]
    for item in body.get("input", []):
        if isinstance(item, dict) and item.get("role") in ("developer", "system"):
            parts = item.get("content") or []
            texts = (
                [p.get("text", "") for p in parts if isinstance(p, dict)]
                if isinstance(parts, list)
                else [parts]
            )
            return "".join(texts) or None
    return None


def _capture_handler(captured: list[str]) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            try:
                text = _first_developer_text(json.loads(raw or b"{}"))
            except ValueError:
                text = None
            if text and not captured:
                captured.append(text)
            body = _minimal_response_stream()
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return Handler


def _minimal_response_stream() -> bytes:
    done = {
        "id": "probe",
        "object": "response",
        "status": "completed",
        "output": [],
        "usage": {
            "input_tokens": 0,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": 0,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 0,
        },
    }
    events = [
        {"type": "response.created", "response": {**done, "status": "in_progress"}},
        {"type": "response.completed", "response": done},
    ]
    return "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events).encode()


def build_env(
    server_url: str, model: str, ctx: LaunchContext | None = None, environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    ctx = ctx or default_context(server_url, model)
    return {API_KEY_ENV: ctx.api_key}


def build_command(
    args: list[str], ctx: LaunchContext | None = None, binary: str | None = None, catalog: Path | None = None
) -> list[str]:
    """`catalog`: the model catalog file; without one the context window is passed on its own."""
    if ctx is None:
        raise KapitsaError("codex needs the launch context; use kapitsa.agents.launch.agent_invocation")
    reject_args(args, _CONFLICTS, "kapitsa sets the model and provider; use `kapitsa codex --model X`")
    _reject_config_overrides(args)
    extra = (
        ["-c", f"model_catalog_json={toml_string(str(catalog))}"]
        if catalog
        else ["-c", f"model_context_window={ctx.context_window}"]
    )
    return [binary or BINARY, *provider_overrides(ctx), *extra, "-m", ctx.model_id, *args]


def _reject_config_overrides(args: list[str]) -> None:
    owned = ("model=", "model_provider", "model_providers.", "model_catalog_json", "profile=")
    for flag, value in zip(args, args[1:], strict=False):
        if flag in ("-c", "--config") and value.replace(" ", "").startswith(owned):
            reject_args(
                [value.split("=", 1)[0]],
                [value.split("=", 1)[0]],
                "kapitsa sets the model and provider for Codex",
            )
