"""Train the multi-token-prediction head of a trained Nemotron-H checkpoint whose config names its
MTP step (`mtp_layers_block_type` or `mtp_hybrid_override_pattern`), with MLX on any device.

    python tools/train_mtp_head.py --target tests/checkpoints/trained/nemotron-h --data build/answers.json

The data is the target's own greedy answers to chat prompts (tools/drafter_data.py). The head reads
the target's final-normed hidden state at t and the embedding of token t+1; its label is the
target's own next-token distribution at t+1 (soft cross-entropy: KL to the target plus a constant),
because a draft is accepted when it equals the target's argmax there. The head trains through the
engine's own `mtp_forward` / `mtp_logits` with the target frozen. It is written as `mtp.safetensors`
in the target folder (`--out` elsewhere) under the published names (`mtp.layers.{i}.{norm,mixer,
eh_proj,enorm,hnorm,final_layernorm}`, one tensor per expert, bf16), which the loader reads beside
the model's own files; `mtp-report.json` beside it holds the held-out top-1 agreement with the
target on answer tokens.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parent))

from drafter_data import add_data_arguments, answer_rows  # noqa: E402
from host_products import host_head  # noqa: E402

from kapitsa.engine.loading.loader import LoadedModel, load_model  # noqa: E402
from kapitsa.engine.models.base import use_kernel_options  # noqa: E402
from kapitsa.engine.models.nemotron_h import Block  # noqa: E402
from kapitsa.engine.models.nemotron_mtp import NemotronMTPHead  # noqa: E402
from kapitsa.engine.options import KernelOptions  # noqa: E402

MTP_FILE = "mtp.safetensors"
ROUTER_INIT_STD = 0.02  # the router starts near uniform scores but not tied (zeros tie every expert)


def attach_head(model: nn.Module, seed: int) -> None:
    """A fresh MTP head on a Nemotron-H model, the only trainable part; MLX ops only (no custom
    kernels: they have no gradients)."""
    if getattr(model, "model_type", "") != "nemotron_h" or not model.args.mtp_pattern:
        raise SystemExit("the target must be a Nemotron-H checkpoint whose config names its MTP blocks")
    mx.random.seed(seed)
    model.freeze()
    model.mtp = NemotronMTPHead(model.args, model.args.mtp_pattern, lambda ch: Block(model.args, ch))
    for _, module in model.mtp.named_modules():
        if hasattr(module, "e_score_correction_bias"):  # a balancing bias, not a trained weight
            module.weight = ROUTER_INIT_STD * mx.random.normal(module.weight.shape)
            module.freeze(keys=["e_score_correction_bias"])
    use_kernel_options(model, KernelOptions(families=frozenset(), compile_decode=False))


def states(loaded: LoadedModel, rows: list[tuple[list[int], int]]) -> list[dict]:
    """Each row's ids and the target's final-normed hidden states `[L, H]` (float16, host memory)."""
    out = []
    for ids, start in rows:
        hidden = loaded.model.final_norm(loaded.model.forward(mx.array([ids])).hidden)[0]
        out.append(dict(ids=ids, start=start, hidden=np.array(hidden.astype(mx.float16))))
    return out


def window(example: dict, begin: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """(hidden rows t = begin .. begin+length, ids t+1 for the first `length` of them)."""
    hidden = example["hidden"][begin : begin + length + 1]
    return hidden, np.array(example["ids"][begin + 1 : begin + length + 1])


def batch(examples: list[dict], size: int, length: int, rng: random.Random) -> tuple[mx.array, mx.array]:
    """`size` windows of `length` positions, each inside one sequence (prompt and answer)."""
    rows = [ex for ex in examples if len(ex["ids"]) > length + 1]
    picked = [rng.choice(rows) for _ in range(size)]
    pairs = [window(ex, rng.randrange(len(ex["ids"]) - length), length) for ex in picked]
    return mx.array(np.stack([h for h, _ in pairs])).astype(mx.float32), mx.array(
        np.stack([i for _, i in pairs])
    )


def distill_loss(model: nn.Module, head, hidden: mx.array, next_ids: mx.array) -> mx.array:  # noqa: ANN001
    """Mean cross-entropy of the head at t against the target's distribution at t+1."""
    teacher = mx.stop_gradient(mx.softmax(head(hidden[:, 1:]), axis=-1))
    logits = head(model.mtp_forward(next_ids, hidden[:, :-1]))
    return -(teacher * nn.log_softmax(logits, axis=-1)).sum(axis=-1).mean()


