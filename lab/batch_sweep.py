"""Aggregate decode at 1, 4, 8 and 16 streams, kapitsa's engine against mlx-lm's batch_generate, on
random-weight 4-bit models of the real shapes; and what a batch size costs the first time it runs.

    python lab/batch_sweep.py --shapes 35b-a3b --streams 1,4,8,16 --tokens 64 --prompt 512
    python lab/batch_sweep.py --tiny --streams 1,2,4 --tokens 8 --prompt 32      # any machine
    python lab/batch_sweep.py --shapes 4b --streams 8,16 --engines kapitsa --ragged

`--ragged`: the streams' prompts differ in length (stream i's is 29 * i tokens shorter, wrapping at
half the prompt), so the batch's rows decode at different positions, as a server's conversations do.

Each burst sends N distinct prompts at once and waits for all N answers (greedy, fixed length).
Aggregate decode is the tokens after each stream's first, over the span from the last stream's
first token to the last stream's end: the time when all N decode together. A batch size's first
burst pays its compiles (MLX traces, CUDA kernels for new shapes); `first_burst_extra_s` is its
wall time minus the next burst's. mlx-lm runs `batch_generate` on the same prompts, once cold and
once warm, and reports its own generation tok/s.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import shutil
import subprocess
import time

import mlx.core as mx

from kapitsa.engine.inprocess import InProcessEngine
from kapitsa.engine.options import EngineConfig
from kapitsa.engine.types import (
    ModelInfo,
)
from lab.device_memory import DeviceProbe, Sampler
from lab.engine_timing import DEFAULTS, _Tokenizer, emit, stream
from lab.models_under_test import DTYPE, SHAPES, TINY, kapitsa_model, mlxlm_model, prompt_ids

WARMUP_PROMPT = 16  # tokens a prompt of mlx-lm's warm-up burst keeps


def engine(model, prompt_len: int, tokens: int, streams: int, warm: bool = False) -> InProcessEngine:
    """`warm`: the engine readies its batch sizes while idle as `kapitsa serve`'s does (every size up
    to `streams` on a GPU, none on the CPU: runner/warmup.py)."""
    info = ModelInfo(
        id="bench", family="bench", context_length=prompt_len + tokens + 16, max_output_tokens=tokens
    )
    config = EngineConfig(
        prefix_cache_bytes=0,
        prefill_chunk=2048,
        max_running=streams,
        kernels=DEFAULTS,
        warm_batches=None if warm else (),  # None: the device's default, as serve asks for
    )
    return InProcessEngine(model, _Tokenizer(), info, eos_token_ids=set(), config=config)


def wait_warm(client: InProcessEngine, limit_s: float = 600.0) -> float:
    """Wait until the engine's idle warm-up is done; its seconds."""
    deadline = time.perf_counter() + limit_s
    while client.stats().warm_batches_pending:
        if not client.stats().alive or time.perf_counter() > deadline:
            raise RuntimeError(f"the warm-up did not finish (alive: {client.stats().alive})")
        time.sleep(0.05)
    return client.stats().warmup_seconds


def burst(client: InProcessEngine, prompts: list[list[int]], tokens: int) -> dict:
    async def run() -> list[tuple[float, float, float, list[int]]]:
        return await asyncio.gather(*(stream(client, p, tokens) for p in prompts))

    start, sent_back = time.perf_counter(), client.stats().requests_sent_back
    # at most this many run at once: the configured batch, halved for a while after an
    # out-of-memory step sent rows back (runner/send_back.py), when a burst runs in waves
    limit = client.engine.batch_limit.current(start)
    sampler = Sampler(DeviceProbe(), interval_s=0.05)  # a read every 50 ms: no weight on the timing
    sampler.start()
    results = asyncio.run(run())
    wall = time.perf_counter() - start
    during = sampler.stop()
    all_decoding = max(r[1] for r in results)
    span = max(r[2] for r in results) - all_decoding
    after_first = sum(len(r[3]) - 1 for r in results)
    # rows an out-of-memory step sent back: the burst ran, but not all of it at this batch size
    resent = client.stats().requests_sent_back - sent_back
    return dict(
        wall_s=round(wall, 3),
        aggregate_tok_s=round(after_first / max(span, 1e-9), 2),
        sent_back=resent,
        limit=limit,
        **_highest_gb(during),
    )


def _highest_gb(samples: list[dict]) -> dict:
    """The burst's highest device use (NVML) and MLX buffer cache: the sweep's memory lines come
    after the burst, when the engine has handed its cache back."""
    out = {"burst_max_cache_gb": round(max(s["cache"] for s in samples), 2)} if samples else {}
    used = [s["device_used"] for s in samples if s.get("device_used") is not None]
    if used:
        out["burst_max_device_used_gb"] = round(max(used), 2)
    return out


def mlxlm_burst(model, prompts: list[list[int]], tokens: int) -> dict:
    from mlx_lm.generate import batch_generate

    start = time.perf_counter()
    response = batch_generate(model, _Tokenizer(), prompts, max_tokens=tokens)
    return dict(
        wall_s=round(time.perf_counter() - start, 3), aggregate_tok_s=round(response.stats.generation_tps, 2)
    )


