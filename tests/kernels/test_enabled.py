"""KAPITSA_KERNELS picks the kernel families the models use."""

from __future__ import annotations

import pytest

from kapitsa.engine.kernels import DEFAULT_FAMILIES, enabled


@pytest.mark.parametrize(
    "value,family,expected",
    [
        (None, "gdn", True),
        (None, "moe", True),
        (None, "mamba", True),  # on since session 6 (the CPU set mirrors CUDA's)
        (None, "route", True),  # on since session 7
        (None, "attn", True),  # on since session 8
        (None, "fold", False),  # not a family
        ("all", "mamba", True),
        ("none", "gdn", False),
        ("gdn, mamba", "mamba", True),
        ("gdn,mamba", "moe", False),
    ],
)
def test_enabled(monkeypatch, value, family, expected) -> None:
    if value is None:
        monkeypatch.delenv("KAPITSA_KERNELS", raising=False)
    else:
        monkeypatch.setenv("KAPITSA_KERNELS", value)
    assert enabled(family) is expected
    assert {"gdn", "moe", "qmv", "mamba", "route", "attn"} == DEFAULT_FAMILIES["cuda"]


def test_metal_uses_no_kernel_unless_asked(monkeypatch) -> None:
    """The Metal ports are unverified on Apple hardware: opt-in only."""
    import kapitsa.engine.kernels as kernels

    monkeypatch.setattr(kernels, "backend", lambda: "metal")
    monkeypatch.delenv("KAPITSA_KERNELS", raising=False)
    assert not any(enabled(f) for f in ("gdn", "moe", "mamba", "qmv"))
    monkeypatch.setenv("KAPITSA_KERNELS", "all")
    assert enabled("gdn")
