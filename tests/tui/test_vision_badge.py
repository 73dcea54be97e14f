"""The model table says which models read images (the catalog's vision-language entries)."""

from __future__ import annotations

from tui_support import of_type, settle

from kapitsa.tui.messages import DoctorLoaded
from kapitsa.tui.widgets.model_table import COLUMNS, ModelTable

NAME = COLUMNS.index("name")


async def test_vision_models_are_marked_and_text_models_are_not(make_app, messages) -> None:
    app = make_app()
    async with app.run_test(size=(160, 48), message_hook=messages.append) as pilot:
        await settle(pilot)
        (loaded,) = of_type(messages, DoctorLoaded)
        table = app.screen.query_one(ModelTable)
        names = {fit.ref: str(table.get_row(fit.ref)[NAME]) for fit in loaded.report.models}
    assert names["super-vl"].endswith("· images") and names["27b"].endswith("· images")
    assert "images" not in names["flash-next"] and "images" not in names["lightning"]
    assert names["flash-next"] == next(f.name for f in loaded.report.models if f.ref == "flash-next")
