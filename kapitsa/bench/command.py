"""The body of `kapitsa bench`: build the targets, run them, print, keep, and maybe submit."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kapitsa.bench.local import open_local_engine
from kapitsa.bench.machine import machine_info
from kapitsa.bench.progress import BenchProgress
from kapitsa.bench.render import notes, render_text, rich_table
from kapitsa.bench.runner import WORKLOAD_NAMES, check_workloads, run_bench
from kapitsa.bench.schema import BenchReport, EngineResult
from kapitsa.bench.submit import report_json, resolve_results_url, save_report, submit_report
from kapitsa.bench.targets import BenchTarget, EngineTarget, HttpTarget
from kapitsa.bench.workloads import BenchConfig
from kapitsa.engine.options import DEFAULT_SPECULATIVE

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
    speculative: str = DEFAULT_SPECULATIVE
    results_url: str | None = None
    config: BenchConfig = field(default_factory=BenchConfig)
    workloads: tuple[str, ...] = WORKLOAD_NAMES  # a subset runs in the standard order

    def __post_init__(self) -> None:
        object.__setattr__(self, "workloads", check_workloads(self.workloads))


def bench_main(options: BenchOptions, *, confirm: Callable[[str], bool]) -> BenchReport:
    """Run the bench as the CLI does. `confirm` asks the user (yes/no) before anything is posted."""
    config = QUICK_CONFIG if options.quick else options.config
    report = asyncio.run(collect_report(options, config))
    path = save_report(report)
    print_report(report, json_out=options.json_out)
    print(f"saved {path}", file=sys.stderr)
    if options.submit:
        confirm_and_submit(report, path, options, confirm)
    return report


def print_report(report: BenchReport, *, json_out: bool) -> None:
    """JSON for `--json`; a rich table in colour on a terminal; the plain table when piped."""
    if json_out:
        print(report_json(report))
    elif sys.stdout.isatty():
        from rich.console import Console

        console = Console()
        console.print(rich_table(report))
        for note in notes(report):
            console.print(note, style="yellow", markup=False, highlight=False)
    else:
        print(render_text(report))


async def collect_report(options: BenchOptions, config: BenchConfig) -> BenchReport:
    report = BenchReport(
        machine=machine_info(), config=config.to_dict() | {"workloads": list(options.workloads)}
    )
    num_engines = int(options.local) + len(options.compare)
    progress = BenchProgress(num_engines * len(options.workloads))
    try:
        if options.local:
            from kapitsa.opener import hand_back_memory

            report.engines.append(await _run_local(options, config, progress))
            hand_back_memory()  # the servers compared next may share this device
        for url in options.compare:
            report.engines.append(await _run_one(HttpTarget(url), config, progress, options.workloads))
    finally:
        progress.close()
    return report


async def _run_local(options: BenchOptions, config: BenchConfig, progress: BenchProgress) -> EngineResult:
    """The in-process engine's results; the engine is closed and out of reach when this returns."""
    async with open_local_engine(options.model, speculative=options.speculative) as client:
        target = EngineTarget(client, name="kapitsa")
        return await _run_one(target, config, progress, options.workloads)


async def _run_one(
    target: BenchTarget, config: BenchConfig, progress: BenchProgress, workloads: tuple[str, ...]
) -> EngineResult:
    try:
        await target.prepare()
        return await run_bench(
            target,
            config,
            on_progress=lambda name, index, total: progress.started(target.name, name, index, total),
            on_result=lambda result, _index, _total: progress.finished(target.name, result),
            workloads=workloads,
        )
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
