"""The body of `kapitsa bench`: build the targets, run them, print, keep, and maybe submit."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kapitsa.bench.local import open_local_engine
from kapitsa.bench.machine import machine_info
from kapitsa.bench.render import render_text
from kapitsa.bench.runner import run_bench
from kapitsa.bench.schema import BenchReport, EngineResult
from kapitsa.bench.submit import report_json, resolve_results_url, save_report, submit_report
from kapitsa.bench.targets import BenchTarget, EngineTarget, HttpTarget
from kapitsa.bench.workloads import BenchConfig

QUICK_CONFIG = BenchConfig(
    short_prompt_words=16,
    long_prompt_words=256,
    decode_tokens=16,
    replay_turns=4,
    replay_context_words=200,
    concurrent_tokens=16,
)


@dataclass(slots=True, frozen=True)
class BenchOptions:
    model: str | None = None
    json_out: bool = False
    submit: bool = False
    compare: tuple[str, ...] = ()
    local: bool = True
    quick: bool = False
    speculative: str = "none"
    results_url: str | None = None
    config: BenchConfig = field(default_factory=BenchConfig)


def bench_main(options: BenchOptions, *, confirm: Callable[[str], bool]) -> BenchReport:
    """Run the bench as the CLI does. `confirm` asks the user (yes/no) before anything is posted."""
    config = QUICK_CONFIG if options.quick else options.config
    report = asyncio.run(collect_report(options, config))
    path = save_report(report)
    print(report_json(report) if options.json_out else render_text(report))
    print(f"saved {path}", file=sys.stderr)
    if options.submit:
        confirm_and_submit(report, path, options, confirm)
    return report


async def collect_report(options: BenchOptions, config: BenchConfig) -> BenchReport:
    report = BenchReport(machine=machine_info(), config=config.to_dict())
    if options.local:
        with open_local_engine(options.model, speculative=options.speculative) as client:
            report.engines.append(await _run_one(EngineTarget(client, name="kapitsa"), config))
    for url in options.compare:
        report.engines.append(await _run_one(HttpTarget(url), config))
    return report


async def _run_one(target: BenchTarget, config: BenchConfig) -> EngineResult:
    def progress(name: str, index: int, total: int) -> None:
        print(f"[{target.name}] {index + 1}/{total} {name}", file=sys.stderr, flush=True)

    try:
        await target.prepare()
        return await run_bench(target, config, on_progress=progress)
    finally:
        await target.aclose()


def confirm_and_submit(
    report: BenchReport, path: Path, options: BenchOptions, confirm: Callable[[str], bool]
) -> None:
    """Show the JSON, ask, then post; without a results URL, say so (the file is kept either way)."""
    url = resolve_results_url(options.results_url)
    if url and not options.json_out:
        print(report_json(report))  # the user sees exactly what will be sent
    if url and not confirm(f"Post these results to {url}?"):
        print(f"not submitted; kept {path}", file=sys.stderr)
        return
    print(submit_report(report, url=url, path=path).message, file=sys.stderr)
