"""Draft acceptance of the draft model and the MTP head (torch), replayed as in `replay.py`."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .evaluation import greedy
from .replay import Proposer, ngram_proposer, replay


def draft_model_proposer(draft: nn.Module, k: int, device: torch.device) -> Proposer:
    def propose(context: list[int], _prompt_len: int) -> list[int]:
        return greedy(draft, context, k, device)

    return propose


def mtp_proposer(
    mtp: nn.Module, target: nn.Module, sequence: list[int], k: int, device: torch.device
) -> Proposer:
    """Chains the MTP head k times: step j feeds its own output hidden state and its own last draft back."""
    ids = torch.tensor([sequence], device=device)
    with torch.no_grad():
        hidden = target.model(input_ids=ids, use_cache=False).last_hidden_state[
            0
        ]  # h_t of the final sequence
    embed = target.model.embed_tokens

    @torch.no_grad()
    def propose(context: list[int], _prompt_len: int) -> list[int]:
        end = len(context) - 1  # MTP rows t = 0..end-1 pair h_t with token t+1 (the last is the bonus token)
        rows_hidden = hidden[:end]
        rows_tokens = torch.tensor(context[1 : end + 1], device=device)
        drafts: list[int] = []
        for _ in range(k):
            out = mtp(embed(rows_tokens)[None], rows_hidden[None])[0]
            token = int(target.lm_head(out[-1]).argmax())
            drafts.append(token)
            rows_hidden = torch.cat([rows_hidden, out[-1:]])
            rows_tokens = torch.cat([rows_tokens, torch.tensor([token], device=device)])
        return drafts

    return propose


def measure(
    target: nn.Module,
    prompts: list[list[int]],
    new_tokens: int,
    device: torch.device,
    proposers: dict[str, Callable[[list[int]], Proposer]],
    stop_ids: tuple[int, ...],
) -> dict:
    """proposers: name -> factory(full greedy sequence) -> Proposer. Returns per-drafter totals."""
    totals = {name: [0, 0, 0, 0] for name in proposers}
    for prompt in prompts:
        sequence = prompt + greedy(target, prompt, new_tokens, device, stop_ids)
        for name, factory in proposers.items():
            for i, value in enumerate(replay(sequence, len(prompt), factory(sequence))):
                totals[name][i] += value
    return {
        name: {
            "verify_steps": s,
            "tokens": t,
            "drafted": d,
            "accepted": a,
            "tokens_per_step": t / max(1, s),
            "acceptance_rate": a / max(1, d),
        }
        for name, (s, t, d, a) in totals.items()
    }


__all__ = ["measure", "draft_model_proposer", "mtp_proposer", "ngram_proposer", "replay"]
