"""doctor on recorded hardware profiles and on this machine."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from kapitsa.catalog import load_catalog
from kapitsa.cli import app
from kapitsa.doctor import RECORDED_PROFILES, GiB, HardwareProfile, build_report, probe_hardware
from kapitsa.doctor_render import render_report


def _verdicts(profile_name: str) -> dict[str, str]:
    report = build_report(RECORDED_PROFILES[profile_name], load_catalog())
    return {fit.ref: fit.verdict for fit in report.models}


def test_16gb_m1_pro_runs_small_models_only() -> None:
    report = build_report(RECORDED_PROFILES["m1-pro-16gb"], load_catalog())
    verdicts = {f.ref: f.verdict for f in report.models}
    assert verdicts["4b"] == verdicts["9b"] == "fits"
    assert verdicts["27b"] == verdicts["35b"] == verdicts["flash-next"] == "too_big"
    assert report.recommended == "9b"
    assert report.warnings == ()


def _mac(total_gib: int) -> HardwareProfile:
    """A Mac whose Metal working set is 2/3 of its RAM, as recorded on 16 GB machines."""
    return replace(
        RECORDED_PROFILES["m1-pro-16gb"],
        total_memory_bytes=total_gib * GiB,
        usable_memory_bytes=total_gib * GiB * 2 // 3,
    )


def test_16gb_advice_is_a_9b_or_4b_qwen_and_no_moe_fits_even_with_small() -> None:
    report = build_report(_mac(16), load_catalog())
    fits = {f.ref: f for f in report.models}
    assert report.recommended == "9b" and fits["4b"].verdict == "fits"
    # Flint's routed experts alone are 11.8 GB at 2 bits: more than a 16 GB Mac's 10.7 GiB working set
    assert fits["flint:small"].verdict == "too_big" and fits["flint:small"].note.endswith("the rest 3-bit")
    assert report.also_small == ()


def test_24gb_advice_adds_flint_and_the_moes_whose_4bit_does_not_fit_with_small() -> None:
    report = build_report(_mac(24), load_catalog())
    fits = {f.ref: f for f in report.models}
    assert report.recommended == "9b"
    assert fits["flint"].verdict == fits["35b"].verdict == fits["lightning"].verdict == "too_big"
    assert fits["flint:small"].verdict == "fits" and fits["flint:small"].note.endswith("the rest 6-bit")
    assert fits["flint:small"].repo_id == "RecursiveSI/flint"  # quantized on load from the bf16 weights
    assert set(report.also_small) == {"flint:small", "35b:small", "lightning:small"}
    assert report.also_small[0] == "lightning:small"  # most capable first (catalog rank)
    assert "Fits only with :small (routed experts at 2 bits): lightning:small" in render_report(report)


def test_dense_models_get_no_small_row_and_a_moe_that_fits_at_4bit_is_not_advised_small() -> None:
    report = build_report(RECORDED_PROFILES["m4-pro-48gb"], load_catalog())
    refs = {f.ref for f in report.models}
    assert {"flint:small", "35b:small", "lightning:small"} <= refs
    assert not {"4b:small", "9b:small", "27b:small"} & refs
    assert "flint:small" not in report.also_small  # its 4-bit fits in 36 GiB


def test_48gb_m4_pro_runs_27b_but_not_80b() -> None:
    report = build_report(RECORDED_PROFILES["m4-pro-48gb"], load_catalog())
    verdicts = {f.ref: f.verdict for f in report.models}
    assert verdicts["27b"] == verdicts["35b"] == verdicts["lightning"] == "fits"
    assert verdicts["27b:bf16"] == verdicts["flash-next"] == "too_big"
    assert report.recommended in {"27b", "lightning"}


def test_128gb_m5_max_runs_everything_at_4bit() -> None:
    report = build_report(RECORDED_PROFILES["m5-max-128gb"], load_catalog())
    defaults = {f.ref: f for f in report.models if f.ref == f.alias and f.alias != "demo"}
    assert all(f.verdict == "fits" for f in defaults.values())
    assert defaults["flash-next"].max_context == 262144
    assert report.recommended == "super-vl"


def test_more_memory_never_means_less_context() -> None:
    small = build_report(RECORDED_PROFILES["m4-pro-48gb"], load_catalog())
    big = build_report(RECORDED_PROFILES["m5-max-128gb"], load_catalog())
    for a, b in zip(small.models, big.models, strict=True):
        assert (a.max_context or 0) <= (b.max_context or 0), a.ref


def test_warnings_for_old_macos_and_intel_macs() -> None:
    base = RECORDED_PROFILES["m4-pro-48gb"]
    old = build_report(replace(base, os_name="macOS 13.6", macos_version=(13, 6)), load_catalog())
    assert any("older than macOS 14" in w for w in old.warnings)
    intel = build_report(replace(base, machine="x86_64", is_apple_silicon=False), load_catalog())
    assert any("not Apple silicon" in w for w in intel.warnings)


def test_warning_when_the_disk_cannot_hold_any_model() -> None:
    full_disk = replace(RECORDED_PROFILES["m4-pro-48gb"], disk_free_bytes=10**9)
    assert any("free at" in w for w in build_report(full_disk, load_catalog()).warnings)


def test_doctor_on_this_machine_is_truthful() -> None:
    hw = probe_hardware()
    assert hw.total_memory_bytes > 0 and 0 < hw.usable_memory_bytes <= hw.total_memory_bytes
    assert hw.mlx_version is not None
    report = build_report(hw, load_catalog())
    text = render_report(report)
    assert hw.chip in text and "Recommended:" in text
    if hw.macos_version is None:
        assert hw.backend in ("cpu", "cuda") and any("not macOS" in w for w in report.warnings)
    json.dumps(report.to_json_dict())


def test_cli_doctor_json_and_text() -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["doctor", "--json"], catch_exceptions=False)
    assert result.exit_code == 0
    data = json.loads(result.output)
    assert {"hardware", "models", "recommended", "warnings"} <= set(data)
    assert {m["alias"] for m in data["models"]} >= {"4b", "27b", "bolt", "demo"}
    text = runner.invoke(app, ["doctor"], catch_exceptions=False)
    assert text.exit_code == 0 and "MAX CONTEXT" in text.output


@pytest.mark.parametrize("name", sorted(RECORDED_PROFILES))
def test_recorded_profiles_use_the_metal_working_set(name: str) -> None:
    hw = RECORDED_PROFILES[name]
    assert hw.backend == "metal" and hw.usable_memory_bytes < hw.total_memory_bytes


def test_no_big_model_recommended_on_a_cpu_only_machine() -> None:
    """A 128 GB Linux box with MLX on the CPU: 27B fits in RAM, but decodes far too slowly to recommend."""
    big_cpu = replace(
        RECORDED_PROFILES["m5-max-128gb"], backend="cpu", macos_version=None, os_name="Linux", gpu="cpu"
    )
    report = build_report(big_cpu, load_catalog())
    verdicts = {f.ref: f.verdict for f in report.models}
    assert verdicts["27b"] == "fits"  # the memory verdict itself is unchanged
    recommended = next(f for f in report.models if f.ref == report.recommended)
    assert recommended.weights_bytes is not None and recommended.weights_bytes <= 5 * 10**9
    assert build_report(RECORDED_PROFILES["m5-max-128gb"], load_catalog()).recommended != report.recommended


def test_the_demo_size_is_not_zero_gb() -> None:
    text = render_report(build_report(RECORDED_PROFILES["m1-pro-16gb"], load_catalog()))
    demo_line = next(line for line in text.splitlines() if line.lstrip().startswith("demo"))
    assert "0.0 GB" not in demo_line and " MB" in demo_line