def sweep(
    shape: str,
    dims_of: dict,
    streams: list[int],
    tokens: int,
    prompt_len: int,
    engines: set[str],
    warm: bool = False,
    ragged: bool = False,
) -> None:
    kind, dims = dims_of[shape]
    from kapitsa.testing.tiny import tiny_config

    config = tiny_config(kind, **dims)
    if "kapitsa" in engines:
        model = kapitsa_model(config)
        sweep_model(shape, "kapitsa", model, config, streams, tokens, prompt_len, warm, ragged)
        mx.clear_cache()
    if "mlx-lm" in engines:
        sweep_model(shape, "mlx-lm", mlxlm_model(config), config, streams, tokens, prompt_len, ragged=ragged)
        mx.clear_cache()


def _memory_gb() -> dict:
    """MLX's memory after a burst: what arrays hold, its buffer cache, the process's peak; on an
    NVIDIA GPU also what the device has in use in all (`device_used_gb`, from nvidia-smi): the gap
    is memory outside MLX's count (its allocator's pool, CUDA graphs, cuDNN and cuBLAS workspaces),
    where the 27B's 16-row step ran out."""
    gb = 1024**3
    out = dict(
        active_gb=round(mx.get_active_memory() / gb, 2),
        cache_gb=round(mx.get_cache_memory() / gb, 2),
        peak_gb=round(mx.get_peak_memory() / gb, 2),
    )
    used = _device_used_mib()
    if used is not None:
        out["device_used_gb"] = round(used * 1024**2 / gb, 2)
    return out


def _device_used_mib() -> float | None:
    """The first GPU's memory in use by every process, MiB; None without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "--id=0"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        return float(done.stdout.split()[0])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def sweep_model(
    shape: str,
    engine_name: str,
    model,
    config: dict,
    streams: list[int],
    tokens: int,
    prompt_len: int,
    warm: bool = False,
    ragged: bool = False,
) -> None:
    """One engine's bursts at each stream count on an already built model ("kapitsa" wraps it in an
    engine for the sweep, `warm`: one that readies its batch sizes first and reports the seconds;
    "mlx-lm" runs `batch_generate` on it), one line per count."""
    vocab = (config.get("text_config") or config)["vocab_size"]
    lengths = [
        prompt_len - (29 * i) % max(prompt_len // 2, 1) if ragged else prompt_len for i in range(max(streams))
    ]
    prompts = [prompt_ids(n, vocab, stride=7919 + 2 * i) for i, n in enumerate(lengths)]
    gc.collect()
    mx.clear_cache()  # buffers earlier rounds left in MLX's cache go back before the bursts
    if engine_name == "kapitsa":
        client = engine(model, prompt_len, tokens, max(streams), warm)
        if warm:
            emit(dict(shape=shape, engine=engine_name, warmup_s=round(wait_warm(client), 2)))
        run = lambda ps, n: burst(client, ps, n)  # noqa: E731
    else:
        client = None
        run = lambda ps, n: mlxlm_burst(model, ps, n)  # noqa: E731
    try:
        run(prompts[:1], 8)  # the one-stream path's compiles, before anything is timed
        for n in streams:
            if engine_name == "kapitsa":
                cold, timed = run(prompts[:n], tokens), run(prompts[:n], tokens)
                timed["first_burst_extra_s"] = round(cold["wall_s"] - timed["wall_s"], 3)
                timed["first_burst_sent_back"] = cold["sent_back"]
            else:
                # mlx-lm's first burst of a size warms up on short prompts: its decode compiles, not
                # a second batch prefill of n x 512 tokens (up to ~45 s a burst on the Qwen shapes, at
                # 180-500 tok/s); its generation rate leaves the prefill out
                run([p[:WARMUP_PROMPT] for p in prompts[:n]], 4)
                timed = run(prompts[:n], tokens)
            emit(dict(shape=shape, engine=engine_name, streams=n, ragged=ragged, **timed, **_memory_gb()))
    finally:
        if client is not None:
            client.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default="27b,35b-a3b,4b,nemotron-30b-a3b")
    parser.add_argument("--streams", default="1,4,8,16")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--engines", default="kapitsa,mlx-lm")
    parser.add_argument("--tiny", action="store_true", help="small widths, float32 (any machine)")
    parser.add_argument(
        "--warm", action="store_true", help="kapitsa readies its batch sizes first (serve's way)"
    )
    parser.add_argument("--ragged", action="store_true", help="prompts of different lengths (see above)")
    args = parser.parse_args()
    if args.tiny:
        DTYPE["value"] = mx.float32  # MLX's CPU gather_mm (MoE) is float32-only
    streams = [int(s) for s in args.streams.split(",")]
    for shape in args.shapes.split(","):
        sweep(
            shape,
            TINY if args.tiny else SHAPES,
            streams,
            args.tokens,
            args.prompt,
            set(args.engines.split(",")),
            args.warm,
            args.ragged,
        )


if __name__ == "__main__":
    main()
