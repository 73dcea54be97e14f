"""A decode batch that runs out of memory sends its rows back to the queue (runner/send_back.py):
they resume from their prompt and output, finish with the tokens they would have had, and the
engine runs fewer at once for a while; a request sent back too often, or one alone, fails as 503."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import mlx.core as mx

from kapitsa.engine.runner.sampler import SequenceSampler
from kapitsa.engine.runner.send_back import MAX_SEND_BACKS, BatchLimit
from kapitsa.engine.types import ErrorEvent, FinishEvent, GenerationRequest, SamplingParams, TokenEvent
from kapitsa.errors import EngineBusy

CUDA_OOM = "cudaMallocAsync(&data, size, stream) failed: out of memory"
PROMPTS = [(5, 6, 7, 8), (9, 10), (11, 12, 13)]


def _request(prompt, max_tokens: int = 24, **sampling) -> GenerationRequest:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)
    return GenerationRequest(prompt_token_ids=prompt, sampling=params)


async def _run(client, prompt, max_tokens: int = 24, **sampling):
    """(tokens, finish event) of one request; its error event raised."""
    tokens, finish = [], None
    async for event in client.generate(_request(prompt, max_tokens, **sampling)):
        if isinstance(event, ErrorEvent):
            raise event.error
        if isinstance(event, TokenEvent):
            tokens += event.token_ids
        if isinstance(event, FinishEvent):
            finish = event
    return tokens, finish


def _fail_batch_steps(monkeypatch, engine, *, times: int, rows: int = 2, after_tokens: int = 6) -> dict:
    """The first `times` decode steps of at least `rows` rows, once every row has `after_tokens`
    tokens, raise CUDA's out-of-memory error."""
    real = engine.runner.decode_lazy
    state = {"failed": 0}

    def decode_lazy(*args, **kwargs):
        decoding = engine.scheduler.decoding
        ready = len(decoding) >= rows and all(len(s.output_ids) >= after_tokens for s in decoding)
        if ready and state["failed"] < times:
            state["failed"] += 1
            raise RuntimeError(CUDA_OOM)
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "decode_lazy", decode_lazy)
    monkeypatch.setattr(logging.getLogger("kapitsa.engine.runner.loop"), "propagate", False)
    return state


async def test_rows_sent_back_finish_with_the_tokens_they_would_have_had(
    family_model, make_client, monkeypatch
) -> None:
    client = make_client(family_model)
    expected = [await _run(client, p) for p in PROMPTS]
    engine = client.engine
    state = _fail_batch_steps(monkeypatch, engine, times=1, rows=3)
    got = await asyncio.gather(*(_run(client, p) for p in PROMPTS))
    assert state["failed"] == 1
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    for (_, finish), (_, before) in zip(got, expected, strict=True):
        assert finish.finish_reason == "length"
        assert finish.usage.prompt_tokens == before.usage.prompt_tokens
        assert finish.usage.completion_tokens == 24
    assert engine.stats.failed == 0 and client.stats().requests_sent_back == 3
    assert engine.scheduler.max_running == 1  # three rows failed: half of them, at least one
    assert engine.memory.reserved_bytes == 0  # every reservation released, none twice


async def test_the_limit_comes_back_after_its_hold(qwen_model, make_client, monkeypatch) -> None:
    client = make_client(qwen_model, max_running=4)
    engine = client.engine
    engine.batch_limit.hold_s = 0.0
    lowered = []
    real = engine.batch_limit.after_failure
    monkeypatch.setattr(
        engine.batch_limit, "after_failure", lambda *a: lowered.append(real(*a)) or lowered[-1]
    )
    _fail_batch_steps(monkeypatch, engine, times=1)
    await asyncio.gather(*(_run(client, p, 12) for p in PROMPTS[:2]))
    assert lowered == [1]
    await _run(client, PROMPTS[2], 4)  # admitted after the hold: the configured limit again
    assert engine.scheduler.max_running == 4


