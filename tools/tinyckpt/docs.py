"""Render docs/checkpoints.md's numbers section from a results.json written by the evaluate phase."""

from __future__ import annotations

import json
import sys
from pathlib import Path

NAMES = {
    "qwen35-demo": "Qwen3.5 demo (`kapitsa/demo`)",
    "qwen35-draft": "Qwen3.5 draft",
    "nemotron-h": "Nemotron-H",
    "unigram": "unigram baseline (train counts, add-one)",
}


def _loss_table(results: dict) -> list[str]:
    rows = [
        "| model | parameters | steps | held-out code loss (nats/token) | held-out chat loss |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for key, label in NAMES.items():
        loss = results["losses"][key]
        log = results["training"].get(key, {})
        params = f"{log['parameters'] / 1e6:.2f}M" if log else "-"
        rows.append(
            f"| {label} | {params} | {log.get('steps', '-')} | {loss['code']:.3f} | {loss['chat']:.3f} |"
        )
    mtp = results["losses"]["mtp_t+2"]
    rows.append(
        f"| MTP head (token t+2) | {results['training']['mtp']['parameters'] / 1e6:.2f}M | "
        f"{results['training']['mtp']['steps']} | {mtp['code']['loss']:.3f} (top-1 {mtp['code']['top1']:.1%}) | "
        f"{mtp['chat']['loss']:.3f} (top-1 {mtp['chat']['top1']:.1%}) |"
    )
    return rows


def _acceptance_table(results: dict) -> list[str]:
    acc = results["acceptance"]
    rows = [
        "| drafter | chat: tokens / verify step | chat: draft tokens accepted | code: tokens / verify step | code: accepted |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name in acc["chat"]:
        chat, code = acc["chat"][name], acc["code"][name]
        rows.append(
            f"| {name} | {chat['tokens_per_step']:.2f} | {chat['acceptance_rate']:.1%} | "
            f"{code['tokens_per_step']:.2f} | {code['acceptance_rate']:.1%} |"
        )
    return rows


def _samples(results: dict, folder: str) -> list[str]:
    lines = []
    samples = results["completions"][folder]
    shown = [s for s in samples if s["mode"] == "raw"][:3] + [s for s in samples if s["mode"] == "chat"]
    for sample in shown:
        lines += [
            f"Prompt ({sample['mode']}):",
            "",
            "```",
            sample["prompt"].rstrip("\n"),
            "```",
            "",
            "Greedy completion:",
            "",
            "```",
            sample["completion"].rstrip("\n"),
            "```",
            "",
        ]
    return lines


def render(results: dict) -> str:
    lines = [
        f"Measured on {results['device']}, Python {results['python'].split()[0]}, torch {results['torch']}, "
        f"transformers {results['transformers']}.",
        "",
        "### Held-out loss",
        "",
    ]
    lines += _loss_table(results)
    lines += [
        "",
        "### Draft acceptance (greedy, target = Qwen3.5 demo in fp32)",
        "",
        f"{results['acceptance']['prompts_each']} chat prompts and {results['acceptance']['prompts_each']} "
        f"raw-code prompts from held-out files, {results['acceptance']['new_tokens']} new tokens each. "
        "Tokens per verify step counts the target's own bonus token (no drafter = 1.00).",
        "",
    ]
    lines += _acceptance_table(results)
    for folder in ("qwen35-demo", "nemotron-h"):
        lines += ["", f"### Greedy completions: {NAMES[folder]}", ""] + _samples(results, folder)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render(json.loads(Path(sys.argv[1]).read_text())))
