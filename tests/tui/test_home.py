"""Home: doctor summary, model list with fit badges, downloads with progress and cancel, engine start/stop."""

from __future__ import annotations

import httpx
from tui_support import FakeServices, of_type, settle

from kapitsa.errors import ModelNotFound
from kapitsa.tui.messages import (
    DoctorLoaded,
    DownloadCancelled,
    DownloadFinished,
    DownloadProgressed,
    EngineFailed,
    EngineStarted,
    EngineStopped,
)
from kapitsa.tui.screens.error import ErrorModal
from kapitsa.tui.services import TuiServices
from kapitsa.tui.widgets.downloads_panel import DownloadsPanel
from kapitsa.tui.widgets.engine_panel import EnginePanel
from kapitsa.tui.widgets.env_panel import EnvPanel
from kapitsa.tui.widgets.model_table import ModelTable
from kapitsa.units import format_context


class TestDoctorAndModels:
    async def test_models_get_fit_badges_and_the_default_is_selected(self, make_app, messages) -> None:
        """Check that every catalog ref is listed with its verdict, and the default model is highlighted."""
        app = make_app()
        async with app.run_test(size=(80, 24), message_hook=messages.append) as pilot:
            await settle(pilot)
            (loaded,) = of_type(messages, DoctorLoaded)
            table = app.screen.query_one(ModelTable)
            assert table.row_count == len(loaded.report.models)
            assert table.selected_ref == "4b" == app.selected_ref
            badges = {str(table.get_row(f.ref)[1]) for f in loaded.report.models}
            assert {"fits", "too big"} <= badges
            assert str(table.get_row("35b:bf16")[1]) == "too big"
            for fit in loaded.report.models:  # max context from the memory estimate, in K tokens
                assert table.get_row(fit.ref)[2] == format_context(fit.max_context)
            assert "Apple M4 Pro" in str(app.screen.query_one("#doctor").render())

    async def test_moving_the_cursor_changes_the_selected_model(self, make_app) -> None:
        async with make_app().run_test(size=(80, 24)) as pilot:
            await settle(pilot)
            await pilot.press("down")
            assert pilot.app.selected_ref == "4b:6bit"

    async def test_a_missing_doctor_is_said_not_faked(self, tmp_path) -> None:
        """Check that a doctor failure shows as text in the panel, with no rows invented."""

        class Broken(FakeServices):
            def doctor_report(self):
                raise ModuleNotFoundError("kapitsa.doctor")

        app = __import__("kapitsa.tui.app", fromlist=["KapitsaApp"]).KapitsaApp(Broken(tmp_path))
        async with app.run_test(size=(80, 24)) as pilot:
            await settle(pilot)
            assert "doctor unavailable" in str(app.screen.query_one("#doctor").render())
            assert app.screen.query_one(ModelTable).row_count == 0


class TestDownloads:
    async def test_progress_then_done_marks_the_row(self, make_app, messages) -> None:
        app = make_app()
        async with app.run_test(size=(80, 24), message_hook=messages.append) as pilot:
            await settle(pilot)
            await pilot.press("d")
            await settle(pilot)
            progress = of_type(messages, DownloadProgressed)
            assert progress[-1].bytes_done == progress[-1].bytes_total == 5000
            (finished,) = of_type(messages, DownloadFinished)
            assert finished.ref == "4b"
            assert app.screen.query_one(ModelTable).get_row("4b")[4] == "yes"
            await pilot.press("d")  # already there: no second download
            await settle(pilot)
            assert len(of_type(messages, DownloadFinished)) == 1

    async def test_cancel_stops_the_download(self, make_app, services, messages) -> None:
        services.download_steps, services.download_step_s = 200, 0.02
        app = make_app()
        async with app.run_test(size=(80, 24), message_hook=messages.append) as pilot:
            await settle(pilot)
            await pilot.press("d")
            await pilot.pause(0.1)
            await pilot.press("x")
            await settle(pilot)
            assert [m.ref for m in of_type(messages, DownloadCancelled)] == ["4b"]
            assert not of_type(messages, DownloadFinished)
            status = app.screen.query_one(DownloadsPanel).query_one(".dl-status")
            assert "cancelled" in str(status.render())
            assert app.screen.cancel_events == {}


