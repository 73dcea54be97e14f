"""What every kapitsa model module shares: config parsing, attention, and the forward protocol.

Model module contract (the loader relies on it):

- `ModelArgs.from_dict(config: dict)` takes config.json as published (unknown keys ignored).
- `Model(args)` is an `nn.Module` with
  - `__call__(inputs [B, T] int32, cache: HybridCache | None = None, *, lengths=None,
    record=False) -> logits [B, T, V]`;
  - `forward(...)` with the same arguments (plus `taps`) -> `ForwardOutput` holding the hidden
    states before the final norm (and chosen layers' outputs, for drafters); `logits(hidden)`
    turns pre-norm hidden states into logits, `final_norm(hidden)` applies the last norm only;
  - `sanitize(weights) -> weights`: the only place that renames or reshapes checkpoint tensors;
  - `last_hidden(hidden, lengths)` -> each row's last real position (ragged prefill logits);
  - `make_cache(batch_size=1) -> HybridCache`, `layers`, `model_type`, `args`;
  - `state_bytes(dtype) -> (recurrent bytes per sequence, KV bytes per token)`;
  - `quant_predicate(path, module) -> bool | dict` (False: keep unquantized; a dict overrides
    group size / bits) and `cast_predicate(path) -> bool` (False: keep the stored float32).
- `lengths[b]` (host ints) is how many tokens of row b are real (right padding); see cache/layers.py.
- `record=True` keeps what `cache.rollback(n)` needs to drop the last n[b] tokens by replay.
- MTP: Qwen models get `model.mtp` (+ `mtp_forward`, `mtp_logits`, `make_mtp_cache`) when the
  checkpoint ships `mtp.*`; Nemotron keeps them in `model.mtp_weights`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from kapitsa.engine import kernels
from kapitsa.engine.cache.hybrid import HybridCache
from kapitsa.engine.cache.layers import KVCache, LayerCache, RecurrentCache, StepInfo, full_step
from kapitsa.engine.cache.quantized_kv import QuantizedKVCache, quantize_kv_layers
from kapitsa.engine.kernels import attn_prep, cpu_blas
from kapitsa.engine.kernels.attention import decode_attention
from kapitsa.engine.kernels.attention import probe as attention_probe
from kapitsa.engine.kernels.attention import usable as attention_usable
from kapitsa.engine.loading.fuse import fuse_into, normed_projections, projections
from kapitsa.engine.models.media import MediaChunk
from kapitsa.engine.ops import device_queue, prefill_attention
from kapitsa.engine.ops.linear import linear_plus, normed_linear, rows_apart
from kapitsa.engine.ops.rope import Rope
from kapitsa.engine.options import KernelOptions
from kapitsa.engine.traces import compiled
from kapitsa.errors import CheckpointError


def known_fields(cls: type, params: dict[str, Any]) -> dict[str, Any]:
    """The entries of `params` that are fields of dataclass `cls` (config.json has many extras)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in params.items() if k in names}


def require(cond: bool, message: str) -> None:
    if not cond:
        raise CheckpointError(message)


@dataclass
class ForwardOutput:
    hidden: mx.array  # [B, T, hidden] output of the last layer, before the final norm
    taps: dict[int, mx.array] = field(default_factory=dict)  # layer index -> that layer's output


