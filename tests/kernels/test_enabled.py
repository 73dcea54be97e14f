"""KernelOptions.families picks the kernel families the models use; None: the backend's defaults."""

from __future__ import annotations

import pytest

from kapitsa.engine.kernels import DEFAULT_FAMILIES, enabled
from kapitsa.engine.options import KernelOptions


@pytest.mark.parametrize(
    "families,family,expected",
    [
        (None, "gdn", True),
        (None, "moe", True),
        (None, "mamba", True),  # the CPU set mirrors CUDA's
        (None, "route", True),
        (None, "attn", True),
        (None, "fold", False),  # not a family
        ({"gdn", "moe", "qmv", "mamba", "route", "attn"}, "mamba", True),
        (set(), "gdn", False),
        ({"gdn", "mamba"}, "mamba", True),
        ({"gdn", "mamba"}, "moe", False),
    ],
)
def test_enabled(families, family, expected) -> None:
    options = KernelOptions(families=None if families is None else frozenset(families))
    assert enabled(family, options) is expected
    assert {"gdn", "moe", "qmv", "mamba", "route", "attn"} == DEFAULT_FAMILIES["cuda"]


def test_metal_uses_no_kernel_unless_asked(monkeypatch) -> None:
    """The Metal ports are unverified on Apple hardware: opt-in only."""
    import kapitsa.engine.kernels as kernels

    monkeypatch.setattr(kernels, "backend", lambda: "metal")
    assert not any(enabled(f, KernelOptions()) for f in ("gdn", "moe", "mamba", "qmv"))
    assert enabled("gdn", KernelOptions(families=frozenset({"gdn"})))
