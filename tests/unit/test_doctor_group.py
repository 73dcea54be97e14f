"""`kapitsa doctor --hostfile`'s arithmetic: what each rank holds and when a model fits the group."""

from __future__ import annotations

from kapitsa.catalog import load_catalog
from kapitsa.doctor_group import GiB, group_fits, rank_shares, render_group


def test_pipeline_ranks_split_the_layers_and_rank_0_holds_the_ends() -> None:
    assert rank_shares(10 * GiB, 2 * GiB, 2, "pipeline") == (6 * GiB, 4 * GiB)
    assert sum(rank_shares(10 * GiB, 2 * GiB, 4, "pipeline")) == 10 * GiB


def test_tensor_ranks_each_hold_the_embedding_whole() -> None:
    assert rank_shares(10 * GiB, 2 * GiB, 2, "tensor") == (6 * GiB, 6 * GiB)


def _fit(usable: list[int], ref: str, parallel: str = "pipeline"):  # noqa: ANN202
    return next(f for f in group_fits(load_catalog(), usable, parallel=parallel) if f.ref == ref)


def test_a_model_too_big_for_one_machine_fits_two() -> None:
    weights = _fit([64 * GiB], "27b").weights_bytes
    one = int(weights * 0.8)
    assert _fit([one], "27b").verdict == "too_big"
    both = _fit([one, one], "27b")
    assert both.verdict in ("fits", "tight") and both.max_context
    assert len(both.rank_weights_bytes) == 2 and max(both.rank_weights_bytes) < one


def test_the_smallest_rank_decides() -> None:
    weights = _fit([64 * GiB], "27b").weights_bytes
    fit = _fit([weights, weights // 8], "27b")
    assert fit.rank_verdicts[1] == "too_big" and fit.verdict == "too_big" and fit.max_context is None
    text = render_group([weights, weights // 8], [weights, weights // 8], [fit], parallel="pipeline")
    assert "too_big" in text and "summed" in text
