"""The Textual app (`kapitsa` with no arguments): home, live panels, bench, agent launch.

The App holds the one engine handle. Engine work runs in workers that never touch widgets: they
post messages, and the handlers below own the state (`engine_status`, `engine_stats`).
"""

from __future__ import annotations

import asyncio
import time

from textual import work
from textual.app import App, SuspendNotSupported
from textual.binding import Binding
from textual.reactive import reactive, var
from textual.worker import Worker, WorkerState, get_current_worker

from kapitsa.engine.client import EngineClient
from kapitsa.engine.types import EngineStats
from kapitsa.errors import KapitsaError
from kapitsa.tui.messages import AgentExited, EngineFailed, EngineStarted, EngineStopped, StatsPolled
from kapitsa.tui.screens.bench import BenchScreen
from kapitsa.tui.screens.error import ErrorModal
from kapitsa.tui.screens.help import HelpScreen
from kapitsa.tui.screens.home import HomeScreen
from kapitsa.tui.screens.launch import LaunchScreen
from kapitsa.tui.screens.live import LiveScreen
from kapitsa.tui.services import AGENT_LABELS, EngineHandle, TuiServices

STATS_INTERVAL_S = 0.5
FALLBACK_MODEL = "demo"  # the model that ships inside kapitsa: a first run needs no download


class KapitsaApp(App):
    CSS_PATH = "app.tcss"
    TITLE = "kapitsa"
    ENABLE_COMMAND_PALETTE = False  # every action has a key; the footer needs the room at 80 columns
    MODES = {"home": HomeScreen, "live": LiveScreen, "bench": BenchScreen}
    DEFAULT_MODE = "home"
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (120, "-wide")]  # app.tcss packs the footer when narrow
    BINDINGS = [
        Binding("1", "switch_mode('home')", "Home"),
        Binding("2", "switch_mode('live')", "Live"),
        Binding("3", "switch_mode('bench')", "Bench"),
        Binding("s", "toggle_engine", "Engine"),
        Binding("a", "launch", "Agent"),
        Binding("question_mark", "help", "Help"),
        Binding("q", "quit", "Quit"),
    ]

    engine_status: reactive[str] = reactive("stopped")
    engine_stats: reactive[EngineStats | None] = reactive(None, always_update=True)
    selected_ref: var[str | None] = var(None)

    def __init__(self, services: TuiServices | None = None) -> None:
        super().__init__()
        self.services = services or TuiServices()
        self.engine_handle: EngineHandle | None = None
        self.engine_model: str | None = None  # the model being started, stopped, or that failed
        self.engine_note: str | None = None  # why the last start failed
        self._settings_error: KapitsaError | None = None
        try:  # before any screen mounts: the home screen selects this model when its list loads
            self.selected_ref = self.services.settings.default_model
        except KapitsaError as err:
            self.selected_ref = FALLBACK_MODEL
            self._settings_error = err

    def on_mount(self) -> None:
        if self._settings_error is not None:
            self.show_error("Settings", self._settings_error)

    def show_error(self, title: str, error: Exception | str) -> None:
        """Every error the user should see ends here: a modal, never a crash."""
        if isinstance(error, Exception) and not isinstance(error, KapitsaError):
            error = f"{type(error).__name__}: {error}"
        self.push_screen(ErrorModal(title, str(error)))

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        if event.state == WorkerState.ERROR:  # workers report their own errors; this catches the unexpected
            self.show_error(f"Internal error in {event.worker.name}", event.worker.error or "unknown error")

    # -- engine -------------------------------------------------------------------------------------

    def action_toggle_engine(self) -> None:
        if self.engine_status in ("starting", "stopping"):
            self.notify(f"the engine is {self.engine_status}…")
        elif self.engine_handle is not None:
            self.engine_status = "stopping"
            self.stop_engine_worker(self.engine_handle)
        else:
            self.engine_model = self.selected_ref or FALLBACK_MODEL
            self.engine_note = None
            self.engine_status = "starting"
            self.start_engine_worker(self.engine_model)

    @work(thread=True, exclusive=True, group="engine", exit_on_error=False)
    def start_engine_worker(self, ref: str) -> None:
        try:
            handle = self.services.start_engine(ref)
        except Exception as err:  # noqa: BLE001 - reported in a modal
            self.post_message(EngineFailed(err))
            return
        self.post_message(EngineStarted(handle))

    @work(thread=True, exclusive=True, group="engine", exit_on_error=False)
    def stop_engine_worker(self, handle: EngineHandle) -> None:
        handle.stop()
        self.post_message(EngineStopped(handle.model))

    @work(thread=True, exclusive=True, group="stats", exit_on_error=False)
    def poll_stats(self, client: EngineClient) -> None:
        worker = get_current_worker()
        while not worker.is_cancelled:
            self.post_message(StatsPolled(client.stats()))
            time.sleep(STATS_INTERVAL_S)

    def on_engine_started(self, message: EngineStarted) -> None:
        self.engine_handle = message.handle
        self.engine_status = "running"
        self.poll_stats(message.handle.client)

    def on_engine_failed(self, message: EngineFailed) -> None:
        self.engine_note = str(message.error)
        self.engine_status = "failed"
        self.show_error(f"Could not start {self.engine_model}", message.error)

    def on_engine_stopped(self, message: EngineStopped) -> None:
        self.workers.cancel_group(self, "stats")
        self.engine_handle = None
        self.engine_stats = None
        self.engine_status = "stopped"

    def on_stats_polled(self, message: StatsPolled) -> None:
        if self.engine_handle is not None:
            self.engine_stats = message.stats

    async def action_quit(self) -> None:
        handle, self.engine_handle = self.engine_handle, None
        if handle is not None:
            self.engine_status = "stopping"
            self.workers.cancel_group(self, "stats")
            await asyncio.to_thread(handle.stop)
        self.exit()

    # -- agents and help ----------------------------------------------------------------------------

    def action_launch(self) -> None:
        handle = self.engine_handle
        too_small = self.services.agents_the_window_cannot_hold(handle) if handle else frozenset()
        screen = LaunchScreen(
            AGENT_LABELS, server_url=f"{handle.url}/v1" if handle else None, too_small=too_small
        )
        self.push_screen(screen, self.launch_agent)

    def launch_agent(self, agent: str | None) -> None:
        if agent is None:
            return
        handle = self.engine_handle
        if handle is None:
            self.show_error("Launch", "the engine is not running: start it first (s)")
            return
        try:
            if shortfall := self.services.window_shortfall(agent, handle):
                self.show_error(f"Launch {AGENT_LABELS[agent]}", shortfall)
                return
            argv, env = self.services.agent_invocation(agent, handle)
            with self.suspend():
                returncode = self.services.run_agent(argv, env)
        except SuspendNotSupported:
            self.show_error(
                "Launch", f"this terminal cannot hand over to an agent; run `kapitsa {agent}` in another one"
            )
        except KapitsaError as err:
            self.show_error(f"Launch {AGENT_LABELS[agent]}", err)
        else:
            self.post_message(AgentExited(agent, returncode))

    def on_agent_exited(self, message: AgentExited) -> None:
        self.notify(
            f"{AGENT_LABELS[message.agent]} exited ({message.returncode}); the server is still running"
        )

    def action_help(self) -> None:
        self.push_screen(HelpScreen())


def run_tui() -> None:
    """Entry point for `kapitsa` with no arguments."""
    KapitsaApp().run()
