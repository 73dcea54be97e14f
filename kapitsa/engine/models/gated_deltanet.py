"""The Gated DeltaNet mixer of Qwen3.5 and Qwen3-Next: a causal conv, then the gated delta rule's
linear attention over a recurrent state, then a gated RMSNorm and the out-projection.

Four paths run the same math: a prefill or verify chunk op by op (or as one fused chain kernel),
a tree of draft tokens (its root-to-leaf paths as one batch of chains, ops/tree.py), a plain
decode step and a short chain as pure functions the decoder layer compiles (`decode`, `chain`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn

from kapitsa.engine import kernels
from kapitsa.engine.cache.layers import RecurrentCache, ReplayRecord, StepInfo
from kapitsa.engine.kernels.gdn import gdn_decode, gdn_step
from kapitsa.engine.kernels.gdn_prefill import gdn_chain
from kapitsa.engine.kernels.gdn_reference import gdn_step_reference, projection_views
from kapitsa.engine.loading.fuse import fuse_into, projections
from kapitsa.engine.ops.conv import causal_conv, conv_state_after
from kapitsa.engine.ops.gated_delta import gated_delta, gdn_decay, l2norm_qk
from kapitsa.engine.ops.linear import linear_plus, normed_linear
from kapitsa.engine.ops.norm import GatedRMSNorm
from kapitsa.engine.ops.tree import (
    gather_paths,
    gather_time,
    node_outputs,
    path_conv_in,
    path_recurrence,
    repeat_rows,
    tree_conv,
    tree_recurrence,
)
from kapitsa.engine.options import KernelOptions

if TYPE_CHECKING:
    from kapitsa.engine.models.qwen3_5_args import ModelArgs


class GatedDeltaNet(nn.Module):
    """Linear attention layer. Qwen3-Next packs the projections per key head (`in_proj_qkvz`,
    `in_proj_ba`); Qwen3.5 keeps them apart (`in_proj_qkv`, `_z`, `_b`, `_a`)."""

    kernel_options = KernelOptions()  # the engine's, given by use_kernel_options

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.nk, self.nv = a.linear_num_key_heads, a.linear_num_value_heads
        self.dk, self.dv = a.linear_key_head_dim, a.linear_value_head_dim
        self.kernel = a.linear_conv_kernel_dim
        key_dim, value_dim = self.nk * self.dk, self.nv * self.dv
        self.conv_dim = 2 * key_dim + value_dim
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False)
        self.packed = a.model_type == "qwen3_next"
        if self.packed:
            self.in_proj_qkvz = nn.Linear(a.hidden_size, 2 * key_dim + 2 * value_dim, bias=False)
            self.in_proj_ba = nn.Linear(a.hidden_size, 2 * self.nv, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(a.hidden_size, self.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(a.hidden_size, value_dim, bias=False)
            self.in_proj_b = nn.Linear(a.hidden_size, self.nv, bias=False)
            self.in_proj_a = nn.Linear(a.hidden_size, self.nv, bias=False)
        self.dt_bias = mx.ones((self.nv,))
        self.A_log = mx.zeros((self.nv,))
        self.norm = GatedRMSNorm(self.dv, a.rms_norm_eps)
        self.out_proj = nn.Linear(value_dim, a.hidden_size, bias=False)

    @property
    def _in_projections(self) -> tuple[str, ...]:
        if self.packed:
            return ("in_proj_qkvz", "in_proj_ba")
        return ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")

    def fuse(self) -> bool:
        """One in-projection for the layer (see kapitsa.engine.loading.fuse)."""
        return fuse_into(self, self._in_projections, "in_proj")

    def _project(self, x: mx.array):
        B, T, _ = x.shape
        outputs = projections(self, x, self._in_projections, "in_proj")
        if not self.packed:
            qkv, z, b, a = outputs
            return qkv, z.reshape(B, T, self.nv, self.dv), b, a
        per = self.nv // self.nk
        qkvz, ba = outputs
        q, k, v, z = mx.split(
            qkvz.reshape(B, T, self.nk, -1), [self.dk, 2 * self.dk, 2 * self.dk + per * self.dv], axis=-1
        )
        b, a = mx.split(ba.reshape(B, T, self.nk, 2 * per), [per], axis=-1)
        qkv = mx.concatenate([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], axis=-1)
        return qkv, z.reshape(B, T, self.nv, self.dv), b.reshape(B, T, self.nv), a.reshape(B, T, self.nv)

    def __call__(
        self, x: mx.array, info: StepInfo, cache: RecurrentCache | None, *, node_walk: bool = False
    ) -> mx.array:
        """`node_walk`: a tree's recurrence one node at a time (ops/tree.py `tree_recurrence`), the
        reference the path-batched tree routes are tested against."""
        B, T, _ = x.shape
        qkv, z, b, a = self._project(x)
        conv_state, s0 = (cache.conv, cache.state) if cache is not None else (None, None)
        if conv_state is None:
            conv_state, s0 = mx.zeros((B, self.kernel - 1, self.conv_dim), qkv.dtype), None
        conv_in = mx.concatenate([conv_state, qkv], axis=1)
        fused = kernels.enabled("gdn", self.kernel_options)
        if fused and info.parents is None:
            return self._chain_fused(conv_in, z, b, a, s0, info, cache)
        if fused and not node_walk:
            return self._tree_fused(conv_in, z, b, a, s0, info, cache)
        if info.parents is None:
            conv_out = causal_conv(conv_in, self.conv1d.weight)
        else:
            conv_out = tree_conv(conv_in, info.conv_windows(self.kernel), self.conv1d.weight)
        q, k, v = mx.split(nn.silu(conv_out), [self.nk * self.dk, 2 * self.nk * self.dk], axis=-1)
        q, k = l2norm_qk(q.reshape(B, T, self.nk, self.dk), k.reshape(B, T, self.nk, self.dk))
        v = v.reshape(B, T, self.nv, self.dv)
        g, beta = gdn_decay(self.A_log, a, self.dt_bias), mx.sigmoid(b)
        if s0 is None:
            s0 = mx.zeros((B, self.nv, self.dv, self.dk), mx.float32)
        inputs = (q, k, v, g, beta)
        if info.parents is None:
            y, state = gated_delta(*inputs, s0, info.recurrent_mask)
        elif node_walk:  # each node steps from its parent's state; the cache keeps s0 until commit_path
            y = tree_recurrence(
                lambda t, st: gated_delta(*(x[:, t : t + 1] for x in inputs), st), s0, info.parents
            )
        else:
            y = path_recurrence(
                lambda xs, mask, st: gated_delta(*xs, st, mask)[0], inputs, s0, info.tree_paths
            )
        if cache is not None:
            if info.parents is None:
                cache.conv, cache.state = conv_state_after(conv_in, info.kept, self.kernel), state
            if info.record:

                def replay(mask, order=None):
                    xs = inputs if order is None else tuple(gather_time(x, order) for x in inputs)
                    return gated_delta(*xs, s0, mask)[1]

                cache.record = ReplayRecord(conv_in, self.kernel, replay)
        return self.out_proj(self.norm(y, z).reshape(B, T, -1))

    def _fused(self, conv_in, z, b, a, s0, mask) -> tuple[mx.array, mx.array]:
        """The fused kernel over chains: (out `[B, T, Hv*Dv]`, state) from conv rows `[B, K-1+T, C]`."""
        return gdn_chain(
            conv_in, self.conv1d.weight, a, b, self.A_log, self.dt_bias, z, self.norm.weight, s0,
            **self._heads, norm_eps=self.norm.eps, mask=mask,
        )  # fmt: skip

    def _chain_fused(self, conv_in, z, b, a, s0, info: StepInfo, cache: RecurrentCache | None) -> mx.array:
        """A chain of tokens (prefill chunk, verification) through the fused kernel, any length
        (kernels/gdn_prefill.py); the rollback replay runs it again from s0 under its mask."""
        out, state = self._fused(conv_in, z, b, a, s0, info.recurrent_mask)
        if cache is not None:
            cache.conv, cache.state = conv_state_after(conv_in, info.kept, self.kernel), state
            if info.record:

                def replay(mask, order=None):
                    assert order is None, "a chain's replay takes its tokens in order"
                    return self._fused(conv_in, z, b, a, s0, mask)[1]

                cache.record = ReplayRecord(conv_in, self.kernel, replay)
        return self.out_proj(out)

    def _tree_fused(self, conv_in, z, b, a, s0, info: StepInfo, cache: RecurrentCache | None) -> mx.array:
        """A draft tree through the fused kernel in one call over its root-to-leaf paths (ops/tree.py),
        each node's output from the first path through it. The cache keeps s0 until commit_path,
        whose replay runs the kernel over the accepted path."""
        paths, K = info.tree_paths, self.kernel
        chains = (gather_paths(x, paths) for x in (z, b, a))
        out, _ = self._fused(path_conv_in(conv_in, K, paths), *chains, repeat_rows(s0, paths), paths.mask)
        if cache is not None and info.record:

            def replay(mask, order):
                rows, *picked = (gather_time(x, order) for x in (conv_in[:, K - 1 :], z, b, a))
                return self._fused(mx.concatenate([conv_in[:, : K - 1], rows], 1), *picked, s0, mask)[1]

            cache.record = ReplayRecord(conv_in, K, replay)
        return self.out_proj(node_outputs(out, paths))

    def decode(
        self,
        x: mx.array,
        conv_state: mx.array,
        s0: mx.array,
        *,
        norm: nn.Module | None = None,
        residual: mx.array | None = None,
    ) -> tuple[mx.array, mx.array, mx.array]:
        """Plain decode step as a pure function: (x, conv rows, state) -> (out, conv rows, state);
        of norm(x) when `norm` is given, and residual + out when `residual` is.

        One fused kernel (conv, q/k norms, gated delta rule, gated output norm; kernels/gdn.py)
        where the backend has it, the same math in MLX ops elsewhere. With the fused
        in-projection, z/b/a are read in place from its output, and the input norm and the
        residual add can run inside the projections' one-row mat-vecs (ops/linear.py)."""
        rows, z, b, a = self._step_projection(x, norm)
        out, conv_state, state = gdn_decode(
            conv_state, rows, self.conv1d.weight, a, b, self.A_log, self.dt_bias, z, self.norm.weight, s0,
            **self._heads, norm_eps=self.norm.eps, fused=kernels.enabled("gdn", self.kernel_options),
        )  # fmt: skip
        y = self.out_proj(out) if residual is None else linear_plus(self.out_proj, out, residual)
        return y, conv_state, state

    @property
    def _fused_in_proj(self) -> bool:
        return "in_proj" in self and not self.packed

    def _step_projection(self, x: mx.array, norm: nn.Module | None) -> tuple[mx.array, ...]:
        """(rows, z, b, a) of a decode step or chain, of norm(x) when `norm` is given. With the
        fused in-projection (Qwen3.5) rows is its whole output, the conv rows its first C columns
        and z/b/a views into it, the norm inside its one-row mat-vec where the route takes it;
        otherwise rows is the conv rows alone."""
        if self._fused_in_proj:
            rows = self.in_proj(x) if norm is None else normed_linear(norm, self.in_proj, x)
            return rows, *projection_views(rows, packed=False, **self._heads)
        return self._project(x if norm is None else norm(x))

    def _step(self):
        """The fused kernel where the `gdn` family is on (it falls back itself off-GPU), else the
        model's op-by-op math: one choice for decode, chains and their replays."""
        return gdn_step if kernels.enabled("gdn", self.kernel_options) else gdn_step_reference

    def chain(
        self,
        x: mx.array,
        conv_state: mx.array,
        s0: mx.array,
        *,
        norm: nn.Module | None = None,
        residual: mx.array | None = None,
    ) -> tuple[mx.array, ...]:
        """T tokens of a chain (no padding) through the fused kernel, as a pure function:
        (out, conv_in, state, *replay inputs) — the fused projection, or z, b, a (`chain_record`).
        Of norm(x) when `norm` is given, residual + out when `residual` is: the calls `decode`
        makes, so a verify's rows take the decode step's routes where they are exact
        (KernelOptions.exact_verify)."""
        rows, z, b, a = self._step_projection(x, norm)
        if self._fused_in_proj:  # the replay reads z, b, a from the projection again
            qkv, extra = rows[..., : self.conv_dim], (rows,)
        else:
            qkv, extra = rows, (z, b, a)
        conv_in = mx.concatenate([conv_state, qkv], axis=1)
        out, state = self._step()(
            conv_in, self.conv1d.weight, a, b, self.A_log, self.dt_bias, z, self.norm.weight, s0,
            **self._heads, norm_eps=self.norm.eps,
        )  # fmt: skip
        y = self.out_proj(out) if residual is None else linear_plus(self.out_proj, out, residual)
        return (y, conv_in, state, *extra)  # out: [B, T, Hv*Dv]

    def chain_record(self, conv_in: mx.array, s0: mx.array, extra: list[mx.array]) -> ReplayRecord:
        """The rollback record of a `chain` call: the kernel again from s0 under the kept mask."""
        args = (conv_in, s0, *extra)

        def replay(mask, order=None):
            assert order is None, "a chain's replay takes its tokens in order"
            return self.chain_replay(mask, *args)

        return ReplayRecord(conv_in, self.kernel, replay, fn=self.chain_replay, args=args)

    def chain_replay(self, mask: mx.array, conv_in: mx.array, s0: mx.array, *extra: mx.array) -> mx.array:
        """The state after the masked tokens of a `chain` call (its conv rows, s0 and projection)."""
        z, b, a = projection_views(extra[0], packed=False, **self._heads) if len(extra) == 1 else extra
        return self._step()(
            conv_in, self.conv1d.weight, a, b, self.A_log, self.dt_bias, z, self.norm.weight, s0,
            **self._heads, norm_eps=self.norm.eps, mask=mask,
        )[1]  # fmt: skip

    @property
    def _heads(self) -> dict[str, int]:
        return dict(num_k_heads=self.nk, num_v_heads=self.nv, head_k_dim=self.dk, head_v_dim=self.dv)