async def test_a_row_that_finished_in_the_failed_step_is_not_sent_back(
    qwen_model, make_client, monkeypatch
) -> None:
    """The failure comes after a row finished in the step (copying its state for the prefix cache):
    that row's request has its one finish; the other row resumes."""
    from kapitsa.engine.runner.batch import DecodeBatch

    client = make_client(qwen_model)
    engine = client.engine
    expected = (await _run(client, PROMPTS[1], 30))[0]
    real, failed = DecodeBatch.extract, []

    def extract(self, row):  # noqa: ANN001, ANN202
        seqs = engine.scheduler.decoding
        if not failed and len(seqs) >= 2 and seqs[row].is_finished:
            failed.append(row)
            raise RuntimeError(CUDA_OOM)
        return real(self, row)

    monkeypatch.setattr(DecodeBatch, "extract", extract)
    monkeypatch.setattr(logging.getLogger("kapitsa.engine.runner.loop"), "propagate", False)

    async def events(prompt, max_tokens):  # noqa: ANN001, ANN202
        request = _request(prompt, max_tokens)
        return [e async for e in client.generate(request)]

    short, long = await asyncio.gather(events(PROMPTS[0], 8), events(PROMPTS[1], 30))
    assert failed
    assert [type(e).__name__ for e in short].count("FinishEvent") == 1
    assert sum(len(e.token_ids) for e in short if isinstance(e, TokenEvent)) == 8
    assert [t for e in long if isinstance(e, TokenEvent) for t in e.token_ids] == expected
    assert engine.stats.finished == 3  # the reference request and these two, each once


async def test_a_row_whose_sampler_read_a_lost_pick_fails_and_the_others_resume(
    qwen_model, make_client, monkeypatch
) -> None:
    """A synchronous step (logprobs) reads row 0's pick back, then runs out of memory in row 1: row 0
    would resume with its penalties ahead of its output, so it fails as a 503; row 1 resumes."""
    sampling = dict(frequency_penalty=1.5, logprobs=1)
    client = make_client(qwen_model)
    engine = client.engine
    expected = (await _run(client, PROMPTS[1], 24, **sampling))[0]
    real, failed = SequenceSampler.sample, []

    def sample(self, logits):  # noqa: ANN001, ANN202
        seqs = engine.scheduler.decoding
        if not failed and len(seqs) == 2 and self is seqs[1].sampler and len(seqs[1].output_ids) >= 6:
            failed.append(True)
            raise RuntimeError(CUDA_OOM)
        return real(self, logits)

    monkeypatch.setattr(SequenceSampler, "sample", sample)
    monkeypatch.setattr(logging.getLogger("kapitsa.engine.runner.loop"), "propagate", False)
    first, second = await asyncio.gather(
        _run(client, PROMPTS[0], 24, **sampling),
        _run(client, PROMPTS[1], 24, **sampling),
        return_exceptions=True,
    )
    assert failed and isinstance(first, EngineBusy)
    assert second[0] == expected


async def test_sampled_rows_with_penalties_resume(qwen_model, make_client, monkeypatch) -> None:
    """Rows that sample lazily (pipelined, penalties counted on the device) lose the picks of the
    failed step and count only what they streamed; each still ends with its max_tokens."""
    client = make_client(qwen_model)
    _fail_batch_steps(monkeypatch, client.engine, times=1)
    sampling = dict(temperature=0.8, seed=3, frequency_penalty=0.5, presence_penalty=0.3)
    got = await asyncio.gather(*(_run(client, p, 20, **sampling) for p in PROMPTS[:2]))
    assert [len(tokens) for tokens, _ in got] == [20, 20]
    assert client.engine.stats.failed == 0


async def test_sent_back_too_often_it_fails_as_busy(qwen_model, make_client, monkeypatch) -> None:
    """Every batch step runs out of memory: the rows come back, run with a lower limit, and once
    alone (or sent back MAX_SEND_BACKS times) fail as a 503; the engine serves on."""
    client = make_client(qwen_model, max_running=8)
    engine = client.engine
    engine.batch_limit.hold_s = 0.0  # the limit restores at once, so the rows keep meeting
    state = _fail_batch_steps(monkeypatch, engine, times=100, after_tokens=2)
    results = await asyncio.gather(*(_run(client, p) for p in PROMPTS[:2]), return_exceptions=True)
    assert all(isinstance(r, EngineBusy) for r in results), results
    assert state["failed"] == MAX_SEND_BACKS + 1
    assert engine.memory.reserved_bytes == 0
    state["failed"] = 100  # no more failures
    tokens, _ = await _run(client, PROMPTS[0])
    assert len(tokens) == 24


def test_the_limit_halves_and_holds() -> None:
    limit = BatchLimit(16, hold_s=60.0)
    assert limit.after_failure(16, now=0.0) == 8
    assert limit.current(now=30.0) == 8
    assert limit.after_failure(3, now=40.0) == 1  # the rows that failed, halved
    assert limit.current(now=99.0) == 1
    assert limit.current(now=100.0) == 16


