"""Pick a coding agent to launch against the running engine."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import OptionList, Static
from textual.widgets.option_list import Option


class LaunchScreen(ModalScreen[str | None]):
    """Dismisses with the agent's command name (`claude`, `codex`, …) or None."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, agents: dict[str, str], *, server_url: str | None) -> None:
        super().__init__()
        self.agents = agents
        self.server_url = server_url

    def compose(self) -> ComposeResult:
        with Vertical(classes="modal-box launch-box") as box:
            box.border_title = "Launch an agent"
            target = (
                f"server: {self.server_url}"
                if self.server_url
                else "the engine is not running: start it first (s)"
            )
            yield Static(f"{target}\nthe TUI comes back when the agent exits", id="launch-target")
            yield OptionList(
                *[Option(label, id=name) for name, label in self.agents.items()], id="agent-list"
            )

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(event.option.id)

    def action_cancel(self) -> None:
        self.dismiss(None)
