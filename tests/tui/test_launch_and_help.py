"""Launch: pick an agent, the TUI suspends while it runs, the server keeps running. Help and errors."""

from __future__ import annotations

import contextlib

import httpx
from textual.widgets import OptionList
from tui_support import FakeServices, of_type, settle, wait_until

from kapitsa.errors import KapitsaError
from kapitsa.tui.messages import AgentExited
from kapitsa.tui.screens.error import ErrorModal
from kapitsa.tui.screens.help import HelpScreen
from kapitsa.tui.screens.launch import LaunchScreen


class TestLaunch:
    async def test_agent_runs_suspended_and_the_server_survives(
        self, make_app, services, messages, monkeypatch
    ) -> None:
        """Check that choosing Claude Code runs its command with the server's env, then the TUI returns."""
        app = make_app()
        suspended: list[bool] = []

        @contextlib.contextmanager
        def fake_suspend():
            suspended.append(True)  # headless test drivers cannot really suspend
            yield

        monkeypatch.setattr(app, "suspend", fake_suspend)
        async with app.run_test(size=(80, 24), message_hook=messages.append) as pilot:
            await settle(pilot)
            await pilot.press("s")
            await wait_until(pilot, lambda: app.engine_status == "running")
            await pilot.press("a")
            assert isinstance(app.screen, LaunchScreen)
            options = app.screen.query_one(OptionList)
            assert [options.get_option_at_index(i).id for i in range(options.option_count)] == [
                "opencode",
                "claude",
                "codex",
                "pi",
            ]
            await pilot.press("down", "enter")
            await pilot.pause()
            assert suspended == [True]
            ((argv, env),) = services.agent_runs
            assert argv == ["fake-claude", "--model", "4b"] and env["FAKE_URL"] == app.engine_handle.url
            assert [(m.agent, m.returncode) for m in of_type(messages, AgentExited)] == [("claude", 0)]
            async with httpx.AsyncClient() as http:
                assert (await http.get(f"{app.engine_handle.url}/health")).status_code == 200

    async def test_without_an_engine_it_says_start_first(self, make_app, services) -> None:
        app = make_app()
        async with app.run_test(size=(80, 24)) as pilot:
            await settle(pilot)
            await pilot.press("a")
            assert "not running" in str(app.screen.query_one("#launch-target").render())
            await pilot.press("enter")
            await pilot.pause()
            assert isinstance(app.screen, ErrorModal) and "start it first" in app.screen.message
            assert services.agent_runs == []

    async def test_a_missing_agent_binary_is_a_modal(self, make_app, services, monkeypatch) -> None:
        def not_installed(argv, env):
            raise KapitsaError("codex is not installed: npm install -g @openai/codex")

        monkeypatch.setattr(services, "run_agent", not_installed)
        app = make_app()
        monkeypatch.setattr(app, "suspend", contextlib.nullcontext)
        async with app.run_test(size=(80, 24)) as pilot:
            await settle(pilot)
            await pilot.press("s")
            await wait_until(pilot, lambda: app.engine_status == "running")
            await pilot.press("a", "down", "down", "enter")
            await pilot.pause()
            assert isinstance(app.screen, ErrorModal)
            assert app.screen.title_text == "Launch Codex" and "npm install" in app.screen.message

    async def test_escape_cancels(self, make_app, services) -> None:
        async with make_app().run_test(size=(80, 24)) as pilot:
            await settle(pilot)
            await pilot.press("a", "escape")
            assert not isinstance(pilot.app.screen, LaunchScreen) and services.agent_runs == []


async def test_help_opens_and_closes(make_app) -> None:
    async with make_app().run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        await pilot.press("question_mark")
        assert isinstance(pilot.app.screen, HelpScreen)
        await pilot.press("escape")
        assert pilot.app.screen.id == "home"


async def test_unexpected_worker_errors_become_modals(make_app) -> None:
    """Check the safety net: a worker that raises something unplanned shows a modal and the app lives on."""
    app = make_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)

        def explode() -> None:
            raise RuntimeError("boom")

        app.run_worker(explode, thread=True, name="explode", exit_on_error=False)
        await settle(pilot)
        assert isinstance(app.screen, ErrorModal) and "RuntimeError: boom" in app.screen.message
        assert app.is_running


async def test_an_agent_the_window_cannot_hold_is_refused_in_one_line(
    tmp_path, messages, monkeypatch
) -> None:
    from kapitsa.engine.types import ModelInfo
    from kapitsa.testing.fake_engine import FakeEngine
    from kapitsa.tui.app import KapitsaApp

    small = ModelInfo("4b", "fake", context_length=8192, max_output_tokens=4096)
    services = FakeServices(tmp_path, engine_factory=lambda ref: FakeEngine(model=small))
    app = KapitsaApp(services)
    monkeypatch.setattr(app, "suspend", contextlib.nullcontext)
    async with app.run_test(size=(80, 24), message_hook=messages.append) as pilot:
        await settle(pilot)
        await pilot.press("s")
        await wait_until(pilot, lambda: app.engine_status == "running")
        await pilot.press("a")
        options = app.screen.query_one(OptionList)
        labels = [str(options.get_option_at_index(i).prompt) for i in range(options.option_count)]
        assert labels == [
            "opencode  (window too small)",
            "Claude Code  (window too small)",
            "Codex  (window too small)",
            "pi",
        ]
        await pilot.press("down", "enter")  # Claude Code
        await pilot.pause()
        assert isinstance(app.screen, ErrorModal) and app.screen.title_text == "Launch Claude Code"
        message = app.screen.message
        assert "\n" not in message and "4b's context window is 8,192 tokens" in message
        assert "then select " in message and "download it (d) and start it (s)" in message
        assert services.agent_runs == []
        await pilot.press("enter", "a", "down", "down", "down", "enter")  # pi's first request fits
        await pilot.pause()
        assert [argv[0] for argv, _ in services.agent_runs] == ["fake-pi"]