class Attention(nn.Module):
    """Grouped-query attention over a ragged `KVCache`.

    `gated`: q_proj also emits a per-head output gate (Qwen3.5: out * sigmoid(gate)).
    `qk_norm_eps`: RMS-normalise q and k per head (Qwen). `rope`: None means no positions (Nemotron-H).
    """

    kernel_options = KernelOptions()  # the engine's, given by use_kernel_options

    def __init__(
        self,
        hidden: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        *,
        bias: bool = False,
        gated: bool = False,
        qk_norm_eps: float | None = None,
        rope: Rope | None = None,
    ):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.gated = heads, kv_heads, head_dim, gated
        self.scale = head_dim**-0.5
        self.q_proj = nn.Linear(hidden, heads * head_dim * (2 if gated else 1), bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=bias)
        if qk_norm_eps is not None:
            self.q_norm = nn.RMSNorm(head_dim, eps=qk_norm_eps)
            self.k_norm = nn.RMSNorm(head_dim, eps=qk_norm_eps)
        self.rope = rope

    PROJECTIONS = ("q_proj", "k_proj", "v_proj")

    def fuse(self) -> bool:
        """One q/k/v projection (see kapitsa.engine.loading.fuse)."""
        return fuse_into(self, self.PROJECTIONS, "qkv_proj")

    def project(
        self, x: mx.array, norm: nn.Module | None = None
    ) -> tuple[mx.array, mx.array, mx.array, mx.array | None]:
        """q, k `[B, H, T, D]` (normed, not rotated), v `[B, Hkv, T, D]`, and the output gate, of
        x or of norm(x) (`norm`: the layer's input norm, fused into the projection at decode)."""
        B, T, _ = x.shape
        if norm is None:
            q, k, v = projections(self, x, self.PROJECTIONS, "qkv_proj")
        else:
            q, k, v = normed_projections(self, norm, x, self.PROJECTIONS, "qkv_proj")
        q = q.reshape(B, T, self.heads, -1)
        gate = None
        if self.gated:
            q, gate = mx.split(q, 2, axis=-1)
            gate = gate.reshape(B, T, -1)
        k = k.reshape(B, T, self.kv_heads, self.head_dim)
        v = v.reshape(B, T, self.kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        if "q_norm" in self:
            q, k = self.q_norm(q), self.k_norm(k)
        return q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v, gate

    def project_rotated(
        self, x: mx.array, offsets: mx.array, norm: nn.Module | None = None
    ) -> tuple[mx.array, mx.array, mx.array, mx.array | None]:
        """`project` then `rotate` at `offsets`. With kernel family "attn", fused projections and
        a short step (decode, verification chains), the split, norms and rotations are one kernel
        after the projection (kernels/attn_prep.py): ~30 fewer primitives per layer on CUDA."""
        spec = self.prep_spec
        if (
            spec is not None
            and "qkv_proj" in self
            and kernels.enabled("attn", self.kernel_options)
            and attn_prep.usable(x.shape[1], x.dtype, spec)
        ):
            qkv = self.qkv_proj(x) if norm is None else normed_linear(norm, self.qkv_proj, x)
            norms = (self.q_norm.weight, self.k_norm.weight) if spec.eps is not None else (None, None)
            inv_freq = None if self.rope is None else self.rope.inv_freq
            return attn_prep.prep(qkv, offsets, spec, *norms, inv_freq)
        q, k, v, gate = self.project(x, norm=norm)
        q, k = self.rotate(q, k, offsets)
        return q, k, v, gate

    @functools.cached_property
    def prep_spec(self) -> attn_prep.PrepSpec | None:
        """The prep kernel's description of this layer, or None where it does not apply (a rope
        with YaRN's magnitude scale). Made once: every decode step's probe check reads it."""
        if self.rope is not None and self.rope.mscale != 1.0:
            return None
        return attn_prep.PrepSpec(
            heads=self.heads,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            gated=self.gated,
            eps=self.q_norm.eps if "q_norm" in self else None,
            rotary_dims=0 if self.rope is None else self.rope.dims,
        )

    def attend(
        self, q: mx.array, k: mx.array, v: mx.array, info: StepInfo, cache: KVCache | None
    ) -> mx.array:
        """Write k/v to the cache, attend; `[B, T, H*D]`."""
        if cache is not None:
            k, v = cache.update(k, v, info)
            if isinstance(cache, QuantizedKVCache):
                return cache.attention(q, k, v, info, scale=self.scale)
        return self._sdpa(q, k, v, info)

    def _sdpa(self, q: mx.array, k: mx.array, v: mx.array, info: StepInfo) -> mx.array:
        B, _, T, _ = q.shape
        mask = info.attention_mask
        out = _cpu_attention(q, k, v, self.scale, mask) if cpu_blas.attention_takes(q, k, mask) else None
        if out is None and (rows := prefill_attention.block_rows(q, k)) is not None:
            out = prefill_attention.attention_in_blocks(q, k, v, scale=self.scale, mask=mask, rows=rows)
        if out is None:
            out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return out.transpose(0, 2, 1, 3).reshape(B, T, -1)

    def attend_step(
        self, q: mx.array, k: mx.array, v: mx.array, info: StepInfo, cache: KVCache, gate: mx.array | None
    ) -> tuple[mx.array, tuple[mx.array, ...]]:
        """`attend` for a compiled decode step -> (output, the gate still to apply, if any). With
        kernel family "attn", one query token per row and a head size MLX's CUDA backend has no
        fast kernel for, attention is kapitsa's decode kernel (kernels/attention.py), which also
        applies the output gate, and the step's K/V row goes to the cache's tail (`append_row`)."""
        if info.T == 1 and getattr(cache, "has_tail", False) and self._decode_kernel_takes(q, info, cache):
            keys, values, committed, tail_keys, tail_values = cache.append_row(k, v, info)
            out = decode_attention(
                q, keys, values, _row_lengths(info, 0), scale=self.scale, gate=gate,
                tail=(tail_keys, tail_values), committed=committed,
            )  # fmt: skip
            return out, ()
        keys, values = cache.update(k, v, info)
        if isinstance(cache, QuantizedKVCache):
            return cache.attention(q, keys, values, info, scale=self.scale), (() if gate is None else (gate,))
        if self.kernel_options.exact_verify and info.T > 1 and info.parents is None:
            kernel = self._decode_kernel_takes(q[:, :, :1], info, cache)  # a verify row's decode step
            return self._attend_as_decode_steps(q, keys, values, info, cache, gate, kernel)
        return self._sdpa(q, keys, values, info), (() if gate is None else (gate,))

    def _decode_kernel_takes(self, q_row: mx.array, info: StepInfo, cache: KVCache) -> bool:
        """Whether a decode step of query `q_row` `[B, Hq, 1, D]` runs kapitsa's attention kernel
        (asked before the step's write: the cache's buffers as they are say the shape and dtype)."""
        keys, values = cache.buffers()
        return (
            kernels.enabled("attn", self.kernel_options)
            and info.parents is None
            and keys is not None
            and attention_usable(q_row, keys, values)
        )

    def _attend_as_decode_steps(
        self, q, keys, values, info: StepInfo, cache: KVCache, gate, decode_kernel: bool
    ) -> tuple[mx.array, tuple[mx.array, ...]]:
        """A verify's query rows one at a time, each over the keys a decode step at its position
        sees (the batch's step t: every row's offset + t, its mask where offsets differ) and
        through the call that step makes (KernelOptions.exact_verify): the same kernel on the same
        inputs, so the same bits. One attention call per token."""
        rows = []
        for t in range(info.T):
            if decode_kernel:
                rows.append(
                    decode_attention(
                        q[:, :, t : t + 1], cache.keys, cache.values, _row_lengths(info, t),
                        scale=self.scale, gate=None if gate is None else gate[:, t : t + 1],
                    )
                )  # fmt: skip
            else:
                step = StepInfo(1, [1] * q.shape[0], [offset + t for offset in info.offsets])
                length = step.kv_len
                rows.append(self._sdpa(q[:, :, t : t + 1], keys[:, :, :length], values[:, :, :length], step))
        out = mx.concatenate(rows, axis=1)
        return out, (() if decode_kernel or gate is None else (gate,))

    def finish(self, out: mx.array, gate: mx.array | None, residual: mx.array | None = None) -> mx.array:
        """The output projection of the gated attention output (+ `residual`, fused at decode)."""
        if gate is not None:
            out = out * mx.sigmoid(gate)
        return self.o_proj(out) if residual is None else linear_plus(self.o_proj, out, residual)

    def rotate(self, q: mx.array, k: mx.array, offsets: int | mx.array) -> tuple[mx.array, mx.array]:
        """q, k at positions `offsets[b] + t` (no-op without rope)."""
        if self.rope is None:
            return q, k
        return self.rope(q, offsets), self.rope(k, offsets)

    def __call__(self, x: mx.array, info: StepInfo, cache: KVCache | None) -> mx.array:
        q, k, v, gate = self.project(x)
        if self.rope is not None and info.positions is not None:  # image tokens (an `MRope`)
            q, k = self.rope.at_axes(q, info.positions), self.rope.at_axes(k, info.positions)
        elif self.rope is not None and info.parents is not None:
            q, k = (
                self.rope.at_positions(q, info.tree_positions),
                self.rope.at_positions(k, info.tree_positions),
            )
        else:
            q, k = self.rotate(q, k, info.rope_offsets)
        return self.finish(self.attend(q, k, v, info, cache), gate)


def _row_lengths(info: StepInfo, t: int) -> int | list[int]:
    """The keys a decode step at token `t` of this forward attends over: one count for every row,
    or one per row where the rows' offsets differ."""
    if info.uniform_offsets:
        return info.offsets[0] + t + 1
    return [offset + t + 1 for offset in info.offsets]


def _cpu_attention(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: object) -> mx.array | None:
    try:
        if isinstance(mask, mx.array):
            return cpu_blas.attention(q, k, v, scale=scale, causal=False, mask=mask)
        return cpu_blas.attention(q, k, v, scale=scale, causal=mask is not None)
    except cpu_blas.Traced:
        return None


# -- compiled decode steps ------------------------------------------------------------------
# On MLX's GPU backends a decode step costs host time per op (graph building in Python, then the
# backend encoding each kernel); measured on the H200 that is most of a 27B token
# (lab/runs/decode-h200.md). So plain decode steps (one token per row, no padding, no draft tree,
# no replay record) run each layer as `mx.compile`d functions of (hidden, state) -> (hidden,
# state): traced once per batch size, elementwise chains fused, no Python per op afterwards.
# KernelOptions.compile_decode False turns it off (the uncompiled path is the same math, op for op).
# A trace captures the layer's weight arrays as they are when it is made: code that replaces
# weights afterwards must drop the layer's `_compiled_steps` (fuse_model does).


def use_kernel_options(model: nn.Module, options: KernelOptions) -> None:
    """Give every layer that picks kernels (a `kernel_options` class attribute) the engine's options."""
    for _, module in model.named_modules():
        if hasattr(type(module), "kernel_options"):
            module.kernel_options = options


def _blas_step(info: StepInfo, options: KernelOptions) -> bool:
    """A CPU step whose linears take BLAS (KernelOptions.cpu_blas_rows): op by op, as a compiled
    trace cannot read its inputs on the host."""
    return cpu_blas.steps_by_blas(len(info.lengths), info.T, options.cpu_blas_rows)


def fast_decode(info: StepInfo, cache: LayerCache, options: KernelOptions) -> bool:
    """Whether this layer call may take the compiled decode path."""
    if not options.compile_decode or not info.plain_decode or _blas_step(info, options):
        return False
    if isinstance(cache, RecurrentCache):
        return cache.conv is not None and cache.state is not None
    return True


# Short chains (speculative verification: T <= CHAIN_MAX_T tokens per row, none padded, no tree)
# take compiled functions too, one trace per T; a verify forward op by op costs ~2.8 compiled decode
# steps of host time on the H200 (lab/runs/decode-h200.md). Replay records are built outside
# the traced functions from arrays they return.
CHAIN_MAX_T = 16
# Rows (batch x tokens) from which a forward runs layer by layer on a GPU. The device holds each
# queued op's transients (the chunk's activations, CUDA's prefill route's dense copies of the
# weights) until the work they belong to is done, and the host queues a whole chunk long before the
# device finishes its first layers: a prefill chunk sent as one graph holds most layers' transients
# at once. Each layer is sent as it is built and the host waits for the one before it, so at most
# two layers' are held and the device never idles. Decode steps and verifies (few rows) stay one graph.
LAYER_QUEUE_ROWS = 256


def _on_gpu() -> bool:
    return mx.default_device().type == mx.gpu


def _queue_layer(h: mx.array, rows: int, previous: mx.array | None) -> mx.array | None:
    """Send layer output `h` to the device and wait for `previous` (the last one sent); returns
    what was sent, None when this forward stays one graph."""
    if rows < LAYER_QUEUE_ROWS or not _on_gpu():
        return None
    return device_queue.send(h, previous)


def fast_chain(info: StepInfo, cache: LayerCache, options: KernelOptions) -> bool:
    """Whether this layer call may take the compiled short-chain path (T > 1)."""
    if not options.compile_decode or info.parents is not None or info.ragged or not 1 < info.T <= CHAIN_MAX_T:
        return False
    if info.positions is not None:  # multi-axis rope positions: the layer's plain path rotates them
        return False
    if isinstance(cache, RecurrentCache):
        return cache.conv is not None and cache.state is not None
    return True


def compiled_attention(
    owner: object, attn: Attention, x: mx.array, info: StepInfo, cache: KVCache, pre, post
):  # noqa: ANN001
    """Attention layer decode: compiled `pre(x, offsets) -> (q, k, v[, gate])`, the cache write
    and attention (shapes grow every step, so not compiled), compiled `post(x, out[, gate])`."""
    if kernels.enabled(
        "attn", attn.kernel_options
    ):  # the kernels' one-time probes (they evaluate: before tracing)
        spec = attn.prep_spec
        if spec is not None:
            attn_prep.probe(spec, x.dtype)
        attention_probe()
    parts = compiled(owner, "pre", pre)(x, info.offsets_array)
    gate = parts[3] if len(parts) > 3 else None
    out, rest = attn.attend_step(parts[0], parts[1], parts[2], info, cache, gate)
    name = "post_gate_applied" if gate is not None and not rest else "post"  # one trace per arity
    return compiled(owner, name, post)(x, out, *rest)


def tied_embedding(model: HybridLM) -> nn.Module | None:
    """The embedding `model`'s head reads (tied word embeddings: `head()` is its `as_linear`), or None."""
    owner = getattr(model.head(), "__self__", None)
    return owner if isinstance(owner, (nn.Embedding, nn.QuantizedEmbedding)) else None


class HybridLM(nn.Module):
    """Forward protocol shared by the families. Subclasses provide `backbone_parts()` ->
    (embedding, layers, final norm), `head()` -> (embedding-as-linear or lm_head), and
    `make_layer_cache(layer)`; each layer is called as `layer(h, info, layer_cache)`."""

    kv_bits: int | None = None  # attention K/V stored at 8 or 4 bits (use_kv_bits); None: as computed
    kernel_options = KernelOptions()  # the engine's, given by use_kernel_options (exact_verify: logits)

    def __call__(
        self,
        inputs: mx.array,
        cache: HybridCache | None = None,
        *,
        lengths: list[int] | None = None,
        record: bool = False,
        parents: list[list[int]] | None = None,
    ) -> mx.array:
        return self.logits(
            self.forward(inputs, cache, lengths=lengths, record=record, parents=parents).hidden
        )

    def forward(
        self,
        inputs: mx.array,
        cache: HybridCache | None = None,
        *,
        lengths: list[int] | None = None,
        record: bool = False,
        taps: tuple[int, ...] = (),
        parents: list[list[int]] | None = None,
        media: MediaChunk | None = None,
    ) -> ForwardOutput:
        """`parents` (per row, preorder; needs a cache) verifies a draft tree: every node sees its
        ancestors only, nothing is held until `cache.commit_path(paths)`. `media` (batch 1) puts
        image features in place of image tokens' embeddings and gives their rope positions."""
        embed, layers, _ = self.backbone_parts()
        if inputs.ndim != 2:
            raise ValueError(f"inputs must be [batch, tokens], got shape {inputs.shape}")
        B, T = inputs.shape
        if cache is None:
            if parents is not None:
                raise ValueError("tree verification needs a cache")
            info = full_step(B, T, lengths)
        else:
            if cache.batch_size != B:
                raise ValueError(f"cache holds {cache.batch_size} sequences, inputs has {B} rows")
            info = cache.begin(T, lengths, record, parents)
        h = embed(inputs)
        if media is not None:
            h, info.positions = media.splice(h), media.positions
        out = ForwardOutput(h)
        queued = None
        for i, layer in enumerate(layers):
            h = layer(h, info, None if cache is None else cache[i])
            queued = _queue_layer(h, B * T, queued)
            if i in taps:
                out.taps[i] = h
        if cache is not None:
            cache.end(info)
        out.hidden = h
        return out

    @staticmethod
    def last_hidden(hidden: mx.array, lengths: list[int] | None = None) -> mx.array:
        """`[B, 1, H]`: each row's hidden state at its last real token (right-padded batches), so
        a prefill computes logits for one position per row instead of all T."""
        if lengths is None:
            return hidden[:, -1:]
        ends = mx.array([max(n, 1) - 1 for n in lengths], dtype=mx.int32)
        return mx.take_along_axis(hidden, ends[:, None, None], axis=1)

    def final_norm(self, hidden: mx.array) -> mx.array:
        return self.backbone_parts()[2](hidden)

    def logits(self, hidden: mx.array) -> mx.array:
        """Pre-norm hidden states `[..., hidden]` -> logits `[..., vocab]`; with exact_verify a
        verify's rows through the head one row per product (rows_apart), as decode steps' are."""
        normed = self.final_norm(hidden)
        if self.kernel_options.exact_verify:
            return rows_apart(self.head(), normed)
        blas_rows = self.kernel_options.cpu_blas_rows  # 0 off the CPU: nothing more asked per step
        if blas_rows and cpu_blas.takes_step_rows(normed, blas_rows):
            tied = tied_embedding(self)  # a CPU step's rows through BLAS, as its linears'
            if getattr(tied, "keeps_dense_copy", False):
                logits = cpu_blas.linear(tied, normed, keep=True)
                if logits is not None:
                    return logits
        return self.head()(normed)

    def make_cache(self, batch_size: int = 1) -> HybridCache:
        layers = [self.make_layer_cache(layer) for layer in self.layers]
        return HybridCache(quantize_kv_layers(layers, self.kv_bits), batch_size)

    def state_bytes(self, dtype: mx.Dtype = mx.bfloat16) -> tuple[int, int]:
        """(recurrent bytes per sequence, KV bytes per token) for activations of `dtype`, from the
        layer shapes alone (recurrent state is float32). For admission control before any forward."""
        recurrent = kv = 0
        for c in self.make_cache(1).layers:
            if isinstance(c, RecurrentCache):
                recurrent += math.prod(c.conv_shape) * dtype.size + math.prod(c.state_shape) * 4
            elif isinstance(c, KVCache):
                kv += c.bytes_per_token(dtype)
        return recurrent, kv

    def cast_predicate(self, path: str) -> bool:
        return not any(s in path for s in ("A_log", "e_score_correction_bias"))
