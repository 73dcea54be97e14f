"""The disk tier on the real tiny engine: a corrupt checkpoint is never served, a kill -9 during
checkpoint writes leaves no corrupt file, and a restarted engine resumes at the last turn boundary
on both families (with their own chat templates, which re-render a reply differently)."""

from __future__ import annotations

import json
import random
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from test_prefix_reuse import SYSTEM, chat

from kapitsa.engine.cache.file import TMP_PREFIX, read_prefix_file
from kapitsa.engine.inprocess import InProcessEngine
from kapitsa.engine.loading.loader import load_model
from kapitsa.engine.options import EngineConfig
from kapitsa.testing.tiny import write_tiny_checkpoint

CHILD = Path(__file__).with_name("disk_crash_child.py")
KILLS = 20


def _scramble_kv(path: Path) -> None:
    """Plausible but wrong floats in every KV array; the header (and so its layout) stays as it was."""
    raw = bytearray(path.read_bytes())
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + size])
    rng = np.random.default_rng(0)
    for name, info in header.items():
        if name.startswith("kv.") and info["dtype"] == "F32":
            begin, end = (8 + size + o for o in info["data_offsets"])
            raw[begin:end] = rng.standard_normal((end - begin) // 4).astype(np.float32).tobytes()
    path.write_bytes(bytes(raw))


async def test_corrupt_checkpoint_is_deleted_counted_and_recomputed(
    family_model, make_client, tmp_path
) -> None:
    first = make_client(family_model, disk_cache_dir=tmp_path, model_key="k")
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]
    text, _, _ = await chat(first, messages)
    first.close()
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "more"}]
    files = sorted(tmp_path.rglob("*.safetensors"))
    assert files, "the first engine wrote no checkpoint to damage"
    for path in files:
        _scramble_kv(path)
    cold_ids = (await chat(make_client(family_model, prefix_cache_bytes=0), messages, 16))[1]
    damaged = make_client(family_model, disk_cache_dir=tmp_path, model_key="k", disk_write_delay_s=600.0)
    _, ids, finish = await chat(damaged, messages, 16)
    assert ids == cold_ids and finish.usage.cached_tokens == 0
    assert not any(path.exists() for path in files)
    assert damaged.stats().corrupt_checkpoints_deleted == len(files)


def _tiny_engine(folder: Path, kind: str, cache: Path):
    loaded = load_model(write_tiny_checkpoint(folder, kind))
    config = EngineConfig(prefill_chunk=64, disk_cache_dir=cache, disk_write_delay_s=0.2)
    return loaded, config


def _has_turn_on_disk(cache: Path, pos: int) -> bool:
    for path in cache.rglob("*.safetensors"):
        if path.name.startswith(TMP_PREFIX):
            continue  # a write in progress: a restart's scan skips it too
        try:
            header = path.read_bytes()[8 : 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]]
            meta = json.loads(header)["__metadata__"]
        except (OSError, ValueError, KeyError):
            continue  # a temporary file renamed meanwhile
        if meta["kind"] == "turn" and int(meta["pos"]) >= pos:
            return True
    return False


@pytest.mark.parametrize("stop", ["close", "crash"])
@pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h"])
async def test_restart_resumes_at_the_last_turn(kind, stop, tmp_path) -> None:
    loaded, config = _tiny_engine(tmp_path / "ckpt", kind, tmp_path / "cache")
    first = InProcessEngine.from_loaded(loaded, config=config)
    messages = [{"role": "system", "content": "You are a coding agent."}]
    for turn in range(3):  # turns long next to the system prompt: resuming there would not be enough
        messages.append(
            {"role": "user", "content": f"Step {turn}: " + "read the file, then summarise it. " * 6}
        )
        text, _, finish = await chat(first, messages)
        messages.append({"role": "assistant", "content": text})
    last_prompt = finish.usage.prompt_tokens
    if stop == "close":
        first.close()
    else:  # no flush: only what the background writer put on disk within seconds survives
        deadline = time.monotonic() + 5.0
        while not _has_turn_on_disk(tmp_path / "cache", int(0.9 * last_prompt)):
            if time.monotonic() > deadline:
                pytest.fail("the background writer put no checkpoint of the last turn on disk in 5 s")
            time.sleep(0.05)
    restarted = InProcessEngine.from_loaded(loaded, config=config)
    try:
        messages.append({"role": "user", "content": "Next."})
        _, _, finish = await chat(restarted, messages)
        assert finish.usage.cached_tokens >= 0.9 * last_prompt, (finish.usage.cached_tokens, last_prompt)
    finally:
        restarted.close()
        first.close()


def _start_child(folder: Path, run: int, kind: str) -> tuple[subprocess.Popen, dict]:
    child = subprocess.Popen(
        [sys.executable, str(CHILD), str(folder), str(run), kind],
        stdout=subprocess.PIPE,
        text=True,
        cwd=CHILD.parent,
    )
    line = child.stdout.readline()  # type: ignore[union-attr]
    assert line, f"the child of run {run} exited with {child.wait()}"
    return child, json.loads(line)


def _tmp_files(folder: Path) -> set[Path]:
    return set(folder.glob("*/tmp-*"))


def _kill_mid_write(child: subprocess.Popen, folder: Path, earlier: set[Path], rng: random.Random) -> bool:
    """kill -9 at a random moment once this run's first temporary file exists; whether one was left.
    Earlier runs' torn files stay (a restart keeps recent ones: they may be another process's live
    write), so only names not in `earlier` count."""
    time.sleep(rng.uniform(0.05, 0.4))
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline and not _tmp_files(folder) - earlier:
        time.sleep(0.001)
    child.kill()
    child.wait()
    return bool(_tmp_files(folder) - earlier)


def _assert_every_file_intact(folder: Path) -> None:
    for path in folder.glob("*/*.safetensors"):
        if not path.name.startswith("tmp-"):
            read_prefix_file(path)  # raises on any checksum or layout mismatch


def test_kill_during_checkpoint_writes_never_leaves_a_corrupt_file(tmp_path) -> None:
    rng = random.Random(0)
    reference: dict[str, list[int]] = {}
    torn_writes = served_from_disk = 0
    for run in range(KILLS):
        kind = ("qwen3_5", "nemotron_h")[run % 2]
        folder = tmp_path / kind
        earlier = _tmp_files(folder)
        child, report = _start_child(folder, run, kind)
        torn_writes += _kill_mid_write(child, folder, earlier, rng)
        reference.setdefault(kind, report["probe"])  # each family's first run starts from nothing
        assert report["probe"] == reference[kind], f"run {run}: greedy output changed after a kill"
        assert report["corrupt"] == 0, f"run {run} met a corrupt checkpoint"
        served_from_disk += report["cached"] > 0
        _assert_every_file_intact(folder)
    for kind in reference:  # the last kill of each family is followed by a restart too
        child, report = _start_child(tmp_path / kind, KILLS, kind)
        child.kill()
        child.wait()
        assert report["probe"] == reference[kind] and report["corrupt"] == 0
    assert torn_writes >= KILLS // 2, "the kills did not land during checkpoint writes"
    assert served_from_disk >= KILLS // 2
