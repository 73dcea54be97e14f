"""lab/gpu_tests.py, the sharded runner of the `-m gpu` set: its merging of phase reports and,
end to end on a throwaway test file, its failures, skips and the cases a deadline cut."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "lab"))

import gpu_tests  # noqa: E402


def test_shard_spreads_each_function_round_robin() -> None:
    ids = [f"t.py::f[{i}]" for i in range(5)]
    assert gpu_tests.shard(ids, 2) == [
        ["t.py::f[0]", "t.py::f[2]", "t.py::f[4]"],
        ["t.py::f[1]", "t.py::f[3]"],
    ]
    assert gpu_tests.shard(ids[:1], 4) == [["t.py::f[0]"]]  # no empty shards


def test_merge_takes_the_worst_phase_and_names_the_missing() -> None:
    lines = [
        dict(nodeid="a", when="call", outcome="passed", message=""),
        dict(nodeid="b", when="call", outcome="passed", message=""),
        dict(nodeid="b", when="teardown", outcome="failed", message="boom"),
        dict(nodeid="c", when="setup", outcome="skipped", message="Skipped: needs CUDA"),
    ]
    result = gpu_tests.merge(lines, ["a", "b", "c", "d"])
    assert result["counts"] == {"passed": 1, "failed": 1, "skipped": 1, "not_run": 1}
    assert result["failures"] == [{"nodeid": "b", "when": "teardown", "message": "boom"}]
    assert result["skip_reasons"] == {"Skipped: needs CUDA": 1}
    assert result["not_run"] == ["d"]


DEMO = """
import time
import pytest

pytestmark = pytest.mark.demo

def test_passes():
    assert True

def test_fails():
    assert 1 + 1 == 3, "arithmetic"

def test_skips():
    pytest.skip("not here")

def test_sleeps_past_the_deadline():
    time.sleep(120)

@pytest.mark.parametrize("n", [1, 2])
def test_param(n):
    assert n > 0
"""


def test_runner_end_to_end(tmp_path: Path) -> None:
    (tmp_path / "test_demo.py").write_text(DEMO)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    demo: a demo\n")
    done = subprocess.run(
        [
            sys.executable, str(ROOT / "lab" / "gpu_tests.py"), "--marker", "demo", "--shards", "2",
            "--budget", "20", "--cwd", str(tmp_path), "--out", str(tmp_path / "out"), "test_demo.py",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    summary = rows[-1]
    assert done.returncode == 1, done.stdout + done.stderr
    # shard 0: passes, skips, param[1]; shard 1: fails, sleeps (killed at the deadline), param[2]
    assert (summary["collected"], summary["passed"], summary["failed"], summary["skipped"]) == (6, 2, 1, 1)
    assert summary["not_run_first"] == [
        "test_demo.py::test_sleeps_past_the_deadline",
        "test_demo.py::test_param[2]",
    ]
    assert summary["not_run"] == 2
    assert summary["skip_reasons"] == {"Skipped: not here": 1}
    [failure] = [r for r in rows if r.get("kind") == "gpu_test_failure"]
    assert failure["nodeid"] == "test_demo.py::test_fails" and "arithmetic" in failure["message"]
