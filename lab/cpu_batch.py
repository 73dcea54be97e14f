"""Aggregate decode on MLX's CPU device at 1-16 streams, on a real checkpoint (default: the demo),
with a batch step's linears and tied head through BLAS on float32 copies (the engine's default
where the copies fit, KernelOptions.cpu_blas_rows) and without (every step a compiled trace of MLX's
quantized products). One process per setting, the engine as `kapitsa serve` runs it (prefix cache off).

    python lab/cpu_batch.py                         # both settings, the demo
    python lab/cpu_batch.py --streams 1,2,4,8,16 --tokens 64 --model DIR
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(resources.files("kapitsa").joinpath("demo"))


def run(model: str, streams: list[int], tokens: int, prompt: int, blas: bool) -> None:
    from kapitsa.engine.inprocess import InProcessEngine
    from kapitsa.engine.kernels import cpu_blas
    from kapitsa.engine.loading.loader import load_model
    from kapitsa.engine.options import EngineConfig
    from lab.batch_sweep import burst
    from lab.engine_timing import DEFAULTS
    from lab.models_under_test import prompt_ids

    if not blas:
        cpu_blas.STEP_MIN_ROWS = 0  # the runner then leaves KernelOptions.cpu_blas_rows at 0
    loaded = load_model(model)
    config = loaded.config.get("text_config") or loaded.config
    engine_config = EngineConfig(
        prefix_cache_bytes=0, max_running=max(streams), kernels=DEFAULTS, warm_batches=()
    )
    client = InProcessEngine.from_loaded(loaded, config=engine_config)
    prompts = [prompt_ids(prompt, config["vocab_size"], stride=7919 + 2 * i) for i in range(max(streams))]
    try:
        burst(client, prompts[:1], 8)
        for n in streams:
            burst(client, prompts[:n], tokens)  # this size's first burst
            print(
                json.dumps(dict(blas_steps=blas, streams=n, **burst(client, prompts[:n], tokens))), flush=True
            )
    finally:
        client.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=DEMO)
    parser.add_argument("--streams", default="1,2,4,8,16")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--setting", choices=("blas", "compiled"), help="one setting, in this process")
    args = parser.parse_args()
    streams = [int(n) for n in args.streams.split(",")]
    if args.setting:
        run(args.model, streams, args.tokens, args.prompt, blas=args.setting == "blas")
        return
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)])),
    }
    for setting in ("compiled", "blas"):
        argv = [sys.executable, __file__, "--model", args.model, "--streams", args.streams]
        argv += ["--tokens", str(args.tokens), "--prompt", str(args.prompt), "--setting", setting]
        subprocess.run(argv, check=True, env=env)


if __name__ == "__main__":
    main()
