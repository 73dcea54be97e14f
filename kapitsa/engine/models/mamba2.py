"""The Mamba-2 mixer of Nemotron-H: in-projection, a causal conv over x/B/C, the selective state
space scan (chunked at prefill), a group-gated RMSNorm and the out-projection.

Like the Gated DeltaNet mixer it runs a chunk op by op, a tree of draft tokens (its root-to-leaf
paths as one batch of chains, ops/tree.py), and a plain decode step or a short chain as pure
functions the block compiles (`decode`, `chain`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn

from kapitsa.engine import kernels
from kapitsa.engine.cache.layers import RecurrentCache, ReplayRecord, StepInfo
from kapitsa.engine.kernels.mamba import mamba_step, mamba_step_reference
from kapitsa.engine.ops.conv import causal_conv, conv_state_after
from kapitsa.engine.ops.linear import linear_plus, normed_linear
from kapitsa.engine.ops.norm import GroupGatedRMSNorm
from kapitsa.engine.ops.ssm import ssm_dt, ssm_scan
from kapitsa.engine.ops.tree import gather_time, path_recurrence, tree_conv, tree_recurrence
from kapitsa.engine.options import KernelOptions

if TYPE_CHECKING:
    from kapitsa.engine.models.nemotron_h_args import ModelArgs


class Mamba2Mixer(nn.Module):
    kernel_options = KernelOptions()  # the engine's, given by use_kernel_options

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.heads, self.head_dim, self.state_size = a.mamba_num_heads, a.mamba_head_dim, a.ssm_state_size
        self.groups, self.kernel, self.limit = a.n_groups, a.conv_kernel, a.time_step_limit
        self.inner = self.heads * self.head_dim
        self.conv_dim = self.inner + 2 * self.groups * self.state_size
        self.in_proj = nn.Linear(a.hidden_size, self.inner + self.conv_dim + self.heads, bias=a.use_bias)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=a.use_conv_bias
        )
        self.dt_bias = mx.ones((self.heads,))
        self.A_log = mx.zeros((self.heads,))
        self.D = mx.ones((self.heads,))
        self.norm = GroupGatedRMSNorm(self.inner, a.layer_norm_epsilon, self.inner // self.groups)
        self.out_proj = nn.Linear(self.inner, a.hidden_size, bias=a.use_bias)

    def __call__(
        self, x: mx.array, info: StepInfo, cache: RecurrentCache | None, *, node_walk: bool = False
    ) -> mx.array:
        """`node_walk`: a tree's recurrence one node at a time (ops/tree.py `tree_recurrence`), the
        reference the path-batched tree route is tested against."""
        B, T, _ = x.shape
        gate, xbc, dt = mx.split(self.in_proj(x), [self.inner, self.inner + self.conv_dim], axis=-1)
        conv_state, s0 = (cache.conv, cache.state) if cache is not None else (None, None)
        if conv_state is None:
            conv_state, s0 = mx.zeros((B, self.kernel - 1, self.conv_dim), xbc.dtype), None
        conv_in = mx.concatenate([conv_state, xbc], axis=1)
        bias = self.conv1d.get("bias")
        if info.parents is None:
            conv_out = causal_conv(conv_in, self.conv1d.weight, bias)
        else:
            conv_out = tree_conv(conv_in, info.conv_windows(self.kernel), self.conv1d.weight, bias)
        xs, Bm, Cm = mx.split(
            nn.silu(conv_out), [self.inner, self.inner + self.groups * self.state_size], axis=-1
        )
        xs = xs.reshape(B, T, self.heads, self.head_dim)
        Bm = Bm.reshape(B, T, self.groups, self.state_size)
        Cm = Cm.reshape(B, T, self.groups, self.state_size)
        step = ssm_dt(dt, self.dt_bias, self.limit, info.recurrent_mask)  # 0 on padding: state frozen
        if s0 is None:
            s0 = mx.zeros((B, self.heads, self.head_dim, self.state_size), mx.float32)
        if info.parents is None:
            y, state = ssm_scan(xs, step, self.A_log, Bm, Cm, self.D, s0, chunk=self.kernel_options.ssd_chunk)
        else:  # the cache keeps s0 until commit_path
            y = self._tree_scan((xs, step, Bm, Cm), s0, info, node_walk)
        if cache is not None:
            if info.parents is None:
                cache.conv, cache.state = conv_state_after(conv_in, info.kept, self.kernel), state
            if info.record:

                def replay(mask, order=None):
                    x_, dt_, b_, c_ = (
                        (xs, step, Bm, Cm)
                        if order is None
                        else (gather_time(a, order) for a in (xs, step, Bm, Cm))
                    )
                    return ssm_scan(
                        x_,
                        dt_ * mask[..., None],
                        self.A_log,
                        b_,
                        c_,
                        self.D,
                        s0,
                        chunk=self.kernel_options.ssd_chunk,
                    )[1]

                cache.record = ReplayRecord(conv_in, self.kernel, replay)
        return self.out_proj(self.norm(y.reshape(B, T, self.inner), gate))

    def _tree_scan(
        self, inputs: tuple[mx.array, ...], s0: mx.array, info: StepInfo, node_walk: bool
    ) -> mx.array:
        """y `[B, T, H, P]` of a draft tree: one chunked scan over its root-to-leaf paths
        (ops/tree.py), or with `node_walk` one step per node from its parent's state."""
        if not node_walk:
            return path_recurrence(self._path_scan, inputs, s0, info.tree_paths)

        def node(t: int, st: mx.array):
            xs, step, Bm, Cm = (x[:, t : t + 1] for x in inputs)
            return ssm_scan(xs, step, self.A_log, Bm, Cm, self.D, st)

        return tree_recurrence(node, s0, info.parents)

    def _path_scan(self, inputs: tuple[mx.array, ...], mask: mx.array | None, s0: mx.array) -> mx.array:
        xs, step, Bm, Cm = inputs
        step = step if mask is None else step * mask[..., None]  # dt = 0: padding leaves the state alone
        return ssm_scan(xs, step, self.A_log, Bm, Cm, self.D, s0, chunk=self.kernel_options.ssd_chunk)[0]

    def decode(
        self, x: mx.array, conv_state: mx.array, s0: mx.array, **fused
    ) -> tuple[mx.array, mx.array, mx.array]:
        """Plain decode step as a pure function: (x, conv rows, state) -> (out, conv rows, state).

        One fused kernel (conv, SSM update, gated group norm; kernels/mamba.py) where the backend
        has it, the same math in MLX ops elsewhere. `fused`: as `chain`'s."""
        out, conv_in, state, _ = self.chain(x, conv_state, s0, **fused)
        return out, conv_in[:, x.shape[1] :], state

    def chain(
        self,
        x: mx.array,
        conv_state: mx.array,
        s0: mx.array,
        *,
        norm: nn.Module | None = None,
        residual: mx.array | None = None,
    ) -> tuple[mx.array, ...]:
        """T tokens of a chain (no padding) as a pure function: (out, conv_in, state, dt), the
        last two what `chain_record` needs to replay the recurrence. Of norm(x) when `norm` is
        given, residual + out when `residual` is (both inside the one-row mat-vecs at decode)."""
        proj = self.in_proj(x) if norm is None else normed_linear(norm, self.in_proj, x)
        gate, xbc, dt = mx.split(proj, [self.inner, self.inner + self.conv_dim], axis=-1)
        conv_in = mx.concatenate([conv_state, xbc], axis=1)
        out, state = self._step_fn()(
            conv_in, self.conv1d.weight, self.conv1d.get("bias"), dt, self.dt_bias, self.A_log, self.D,
            gate, self.norm.weight, s0, **self._dims,
        )  # fmt: skip
        y = self.out_proj(out) if residual is None else linear_plus(self.out_proj, out, residual)
        return y, conv_in, state, dt

    def chain_record(self, conv_in: mx.array, s0: mx.array, dt: mx.array) -> ReplayRecord:
        """The rollback record of a `chain` call: the scan's inputs are rebuilt from the conv rows
        and dt (as `__call__` computes them) only if a rollback happens."""

        def replay(mask, order=None):
            assert order is None, "a chain's replay takes its tokens in order"
            return self.chain_replay(mask, conv_in, s0, dt)

        return ReplayRecord(conv_in, self.kernel, replay, fn=self.chain_replay, args=(conv_in, s0, dt))

    def chain_replay(self, mask: mx.array, conv_in: mx.array, s0: mx.array, dt: mx.array) -> mx.array:
        """The state after the masked tokens of a `chain` call, from its conv rows, s0 and dt: the
        chain's own step function under the mask (dt = 0 on dropped tokens), so the state equals
        decoding only the kept tokens bit for bit, as a chunked scan would not."""
        B, T = dt.shape[:2]
        gate = mx.zeros((B, T, self.inner), conv_in.dtype)  # the output is not read, only the state
        return self._step_fn()(
            conv_in, self.conv1d.weight, self.conv1d.get("bias"), dt, self.dt_bias, self.A_log, self.D,
            gate, self.norm.weight, s0, **self._dims, mask=mask,
        )[1]  # fmt: skip

    def _step_fn(self):
        """The fused kernel where the `mamba` family is on (it falls back itself where none runs),
        else the op-by-op step: one choice for decode steps, chains and their replays."""
        return mamba_step if kernels.enabled("mamba", self.kernel_options) else mamba_step_reference

    @property
    def _dims(self) -> dict:
        return dict(
            heads=self.heads, head_dim=self.head_dim, groups=self.groups, state_size=self.state_size,
            time_step_limit=self.limit, norm_eps=self.norm.eps,
        )  # fmt: skip
