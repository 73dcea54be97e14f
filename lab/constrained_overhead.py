"""Per-token cost of constrained decoding on a tiny random checkpoint (CPU): decode time per token
with and without a JSON Schema grammar, at batch 1 and 8, greedy, fixed length (ignore_eos off,
an always-open string so the grammar never ends early).

    .venv/bin/python lab/constrained_overhead.py
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

from kapitsa.engine.inprocess import InProcessEngine
from kapitsa.engine.loading.loader import load_model
from kapitsa.engine.options import EngineConfig
from kapitsa.engine.types import Constraint, FinishEvent, GenerationRequest, SamplingParams
from kapitsa.testing.tiny import write_tiny_checkpoint

TOKENS = 128
# A long free string keeps every row inside the grammar for TOKENS tokens.
SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}


async def _decode_seconds(engine: InProcessEngine, batch: int, constrained: bool) -> tuple[float, int]:
    constraint = Constraint("json_schema", json.dumps(SCHEMA)) if constrained else None
    requests = [
        GenerationRequest(
            prompt=f"row {i}",
            sampling=SamplingParams(max_tokens=TOKENS, temperature=1.0, seed=i, constraint=constraint),
        )
        for i in range(batch)
    ]

    async def one(request: GenerationRequest) -> tuple[float, int]:
        async for event in engine.generate(request):
            if isinstance(event, FinishEvent):
                return event.usage.decode_seconds, event.usage.completion_tokens
        return 0.0, 0

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(r) for r in requests))
    wall = time.perf_counter() - t0
    return wall, sum(n for _, n in results)


async def main(kind: str) -> None:
    loaded = load_model(write_tiny_checkpoint(Path(tempfile.mkdtemp()), kind))
    engine = InProcessEngine.from_loaded(loaded, config=EngineConfig(prefill_chunk=64, prefix_cache_bytes=0))
    await _decode_seconds(engine, 2, True)  # warm up: compile the grammar compiler, traces
    for batch in (1, 8):
        rows = {}
        for constrained in (False, True, False, True):
            wall, tokens = await _decode_seconds(engine, batch, constrained)
            rows.setdefault(constrained, []).append(wall / max(tokens, 1) * batch)
        free, held = min(rows[False]), min(rows[True])
        print(
            f"{kind} batch {batch}: free {free * 1e3:.3f} ms/step, constrained {held * 1e3:.3f} ms/step, "
            f"overhead {(held - free) * 1e3:.3f} ms/step ({(held - free) / batch * 1e6:.0f} us/token)"
        )
    engine.close()


def host_cost(kind: str = "qwen3_5", steps: int = 2000) -> None:
    """The host work per constrained token alone: mask, apply to a [V] row, advance (no model)."""
    import mlx.core as mx

    from kapitsa.engine.text.constraint import GrammarCompiler

    loaded = load_model(write_tiny_checkpoint(Path(tempfile.mkdtemp()), kind))
    tok = loaded.tokenizer
    compiler = GrammarCompiler(tok.backend, vocab_size=tok.vocab_size, eos_ids=tok.eos_token_ids)
    constraint = compiler.make(Constraint("json_schema", json.dumps(SCHEMA)))
    row = mx.random.normal((compiler.vocab_size,))
    prefix = tok.encode('{"text": "')
    for token in prefix:
        constraint.advance(token)
    filler = tok.encode("a")[0]
    t0 = time.perf_counter()
    for _ in range(steps):
        constraint.prepare()
        mx.eval(constraint.apply(row))
        constraint.advance(filler)
    print(
        f"{kind} host cost: {(time.perf_counter() - t0) / steps * 1e6:.0f} us/token (vocab {compiler.vocab_size})"
    )


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "qwen3_5"))
    host_cost(sys.argv[1] if len(sys.argv) > 1 else "qwen3_5")
