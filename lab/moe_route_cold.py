"""Whether a MoE prefill pays ~0.25 s when the dequantize-then-grouped-GEMM route (ops/moe.py) runs
after its dense expert buffers have left MLX's buffer cache.

The table's Nemotron rounds (docs/results.md) prefill 512 tokens at ~2700 tok/s when the warm-up
request just before took the route too, and at ~1000-1200 when it did not (64 tokens x top-6 =
384 token-expert pairs, under the route's 512); the 35B-A3B's 64-token warm-up (x top-8 = 512
pairs) takes the route and shows no such step. Each case here times one prompt's first token in
one engine, after a warm-up prompt of some length and with MLX's cache cleared or not:

    route-warm      a warm-up prompt of the prompt's length (it takes the route), then the prompt
    no-route-warm   a warm-up prompt under the route's pairs, then the prompt
    cleared         a route-taking warm-up, `mx.clear_cache()`, then the prompt
    again           a route-taking warm-up and the prompt, then the prompt timed

    python lab/moe_route_cold.py --shapes nemotron-30b-a3b 35b-a3b --prompt 512 --rounds 3
    python lab/moe_route_cold.py --tiny --shapes nemotron-30b-a3b   # any machine (no route off CUDA)

Each line carries MLX's cached and active bytes before the timed prompt.
"""

from __future__ import annotations

import argparse
import gc

import mlx.core as mx

from kapitsa.engine.ops.moe import MOE_DEQUANT_MIN_ROWS
from kapitsa.testing.tiny import tiny_config
from lab.engine_timing import emit, generate, kapitsa_engine
from lab.models_under_test import DTYPE, SHAPES, TINY, kapitsa_model, prompt_ids

CASES = ("route-warm", "no-route-warm", "cleared", "again")


def top_k(config: dict) -> int:
    """Experts a token picks (the route's pairs are tokens x this)."""
    return int((config.get("text_config") or config)["num_experts_per_tok"])


def warmup_prompt(case: str, prompt: list[int], k: int, vocab: int) -> list[int]:
    """The warm-up request's prompt for `case`: other tokens than the prompt's, as long as it, or
    in `no-route-warm` the most tokens whose pairs stay under the route's."""
    tokens = max(1, (MOE_DEQUANT_MIN_ROWS - 1) // k) if case == "no-route-warm" else len(prompt)
    return prompt_ids(min(tokens, len(prompt)), vocab, stride=104729)


def time_case(model, case: str, prompt: list[int], k: int, vocab: int) -> dict:
    """One engine: the case's warm-up, then the prompt; its first token and MLX's memory before."""
    gc.collect()
    mx.clear_cache()  # every case starts from the same empty cache
    client = kapitsa_engine(model, len(prompt), 8)
    try:
        warm = warmup_prompt(case, prompt, k, vocab)
        generate(client, warm, 2)
        if case == "cleared":
            mx.clear_cache()
        if case == "again":
            generate(client, prompt, 2)
        cached, active = mx.get_cache_memory(), mx.get_active_memory()
        result = generate(client, prompt, 2)
    finally:
        client.close()
    return dict(
        case=case,
        warmup_tokens=len(warm),
        ttft_s=round(result["ttft_s"], 4),
        prefill_tok_s=round(result["prefill_tok_s"], 1),
        cache_gb_before=round(cached / 1e9, 2),
        active_gb_before=round(active / 1e9, 2),
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", nargs="+", default=["nemotron-30b-a3b"])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    table = TINY if args.tiny else SHAPES
    if args.tiny:
        DTYPE["value"] = mx.float32
    for shape in args.shapes:
        kind, dims = table[shape]
        config = tiny_config(kind, **dims)
        vocab = (config.get("text_config") or config)["vocab_size"]
        model, k = kapitsa_model(config), top_k(config)
        prompt = prompt_ids(args.prompt, vocab)
        emit(dict(shape=shape, top_k=k, route_min_pairs=MOE_DEQUANT_MIN_ROWS, prompt_pairs=args.prompt * k))
        for rnd in range(args.rounds):
            for case in CASES:  # interleaved: the host's drift falls on every case alike
                emit(dict(shape=shape, round=rnd, **time_case(model, case, prompt, k, vocab)))
        del model
        gc.collect()


if __name__ == "__main__":
    main()
