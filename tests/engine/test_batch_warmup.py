"""The idle engine warms its decode batch sizes (runner/warmup.py): a later burst of those sizes
traces nothing new, writes what an unwarmed engine writes, and the warm-up never blocks, fails or
overfills the engine."""

from __future__ import annotations

import asyncio
import time

import mlx.core as mx
import pytest
from engine_standins import tiny_model

from kapitsa.engine.models.base import CHAIN_MAX_T
from kapitsa.engine.options import EngineConfig
from kapitsa.engine.runner import warmup
from kapitsa.engine.runner.model_runner import ModelRunner
from kapitsa.engine.runner.warmup import default_warm_batches
from kapitsa.engine.types import GenerationRequest, SamplingParams, TokenEvent

FAMILIES = ("qwen3_5", "nemotron_h")
# longer than the compiled short-chain limit (models/base.py CHAIN_MAX_T): prefill runs op by op
PROMPTS = [f"stream {i} asks a question long enough to pass sixteen tokens" for i in range(4)]


def _count_traces(monkeypatch) -> list[int]:
    """Counts every trace of a function `mx.compile` wraps from now on (a call served from MLX's
    trace cache does not run the Python function)."""
    traced = [0]
    real = mx.compile

    def counting(fn, *args, **kwargs):
        def traced_fn(*a):
            traced[0] += 1
            return fn(*a)

        return real(traced_fn, *args, **kwargs)

    monkeypatch.setattr(mx, "compile", counting)
    return traced


async def _until_warm(client) -> None:
    for _ in range(1000):
        if client.stats().warm_batches_pending == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the warm-up did not finish")


async def _burst(client) -> list[list[int]]:
    async def one(prompt: str) -> list[int]:
        request = GenerationRequest(prompt=prompt, sampling=SamplingParams(max_tokens=6, ignore_eos=True))
        ids: list[int] = []
        async for event in client.generate(request):
            if isinstance(event, TokenEvent):
                ids.extend(event.token_ids)
        return ids

    return list(await asyncio.gather(*(one(p) for p in PROMPTS)))


@pytest.mark.parametrize("kind", FAMILIES)
async def test_a_warmed_burst_traces_nothing_new(kind, make_client, monkeypatch) -> None:
    traced = _count_traces(monkeypatch)
    cold = make_client(tiny_model(kind), max_running=4, warm_batches=())
    await _until_warm(cold)
    before = traced[0]
    cold_ids = await _burst(cold)
    assert traced[0] > before  # the control: an unwarmed engine traces its batch sizes in the burst

    warm = make_client(tiny_model(kind), max_running=4, warm_batches=(1, 2, 3, 4))
    await _until_warm(warm)
    assert warm.stats().warmup_seconds > 0
    before = traced[0]
    assert await _burst(warm) == cold_ids
    assert traced[0] == before


async def test_a_request_during_the_warm_up_waits_for_one_step_only(
    qwen_model, make_client, monkeypatch
) -> None:
    """Each size's step takes 0.5 s here; a request arriving meanwhile is served after the step
    in progress, long before the 4 s of warm-up are over, which resumes afterwards."""

    def slow_step(runner, rows, bases, busy) -> bool:
        time.sleep(0.5)
        return True

    monkeypatch.setattr(warmup, "warm_decode_step", slow_step)
    monkeypatch.setattr(warmup.BatchWarmup, "_base_caches", lambda self, runner: [])
    client = make_client(qwen_model, max_running=8, warm_batches=tuple(range(1, 9)))
    request = GenerationRequest(prompt=PROMPTS[0], sampling=SamplingParams(max_tokens=4, ignore_eos=True))
    started = time.perf_counter()
    events = [event async for event in client.generate(request)]
    assert time.perf_counter() - started < 2.5
    assert sum(len(e.token_ids) for e in events if isinstance(e, TokenEvent)) == 4
    assert client.stats().warm_batches_pending > 0
    await _until_warm(client)


