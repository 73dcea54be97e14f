"""Two open gaps of #32's table, in one process per shape, kapitsa's engine only:

- after an 8k prompt Qwen's decode slows in both engines (docs/results.md): decode after 512 and
  8192 prompt tokens, each for --tokens and 4x as many tokens; a fixed delay at the start of
  decoding (a first step that pays for the prefill's aftermath) shrinks per token as the run
  grows, a per-step cost does not;
- on the MoE shapes a 1-stream burst of the batch sweep ran below batch-1 decode: the same prompt
  and tokens through an engine as the benchmarks build it, one with room for 16 streams, and one
  that also readied batch sizes 1-16 first (as `kapitsa serve`'s does on a GPU).

    python lab/decode_gaps.py --shapes 4b nemotron-30b-a3b [--tokens 64] [--rounds 2]
    python lab/decode_gaps.py --tiny --shapes 4b --tokens 8     # a smoke run on any machine

One JSON line per run (`case`, `decode_tok_s`), then per shape a summary of medians.
"""

from __future__ import annotations

import argparse
import gc
import statistics

import mlx.core as mx

from kapitsa.testing.tiny import tiny_config
from lab.batch_sweep import engine as sweep_engine
from lab.batch_sweep import wait_warm
from lab.engine_timing import emit, generate, kapitsa_engine
from lab.models_under_test import DTYPE, SHAPES, TINY, kapitsa_model, prompt_ids

STREAMS = 16  # the sweep's largest batch


def timed(model, prompt: list[int], tokens: int, *, room: int = 0, warm: bool = False) -> dict:
    """Decode tok/s through the decode benchmark's engine (`room` 0) or the batch sweep's, with
    room for `room` streams (`warm`: its batch sizes readied first, on a GPU as serve's are)."""
    if room:
        client = sweep_engine(model, len(prompt), tokens, room, warm)
    else:
        client = kapitsa_engine(model, len(prompt), tokens)
    try:
        warm_s = wait_warm(client) if warm else 0.0
        generate(client, prompt, 8)  # compiles what the timed run meets
        rate = generate(client, prompt, tokens)["decode_tok_s"]
        return dict(decode_tok_s=round(rate, 1), warmup_s=round(warm_s, 1))
    finally:
        client.close()


def cases(tokens: int, long_prompt: int) -> dict:
    """case name -> (prompt length, tokens, engine kind)."""
    return {
        "512": (512, tokens, {}),
        f"512x{4 * tokens}": (512, 4 * tokens, {}),
        f"{long_prompt}": (long_prompt, tokens, {}),
        f"{long_prompt}x{4 * tokens}": (long_prompt, 4 * tokens, {}),
        "512 room16": (512, tokens, {"room": STREAMS}),
        "512 room16 warmed": (512, tokens, {"room": STREAMS, "warm": True}),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["4b", "nemotron-30b-a3b"])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--long-prompt", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tiny", action="store_true", help="tiny widths: a smoke run on CPU")
    args = ap.parse_args()
    table = TINY if args.tiny else SHAPES
    if args.tiny:
        DTYPE["value"] = mx.float32
    print(f"mlx {mx.__version__} on {mx.default_device()}", flush=True)
    for shape in args.shapes:
        kind, dims = table[shape]
        model = kapitsa_model(tiny_config(kind, **dims))
        vocab = dims.get("vocab_size", 512)
        rates: dict[str, list[float]] = {}
        for rnd in range(args.rounds):
            for case, (plen, tokens, kind_of) in cases(args.tokens, args.long_prompt).items():
                row = timed(model, prompt_ids(plen, vocab), tokens, **kind_of)
                rates.setdefault(case, []).append(row["decode_tok_s"])
                emit(dict(shape=shape, case=case, round=rnd, **row))
        emit(dict(summary=shape, **{case: round(statistics.median(r), 1) for case, r in rates.items()}))
        del model
        gc.collect()
        mx.clear_cache()


if __name__ == "__main__":
    main()
