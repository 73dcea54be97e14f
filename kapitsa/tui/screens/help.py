"""The keys, per screen."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

HELP_TEXT = """\
[b]Everywhere[/b]
  1 2 3   home · live panels · bench
  s       start/stop the engine (the model picked on home)
  a       launch a coding agent against the engine
  ?       this help              q   quit (stops the engine)

[b]Home[/b]
  ↑ ↓     pick a model           d   download it
  x       cancel its download    r   check this machine again
  c       copy the endpoint and env lines

[b]Live[/b]    tok/s, requests and cache, twice a second

[b]Bench[/b]
  r       quick bench            f   full bench
  u       submit the results (shows the JSON, asks first)

The server listens on 127.0.0.1 only; it keeps running while an
agent runs, and stops when you quit."""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,q,question_mark", "close", "Close")]

    def compose(self) -> ComposeResult:
        with VerticalScroll(classes="modal-box help-box") as box:
            box.border_title = "Help"
            yield Static(HELP_TEXT)

    def action_close(self) -> None:
        self.dismiss(None)
