"""The memory estimate (`memory_estimate.prefill_peak_bytes`) against the engine's measured peak
allocation, on the CPU at the tiny shapes of tests/engine/test_memory_fit.py (`--runs` times each),
or with `--shapes` on random-weight 4-bit models of the real shapes (lab/models_under_test.py,
bf16 activations: the H200's figures), a long prompt prefilled in chunks with K/V in the activation
dtype and quantized (`--kv-bits`), one JSON line per run.

    .venv/bin/python lab/memory_fit.py                                    # the test's tiny shapes
    python lab/memory_fit.py --shapes 4b 27b                              # real shapes, 8k prompt
    .venv/bin/python lab/memory_fit.py --shapes 4b 27b --tiny --context 1024 --chunk 256  # smoke run

The estimate takes `dtype_bytes` of the activation dtype (2 for bf16: K/V, their quantization
scales, the conv state); its workspace and quantized scores are float32 by its own rule. On a GPU
it leaves out `dequantized_kv` (the CPU's quantized matmul works on a float32 copy of K or V): a
row says whether it counted it, and `ratio_with_dequantized` gives the other case.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "engine"))

from engine_standins import EOS, ByteTokenizer  # noqa: E402
from test_memory_fit import SHAPES, _measured_peak  # noqa: E402

from kapitsa import memory_estimate as me  # noqa: E402
from kapitsa.catalog import arch_from_config  # noqa: E402
from kapitsa.engine import kernels  # noqa: E402
from kapitsa.engine.inprocess import InProcessEngine  # noqa: E402
from kapitsa.engine.models import base  # noqa: E402
from kapitsa.engine.ops import prefill_attention  # noqa: E402
from kapitsa.engine.options import EngineConfig, KernelOptions  # noqa: E402
from kapitsa.engine.types import GenerationRequest, ModelInfo, SamplingParams  # noqa: E402
from kapitsa.testing.tiny import tiny_config  # noqa: E402
from lab import models_under_test as mut  # noqa: E402
from lab.engine_timing import emit  # noqa: E402

MIB = 2**20
ONE_GRAPH = 1 << 62  # models/base.LAYER_QUEUE_ROWS that no chunk reaches: each chunk one graph


def main(runs: int) -> None:
    for kind, overrides, context, chunk, kv_bits in SHAPES:
        config = tiny_config(kind, **overrides)
        arch = arch_from_config(config)
        heads = config.get("text_config", config)["num_attention_heads"]
        estimate = me.prefill_peak_bytes(
            arch,
            context_tokens=context,
            prefill_chunk=chunk,
            dtype_bytes=4,
            kv_bits=kv_bits,
            attention_heads=heads,
            dequantized_kv=True,
        )
        lower = estimate - me.update_transient_bytes(arch, context, 4, kv_bits=kv_bits) // 2
        for _ in range(runs):
            peak = _measured_peak(config, context, chunk, kv_bits)
            print(
                f"{kind} {overrides} context {context} chunk {chunk} kv_bits {kv_bits}: peak {peak / MIB:.2f} MiB,"
                f" estimate {estimate / MIB:.2f} (one of K/V growing: {lower / MIB:.2f}), ratio {peak / estimate:.3f}",
                flush=True,
            )


def _layer_kind(layer) -> str:  # noqa: ANN001
    """'linear' / 'attention' (Qwen3.5), Nemotron-H's block letter, else the layer's class name."""
    if hasattr(layer, "is_linear"):
        return "linear" if layer.is_linear else "attention"
    names = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
    return names.get(getattr(layer, "block_type", ""), type(layer).__name__)


class LayerPeaks:
    """While installed, records the peak allocation above `before` at each layer the prefill sends
    (models/base._queue_layer: layer i sent, layer i - 1 waited for), so a run's peak is placed at
    the layer (and its kind) where it happens."""

    def __init__(self, layers) -> None:  # noqa: ANN001 - the model's layers
        self.kinds = [_layer_kind(layer) for layer in layers]
        self.rows: list[tuple[int, int]] = []  # (layer index, peak above before)
        self.before = 0

    def __enter__(self) -> LayerPeaks:
        self._original = base._queue_layer

        def queue(h, rows, previous):  # noqa: ANN001, ANN202
            sent = self._original(h, rows, previous)
            if sent is not None:
                self.rows.append((len(self.rows) % len(self.kinds), mx.get_peak_memory() - self.before))
                mx.reset_peak_memory()
            return sent

        base._queue_layer = queue
        return self

    def __exit__(self, *exc: object) -> None:
        base._queue_layer = self._original

    def summary(self) -> dict:
        """The highest window's layer, its kind and its peak; the highest window per layer kind (MiB)."""
        if not self.rows:
            return {"layer_windows": 0}
        index, peak = max(self.rows, key=lambda row: row[1])
        per_kind: dict[str, int] = {}
        for i, value in self.rows:
            per_kind[self.kinds[i]] = max(per_kind.get(self.kinds[i], 0), value)
        return dict(
            layer_windows=len(self.rows),
            peak_layer=index,
            peak_layer_kind=self.kinds[index],
            peak_by_kind_mib={kind: round(v / MIB, 1) for kind, v in per_kind.items()},
        )


