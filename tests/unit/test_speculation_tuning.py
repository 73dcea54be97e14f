"""`kapitsa bench --tune-speculation`: each draft shape timed on one load, the fastest kept per
model and backend, and read back by the opener when no --tree / --draft-tokens is given."""

from __future__ import annotations

import contextlib
import json
import stat
from pathlib import Path

import pytest

from kapitsa.engine.speculative.tuning import CANDIDATES, DraftShape, Tuning, read_tuning, write_tuning
from kapitsa.opener import open_engine
from kapitsa.settings import load_settings
from kapitsa.speculation_tuner import tune_speculation
from kapitsa.testing import tiny


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny-qwen3_5", "qwen3_5")


@pytest.fixture
def settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    monkeypatch.setenv("KAPITSA_CONFIG", str(tmp_path / "no-config.toml"))
    monkeypatch.setenv("KAPITSA_STATE_DIR", str(tmp_path / "state"))
    return load_settings()


def test_the_tuning_file_keeps_every_model_and_is_private(tmp_path: Path) -> None:
    path = tmp_path / "state" / "speculation-tuning.json"
    measured = {DraftShape(False, 3): 10.0, DraftShape(True, 7): 12.5}
    write_tuning(path, "a@cpu", Tuning(DraftShape(True, 7), True), measured, plain_tok_s=9.0)
    write_tuning(path, "b@cuda", Tuning(DraftShape(False, 3), False), measured, plain_tok_s=20.0)
    assert read_tuning(path, "a@cpu") == Tuning(DraftShape(True, 7), True)
    assert read_tuning(path, "b@cuda") == Tuning(DraftShape(False, 3), False)
    assert read_tuning(path, "c@cpu") is None
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert json.loads(path.read_text())["a@cpu"]["decode_tok_s"] == {
        "plain": 9.0,
        "chain 3": 10.0,
        "tree 7": 12.5,
    }


@pytest.mark.parametrize(
    "text", ["not json", "[]", '{"a@cpu": {"tree": true}}', '{"a@cpu": {"tree": false, "draft_tokens": 0}}']
)
def test_a_broken_tuning_file_means_untuned(tmp_path: Path, text: str) -> None:
    path = tmp_path / "t.json"
    path.write_text(text)
    assert read_tuning(path, "a@cpu") is None


def test_tuning_times_every_shape_and_the_opener_reads_what_it_kept(tiny_qwen: Path, settings) -> None:  # noqa: ANN001
    seen: list[str] = []
    result = tune_speculation(
        str(tiny_qwen), tokens=24, settings=settings, on_result=lambda label, _: seen.append(label)
    )
    assert seen == ["plain", *(s.label for s in CANDIDATES)]
    assert result.best_label == max(result.tok_s, key=result.tok_s.get)
    assert result.pays == (result.tok_s[result.best_label] > result.plain_tok_s)
    kept = read_tuning(result.path, result.key)
    assert kept is not None and kept.shape.label == result.best_label

    with contextlib.closing(open_engine(str(tiny_qwen), settings=settings)) as engine:
        strategy = engine.engine.decode_strategy
        if kept.pays:
            assert (strategy.tree, strategy.max_draft) == (kept.shape.tree, kept.shape.draft_tokens)
        else:
            assert engine.stats().speculative == "none"
    # flags win over the tuning
    with contextlib.closing(
        open_engine(str(tiny_qwen), settings=settings, tree=False, draft_tokens=2)
    ) as engine:
        strategy = engine.engine.decode_strategy
        assert (strategy.tree, strategy.max_draft) == (False, 2)


def test_a_slower_than_plain_tuning_turns_auto_off_but_not_a_named_mode(tiny_qwen: Path, settings) -> None:  # noqa: ANN001
    from kapitsa.engine.loading.loader import load_model
    from kapitsa.opener import tuning_key_for, tuning_path

    key = tuning_key_for(load_model(str(tiny_qwen)))
    write_tuning(tuning_path(settings), key, Tuning(DraftShape(True, 11), False), {}, plain_tok_s=1.0)
    with contextlib.closing(open_engine(str(tiny_qwen), settings=settings)) as engine:
        assert engine.stats().speculative == "none"
    with contextlib.closing(open_engine(str(tiny_qwen), settings=settings, speculative="ngram")) as engine:
        strategy = engine.engine.decode_strategy
        assert engine.stats().speculative == "ngram" and (strategy.tree, strategy.max_draft) == (True, 11)
