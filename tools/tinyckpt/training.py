"""The training loops: next-token training of a whole model, and of an MTP head on a frozen target."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .dataset import WindowSampler

# Steps timed to turn a time budget into a step count: the first ones are slow (CUDA start-up, allocator
# warm-up, the other training processes starting), so the timing starts after a few.
CALIBRATION_START, CALIBRATION_END = 5, 25


@dataclass
class TrainSettings:
    batch: int
    seq_len: int
    lr: float
    seconds: float  # time budget used when `steps` is not given
    steps: int | None = None
    warmup: int = 100
    weight_decay: float = 0.1
    seed: int = 0


@dataclass
class TrainLog:
    steps: int = 0
    seconds: float = 0.0
    tokens: int = 0
    losses: list[tuple[int, float]] = field(default_factory=list)


def _optimizer(params: list[tuple[str, nn.Parameter]], settings: TrainSettings) -> torch.optim.Optimizer:
    decay = [p for n, p in params if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in params if not (p.ndim >= 2 and "embed" not in n)]
    groups = [
        {"params": decay, "weight_decay": settings.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        groups, lr=settings.lr, betas=(0.9, 0.95), eps=1e-8, fused=torch.cuda.is_available()
    )


def _lr_factor(step: int, total: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def run_training(
    loss_fn: Callable[[torch.Tensor], torch.Tensor],
    params: list[tuple[str, nn.Parameter]],
    sampler: WindowSampler,
    settings: TrainSettings,
    device: torch.device,
    name: str,
    after_step: Callable[[], None] | None = None,
) -> TrainLog:
    """Train for `settings.steps`, or for as many steps as fit in `settings.seconds` (timed on the first steps)."""
    optimizer = _optimizer(params, settings)
    log = TrainLog()
    total = settings.steps or 10**9
    start = time.perf_counter()
    step = 0
    while step < total:
        for group in optimizer.param_groups:
            group["lr"] = settings.lr * _lr_factor(step, total, settings.warmup)
        batch = sampler.next().to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = loss_fn(batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for _, p in params], 1.0)
        optimizer.step()
        if after_step:
            after_step()
        step += 1
        if settings.steps is None and step == CALIBRATION_START:
            calibration_start = time.perf_counter()
        if settings.steps is None and step == CALIBRATION_END:
            per_step = (time.perf_counter() - calibration_start) / (CALIBRATION_END - CALIBRATION_START)
            spent = time.perf_counter() - start
            total = max(step + 1, step + int((settings.seconds - spent) / per_step))
            print(f"[{name}] {per_step * 1000:.1f} ms/step -> {total} steps", flush=True)
        if step % 50 == 0 or step == total:
            value = float(loss.detach())
            log.losses.append((step, value))
            if step % 200 == 0 or step == total:
                print(
                    f"[{name}] step {step}/{total} loss {value:.3f} {time.perf_counter() - start:.0f}s",
                    flush=True,
                )
    log.steps, log.seconds = step, time.perf_counter() - start
    log.tokens = step * settings.batch * settings.seq_len
    return log


def next_token_loss(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    def loss(batch: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=batch[:, :-1], use_cache=False).logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    return loss


def target_states(target: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's final post-norm hidden states h_t and its token embeddings, without gradients."""
    with torch.no_grad():
        hidden = target.model(input_ids=ids, use_cache=False).last_hidden_state
        embeds = target.model.embed_tokens(ids)
    return hidden, embeds


def mtp_logits(mtp: nn.Module, target: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Logits for token t+2 at every t = 0..L-2 of `ids` [batch, L]."""
    hidden, embeds = target_states(target, ids)
    return target.lm_head(mtp(embeds[:, 1:], hidden[:, :-1]))


def mtp_loss(mtp: nn.Module, target: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    def loss(batch: torch.Tensor) -> torch.Tensor:
        logits = mtp_logits(mtp, target, batch[:, :-1])  # predicts batch[:, 2:L]
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 2:].reshape(-1))

    return loss


class MoEBalancer:
    """Auxiliary-loss-free load balancing (as Nemotron-H and DeepSeek-V3 train): after each step, nudge every
    router's `e_score_correction_bias` up for under-used experts and down for over-used ones."""

    def __init__(self, model: nn.Module, rate: float = 1e-3):
        self.rate = rate
        self.counts: dict[nn.Module, torch.Tensor] = {}
        self.routers = [m for m in model.modules() if type(m).__name__ == "NemotronHTopkRouter"]
        for router in self.routers:
            router.register_forward_hook(self._record)

    def _record(self, router: nn.Module, _inputs, outputs) -> None:
        indices = outputs[2].detach().reshape(-1)
        counts = torch.bincount(indices, minlength=router.num_experts).float()
        self.counts[router] = self.counts.get(router, 0) + counts

    def __call__(self) -> None:
        with torch.no_grad():
            for router, counts in self.counts.items():
                router.e_score_correction_bias += self.rate * torch.sign(counts.mean() - counts)
        self.counts.clear()
