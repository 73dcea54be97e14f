"""Keeping and submitting reports: every report is saved to a file first, then optionally posted.

Posting needs a results URL (`--results-url` or `KAPITSA_BENCH_RESULTS_URL`); none is built in.
When the server cannot be reached, the report stays in its file and the result says so.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx

from kapitsa.bench.schema import BenchReport
from kapitsa.errors import KapitsaError

RESULTS_URL_ENV = "KAPITSA_BENCH_RESULTS_URL"


@dataclass(slots=True, frozen=True)
class SubmitResult:
    """What happened to a submission. `posted` is False when offline; the file is kept either way."""

    posted: bool
    path: Path
    message: str


def results_dir() -> Path:
    """Where reports are kept: `KAPITSA_BENCH_DIR`, else the user state folder."""
    if explicit := os.environ.get("KAPITSA_BENCH_DIR"):
        return Path(explicit)
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "kapitsa" / "bench"
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "kapitsa" / "bench"


def report_json(report: BenchReport) -> str:
    return json.dumps(report.to_dict(), indent=2, sort_keys=False)


def save_report(report: BenchReport, directory: Path | None = None) -> Path:
    """Write the report as `bench-<UTC time>.json` and return its path."""
    folder = directory or results_dir()
    folder.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%S%fZ")
    path = folder / f"bench-{stamp}.json"
    path.write_text(report_json(report) + "\n", encoding="utf-8")
    return path


def resolve_results_url(explicit: str | None) -> str | None:
    return explicit or os.environ.get(RESULTS_URL_ENV) or None


def submit_report(
    report: BenchReport, *, url: str | None, path: Path, timeout_s: float = 15.0
) -> SubmitResult:
    """POST the report as JSON to `url`. Offline → not posted, file kept; a refusal → `KapitsaError`."""
    if not url:
        return SubmitResult(
            False, path, f"no results URL configured (set {RESULTS_URL_ENV} or --results-url); kept {path}"
        )
    try:
        response = httpx.post(url, json=report.to_dict(), timeout=timeout_s)
    except httpx.TransportError as err:
        return SubmitResult(
            False, path, f"offline: could not reach {url} ({type(err).__name__}); kept {path}"
        )
    if not response.is_success:
        raise KapitsaError(
            f"{url} refused the results ({response.status_code}: {response.text[:200]}); kept {path}"
        )
    return SubmitResult(True, path, f"submitted to {url}{_receipt(response)}; kept {path}")


def _receipt(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return ""
    link = body.get("url") or body.get("id") if isinstance(body, dict) else None
    return f" ({link})" if link else ""
