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

    def __init__(
        self, agents: dict[str, str], *, server_url: str | None, too_small: frozenset[str] = frozenset()
    ) -> None:
        super().__init__()
        self.agents = agents
        self.server_url = server_url
        self.too_small = too_small  # agents whose first request the model's window cannot hold

    def compose(self) -> ComposeResult:
        with Vertical(classes="modal-box launch-box") as box:
            box.border_title = "Launch an agent"
            target = (
                f"server: {self.server_url}"
                if self.server_url
                else "the engine is not running: start it first (s)"
            )
            yield Static(f"{target}\nthe TUI comes back when the agent exits", id="launch-target")
            yield OptionList(*[Option(self._label(name), id=name) for name in self.agents], id="agent-list")

    def _label(self, name: str) -> str:
        label = self.agents[name]
        return f"{label}  (window too small)" if name in self.too_small else label

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(event.option.id)

    def action_cancel(self) -> None:
        self.dismiss(None)
