"""Starting this process's rank: join the group, load its shard, then serve (rank 0) or follow."""

from __future__ import annotations

from kapitsa.engine.distributed.engine import GroupEngine
from kapitsa.engine.distributed.follower import follow
from kapitsa.engine.distributed.group import barrier, init_group
from kapitsa.engine.distributed.loading import LoadedShard, load_shard
from kapitsa.engine.distributed.shard import PipelineShard, Shard
from kapitsa.engine.distributed.speculation import GroupSpeculation, group_speculates
from kapitsa.engine.options import KernelOptions


def make_shard(loaded: LoadedShard, group, parallel: str, kernels: KernelOptions) -> Shard:  # noqa: ANN001
    """The runnable shard of a loaded part (tensor parallel runs its layers' plain paths)."""
    if parallel == "tensor":
        from kapitsa.engine.distributed.tensor import TensorShard, tensor_kernels

        return TensorShard(loaded.model, group, loaded.layer_ids, tensor_kernels(kernels))
    return PipelineShard(loaded.model, group, loaded.layer_ids, kernels)


def start_rank(
    source: str,
    *,
    parallel: str,
    model_id: str | None = None,
    kernels: KernelOptions = KernelOptions(),  # noqa: B008 - frozen
    speculative: str | None = None,
    draft_tokens: int | None = None,
    prefix_cache_bytes: int | None = None,
) -> GroupEngine | None:
    """Join the group mlx.launch started, load this rank's shard of `source`.

    `speculative` is the `--speculative` mode (speculation.GROUP_SPECULATIVE_MODES; None: the
    default, n-gram drafting) and `draft_tokens` the longest draft; only rank 0 reads them, the
    other ranks take each step's shape from its command. `prefix_cache_bytes` bounds rank 0's saved
    states (prefix.py; 0: none, None: a quarter of the memory left next to its weights); every rank
    keeps its own shard of the same states.

    Returns:
        On rank 0 the running `GroupEngine` (its `close()` stops the group); on the other ranks
        None, once rank 0 has stopped the group (they follow its steps until then).
    """
    group = init_group()
    loaded = load_shard(source, group=group, parallel=parallel, model_id=model_id)
    shard = make_shard(loaded, group, parallel, kernels)
    barrier(group, what="startup")
    if group.is_driver:
        speculation = GroupSpeculation(draft_tokens) if group_speculates(speculative) else None
        return GroupEngine(shard, loaded, speculation=speculation, prefix_cache_bytes=prefix_cache_bytes)
    follow(shard, group)
    return None
