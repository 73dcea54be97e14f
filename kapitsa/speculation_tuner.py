"""`kapitsa bench --tune-speculation`: time each candidate draft shape (engine/speculative/tuning.py)
on one load of the model, keep the fastest for the opener.

The workload is the one speculation exists for: the model is shown code and asked to write it
back with one name changed, greedy, so every shape writes the same tokens and only the speed
differs. Plain decoding is timed too, as the reference the report prints.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from kapitsa.engine.types import ErrorEvent, FinishEvent, GenerationRequest, SamplingParams, TokenEvent
from kapitsa.opener import engine_config, load_for_ref, start_engine, tuning_key_for, tuning_path
from kapitsa.settings import KapitsaSettings, load_settings

_CODE = '''def merge_intervals(intervals):
    """Merge overlapping [start, end] intervals; the result is sorted by start."""
    ordered = sorted(intervals, key=lambda item: item[0])
    merged = []
    for start, end in ordered:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def total_covered(intervals):
    """The length the intervals cover together, overlaps counted once."""
    return sum(end - start for start, end in merge_intervals(intervals))
'''
EDIT_MESSAGES = [
    {
        "role": "user",
        "content": f"Rewrite this code exactly, only renaming `ordered` to `by_start`:\n\n```python\n{_CODE}```",
    }
]


@dataclass(slots=True, frozen=True)
class TuneResult:
    best_label: str
    pays: bool  # the best shape beat plain decoding; if not, `auto` decodes plainly here
    plain_tok_s: float
    tok_s: dict[str, float]  # per candidate label
    path: Path
    key: str


def tune_speculation(
    ref: str | None,
    *,
    draft: str | None = None,
    tokens: int = 160,
    settings: KapitsaSettings | None = None,
    on_result: Callable[[str, float], None] = lambda label, tok_s: None,
) -> TuneResult:
    """Time plain decoding and every candidate shape on `ref`, write the fastest shape."""
    from kapitsa.engine.speculative.tuning import CANDIDATES, Tuning, fastest, write_tuning

    settings = settings or load_settings()
    loaded = load_for_ref(ref, settings=settings)
    # No prefix cache: every run decodes the same prompt from cold, so runs compare.
    config = replace(engine_config(settings), prefix_cache_bytes=0, disk_cache_dir=None)
    template = loaded.tokenizer.apply_chat_template(EDIT_MESSAGES, add_generation_prompt=True)
    prompt = loaded.tokenizer.encode(template)

    def timed(speculative: str, **shape: object) -> float:
        engine = start_engine(loaded, config, speculative=speculative, draft=draft, **shape)
        with contextlib.closing(engine):
            asyncio.run(_decode_tok_s(engine, prompt, tokens))  # warm-up: compiles what it meets
            return asyncio.run(_decode_tok_s(engine, prompt, tokens))

    plain = timed("none")
    on_result("plain", plain)
    measured = {}
    for shape in CANDIDATES:
        measured[shape] = timed("auto", draft_tokens=shape.draft_tokens, tree=shape.tree)
        on_result(shape.label, measured[shape])
    best = fastest(measured)
    path, key = tuning_path(settings), tuning_key_for(loaded)
    pays = measured[best] > plain
    write_tuning(path, key, Tuning(best, pays), measured, plain)
    return TuneResult(best.label, pays, plain, {s.label: v for s, v in measured.items()}, path, key)


async def _decode_tok_s(engine, prompt: list[int], tokens: int) -> float:  # noqa: ANN001 - an EngineClient
    request = GenerationRequest(
        prompt_token_ids=tuple(prompt),
        sampling=SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True),
    )
    first = end = None
    count = 0
    async for event in engine.generate(request):
        if isinstance(event, TokenEvent):
            count += len(event.token_ids)
            first = first or time.perf_counter()
        elif isinstance(event, FinishEvent):
            end = time.perf_counter()
        elif isinstance(event, ErrorEvent):
            raise event.error
    if first is None or end is None or count < 2:
        return 0.0
    return (count - 1) / max(end - first, 1e-9)
