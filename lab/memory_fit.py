"""The memory estimate (`memory_estimate.prefill_peak_bytes`) against the engine's measured peak
allocation on the CPU, on the shapes of tests/engine/test_memory_fit.py, `--runs` times each.

    .venv/bin/python lab/memory_fit.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "engine"))

from test_memory_fit import SHAPES, _measured_peak  # noqa: E402

from kapitsa import memory_estimate as me  # noqa: E402
from kapitsa.catalog import arch_from_config  # noqa: E402
from kapitsa.testing.tiny import tiny_config  # noqa: E402

MIB = 2**20


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


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    main(parser.parse_args().runs)