def test_arriving_work_interrupts_a_size_which_is_warmed_later() -> None:
    """`busy()` between the throwaway steps: the size stays pending and the next idle turn redoes it."""
    runner = ModelRunner(tiny_model("qwen3_5"))
    asked = [0]

    # asked once per run_one, once per size built ahead (on the first turn) and once per layout:
    # work arrives just before the 3-row size's second layout (equal lengths), the 11th question
    def busy() -> bool:
        asked[0] += 1
        return asked[0] == 11

    warm = warmup.BatchWarmup((1, 2, 3), busy=busy)
    assert warm.run_one(runner) and warm.run_one(runner)  # 1 row; 2 rows (both layouts)
    assert warm.pending == [3]
    assert warm.run_one(runner) and warm.pending == [3]  # the first layout ran; then busy
    assert warm.run_one(runner) and warm.pending == []
    assert not warm.run_one(runner)


async def test_a_failing_warm_up_is_skipped_and_the_engine_serves(
    qwen_model, make_client, monkeypatch
) -> None:
    def broken(runner, rows, bases, busy):
        raise RuntimeError("no kernel for this size")

    monkeypatch.setattr(warmup, "warm_decode_step", broken)
    client = make_client(qwen_model, max_running=4, warm_batches=(1, 2, 3, 4))
    await _until_warm(client)
    assert client.stats().warmup_seconds == 0 and client.engine.alive
    ids = await _burst(client)
    assert all(len(i) == 6 for i in ids)


async def test_sizes_whose_state_does_not_fit_are_not_warmed(qwen_model, make_client, monkeypatch) -> None:
    warmed: list[int] = []
    monkeypatch.setattr(
        warmup, "warm_decode_step", lambda runner, rows, bases, busy: warmed.append(rows) or True
    )
    monkeypatch.setattr(warmup.BatchWarmup, "_base_caches", lambda self, runner: [])
    client = make_client(qwen_model, max_running=8, warm_batches=(1, 2, 8))
    budget = client.engine.memory
    room = budget.available_bytes - budget.reserved_bytes
    await _until_warm(client)
    assert warmed == [1, 2, 8]  # the control: all fit
    per_row = budget.sequence_bytes(warmup.KV_STEP)
    held = room - (2 + warmup.WARM_LENGTHS) * per_row  # room for 2 rows beside the base caches
    tight = warmup.BatchWarmup((1, 2, 8), budget, prefix=None)
    budget.reserve(held)
    try:
        warmed.clear()
        while tight.run_one(client.engine.runner):
            pass
    finally:
        budget.release(held)
    assert warmed == [1, 2] and tight.pending == []


def test_default_sizes_are_every_batch_on_a_gpu_and_none_on_the_cpu() -> None:
    assert default_warm_batches(8, on_gpu=True) == (1, 2, 3, 4, 5, 6, 7, 8)
    assert default_warm_batches(8, on_gpu=False) == ()
    assert EngineConfig().warm_batches == ()  # none unless asked: a one-user engine forms no batches


@pytest.mark.parametrize("sizes", [(0,), (9,), (1, 16)])
def test_warm_sizes_outside_the_batch_are_refused(sizes) -> None:
    with pytest.raises(ValueError, match="warm_batches"):
        EngineConfig(max_running=8, warm_batches=sizes)


def test_default_prefill_lengths_are_the_exact_and_padded_lengths_on_cuda_and_none_elsewhere() -> None:
    short = tuple(range(1, CHAIN_MAX_T + 1))  # run at their own token count
    assert warmup.default_warm_prefill(512, on_cuda=True) == (*short, 31, 63, 127, 255, 511, 512)
    assert warmup.default_warm_prefill(100, on_cuda=True) == (*short, 31, 63, 100)
    assert warmup.default_warm_prefill(8, on_cuda=True) == tuple(range(1, 9))
    assert warmup.default_warm_prefill(512, on_cuda=False) == ()
    assert EngineConfig().warm_prefill == ()


