"""The phases of tools/train_checkpoints.py: prepare data, train each model, train the MTP head, evaluate."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from . import checkpoint, evaluation
from .architectures import MTPHead, build_model, parameter_count
from .dataset import WindowSampler, build_corpus
from .tokenizer import EOS_TOKEN, PAD_TOKEN, write_tokenizer_files
from .training import MoEBalancer, TrainSettings, mtp_loss, next_token_loss, run_training

LEARNING_RATES = {"main": 2e-3, "draft": 3e-3, "nemotron": 2e-3}
DEMO = "qwen35-demo"


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_tokenizer(out: Path) -> Tokenizer:
    return Tokenizer.from_file(str(out / "tokenizer" / "tokenizer.json"))


def load_ids(out: Path, name: str) -> np.ndarray:
    return np.load(out / "data" / f"{name}.npy")


def prepare(out: Path, seed: int, tokenizer_file: Path | None = None) -> None:
    reused = Tokenizer.from_file(str(tokenizer_file)) if tokenizer_file else None
    corpus = build_corpus(seed, reused)
    write_tokenizer_files(corpus.tokenizer, out / "tokenizer")
    (out / "data").mkdir(parents=True, exist_ok=True)
    for name in ("train_ids", "held_out_code_ids", "held_out_chat_ids"):
        np.save(out / "data" / f"{name}.npy", getattr(corpus, name))
    (out / "data" / "corpus.json").write_text(json.dumps(corpus.stats, indent=1))
    print(
        f"[prepare] {json.dumps({k: v for k, v in corpus.stats.items() if k != 'held_out_file_names'})}",
        flush=True,
    )


def steps_for(spec: str | None, name: str) -> int | None:
    """`--steps` is `N` (every model) or `main=N,draft=N,nemotron=N,mtp=N`; None means use the time budget."""
    if not spec:
        return None
    if "=" not in spec:
        return int(spec)
    counts = dict(part.split("=", 1) for part in spec.split(","))
    return int(counts[name]) if name in counts else None


def _settings(
    args: argparse.Namespace, name: str, lr: float, seconds: float, warmup: int = 100
) -> TrainSettings:
    steps = steps_for(args.steps, name)
    return TrainSettings(
        batch=args.batch,
        seq_len=args.seq_len,
        lr=lr,
        seconds=seconds,
        steps=steps,
        warmup=min(warmup, steps or warmup),
        seed=args.seed,
    )


def _write_log(out: Path, name: str, record: dict) -> None:
    (out / "logs").mkdir(exist_ok=True)
    (out / "logs" / f"{name}.json").write_text(json.dumps(record, indent=1))


def _start_model(
    out: Path, kind: str, folder_name: str, tokenizer: Tokenizer, resume: bool
) -> torch.nn.Module:
    if resume:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(out / folder_name, dtype=torch.float32)
    return build_model(
        kind, tokenizer.get_vocab_size(), tokenizer.token_to_id(EOS_TOKEN), tokenizer.token_to_id(PAD_TOKEN)
    )


def train_model(out: Path, kind: str, folder_name: str, args: argparse.Namespace) -> None:
    """Train `kind` into `out/folder_name`; `args.resume` continues from the checkpoint saved there
    (a second stage, e.g. on longer windows), at `args.lr` when given."""
    tokenizer = load_tokenizer(out)
    torch.manual_seed(args.seed)
    model = _start_model(out, kind, folder_name, tokenizer, args.resume).to(device())
    model.train()
    sampler = WindowSampler(load_ids(out, "train_ids"), args.seq_len, args.batch, args.seed)
    balancer = MoEBalancer(model) if kind == "nemotron" else None
    lr = args.lr or LEARNING_RATES[kind]
    settings = _settings(args, kind, lr, args.seconds, warmup=20 if args.resume else 100)
    log = run_training(
        next_token_loss(model),
        list(model.named_parameters()),
        sampler,
        settings,
        device(),
        folder_name,
        after_step=balancer,
    )
    checkpoint.save_checkpoint(model, out / folder_name, tokenizer)
    _write_log(
        out,
        folder_name + ("-resumed" if args.resume else ""),
        {
            "parameters": parameter_count(model),
            "steps": log.steps,
            "seconds": round(log.seconds, 1),
            "tokens": log.tokens,
            "batch": args.batch,
            "seq_len": args.seq_len,
            "lr": settings.lr,
            "losses": log.losses,
        },
    )


def load_target(out: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / DEMO, dtype=torch.float32).to(device())
    model.eval()
    return model


def train_mtp(out: Path, args: argparse.Namespace) -> None:
    target = load_target(out)
    for p in target.parameters():
        p.requires_grad_(False)
    torch.manual_seed(args.seed)
    mtp = MTPHead(target.config).to(device())
    sampler = WindowSampler(load_ids(out, "train_ids"), args.seq_len, args.batch, args.seed + 7)
    settings = _settings(args, "mtp", 2e-3, args.mtp_seconds, warmup=50)
    log = run_training(
        mtp_loss(mtp, target), list(mtp.named_parameters()), sampler, settings, device(), "mtp"
    )
    checkpoint.add_mtp_weights(out / DEMO, mtp.checkpoint_tensors())
    _write_log(
        out,
        "mtp",
        {
            "parameters": parameter_count(mtp),
            "steps": log.steps,
            "seconds": round(log.seconds, 1),
            "tokens": log.tokens,
            "lr": settings.lr,
            "losses": log.losses,
        },
    )


def evaluate(out: Path, args: argparse.Namespace) -> None:
    from .report import evaluate_all

    results = evaluate_all(out, device(), quick=args.quick)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(
        json.dumps({k: v for k, v in results.items() if k in ("losses", "acceptance")}, indent=1), flush=True
    )


__all__ = ["prepare", "train_model", "train_mtp", "evaluate", "evaluation"]
