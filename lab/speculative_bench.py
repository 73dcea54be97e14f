"""Speculative decoding: tokens per verify step and decode tok/s, against plain decoding and
against mlx-lm's plain decoding of the same checkpoint, in one run.

    python lab/speculative_bench.py --model kapitsa/demo [--draft PATH] [--block PATH] [--tokens 128]

`--block` adds the DFlash block drafter at PATH (tools/train_block_drafter.py trains one for the
demo), as a chain ("block") and as a best-first tree ("block-tree").

Workloads: "edit" (the model is shown a Python file and asked to rewrite it, so much of the
answer copies the prompt: the n-gram drafter's case) and "complete" (held-out function headers).
Every mode is greedy, so each mode's text must equal plain decoding's; the script checks it.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import time
from pathlib import Path

import mlx.core as mx

from kapitsa.engine.inprocess import InProcessEngine
from kapitsa.engine.loading.loader import load_model
from kapitsa.engine.options import EngineConfig
from kapitsa.engine.speculative.factory import make_decode_strategy, strategy_for
from kapitsa.engine.types import FinishEvent, GenerationRequest, SamplingParams, TokenEvent
from lab.engine_timing import DEFAULTS


def _edit_prompt() -> list[dict]:
    source = inspect.getsource(json.encoder.py_encode_basestring) + inspect.getsource(
        json.encoder.JSONEncoder.iterencode
    )
    return [
        {
            "role": "user",
            "content": f"Rewrite this code, keeping it the same but renaming `o` to `obj`:\n\n{source}",
        }
    ]


def _complete_prompt() -> list[dict]:
    return [{"role": "user", "content": "Complete this function:\n\ndef fibonacci(n):\n"}]


WORKLOADS = {"edit": _edit_prompt, "complete": _complete_prompt}


async def _generate(client: InProcessEngine, messages: list[dict], tokens: int) -> dict:
    request = GenerationRequest(
        messages=tuple(messages), sampling=SamplingParams(max_tokens=tokens, ignore_eos=True)
    )
    ids: list[int] = []
    first = end = None
    start = time.perf_counter()
    async for event in client.generate(request):
        if isinstance(event, TokenEvent):
            ids += event.token_ids
            first = first or time.perf_counter()
        elif isinstance(event, FinishEvent):
            end = time.perf_counter()
    return dict(ids=ids, ttft_s=first - start, decode_tok_s=(len(ids) - 1) / max(end - first, 1e-9))


DRAFT: dict[str, str | None] = {"path": None}
BLOCK: dict[str, object] = {"drafter": None}


def _run_mode(loaded, mode: str, draft, messages: list[dict], tokens: int) -> dict:
    if mode == "auto":  # as the opener builds it: on the CPU with the cost curve timed on this model
        strategy = strategy_for("auto", target_model=loaded.model, draft=DRAFT["path"], kernels=DEFAULTS)
    elif mode.startswith("block"):
        strategy = make_decode_strategy(
            "block",
            target_model=loaded.model,
            block_drafter=BLOCK["drafter"],
            tree=mode == "block-tree",
            kernels=DEFAULTS,
        )
    else:
        strategy = make_decode_strategy(mode, target_model=loaded.model, draft_model=draft, kernels=DEFAULTS)
    config = EngineConfig(prefix_cache_bytes=0, kernels=DEFAULTS)
    client = InProcessEngine.from_loaded(loaded, config=config, decode=strategy)
    try:
        asyncio.run(_generate(client, messages, tokens))  # warm-up
        result = asyncio.run(_generate(client, messages, tokens))
    finally:
        client.close()
    stats = getattr(strategy, "stats", None)
    result["tokens_per_step"] = round(stats.tokens_per_step, 3) if stats else 1.0
    result["acceptance"] = round(stats.acceptance_rate, 3) if stats else 0.0
    return result


def _mlxlm_plain(path: Path, prompt_ids: list[int], tokens: int) -> dict:
    try:
        from mlx_lm import load
        from mlx_lm.generate import generate_step

        model, _ = load(str(path))
    except Exception as err:  # noqa: BLE001 - report why mlx-lm could not run this checkpoint
        return dict(error=f"mlx-lm could not load it: {err}"[:200])

    def once() -> dict:
        start = time.perf_counter()
        first, ids = None, []
        for (tok, _), _ in zip(
            generate_step(mx.array(prompt_ids), model, max_tokens=tokens), range(tokens), strict=False
        ):
            ids.append(int(tok))
            first = first or time.perf_counter()
        end = time.perf_counter()
        return dict(ids=ids, ttft_s=first - start, decode_tok_s=(len(ids) - 1) / (end - first))

    once()
    return once()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--block", default=None, help="a DFlash block drafter folder")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    loaded = load_model(args.model)
    draft = load_model(args.draft).model if args.draft else None
    DRAFT["path"] = args.draft
    modes = (
        ["none", "auto", "ngram"]
        + (["mtp"] if getattr(loaded.model, "mtp", None) is not None else [])
        + (["draft"] if draft else [])
        + (["block", "block-tree"] if args.block else [])
    )
    if args.block:
        from kapitsa.engine.speculative.dflash import load_dflash

        BLOCK["drafter"] = load_dflash(args.block)
    print(f"mlx {mx.__version__} on {mx.default_device()}; model {args.model}")
    rows = []
    for workload, make in WORKLOADS.items():
        messages = make()
        prompt_ids = loaded.tokenizer.encode(
            loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        )
        plain_ids = None
        for mode in modes:
            r = _run_mode(loaded, mode, draft, messages, args.tokens)
            plain_ids = r["ids"] if mode == "none" else plain_ids
            row = dict(
                workload=workload,
                engine="kapitsa",
                mode=mode,
                decode_tok_s=round(r["decode_tok_s"], 1),
                tokens_per_step=r["tokens_per_step"],
                acceptance=r["acceptance"],
                same_as_plain=r["ids"] == plain_ids,
            )
            rows.append(row)
            print(json.dumps(row), flush=True)
        m = _mlxlm_plain(Path(loaded.path), prompt_ids, args.tokens)
        row = dict(
            workload=workload,
            engine="mlx-lm",
            mode="none",
            **(
                {"decode_tok_s": round(m["decode_tok_s"], 1), "same_as_plain": m["ids"] == plain_ids}
                if "ids" in m
                else m
            ),
        )
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
