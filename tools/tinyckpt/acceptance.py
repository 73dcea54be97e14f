"""Draft acceptance, measured the way greedy speculative decoding accepts: a drafted token counts while it
equals the target's argmax at that position; each verify step also yields the target's own next token.

Under greedy verification the output is exactly the target's greedy continuation, so that continuation
is computed once and every drafter is replayed against it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .evaluation import greedy

Proposer = Callable[[list[int], int], list[int]]  # (context ids, prompt length) -> draft ids


def replay(sequence: list[int], prompt_len: int, propose: Proposer) -> tuple[int, int, int, int]:
    """Returns (verify steps, generated tokens, drafted tokens, accepted tokens)."""
    position, steps, drafted, accepted = prompt_len, 0, 0, 0
    while position < len(sequence):
        draft = propose(sequence[:position], prompt_len)
        run = 0
        while run < len(draft) and position + run < len(sequence) and draft[run] == sequence[position + run]:
            run += 1
        steps += 1
        drafted += len(draft)
        accepted += run
        position += run + 1
    return steps, len(sequence) - prompt_len, drafted, accepted


def ngram_proposer(k: int, max_n: int = 3) -> Proposer:
    """Prompt lookup: the continuation of the latest earlier occurrence of the last n tokens (n = max_n..1)."""
    def propose(context: list[int], _prompt_len: int) -> list[int]:
        for n in range(max_n, 0, -1):
            if len(context) <= n:
                continue
            tail = context[-n:]
            for start in range(len(context) - n - 1, -1, -1):
                if context[start: start + n] == tail:
                    return context[start + n: start + n + k]
        return []
    return propose


def draft_model_proposer(draft: nn.Module, k: int, device: torch.device) -> Proposer:
    def propose(context: list[int], _prompt_len: int) -> list[int]:
        return greedy(draft, context, k, device)
    return propose


def mtp_proposer(mtp: nn.Module, target: nn.Module, sequence: list[int], k: int, device: torch.device) -> Proposer:
    """Chains the MTP head k times: step j feeds its own output hidden state and its own last draft back."""
    ids = torch.tensor([sequence], device=device)
    with torch.no_grad():
        hidden = target.model(input_ids=ids, use_cache=False).last_hidden_state[0]  # h_t of the final sequence
    embed = target.model.embed_tokens

    @torch.no_grad()
    def propose(context: list[int], _prompt_len: int) -> list[int]:
        end = len(context) - 1  # MTP rows t = 0..end-1 pair h_t with token t+1 (the last is the bonus token)
        rows_hidden = hidden[:end]
        rows_tokens = torch.tensor(context[1:end + 1], device=device)
        drafts: list[int] = []
        for _ in range(k):
            out = mtp(embed(rows_tokens)[None], rows_hidden[None])[0]
            token = int(target.lm_head(out[-1]).argmax())
            drafts.append(token)
            rows_hidden = torch.cat([rows_hidden, out[-1:]])
            rows_tokens = torch.cat([rows_tokens, torch.tensor([token], device=device)])
        return drafts
    return propose


def measure(target: nn.Module, prompts: list[list[int]], new_tokens: int, device: torch.device,
            proposers: dict[str, Callable[[list[int]], Proposer]], stop_ids: tuple[int, ...]) -> dict:
    """proposers: name -> factory(full greedy sequence) -> Proposer. Returns per-drafter totals."""
    totals = {name: [0, 0, 0, 0] for name in proposers}
    for prompt in prompts:
        sequence = prompt + greedy(target, prompt, new_tokens, device, stop_ids)
        for name, factory in proposers.items():
            for i, value in enumerate(replay(sequence, len(prompt), factory(sequence))):
                totals[name][i] += value
    return {name: {"verify_steps": s, "tokens": t, "drafted": d, "accepted": a,
                   "tokens_per_step": t / max(1, s), "acceptance_rate": a / max(1, d)}
            for name, (s, t, d, a) in totals.items()}