def test_forgetting_queued_picks_counts_only_what_was_observed() -> None:
    params = SamplingParams(temperature=1.0, seed=1, frequency_penalty=1.0)
    sampler = SequenceSampler(params, [1, 2, 3])
    logits = mx.zeros((16,), mx.float32)
    first = sampler.sample(logits).token_id  # makes the penalty arrays
    for _ in range(2):
        sampler.lazy_pick(logits)  # queued, never read back
    sampler.forget_queued([1, 2, 3], [first])
    fresh = SequenceSampler(params, [1, 2, 3])
    fresh.sample(logits)
    assert mx.array_equal(sampler.process(logits), fresh.process(logits)).item()
    sampler.observe(4)  # a token read back after the forget: counted once, as a host token
    assert mx.array_equal(sampler._penalties._counts, fresh._penalties._counts.at[4].add(1.0)).item()


def test_rows_with_images_or_sent_back_too_often_do_not_resume() -> None:
    from types import SimpleNamespace

    from kapitsa.engine.runner.send_back import resumable

    def row(**fields):  # noqa: ANN202
        base = dict(times_sent_back=0, media=None, sampler=None, output_ids=[1, 2])
        return SimpleNamespace(**(base | fields))

    assert resumable(row())
    assert not resumable(row(times_sent_back=MAX_SEND_BACKS))
    assert not resumable(row(media=object()))  # image positions cover the prompt only
    assert not resumable(row(sampler=SimpleNamespace(observed=3)))
    assert resumable(row(sampler=SimpleNamespace(observed=2)))


async def test_a_speculative_batch_resumes_with_new_drafters(qwen_model, make_client, monkeypatch) -> None:
    """A verify of several rows runs out of memory: the rows resume, each with a new drafter, and
    write plain decoding's tokens."""
    from engine_standins import EOS, ByteTokenizer
    from test_speculation_at_rest import HostOracle

    from kapitsa.engine.inprocess import InProcessEngine
    from kapitsa.engine.options import EngineConfig
    from kapitsa.engine.speculative.decoder import SpeculativeDecode
    from kapitsa.engine.types import ModelInfo

    plain = make_client(qwen_model)
    expected = [(await _run(plain, p, 30))[0] for p in PROMPTS[:2]]
    made = []

    def drafter() -> HostOracle:
        made.append(HostOracle({p: e for p, e in zip(PROMPTS[:2], expected, strict=True)}, right_from=0))
        return made[-1]

    strategy = SpeculativeDecode(drafter, name="host", max_draft=4, cost_curve=[1.0] * 5)
    info = ModelInfo(id="tiny", family="test", context_length=4096, max_output_tokens=1024)
    client = InProcessEngine(
        qwen_model, ByteTokenizer(), info, eos_token_ids={EOS}, config=EngineConfig(prefill_chunk=64),
        decode=strategy,
    )  # fmt: skip
    try:
        real, failed = strategy.step, []

        def step(runner, cache, sequences):  # noqa: ANN001, ANN202
            if len(sequences) == 2 and not failed and all(len(s.output_ids) > 4 for s in sequences):
                failed.append(True)
                raise RuntimeError(CUDA_OOM)
            return real(runner, cache, sequences)

        monkeypatch.setattr(strategy, "step", step)
        monkeypatch.setattr(logging.getLogger("kapitsa.engine.runner.loop"), "propagate", False)
        got = await asyncio.gather(*(_run(client, p, 30) for p in PROMPTS[:2]))
        assert failed and [tokens for tokens, _ in got] == expected
        assert len(made) >= 4  # two drafters before the failure, two after
        assert strategy.stats.accepted > 0
    finally:
        client.close()


def test_a_row_sent_back_waits_for_memory_afresh() -> None:
    """Its wait for memory (`queue_timeout_s`) counts from when it was sent back, not from its
    arrival minutes earlier: a row that has streamed output is not refused for an old arrival."""
    from types import SimpleNamespace

    from kapitsa.engine.runner.send_back import prepare_resume

    memory = SimpleNamespace(released=[], release=lambda n: memory.released.append(n))
    seq = SimpleNamespace(
        sampler=None, cache=object(), prompt_tail=None, pending_logits=None, reserved_bytes=100,
        num_processed=50, arrival=0.0, resuming=False, times_sent_back=0, prompt_ids=[1], output_ids=[2],
    )  # fmt: skip
    prepare_resume(seq, memory)
    assert seq.arrival > 0.0 and seq.resuming and seq.times_sent_back == 1
    assert (
        memory.released == [100] and seq.reserved_bytes == 0 and seq.cache is None and seq.num_processed == 0
    )


