"""`--kv-bits`: refused before anything loads when wrong, reaches the engine's caches when right,
and "auto" is doctor's fit (bf16 while a comfortable context fits, else the fewest bits that do)."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kapitsa import memory_estimate
from kapitsa.catalog import load_catalog
from kapitsa.cli import app
from kapitsa.errors import InvalidRequest
from kapitsa.kv_fit import parse_kv_bits
from kapitsa.opener import open_engine
from kapitsa.testing import tiny

GIB = 1 << 30


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny-qwen3_5", "qwen3_5")


@pytest.fixture
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KAPITSA_CONFIG", str(tmp_path / "no-config.toml"))
    monkeypatch.setenv("KAPITSA_STATE_DIR", str(tmp_path / "state"))
    return tmp_path / "state"


def test_flag_values() -> None:
    assert [parse_kv_bits(v) for v in (None, "8", "4", "auto", "off", 8)] == [None, 8, 4, "auto", None, 8]
    with pytest.raises(InvalidRequest, match="--kv-bits 6"):
        parse_kv_bits("6")


def test_a_bad_flag_fails_before_loading(state_dir: Path) -> None:
    result = CliRunner().invoke(app, ["run", "--model", "/nonexistent", "--kv-bits", "3", "hi"])
    assert result.exit_code != 0 and "--kv-bits 3" in str(result.exception or result.output)


@pytest.mark.parametrize(("flag", "bits"), [("8", 8), ("4", 4), ("auto", None)])
def test_the_engine_gets_the_bits(tiny_qwen: Path, state_dir: Path, flag: str, bits: int | None) -> None:
    from kapitsa.engine.cache.quantized_kv import QuantizedKVCache

    with contextlib.closing(open_engine(str(tiny_qwen), speculative="none", kv_bits=flag)) as engine:
        assert engine.engine.config.kv_bits == bits  # auto: the tiny model fits a long context in bf16
        layers = engine.engine.runner.new_cache().layers
        assert any(isinstance(c, QuantizedKVCache) for c in layers) == (bits is not None)


def test_doctor_fit_picks_the_fewest_bits_that_keep_a_comfortable_context() -> None:
    arch = next(e.arch for e in load_catalog() if e.alias == "27b")
    dense = dataclasses.replace(arch, attention_layers=64)  # all-attention: K/V is what grows
    weights = memory_estimate.weights_bytes(dense, 4.5)
    picks = [
        memory_estimate.choose_kv_bits(dense, usable_bytes=weights + extra * GIB, weight_bytes=weights)
        for extra in (80, 15, 10, 1)
    ]
    assert picks == [None, 8, 4, None]
    for bits, ratio in ((8, 0.53), (4, 0.28)):  # bf16 scales and biases per group of 64
        per_token = memory_estimate.kv_bytes_per_token(dense, kv_bits=bits)
        assert per_token / memory_estimate.kv_bytes_per_token(dense) == pytest.approx(ratio, abs=0.005)
