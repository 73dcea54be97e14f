"""Memory admission: what a request will hold, against what the device can give.

A sequence holds KV for every token it keeps (attention layers), one recurrent state (GDN / Mamba
layers, fixed size) and scratch for a prefill chunk. The context window is checked first, before
any compute; then memory: a request that could never fit is refused outright, one that does not fit
now waits for running requests to finish (the engine turns a long wait into `EngineBusy`).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from kapitsa.errors import ContextOverflow, EngineBusy, KapitsaError

GIB = 1024**3
# Tokens reserved for a request that did not set max_tokens; it may grow past them while memory lasts.
DEFAULT_OUTPUT_RESERVE = 4096


@dataclass(slots=True, frozen=True)
class StateSizes:
    """Per-sequence state of one model, in bytes."""

    kv_bytes_per_token: int
    recurrent_bytes: int
    activation_bytes_per_token: int = 0  # scratch per prompt token of a prefill chunk


def device_memory_limit() -> int:
    """The memory MLX may use on this device: its size (Metal's recommended working set, else the
    device's or the system's memory), capped by MLX's allocator limit (on CUDA 95% of the device,
    the rest left to the CUDA context and libraries)."""
    size = _device_size()
    allocator = mx.get_memory_limit()
    return min(size, allocator) if allocator > 0 else size


# MLX keeps freed buffers for reuse up to its memory limit unless told otherwise. A batch that
# grows row by row leaves buffers of every row count behind (recurrent states and caches per
# size), and on CUDA the allocator trims its cache only at the limit, where stream-ordered frees
# may not have landed when the next allocation needs them. An eighth of the limit holds what a
# step frees for the next one to reuse and keeps the cache far from that edge.
BUFFER_CACHE_SHARE = 8
MIN_BUFFER_CACHE = 1 * GIB


def buffer_cache_limit(limit_bytes: int) -> int:
    """Bytes of freed buffers MLX keeps for reuse under a memory limit of `limit_bytes`."""
    return max(MIN_BUFFER_CACHE, limit_bytes // BUFFER_CACHE_SHARE)


def _device_size() -> int:
    info = mx.device_info()
    for key in ("max_recommended_working_set_size", "memory_size", "total_memory"):
        value = info.get(key)
        if isinstance(value, int) and value > 0:
            return value
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * GIB


# How a failed device allocation reads (lower-cased): MLX's CUDA allocator and its CUDA, cuBLAS and
# cuDNN calls, Metal's command buffer, the allocators' own check. A buffer over Metal's
# single-buffer limit is not among them: a retry cannot fit it either.
_OUT_OF_MEMORY = (
    "out of memory",
    "out_of_memory",
    "outofmemory",
    "insufficient memory",
    "unable to allocate",
    "alloc_failed",
)


def is_out_of_memory(err: BaseException) -> bool:
    text = str(err).lower()
    return any(marker in text for marker in _OUT_OF_MEMORY)


def failure_error(err: Exception) -> KapitsaError:
    """The error a request gets for a step that raised `err`. A device out of memory (the rows of a
    batch together, or what other processes hold) is `EngineBusy`: the engine serves on
    (the engine loop hands MLX's cache back), and a client's retry, alone or in a smaller batch,
    finds the memory."""
    if isinstance(err, KapitsaError):
        return err
    if is_out_of_memory(err):
        return EngineBusy(f"the device ran out of memory for this request ({err}); retry it")
    return KapitsaError(f"generation failed: {err}")


class DoesNotFit(ContextOverflow):
    """The device ran out of memory for a request that ran alone, a second time: a retry cannot help.
    A `ContextOverflow`, so clients shorten or compact their conversation as they do for the window."""


class AloneFailures:
    """Out-of-memory steps of a request that was the only one running. The first is taken for
    memory that other processes held (`EngineBusy`: retry); the same prompt failing alone again
    within `window_s` does not fit next to the model here: a 400 that says what to change, so an
    agent stops retrying it. The prompt finishing once clears it."""

    def __init__(self, *, window_s: float = 600.0, keep: int = 16) -> None:
        self.window_s, self.keep = window_s, keep
        self.failed: dict[int, float] = {}  # the prompt's hash -> when it last failed alone

    def error_for(
        self, err: Exception, prompt_ids: Sequence[int], *, processed: int, alone: bool
    ) -> KapitsaError:
        """The error for a request whose step raised `err`, after `processed` tokens were in its cache."""
        if not alone or isinstance(err, KapitsaError) or not is_out_of_memory(err):
            return failure_error(err)
        now, key = time.monotonic(), hash(tuple(prompt_ids))
        self.failed = {k: t for k, t in self.failed.items() if now - t < self.window_s}
        if key in self.failed:
            self.failed[key] = now  # failing on: it stays refused
            prompt = len(prompt_ids)
            return DoesNotFit(
                prompt,
                max(0, min(processed, prompt - 1)),  # what ran before the failure, below the prompt
                f"the device ran out of memory for this request twice with no other request running "
                f"({prompt} prompt tokens, {processed} in its cache when it failed; {err}): it does not "
                "fit next to the model on this machine; use a shorter prompt, a lower max_tokens, "
                "--kv-bits 8 or a smaller quantization",
            )
        self.failed[key] = now
        while len(self.failed) > self.keep:
            self.failed.pop(next(iter(self.failed)))
        return failure_error(err)

    def note_finished(self, prompt_ids: Sequence[int]) -> None:
        if self.failed:
            self.failed.pop(hash(tuple(prompt_ids)), None)


def check_context(prompt_tokens: int, context_length: int) -> None:
    """Raise `ContextOverflow` when the prompt leaves no room to generate. A too-large `max_tokens` is no
    error: the engine clamps it to the room left (agents ask for fixed budgets, e.g. Claude Code's 32000)."""
    if prompt_tokens >= context_length:
        raise ContextOverflow(
            prompt_tokens,
            context_length,
            f"prompt is too long: {prompt_tokens} tokens, the model's context is {context_length} tokens "
            "(and at least one token must be left to generate)",
        )


class MemoryBudget:
    """Tracks bytes reserved by admitted sequences against the device limit.

    Args:
        sizes: the model's per-sequence state sizes.
        limit_bytes: what MLX may use in all (weights included).
        weights_bytes: memory already taken by the weights and other fixed buffers.
        prefill_chunk: tokens per prefill chunk (bounds activation scratch).
    """

    def __init__(
        self, sizes: StateSizes, *, limit_bytes: int, weights_bytes: int, prefill_chunk: int
    ) -> None:
        self.sizes = sizes
        self.limit_bytes = limit_bytes
        self.weights_bytes = weights_bytes
        self.prefill_chunk = prefill_chunk
        self.reserved_bytes = 0

    @property
    def available_bytes(self) -> int:
        """Bytes for sequences and the prefix cache, with nothing admitted."""
        return max(0, self.limit_bytes - self.weights_bytes)

    @property
    def free_bytes(self) -> int:
        return self.available_bytes - self.reserved_bytes

    def sequence_bytes(self, tokens: int) -> int:
        """What one sequence of `tokens` tokens holds (KV, recurrent state, prefill scratch)."""
        s = self.sizes
        scratch = s.activation_bytes_per_token * min(tokens, self.prefill_chunk)
        return s.kv_bytes_per_token * tokens + s.recurrent_bytes + scratch

    def reserve_tokens(self, prompt_tokens: int, max_tokens: int | None, context_length: int) -> int:
        """Tokens to reserve for a request: its prompt plus its output allowance."""
        room = context_length - prompt_tokens
        output = min(max_tokens, room) if max_tokens is not None else min(DEFAULT_OUTPUT_RESERVE, room)
        return prompt_tokens + output

    def tokens_that_fit(self) -> int:
        """The longest sequence whose `sequence_bytes` fit, with nothing else admitted."""
        s = self.sizes
        free = self.available_bytes - s.recurrent_bytes
        if free <= 0:
            return 0
        per_token = s.kv_bytes_per_token + s.activation_bytes_per_token
        if free < per_token * self.prefill_chunk:  # shorter than one prefill chunk: scratch grows too
            return free // per_token
        if s.kv_bytes_per_token == 0:
            return sys.maxsize
        return (free - s.activation_bytes_per_token * self.prefill_chunk) // s.kv_bytes_per_token

    def fits_ever(self, nbytes: int) -> bool:
        return nbytes <= self.available_bytes

    def fits_now(self, nbytes: int, *, other_bytes: int = 0) -> bool:
        """Whether `nbytes` more fit next to what is reserved and `other_bytes` (e.g. the prefix cache)."""
        return self.reserved_bytes + other_bytes + nbytes <= self.available_bytes

    def reserve(self, nbytes: int) -> None:
        self.reserved_bytes += nbytes

    def release(self, nbytes: int) -> None:
        self.reserved_bytes = max(0, self.reserved_bytes - nbytes)

    def describe_shortfall(self, nbytes: int) -> str:
        return (
            f"this request needs {nbytes / GIB:.2f} GiB for its KV cache and recurrent state, "
            f"but only {self.available_bytes / GIB:.2f} GiB is available next to the model "
            f"({self.limit_bytes / GIB:.2f} GiB limit, {self.weights_bytes / GIB:.2f} GiB of weights); "
            "use a shorter prompt, a lower max_tokens or a smaller quantization"
        )


def periodic_checkpoint_interval(checkpoint_bytes: int, kv_bytes_per_token: int) -> int:
    """Tokens between periodic checkpoints: twice the checkpoint's size in KV tokens, clamped."""
    if kv_bytes_per_token <= 0:
        return 4096
    return max(2048, min(16384, 2 * checkpoint_bytes // kv_bytes_per_token))
