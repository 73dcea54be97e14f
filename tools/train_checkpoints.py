"""Build kapitsa's tiny trained checkpoints from the standard library of the Python that runs this script.

    python tools/train_checkpoints.py all --out build/checkpoints           # everything (one GPU, ~6 min)
    python tools/train_checkpoints.py prepare|train|mtp|evaluate --out DIR  # one phase at a time

Writes, under --out: `tokenizer/`, `qwen35-demo/` (Qwen3.5 architecture, with its trained `mtp.*` head),
`qwen35-draft/` (a smaller drafter, same tokenizer), `nemotron-h/` (Mamba-2 + attention + MoE), and
`results.json` (held-out losses vs a unigram baseline, greedy completions, draft acceptance). The
checkpoint folders are written by transformers' own save_pretrained, in bf16. docs/checkpoints.md
records the numbers of the run that produced the committed checkpoints.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tinyckpt import phases  # noqa: E402

MODELS = {"main": "qwen35-demo", "draft": "qwen35-draft", "nemotron": "nemotron-h"}


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("phase", choices=["all", "prepare", "train", "mtp", "evaluate"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", choices=sorted(MODELS), help="for the train phase")
    parser.add_argument("--seconds", type=float, default=150.0, help="training time budget per model")
    parser.add_argument("--mtp-seconds", type=float, default=60.0)
    parser.add_argument(
        "--steps",
        help="fixed step counts instead of --seconds, for reproduction: N for every "
        "model, or per model as main=N,draft=N,nemotron=N,mtp=N",
    )
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="few evaluation prompts (CPU smoke runs)")
    parser.add_argument("--resume", action="store_true", help="for train: continue from the saved checkpoint")
    parser.add_argument("--lr", type=float, help="for train: peak learning rate (default per model)")
    parser.add_argument(
        "--tokenizer",
        type=Path,
        help="for prepare: reuse this tokenizer.json (the models already trained on it stay compatible)",
    )
    return parser.parse_args(argv)


def _run_all(args: argparse.Namespace) -> None:
    started = time.perf_counter()
    phases.prepare(args.out, args.seed)
    # The three models train at once on one GPU: each is too small to keep it busy alone.
    common = [
        "--out",
        str(args.out),
        "--seconds",
        str(args.seconds),
        "--batch",
        str(args.batch),
        "--seq-len",
        str(args.seq_len),
        "--seed",
        str(args.seed),
    ]
    if args.steps:
        common += ["--steps", str(args.steps)]
    children = [
        subprocess.Popen([sys.executable, __file__, "train", "--model", name, *common]) for name in MODELS
    ]
    if any(child.wait() != 0 for child in children):
        raise SystemExit("a training process failed")
    phases.train_mtp(args.out, args)
    phases.evaluate(args.out, args)
    print(f"all done in {time.perf_counter() - started:.0f}s", flush=True)


def main(argv: list[str] | None = None) -> None:
    args = _parse(sys.argv[1:] if argv is None else argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.phase == "all":
        _run_all(args)
    elif args.phase == "prepare":
        phases.prepare(args.out, args.seed, args.tokenizer)
    elif args.phase == "train":
        if not args.model:
            raise SystemExit("train needs --model")
        phases.train_model(args.out, args.model, MODELS[args.model], args)
    elif args.phase == "mtp":
        phases.train_mtp(args.out, args)
    else:
        phases.evaluate(args.out, args)
    print(json.dumps({"phase": args.phase, "out": str(args.out)}), flush=True)


if __name__ == "__main__":
    main()
