"""The models the lab scripts time: random-weight 4-bit models of the published shapes, kapitsa's
and mlx-lm's built from the same config (`SHAPES`, or `TINY` widths for a smoke run on any machine).

Every measurement script imports its shapes and model builders from here, and this module imports
no other lab script.
"""

from __future__ import annotations

import importlib

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from kapitsa.engine.models import get_model_module

QWEN_VOCAB = 248320
SHAPES = {
    "4b": (
        "qwen3_5",
        dict(
            hidden_size=2560,
            num_hidden_layers=32,
            intermediate_size=9216,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=256,
            linear_num_key_heads=16,
            linear_num_value_heads=32,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            tie_word_embeddings=True,
            vocab_size=QWEN_VOCAB,
        ),
    ),
    "27b": (
        "qwen3_5",
        dict(
            hidden_size=5120,
            num_hidden_layers=64,
            intermediate_size=17408,
            num_attention_heads=24,
            num_key_value_heads=4,
            head_dim=256,
            linear_num_key_heads=16,
            linear_num_value_heads=48,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            vocab_size=QWEN_VOCAB,
        ),
    ),
    "35b-a3b": (
        "qwen3_5_moe",
        dict(
            hidden_size=2048,
            num_hidden_layers=40,
            num_attention_heads=16,
            num_key_value_heads=2,
            head_dim=256,
            linear_num_key_heads=16,
            linear_num_value_heads=32,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            num_experts=256,
            num_experts_per_tok=8,
            moe_intermediate_size=512,
            shared_expert_intermediate_size=512,
            vocab_size=QWEN_VOCAB,
        ),
    ),
    "nemotron-30b-a3b": (
        "nemotron_h",
        dict(
            hidden_size=2688,
            num_hidden_layers=52,
            hybrid_override_pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
            mamba_num_heads=64,
            mamba_head_dim=64,
            ssm_state_size=128,
            n_groups=8,
            num_attention_heads=32,
            num_key_value_heads=2,
            head_dim=128,
            n_routed_experts=128,
            num_experts_per_tok=6,
            moe_intermediate_size=1856,
            moe_shared_expert_intermediate_size=3712,
            intermediate_size=1856,
            vocab_size=131072,
        ),
    ),
}
TINY = {k: (kind, {"vocab_size": 8192}) for k, (kind, _) in SHAPES.items()}  # the demo tokenizer's ids fit
FULL_PRECISION_SUFFIXES = ("mlp.gate", "shared_expert_gate", "mixer.gate")  # routers and gates stay bf16
DTYPE = {"value": mx.bfloat16}  # float32 for --tiny: MLX's CPU gather_mm (MoE) is float32-only


def quantizable(path: str, module: nn.Module) -> bool:
    """Whether the bench quantizes this module (`nn.quantize`'s class_predicate)."""
    if path.endswith(FULL_PRECISION_SUFFIXES) or not hasattr(module, "to_quantized"):
        return False
    return getattr(module, "weight", None) is not None and module.weight.shape[-1] % 64 == 0


def materialize(model: nn.Module) -> nn.Module:
    """bf16 + 4-bit, one layer at a time so random fp32 init never holds the whole model; routers
    the model classes start at zero get random weights (`random_routers`)."""
    random_routers(model)
    model.set_dtype(DTYPE["value"])
    for layer in model.layers:
        nn.quantize(layer, group_size=64, bits=4, class_predicate=quantizable)
        mx.eval(layer.parameters())
    nn.quantize(model, group_size=64, bits=4, class_predicate=quantizable)
    mx.eval(model.parameters())
    return model


def random_routers(model: nn.Module) -> int:
    """Give random weights to MoE routers (`...gate.weight`, 2-D) that the model class initialises
    to zeros, as mlx-lm's Nemotron-H does (a checkpoint fills them; kapitsa's starts random). A
    zero router scores every expert alike, so every token of every step picks the same experts
    (the lowest indices): one fixed set of weights read, batches that never spread over more
    experts, and ties that real routing never has. Returns how many routers were filled."""
    zero = [
        (path, value)
        for path, value in tree_flatten(model.parameters())
        if path.endswith("gate.weight") and value.ndim == 2 and not mx.any(value).item()
    ]
    model.load_weights(
        [(path, mx.random.normal(v.shape, dtype=v.dtype) * v.shape[-1] ** -0.5) for path, v in zero],
        strict=False,
    )
    return len(zero)


def kapitsa_model(config: dict) -> nn.Module:
    """kapitsa's model of `config`, materialized (not yet fused or routed: its engine does that)."""
    module = get_model_module(config["model_type"])
    return materialize(module.Model(module.ModelArgs.from_dict(config)))


def mlxlm_model(config: dict) -> nn.Module:
    """mlx-lm's model of `config`, materialized."""
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    return materialize(module.Model(module.ModelArgs.from_dict(config)))


def prompt_ids(length: int, vocab: int, stride: int = 7919) -> list[int]:
    """Deterministic token ids spread over the vocabulary (ids 0-4 left out)."""
    return [(i * stride) % (vocab - 10) + 5 for i in range(length)]
