"""The model seen by the engine: prefill chunks, batched decode steps, and the cache surgery the
prefix cache needs (KV spans out, recurrent state out, a batch-1 cache rebuilt from both).

Works on any model that follows `kapitsa.engine.models.base` (`forward`, `logits`, `make_cache`)
with a `HybridCache` (ragged, right-padded rows; `[B, Hkv, capacity, D]` KV buffers).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import mlx.core as mx

from kapitsa.engine.cache import snapshot
from kapitsa.engine.cache.disk import StoredPrefix
from kapitsa.engine.cache.hybrid import HybridCache
from kapitsa.engine.cache.layers import KVCache
from kapitsa.engine.cache.prefix import PrefixMatch
from kapitsa.engine.cache.quantized_kv import use_kv_bits
from kapitsa.engine.cache.snapshot import KV_AXIS
from kapitsa.engine.kernels import cpu_blas
from kapitsa.engine.kernels.probes import probe_enabled
from kapitsa.engine.loading.fuse import fuse_model
from kapitsa.engine.models.base import ForwardOutput, tied_embedding, use_kernel_options
from kapitsa.engine.ops import device_queue
from kapitsa.engine.ops.linear import keeps_every_dense_copy, kept_dense_bytes, route_quantized_linears
from kapitsa.engine.options import EngineConfig, KernelOptions
from kapitsa.engine.runner.memory import StateSizes
from kapitsa.engine.runner.prompt_tail import PromptTail
from kapitsa.engine.runner.vision import ImageFeatures
from kapitsa.engine.vision.media import PromptMedia

_Layout = tuple[
    list[tuple[tuple[int, ...], mx.Dtype]], list[tuple[tuple[int, ...], mx.Dtype]]
]  # (KV, recurrent)


class ModelRunner:
    """Runs one model. Owned by the engine thread (MLX is not shared across threads)."""

    def __init__(
        self,
        model,  # noqa: ANN001 - any HybridLM
        *,
        kernels: KernelOptions = KernelOptions(),  # noqa: B008 - frozen
        dtype: mx.Dtype | None = None,
        cpu_float32_bytes: int = 0,
        kv_bits: int | None = None,
    ) -> None:
        """`kernels`: which kernels and rewrites the model's layers use. `cpu_float32_bytes`: on the
        CPU device, how much float32 the model may take beyond its stored weights: floating weights
        cast to float32 (the CPU has no bf16 arithmetic) and dense copies of quantized weights for
        BLAS prefill (kernels/cpu_blas.py). `kv_bits`: attention K/V stored at 8 or 4 bits (None:
        in the activation dtype)."""
        self.model = model
        use_kernel_options(model, kernels)
        use_kv_bits(model, kv_bits)
        fuse_model(model)  # same-input projections as one mat-vec each (kapitsa.engine.loading.fuse)
        spare = _compute_in_float32(model, cpu_float32_bytes) if cpu_blas.on_cpu() else 0
        # per-row-count mat-muls on CUDA, BLAS prefill on the CPU (kapitsa.engine.ops.linear)
        route_quantized_linears(model, kernels, dense_copy_bytes=spare)
        if blas_steps_apply(kernels) and keeps_every_dense_copy(model):
            kernels = dataclasses.replace(kernels, cpu_blas_rows=cpu_blas.STEP_MIN_ROWS)
            use_kernel_options(model, kernels)  # the routed linears' too
            _keep_head_copy(model, spare - kept_dense_bytes(model))
        probe_enabled(kernels)  # the opt-in kernels' one-time checks evaluate: before any trace
        probe = model.make_cache(1)
        self.kv_layers = snapshot.kv_layer_ids(probe)
        # fixed-size state per sequence, checkpointed whole: recurrent layers and sliding windows
        self.recurrent_layers = snapshot.fixed_layer_ids(probe)
        self.dtype = dtype or _param_dtype(model)
        self._layout: _Layout | None = None  # state shapes and dtypes, measured by `state_sizes`
        self.images = ImageFeatures(model) if getattr(model, "takes_images", False) else None

    @classmethod
    def for_config(cls, model, config: EngineConfig) -> ModelRunner:  # noqa: ANN001 - any HybridLM
        """The runner an engine of `config` uses (its kernels, CPU float32 budget and KV bits)."""
        return cls(
            model, kernels=config.kernels, cpu_float32_bytes=config.cpu_float32_bytes, kv_bits=config.kv_bits
        )

    @property
    def state_key(self) -> str:
        """What a stored checkpoint's arrays depend on beyond the weights: dtype and K/V bits."""
        bits = getattr(self.model, "kv_bits", None)
        return str(self.dtype) if bits is None else f"{self.dtype}|kv{bits}"

    # forward

    def prefill(
        self, cache: HybridCache, tokens: Sequence[int], *, media: PromptMedia | None = None, start: int = 0
    ) -> mx.array:
        """Feed `tokens` to a batch-1 cache; return the logits after the last one ([V]). With
        `media` (the prompt's images), `tokens` are the prompt's tokens from `start` on."""
        return self.prefill_at(cache, tokens, [start + len(tokens)], media=media, start=start)[0]

    def prefill_at(
        self,
        cache: HybridCache,
        tokens: Sequence[int],
        ends: Sequence[int],
        *,
        media: PromptMedia | None = None,
        start: int = 0,
        tail: PromptTail | None = None,
    ) -> list[mx.array]:
        """`prefill` of the prompt's `tokens` from position `start`, returning the logits ([V])
        after each of `ends` (prompt positions in (start, start + len(tokens)]): a checkpoint
        inside the chunk keeps the next-token logits an exact hit resumes from. `tail` keeps the
        chunk's last rows that a drafter reads (prompt_tail.py)."""
        inputs = mx.array([list(tokens)], dtype=mx.int32)
        if tail is not None and not tail.wants(start + len(tokens)):
            tail = None  # a chunk the prompt's last `window` positions are all after
        taps = () if tail is None else tail.request.taps
        if media is None:
            out = self.model.forward(inputs, cache, taps=taps)
        else:
            cache.rope_deltas = [media.delta_after(start)]
            chunk = self.images.chunk(media, start, start + len(tokens))
            out = self.model.forward(inputs, cache, media=chunk, taps=taps)
            cache.rope_deltas = [media.delta_after(start + len(tokens))]
        rows = mx.array([end - start - 1 for end in ends], dtype=mx.int32)
        logits = self.model.logits(out.hidden[:, rows, :])[0]
        if tail is not None:
            self._keep_tail(tail, out, start + len(tokens))
        mx.eval(logits, *cache.state_arrays(), *([] if tail is None else tail.arrays()))
        return list(logits)

    def build_prefill(self, cache: HybridCache, tokens: Sequence[int]) -> mx.array:
        """`prefill`'s graph for a batch-1 cache, built and not evaluated (a long chunk's layers are
        not sent to the device one by one either: `device_queue.building`): building it hands the
        custom kernels it launches to the compile workers (kernels/cuda_disk_cache.py)."""
        with device_queue.building():
            out = self.model.forward(mx.array([list(tokens)], dtype=mx.int32), cache)
            return self.model.logits(out.hidden[:, mx.array([len(tokens) - 1], dtype=mx.int32), :])[0, 0]

    def _keep_tail(self, tail: PromptTail, out: ForwardOutput, end: int) -> None:
        """Hand `tail` the last rows of a batch-1 chunk forward that ends at prompt position `end`."""
        first = max(0, out.hidden.shape[1] - tail.request.window)
        normed = self.model.final_norm(out.hidden[0, first:]) if tail.request.normed else None
        # copies: a slice would keep the whole chunk's layer output alive while the tail waits
        tail.keep(end, normed, {i: mx.contiguous(out.taps[i][0, first:]) for i in tail.request.taps})

    def decode(self, cache: HybridCache, tokens: Sequence[int]) -> mx.array:
        """One token per row of the batch cache; returns logits [B, V]."""
        logits = self.decode_lazy(cache, mx.array(list(tokens), dtype=mx.int32))
        mx.eval(logits)
        return logits

    def decode_lazy(self, cache: HybridCache, tokens: mx.array) -> mx.array:
        """Like `decode` with the tokens as a (possibly still lazy) [B] array; nothing is evaluated."""
        return self.model(tokens[:, None], cache)[:, -1, :]

    # cache surgery

    def new_cache(self) -> HybridCache:
        return self.model.make_cache(1)

    def kv_span(self, cache: HybridCache, start: int, end: int) -> tuple[mx.array, ...]:
        """K and V of every attention layer for positions [start, end) of a batch-1 cache."""
        return snapshot.kv_span(cache, self.kv_layers, start, end)

    def recurrent_state(self, cache: HybridCache) -> tuple[mx.array, ...]:
        """(conv, state) of every recurrent layer and (keys, values) of every sliding window of a
        batch-1 cache, by reference."""
        return snapshot.fixed_state(cache, self.recurrent_layers)

    def restore(self, match: PrefixMatch, media: PromptMedia | None = None, *, room: int = 0) -> HybridCache:
        """A batch-1 cache holding `match.pos` tokens: KV copied in, recurrent state shared (and the
        rope delta the prompt's images leave there). `room`: the prompt's tokens still to prefill;
        the KV buffers are sized for them, so the K/V is copied here once and not again when the
        first forward would grow the buffers."""
        cache = self.model.make_cache(1)
        if media is not None:
            cache.rope_deltas = [media.delta_after(match.pos)]
        snapshot.fill(
            cache,
            pos=match.pos,
            kv=match.kv_spans,
            fixed=match.recurrent,
            kv_layers=self.kv_layers,
            fixed_layers=self.recurrent_layers,
            room=room,
        )
        mx.eval(*cache.state_arrays())
        return cache

    def check_stored(self, stored: StoredPrefix) -> None:
        """Raises ValueError when a disk checkpoint's arrays do not fit this model's batch-1 cache."""
        kv_ref, rec_ref = self._layout if self._layout is not None else self._measure_layout()
        if len(stored.recurrent) != len(rec_ref) or any(len(span) != len(kv_ref) for span in stored.kv_parts):
            raise ValueError("a checkpoint with the wrong number of state arrays")
        for array, (shape, dtype) in zip(stored.recurrent, rec_ref, strict=True):
            if tuple(array.shape) != shape or array.dtype != dtype:
                raise ValueError(f"recurrent state {array.shape} {array.dtype}, expected {shape} {dtype}")
        for span in stored.kv_parts:
            for array, (shape, dtype) in zip(span, kv_ref, strict=True):
                if array.ndim != len(shape) or _without_tokens(array.shape) != _without_tokens(shape):
                    raise ValueError(f"KV of shape {array.shape}, expected {shape} with any token count")
                if array.dtype != dtype:
                    raise ValueError(f"KV of dtype {array.dtype}, expected {dtype}")
        if self.kv_layers and sum(span[0].shape[KV_AXIS] for span in stored.kv_parts) != len(stored.tokens):
            raise ValueError("the KV does not cover the checkpoint's tokens")

    def _measure_layout(self) -> _Layout:
        self.state_sizes()
        assert self._layout is not None
        return self._layout

    # sizes

    def state_sizes(self) -> StateSizes:
        """Bytes per token of KV and bytes of one recurrent state, measured on a 1-token forward."""
        cache = self.model.make_cache(1)
        self.model(mx.array([[0]], dtype=mx.int32), cache)
        mx.eval(*cache.state_arrays())
        kv_per_token = 0
        for i in self.kv_layers:
            layer = cache.layers[i]
            assert isinstance(layer, KVCache) and layer.keys is not None
            kv_per_token += sum(a[:, :, :1].nbytes for a in layer.slots())
        self._layout = _state_layout(cache, self.kv_layers, self.recurrent_layers)
        hidden = int(getattr(getattr(self.model, "args", None), "hidden_size", 0) or 0)
        # prefill scratch per chunk token: a few float32 rows of hidden size (residual, MLP widening)
        activation = 16 * hidden * 4
        return StateSizes(kv_per_token, cache.recurrent_nbytes, activation)