def model_peak(
    model, *, context: int, chunk: int, kv_bits: int | None, vocab: int, layer_peaks: LayerPeaks | None = None
) -> int:
    """The engine's peak allocation above what it holds before a `context`-token prompt, measured
    as tests/engine/test_memory_fit._measured_peak measures it, over a given model (`layer_peaks`:
    also per layer the prefill sends)."""
    info = ModelInfo(id="shape", family="test", context_length=2 * context, max_output_tokens=16)
    # the KAPITSA_* lab variables (KAPITSA_QLINEAR=stock: no dense prefill route) A/B a kernel's share
    kernels = KernelOptions.from_environ(os.environ)
    config = EngineConfig(prefill_chunk=chunk, kv_bits=kv_bits, prefix_cache_bytes=0, kernels=kernels)
    client = InProcessEngine(model, ByteTokenizer(), info, eos_token_ids={EOS}, config=config)
    prompt = tuple(mut.prompt_ids(context, vocab))
    try:
        # the first chunk alone first: kernels compile and the engine's lasting buffers allocate,
        # so the peak below is the long prompt's own
        _run(client, prompt[:chunk], max_tokens=1)
        gc.collect()
        mx.clear_cache()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        if layer_peaks is None:
            _run(client, prompt, max_tokens=2)
            return mx.get_peak_memory() - before
        layer_peaks.before = before
        with layer_peaks:
            _run(client, prompt, max_tokens=2)
        return max([mx.get_peak_memory() - before, *(peak for _, peak in layer_peaks.rows)])
    finally:
        client.close()


def _run(client: InProcessEngine, prompt: tuple[int, ...], *, max_tokens: int) -> None:
    request = GenerationRequest(
        prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    )

    async def drain() -> None:
        async for _ in client.generate(request):
            pass

    asyncio.run(drain())


def estimate_fields(
    arch, args: argparse.Namespace, *, kv_bits: int | None, dtype_bytes: int, heads: int
) -> dict:
    """The estimate (with `dequantized_kv` as this device has it), its lower bound (one of K/V
    growing, as the test allows) and its terms in MiB, so a measured gap names the term it comes from."""
    # MLX's CPU quantized matmul works on a float copy; on CUDA the engine dequantizes K/V first
    on_cpu = mx.default_device().type == mx.cpu or kernels.backend() == "cuda"
    context, chunk = args.context, args.chunk
    sizes = dict(context_tokens=context, prefill_chunk=chunk, dtype_bytes=dtype_bytes, kv_bits=kv_bits)
    sizes["backend"] = kernels.backend()  # a GPU's prefill activations follow the layer shapes
    estimate = me.prefill_peak_bytes(arch, **sizes, attention_heads=heads, dequantized_kv=on_cpu)
    terms = {
        "cache": me.sequence_bytes(arch, context, dtype_bytes, kv_bits=kv_bits),
        "kv_update": me.update_transient_bytes(arch, context, dtype_bytes, kv_bits=kv_bits),
        "workspace": me.prefill_workspace_bytes(
            arch, chunk, context, dtype_bytes=dtype_bytes, backend=sizes["backend"], kv_bits=kv_bits
        ),
        "scores": me.quantized_scores_bytes(heads, chunk, context) if kv_bits else 0,
        "dequantized_kv": heads * arch.head_dim * context * me.SCORE_BYTES if kv_bits else 0,
    }
    return dict(
        dtype_bytes=dtype_bytes,
        dequantized_kv=on_cpu,
        estimate=estimate,
        flipped=me.prefill_peak_bytes(arch, **sizes, attention_heads=heads, dequantized_kv=not on_cpu),
        lower=estimate - terms["kv_update"] // 2,
        terms_mib={name: round(value / MIB, 2) for name, value in terms.items()},
    )


