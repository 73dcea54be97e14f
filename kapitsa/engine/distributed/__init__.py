"""One model across several processes (machines) on MLX's distributed layer.

Rank 0 decides every step (what to prefill, what to decode) and broadcasts it as a small int
array (control.py); every rank runs the same forward on its shard: a contiguous range of layers
(pipeline parallel, stage.py) or a slice of every layer's heads, columns and experts (tensor
parallel, tensor.py). Rank 0 serves the `EngineClient` (engine.py), the others follow
(follower.py). Rank 0 indexes the prefix cache's saved states (prefix.py), every rank holds its
shard of them (saved.py). A lost peer is an error on rank 0 and a stop everywhere (group.py).
"""
