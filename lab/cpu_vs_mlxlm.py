"""kapitsa vs mlx-lm on MLX's CPU device, one checkpoint, side by side in one process.

Both engines load the same MLX checkpoint folder (default: the embedded demo). kapitsa runs through
its engine (`InProcessEngine.from_loaded`, the path of `kapitsa run` and `serve`, prefix cache off); mlx-lm through
`mlx_lm.load` and `generate_step`. Rounds alternate the engines; each round times one prefill of
`--prompt` tokens and `--tokens` greedy decode steps after it. Prints one JSON line per run and a
summary of medians and ratios.

    python lab/cpu_vs_mlxlm.py                       # the demo, 512-token prompt, 3 rounds
    python lab/cpu_vs_mlxlm.py --model DIR --prompt 1024 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from kapitsa.engine.inprocess import InProcessEngine
from kapitsa.engine.loading.loader import load_model
from kapitsa.engine.options import EngineConfig
from kapitsa.engine.types import ErrorEvent, FinishEvent, GenerationRequest, SamplingParams, TokenEvent
from lab.engine_timing import DEFAULTS  # the KAPITSA_* kernel options of this process

DEMO = Path(__file__).resolve().parents[1] / "kapitsa" / "demo"


def _prompt(length: int, vocab: int, stride: int) -> list[int]:
    return [(i * stride) % (vocab - 300) + 5 for i in range(length)]


def _mlxlm_folder(folder: Path, scratch: Path) -> Path:
    """The checkpoint as mlx-lm names it: model_type `qwen3_5` (mlx-lm has no `qwen3_5_text`) with
    its attention rhythm as `full_attention_interval`; the weights are the same files."""
    config = json.loads((folder / "config.json").read_text())
    if config.get("model_type") != "qwen3_5_text":
        return folder
    target = scratch / folder.name
    shutil.copytree(folder, target)
    types = config.get("layer_types") or []
    config["model_type"] = "qwen3_5"
    if "full_attention" in types:
        config["full_attention_interval"] = types.index("full_attention") + 1
    (target / "config.json").write_text(json.dumps(config))
    return target


def time_kapitsa(engine: InProcessEngine, prompt: list[int], tokens: int) -> dict:
    async def run() -> dict:
        start = time.perf_counter()
        first = end = None
        count = 0
        request = GenerationRequest(
            prompt_token_ids=tuple(prompt), sampling=SamplingParams(max_tokens=tokens, ignore_eos=True)
        )
        async for event in engine.generate(request):
            if isinstance(event, TokenEvent):
                count += len(event.token_ids)
                first = first or time.perf_counter()
            elif isinstance(event, FinishEvent):
                end = time.perf_counter()
            elif isinstance(event, ErrorEvent):
                raise event.error
        return _rates(len(prompt), count, start, first, end)

    return asyncio.run(run())


def time_mlxlm(model, prompt: list[int], tokens: int) -> dict:  # noqa: ANN001
    from mlx_lm.generate import generate_step

    start = time.perf_counter()
    first = None
    count = 0
    for _ in zip(generate_step(mx.array(prompt), model, max_tokens=tokens), range(tokens), strict=False):
        count += 1
        first = first or time.perf_counter()
    return _rates(len(prompt), count, start, first, time.perf_counter())


def _rates(prompt_tokens: int, count: int, start: float, first: float, end: float) -> dict:
    return {
        "prefill_tok_s": round(prompt_tokens / (first - start), 1),
        "decode_tok_s": round((count - 1) / max(end - first, 1e-9), 1),
    }


def _summary(rows: list[dict]) -> dict:
    out: dict = {"summary": True}
    for key in ("prefill_tok_s", "decode_tok_s"):
        for engine in ("kapitsa", "mlx-lm"):
            out[f"{engine}_{key}"] = statistics.median(r[key] for r in rows if r["engine"] == engine)
        out[f"{key.split('_')[0]}_ratio"] = round(out[f"kapitsa_{key}"] / out[f"mlx-lm_{key}"], 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", type=Path, default=DEMO, help="an MLX checkpoint folder (default: the demo)"
    )
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens decoded")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    mx.set_default_device(mx.cpu)
    import mlx_lm

    vocab = int(json.loads((args.model / "config.json").read_text()).get("vocab_size", 1024))
    prompt, warmup = _prompt(args.prompt, vocab, 7919), _prompt(args.prompt, vocab, 104729)
    with tempfile.TemporaryDirectory() as scratch:
        mlxlm_model, _ = mlx_lm.load(str(_mlxlm_folder(args.model, Path(scratch))))
    config = EngineConfig(prefix_cache_bytes=0, kernels=DEFAULTS)
    engine = InProcessEngine.from_loaded(load_model(str(args.model)), config=config)
    timers = {
        "kapitsa": lambda p, n: time_kapitsa(engine, p, n),
        "mlx-lm": lambda p, n: time_mlxlm(mlxlm_model, p, n),
    }
    try:
        for timer in timers.values():
            timer(warmup, 4)  # first-call compiles and allocations
        rows = []
        for round_index in range(args.rounds):
            order = list(timers) if round_index % 2 == 0 else list(reversed(timers))
            for name in order:
                row = {"engine": name, "round": round_index, **timers[name](prompt, args.tokens)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        engine.close()
    summary = {"model": str(args.model), "prompt": args.prompt, "tokens": args.tokens, **_summary(rows)}
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
