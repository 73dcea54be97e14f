"""The decode strategy's draft model gets the engine's kernel options, as the target does."""

from __future__ import annotations

import pytest

from kapitsa.engine.cache.hybrid import HybridCache
from kapitsa.engine.options import KernelOptions
from kapitsa.engine.speculative.factory import make_decode_strategy
from tests.models.builders import build_ours


def _options_of(model) -> set[KernelOptions]:
    return {m.kernel_options for _, m in model.named_modules() if hasattr(type(m), "kernel_options")}


def test_a_draft_model_takes_the_engines_kernel_options() -> None:
    draft = build_ours("qwen3_5_moe")
    assert _options_of(draft) == {KernelOptions()}
    options = KernelOptions(families=frozenset({"gdn"}), compile_decode=False)
    strategy = make_decode_strategy("draft", draft_model=draft, kernels=options)
    assert strategy.name == "draft"
    assert _options_of(draft) == {options}


def test_without_engine_options_a_draft_model_keeps_its_own() -> None:
    draft = build_ours("nemotron_moe")
    make_decode_strategy("draft", draft_model=draft)
    assert _options_of(draft) == {KernelOptions()}


def test_the_served_strategy_prices_verifies_by_timing_the_model_on_the_cpu() -> None:
    """On the CPU the opener's strategy carries a cost curve timed on the served model (a small
    model's verify costs about T decode steps there), not the bandwidth-only default."""
    import mlx.core as mx

    from kapitsa.engine.speculative.controller import default_cost_curve
    from kapitsa.engine.speculative.factory import strategy_for

    if mx.default_device().type == mx.DeviceType.gpu:
        pytest.skip("GPUs use the curve measured on the H200")
    strategy = strategy_for("auto", target_model=build_ours("qwen3_5_dense"))
    curve = strategy.cost_curve
    assert curve is not None and len(curve) == strategy.max_draft + 1 and curve[0] == 1.0
    assert curve == sorted(curve) and curve != default_cost_curve(strategy.max_draft)


def test_a_gpu_prices_verifies_by_what_their_widths_cost_on_the_model() -> None:
    """Dense: every verify width costs about one token's forward, the built-in GPU curve stays.
    MoE: the widths route to more experts (Nemotron-30B-A3B on the H200: 8 tokens cost 4.5x one),
    and even drafts that are always accepted do not pay, so the controller decodes plainly."""
    from kapitsa.engine.speculative.controller import DraftLengthController, gpu_cost_curve
    from kapitsa.engine.speculative.cost import gpu_cost_curve_from_timings

    dense = gpu_cost_curve_from_timings({1: 21.9, 2: 21.0, 4: 20.2, 8: 20.7}.__getitem__, 7, (2, 4, 8))
    assert dense == gpu_cost_curve(7)
    moe_ms = {1: 15.1, 2: 30.0, 4: 50.3, 8: 68.3}
    moe = gpu_cost_curve_from_timings(moe_ms.__getitem__, 7, (2, 4, 8))
    assert (
        moe[0] == 1.0 and moe[7] == pytest.approx(gpu_cost_curve(7)[1] * 68.3 / 15.1) and moe[4] == moe[7]
    )  # T=5..8 pad to 8
    assert all(m >= g for m, g in zip(moe, gpu_cost_curve(7), strict=True))
    sure = DraftLengthController(max_draft=7, cost=moe, alphas=[1.0] * 7)
    assert sure.best_length() == 0
    cheaper = gpu_cost_curve_from_timings({1: 15.1, 2: 16.0, 4: 20.0, 8: 30.0}.__getitem__, 7, (2, 4, 8))
    assert DraftLengthController(max_draft=7, cost=cheaper, alphas=[1.0] * 7).best_length() == 7


def test_the_served_strategy_times_its_verify_widths_on_a_gpu(monkeypatch) -> None:  # noqa: ANN001
    """The opener's wiring with a GPU backend: the curve comes from the model's own forwards at the
    decoder's padded widths (timed here on the CPU, so only its form is checked; whether a loaded
    CPU's 16-token verify looks cheap is noise, so the long-draft choice is pinned to no, and the
    tests below check that choice from given timings)."""
    from kapitsa.engine.speculative import decoder, factory
    from kapitsa.engine.speculative.controller import gpu_cost_curve

    monkeypatch.setattr(factory, "backend", lambda: "cuda")
    monkeypatch.setattr(decoder, "backend", lambda: "cuda")
    monkeypatch.setattr(factory, "takes_long_drafts", lambda _timed: False)
    strategy = factory.strategy_for("auto", target_model=build_ours("qwen3_5_moe"))
    assert strategy.padded_widths == (2, 4, 8)
    curve = strategy.cost_curve
    assert len(curve) == strategy.max_draft + 1 and curve[0] == 1.0
    assert all(c >= g for c, g in zip(curve, gpu_cost_curve(strategy.max_draft), strict=True))