def _prompt_with_a_short_remainder(runner: ModelRunner) -> None:
    """A 40-token prompt in a 31-token chunk and a continued 9-token one (the compiled short-chain
    step: the remainder after a prefix-cache hit, a chat's short next turn)."""
    cache = runner.new_cache()
    runner.prefill(cache, list(range(5, 36)))
    mx.eval(runner.prefill(cache, list(range(36, 45)), start=31))


@pytest.mark.parametrize("kind", FAMILIES)
def test_a_warmed_short_chunk_traces_nothing_new(kind, monkeypatch) -> None:
    traced = _count_traces(monkeypatch)
    _prompt_with_a_short_remainder(ModelRunner(tiny_model(kind)))
    assert traced[0] > 0  # the control: the continued short chunk traces its step

    runner = ModelRunner(tiny_model(kind))
    warm = warmup.BatchWarmup((), prefill_lengths=(9,))
    while warm.run_one(runner):
        pass
    before = traced[0]
    _prompt_with_a_short_remainder(runner)
    assert traced[0] == before


@pytest.mark.parametrize("lengths", [(0,), (65,)])
def test_prefill_lengths_past_the_chunk_are_refused(lengths) -> None:
    with pytest.raises(ValueError, match="warm_prefill"):
        EngineConfig(prefill_chunk=64, warm_prefill=lengths)


async def test_the_idle_engine_prefills_each_length_fresh_and_continued(
    qwen_model, make_client, monkeypatch
) -> None:
    """The throwaway chunks run after the decode sizes, each from an empty cache and after a first
    chunk; the requests after them write what an engine without the warm-up writes."""
    real, seen = ModelRunner.prefill_at, []

    def spy(self, cache, tokens, ends, **kwargs):
        seen.append((kwargs.get("start", 0), len(tokens)))
        return real(self, cache, tokens, ends, **kwargs)

    plain = make_client(qwen_model, max_running=4)
    expected = await _burst(plain)
    monkeypatch.setattr(ModelRunner, "prefill_at", spy)
    client = make_client(qwen_model, max_running=4, warm_batches=(1, 2), warm_prefill=(31, 64))
    assert client.stats().warm_batches_pending == 6  # 2 sizes, 2 lengths x (fresh, continued)
    await _until_warm(client)
    first = warmup.FIRST_CHUNK
    assert seen == [(0, 31), (0, first), (first, 31), (0, 64), (0, first), (first, 64)]
    assert await _burst(client) == expected


def test_every_prefill_chunk_is_built_before_the_first_runs(monkeypatch) -> None:
    """Building a chunk hands its kernels to the compile workers (on CUDA): all of them are built
    before the first throwaway chunk runs, so the lengths compile side by side, and the chunks
    wait for those compiles before they run."""
    from tests.models.builders import build_ours

    runner = ModelRunner.for_config(build_ours("qwen3_5_dense"), EngineConfig())
    calls: list[tuple[str, int]] = []
    real_build, real_prefill = ModelRunner.build_prefill, ModelRunner.prefill
    monkeypatch.setattr(
        ModelRunner,
        "build_prefill",
        lambda self, cache, tokens: calls.append(("build", len(tokens))) or real_build(self, cache, tokens),
    )
    monkeypatch.setattr(
        ModelRunner,
        "prefill",
        lambda self, cache, tokens, **kw: (
            calls.append(("run", len(tokens))) or real_prefill(self, cache, tokens, **kw)
        ),
    )
    compiling = [True]  # the first idle turn finds the built chunks' kernels still compiling
    monkeypatch.setattr(
        warmup.cuda_disk_cache, "compiles_running", lambda wait_s=0.0: compiling.pop() if compiling else False
    )
    warm = warmup.BatchWarmup((), prefill_lengths=(31, 64))
    assert warm.run_one(runner) and calls == [
        ("build", 31),
        ("build", warmup.FIRST_CHUNK),
        ("build", 31),
        ("build", 64),
        ("build", warmup.FIRST_CHUNK),
        ("build", 64),
    ]
    while warm.run_one(runner):
        pass
    first = warmup.FIRST_CHUNK
    assert [c for c in calls if c[0] == "run"] == [("run", n) for n in (31, first, 31, 64, first, 64)]
    assert warm.prefill_pending == [] and ("build", 31) not in calls[6:]