def blas_steps_apply(kernels: KernelOptions) -> bool:
    """Whether the runner may turn on CPU BLAS decode steps: on the CPU, not already set, and not
    under exact_verify (whose promise is bits equal to the one-row step's across batch sizes)."""
    return cpu_blas.on_cpu() and not kernels.cpu_blas_rows and not kernels.exact_verify


def _keep_head_copy(model, budget: int) -> None:  # noqa: ANN001
    """Let a tied head keep its float32 copy for CPU BLAS steps when it fits `budget` bytes."""
    embedding = tied_embedding(model)
    if embedding is not None:
        embedding.keeps_dense_copy = cpu_blas.dense_bytes(embedding) <= budget


def _compute_in_float32(model, budget: int) -> int:  # noqa: ANN001
    """Cast the model's floating weights to float32 when the extra bytes fit `budget`; the bytes
    of budget left."""
    from mlx.utils import tree_flatten

    floats = [v for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)]
    extra = sum(v.size * (4 - v.dtype.size) for v in floats)
    if extra > budget:
        return budget
    if extra:
        model.set_dtype(mx.float32)
        mx.eval(model.parameters())
    return budget - extra


def _param_dtype(model) -> mx.Dtype:  # noqa: ANN001
    from mlx.utils import tree_flatten

    for _, value in tree_flatten(model.parameters()):
        if mx.issubdtype(value.dtype, mx.floating):
            return value.dtype
    return mx.float32


def _without_tokens(shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(d for axis, d in enumerate(shape) if axis != KV_AXIS)


def _state_layout(cache: HybridCache, kv_layers: list[int], recurrent_layers: list[int]) -> _Layout:
    """(shape, dtype) of each array `kv_span` and `recurrent_state` return, from a 1-token cache."""
    kv: list[tuple[tuple[int, ...], mx.Dtype]] = []
    for i in kv_layers:
        layer = cache.layers[i]
        assert isinstance(layer, KVCache) and layer.keys is not None and layer.values is not None
        kv += [(tuple(a[:, :, :1].shape), a.dtype) for a in layer.slots()]
    recurrent: list[tuple[tuple[int, ...], mx.Dtype]] = []
    for i in recurrent_layers:
        recurrent += [(tuple(a.shape), a.dtype) for a in snapshot.layer_state(cache.layers[i])]
    return kv, recurrent
