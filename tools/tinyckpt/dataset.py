"""Token streams for training and evaluation, and random training windows."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch
from tokenizers import Tokenizer

from .agent_chats import make_agent_conversations
from .chats import make_conversations
from .corpus import Function, SourceFile, functions_in, read_stdlib, split_files
from .tokenizer import PAD_TOKEN, train_tokenizer

TRAIN_CHATS = 5000
HELD_OUT_CHATS = 300
TRAIN_AGENT_CHATS = 500  # ~8k tokens each: about a third of the training tokens


@dataclass
class Corpus:
    tokenizer: Tokenizer
    train_ids: np.ndarray  # every training document, each followed by <|endoftext|>
    held_out_code_ids: np.ndarray
    held_out_chat_ids: np.ndarray
    held_out_files: list[SourceFile]
    held_out_functions: list[tuple[str, Function]]
    held_out_chats: list[str]
    stats: dict


def _stream(tokenizer: Tokenizer, texts: list[str]) -> np.ndarray:
    separator = tokenizer.token_to_id(PAD_TOKEN)
    pieces = []
    for encoding in tokenizer.encode_batch(texts):
        pieces.append(np.asarray(encoding.ids, dtype=np.int32))
        pieces.append(np.asarray([separator], dtype=np.int32))
    return np.concatenate(pieces)


def build_corpus(seed: int = 0, tokenizer: Tokenizer | None = None) -> Corpus:
    """`tokenizer`: reuse this one (so fixtures trained on it stay compatible) instead of training one."""
    train_files, held_out_files = split_files(read_stdlib())
    train_pool = [(f.name, fn) for f in train_files for fn in functions_in(f)]
    held_out_pool = [(f.name, fn) for f in held_out_files for fn in functions_in(f)]
    train_chats = make_conversations(train_pool, TRAIN_CHATS, seed)
    train_chats += make_agent_conversations(train_pool, TRAIN_AGENT_CHATS, seed + 2)
    held_out_chats = make_conversations(held_out_pool, HELD_OUT_CHATS, seed + 1)
    documents = [f.text for f in train_files] + train_chats
    random.Random(seed).shuffle(documents)
    tokenizer = tokenizer or train_tokenizer(documents)
    corpus = Corpus(
        tokenizer=tokenizer,
        train_ids=_stream(tokenizer, documents),
        held_out_code_ids=_stream(tokenizer, [f.text for f in held_out_files]),
        held_out_chat_ids=_stream(tokenizer, held_out_chats),
        held_out_files=held_out_files,
        held_out_functions=held_out_pool,
        held_out_chats=held_out_chats,
        stats={},
    )
    corpus.stats = {
        "train_files": len(train_files),
        "held_out_files": len(held_out_files),
        "train_chats": len(train_chats),
        "held_out_chats": len(held_out_chats),
        "train_tokens": int(corpus.train_ids.size),
        "held_out_code_tokens": int(corpus.held_out_code_ids.size),
        "held_out_chat_tokens": int(corpus.held_out_chat_ids.size),
        "held_out_file_names": [f.name for f in held_out_files],
    }
    return corpus


class WindowSampler:
    """Random windows of seq_len + 1 tokens from one stream, from a seeded generator."""

    def __init__(self, ids: np.ndarray, seq_len: int, batch: int, seed: int):
        self.ids = torch.from_numpy(ids.astype(np.int64))
        self.seq_len, self.batch = seq_len, batch
        self.generator = torch.Generator().manual_seed(seed)

    def next(self) -> torch.Tensor:
        starts = torch.randint(
            0, self.ids.numel() - self.seq_len - 1, (self.batch,), generator=self.generator
        )
        return torch.stack([self.ids[s : s + self.seq_len + 1] for s in starts.tolist()])