def agreement(model: nn.Module, examples: list[dict]) -> float:
    """Top-1 agreement of the head with the target on answer positions, each answer whole."""
    hits = total = 0
    for ex in examples:
        hidden, next_ids = window(ex, 0, len(ex["ids"]) - 1)
        hidden = mx.array(hidden).astype(mx.float32)
        guess = mx.argmax(
            model.mtp_logits(model.mtp_forward(mx.array(next_ids)[None], hidden[None, :-1])), -1
        )
        wanted = mx.argmax(model.head()(hidden[None, 1:]), axis=-1)
        answer = slice(ex["start"], None)  # positions whose drafted token (t+2) lies in the answer
        hits += int((guess[0, answer] == wanted[0, answer]).sum())
        total += guess[0, answer].size
    return hits / max(total, 1)


def published(head: NemotronMTPHead, num_experts: int) -> dict[str, mx.array]:
    """The head's tensors under NVIDIA's names: `.block.` dropped, stacked experts split per expert."""
    out = {}
    for name, value in tree_flatten(head.parameters()):
        name = "mtp." + name.replace(".block.", ".")
        for fc, proj in (("fc1", "up_proj"), ("fc2", "down_proj")):
            if name.endswith(f"switch_mlp.{fc}.weight"):
                base = name.removesuffix(f"switch_mlp.{fc}.weight")
                out |= {f"{base}experts.{e}.{proj}.weight": value[e] for e in range(num_experts)}
                break
        else:
            out[name] = value
    return {k: v.astype(mx.bfloat16) for k, v in out.items()}  # as the checkpoint stores every tensor


def train(args: argparse.Namespace) -> dict:
    started = time.perf_counter()
    loaded = load_model(args.target)
    train_rows, held_rows = answer_rows(loaded, args)
    data, held = states(loaded, train_rows), states(loaded, held_rows)
    print(
        f"data: {len(data)} answers, {len(held)} held out, {time.perf_counter() - started:.0f} s", flush=True
    )
    # A fresh copy: serving re-classes the linears for the CPU BLAS route, which reads arrays on the
    # host and so passes no gradient through the LM head (ops/linear.py, kernels/cpu_blas.py).
    model = load_model(args.target).model
    attach_head(model, args.seed)
    optimizer = optim.AdamW(
        learning_rate=optim.join_schedules(
            [
                optim.linear_schedule(0.0, args.lr, args.warmup),
                optim.cosine_decay(args.lr, args.steps, args.lr * 0.05),
            ],
            [args.warmup],
        ),
        weight_decay=0.01,
    )
    head = host_head(model)
    step_fn = nn.value_and_grad(model, lambda m, h, ids: distill_loss(m, head, h, ids))
    rng = random.Random(args.seed)
    for step in range(1, args.steps + 1):
        loss, grads = step_fn(model, *batch(data, args.batch, args.window, rng))
        optimizer.update(model, grads)
        mx.eval(model.mtp.parameters(), optimizer.state, loss)
        if step % 100 == 0 or step == 1:
            print(f"step {step} loss {loss.item():.3f} ({time.perf_counter() - started:.0f} s)", flush=True)
    out = args.out or Path(args.target) / MTP_FILE
    mx.save_safetensors(
        str(out), published(model.mtp, model.args.n_routed_experts), metadata={"format": "pt"}
    )
    reloaded = load_model(args.target if args.out is None else _beside(args.target, out)).model
    use_kernel_options(reloaded, KernelOptions(families=frozenset(), compile_decode=False))
    report = dict(
        target=str(args.target),
        steps=args.steps,
        answers=len(data),
        parameters=sum(v.size for _, v in tree_flatten(model.mtp.parameters())),
        held_out_top1_agreement=round(agreement(reloaded, held), 3),
        seconds=round(time.perf_counter() - started),
    )
    out.with_name("mtp-report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def _beside(target: Path, mtp_file: Path) -> Path:
    """A folder of links to the target's files plus the new head, for the read-back check."""
    folder = mtp_file.with_name(mtp_file.stem + "-checkpoint")
    folder.mkdir(exist_ok=True)
    for f in Path(target).iterdir():
        if f.name != MTP_FILE and not (folder / f.name).exists():
            (folder / f.name).symlink_to(f.resolve())
    (folder / MTP_FILE).unlink(missing_ok=True)
    (folder / MTP_FILE).symlink_to(mtp_file.resolve())
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", type=Path, default=Path("tests/checkpoints/trained/nemotron-h"))
    parser.add_argument(
        "--out", type=Path, help=f"where to write the head (default: the target's {MTP_FILE})"
    )
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=30)
    add_data_arguments(parser)
    args = parser.parse_args()
    print(json.dumps(train(args)))


if __name__ == "__main__":
    main()
