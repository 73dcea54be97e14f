"""Messages workers post. Workers never touch widgets; the handlers of these messages own all state.

None bubble: each is handled by the node whose worker posted it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from textual.message import Message

from kapitsa.engine.types import EngineStats

if TYPE_CHECKING:
    from kapitsa.bench.schema import BenchReport, WorkloadResult
    from kapitsa.bench.submit import SubmitResult
    from kapitsa.doctor import DoctorReport
    from kapitsa.tui.services import EngineHandle


@dataclass
class DoctorLoaded(Message, bubble=False):
    report: DoctorReport
    downloaded_refs: frozenset[str]


@dataclass
class DoctorFailed(Message, bubble=False):
    error: Exception


@dataclass
class EngineStarted(Message, bubble=False):
    handle: EngineHandle


@dataclass
class EngineStopped(Message, bubble=False):
    model: str


@dataclass
class EngineFailed(Message, bubble=False):
    error: Exception


@dataclass
class StatsPolled(Message, bubble=False):
    stats: EngineStats


@dataclass
class DownloadProgressed(Message, bubble=False):
    ref: str
    bytes_done: int
    bytes_total: int


@dataclass
class DownloadFinished(Message, bubble=False):
    ref: str
    path: Path


@dataclass
class DownloadCancelled(Message, bubble=False):
    ref: str


@dataclass
class DownloadFailed(Message, bubble=False):
    ref: str
    error: Exception


@dataclass
class AgentExited(Message, bubble=False):
    agent: str
    returncode: int


@dataclass
class BenchProgressed(Message, bubble=False):
    workload: str
    index: int
    total: int


@dataclass
class BenchWorkloadDone(Message, bubble=False):
    result: WorkloadResult
    index: int
    total: int


@dataclass
class BenchFinished(Message, bubble=False):
    report: BenchReport
    path: Path  # where the report was saved


@dataclass
class BenchFailed(Message, bubble=False):
    error: Exception


@dataclass
class SubmitFinished(Message, bubble=False):
    result: SubmitResult


@dataclass
class SubmitFailed(Message, bubble=False):
    error: Exception
