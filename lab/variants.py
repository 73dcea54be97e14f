"""kapitsa settings timed beside its defaults in one process (`decode_vs_mlxlm.py --fused-ab,
--kernels-ab, --qmv-ab, --fold-ab`): each variant is one more engine in the interleaved rounds, so the host's
drift within a run falls on all of them alike.

A variant changes what the models trace (fused mat-vec parts, kernel families) or how the engine
prepares the model (shared-expert folding), so its timer drops the model's compiled traces before
and after its runs, and `--fold-ab` times a second copy of the model, whose shared experts are folded.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

from kapitsa.engine.traces import drop_traces

Timer = Callable[..., dict]


@contextlib.contextmanager
def fused_parts(parts: str) -> Iterator[dict]:
    """KAPITSA_FUSED_NORMS=parts for the block (the kernels' probe runs first)."""
    from kapitsa.engine.ops import linear as qlinear

    before = dict(qlinear.FUSED_NORMS)
    qlinear.FUSED_NORMS.update(qlinear._fused_setting(parts))
    qlinear.probe_kernels()
    try:
        yield {"fused_parts": parts, "fused_working": qlinear.WORKING.get("fused")}
    finally:
        qlinear.FUSED_NORMS.update(before)


@contextlib.contextmanager
def kernel_families(families: str) -> Iterator[dict]:
    """KAPITSA_KERNELS=families for the block (read when a model traces its steps)."""
    from kapitsa.engine.kernels import probe_enabled

    before = os.environ.get("KAPITSA_KERNELS")
    os.environ["KAPITSA_KERNELS"] = families
    probe_enabled()  # the ModelRunner probed under the defaults, where opt-in families are off
    try:
        yield {"kernels": families}
    finally:
        if before is None:
            os.environ.pop("KAPITSA_KERNELS", None)
        else:
            os.environ["KAPITSA_KERNELS"] = before


@contextlib.contextmanager
def matvec_kernel(spec: str) -> Iterator[dict]:
    """KAPITSA_QMV_KERNEL=kernel for the block (its kernels' probe runs first); spec
    "kernel:parts" also sets KAPITSA_FUSED_NORMS=parts; "direct@BLOCKS" runs the one-row direct
    kernel on a persistent grid of BLOCKS blocks (qmv_direct.launch_config)."""
    from kapitsa.engine.kernels import qmv_direct
    from kapitsa.engine.ops import linear as qlinear

    kernel, _, parts = spec.partition(":")
    kernel, _, persist = kernel.partition("@")
    before, shape_before = qlinear.MATVEC["kernel"], qmv_direct.SHAPE_BY_ROWS[1]
    qlinear.MATVEC["kernel"] = qlinear._matvec_setting(kernel)
    if persist:
        qmv_direct.SHAPE_BY_ROWS[1] = (*shape_before[:3], False, int(persist))
    try:
        with fused_parts(parts) if parts else contextlib.nullcontext({}) as described:
            qlinear.probe_kernels()
            yield {
                "qmv_kernel": kernel + (f"@{persist}" if persist else ""),
                "qmv_working": qlinear.WORKING.get(kernel),
                **described,
            }
    finally:
        qlinear.MATVEC["kernel"], qmv_direct.SHAPE_BY_ROWS[1] = before, shape_before


@contextlib.contextmanager
def folded() -> Iterator[dict]:
    """Shared experts folded into the routed stacks when the engine prepares the model."""
    from kapitsa.engine.loading import moe_fold

    before = moe_fold.FOLD["on"]
    moe_fold.FOLD["on"] = True
    try:
        yield {"folded": True}
    finally:
        moe_fold.FOLD["on"] = before


def timed_with(setting: Callable[[], contextlib.AbstractContextManager], timer: Timer) -> Timer:
    """`timer` run inside `setting()`, the model's traces dropped on both sides; the setting's
    description joins the result. A variant that fails (an untimed kernel that does not compile
    or run on this machine) returns {"error": ...} instead of ending the whole run."""

    def run(model, prompt, tokens, warmup=None) -> dict:
        try:
            with setting() as described:
                drop_traces(model)
                try:
                    return dict(timer(model, prompt, tokens, warmup), **described)
                finally:
                    drop_traces(model)
        except Exception as exc:  # noqa: BLE001 - reported in the row, the defaults' run goes on
            return {"error": f"{type(exc).__name__}: {exc}"[:500]}

    return run


def add_variants(args, models: dict, timers: dict, build_kapitsa: Callable[[], object], *, moe: bool) -> None:
    """Register the variants `args` asks for next to models["kapitsa"] / timers["kapitsa"]."""
    base = timers["kapitsa"]
    if args.fused_ab:
        models["kapitsa-fused"] = models["kapitsa"]
        timers["kapitsa-fused"] = timed_with(lambda: fused_parts(args.fused_ab), base)
    if args.kernels_ab:
        models["kapitsa-kernels"] = models["kapitsa"]
        timers["kapitsa-kernels"] = timed_with(lambda: kernel_families(args.kernels_ab), base)
    if args.qmv_ab:
        models["kapitsa-qmv"] = models["kapitsa"]
        timers["kapitsa-qmv"] = timed_with(lambda: matvec_kernel(args.qmv_ab), base)
    if args.fold_ab and moe:
        models["kapitsa-folded"] = build_kapitsa()  # a copy: folding changes the model in place
        timers["kapitsa-folded"] = timed_with(folded, base)