def _fail_prefills_beside_a_batch(
    monkeypatch, engine, prompt: tuple[int, ...], *, times: int, after_chunks: int = 0
) -> dict:
    """The first `times` prefill chunks of `prompt` that run while other sequences decode, each
    after `after_chunks` chunks of its attempt went through, raise CUDA's out-of-memory error."""
    real = engine.runner.prefill_at
    state = {"failed": 0, "chunks": 0}

    def prefill_at(cache, tokens, ends, **kwargs):
        ours = [s for s in engine.scheduler.prefilling if s.prompt_ids == list(prompt)]
        if ours and ours[0].cache is cache and engine.scheduler.decoding and state["failed"] < times:
            if state["chunks"] >= after_chunks:
                state["failed"], state["chunks"] = state["failed"] + 1, 0
                raise RuntimeError(CUDA_OOM)
            state["chunks"] += 1
        return real(cache, tokens, ends, **kwargs)

    monkeypatch.setattr(engine.runner, "prefill_at", prefill_at)
    monkeypatch.setattr(logging.getLogger("kapitsa.engine.runner.loop"), "propagate", False)
    return state


BESIDE_TOKENS = 120  # the decoding requests outlast the one whose prefill fails


async def _beside_a_batch(client, request_coro):
    """Run `request_coro` once three other requests are decoding; (its result, theirs)."""
    begun = [asyncio.Event() for _ in PROMPTS]

    async def decoding(prompt, begun_event):  # noqa: ANN001, ANN202
        tokens = []
        async for event in client.generate(_request(prompt, BESIDE_TOKENS)):
            if isinstance(event, ErrorEvent):
                raise event.error
            if isinstance(event, TokenEvent):
                tokens += event.token_ids
                begun_event.set()
        return tokens

    others = [asyncio.create_task(decoding(p, e)) for p, e in zip(PROMPTS, begun, strict=True)]
    await asyncio.gather(*(e.wait() for e in begun))
    result = await request_coro
    return result, await asyncio.gather(*others)


async def test_a_prefill_out_of_memory_beside_a_batch_starts_over_and_finishes(
    family_model, make_client, monkeypatch
) -> None:
    """A prompt of several chunks runs out of memory in its second chunk while three rows decode:
    it goes back to the queue, starts its prompt over and writes the tokens it would have had; the
    rows decode on undisturbed, and the engine runs half as many sequences at once for a while."""
    client = make_client(family_model, prefill_chunk=8)
    long_prompt = tuple(range(20, 44))  # 3 chunks of 8
    expected = (await _run(client, long_prompt))[0]
    others_expected = [(await _run(client, p, BESIDE_TOKENS))[0] for p in PROMPTS]
    engine = client.engine
    halved = []
    real_halve = engine.batch_limit.after_failure
    monkeypatch.setattr(engine.batch_limit, "after_failure", lambda *a: halved.append(a[0]) or real_halve(*a))
    state = _fail_prefills_beside_a_batch(monkeypatch, engine, long_prompt, times=1, after_chunks=1)
    (tokens, finish), others = await _beside_a_batch(client, _run(client, long_prompt))
    assert state["failed"] == 1
    assert tokens == expected and finish.finish_reason == "length"
    assert finish.usage.prompt_tokens == len(long_prompt) and finish.usage.completion_tokens == 24
    assert others == others_expected
    assert engine.stats.failed == 0 and client.stats().requests_sent_back == 1
    assert halved == [4] and engine.scheduler.max_running == 2  # four were running: half
    assert engine.memory.reserved_bytes == 0


async def test_a_restarted_prefill_of_several_choices_gives_every_choice(
    qwen_model, make_client, monkeypatch
) -> None:
    """The request's other choices fork when its prefill ends, so a prefill sent back before that
    still streams all of them."""
    client = make_client(qwen_model, prefill_chunk=8)
    prompt = tuple(range(30, 50))

    async def choices() -> dict[int, list[int]]:
        request = GenerationRequest(
            prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=10, ignore_eos=True), n=2
        )
        got: dict[int, list[int]] = {}
        async for event in client.generate(request):
            if isinstance(event, ErrorEvent):
                raise event.error
            if isinstance(event, TokenEvent):
                got.setdefault(event.index, []).extend(event.token_ids)
        return got

    expected = await choices()
    state = _fail_prefills_beside_a_batch(monkeypatch, client.engine, prompt, times=1, after_chunks=1)
    got, _ = await _beside_a_batch(client, choices())
    assert state["failed"] == 1 and sorted(got) == [0, 1] and got == expected


