"""Held-out numbers: loss against a unigram baseline, greedy completions, speculative acceptance."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .training import mtp_logits


def unigram_loss(train_ids: np.ndarray, eval_ids: np.ndarray, vocab_size: int) -> float:
    """Cross-entropy (nats/token) of the held-out tokens under the training set's add-one unigram model."""
    counts = np.bincount(train_ids, minlength=vocab_size).astype(np.float64) + 1.0
    log_probs = np.log(counts / counts.sum())
    return float(-log_probs[eval_ids].mean())


def _windows(ids: np.ndarray, seq_len: int) -> torch.Tensor:
    count = (ids.size - 1) // seq_len
    return torch.stack(
        [
            torch.from_numpy(ids[i * seq_len : i * seq_len + seq_len + 1].astype(np.int64))
            for i in range(count)
        ]
    )


@torch.no_grad()
def held_out_loss(
    model: nn.Module, ids: np.ndarray, seq_len: int, device: torch.device, batch: int = 16
) -> float:
    windows = _windows(ids, seq_len)
    total, count = 0.0, 0
    for i in range(0, len(windows), batch):
        chunk = windows[i : i + batch].to(device)
        logits = model(input_ids=chunk[:, :-1], use_cache=False).logits.float()
        total += float(
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1), reduction="sum")
        )
        count += chunk[:, 1:].numel()
    return total / count


@torch.no_grad()
def held_out_mtp(
    mtp: nn.Module, target: nn.Module, ids: np.ndarray, seq_len: int, device: torch.device, batch: int = 16
) -> dict:
    """MTP loss and top-1 accuracy for token t+2 on held-out windows."""
    windows = _windows(ids, seq_len)
    total, correct, count = 0.0, 0, 0
    for i in range(0, len(windows), batch):
        chunk = windows[i : i + batch].to(device)
        logits = mtp_logits(mtp, target, chunk[:, :-1]).float()
        labels = chunk[:, 2:]
        total += float(
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum")
        )
        correct += int((logits.argmax(-1) == labels).sum())
        count += labels.numel()
    return {"loss": total / count, "top1": correct / count}


@torch.no_grad()
def greedy(
    model: nn.Module,
    prompt_ids: list[int],
    max_new: int,
    device: torch.device,
    stop_ids: tuple[int, ...] = (),
) -> list[int]:
    ids = torch.tensor([prompt_ids], device=device)
    out = model.generate(
        ids,
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=list(stop_ids) or None,
        pad_token_id=stop_ids[0] if stop_ids else 0,
    )
    return out[0, len(prompt_ids) :].tolist()


def bits(nats: float) -> float:
    return nats / math.log(2)
