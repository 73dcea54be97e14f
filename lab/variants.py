"""kapitsa settings timed beside its defaults in one process (`decode_vs_mlxlm.py --fused-ab,
--kernels-ab, --fold-ab`): each variant is one more engine in the interleaved rounds, so the host's
drift within a run falls on all of them alike.

A variant is other `KernelOptions` (the defaults, engine_timing.DEFAULTS, with one field changed)
for the engine that times it: its model runner gives them to the
layers and routed linears. They change what the model traces (fused mat-vec parts, kernel
families), so its timer drops the model's compiled traces before and after its runs; an option that
changes how the engine prepares the model (shared-expert folding) gets its own copy of the model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from kapitsa.engine.options import KernelOptions
from kapitsa.engine.traces import drop_traces
from lab.engine_timing import DEFAULTS

Timer = Callable[..., dict]


@dataclass(frozen=True, slots=True)
class Variant:
    """kapitsa under `kernels`; `described` joins each of its rows, and so does `after()`, read
    once its engine has run (which kernels its probes found working)."""

    kernels: KernelOptions
    described: dict = field(default_factory=dict)
    after: Callable[[], dict] = dict
    own_model: bool = False  # the options change how the engine prepares the model: time a copy


def fused_parts(parts: str) -> Variant:
    """The one-row mat-vecs fuse `parts` (KAPITSA_FUSED_NORMS syntax: "all", "0" or a comma list)."""

    def after() -> dict:
        from kapitsa.engine.ops import linear as qlinear

        return {"fused_working": qlinear.WORKING.get("fused")}

    parsed = KernelOptions.from_environ({"KAPITSA_FUSED_NORMS": parts})
    return Variant(replace(DEFAULTS, fused_parts=parsed.fused_parts), {"fused_parts": parts}, after)


def kernel_families(families: str) -> Variant:
    """The model uses the kernel families `families` names (KAPITSA_KERNELS syntax)."""
    parsed = KernelOptions.from_environ({"KAPITSA_KERNELS": families})
    return Variant(replace(DEFAULTS, families=parsed.families), {"kernels": families})


def folded() -> Variant:
    """Shared experts folded into the routed stacks when the engine prepares the model."""
    return Variant(replace(DEFAULTS, fold_shared_experts=True), {"folded": True}, own_model=True)


def timed_with(variant: Variant, timer: Timer) -> Timer:
    """`timer` run under `variant.kernels`, the model's traces dropped on both sides; the variant's
    description joins the result. A variant that fails (an untimed kernel that does not compile
    or run on this machine) returns {"error": ...} instead of ending the whole run."""

    def run(model, prompt, tokens, warmup=None) -> dict:
        try:
            drop_traces(model)
            try:
                result = timer(model, prompt, tokens, warmup, kernels=variant.kernels)
            finally:
                drop_traces(model)
            return dict(result, **variant.described, **variant.after())
        except Exception as exc:  # noqa: BLE001 - reported in the row, the defaults' run goes on
            return {"error": f"{type(exc).__name__}: {exc}"[:500]}

    return run


def add_variants(args, models: dict, timers: dict, build_kapitsa: Callable[[], object], *, moe: bool) -> None:
    """Register the variants `args` asks for next to models["kapitsa"] / timers["kapitsa"]."""
    base = timers["kapitsa"]
    variants = {}
    if args.fused_ab:
        variants["kapitsa-fused"] = fused_parts(args.fused_ab)
    if args.kernels_ab:
        variants["kapitsa-kernels"] = kernel_families(args.kernels_ab)
    if args.fold_ab and moe:
        variants["kapitsa-folded"] = folded()
    for name, variant in variants.items():
        models[name] = build_kapitsa() if variant.own_model else models["kapitsa"]
        timers[name] = timed_with(variant, base)
