"""A modal that shows an error message; any of enter, escape or the button closes it."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Static


class ErrorModal(ModalScreen[None]):
    BINDINGS = [Binding("escape,enter", "dismiss_modal", "Close")]

    def __init__(self, title: str, message: str) -> None:
        super().__init__(classes="modal")
        self.title_text = title
        self.message = message

    def compose(self) -> ComposeResult:
        with Vertical(classes="modal-box error-box") as box:
            box.border_title = self.title_text
            yield Static(self.message, id="error-message")
            yield Button("OK", variant="error", id="error-ok")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(None)

    def action_dismiss_modal(self) -> None:
        self.dismiss(None)
