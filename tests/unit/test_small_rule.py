"""The `:small` recipe's width rule: pure arithmetic on parameter counts and a memory budget."""

from __future__ import annotations

import pytest

from kapitsa.engine.loading.small_rule import (
    DEFAULT_REST_BITS,
    REST_BITS,
    choose_rest_bits,
    reserve_bytes,
    small_weights_bytes,
)

GiB = 1 << 30
# Flint (RecursiveSI/flint): 47 MoE layers x 256 experts x 3 x 2048 x 512 routed, ~1.95 B the rest.
FLINT = {"expert_params": 37.85e9, "rest_params": 1.95e9}


def test_weights_are_experts_at_2_5_bits_plus_the_rest_at_its_width_plus_half_a_bit():
    assert small_weights_bytes(expert_params=8e9, rest_params=2e9, rest_bits=4) == int(
        8e9 * 2.5 / 8 + 2e9 * 4.5 / 8
    )


def test_the_reserve_is_a_fifth_of_the_budget_and_at_least_2_gib():
    assert reserve_bytes(4 * GiB) == 2 * GiB
    assert reserve_bytes(40 * GiB) == 8 * GiB


@pytest.mark.parametrize(
    ("budget_gib", "bits"),
    [
        (10.67, 3),  # a 16 GB Mac's Metal working set: the 2-bit experts alone overflow it
        (14.5, 3),
        (15.1, 4),
        (15.4, 5),
        (16.0, 6),  # a 24 GB Mac's working set
        (100.0, 6),
    ],
)
def test_flint_gets_more_bits_as_the_budget_grows(budget_gib, bits):
    assert choose_rest_bits(int(budget_gib * GiB), **FLINT) == bits


def test_bigger_budget_never_means_fewer_bits_and_every_width_is_reached():
    budgets = [int(g * GiB / 8) for g in range(8, 200)]
    widths = [choose_rest_bits(b, **FLINT) for b in budgets]
    assert widths == sorted(widths)
    assert set(widths) == set(REST_BITS)


def test_unknown_budget_takes_the_default_width():
    assert choose_rest_bits(None, **FLINT) == DEFAULT_REST_BITS


def test_weights_the_recipe_leaves_float_take_room_from_the_rest():
    budget = 16 * GiB
    assert choose_rest_bits(budget, **FLINT) == 6
    assert choose_rest_bits(budget, **FLINT, fixed_bytes=GiB // 2) == 5  # e.g. a bf16 vision tower
