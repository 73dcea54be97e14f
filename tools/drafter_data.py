"""Training data for drafters (tools/train_block_drafter.py, tools/train_mtp_head.py): a trained
target's own greedy answers to chat prompts made from the standard library's functions.

Drafts are accepted when they equal the target's greedy tokens, so the target's answers (not the
corpus) are what a drafter learns from. The held-out chats come from the corpus's held-out files.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tinyckpt.corpus import functions_in, read_stdlib, split_files  # noqa: E402

from kapitsa.engine.inprocess import InProcessEngine  # noqa: E402
from kapitsa.engine.loading.loader import LoadedModel  # noqa: E402
from kapitsa.engine.options import EngineConfig  # noqa: E402
from kapitsa.engine.types import FinishEvent, GenerationRequest, SamplingParams, TokenEvent  # noqa: E402

ASKS = ("Complete this function:\n\n{header}\n", "Explain what this function does:\n\n{source}")
ASKS += ("Rewrite this function, keeping its behaviour:\n\n{source}",)
CONCURRENT = 16


def prompts(count: int, held_count: int, seed: int) -> tuple[list[list[dict]], list[list[dict]]]:
    """(training chats, held-out chats): the held-out ones from the corpus's held-out files."""
    rng = random.Random(seed)
    out = []
    for files, n in zip(split_files(read_stdlib()), (count, held_count), strict=True):
        functions = [f for source in files for f in functions_in(source, max_lines=16)]
        rng.shuffle(functions)
        out.append(
            [
                [{"role": "user", "content": ASKS[i % len(ASKS)].format(header=f.header, source=f.source)}]
                for i, f in enumerate(functions[:n])
            ]
        )
    return out[0], out[1]


async def _answer(engine: InProcessEngine, messages: list[dict], tokens: int) -> list[int]:
    request = GenerationRequest(messages=tuple(messages), sampling=SamplingParams(max_tokens=tokens))
    ids: list[int] = []
    async for event in engine.generate(request):
        if isinstance(event, TokenEvent):
            ids += event.token_ids
        elif isinstance(event, FinishEvent):
            break
    return ids


def answers(loaded: LoadedModel, chats: list[list[dict]], tokens: int) -> list[tuple[list[int], int]]:
    """(prompt + greedy answer ids, where the answer starts) per chat with an answer longer than 8
    tokens, through the engine's batching."""
    engine = InProcessEngine.from_loaded(
        loaded, config=EngineConfig(prefix_cache_bytes=0, max_running=CONCURRENT)
    )

    async def run() -> list[list[int]]:
        out: list[list[int]] = []
        for start in range(0, len(chats), CONCURRENT):
            batch = chats[start : start + CONCURRENT]
            out += await asyncio.gather(*(_answer(engine, c, tokens) for c in batch))
        return out

    try:
        generated = asyncio.run(run())
    finally:
        engine.close()
    tok = loaded.tokenizer
    rows = []
    for chat, ids in zip(chats, generated, strict=True):
        prompt = tok.encode(tok.apply_chat_template(chat, add_generation_prompt=True))
        if len(ids) > 8:
            rows.append((prompt + ids, len(prompt)))
    return rows


def answer_rows(loaded: LoadedModel, args) -> tuple[list, list]:  # noqa: ANN001 - argparse.Namespace
    """(training rows, held-out rows) of `answers`; read from `args.data` when that file exists
    (the same target and settings made it), else made and, with `args.data` given, saved there."""
    if args.data is not None and args.data.exists():
        saved = json.loads(args.data.read_text())
        return [tuple(r) for r in saved["train"]], [tuple(r) for r in saved["held_out"]]
    train_chats, held_chats = prompts(args.prompts, args.held_out, args.seed)
    train_rows, held_rows = (answers(loaded, c, args.answer_tokens) for c in (train_chats, held_chats))
    if args.data is not None:
        args.data.write_text(json.dumps({"train": train_rows, "held_out": held_rows}))
    return train_rows, held_rows


def add_data_arguments(parser) -> None:  # noqa: ANN001 - argparse.ArgumentParser
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--held-out", type=int, default=48)
    parser.add_argument("--answer-tokens", type=int, default=128)
    parser.add_argument(
        "--data", type=Path, help="a JSON file of the answers, read if it exists, else written"
    )
    parser.add_argument("--seed", type=int, default=0)
