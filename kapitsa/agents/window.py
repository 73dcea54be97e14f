"""Whether a model's context window holds an agent's first request, and which catalog model would.

The sizes are each agent's first request (system prompt, tool schemas, one user line) from the captures in
shared/docs/agent-captures, rendered by kapitsa's server with the demo's chat template and counted with
its tokenizer (the largest capture per agent, rounded up). Qwen3.5's larger vocabulary needs fewer tokens,
and bytes/4 of the rendered prompt is about 80% of these figures, so a model that holds them holds the
real request.
"""

from __future__ import annotations

from dataclasses import dataclass

from kapitsa import memory_estimate
from kapitsa.catalog import Architecture, Catalog, CatalogEntry, arch_for_folder, package_model_path
from kapitsa.errors import KapitsaError

ANSWER_ROOM_TOKENS = 4096  # a first answer with a tool call or two


@dataclass(slots=True, frozen=True)
class AgentNeed:
    label: str
    first_request_tokens: int

    @property
    def context_tokens(self) -> int:
        return self.first_request_tokens + ANSWER_ROOM_TOKENS


AGENT_NEEDS: dict[str, AgentNeed] = {
    "claude": AgentNeed("Claude Code", 28_000),  # 24.9k-28.0k over 4 captures (bytes/4: 19.2k-21.5k)
    "codex": AgentNeed("Codex", 11_800),  # 11.6k-11.8k over 4 captures (bytes/4: 9.9k-10.0k)
    "opencode": AgentNeed("opencode", 9_000),  # 8.9k-9.0k with its tools (bytes/4: 7.8k-7.9k)
    "pi": AgentNeed("pi", 1_800),  # 1.7k-1.8k over 4 captures (bytes/4: 1.4k-1.5k)
}


class WindowTooSmall(KapitsaError):
    """The model's context window cannot hold the agent's first request: it would only get a 400."""


def window_shortfall(agent: str, model: str, context_window: int) -> str | None:
    """One sentence saying why `model` cannot run `agent`, or None when its window holds the agent."""
    need = AGENT_NEEDS.get(agent)
    if need is None or context_window >= need.context_tokens:
        return None
    return (
        f"{need.label}'s first request is about {need.first_request_tokens:,} tokens, but {model}'s "
        f"context window is {context_window:,} tokens"
    )


def suggest_model(
    catalog: Catalog, agent: str, *, exclude: str, usable_bytes: int | None, num_checkpoints: int
) -> str | None:
    """A catalog alias whose window (capped by this machine's memory when known) holds `agent`.

    Of those that fit the machine comfortably, the most capable; else the most capable that fits at all.
    Without a memory figure, the smallest: the likeliest to run anywhere.
    """
    need = AGENT_NEEDS[agent].context_tokens
    scored = []
    for entry in catalog:
        arch = _arch(entry)
        if entry.alias == exclude or arch is None:
            continue
        window, comfortable = _window_on_this_machine(entry, arch, usable_bytes, num_checkpoints)
        if window >= need:
            key = (comfortable, entry.rank) if usable_bytes else (True, -arch.params_b)
            scored.append((key, entry.alias))
    return max(scored)[1] if scored else None


def _window_on_this_machine(
    entry: CatalogEntry, arch: Architecture, usable_bytes: int | None, num_checkpoints: int
) -> tuple[int, bool]:
    if not usable_bytes:
        return arch.context_length, True
    quant = entry.quant(None) if entry.quants else None
    bits = quant.bits_per_weight if quant else 16.0
    estimate = memory_estimate.estimate(
        arch,
        usable_bytes=usable_bytes,
        weight_bytes=memory_estimate.weights_bytes(arch, bits),
        num_checkpoints=num_checkpoints,
    )
    if estimate.verdict == "too_big":
        return 0, False
    return estimate.max_context, estimate.verdict == "fits"


def _arch(entry: CatalogEntry) -> Architecture | None:
    if entry.arch is not None:
        return entry.arch
    if entry.package_path is None:
        return None
    try:
        return arch_for_folder(package_model_path(entry))
    except KapitsaError:
        return None
