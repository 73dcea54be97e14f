"""The engine's state and its endpoint."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

STATUS_STYLES = {
    "stopped": "dim",
    "starting": "yellow",
    "running": "bold green",
    "stopping": "yellow",
    "failed": "bold red",
}


class EnginePanel(Static):
    """Status line, then the endpoint while the engine runs."""

    def on_mount(self) -> None:
        self.border_title = "Engine"
        self.show("stopped", model=None)

    def show(
        self, status: str, *, model: str | None, url: str | None = None, note: str | None = None
    ) -> None:
        text = Text()
        text.append(f"● {status}", style=STATUS_STYLES.get(status, ""))
        if model:
            text.append(f"  {model}", style="bold")
        if url:
            text.append(f"\n{url}/v1", style="bold cyan")
            text.append("\na launches an agent", style="dim")
        if note:
            text.append(f"\n{note}", style="yellow")
        if status in ("stopped", "failed"):
            text.append("\npick a model, s starts it", style="dim")
        self.update(text)
