"""What one rank holds of the model and how it runs one step of the group's forward.

`PipelineShard`: a contiguous range of layers; hidden states go rank to rank (`send`/`recv`),
the last rank sends its last position back to rank 0, which holds the embedding and the head.
`TensorShard` (tensor.py): every layer, each with a slice of its heads and columns.
A step runs `[B, T]` tokens: a prompt chunk or a verify (B = 1), or a batched decode step (one
token per row, each row at its own offset). Both give rank 0 each row's next-token logits `[B, V]`;
the other ranks get None. A recorded step (a speculative verify, B = 1) keeps replay records on
every rank and gives rank 0 every position's logits `[T, V]`, so the pipeline's last rank sends
all T hidden states back, not just the last.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from kapitsa.engine.cache.hybrid import HybridCache
from kapitsa.engine.distributed.caches import RankCaches
from kapitsa.engine.distributed.group import Group, evaluate
from kapitsa.engine.distributed.saved import SavedStates
from kapitsa.engine.kernels import cpu_blas
from kapitsa.engine.loading.fuse import fuse_model
from kapitsa.engine.models.base import use_kernel_options
from kapitsa.engine.ops.linear import route_quantized_linears
from kapitsa.engine.options import KernelOptions


def layer_range(num_layers: int, rank: int, size: int) -> range:
    """Rank `rank`'s layers: contiguous, the first `num_layers % size` ranks one layer more."""
    base, extra = divmod(num_layers, size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


class Shard:
    """One rank's part of the model, made ready to run as the single-process engine runs it."""

    def __init__(self, model: nn.Module, group: Group, layers: list[int], kernels: KernelOptions) -> None:
        self.model, self.group, self.layer_ids = model, group, layers
        use_kernel_options(model, kernels)
        fuse_model(model)
        if cpu_blas.on_cpu():  # the CPU has no bf16 arithmetic: compute in float32, as ModelRunner does
            model.set_dtype(mx.float32)
        route_quantized_linears(model, kernels)
        mx.eval(model.parameters())
        self.dtype = _activation_dtype(model)
        self.saved = SavedStates(self.new_cache())
        self.caches = RankCaches(self.saved, self.new_cache)

    @property
    def local_layers(self) -> list[nn.Module]:
        all_layers = self.model.layers
        return [all_layers[i] for i in self.layer_ids]

    def new_cache(self) -> HybridCache:
        return HybridCache([self.model.make_layer_cache(layer) for layer in self.local_layers], 1)

    def run_layers(self, h: mx.array, cache: HybridCache, record: bool = False) -> mx.array:
        info = cache.begin(h.shape[1], record=record)
        for layer, layer_cache in zip(self.local_layers, cache.layers, strict=True):
            h = layer(h, info, layer_cache)
        cache.end(info)
        return h

    def head_logits(self, h: mx.array, record: bool = False) -> mx.array:
        """`[B, V]` of each row's last position, or `[T, V]` float32 of every position for a verify."""
        if record:
            return self.model.logits(h)[0].astype(mx.float32)
        return self.model.logits(h[:, -1:])[:, -1]


class PipelineShard(Shard):
    """Layers `layer_ids` (contiguous); rank 0 also embeds and computes the logits."""

    def step(self, cache: HybridCache, rows: list[list[int]], record: bool = False) -> mx.array | None:
        g, B, T = self.group, len(rows), len(rows[0])
        hidden_size = self.model.args.hidden_size
        if g.is_driver:
            h = self.model.backbone_parts()[0](mx.array(rows, dtype=mx.int32)).astype(self.dtype)
        else:
            h = mx.distributed.recv_like(
                mx.zeros((B, T, hidden_size), self.dtype), g.prev_rank, group=g.handle
            )
            if record:
                # replay records keep lazy pieces of this pass that the outputs do not need; left
                # hanging off the recv, a rollback that evaluates them would run the recv again
                # and wait for a send that never comes
                evaluate(h, what="a forward")
        h = self.run_layers(h, cache, record)
        last_rank = g.rank == g.size - 1
        if g.size == 1:
            logits = self.head_logits(h, record)
            evaluate(logits, *cache.state_arrays(), what="a forward")
            return logits
        back = T if record else 1  # the positions whose logits rank 0 needs
        sent = mx.distributed.send(h[:, -back:] if last_rank else h, g.next_rank, group=g.handle)
        evaluate(sent, *cache.state_arrays(), what="a forward")
        if not g.is_driver:
            return None
        template = mx.zeros((B, back, hidden_size), self.dtype)
        last = mx.distributed.recv_like(template, g.size - 1, group=g.handle)
        logits = self.head_logits(last, record)
        evaluate(logits, what="a forward")
        return logits


def _activation_dtype(model: nn.Module) -> mx.Dtype:
    from mlx.utils import tree_flatten

    for _, value in tree_flatten(model.parameters()):
        if mx.issubdtype(value.dtype, mx.floating):
            return value.dtype
    return mx.float32
