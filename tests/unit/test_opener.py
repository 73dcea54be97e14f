"""The one opener: every surface's engine gets the disk tier in the state folder, the kernel options
the environment names and the speculation its flags ask for, and refuses bad flags before loading."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import pytest

from kapitsa.commands.run import RunOptions, cmd_run
from kapitsa.errors import InvalidRequest, KapitsaError
from kapitsa.opener import check_speculation, open_engine
from kapitsa.settings import load_settings
from kapitsa.testing import tiny


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny-qwen3_5", "qwen3_5")


@pytest.fixture
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KAPITSA_CONFIG", str(tmp_path / "no-config.toml"))
    monkeypatch.setenv("KAPITSA_STATE_DIR", str(tmp_path / "state"))
    return tmp_path / "state"


def test_the_engine_has_the_disk_tier_kernels_and_speculation(
    tiny_qwen: Path, state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KAPITSA_SSD_CHUNK", "64")
    with contextlib.closing(open_engine(str(tiny_qwen), speculative="ngram")) as engine:
        config = engine.engine.config
        assert config.disk_cache_dir == state_dir / "prefix-cache"
        assert config.kernels.ssd_chunk == 64
        assert engine.stats().speculative == "ngram"


def test_only_an_engine_asked_to_warms_its_batch_sizes(tiny_qwen: Path, state_dir: Path) -> None:
    """`warm_batches=True` (serve) leaves the sizes to the device (every size on a GPU); a plain
    open (run, the TUI: one user, no batches) warms none."""
    with contextlib.closing(open_engine(str(tiny_qwen), speculative="none", warm_batches=True)) as engine:
        assert engine.engine.config.warm_batches is None
    with contextlib.closing(open_engine(str(tiny_qwen), speculative="none")) as engine:
        assert engine.engine.config.warm_batches == () and engine.stats().warm_batches_pending == 0


def test_every_surface_speculates_by_default(tiny_qwen: Path, state_dir: Path) -> None:
    """No flag: `auto`, which drafts by n-gram lookup on a checkpoint without a drafter or MTP head
    (serve's settings, run's options and the TUI's plain `open_engine(ref)` all land here)."""
    from kapitsa.commands.serve import make_settings

    assert make_settings(model=None, host=None, port=None, speculative=None).speculative == "auto"
    assert RunOptions(model=None, prompt_arg="x").speculative is None  # cmd_run resolves it to auto
    with contextlib.closing(open_engine(str(tiny_qwen))) as engine:
        assert engine.stats().speculative == "ngram"


def test_a_second_run_reads_the_first_runs_prompt_from_disk(tiny_qwen: Path, state_dir: Path) -> None:
    prompt = "the same long prompt, word after word, " * 12
    options = RunOptions(model=str(tiny_qwen), prompt_arg=prompt, max_tokens=2, json_out=True)
    first = cmd_run(options, write=lambda _text: None)
    second = cmd_run(options, write=lambda _text: None)
    assert first.cached_tokens == 0 and second.cached_tokens > first.prompt_tokens // 2
    assert any((state_dir / "prefix-cache").rglob("*"))


def test_bad_kernel_variables_are_refused_before_loading(
    monkeypatch: pytest.MonkeyPatch, state_dir: Path
) -> None:
    monkeypatch.setenv("KAPITSA_SSD_CHUNK", "many")
    with pytest.raises(InvalidRequest, match="KAPITSA_SSD_CHUNK"):
        open_engine("/nonexistent")


@pytest.mark.parametrize(("mode", "message"), [("block", "needs --draft"), ("warp", "unknown speculative")])
def test_speculation_that_cannot_be_set_up_is_refused(mode: str, message: str) -> None:
    with pytest.raises(KapitsaError, match=message):
        check_speculation(mode, None)
    with pytest.raises(KapitsaError, match=message):
        open_engine("/nonexistent", speculative=mode, settings=load_settings())


@pytest.mark.parametrize(("usable_gib", "quantization"), [(64, "small-2/6"), (1, "small-2/3")])
def test_small_takes_its_widths_from_doctors_budget(
    tmp_path: Path, state_dir: Path, monkeypatch: pytest.MonkeyPatch, usable_gib: int, quantization: str
) -> None:
    from kapitsa import doctor
    from kapitsa.opener import load_for_ref
    from kapitsa.testing.tiny_flint import write_tiny_flint

    machine = dataclasses.replace(
        doctor.RECORDED_PROFILES["m1-pro-16gb"], usable_memory_bytes=usable_gib << 30
    )
    monkeypatch.setattr(doctor, "probe_hardware", lambda *a, **k: machine)
    loaded = load_for_ref(f"{write_tiny_flint(tmp_path / 'flint')}:small")
    assert loaded.info.quantization == quantization


def test_a_catalog_alias_with_small_loads_its_bf16_repo_with_the_recipe(
    state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kapitsa import doctor
    from kapitsa.engine.loading import loader
    from kapitsa.opener import load_for_ref

    machine = dataclasses.replace(doctor.RECORDED_PROFILES["m1-pro-16gb"], usable_memory_bytes=24 << 30)
    monkeypatch.setattr(doctor, "probe_hardware", lambda *a, **k: machine)
    calls = []
    monkeypatch.setattr(loader, "load_model", lambda spec, **kw: calls.append((spec, kw)) or "loaded")
    assert load_for_ref("flint:small") == "loaded"
    assert calls == [
        ("RecursiveSI/flint", {"model_id": "flint:small", "quantize": "small", "memory_budget": 24 << 30})
    ]


def test_cuda_keeps_mlx_jit_cache_in_the_state_folder(tmp_path: Path, monkeypatch) -> None:
    import mlx.core as mx

    from kapitsa.opener import keep_jit_cache

    environ: dict[str, str] = {}
    monkeypatch.setattr(mx.cuda, "is_available", lambda: False)
    assert keep_jit_cache(tmp_path, environ) is None and environ == {}  # Metal and the CPU: unchanged

    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    info = {"architecture": "sm_90", "device_name": "NVIDIA H200"}
    monkeypatch.setattr(mx, "device_info", lambda: info, raising=False)
    folder = keep_jit_cache(tmp_path, environ)
    assert folder == tmp_path / "jit-cache" / f"mlx-{mx.__version__}" / "sm_90" and folder.is_dir()
    assert environ == {"MLX_PTX_CACHE_DIR": str(folder)}

    mine = {"MLX_PTX_CACHE_DIR": "/elsewhere"}
    assert keep_jit_cache(tmp_path, mine) is None and mine == {"MLX_PTX_CACHE_DIR": "/elsewhere"}

    (tmp_path / "blocked").write_text("a file where the folder would go")
    assert keep_jit_cache(tmp_path / "blocked", {}) is None


def test_draft_takes_a_catalog_alias(state_dir: Path) -> None:
    with contextlib.closing(open_engine("demo", speculative="draft", draft="demo")) as engine:
        assert engine.stats().speculative == "draft"


def test_draft_alias_and_folder_resolve_to_what_the_loader_reads(tiny_qwen: Path, state_dir: Path) -> None:
    from kapitsa.opener import draft_source

    settings = load_settings()
    assert Path(draft_source("demo", settings)).is_dir()  # the embedded demo's folder
    assert draft_source(str(tiny_qwen), settings) == str(tiny_qwen)
    assert draft_source(None, settings) is None