def peak_row(peak: int, fields: dict) -> dict:
    """One run's JSON fields: the measured peak beside the estimate, in MiB, and their ratios."""
    estimate, flipped = fields["estimate"], fields["flipped"]
    row = dict(
        dtype_bytes=fields["dtype_bytes"],
        dequantized_kv=fields["dequantized_kv"],
        peak_mib=round(peak / MIB, 2),
        estimate_mib=round(estimate / MIB, 2),
        one_of_kv_growing_mib=round(fields["lower"] / MIB, 2),
        ratio=round(peak / estimate, 3),
        terms_mib=fields["terms_mib"],
    )
    if flipped != estimate:  # quantized K/V: the ratio had the other device's dequantized copy counted
        other = "ratio_without_dequantized" if fields["dequantized_kv"] else "ratio_with_dequantized"
        row[other] = round(peak / flipped, 3)
    return row


def shape_rows(shape: str, args: argparse.Namespace) -> None:
    """Every `--kv-bits` setting's estimate and `--runs` measured peaks for one shape."""
    kind, dims = (mut.TINY if args.tiny else mut.SHAPES)[shape]
    config = tiny_config(kind, **dims)
    model = mut.kapitsa_model(config)
    emit({"shape": shape, "built": True, "weights_gb": round(mx.get_active_memory() / 1e9, 2)})
    arch = arch_from_config(config)
    text = config.get("text_config", config)
    dtype_bytes = mut.DTYPE["value"].size  # K/V and conv state take the activation dtype
    queue_rows = base.LAYER_QUEUE_ROWS
    for kv_bits in args.kv_bits:
        fields = estimate_fields(
            arch, args, kv_bits=kv_bits, dtype_bytes=dtype_bytes, heads=text["num_attention_heads"]
        )
        for run, variant in enumerate([v for _ in range(args.runs) for v in args.variants]):
            _use_variant(variant, queue_rows)
            layer_peaks = LayerPeaks(model.layers)
            start = time.perf_counter()
            peak = model_peak(
                model,
                context=args.context,
                chunk=args.chunk,
                kv_bits=kv_bits,
                vocab=text["vocab_size"],
                layer_peaks=layer_peaks,
            )
            where = dict(
                shape=shape, kind=kind, context=args.context, chunk=args.chunk, kv_bits=kv_bits, run=run
            )
            knobs = {k: v for k, v in os.environ.items() if k.startswith(("KAPITSA_", "MLX_MAX"))}
            timing = {
                "prompt_s": round(time.perf_counter() - start, 3),
                "variant": variant,
                "layer_queue_rows": base.LAYER_QUEUE_ROWS,
            }
            emit({**where, "knobs": knobs, **timing, **peak_row(peak, fields), **layer_peaks.summary()})
    _use_variant("default", queue_rows)
    del model
    gc.collect()
    mx.clear_cache()


VARIANTS = ("default", "one-graph", "no-blocks")
_BLOCK_ROWS = prefill_attention.block_rows


def _use_variant(variant: str, queue_rows: int) -> None:
    """`one-graph`: each prefill chunk sent as one graph (no layer queue); `no-blocks`: attention
    over unfused head sizes in one call (ops/prefill_attention.py off); `default`: the engine's."""
    base.LAYER_QUEUE_ROWS = ONE_GRAPH if variant == "one-graph" else queue_rows
    prefill_attention.block_rows = (lambda q, k: None) if variant == "no-blocks" else _BLOCK_ROWS


def _kv_bits(text: str) -> int | None:
    return None if text.lower() == "none" else int(text)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument(
        "--shapes", nargs="*", choices=sorted(mut.SHAPES), help="real shapes instead of the test's"
    )
    parser.add_argument("--context", type=int, default=8192, help="prompt tokens (--shapes)")
    parser.add_argument(
        "--chunk", type=int, default=me.DEFAULT_PREFILL_CHUNK, help="prefill chunk (--shapes)"
    )
    parser.add_argument(
        "--kv-bits", nargs="+", type=_kv_bits, default=[None, 8], help="none, 8 or 4 (--shapes)"
    )
    parser.add_argument(
        "--tiny", action="store_true", help="--shapes at tiny widths, float32 (a CPU smoke run)"
    )
    parser.add_argument(
        "--layer-queue-rows",
        type=int,
        default=None,
        help="models/base.LAYER_QUEUE_ROWS for this run (a huge value: each chunk one graph, as before it)",
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=VARIANTS,
        default=["default"],
        help="each run once per variant: the engine's prefill, one graph per chunk, attention unblocked",
    )
    args = parser.parse_args()
    if args.layer_queue_rows is not None:
        base.LAYER_QUEUE_ROWS = args.layer_queue_rows
    if args.tiny:
        mut.DTYPE["value"] = mx.float32  # MLX's CPU gather_mm (MoE) is float32-only
    if not args.shapes:
        main(args.runs)
    else:
        print(f"mlx {mx.__version__} on {mx.default_device()}", flush=True)
        for shape in args.shapes:
            shape_rows(shape, args)
