"""Timing one greedy request: kapitsa through its engine (`InProcessEngine`, the path `kapitsa run`
and `kapitsa serve` use), mlx-lm through `generate_step`; and the JSON lines the lab scripts print.

A kapitsa engine takes the `KernelOptions` it is timed under, so a variant is an engine made with
other options over the same (or a copied) model. The default is what this process's `KAPITSA_*`
variables name, read as the opener reads them, so `KAPITSA_KERNELS=... python lab/...` still picks.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import mlx.core as mx

from kapitsa.engine.inprocess import InProcessEngine
from kapitsa.engine.options import EngineConfig, KernelOptions
from kapitsa.engine.types import (
    ErrorEvent,
    FinishEvent,
    GenerationRequest,
    ModelInfo,
    SamplingParams,
    TokenEvent,
)

STARTED = time.perf_counter()
DEFAULTS = KernelOptions.from_environ(os.environ)


def emit(row: dict) -> None:
    """Print a result row as a JSON line with `t_s`, the seconds since this process started (where
    a device call's time went, when a part is cut by its limit)."""
    print(json.dumps({**row, "t_s": round(time.perf_counter() - STARTED, 1)}), flush=True)


class _Detok:
    def add(self, token_id: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


class _Tokenizer:
    """Enough tokenizer for prompt_token_ids requests (no text is decoded in this benchmark)."""

    eos_token_ids = frozenset()

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids) -> str:
        return ""

    def detokenizer(self) -> _Detok:
        return _Detok()

    def apply_chat_template(self, messages, **kwargs) -> str:
        return ""


def kapitsa_engine(
    model, prompt_len: int, tokens: int, decode=None, *, kernels: KernelOptions = DEFAULTS
) -> InProcessEngine:
    """kapitsa's engine (the path of `kapitsa run` / `serve`) over a bench model, no prefix cache;
    its model runner gives `kernels` to the model's layers and routed linears."""
    info = ModelInfo(
        id="bench", family="bench", context_length=prompt_len + tokens + 16, max_output_tokens=tokens
    )
    return InProcessEngine(
        model,
        _Tokenizer(),
        info,
        eos_token_ids=set(),
        config=EngineConfig(prefix_cache_bytes=0, prefill_chunk=2048, kernels=kernels),
        decode=decode,
    )


def rounded(result: dict, digits: int) -> dict:
    """A timer's result with its plain numbers rounded (lists and None as they are)."""
    return {k: round(v, digits) if isinstance(v, float) else v for k, v in result.items()}


def step_times(arrivals: list[tuple[float, int]]) -> dict:
    """From (time, tokens) per arrival after the first token: the first three decode steps in ms
    (a delay that decoding pays once shows here) and tok/s over the run's second half (what every
    step costs)."""
    gaps = [(t1 - t0) / n for (t0, _), (t1, n) in zip(arrivals, arrivals[1:], strict=False)]
    half = arrivals[len(arrivals) // 2 :]
    tail = sum(n for _, n in half[1:]) / max(half[-1][0] - half[0][0], 1e-9) if len(half) > 1 else None
    return dict(first_steps_ms=[round(g * 1e3, 2) for g in gaps[:3]], tail_tok_s=tail and round(tail, 1))


async def stream(
    client: InProcessEngine, prompt: list[int], tokens: int, arrivals: list | None = None
) -> tuple[float, float, float, list[int]]:
    """One greedy request of `tokens` tokens: (start, first token, end) perf_counter times and its
    ids; `arrivals` gets (time, tokens) of each token event."""
    start = time.perf_counter()
    ids: list[int] = []
    first = end = None
    request = GenerationRequest(
        prompt_token_ids=tuple(prompt), sampling=SamplingParams(max_tokens=tokens, ignore_eos=True)
    )
    async for event in client.generate(request):
        if isinstance(event, TokenEvent):
            ids += event.token_ids
            first = first or time.perf_counter()
            if arrivals is not None:
                arrivals.append((time.perf_counter(), len(event.token_ids)))
        elif isinstance(event, FinishEvent):
            end = time.perf_counter()
        elif isinstance(event, ErrorEvent):
            raise event.error
    return start, first, end, ids


def generate(client: InProcessEngine, prompt: list[int], tokens: int) -> dict:
    """One greedy request of `tokens` tokens: its ids, time to first token, decode and prefill
    tok/s, and `step_times`."""
    arrivals: list[tuple[float, int]] = []
    start, first, end, ids = asyncio.run(stream(client, prompt, tokens, arrivals))
    return dict(
        ids=ids,
        ttft_s=first - start,
        decode_tok_s=(len(ids) - 1) / max(end - first, 1e-9),
        prefill_tok_s=len(prompt) / (first - start),
        **step_times(arrivals),
    )


def time_kapitsa(
    model,
    prompt: list[int],
    tokens: int,
    warmup: list[int] | None = None,
    *,
    kernels: KernelOptions = DEFAULTS,
) -> dict:
    """`warmup`: the prompt of the warm-up request (default: `prompt`)."""
    client = kapitsa_engine(model, len(prompt), tokens, kernels=kernels)
    try:
        generate(client, warmup or prompt, 8)  # warm-up: kernels compile, buffers allocate
        result = generate(client, prompt, tokens)
    finally:
        client.close()
    result.pop("ids")
    return result


def time_mlxlm(model, prompt: list[int], tokens: int, warmup: list[int] | None = None) -> dict:
    from mlx_lm.generate import generate_step

    def run(tokens: int = tokens, prompt: list[int] = prompt) -> dict:
        start = time.perf_counter()
        arrivals = []
        for (_token, _), _ in zip(
            generate_step(mx.array(prompt), model, max_tokens=tokens), range(tokens), strict=False
        ):
            arrivals.append((time.perf_counter(), 1))
        end, first = time.perf_counter(), arrivals[0][0]
        return dict(
            ttft_s=first - start,
            decode_tok_s=(len(arrivals) - 1) / (end - first),
            prefill_tok_s=len(prompt) / (first - start),
            **step_times(arrivals),
        )

    run(8, warmup or prompt)
    return run()
