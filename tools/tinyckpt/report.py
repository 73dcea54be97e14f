"""Everything docs/checkpoints.md reports, computed from the saved checkpoint folders."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

from . import acceptance
from .agent_chats import make_agent_conversation
from .architectures import MTPHead
from .chats import _prompt_upto_docstring
from .checkpoint import load_mtp_weights
from .corpus import functions_in, read_stdlib, split_files
from .evaluation import bits, greedy, held_out_loss, held_out_mtp, unigram_loss
from .template import render_chat
from .tokenizer import EOS_TOKEN, PAD_TOKEN

FOLDERS = {"qwen35-demo": "Qwen3.5 demo", "qwen35-draft": "Qwen3.5 draft", "nemotron-h": "Nemotron-H"}
DEMO_PROMPT = "def fibonacci(n):"


def _load(folder: Path, device: torch.device) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device)
    return model.eval()


def _held_out_functions(count: int):
    _, held_out = split_files(read_stdlib())
    functions = [(f.name, fn) for f in held_out for fn in functions_in(f, max_lines=20) if fn.docstring]
    step = max(1, len(functions) // count)
    return functions[::step][:count]


def _chat_prompt(tokenizer: Tokenizer, user: str) -> list[int]:
    return tokenizer.encode(render_chat([{"role": "user", "content": user}], add_generation_prompt=True)).ids


def _completions(model, tokenizer: Tokenizer, functions, device: torch.device) -> list[dict]:
    stops = (tokenizer.token_to_id(EOS_TOKEN), tokenizer.token_to_id(PAD_TOKEN))
    samples = []
    for module, fn in functions:
        prompt = _prompt_upto_docstring(fn) + "\n"
        ids = greedy(model, tokenizer.encode(prompt).ids, 64, device, stops)
        samples.append(
            {
                "module": module,
                "mode": "raw",
                "prompt": prompt,
                "completion": tokenizer.decode(ids, skip_special_tokens=False),
            }
        )
    for header in [DEMO_PROMPT] + [fn.header for _, fn in functions[:2]]:
        ids = greedy(model, _chat_prompt(tokenizer, header), 128, device, stops)
        samples.append(
            {"mode": "chat", "prompt": header, "completion": tokenizer.decode(ids, skip_special_tokens=False)}
        )
    return samples


def _agent_answers(model, tokenizer: Tokenizer, device: torch.device, count: int) -> list[dict]:
    """Greedy answers after held-out agent-shaped prompts (long system prompt, many tools): how long
    the prompt was, how many tokens the answer took, and whether it stopped by itself."""
    import random

    _, held_out = split_files(read_stdlib())
    pool = [(f.name, fn) for f in held_out for fn in functions_in(f)]
    rng, stops, rows = random.Random(11), (tokenizer.token_to_id(EOS_TOKEN),), []
    while len(rows) < count:
        text = make_agent_conversation(pool, rng)
        if text is None:
            continue
        prompt = (
            text[: text.rindex("<|im_start|>assistant")] + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
        )
        ids = tokenizer.encode(prompt).ids
        answer = greedy(model, ids, 256, device, stops)
        rows.append(
            {"prompt_tokens": len(ids), "answer_tokens": len(answer), "stopped": answer[-1:] == [stops[0]]}
        )
    return rows


def _acceptance(out: Path, target, tokenizer: Tokenizer, device: torch.device, quick: bool) -> dict:
    draft = _load(out / "qwen35-draft", device)
    mtp = MTPHead(target.config).to(device)
    mtp.load_state_dict(load_mtp_weights(out / "qwen35-demo"), strict=False)
    mtp.float().eval()
    count = 2 if quick else 12
    chat_prompts = [
        _chat_prompt(
            tokenizer, f"Complete this Python function:\n\n```python\n{_prompt_upto_docstring(fn)}\n```"
        )
        for _, fn in _held_out_functions(count)
    ]
    code = np.load(out / "data" / "held_out_code_ids.npy")
    offsets = np.linspace(0, code.size - 400, count).astype(int)
    code_prompts = [code[o : o + 192].tolist() for o in offsets]
    proposers = {
        "ngram_k4": lambda seq: acceptance.ngram_proposer(4),
        "draft_k2": lambda seq: acceptance.draft_model_proposer(draft, 2, device),
        "draft_k4": lambda seq: acceptance.draft_model_proposer(draft, 4, device),
        "mtp_k1": lambda seq: acceptance.mtp_proposer(mtp, target, seq, 1, device),
        "mtp_k2": lambda seq: acceptance.mtp_proposer(mtp, target, seq, 2, device),
    }
    stops = (tokenizer.token_to_id(EOS_TOKEN), tokenizer.token_to_id(PAD_TOKEN))
    new_tokens = 16 if quick else 64
    return {
        "chat": acceptance.measure(target, chat_prompts, new_tokens, device, proposers, stops),
        "code": acceptance.measure(target, code_prompts, new_tokens, device, proposers, stops),
        "prompts_each": count,
        "new_tokens": new_tokens,
    }


def evaluate_all(out: Path, device: torch.device, quick: bool = False) -> dict:
    tokenizer = Tokenizer.from_file(str(out / "tokenizer" / "tokenizer.json"))
    data = {
        n: np.load(out / "data" / f"{n}.npy") for n in ("train_ids", "held_out_code_ids", "held_out_chat_ids")
    }
    if quick:
        data = {n: (v if n == "train_ids" else v[:2000]) for n, v in data.items()}
    vocab = tokenizer.get_vocab_size()
    losses = {
        "unigram": {
            "code": unigram_loss(data["train_ids"], data["held_out_code_ids"], vocab),
            "chat": unigram_loss(data["train_ids"], data["held_out_chat_ids"], vocab),
        }
    }
    completions, functions = {}, _held_out_functions(2 if quick else 6)
    for folder in FOLDERS:
        model = _load(out / folder, device)
        losses[folder] = {
            split: held_out_loss(model, data[f"held_out_{split}_ids"], 512, device)
            for split in ("code", "chat")
        }
        completions[folder] = _completions(model, tokenizer, functions, device)
        del model
    target = _load(out / "qwen35-demo", device)
    mtp = MTPHead(target.config).to(device)
    mtp.load_state_dict(load_mtp_weights(out / "qwen35-demo"), strict=False)
    losses["mtp_t+2"] = {
        split: held_out_mtp(mtp.float().eval(), target, data[f"held_out_{split}_ids"], 512, device)
        for split in ("code", "chat")
    }
    for entry in losses.values():
        for split, value in list(entry.items()):
            if isinstance(value, float):
                entry[f"{split}_bits"] = bits(value)
    logs = {p.stem: json.loads(p.read_text()) for p in sorted((out / "logs").glob("*.json"))}
    for record in logs.values():
        record.pop("losses", None)
    return {
        "python": __import__("sys").version,
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "corpus": json.loads((out / "data" / "corpus.json").read_text()),
        "training": logs,
        "losses": losses,
        "acceptance": _acceptance(out, target, tokenizer, device, quick),
        "agent_answers": _agent_answers(target, tokenizer, device, 2 if quick else 6),
        "completions": completions,
    }
