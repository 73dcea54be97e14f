"""The small-Mac recipe on a loaded model: routed experts at 2 bits, the rest at 3-6 bits.

Widths come from `small_rule.choose_rest_bits` (the memory budget). Modules stored at no more bits
than their target stay exactly as stored (a checkpoint's 2-bit experts are kept bit for bit);
float modules are quantized; modules stored wider are dequantized and quantized again. Modules the
model keeps in float (`quant_predicate`: routers, vision towers) are left alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path

from kapitsa.engine.loading.small_rule import EXPERT_BITS, SMALL, choose_rest_bits
from kapitsa.engine.ops.moe import QuantizedSwitchLinear, SwitchLinear
from kapitsa.errors import NoRoutedExperts

_QUANTIZED = (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear)
_GROUP_SIZES = (64, 32)  # 64 as mlx-lm; 32 where 64 does not divide a row


@dataclass(frozen=True, slots=True)
class SmallPlan:
    rest_bits: int
    expert_params: int
    rest_params: int
    fixed_bytes: int = 0  # modules the model keeps as loaded (routers, vision towers)

    @property
    def description(self) -> str:
        """The ModelInfo.quantization string: `small-2/4` = experts 2-bit, the rest 4-bit."""
        return f"{SMALL}-{EXPERT_BITS}/{self.rest_bits}"


def is_routed(module: nn.Module) -> bool:
    """A stack of routed experts (every family's `switch_mlp` projections)."""
    return isinstance(module, (SwitchLinear, QuantizedSwitchLinear))


def plan_small(model: nn.Module, budget_bytes: int | None) -> SmallPlan:
    """The widths for `model` under `budget_bytes`.

    Raises:
        NoRoutedExperts: the model has no routed experts (a dense model).
    """
    allowed = _model_predicate(model)
    experts = rest = fixed = 0
    for path, module in _weight_leaves(model):
        if is_routed(module):
            experts += _logical_params(module)
        elif allowed(path, module) is False:  # stays as loaded: counts at its own size
            fixed += sum(v.nbytes for _, v in tree_flatten(module.parameters()))
        else:
            rest += _logical_params(module)
    if experts == 0:
        name = getattr(model, "model_type", type(model).__name__)
        raise NoRoutedExperts(
            f"{name} is a dense model: ':small' keeps routed experts at 2 bits and has none to act on "
            "here; load it at a uniform width instead (':4bit', ':3bit')"
        )
    bits = choose_rest_bits(budget_bytes, expert_params=experts, rest_params=rest, fixed_bytes=fixed)
    return SmallPlan(rest_bits=bits, expert_params=experts, rest_params=rest, fixed_bytes=fixed)


def apply_small(model: nn.Module, plan: SmallPlan) -> None:
    """Quantize `model` in place to `plan`'s widths (lazily: the caller evaluates)."""
    allowed = _model_predicate(model)
    _dequantize_wider(model, plan, allowed)

    def predicate(path: str, module: nn.Module) -> bool | dict:
        if not hasattr(module, "to_quantized") or allowed(path, module) is False:
            return False
        group = _group_size(module)
        if group is None:
            return False
        return {"group_size": group, "bits": _target_bits(module, plan), "mode": "affine"}

    nn.quantize(model, class_predicate=predicate)


def device_budget() -> int | None:
    """The memory this device reports (Metal's recommended working set, else its memory size); None
    when MLX reports neither. The surfaces pass doctor's budget instead (kapitsa.memory_probe)."""
    try:
        info = mx.device_info()
    except (RuntimeError, AttributeError):
        return None
    for key in ("max_recommended_working_set_size", "memory_size"):
        if isinstance(info.get(key), int) and info[key] > 0:
            return int(info[key])
    return None


def _target_bits(module: nn.Module, plan: SmallPlan) -> int:
    return EXPERT_BITS if is_routed(module) else plan.rest_bits


def _weight_leaves(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    leaves = tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module)
    for path, module in leaves:
        if "weight" in module and (hasattr(module, "to_quantized") or isinstance(module, _QUANTIZED)):
            yield path, module


def _logical_params(module: nn.Module) -> int:
    weight = module["weight"]
    if isinstance(module, _QUANTIZED):
        return weight.size * 32 // module.bits
    return weight.size


def _group_size(module: nn.Module) -> int | None:
    columns = module["weight"].shape[-1]
    return next((g for g in _GROUP_SIZES if columns % g == 0), None)


def _model_predicate(model: nn.Module) -> Callable[[str, nn.Module], bool | dict]:
    hook = getattr(model, "quant_predicate", None)
    return hook if callable(hook) else (lambda path, module: True)


def _dequantize_wider(model: nn.Module, plan: SmallPlan, allowed: Callable) -> None:
    """Stored modules wider than their target become float again, so the quantize pass narrows them."""

    def widen(path: str, module: nn.Module) -> nn.Module:
        if not isinstance(module, _QUANTIZED) or allowed(path, module) is False:
            return module
        if module.mode == "affine" and module.bits <= _target_bits(module, plan):
            return module
        return _dequantized(module)

    leaves = tree_map_with_path(widen, model.leaf_modules(), is_leaf=nn.Module.is_module)
    model.update_modules(leaves)


def _dequantized(module: nn.Module) -> nn.Module:
    weight = mx.dequantize(
        module["weight"],
        module["scales"],
        module.get("biases"),
        group_size=module.group_size,
        bits=module.bits,
        mode=module.mode,
    )
    if isinstance(module, QuantizedSwitchLinear):
        plain: nn.Module = SwitchLinear(1, 1, 1)
    elif isinstance(module, nn.QuantizedEmbedding):
        plain = nn.Embedding(1, 1)
    else:
        plain = nn.Linear(1, 1, bias=False)
    plain.weight = weight
    if "bias" in module:
        plain.bias = module["bias"]
    return plain
