"""Build the decode strategy for a `--speculative` mode."""

from __future__ import annotations

from kapitsa.engine.kernels import backend
from kapitsa.engine.kernels.matvec import MAX_ROWS
from kapitsa.engine.models.base import use_kernel_options
from kapitsa.engine.options import SPECULATIVE_MODES, KernelOptions
from kapitsa.engine.runner.decode import DecodeStrategy, PlainDecode
from kapitsa.engine.speculative.controller import DEFAULT_MAX_DRAFT
from kapitsa.engine.speculative.cost import (
    LONG_DRAFT,
    gpu_cost_curve_from_timings,
    gpu_width_timings,
    measured_cost_curve,
    takes_long_drafts,
)
from kapitsa.engine.speculative.decoder import GPU_VERIFY_WIDTHS, SpeculativeDecode
from kapitsa.engine.speculative.dflash import DFlashDrafter
from kapitsa.engine.speculative.draft_model import DraftModelDrafter
from kapitsa.engine.speculative.mtp import MTPDrafter
from kapitsa.engine.speculative.ngram import NGramDrafter
from kapitsa.errors import InvalidRequest

# With KernelOptions.exact_verify a verify's rows take the one-row kernel, which takes MAX_ROWS rows.
EXACT_MAX_DRAFT = MAX_ROWS - 1

MODES = SPECULATIVE_MODES


def make_decode_strategy(
    mode: str,
    *,
    target_model=None,  # noqa: ANN001 - the served model, for mode "mtp" (its own mtp.* head)
    draft_model=None,  # noqa: ANN001 - a loaded kapitsa model, for mode "draft"
    block_drafter=None,  # noqa: ANN001 - a DFlashModel (speculative.dflash.load_dflash), for mode "block"
    draft_tokens: int | None = None,
    tree: bool = False,
    kernels: KernelOptions | None = None,
) -> DecodeStrategy:
    """The decode strategy for `mode`.

    "auto" drafts with the draft model when one is given, else with n-gram lookup, which costs
    nothing while its guesses fail (shadow.py). A checkpoint's MTP head is opt-in (`mtp`): it
    drafts from the target's hidden states every step, so it can't rest in pipelined decoding
    when it does not pay (on the demo, on the CPU, it decodes at ~0.4x plain). `kernels`: the engine's kernel options, given to a draft model's layers (the
    engine's model runner gives them to the target, its MTP head included).
    """
    if mode not in MODES:
        raise InvalidRequest(f"unknown speculative mode {mode!r}; choose one of {', '.join(MODES)}")
    if mode == "none":
        return PlainDecode()
    max_draft = draft_tokens or DEFAULT_MAX_DRAFT
    if kernels is not None and kernels.exact_verify:  # verifies of at most MAX_ROWS rows stay exact
        max_draft = min(max_draft, EXACT_MAX_DRAFT)
    for drafter in (draft_model, block_drafter):
        if kernels is not None and drafter is not None:
            use_kernel_options(drafter, kernels)
    has_mtp = getattr(target_model, "mtp", None) is not None
    if mode == "auto":
        mode = "draft" if draft_model is not None else "ngram"
    if mode == "mtp":
        if not has_mtp:
            raise InvalidRequest(
                "--speculative mtp needs a checkpoint that ships mtp.* weights (Qwen3.5 / Qwen3-Next originals)"
            )
        return SpeculativeDecode(lambda: MTPDrafter(target_model), name="mtp", max_draft=min(max_draft, 3))
    if mode == "ngram":
        return SpeculativeDecode(NGramDrafter, name="ngram", max_draft=max_draft, tree=tree)
    if mode == "draft":
        if draft_model is None:
            raise InvalidRequest(
                "--speculative draft needs --draft MODEL (a small model with the same tokenizer)"
            )
        return SpeculativeDecode(
            lambda: DraftModelDrafter(draft_model), name="draft", max_draft=max_draft, tree=tree
        )
    if block_drafter is None or target_model is None:
        raise InvalidRequest("--speculative block needs --draft PATH of a DFlash drafter checkpoint")
    size = min(max_draft, block_drafter.config.block_size - 1)
    return SpeculativeDecode(
        lambda: DFlashDrafter(block_drafter, target_model), name="block", max_draft=size, tree=tree
    )


def load_drafter(path: str):  # noqa: ANN201 - a kapitsa model or a DFlashModel
    """Load `--draft PATH`: a DFlash block drafter (config.json with `dflash_config`) or, for any
    other checkpoint, a small model of the target's tokenizer."""
    import json
    from pathlib import Path

    from kapitsa.engine.loading.loader import load_model
    from kapitsa.engine.speculative.dflash import load_dflash

    config = Path(path) / "config.json"
    if config.is_file():
        try:
            is_dflash = "dflash_config" in json.loads(config.read_text())
        except (OSError, ValueError):
            is_dflash = False
        if is_dflash:
            return load_dflash(path)
    return load_model(path).model


def strategy_for(
    mode: str,
    *,
    target_model,
    draft: str | None = None,
    draft_tokens: int | None = None,
    tree: bool = False,  # noqa: ANN001
    kernels: KernelOptions | None = None,
) -> DecodeStrategy:
    """The decode strategy for CLI/server flags: `--speculative MODE [--draft PATH] [--draft-tokens N] [--tree]`;
    `kernels`: the engine's kernel options (EngineConfig.kernels), for the draft model's layers."""
    from kapitsa.engine.speculative.dflash import DFlashModel

    drafter = load_drafter(draft) if draft else None
    if mode == "auto" and isinstance(drafter, DFlashModel):
        mode = "block"
    block = drafter if isinstance(drafter, DFlashModel) else None
    small = drafter if drafter is not None and block is None else None
    if mode == "block" and drafter is not None and block is None:
        raise InvalidRequest(
            f"--draft {draft} is not a DFlash drafter checkpoint (no dflash_config in config.json)"
        )
    if mode == "draft" and block is not None:
        raise InvalidRequest(f"--draft {draft} is a DFlash block drafter; use --speculative block")
    strategy = make_decode_strategy(
        mode,
        target_model=target_model,
        draft_model=small,
        block_drafter=block,
        draft_tokens=draft_tokens,
        tree=tree,
        kernels=kernels,
    )
    if isinstance(strategy, SpeculativeDecode) and strategy.adaptive:
        may_lengthen = draft_tokens is None and not (kernels is not None and kernels.exact_verify)
        strategy.cost_curve = _served_cost_curve(target_model, strategy, may_lengthen=may_lengthen)
    return strategy


def _served_cost_curve(target_model, strategy: SpeculativeDecode, *, may_lengthen: bool) -> list[float]:  # noqa: ANN001
    """The verify cost curve timed on the served model (cost.py): on a GPU the built-in curve
    raised where its verify widths cost more than one token (MoE), on the CPU the timed curve.
    `may_lengthen` (no --draft-tokens): on a GPU an n-gram strategy's drafts reach LONG_DRAFT
    tokens where the model's widest verify is cheap (cost.takes_long_drafts)."""
    if backend() is None:
        return measured_cost_curve(target_model, strategy.max_draft)
    if may_lengthen and strategy.name == "ngram":
        timed = gpu_width_timings(target_model, GPU_VERIFY_WIDTHS)
        if takes_long_drafts(timed):
            strategy.max_draft = LONG_DRAFT
    else:
        widths = strategy.padded_widths or tuple(range(2, strategy.max_draft + 2))
        timed = gpu_width_timings(target_model, widths)
    return gpu_cost_curve_from_timings(timed.__getitem__, strategy.max_draft, sorted(timed))
