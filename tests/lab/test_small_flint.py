"""lab/small_flint.py: its Flint shape is the catalog's, its budgets give the widths doctor quotes,
and the script runs end to end at tiny widths."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kapitsa.catalog import load_catalog
from kapitsa.engine.loading.small import plan_small
from lab.small_flint import BUDGETS, FLINT, _model

ROOT = Path(__file__).resolve().parents[2]


def test_the_published_shape_splits_as_the_catalog_says_and_each_budget_gets_its_width() -> None:
    model = _model(FLINT)  # lazy random init: nothing is materialized
    arch = load_catalog().get("flint").arch
    plans = {name: plan_small(model, budget) for name, budget in BUDGETS.items()}
    assert abs(plans["24gb-mac"].expert_params / 1e9 - arch.expert_params_b) < 0.01
    assert abs((plans["24gb-mac"].expert_params + plans["24gb-mac"].rest_params) / 1e9 - arch.params_b) < 0.05
    assert {n: p.description for n, p in plans.items()} == {"24gb-mac": "small-2/6", "16gb-mac": "small-2/3"}


def test_tiny_run_times_the_recipe_and_plain_4bit_beside_mlx_vlm() -> None:
    done = subprocess.run(
        [sys.executable, "lab/small_flint.py", "--tiny", "--tokens", "4", "--prompt", "24"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [(r["engine"], r["quantization"]) for r in rows] == [
        ("kapitsa", "small-2/6"),
        ("kapitsa", "small-2/6"),
        ("kapitsa", "4bit"),
        ("mlx-vlm", "4bit"),  # the test environment has mlx-vlm 0.7.10
    ]
    assert all(r["decode_tok_s"] > 0 for r in rows)
