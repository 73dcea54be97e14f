"""kapitsa vs mlx-lm, side by side in one process: random-weight 4-bit models of real shapes.

For each shape: build kapitsa's model and mlx-lm's model from the same published-style config,
quantize both to MLX affine 4-bit (group 64), then time a 512-token (and optionally 8k-token)
prefill and greedy decode at batch 1. kapitsa runs through its engine (`InProcessEngine`, the
path `kapitsa run` and `kapitsa serve` use); mlx-lm through `generate_step`.

    python lab/decode_vs_mlxlm.py [--shapes 4b 27b 35b-a3b nemotron-30b-a3b] [--tokens 128]
    python lab/decode_vs_mlxlm.py --tiny       # a seconds-long smoke run on any machine

`--streams 1,4,8,16` adds batch_sweep.py's aggregate decode on the same two models, after the
batch-1 rounds (one process per shape for #32's whole table row: the models are built and
kapitsa's kernels compiled once).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import mlx.core as mx

from kapitsa.engine.speculative.factory import DEFAULT_MAX_DRAFT
from kapitsa.testing.tiny import tiny_config
from lab.batch_sweep import sweep_model
from lab.engine_timing import emit, time_kapitsa, time_mlxlm
from lab.models_under_test import DTYPE, SHAPES, TINY, kapitsa_model, mlxlm_model, prompt_ids
from lab.spec_shapes import spec_rounds
from lab.spec_shapes import summary as spec_summary
from lab.variants import add_variants, fused_parts
from lab.weight_reads import read_bytes_per_token, routing, total_bytes

WARMUP_PROMPT = 64  # tokens of the warm-up request after round 0
MEASURED_LIMIT_GB_S = 3770.0  # H200 grid-stride read through mx.fast.cuda_kernel (shared/gpu/README.md)


def _verify_cost(model, prompt: list[int], sizes=(1, 2, 4, 8), iters: int = 8) -> dict:
    """Milliseconds of one speculative verify of T tokens after the prompt, per T: the forward
    (record=True, logits for all T, evaluated) and the rollback of a rejected draft, which keeps
    the first token (evaluated), each timed alone; what a draft of T-1 tokens costs on this shape. Run on the
    engine's model (fused and routed by its ModelRunner)."""
    cache = model.make_cache(1)
    mx.eval(model.logits(model.forward(mx.array([prompt]), cache).hidden[:, -1:]), *cache.state_arrays())
    out = {}
    for T in sizes:
        tokens = mx.array([[(7 * i + 11) % 200 + 5 for i in range(T)]])
        forward, rollback = [], []
        for i in range(iters + 2):
            start = time.perf_counter()
            logits = model.logits(model.forward(tokens, cache, record=True).hidden)
            mx.eval(logits, *cache.state_arrays())
            middle = time.perf_counter()
            cache.rollback(T - 1)  # a rejected draft: the target's own token stays
            mx.eval(*cache.state_arrays())
            if i >= 2:  # the first two compile the T-token kernels
                forward.append(middle - start)
                rollback.append(time.perf_counter() - middle)
        out[f"verify_ms_T{T}"] = round(sorted(forward)[len(forward) // 2] * 1e3, 2)
        out[f"rollback_ms_T{T}"] = round(sorted(rollback)[len(rollback) // 2] * 1e3, 2)
    return out


def _prefill_rows(name: str, models: dict, timers: dict, plen: int, vocab: int, sizes: dict) -> list[dict]:
    """One prefill of `plen` tokens per engine (2 tokens decoded: the decode figure is not kept),
    after a warm-up prefill of the same length with other tokens, so every chunk offset's kernels
    are compiled before the timed run (a one-chunk warm-up leaves the later chunks' compiles in it)."""
    prompt, warmup = prompt_ids(plen, vocab), prompt_ids(plen, vocab, stride=104729)
    rows = []
    for engine in ("mlx-lm", "kapitsa"):
        result = timers[engine](models[engine], prompt, 2, warmup)
        row = dict(
            shape=name,
            engine=engine,
            prompt=plen,
            round=0,
            weights_gb=round(sizes[engine], 2),
            prefill_only=True,
            ttft_s=result["ttft_s"],
            prefill_tok_s=result["prefill_tok_s"],
        )
        rows.append(row)
        emit(row)
    return rows


def _median(rows: list[dict], key: str, **match) -> float | None:
    mine = [r[key] for r in rows if all(r.get(k) == v for k, v in match.items())]
    return statistics.median(mine) if mine else None


def _decode_summary(rows: list[dict], shape: str, plen: int) -> dict:
    """Medians of one (shape, prompt) decode comparison, the ratio and the weight bandwidth."""
    kapitsa = _median(rows, "decode_tok_s", shape=shape, prompt=plen, engine="kapitsa")
    mlxlm = _median(rows, "decode_tok_s", shape=shape, prompt=plen, engine="mlx-lm")
    # what one token reads: every weight but the embedding table's other rows and, in MoE layers,
    # the routed experts not chosen (lab/weight_reads.py)
    read_gb = next(r["read_gb"] for r in rows if r["shape"] == shape and r["engine"] == "kapitsa")
    stream = read_gb * kapitsa
    out = dict(
        summary=shape,
        prompt=plen,
        kapitsa_decode=round(kapitsa, 1),
        mlxlm_decode=round(mlxlm, 1),
        decode_ratio=round(kapitsa / mlxlm, 2),
        read_gb_per_token=round(read_gb, 3),
        kapitsa_weight_gb_s=round(stream, 1),
        share_of_measured_limit=round(stream / MEASURED_LIMIT_GB_S, 3),
        kapitsa_prefill=round(_median(rows, "prefill_tok_s", shape=shape, prompt=plen, engine="kapitsa"), 1),
        mlxlm_prefill=round(_median(rows, "prefill_tok_s", shape=shape, prompt=plen, engine="mlx-lm"), 1),
    )
    for engine, key in (("kapitsa", "kapitsa_tail"), ("mlx-lm", "mlxlm_tail")):  # the second half's rate
        tail = [
            r["tail_tok_s"] for r in rows if (r["shape"], r["prompt"], r["engine"]) == (shape, plen, engine)
        ]
        if tail and None not in tail:
            out[key] = round(statistics.median(tail), 1)
    variants = sorted(
        {r["engine"] for r in rows if r["shape"] == shape and r["engine"].startswith("kapitsa-")}
    )
    for engine in variants:  # kapitsa-fused -> kapitsa_fused_decode, fused_ratio
        tok_s = _median(rows, "decode_tok_s", shape=shape, prompt=plen, engine=engine)
        name = engine.removeprefix("kapitsa-")
        out.update({f"kapitsa_{name}_decode": round(tok_s, 1), f"{name}_ratio": round(tok_s / mlxlm, 2)})
    return out


def _summary(rows: list[dict]) -> None:
    """Median decode/prefill tok/s per (shape, prompt, engine) and the kapitsa / mlx-lm ratio;
    prefill-only rows (`--prefill-prompts`) get their own lines."""
    decode = [r for r in rows if "decode_tok_s" in r]
    for shape, plen in sorted({(r["shape"], r["prompt"]) for r in decode}, key=str):
        emit(_decode_summary(decode, shape, plen))
    prefill = [r for r in rows if r.get("prefill_only")]
    for shape, plen in sorted({(r["shape"], r["prompt"]) for r in prefill}, key=str):
        match = dict(shape=shape, prompt=plen, prefill_only=True)
        kapitsa = _median(prefill, "prefill_tok_s", engine="kapitsa", **match)
        mlxlm = _median(prefill, "prefill_tok_s", engine="mlx-lm", **match)
        line = dict(
            summary=f"{shape} prefill",
            prompt=plen,
            kapitsa_prefill=round(kapitsa, 1),
            mlxlm_prefill=round(mlxlm, 1),
            prefill_ratio=round(kapitsa / mlxlm, 2),
        )
        emit(line)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, nargs="+", default=[512])
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timings per engine")
    ap.add_argument(
        "--long-rounds",
        type=int,
        default=None,
        help="rounds at prompts of 4096+ tokens (default: --rounds); mlx-lm prefills each at 200-400 tok/s",
    )
    ap.add_argument("--tiny", action="store_true", help="tiny widths: a smoke run on CPU")
    ap.add_argument("--json", default=None)
    ap.add_argument("--verify-shapes", nargs="*", default=[], help="also time T-token verify forwards")
    ap.add_argument("--verify-sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument(
        "--spec-shapes", nargs="*", default=[], help="also time n-gram speculation on the edit workload"
    )
    ap.add_argument("--spec-tokens", type=int, default=256)
    ap.add_argument("--spec-rounds", type=int, default=None, help="default: --rounds")
    ap.add_argument("--spec-draft", type=int, default=DEFAULT_MAX_DRAFT, help="longest n-gram draft")
    ap.add_argument(
        "--fused-ab",
        nargs="?",
        const="all",
        default=None,
        metavar="PARTS",
        help="also time kapitsa with KAPITSA_FUSED_NORMS=PARTS (default all), interleaved",
    )
    ap.add_argument(
        "--kernels-ab",
        default=None,
        metavar="FAMILIES",
        help="also time kapitsa with KAPITSA_KERNELS=FAMILIES",
    )
    ap.add_argument(
        "--fold-ab",
        action="store_true",
        help="MoE shapes: also time a copy with shared experts folded",
    )
    ap.add_argument(
        "--prefill-prompts",
        type=int,
        nargs="*",
        default=[],
        help="also time prefill alone at these prompt lengths (one round per engine, 2 tokens)",
    )
    ap.add_argument("--streams", default="", help="also aggregate decode at these stream counts (1,4,8,16)")
    ap.add_argument("--stream-tokens", type=int, default=48)
    ap.add_argument("--stream-prompt", type=int, default=512)
    ap.add_argument(
        "--stream-warm", action="store_true", help="kapitsa's sweep engine readies its batch sizes first"
    )
    args = ap.parse_args()
    table = TINY if args.tiny else SHAPES
    if args.tiny:
        DTYPE["value"] = mx.float32
    print(f"mlx {mx.__version__} on {mx.default_device()}")
    rows, extra, spec = [], [], []
    for name in args.shapes:
        kind, dims = table[name]
        config = tiny_config(kind, **dims)
        vocab = dims.get("vocab_size", 512)
        # Both models stay loaded and are timed in alternation, `--rounds` times each: the host's
        # speed drifts within a run on a shared machine, so compare medians of interleaved runs.
        built_from = time.perf_counter()
        models = {"mlx-lm": mlxlm_model(config), "kapitsa": kapitsa_model(config)}
        timers = {"mlx-lm": time_mlxlm, "kapitsa": time_kapitsa}
        route = routing(config)
        add_variants(args, models, timers, lambda config=config: kapitsa_model(config), moe=route is not None)
        sizes = {e: total_bytes(m) / 1e9 for e, m in models.items()}
        read_gb = read_bytes_per_token(models["kapitsa"], route) / 1e9
        emit(dict(shape=name, built_s=round(time.perf_counter() - built_from, 1)))
        for plen in args.prompts:
            prompt = prompt_ids(plen, vocab)
            rounds = args.long_rounds if args.long_rounds and plen >= 4096 else args.rounds
            for rnd in range(rounds):
                # round 0's warm-up runs the prompt itself (its prefill shapes compile); later rounds
                # warm up on a short one, as those shapes are ready: mlx-lm's 8k prefill on the
                # Qwen shapes takes 30-50 s on a GPU, and a second one per round does not fit the table
                warmup = None if rnd == 0 else prompt[:WARMUP_PROMPT]
                for engine, model in models.items():
                    result = dict(
                        shape=name,
                        engine=engine,
                        prompt=plen,
                        round=rnd,
                        weights_gb=round(sizes[engine], 2),
                        read_gb=round(read_gb, 3),
                        **timers[engine](model, prompt, args.tokens, warmup),
                    )
                    if "error" not in result:  # a variant that failed (variants.timed_with) is reported only
                        rows.append(result)
                    emit(result)
        for plen in args.prefill_prompts:
            rows += _prefill_rows(name, models, timers, plen, vocab, sizes)
        _summary([r for r in rows if r["shape"] == name])  # before the parts that may still fail
        if name in args.verify_shapes:
            verify = dict(
                shape=name, engine="kapitsa", **_verify_cost(models["kapitsa"], prompt, args.verify_sizes)
            )
            emit(verify)
            extra.append(verify)
        if args.streams:
            counts = [int(n) for n in args.streams.split(",")]
            for engine in ("kapitsa", "mlx-lm"):
                sweep_model(
                    name, engine, models[engine], config, counts, args.stream_tokens, args.stream_prompt,
                    warm=args.stream_warm,
                )  # fmt: skip
        if name in args.spec_shapes:  # last: it scripts the kapitsa model (spec_shapes.py)
            spec += spec_rounds(
                name,
                models["kapitsa"],
                models["mlx-lm"],
                vocab,
                args.spec_rounds or args.rounds,
                args.spec_tokens,
                args.spec_draft,
                # --fused-ab's parts time speculation too (a mat-vec part's default decides on both)
                {"fused": fused_parts(args.fused_ab)} if args.fused_ab else None,
            )
        del models
        gc.collect()
        mx.clear_cache()
    if spec:
        spec_summary(spec)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows + extra + spec, f, indent=1)


if __name__ == "__main__":
    main()