async def test_a_prefill_sent_back_too_often_fails_as_busy(qwen_model, make_client, monkeypatch) -> None:
    client = make_client(qwen_model, max_running=8)
    engine = client.engine
    engine.batch_limit.hold_s = 0.0  # the limit restores at once, so the prefill keeps meeting the rows
    state = _fail_prefills_beside_a_batch(monkeypatch, engine, (40, 41, 42), times=100)

    async def attempt():  # started once the others decode (a gather would start it at once)
        try:
            return await _run(client, (40, 41, 42))
        except EngineBusy as err:
            return err

    result, others = await _beside_a_batch(client, attempt())
    assert isinstance(result, EngineBusy), result
    assert state["failed"] == MAX_SEND_BACKS + 1 and engine.stats.sent_back == MAX_SEND_BACKS
    assert [len(t) for t in others] == [BESIDE_TOKENS] * 3 and engine.memory.reserved_bytes == 0


async def test_a_restarted_prefill_with_checkpoints_writes_its_tokens(
    qwen_model, make_client, monkeypatch, tmp_path
) -> None:
    """The first attempt checkpointed its prompt at 64 tokens before its third chunk ran out of
    memory. The failure empties the prefix cache's memory (to its disk tier where the node is a
    leaf by then), so the restart begins at that checkpoint or at 0; either way it writes the
    tokens it would have had, and the request's figures are its first attempt's."""
    client = make_client(qwen_model, prefill_chunk=32, checkpoint_interval=64, disk_cache_dir=tmp_path)
    prompt = tuple(range(60, 210))  # 150 tokens: chunks end at 32, 64 (a checkpoint), 96, 128, 150
    expected = (await _run(client, prompt))[0]
    engine = client.engine
    engine.prefix.clear()  # the first attempt finds nothing
    starts: list[int] = []
    real = engine.runner.prefill_at

    def recording(cache, tokens, ends, **kwargs):
        if engine.scheduler.prefilling and engine.scheduler.prefilling[0].prompt_ids == list(prompt):
            starts.append(kwargs.get("start", 0))
        return real(cache, tokens, ends, **kwargs)

    monkeypatch.setattr(engine.runner, "prefill_at", recording)
    state = _fail_prefills_beside_a_batch(monkeypatch, engine, prompt, times=1, after_chunks=2)
    (tokens, finish), _ = await _beside_a_batch(client, _run(client, prompt))
    assert state["failed"] == 1 and tokens == expected
    assert starts[:2] == [0, 32] and starts[2:] in ([64, 96, 128], [0, 32, 64, 96, 128])
    assert finish.usage.cached_tokens == 0  # as its first attempt found the cache


def test_a_restart_keeps_its_message_boundaries_and_first_figures() -> None:
    from kapitsa.engine.runner.send_back import prepare_restart
    from kapitsa.engine.runner.sequence import Boundary

    boundaries = [
        Boundary(10, "system"),
        Boundary(100, "turn"),
        Boundary(300, "branch"),
        Boundary(2048, "periodic"),
    ]
    seq = SimpleNamespace(
        cache=object(),
        prompt_tail=None,
        pending_logits=None,
        sampler=object(),
        reserved_bytes=4096,
        num_processed=2048,
        num_cached_tokens=100,
        boundaries=boundaries,
        arrival=0.0,
        times_sent_back=0,
    )
    released: list[int] = []
    prepare_restart(seq, SimpleNamespace(release=released.append))
    assert released == [4096] and seq.reserved_bytes == 0
    assert [b.pos for b in seq.boundaries] == [10, 100]
    assert seq.num_processed == 0 and seq.num_cached_tokens == 100 and seq.times_sent_back == 1
    assert seq.cache is None and seq.sampler is None


def test_a_prefill_restarts_only_before_its_first_token_is_sampled() -> None:
    from kapitsa.engine.runner.send_back import restartable

    seq = SimpleNamespace(times_sent_back=0, num_processed=8, feed_ids=list(range(24)), resuming=False)
    assert restartable(seq)
    seq.num_processed = 24  # the last chunk ran: the failure came while sampling or forking
    assert not restartable(seq)
    seq.num_processed, seq.times_sent_back = 8, MAX_SEND_BACKS
    assert not restartable(seq)
