"""Greedy speculation writes what plain decoding writes in bf16 too, not only in float32: a verify
computes each position as a one-token decode step would (the same reductions, the conv summed in
float32 per row, the recurrent layers' replay through the decode step's own function), so
near-ties fall the same way. The engine runs the weights as they are (on the CPU it would
otherwise compute in float32, where this holds trivially). 256 tokens per prompt, both families,
drafts accepted at every depth; then three requests at once (ragged drafts in one verify).

On a GPU (`bash lab/h200_all.sh bf16`) the same file checks MLX's and kapitsa's CUDA kernels,
where one-row and few-row mat-muls are different kernels: the default kernels are expected to
fail there, `exact_verify` to pass; `lab/verify_vs_decode.py` names the first layer where a
verify's rows leave the decode steps'."""

from __future__ import annotations

import asyncio

import mlx.core as mx
import pytest
from engine_standins import ByteTokenizer, tiny_model  # noqa: I001
from mlx.utils import tree_flatten
from test_speculative_engine import PROMPTS, OracleDrafter, _client, _run

from kapitsa.engine.kernels import backend
from kapitsa.engine.options import KernelOptions
from kapitsa.engine.speculative.decoder import SpeculativeDecode

N = 256


# The default kernels, and exact_verify (a verify's rows through the decode step's own calls). On
# CUDA the default's verify kernels round apart from decode's (docs/results.md): expected to fail.
KERNELS = [
    pytest.param(
        KernelOptions(),
        id="default",
        marks=pytest.mark.xfail(backend() == "cuda", reason="CUDA verify kernels differ", strict=False),
    ),
    pytest.param(KernelOptions(exact_verify=True), id="exact_verify"),
]


async def _outputs(
    model,  # noqa: ANN001
    strategy=None,  # noqa: ANN001
    *,
    kernels: KernelOptions,
    together: int = 0,
    n: int = N,
) -> list[list[int]]:
    """Each prompt's greedy ids, one request after another (`together`: that many at once)."""
    # no float32 copy of the weights on the CPU (the engine's default there): bf16 arithmetic
    client = _client(model, strategy, cpu_float32_bytes=0, kernels=kernels)
    try:
        if together:
            runs = await asyncio.gather(*(_run(client, p, n=n) for p in PROMPTS[:together]))
            return [ids for ids, _, _ in runs]
        return [(await _run(client, p, n=n))[0] for p in PROMPTS[:2]]
    finally:
        client.close()


def _bf16_model(kind: str):  # noqa: ANN202
    model = tiny_model(kind)
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    return model


def _oracle(plain: list[list[int]]) -> SpeculativeDecode:
    refs = {tuple(ByteTokenizer().encode(p)): ids for p, ids in zip(PROMPTS, plain, strict=False)}
    return SpeculativeDecode(lambda: OracleDrafter(refs, seed=3), name="oracle", max_draft=7, adaptive=False)


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h"])
def test_bf16_greedy_speculation_equals_plain(kind: str, kernels: KernelOptions) -> None:
    model = _bf16_model(kind)
    plain = asyncio.run(_outputs(model, kernels=kernels))
    assert _float_dtypes(model) == {mx.bfloat16}  # the engine computed in bf16, not a float32 copy
    strategy = _oracle(plain)
    assert asyncio.run(_outputs(model, strategy, kernels=kernels)) == plain
    stats = strategy.stats
    assert stats.accepted > N // 2 and stats.accepted < stats.proposed  # deep accepts and rejections


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h"])
def test_bf16_batched_speculation_equals_batched_plain(kind: str, kernels: KernelOptions) -> None:
    model = _bf16_model(kind)
    plain = asyncio.run(_outputs(model, kernels=kernels, together=3, n=N // 2))
    strategy = _oracle(plain)
    assert asyncio.run(_outputs(model, strategy, kernels=kernels, together=3, n=N // 2)) == plain
    assert strategy.stats.accepted < strategy.stats.proposed


def _float_dtypes(model) -> set[mx.Dtype]:  # noqa: ANN001
    return {v.dtype for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)}
