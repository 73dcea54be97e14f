"""Count the primitives in one decode step's graph, kapitsa vs mlx-lm (same tiny config).

    python tools/count_ops.py [--kind qwen3_5] [--layers 8]

Launch count is what decode speed on MLX's CUDA backend is made of (see docs/bench), so this is
the number to drive down. Uses mx.export_to_dot on the unevaluated logits of one decode step.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import io
import re
import sys

import mlx.core as mx
import mlx.nn as nn

sys.path.insert(0, ".")
from kapitsa.engine.models import get_model_module  # noqa: E402
from kapitsa.engine.tiny import tiny_config  # noqa: E402


def _q(model):
    nn.quantize(
        model,
        group_size=32,
        bits=4,
        class_predicate=lambda p, m: (
            hasattr(m, "to_quantized")
            and getattr(m, "weight", None) is not None
            and m.weight.shape[-1] % 32 == 0
            and not p.endswith(("mlp.gate", "shared_expert_gate"))
        ),
    )
    mx.eval(model.parameters())
    return model


def count(logits) -> collections.Counter:
    buf = io.StringIO()
    mx.export_to_dot(buf, logits)
    names = re.findall(r'label\s*=\s*"([A-Za-z_]+)', buf.getvalue())
    return collections.Counter(n for n in names)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", default="qwen3_5")
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    config = tiny_config(args.kind, num_hidden_layers=args.layers)
    if args.kind.startswith("nemotron"):
        config.pop("hybrid_override_pattern", None)
        config["hybrid_override_pattern"] = ("M*" if "dense" in args.kind else "ME*E")[0:0] or None
        config = tiny_config(args.kind)
    kmod = get_model_module(config["model_type"])
    km = _q(kmod.Model(kmod.ModelArgs.from_dict(config)))
    lmod = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    lm = _q(lmod.Model(lmod.ModelArgs.from_dict(config)))
    prompt = mx.array([[5, 6, 7, 8, 9, 10, 11, 12]])
    kc = km.make_cache(1)
    mx.eval(km(prompt, kc))
    lc = lm.make_cache()
    mx.eval(lm(prompt, cache=lc))
    tok = mx.array([[13]])
    kcount = count(km(tok, kc))
    lcount = count(lm(tok, cache=lc))
    print(f"layers={len(km.layers)}  kapitsa {sum(kcount.values())} nodes, mlx-lm {sum(lcount.values())}")
    for name in sorted(set(kcount) | set(lcount), key=lambda n: -(kcount[n] + lcount[n])):
        print(f"  {name:28s} {kcount[name]:5d} {lcount[name]:5d}")


if __name__ == "__main__":
    main()
