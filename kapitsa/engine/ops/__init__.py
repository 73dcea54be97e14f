"""Building blocks shared by the hybrid model families.

Every op has a plain MLX-ops reference (`*_reference`) that defines its meaning, and the
function the models call, which may take a faster path (a fused `mx.fast` kernel, a chunked
form). Tests in `tests/ops/` pin each fast path to its reference.
"""
