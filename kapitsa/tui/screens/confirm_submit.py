"""Shows exactly the JSON that would be posted and asks before posting it."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Static, TextArea


class ConfirmSubmitModal(ModalScreen[bool]):
    BINDINGS = [Binding("y", "answer(True)", "Submit"), Binding("n,escape", "answer(False)", "Cancel")]

    def __init__(self, report_json: str, url: str | None) -> None:
        super().__init__()
        self.report_json = report_json
        self.url = url

    def compose(self) -> ComposeResult:
        with Vertical(classes="modal-box submit-box") as box:
            box.border_title = "Submit bench results?"
            where = (
                f"post to {self.url}"
                if self.url
                else "no results URL is set (KAPITSA_BENCH_RESULTS_URL): nothing will be posted"
            )
            yield Static(where, id="submit-url")
            yield TextArea(self.report_json, read_only=True, language=None, id="submit-json")
            with Horizontal(classes="buttons"):
                yield Button("Submit (y)", variant="primary", id="submit-yes", disabled=not self.url)
                yield Button("Cancel (n)", id="submit-no")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "submit-yes")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes and bool(self.url))