@pytest.mark.parametrize("family", ["qwen3_5_dense", "qwen3_5_moe", "nemotron_moe"])
def test_a_long_chunk_is_built_without_running_any_of_it(monkeypatch, family) -> None:
    """On a GPU a chunk of 256 rows or more sends its layers to the device one by one as it builds
    them (models/base.py LAYER_QUEUE_ROWS); a chunk built only for its kernels evaluates nothing."""
    from kapitsa.engine.models import base
    from kapitsa.engine.ops import device_queue
    from tests.models.builders import build_ours

    runner = ModelRunner.for_config(build_ours(family), EngineConfig())
    monkeypatch.setattr(base, "_on_gpu", lambda: True)
    evaluated = []
    monkeypatch.setattr(device_queue.mx, "async_eval", lambda *a: evaluated.append("async_eval"))
    monkeypatch.setattr(device_queue.mx, "eval", lambda *a: evaluated.append("eval"))
    runner.build_prefill(runner.new_cache(), [0] * (base.LAYER_QUEUE_ROWS + 40))
    assert evaluated == []
    device_queue.send(mx.zeros((2,)), mx.zeros((2,)))  # outside the build, the queue sends again
    assert evaluated == ["async_eval", "eval"]


def test_the_warm_up_stops_waiting_for_compiles_after_its_limit(monkeypatch) -> None:
    """A compile that never ends (a stuck worker) holds the throwaway chunks back for at most
    cuda_disk_cache.WAIT_LIMIT_S; then they run, and MLX compiles what is missing itself."""
    from tests.models.builders import build_ours

    runner = ModelRunner.for_config(build_ours("qwen3_5_dense"), EngineConfig())
    clock = [0.0]
    monkeypatch.setattr(warmup.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(warmup.cuda_disk_cache, "compiles_running", lambda wait_s=0.0: True)
    warm = warmup.BatchWarmup((), prefill_lengths=(31,))
    for _ in range(3):
        assert warm.run_one(runner) and len(warm.prefill_pending) == 2
        clock[0] += warmup.cuda_disk_cache.WAIT_LIMIT_S / 4
    clock[0] += warmup.cuda_disk_cache.WAIT_LIMIT_S
    while warm.run_one(runner):
        pass
    assert warm.prefill_pending == []


def test_a_failing_prefill_build_leaves_the_chunks_to_run(monkeypatch) -> None:
    from tests.models.builders import build_ours

    runner = ModelRunner.for_config(build_ours("qwen3_5_dense"), EngineConfig())

    def broken(self, cache, tokens):
        raise RuntimeError("cannot build")

    ran, real_prefill = [], ModelRunner.prefill
    monkeypatch.setattr(ModelRunner, "build_prefill", broken)
    monkeypatch.setattr(
        ModelRunner,
        "prefill",
        lambda self, cache, tokens, **kw: ran.append(len(tokens)) or real_prefill(self, cache, tokens, **kw),
    )
    warm = warmup.BatchWarmup((), prefill_lengths=(31,))
    while warm.run_one(runner):
        pass
    assert warm.prefill_pending == [] and ran == [31, warmup.FIRST_CHUNK, 31]


async def test_a_failing_prefill_warm_up_is_skipped_and_the_engine_serves(
    qwen_model, make_client, monkeypatch
) -> None:
    def broken(self, cache, tokens, **kwargs):
        raise RuntimeError("no kernel for this length")

    monkeypatch.setattr(ModelRunner, "prefill", broken)
    client = make_client(qwen_model, max_running=4, warm_prefill=(31, 64))
    await _until_warm(client)
    assert client.engine.alive and client.engine.warmup.prefill_pending == []
    monkeypatch.undo()
    assert all(len(ids) == 6 for ids in await _burst(client))


def test_work_arriving_between_builds_ends_the_turn_and_the_rest_are_built_later() -> None:
    runner = ModelRunner(tiny_model("qwen3_5"))
    asked = [0]

    def busy() -> bool:  # the first turn's question, then one before each size's build: the third
        asked[0] += 1
        return asked[0] == 3

    warm = warmup.BatchWarmup((1, 2, 3), busy=busy)
    assert not warm.run_one(runner)  # size 1 built, then work arrived
    assert warm._built == {1} and warm.pending == [1, 2, 3]
    while warm.run_one(runner):
        pass
    assert warm._built == {1, 2, 3} and warm.pending == []


def test_every_size_is_built_before_the_first_runs(monkeypatch) -> None:
    """Building a step hands its custom kernels to the compile workers; building every pending size
    first lets a fresh GPU compile them side by side. The built steps trace what the run then uses."""
    runner = ModelRunner(tiny_model("qwen3_5"))
    order: list[tuple[str, int]] = []
    real_build, real_step = warmup.build_decode_step, warmup.warm_decode_step
    monkeypatch.setattr(
        warmup,
        "build_decode_step",
        lambda r, rows, b: order.append(("build", rows)) or real_build(r, rows, b),
    )
    monkeypatch.setattr(
        warmup,
        "warm_decode_step",
        lambda r, rows, b, busy: order.append(("run", rows)) or real_step(r, rows, b, busy),
    )
    warm = warmup.BatchWarmup((1, 2, 3))
    while warm.run_one(runner):
        pass
    assert order == [("build", 1), ("build", 2), ("build", 3), ("run", 1), ("run", 2), ("run", 3)]


def test_built_steps_run_only_once_their_kernels_have_compiled(monkeypatch) -> None:
    """While the compile workers still hold kernels the builds handed them, an idle turn waits a
    moment and gives the thread back (True: more to do) without running a step; once they are
    on disk the steps run, and MLX finds every module there instead of compiling it in line."""
    runner = ModelRunner(tiny_model("qwen3_5"))
    still_compiling = [True, True, False]
    waits: list[float] = []
    ran: list[int] = []

    def compiles_running(wait_s: float = 0.0) -> bool:
        waits.append(wait_s)
        return still_compiling.pop(0) if still_compiling else False

    real_step = warmup.warm_decode_step
    monkeypatch.setattr(warmup.cuda_disk_cache, "compiles_running", compiles_running)
    monkeypatch.setattr(
        warmup, "warm_decode_step", lambda r, rows, b, busy: ran.append(rows) or real_step(r, rows, b, busy)
    )
    warm = warmup.BatchWarmup((1, 2))
    assert warm.run_one(runner) and warm.run_one(runner)
    assert ran == [] and warm._built == {1, 2} and warm.pending == [1, 2]
    assert warm.run_one(runner) and ran == [1]
    while warm.run_one(runner):
        pass
    assert ran == [1, 2] and warm.pending == []
    assert waits[:2] == [warmup.COMPILE_WAIT_S] * 2 and warmup.COMPILE_WAIT_S <= 0.1


def test_a_decode_size_that_does_not_fit_leaves_the_prefill_chunks_to_run(monkeypatch) -> None:
    runner = ModelRunner(tiny_model("qwen3_5"))
    monkeypatch.setattr(warmup.BatchWarmup, "_fits", lambda self, rows: False)
    prefilled = []
    real = ModelRunner.prefill
    monkeypatch.setattr(
        ModelRunner,
        "prefill",
        lambda self, cache, tokens, **kw: prefilled.append(len(tokens)) or real(self, cache, tokens, **kw),
    )
    warm = warmup.BatchWarmup((1, 2), prefill_lengths=(31,))
    while warm.run_one(runner):
        pass
    assert warm.pending == [] and prefilled == [31, warmup.FIRST_CHUNK, 31]
