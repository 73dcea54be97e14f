"""Tensor parallel: every rank runs every layer on a slice of its heads, columns and experts.

Column-parallel projections keep the rows of this rank's heads (q/k/v, the Gated DeltaNet and
Mamba-2 in-projections, gate/up), row-parallel ones keep the matching input columns and are
summed over the group (`all_sum`) right after (o_proj, out_proj, down_proj). Routed experts are
split whole, E/n per rank; a MoE block (its shared expert sliced like an MLP) is summed once.
Attention K/V and recurrent states are then per-rank slices by head, as their projections are.
When there are fewer KV heads (key heads) than ranks, a rank keeps the one its query heads read.

A layout that does not divide over the group is an `UnsupportedModel` error before any tensor is
read (Qwen3-Next packs its projections per key head: its key heads must divide). Biases of row-parallel maps stay on rank 0 only, so the sum adds them once.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import mlx.nn as nn

from kapitsa.engine.cache.hybrid import HybridCache
from kapitsa.engine.distributed.group import Group, evaluate
from kapitsa.engine.distributed.shard import Shard
from kapitsa.engine.models.base import Attention
from kapitsa.engine.models.gated_deltanet import GatedDeltaNet
from kapitsa.engine.models.mamba2 import Mamba2Mixer
from kapitsa.engine.options import KernelOptions
from kapitsa.errors import UnsupportedModel

_FFN_PAIRS = {("gate_proj", "up_proj"): "down_proj", ("up_proj",): "down_proj"}
_MOE_SHARED = ("shared_expert", "shared_experts")


def tensor_kernels(kernels: KernelOptions) -> KernelOptions:
    """Plain op-by-op layer paths: the sums sit between a projection and its residual add, which
    the compiled steps and fused kernels would join."""
    return dataclasses.replace(
        kernels,
        families=frozenset(),
        fused_parts=frozenset(),
        compile_decode=False,
        fold_shared_experts=False,
    )


class SummedLinear(nn.Module):
    """A row-parallel linear: this rank's partial product, summed over the group."""

    def __init__(self, linear: nn.Module, group: Group) -> None:
        super().__init__()
        self.linear = linear
        object.__setattr__(self, "_group", group)  # not a parameter

    def __call__(self, x: mx.array) -> mx.array:
        return mx.distributed.all_sum(self.linear(x), group=self._group.handle)


class SummedBlock(nn.Module):
    """A MoE block whose experts and shared expert are this rank's slice; summed over the group."""

    def __init__(self, block: nn.Module, group: Group) -> None:
        super().__init__()
        self.block = block
        object.__setattr__(self, "_group", group)

    def __call__(self, x: mx.array) -> mx.array:
        return mx.distributed.all_sum(self.block(x), group=self._group.handle)


class LocalExperts(nn.Module):
    """Experts [first, first + count) of a routed stack; rows routed elsewhere come out zero."""

    def __init__(self, experts: nn.Module, first: int, count: int) -> None:
        super().__init__()
        self.experts = experts
        self.first, self.count = first, count

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        local = indices - self.first
        mine = (local >= 0) & (local < self.count)
        out = self.experts(x, mx.clip(local, 0, self.count - 1))
        return out * mine[..., None].astype(out.dtype)


class TensorShard(Shard):
    """Every layer, each on this rank's slice; every rank embeds, rank 0 computes the logits."""

    def step(self, cache: HybridCache, rows: list[list[int]], record: bool = False) -> mx.array | None:
        h = self.model.backbone_parts()[0](mx.array(rows, dtype=mx.int32)).astype(self.dtype)
        h = self.run_layers(h, cache, record)
        if not self.group.is_driver:
            evaluate(h, *cache.state_arrays(), what="a forward")
            return None
        logits = self.head_logits(h, record)
        evaluate(logits, *cache.state_arrays(), what="a forward")
        return logits


def shard_tensor_parallel(model: nn.Module, group: Group) -> None:
    """Cut every layer of `model` (loaded lazily) down to this rank's slice, in place."""
    if group.size == 1:
        return
    kv_heads = None
    for layer in model.layers:
        for name, child in list(layer.children().items()):
            if isinstance(child, Attention):
                kv_heads = _shard_attention(child, group)
            elif isinstance(child, GatedDeltaNet):
                _shard_gdn(child, group)
            elif isinstance(child, Mamba2Mixer):
                _shard_mamba(child, group)
            elif isinstance(child, nn.Module) and "switch_mlp" in child:
                layer[name] = _shard_moe(child, group)
            elif isinstance(child, nn.Module) and _ffn_names(child) is not None:
                _shard_ffn(child, group, summed=True)
    if kv_heads is not None:
        model.args.num_key_value_heads = kv_heads  # the KV caches make_layer_cache builds