def test_a_gpu_lengthens_drafts_only_where_the_widest_verify_is_cheap() -> None:
    """The H200's 27B: 16 tokens verify in 25.2 ms against 20.7 for 8 (one read of the weights),
    so drafts may reach 15 tokens, and a copy that holds is taken 15 at a time; Nemotron's MoE
    verify routes 16 tokens to ~twice the experts of 8, and drafts stay at 7 at most."""
    from kapitsa.engine.speculative.controller import DraftLengthController
    from kapitsa.engine.speculative.cost import LONG_DRAFT, gpu_cost_curve_from_timings, takes_long_drafts

    dense = {1: 21.9, 2: 21.0, 4: 20.2, 8: 20.7, 16: 25.2}
    assert takes_long_drafts(dense)
    curve = gpu_cost_curve_from_timings(dense.__getitem__, LONG_DRAFT, sorted(dense))
    assert (
        DraftLengthController(max_draft=LONG_DRAFT, cost=curve, alphas=[1.0] * LONG_DRAFT).best_length() == 15
    )
    assert not takes_long_drafts({1: 15.1, 2: 30.0, 4: 50.3, 8: 68.3, 16: 120.0})
    assert not takes_long_drafts({1: 15.1, 8: 20.0})  # the wide verify not timed


def test_the_served_strategy_on_a_gpu_picks_the_draft_length_from_its_timings(monkeypatch) -> None:  # noqa: ANN001
    """The opener's wiring with a GPU backend: a cheap 16-token verify lengthens n-gram drafts to
    15 (padded widths up to 16), a dear one keeps 7, and --draft-tokens always wins."""
    from kapitsa.engine.speculative import cost, decoder, factory

    monkeypatch.setattr(factory, "backend", lambda: "cuda")
    monkeypatch.setattr(decoder, "backend", lambda: "cuda")
    model = build_ours("qwen3_5_dense")
    for wide_ms, expected in ((22.0, 15), (40.0, 7)):
        timings = {1: 20.0, 2: 20.0, 4: 20.0, 8: 20.0, 16: wide_ms}
        monkeypatch.setattr(
            factory,
            "gpu_width_timings",
            lambda _m, widths, t=timings: {w: t.get(w, 20.0) for w in (1, *widths)},
        )
        strategy = factory.strategy_for("auto", target_model=model)
        assert strategy.max_draft == expected
        assert len(strategy.cost_curve) == expected + 1
        assert strategy.padded_widths == ((2, 4, 8, 16) if expected == 15 else (2, 4, 8))
    fixed = factory.strategy_for("auto", target_model=model, draft_tokens=5)
    assert fixed.max_draft == 5 and len(fixed.cost_curve) == 6
    assert cost.LONG_DRAFT == 15


def test_every_width_is_built_before_any_is_timed(monkeypatch) -> None:  # noqa: ANN001
    """gpu_width_timings builds each width's forward before it evaluates anything: building hands a
    forward's custom kernels to the compile workers, so on a fresh GPU they compile side by side
    instead of one width after another, and none runs before they are on disk (`drain`): MLX would
    otherwise compile the first it reaches itself. The timings themselves are unchanged."""
    import mlx.core as mx

    from kapitsa.engine.speculative import cost

    model = build_ours("qwen3_5_dense")
    calls: list[str] = []
    real_forward, real_eval = model.forward, mx.eval

    def forward(inputs, cache, **kwargs):  # noqa: ANN001, ANN202
        calls.append(f"build {inputs.shape[1]}")
        return real_forward(inputs, cache, **kwargs)

    def evaluate(*arrays):  # noqa: ANN202
        calls.append("eval")
        return real_eval(*arrays)

    real_rollback = HybridCache.rollback

    def rollback(self, n):  # noqa: ANN001, ANN202
        calls.append(f"rollback {n}")
        return real_rollback(self, n)

    monkeypatch.setattr(model, "forward", forward)
    monkeypatch.setattr(HybridCache, "rollback", rollback)
    monkeypatch.setattr(cost.mx, "eval", evaluate)
    monkeypatch.setattr(cost.cuda_disk_cache, "drain", lambda timeout_s=None: calls.append("drain"))
    timed = cost.gpu_width_timings(model, (2, 4))
    assert sorted(timed) == [1, 2, 4] and all(t > 0 for t in timed.values())
    built = calls[: calls.index("eval")]
    # each width's forward and the rollback a timing runs after it (its masked replay): built
    # before anything is evaluated
    assert [c for c in built if c != f"build {cost.CONTEXT_TOKENS}"] == [
        "build 1",
        "rollback [1]",
        "build 2",
        "rollback [2]",
        "build 4",
        "rollback [4]",
        "drain",
    ]
