"""Where a verify forward stops computing positions as one-token decode steps do, bit for bit.

Greedy speculation writes what plain decoding writes only if the verify's rows equal the decode
steps' outputs exactly (near-ties in bf16 fall either way otherwise). This feeds the same tokens
to two caches after one prefill: one token at a time (decode) and all at once with `record=True`
(a verify), and compares every layer's output at every position. It prints, per model and kernel
setting, the first layer that differs, its kind, and the largest difference after each layer.

    python lab/verify_vs_decode.py                       # the bf16 test's tiny models (unquantized)
    python lab/verify_vs_decode.py --small --quantize    # widths the CUDA kernels take, 4-bit
    python lab/verify_vs_decode.py --variants default KAPITSA_KERNELS=none KAPITSA_QLINEAR=stock
"""

from __future__ import annotations

import argparse
import json

import mlx.core as mx
import mlx.nn as nn

from kapitsa.engine.models import get_model_module
from kapitsa.engine.options import KernelOptions
from kapitsa.engine.runner.model_runner import ModelRunner
from kapitsa.testing.tiny import tiny_config
from lab.models_under_test import prompt_ids, quantizable, random_routers

# widths the CUDA mat-vec kernels take (K a multiple of 256), with the tiny models' layer pattern;
# Qwen's head size is its checkpoints' 256, which takes kapitsa's attention decode kernel on CUDA
SMALL = {
    "qwen3_5": dict(
        hidden_size=512,
        intermediate_size=1024,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
    ),
    "nemotron_h": dict(
        hidden_size=512,
        intermediate_size=1024,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=128,
        mamba_num_heads=16,
        mamba_head_dim=64,
        moe_intermediate_size=256,
        moe_shared_expert_intermediate_size=512,
    ),
}


def build(kind: str, *, small: bool, quantize: bool, dtype: mx.Dtype) -> nn.Module:
    config = tiny_config(kind, **(SMALL[kind] if small else {}))
    module = get_model_module(config["model_type"])
    mx.random.seed(0)
    model = module.Model(module.ModelArgs.from_dict(config))
    random_routers(model)
    model.set_dtype(dtype)
    if quantize:
        nn.quantize(model, group_size=64, bits=4, class_predicate=quantizable)
    mx.eval(model.parameters())
    return model


def layer_kind(layer: nn.Module) -> str:
    """The layer's mixer class (and its MLP's, where it has one): what its output went through."""
    parts = [type(layer).__name__]
    for name in ("linear_attn", "self_attn", "mixer", "mlp"):
        child = getattr(layer, name, None)
        if isinstance(child, nn.Module):
            parts.append(f"{name}={type(child).__name__}")
    return " ".join(parts)


def _run_decode(model, cache, tokens: list[int], layers: tuple[int, ...]) -> list[list[mx.array]]:
    """Each token as its own decode step: per step, every layer's output and the logits."""
    steps = []
    for token in tokens:
        out = model.forward(mx.array([[token]], dtype=mx.int32), cache, taps=layers)
        steps.append([out.taps[i] for i in layers] + [model.logits(out.hidden)])
        mx.eval(steps[-1])
    return steps


def _first_difference(model, stepped: list[list[mx.array]], verified: list[mx.array]) -> dict:
    """Per layer (and the logits): the largest difference over positions, and which positions."""
    n_layers = len(model.layers)
    report: dict = {"first_layer": None, "first_kind": None, "max_diff": [], "positions_differing": []}
    for i in range(n_layers + 1):
        diffs = [
            float(mx.abs(step[i][0, 0].astype(mx.float32) - verified[i][0, p].astype(mx.float32)).max())
            for p, step in enumerate(stepped)
        ]
        report["max_diff"].append(max(diffs))
        report["positions_differing"].append([p for p, d in enumerate(diffs) if d > 0])
        if report["first_layer"] is None and max(diffs) > 0:
            report["first_layer"] = i if i < n_layers else "logits"
            report["first_kind"] = layer_kind(model.layers[i]) if i < n_layers else "final norm + head"
    return report


def compare(model: nn.Module, options: KernelOptions, prompt: list[int], tokens: list[int]) -> dict:
    """The verify's rows against decode steps, then (`after_rollback`) the decode step that
    follows a verify whose last tokens were rejected, against the same step after decoding only
    the kept tokens: the replayed recurrent state must equal the decoded one."""
    runner = ModelRunner(model, kernels=options)
    layers = tuple(range(len(model.layers)))
    decode_cache, verify_cache = model.make_cache(1), model.make_cache(1)
    runner.prefill(decode_cache, prompt)
    runner.prefill(verify_cache, prompt)
    stepped = _run_decode(model, decode_cache, tokens, layers)
    out = model.forward(mx.array([tokens], dtype=mx.int32), verify_cache, record=True, taps=layers)
    verified = [out.taps[i] for i in layers] + [model.logits(out.hidden)]
    mx.eval(verified)
    report = _first_difference(model, stepped, verified)
    verify_cache.commit()
    after = {}
    for kept in sorted({1, len(tokens) // 2, len(tokens) - 1} - {0}):
        cache, check = model.make_cache(1), model.make_cache(1)
        runner.prefill(cache, prompt)
        runner.prefill(check, prompt)
        model.forward(mx.array([tokens], dtype=mx.int32), cache, record=True)
        cache.rollback([len(tokens) - kept])
        following = tokens[kept : kept + 1]
        rolled = _run_decode(model, cache, following, layers)[0]
        decoded = _run_decode(model, check, tokens[:kept] + following, layers)[-1]
        diff = _first_difference(model, [decoded], [r for r in rolled])
        after[kept] = diff["first_layer"], diff["first_kind"]
    report["after_rollback"] = {str(k): v for k, v in after.items()}
    return report


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kinds", nargs="+", default=["qwen3_5", "nemotron_h"])
    ap.add_argument("--variants", nargs="+", default=["default", "KAPITSA_KERNELS=none"])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument(
        "--small", action="store_true", help="widths the CUDA kernels take (else the test's tiny)"
    )
    ap.add_argument("--quantize", action="store_true", help="4-bit linears (group 64), as checkpoints are")
    ap.add_argument("--prompt", type=int, default=40)
    ap.add_argument("--width", type=int, default=8, help="tokens in the verify forward")
    args = ap.parse_args()
    print(json.dumps({"device": str(mx.default_device())}), flush=True)
    for kind in args.kinds:
        for dtype_name in args.dtypes:
            for variant in args.variants:
                environ = dict([variant.split("=", 1)]) if "=" in variant else {}
                options = KernelOptions.from_environ(environ)
                model = build(kind, small=args.small, quantize=args.quantize, dtype=getattr(mx, dtype_name))
                vocab = model.args.vocab_size if hasattr(model, "args") else 512
                prompt = prompt_ids(args.prompt, vocab)
                tokens = prompt_ids(args.width, vocab, stride=4099)
                report = compare(model, options, prompt, tokens)
                line = dict(
                    kind=kind, dtype=dtype_name, variant=variant, small=args.small, quantized=args.quantize
                )
                line.update(report)
                line["max_diff"] = [f"{d:.3g}" for d in line["max_diff"]]
                print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
