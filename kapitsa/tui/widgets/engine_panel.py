"""The engine's state, its endpoint, and `env` lines ready to copy."""

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
    """Status line, then the endpoint and export lines while the engine runs."""

    def on_mount(self) -> None:
        self.border_title = "Engine"
        self.show("stopped", model=None)

    def show(
        self,
        status: str,
        *,
        model: str | None,
        url: str | None = None,
        env_lines: list[str] | None = None,
        note: str | None = None,
    ) -> None:
        text = Text()
        text.append(f"● {status}", style=STATUS_STYLES.get(status, ""))
        if model:
            text.append(f"  {model}", style="bold")
        if url:
            text.append(f"\n{url}/v1", style="bold cyan")
        for line in env_lines or []:
            text.append(f"\n{line}")
        if note:
            text.append(f"\n{note}", style="yellow")
        if status == "stopped":
            text.append("\npick a model, press s to start", style="dim")
        self.update(text)
