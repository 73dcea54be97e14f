"""Build our model and mlx-lm's from the same config and the same HF-named weights."""

from __future__ import annotations

import importlib

import mlx.core as mx

from kapitsa.engine.models import get_model_module
from kapitsa.engine.models.base import use_kernel_options
from kapitsa.engine.options import KernelOptions
from tests.models.hf_weights import nemotron_config, nemotron_weights, qwen_config, qwen_weights

ARCHS = ("qwen3_5_dense", "qwen3_5_moe", "qwen3_next", "nemotron_moe", "nemotron_latent", "nemotron_dense")


def config_and_weights(arch: str, seed: int = 0, mtp: bool = False) -> tuple[dict, dict]:
    if arch.startswith("qwen"):
        kind = {"qwen3_5_dense": "dense", "qwen3_5_moe": "moe", "qwen3_next": "next"}[arch]
        cfg = qwen_config(kind)
        # mlx-lm reads fused experts for qwen3_5_moe and per-expert tensors for qwen3_next
        return cfg, qwen_weights(cfg, seed, mtp=mtp, fused_experts=kind != "next")
    cfg = nemotron_config(arch.split("_")[1])
    if mtp:  # NVIDIA's MTP step: an attention block, then a MoE block (or an MLP on dense models)
        cfg["mtp_hybrid_override_pattern"] = "*E" if cfg.get("n_routed_experts") else "*-"
        cfg["num_nextn_predict_layers"] = 1
    return cfg, nemotron_weights(cfg, seed, mtp=mtp)


def build_ours(arch: str, seed: int = 0, mtp: bool = False, *, kernels: KernelOptions | None = None):
    """The tiny `arch` as kapitsa builds it; `kernels`, when given, goes to its layers."""
    cfg, w = config_and_weights(arch, seed, mtp)
    module = get_model_module(cfg["model_type"])
    model = module.Model(module.ModelArgs.from_dict(cfg))
    model.load_weights(list(model.sanitize(dict(w)).items()), strict=True)
    mx.eval(model.parameters())
    if kernels is not None:
        use_kernel_options(model, kernels)
    return model


def greedy_logits(model, steps: int = 3, prompt=(3, 17, 5, 9)) -> list[mx.array]:  # noqa: ANN001
    """The last-position logits of a prompt and of `steps` greedy decode steps after it, evaluated."""
    cache = model.make_cache(1)
    return greedy_steps(model, cache, model(mx.array([list(prompt)]), cache)[:, -1], steps)


def greedy_steps(model, cache, logits: mx.array, steps: int) -> list[mx.array]:  # noqa: ANN001
    """`logits` `[B, V]` and those of `steps` greedy decode steps after them through `cache`, evaluated."""
    out = [logits]
    for _ in range(steps):
        logits = model(mx.argmax(logits, axis=-1)[:, None].astype(mx.int32), cache)[:, -1]
        out.append(logits)
    mx.eval(out)
    return out


def logits_under_families(model, monkeypatch, families: str) -> list[mx.array]:  # noqa: ANN001
    """`greedy_logits` with the kernel families `families` names (KAPITSA_KERNELS syntax) given to
    the layers, the model's compiled traces dropped first (traces are made under the families in
    force): how a kernel test compares a family on/off. `monkeypatch` is unused: nothing global changes."""
    from kapitsa.engine.traces import drop_traces

    use_kernel_options(model, KernelOptions.from_environ({"KAPITSA_KERNELS": families}))
    drop_traces(model)
    return greedy_logits(model)


def build_mlx_lm(arch: str, seed: int = 0):
    cfg, w = config_and_weights(arch, seed)
    module = importlib.import_module(f"mlx_lm.models.{cfg['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(cfg))
    model.load_weights(list(model.sanitize(dict(w)).items()), strict=True)
    mx.eval(model.parameters())
    return model


def greedy(model, prompt: list[int], n: int, cache) -> tuple[list[int], list[mx.array]]:
    """n greedy tokens after `prompt`; returns the tokens and each step's logits row."""
    logits = model(mx.array([prompt]), cache=cache)[:, -1]
    tokens, rows = [], []
    for _ in range(n):
        rows.append(logits[0])
        tok = int(mx.argmax(logits[0]).item())
        tokens.append(tok)
        logits = model(mx.array([[tok]]), cache=cache)[:, -1]
    return tokens, rows
