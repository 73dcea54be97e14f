"""Flint at its published shape (random weights): the `:small` recipe against plain 4-bit, through
kapitsa's engine (the path of `kapitsa run`), with each variant's weight bytes; beside them
mlx-vlm 0.7.10's own Flint language model at 4 bits, timed through mlx-lm's generate_step (what
`mlx_vlm.generate` runs for text), when mlx-vlm is installed.

`:small` is timed at two budgets: a 24 GB Mac's Metal working set (16 GiB: the rest at 6 bits) and a
16 GB Mac's (10.67 GiB: the rest at 3 bits). Plain 4-bit is `models_under_test.materialize`.

    python lab/small_flint.py [--tokens 128] [--prompt 512]
    python lab/small_flint.py --tiny       # a seconds-long smoke run on any machine
"""

from __future__ import annotations

import argparse
import gc

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from kapitsa.engine.loading.small import apply_small, plan_small
from kapitsa.engine.models import get_model_module
from kapitsa.testing.tiny_flint import flint_config
from lab.engine_timing import emit, rounded, time_kapitsa, time_mlxlm
from lab.models_under_test import DTYPE, materialize, prompt_ids

GiB = 1 << 30
_FULL = [0, 1, *range(5, 46, 4), 48]  # full attention without RoPE (NeMo AutoModel's Flint page)
FLINT = dict(
    model_type="flint",
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=49,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    vocab_size=150144,
    layer_types=["full_attention" if i in _FULL else "sliding_attention" for i in range(49)],
    no_rope_layer_indices=_FULL,
    sliding_window=513,
    mlp_only_layers=[0, 1],
    num_experts=256,
    num_experts_per_tok=6,
    moe_intermediate_size=512,
    shared_expert_intermediate_size=1024,
)
BUDGETS = {"24gb-mac": 16 * GiB, "16gb-mac": int(10922.67 * 2**20)}


def _model(config: dict) -> nn.Module:
    module = get_model_module("flint")
    return module.Model(module.ModelArgs.from_dict(config))


def small_model(config: dict, budget: int) -> tuple[nn.Module, str]:
    """The recipe on a random model: bf16 one layer at a time, then `apply_small` as the loader runs it."""
    model = _model(config)
    model.set_dtype(DTYPE["value"])
    for layer in model.layers:
        mx.eval(layer.parameters())
    plan = plan_small(model, budget)
    apply_small(model, plan)
    mx.eval(model.parameters())
    return model, plan.description


class _VlmText:
    """mlx-vlm's Flint language model as mlx-lm's generate_step calls a model: logits out."""

    def __init__(self, language_model: nn.Module) -> None:
        self.language_model = language_model
        self.layers = language_model.layers

    def __call__(self, inputs: mx.array, cache=None, **kwargs) -> mx.array:  # noqa: ANN001
        return self.language_model(inputs, cache=cache).logits

    def make_cache(self) -> list:
        return self.language_model.make_cache()

    def parameters(self) -> dict:
        return self.language_model.parameters()


def _flint_modules_alone():  # noqa: ANN202
    """mlx-vlm's Flint language model without `mlx_vlm/__init__` (its generate, convert and
    processor imports want transformers and more): the two parent packages become bare namespaces
    over the installed folders, so only the model files and their mlx/numpy/PIL imports load."""
    import importlib
    import importlib.util
    import sys
    import types

    spec = importlib.util.find_spec("mlx_vlm")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("mlx_vlm is not installed")
    root = list(spec.submodule_search_locations)[0]
    for name, folder in (("mlx_vlm", root), ("mlx_vlm.models.flint", f"{root}/models/flint")):
        package = types.ModuleType(name)
        package.__path__ = [folder]
        sys.modules[name] = package
    language = importlib.import_module("mlx_vlm.models.flint.language")
    config = importlib.import_module("mlx_vlm.models.flint.config")
    return language.LanguageModel, config.ModelConfig


def mlx_vlm_model(config: dict) -> _VlmText | None:
    try:
        from mlx_vlm.models.flint import LanguageModel, ModelConfig
    except Exception as error:  # noqa: BLE001 - the package's own imports, not the model's
        print(f"mlx-vlm's package does not import ({error!r}); its Flint files alone", flush=True)
        try:
            LanguageModel, ModelConfig = _flint_modules_alone()  # noqa: N806
        except Exception as inner:  # noqa: BLE001 - a missing install only drops the reference
            print(f"mlx-vlm's Flint does not import: {inner!r}", flush=True)
            return None
    return _VlmText(materialize(LanguageModel(ModelConfig.from_dict(config))))


def weight_gb(model: nn.Module) -> float:
    return round(sum(v.nbytes for _, v in tree_flatten(model.parameters())) / 1e9, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    config = flint_config() if args.tiny else FLINT
    if args.tiny:
        DTYPE["value"] = mx.float32
    prompt = prompt_ids(args.prompt, config["vocab_size"])
    builds = [(name, lambda b=b: small_model(config, b)) for name, b in BUDGETS.items()]
    builds.append(("4bit", lambda: (materialize(_model(config)), "4bit")))
    for budget_name, build in builds:
        model, quantization = build()
        timing = time_kapitsa(model, prompt, args.tokens)
        _emit(args.tiny, "kapitsa", quantization, budget_name, model, timing)
        del model
        gc.collect()
        mx.clear_cache()
    reference = mlx_vlm_model(config)
    if reference is None:
        return
    _emit(args.tiny, "mlx-vlm", "4bit", "4bit", reference, time_mlxlm(reference, prompt, args.tokens))


def _emit(tiny: bool, engine: str, quantization: str, budget: str, model, timing: dict) -> None:  # noqa: ANN001
    emit(
        {
            "shape": "flint-tiny" if tiny else "flint",
            "engine": engine,
            "quantization": quantization,
            "budget": budget,
            "weights_gb": weight_gb(model),
            **rounded(timing, 2),
        }
    )


if __name__ == "__main__":
    main()
