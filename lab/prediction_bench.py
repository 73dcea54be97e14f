"""Predicted Outputs: decode tok/s of one edit request with and without a `prediction`, on one
engine built as `kapitsa serve` builds it (its default `--speculative auto`).

    python lab/prediction_bench.py [--model demo] [--tokens 128] [--rounds 3]

The request asks for a rewrite of a code file (lab/speculative_bench.py's edit workload). The
predictions: the file as sent ("file", what an editor client sends), and the model's own greedy
answer ("answer", the best case). Greedy, so every variant's text must equal the plain one's; the
script checks it. Rounds alternate the variants; one JSON line per run, then medians.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import statistics
import time

from kapitsa.engine.types import FinishEvent, GenerationRequest, SamplingParams, TokenEvent
from kapitsa.opener import open_engine
from lab.speculative_bench import _edit_prompt


async def _run(client, messages: list[dict], tokens: int, prediction: str | None) -> dict:
    request = GenerationRequest(
        messages=tuple(messages),
        sampling=SamplingParams(max_tokens=tokens, ignore_eos=True),
        prediction=prediction,
    )
    text, first, usage = [], None, None
    async for event in client.generate(request):
        if isinstance(event, TokenEvent):
            text.append(event.text)
            first = first or time.perf_counter()
        elif isinstance(event, FinishEvent):
            end, usage = time.perf_counter(), event.usage
    decode_tok_s = (usage.completion_tokens - 1) / max(end - first, 1e-9)
    return {
        "text": "".join(text),
        "decode_tok_s": round(decode_tok_s, 1),
        "drafted": usage.draft_tokens_proposed,
        "accepted": usage.draft_tokens_accepted,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="demo")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    messages = _edit_prompt()
    source = re.split(r"\n\n", messages[0]["content"], maxsplit=1)[1]
    with contextlib.closing(open_engine(args.model)) as client:
        plain = asyncio.run(_run(client, messages, args.tokens, None))  # also the first-use warm-up
        predictions = {"none": None, "file": source, "answer": plain["text"]}
        runs: dict[str, list[dict]] = {name: [] for name in predictions}
        for round_index in range(args.rounds):
            for name, prediction in predictions.items():
                run = asyncio.run(_run(client, messages, args.tokens, prediction))
                assert run["text"] == plain["text"], f"{name}: the text differs from plain decoding"
                runs[name].append(run)
                row = {k: v for k, v in run.items() if k != "text"}
                print(json.dumps({"round": round_index, "prediction": name, **row}), flush=True)
    base = statistics.median(r["decode_tok_s"] for r in runs["none"])
    for name, rows in runs.items():
        median = statistics.median(r["decode_tok_s"] for r in rows)
        print(json.dumps({"summary": name, "decode_tok_s": median, "vs_none": round(median / base, 2)}))


if __name__ == "__main__":
    main()