class TestEngine:
    async def test_start_serves_on_loopback_and_stop_ends_it(self, make_app, messages) -> None:
        """Check that `s` starts a real server over the engine on 127.0.0.1, shows its endpoint, and `s` stops it."""
        app = make_app()
        async with app.run_test(size=(80, 24), message_hook=messages.append) as pilot:
            await settle(pilot)
            await pilot.press("s")
            await settle(pilot)
            (started,) = of_type(messages, EngineStarted)
            assert app.engine_status == "running" and started.handle.model == "4b"
            assert started.handle.url.startswith("http://127.0.0.1:")
            async with httpx.AsyncClient() as http:
                assert (await http.get(f"{started.handle.url}/health")).json()["status"] == "ok"
            assert f"{started.handle.url}/v1" in str(app.screen.query_one(EnginePanel).render())
            env_text = str(app.screen.query_one(EnvPanel).render())
            assert "OPENAI_BASE_URL" in env_text and f"{started.handle.url}/v1" in env_text
            assert "ANTHROPIC_BASE_URL" in env_text
            await pilot.press("c")
            assert (
                app.clipboard.startswith(f"{started.handle.url}/v1\n# kapitsa server at")
                and env_text in app.clipboard
            )
            await pilot.press("s")
            await settle(pilot)
            assert of_type(messages, EngineStopped) and app.engine_status == "stopped"
            assert app.engine_handle is None and not app.screen.query_one(EnvPanel).display

    async def test_start_failure_is_a_modal_not_a_crash(self, tmp_path, messages) -> None:
        def no_such_model(ref):
            raise ModelNotFound(f"unknown model {ref!r}")

        from kapitsa.tui.app import KapitsaApp

        app = KapitsaApp(FakeServices(tmp_path, engine_factory=no_such_model))
        async with app.run_test(size=(80, 24), message_hook=messages.append) as pilot:
            await settle(pilot)
            await pilot.press("s")
            await settle(pilot)
            assert of_type(messages, EngineFailed) and app.engine_status == "failed"
            assert isinstance(app.screen, ErrorModal) and "unknown model '4b'" in app.screen.message
            await pilot.press("enter")
            assert not isinstance(app.screen, ErrorModal)
            assert "unknown model" in str(app.screen.query_one(EnginePanel).render())

    async def test_the_real_services_say_what_is_missing(self, tmp_path) -> None:
        """Without an engine module, starting says so (no fake engine behind the user's back)."""
        from kapitsa.tui.services import Unavailable, needs

        try:
            with needs("the in-process engine"):
                import kapitsa.engine.not_a_module  # noqa: F401
        except Unavailable as err:
            assert "the in-process engine is not available" in str(err)
        else:
            raise AssertionError("expected Unavailable")
        assert isinstance(TuiServices(), TuiServices)


async def test_a_default_model_outside_the_catalog_gets_its_own_row(tmp_path) -> None:
    """Check that a folder set as the default model is listed, highlighted, and is what `s` starts."""
    from kapitsa.tui.app import KapitsaApp

    folder = tmp_path / "my-finetune"
    folder.mkdir()
    services = FakeServices(tmp_path)
    services.settings.default_model = str(folder)
    app = KapitsaApp(services)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        table = app.screen.query_one(ModelTable)
        assert table.selected_ref == str(folder) == app.selected_ref
        row = table.get_row(str(folder))
        assert (row[0], row[4], row[5]) == ("my-finetune", "yes", "your default model")
        await pilot.press("s")
        await settle(pilot)
        assert app.engine_handle is not None and app.engine_handle.model == str(folder)