# -- slicing helpers ---------------------------------------------------------------------------


def _part(total: int, group: Group, what: str) -> tuple[int, int]:
    if total % group.size:
        raise UnsupportedModel(f"--parallel tensor: {total} {what} do not split over {group.size} ranks")
    size = total // group.size
    return group.rank * size, (group.rank + 1) * size


def _shared_heads(q_first: int, q_total: int, kv_total: int, group: Group, what: str) -> tuple[int, int]:
    """The KV (key) heads a rank's query (value) heads starting at `q_first` read."""
    if kv_total % group.size == 0:
        return _part(kv_total, group, what)
    if group.size % kv_total:
        raise UnsupportedModel(f"--parallel tensor: {kv_total} {what} do not split over {group.size} ranks")
    head = q_first // (q_total // kv_total)
    return head, head + 1


def _rows(linear: nn.Module, ranges: list[tuple[int, int]], total: int) -> None:
    """Keep output rows `ranges` (of `total`) of a linear, float or quantized."""
    for key, value in list(linear.parameters().items()):
        if isinstance(value, mx.array) and value.ndim >= 1 and value.shape[0] == total:
            linear[key] = _own(mx.concatenate([value[a:b] for a, b in ranges], axis=0))


def _cols(linear: nn.Module, start: int, end: int, total: int, group: Group) -> None:
    """Keep input columns [start, end) of `total`; packed and grouped arrays scale with their width."""
    for key in ("weight", "scales", "biases"):
        if key in linear:
            value = linear[key]
            width = value.shape[-1]
            if (start * width) % total or (end * width) % total:
                raise UnsupportedModel("--parallel tensor: a quantization group straddles two ranks' columns")
            linear[key] = _own(value[..., start * width // total : end * width // total])
    if "bias" in linear and not group.is_driver:
        linear["bias"] = mx.zeros_like(linear["bias"])


def _channels(array: mx.array, ranges: list[tuple[int, int]]) -> mx.array:
    return _own(mx.concatenate([array[a:b] for a, b in ranges], axis=0))


def _own(part: mx.array) -> mx.array:
    """A copy: a slice is a view that keeps its whole tensor alive (the rank would hold it all)."""
    return mx.contiguous(part)


# -- per-module sharding -------------------------------------------------------------------------


def _shard_attention(attn: Attention, group: Group) -> int:
    H, K, D = attn.heads, attn.kv_heads, attn.head_dim
    q0, q1 = _part(H, group, "attention heads")
    k0, k1 = _shared_heads(q0, H, K, group, "KV heads")
    block = D * (2 if attn.gated else 1)  # a gated q_proj holds [q | gate] per head
    _rows(attn.q_proj, [(q0 * block, q1 * block)], H * block)
    _rows(attn.k_proj, [(k0 * D, k1 * D)], K * D)
    _rows(attn.v_proj, [(k0 * D, k1 * D)], K * D)
    _cols(attn.o_proj, q0 * D, q1 * D, H * D, group)
    attn.o_proj = SummedLinear(attn.o_proj, group)
    if "softmax_offset" in attn:  # Flint's sinks, one per head
        attn.softmax_offset = _own(attn.softmax_offset[q0:q1])
    attn.heads, attn.kv_heads = q1 - q0, k1 - k0
    return k1 - k0


def _shard_gdn(gdn: GatedDeltaNet, group: Group) -> None:
    nk, nv, dk, dv = gdn.nk, gdn.nv, gdn.dk, gdn.dv
    if gdn.packed:  # Qwen3-Next: [q | k | v | z] and [b | a] per key head, so whole key heads split
        k0, k1 = _part(nk, group, "linear-attention key heads (packed per key head)")
        v0, v1 = k0 * (nv // nk), k1 * (nv // nk)
    else:
        v0, v1 = _part(nv, group, "linear-attention value heads")
        k0, k1 = _shared_heads(v0, nv, nk, group, "linear-attention key heads")
    key_dim = nk * dk
    channels = [
        (k0 * dk, k1 * dk),
        (key_dim + k0 * dk, key_dim + k1 * dk),
        (2 * key_dim + v0 * dv, 2 * key_dim + v1 * dv),
    ]
    gdn.conv1d.weight = _channels(gdn.conv1d.weight, channels)
    if gdn.packed:
        per_head = 2 * dk + 2 * (nv // nk) * dv
        _rows(gdn.in_proj_qkvz, [(k0 * per_head, k1 * per_head)], nk * per_head)
        _rows(gdn.in_proj_ba, [(2 * v0, 2 * v1)], 2 * nv)
    else:
        _rows(gdn.in_proj_qkv, channels, gdn.conv_dim)
        _rows(gdn.in_proj_z, [(v0 * dv, v1 * dv)], nv * dv)
        _rows(gdn.in_proj_b, [(v0, v1)], nv)
        _rows(gdn.in_proj_a, [(v0, v1)], nv)
    gdn.dt_bias, gdn.A_log = _own(gdn.dt_bias[v0:v1]), _own(gdn.A_log[v0:v1])
    _cols(gdn.out_proj, v0 * dv, v1 * dv, nv * dv, group)
    gdn.out_proj = SummedLinear(gdn.out_proj, group)
    gdn.nk, gdn.nv = k1 - k0, v1 - v0
    gdn.conv_dim = 2 * gdn.nk * dk + gdn.nv * dv


def _shard_mamba(m: Mamba2Mixer, group: Group) -> None:
    P, N, inner = m.head_dim, m.state_size, m.inner
    h0, h1 = _part(m.heads, group, "Mamba-2 heads")
    g0, g1 = _part(m.groups, group, "Mamba-2 groups (its norm is per group)")
    xbc = [
        (h0 * P, h1 * P),
        (inner + g0 * N, inner + g1 * N),
        (inner + m.groups * N + g0 * N, inner + m.groups * N + g1 * N),
    ]
    rows = [(h0 * P, h1 * P), *((inner + a, inner + b) for a, b in xbc)]
    rows.append((inner + m.conv_dim + h0, inner + m.conv_dim + h1))
    _rows(m.in_proj, rows, inner + m.conv_dim + m.heads)
    for key in ("weight", "bias"):
        if key in m.conv1d:
            m.conv1d[key] = _channels(m.conv1d[key], xbc)
    m.dt_bias, m.A_log, m.D = (_own(a[h0:h1]) for a in (m.dt_bias, m.A_log, m.D))
    m.norm.weight = _own(m.norm.weight[h0 * P : h1 * P])
    _cols(m.out_proj, h0 * P, h1 * P, inner, group)
    m.out_proj = SummedLinear(m.out_proj, group)
    m.heads, m.groups = h1 - h0, g1 - g0
    m.inner = m.heads * P
    m.conv_dim = m.inner + 2 * m.groups * N


def _ffn_names(ffn: nn.Module) -> tuple[tuple[str, ...], str] | None:
    for column_names, row_name in _FFN_PAIRS.items():
        if all(n in ffn for n in (*column_names, row_name)):
            return column_names, row_name
    return None


def _shard_ffn(ffn: nn.Module, group: Group, *, summed: bool) -> None:
    names = _ffn_names(ffn)
    assert names is not None
    column_names, row_name = names
    hidden = ffn[column_names[0]].weight.shape[0]
    c0, c1 = _part(hidden, group, "MLP columns")
    for name in column_names:
        _rows(ffn[name], [(c0, c1)], hidden)
    _cols(ffn[row_name], c0, c1, hidden, group)
    if summed:
        ffn[row_name] = SummedLinear(ffn[row_name], group)


def _shard_moe(moe: nn.Module, group: Group) -> SummedBlock:
    experts = moe.switch_mlp
    total = next(v for v in experts.parameters().values() for v in v.values()).shape[0]
    e0, e1 = _part(total, group, "routed experts")
    for proj in experts.children().values():
        for key, value in list(proj.parameters().items()):
            proj[key] = _own(value[e0:e1])
    moe.switch_mlp = LocalExperts(experts, e0, e1 - e0)
    for name in _MOE_SHARED:
        if name in moe:
            _shard_ffn(moe[name], group, summed=False)
    if "fc2_latent_proj" in moe and "bias" in moe.fc2_latent_proj and not group.is_driver:
        moe.fc2_latent_proj.bias = mx.zeros_like(moe.fc2_latent_proj.bias)
    return SummedBlock(moe, group)
