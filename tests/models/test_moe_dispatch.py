"""Every MoE model hands its KernelOptions.moe_max_pairs to the expert kernels' dispatch, so a lab
run or an opener's options move the kernel/gather_qmm boundary the same way on every family."""

from __future__ import annotations

import mlx.core as mx
import pytest

from kapitsa.engine.kernels import moe
from kapitsa.engine.models import flint, nemotron_h, sparse_moe
from kapitsa.engine.models.base import use_kernel_options
from kapitsa.engine.options import DEFAULT_MOE_MAX_PAIRS, KernelOptions
from kapitsa.engine.traces import drop_traces
from tests.models.builders import build_ours, greedy_logits
from tests.models.test_flint import build_flint


def _spy(monkeypatch, module) -> list[int]:
    seen: list[int] = []

    def routed(switch_mlp, x, indices, scores, max_pairs=moe.MAX_PAIRS):
        seen.append(max_pairs)
        return moe.routed_experts(switch_mlp, x, indices, scores, max_pairs)

    monkeypatch.setattr(module, "routed_experts", routed)
    return seen


@pytest.mark.parametrize(
    "arch,module", [("qwen3_5_moe", sparse_moe), ("nemotron_moe", nemotron_h), ("flint", flint)]
)
def test_the_models_pass_their_pair_limit(arch, module, monkeypatch) -> None:
    seen = _spy(monkeypatch, module)
    model = build_flint() if arch == "flint" else build_ours(arch)
    mx.eval(greedy_logits(model, steps=1))
    assert seen and set(seen) == {DEFAULT_MOE_MAX_PAIRS}
    seen.clear()
    use_kernel_options(model, KernelOptions(moe_max_pairs=7))
    drop_traces(model)  # compiled steps keep the options they were traced under
    mx.eval(greedy_logits(model, steps=1))
    assert seen and set(seen) == {7}
