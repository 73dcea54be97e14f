"""Progress for a running bench: which workload, how many are left, an ETA, and each result as it lands.

The ETA is the mean wall time of the workloads finished so far times the number still to run
(across every engine in the run). Workloads differ in length, so it is rough until a few have
finished; there is none before the first.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import TextIO

from kapitsa.bench.render import workload_line
from kapitsa.bench.schema import WorkloadResult


@dataclass(slots=True)
class EtaClock:
    """Counts finished steps against `total_steps` and estimates the time left from their mean."""

    total_steps: int
    started: float | None = None  # the first step's start, so loading a model is not counted
    done_steps: int = 0

    def start(self, now: float | None = None) -> None:
        if self.started is None:
            self.started = time.monotonic() if now is None else now

    def step_done(self) -> None:
        self.done_steps += 1

    def eta_s(self, now: float | None = None) -> float | None:
        if self.done_steps == 0 or self.started is None:
            return None
        elapsed = (time.monotonic() if now is None else now) - self.started
        return elapsed / self.done_steps * max(self.total_steps - self.done_steps, 0)


def format_eta(seconds: float | None) -> str:
    """`ETA 42s`, `ETA 3m05s`, or `ETA …` before there is an estimate."""
    if seconds is None:
        return "ETA …"
    whole = round(seconds)
    return f"ETA {whole}s" if whole < 60 else f"ETA {whole // 60}m{whole % 60:02d}s"


class BenchProgress:
    """The CLI's progress: a rich bar on a terminal, one plain line per event when piped.

    Either way each workload's figures are printed the moment it finishes.
    """

    def __init__(self, total_steps: int, *, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.clock = EtaClock(total_steps)
        self._bar = _RichBar(self.stream, total_steps) if self.stream.isatty() else None

    def started(self, engine_name: str, workload: str, index: int, total: int) -> None:
        self.clock.start()
        position = f"{self.clock.done_steps + 1}/{self.clock.total_steps}"
        eta = format_eta(self.clock.eta_s())
        if self._bar:
            self._bar.update(f"{engine_name}: {workload}", eta)
        else:
            overall = f" · overall {position}" if self.clock.total_steps != total else ""
            self._print(f"[{engine_name}] {index + 1}/{total} {workload}{overall} · {eta}")

    def finished(self, engine_name: str, result: WorkloadResult) -> None:
        self.clock.step_done()
        line = workload_line(engine_name, result)
        if self._bar:
            self._bar.advance(line, format_eta(self.clock.eta_s()))
        else:
            self._print(line)

    def close(self) -> None:
        if self._bar:
            self._bar.stop()

    def _print(self, line: str) -> None:
        print(line, file=self.stream, flush=True)


class _RichBar:
    def __init__(self, stream: TextIO, total_steps: int) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[eta]}"),
            console=Console(file=stream),
            transient=True,
        )
        self.task = self.progress.add_task("starting", total=total_steps, eta=format_eta(None))
        self.progress.start()

    def update(self, description: str, eta: str) -> None:
        self.progress.update(self.task, description=description, eta=eta)

    def advance(self, line: str, eta: str) -> None:
        from rich.text import Text

        self.progress.console.print(Text(line))
        self.progress.update(self.task, advance=1, eta=eta)

    def stop(self) -> None:
        self.progress.stop()
