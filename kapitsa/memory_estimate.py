"""How much memory a hybrid model needs, and how much context fits in a given budget.

memory = weights + KV per token × context + recurrent state (fixed per sequence)
         + recurrent checkpoints kept by the prefix cache + activation workspace + headroom
         (the larger of a prefill chunk's and, for vision models, one image encoding's)
         + one attention layer's K/V again (a cache update writes the new buffer before the old one goes)
         + the disk tier's read-ahead buffers (prefetch)
         + with quantized K/V: one block of a prefill chunk's attention scores (see below)

Only the attention layers grow with context. Gated DeltaNet and Mamba-2 layers hold a fixed state
per sequence (fp32 SSM state plus bf16 conv window, as in mlx-lm and ../shared/docs/hybrid-engine.md
§4), and every prefix-cache checkpoint costs one more copy of it: the sequence's own (system prompt,
turn, periodic ones) and the newest two (reply end and turn end) of each resident conversation.

K/V quantized to 8 or 4 bits (`kv_bits`) take fewer bytes per token, but the quantized attention
(engine/cache/quantized_kv.py) materialises float32 scores, one per query head, prompt position and
context position (fused attention over float K/V never does); it runs a prefill chunk's positions in
blocks whose scores stay under SCORES_BLOCK_BYTES, which the estimate budgets once.

On a GPU (`backend` "metal" or "cuda") a prefill chunk's activations follow the layer shapes
instead of the CPU's rule of thumb: the engine sends one layer at a time and waits for the one
before it (models/base.py), and the backend keeps every op's buffers until the command buffer that
holds it completes, so a few layers' intermediates are alive at once, all of them
(GPU_LAYERS_IN_FLIGHT). On CUDA a layer's prefill mat-muls also run on dense copies of its weights
(ops/linear.py, ops/moe.py). Attention over head sizes MLX has no fused kernel for (Qwen3.5's 256)
materialises its scores, which the engine bounds by running a long chunk's query rows in blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from kapitsa.catalog import Architecture
from kapitsa.engine.options import READ_AHEAD_BYTES, SCORES_BLOCK_BYTES

Verdict = Literal["fits", "tight", "too_big"]

KV_BYTES = 2  # bf16 K and V
STATE_BYTES = 4  # SSM state stays fp32 (bf16 drifts)
CONV_BYTES = 2
DEFAULT_CHECKPOINTS = 4  # e.g. system prompt + tools, last user turn, two periodic (hybrid-engine.md §5.7)
DEFAULT_RESIDENT_CONVERSATIONS = 4  # EngineConfig.resident_conversations
CHECKPOINTS_PER_RESIDENT = 2  # a resident conversation's reply end and turn end (engine/cache/resident.py)
SCORE_BYTES = 4  # the quantized attention's scores are float32
DEFAULT_PREFILL_CHUNK = 2048
HEADROOM_BYTES = 1 << 30  # the rest of the process, allocator fragmentation
# Layers whose intermediates are alive at once in a GPU prefill (models/base._queue_layer): the one
# being encoded, the one running, and the one just waited for, whose buffers return only when its
# command buffer's completion handler has run (H200, lab/runs/memory-fit-h200-s17.log: the peak
# window's bytes match three layers, not two)
GPU_LAYERS_IN_FLIGHT = 3
SCORE_BLOCKS_IN_FLIGHT = 2  # ops/prefill_attention.py: a block is sent, the one before waited for
# CUDA's prefill routes (kept equal to ops/linear.py and ops/moe.py by tests/unit/test_gpu_prefill_estimate.py)
DENSE_COPY_MIN_ROWS = 384  # a linear's rows from which it multiplies a dense copy of its weight
DENSE_COPY_MAX_BYTES = 1 << 30  # the largest such copy
EXPERT_COPY_MIN_ROWS = 512  # token-expert rows from which a MoE layer copies its expert stacks
EXPERT_COPY_MAX_BYTES = 3 << 30
# MLX's fused prefill attention per backend (kept equal to ops/prefill_attention.py by a test)
FUSED_PREFILL_HEAD_DIMS = {"metal": (64, 80, 128), "cuda": (64, 96, 128)}
EXPERT_STACKS = 3  # gate, up, down (Nemotron's relu^2 experts have two: the estimate takes three)
COMFORTABLE_CONTEXT = 65536  # coding agents send 20k+ tokens on the first turn (real-agents.md §2)
MINIMUM_CONTEXT = 8192


@dataclass(slots=True, frozen=True)
class MemoryEstimate:
    usable_bytes: int
    weights_bytes: int
    kv_bytes_per_token: int
    state_bytes: int  # recurrent state of one sequence
    checkpoint_bytes: int
    workspace_bytes: int
    headroom_bytes: int
    max_context: int  # tokens that fit, capped at the model's context window
    verdict: Verdict
    kv_bits: int | None = None  # K/V quantized to 8 or 4 bits; None: bf16
    prefetch_bytes: int = 0  # the disk tier's read-ahead buffers
    scores_bytes: int = 0  # quantized K/V only: one block of the prefill's attention scores

    @property
    def fixed_bytes(self) -> int:
        """Everything that does not grow with the context."""
        return (
            self.weights_bytes
            + self.state_bytes
            + self.checkpoint_bytes
            + self.workspace_bytes
            + self.headroom_bytes
            + self.prefetch_bytes
            + self.scores_bytes
        )


def kv_bytes_per_token(arch: Architecture, dtype_bytes: int = KV_BYTES, *, kv_bits: int | None = None) -> int:
    """K and V of every attention layer for one token; `kv_bits` 8 or 4: quantized as the engine
    stores them (packed words plus a `dtype_bytes` scale and bias per group, cache/quantized_kv.py)."""
    if kv_bits is None:
        return arch.attention_layers * 2 * arch.num_kv_heads * arch.head_dim * dtype_bytes
    row = arch.head_dim * kv_bits // 8 + 2 * (arch.head_dim // kv_group_size(arch.head_dim)) * dtype_bytes
    return arch.attention_layers * 2 * arch.num_kv_heads * row


def kv_group_size(head_dim: int) -> int:
    """The engine's quantization group for a head size: 64 where it divides it, else 32."""
    return 64 if head_dim % 64 == 0 else 32


def gdn_layer_state_bytes(arch: Architecture, conv_bytes: int = CONV_BYTES) -> int:
    ssm = arch.linear_value_heads * arch.linear_value_dim * arch.linear_key_dim * STATE_BYTES
    conv_channels = (
        2 * arch.linear_key_heads * arch.linear_key_dim + arch.linear_value_heads * arch.linear_value_dim
    )
    return ssm + (arch.conv_kernel - 1) * conv_channels * conv_bytes


def mamba_layer_state_bytes(arch: Architecture, conv_bytes: int = CONV_BYTES) -> int:
    ssm = arch.mamba_heads * arch.mamba_head_dim * arch.mamba_state_size * STATE_BYTES
    conv_channels = arch.mamba_heads * arch.mamba_head_dim + 2 * arch.mamba_groups * arch.mamba_state_size
    return ssm + (arch.conv_kernel - 1) * conv_channels * conv_bytes


def recurrent_state_bytes(arch: Architecture, conv_bytes: int = CONV_BYTES) -> int:
    """Fixed per-sequence state of all recurrent layers (= the size of one prefix-cache checkpoint)."""
    return arch.linear_layers * gdn_layer_state_bytes(
        arch, conv_bytes
    ) + arch.mamba_layers * mamba_layer_state_bytes(arch, conv_bytes)


def update_transient_bytes(
    arch: Architecture, context_tokens: int, dtype_bytes: int = KV_BYTES, *, kv_bits: int | None = None
) -> int:
    """A K/V update produces the layer's new buffer while the old one is still alive: one layer's K/V extra."""
    if arch.attention_layers == 0:
        return 0
    return kv_bytes_per_token(arch, dtype_bytes, kv_bits=kv_bits) // arch.attention_layers * context_tokens


def weights_bytes(arch: Architecture, bits_per_weight: float) -> int:
    return int(arch.params_b * 1e9 * bits_per_weight / 8)


def workspace_bytes(arch: Architecture, prefill_chunk: int = DEFAULT_PREFILL_CHUNK) -> int:
    """Activations of one prefill chunk plus the last position's fp32 logits.

    Rule of thumb: about 16 hidden-sized fp32 buffers per chunk token are alive at the peak of a block
    (residual, norms, q/k/v or GDN projections, the MLP's gate and up halves).
    """
    return prefill_chunk * arch.hidden_size * 4 * 16 + arch.vocab_size * 4 * 2


def gpu_backend(name: str) -> str | None:
    """The `backend` the estimate takes for a doctor's backend name: "cuda" or "metal", else None."""
    return name if name in ("cuda", "metal") else None


def knows_layer_shapes(arch: Architecture) -> bool:
    """Whether `arch` carries what `gpu_layer_bytes` needs (catalog entries without it fall back to
    the rule of thumb)."""
    return arch.attention_heads > 0 and (arch.mlp_width > 0 or arch.moe_layers > 0)


def _mixer_widths(arch: Architecture) -> list[tuple[int, int]]:
    """(input projection width, output projection's input width) of each kind of token mixer."""
    gated = arch.linear_layers > 0  # Qwen3.5 / Qwen3-Next attention projects a gate beside q
    heads = arch.attention_heads * arch.head_dim
    widths = [(heads * (2 if gated else 1) + 2 * arch.num_kv_heads * arch.head_dim, heads)]
    if arch.linear_layers:
        value = arch.linear_value_heads * arch.linear_value_dim
        keys = arch.linear_key_heads * arch.linear_key_dim
        widths.append((2 * keys + 2 * value + 2 * arch.linear_value_heads, value))
    if arch.mamba_layers:
        inner = arch.mamba_heads * arch.mamba_head_dim
        widths.append((2 * inner + 2 * arch.mamba_groups * arch.mamba_state_size + arch.mamba_heads, inner))
    return widths


def gpu_layer_bytes(
    arch: Architecture, prefill_chunk: int, dtype_bytes: int = KV_BYTES, *, cuda: bool
) -> int:
    """The intermediates of one layer (the widest kind) at a prefill chunk on a GPU. Per token: six
    hidden-sized buffers (norms, residual adds, projections' outputs), the mixer's input projection
    twice (its output and the convolution's / split's copies), its output, and the MLP's gate, up
    and product. On CUDA (`cuda`) also the dense copies of the layer's weights its prefill
    mat-muls take, each up to DENSE_COPY_MAX_BYTES, and a MoE layer's expert stacks."""
    H, mlp = arch.hidden_size, arch.mlp_width
    worst = 0
    for into, out in _mixer_widths(arch):
        per_token = 6 * H + 2 * into + out + 3 * mlp
        total = prefill_chunk * per_token * dtype_bytes
        if cuda and prefill_chunk >= DENSE_COPY_MIN_ROWS:
            weights = (H * into, out * H, 2 * H * mlp, mlp * H)
            total += sum(n * dtype_bytes for n in weights if n * dtype_bytes <= DENSE_COPY_MAX_BYTES)
        worst = max(worst, total)
    return worst + (_expert_copy_bytes(arch, prefill_chunk, dtype_bytes) if cuda else 0)


def _expert_copy_bytes(arch: Architecture, prefill_chunk: int, dtype_bytes: int) -> int:
    """One MoE layer's expert stacks copied dense for a prefill chunk on CUDA (ops/moe.py)."""
    if not arch.moe_layers or arch.expert_params_b <= 0 or prefill_chunk < EXPERT_COPY_MIN_ROWS:
        return 0
    stack = int(arch.expert_params_b * 1e9 / arch.moe_layers / EXPERT_STACKS) * dtype_bytes
    return EXPERT_STACKS * stack if stack <= EXPERT_COPY_MAX_BYTES else 0


def unfused_scores_bytes(
    arch: Architecture, prefill_chunk: int, context_tokens: int, dtype_bytes: int, backend: str = "cuda"
) -> int:
    """Attention over a head size `backend` has no fused prefill kernel for: the chunk's scores in
    the activation dtype (one per query head, prompt position and context position) plus the
    causal mask, which the engine runs in blocks of query rows when they pass SCORES_BLOCK_BYTES
    (ops/prefill_attention.py), two blocks alive at a time."""
    if arch.head_dim in FUSED_PREFILL_HEAD_DIMS.get(backend, ()) or not arch.attention_layers:
        return 0
    row_bytes = context_tokens * (arch.attention_heads * dtype_bytes + 1)
    if prefill_chunk * arch.attention_heads * context_tokens * dtype_bytes <= SCORES_BLOCK_BYTES:
        return prefill_chunk * row_bytes
    return SCORE_BLOCKS_IN_FLIGHT * SCORES_BLOCK_BYTES * row_bytes // max(1, row_bytes - context_tokens)


def prefill_workspace_bytes(
    arch: Architecture,
    prefill_chunk: int,
    context_tokens: int,
    *,
    dtype_bytes: int = KV_BYTES,
    backend: str | None = None,
    kv_bits: int | None = None,
) -> int:
    """A prefill chunk's activations on `backend` ("cuda", "metal"; None: the CPU): on a GPU, with
    the layer shapes known, GPU_LAYERS_IN_FLIGHT layers' intermediates (gpu_layer_bytes), with
    float K/V an unfused attention's scores, and the last position's logits; else the rule of
    thumb (`workspace_bytes`)."""
    if backend not in ("cuda", "metal") or not knows_layer_shapes(arch):
        return workspace_bytes(arch, prefill_chunk)
    layers = GPU_LAYERS_IN_FLIGHT * gpu_layer_bytes(arch, prefill_chunk, dtype_bytes, cuda=backend == "cuda")
    scores = 0 if kv_bits else unfused_scores_bytes(arch, prefill_chunk, context_tokens, dtype_bytes, backend)
    return layers + scores + arch.vocab_size * 4 * 2


def vision_workspace_bytes(arch: Architecture) -> int:
    """Activations of encoding one image (`arch.vision_image_patches` patches), by the same rule of
    thumb as a prefill chunk; it runs before the chunk that holds the image, so the larger counts."""
    return arch.vision_image_patches * arch.vision_hidden_size * 4 * 16


def quantized_scores_bytes(attention_heads: int, prefill_chunk: int, context_tokens: int) -> int:
    """The float32 scores (and the causal mask, a bool per position pair) the quantized attention
    holds for one layer while a prefill chunk attends over the context: the chunk's query rows run
    in blocks whose scores stay under SCORES_BLOCK_BYTES (engine/cache/quantized_kv.py)."""
    row_bytes = attention_heads * context_tokens * SCORE_BYTES
    rows = min(prefill_chunk, max(1, SCORES_BLOCK_BYTES // max(1, row_bytes)))
    return rows * context_tokens * (attention_heads * SCORE_BYTES + 1)


def checkpoints_kept(num_checkpoints: int, resident_conversations: int) -> int:
    """Recurrent checkpoints the prefix cache holds: the sequence's own and the resident conversations'."""
    return num_checkpoints + CHECKPOINTS_PER_RESIDENT * resident_conversations


def sequence_bytes(
    arch: Architecture, context_tokens: int, dtype_bytes: int = KV_BYTES, *, kv_bits: int | None = None
) -> int:
    """Cache memory of one sequence holding `context_tokens`: its KV plus its recurrent state."""
    kv = kv_bytes_per_token(arch, dtype_bytes, kv_bits=kv_bits) * context_tokens
    return kv + recurrent_state_bytes(arch, dtype_bytes)


def decode_peak_bytes(
    arch: Architecture, *, weight_bytes: int, context_tokens: int, dtype_bytes: int = KV_BYTES
) -> int:
    """Peak memory while decoding one sequence at `context_tokens`: what the tiny-run test measures."""
    return (
        weight_bytes
        + sequence_bytes(arch, context_tokens, dtype_bytes)
        + update_transient_bytes(arch, context_tokens, dtype_bytes)
        + workspace_bytes(arch, prefill_chunk=1)
    )


def prefill_peak_bytes(
    arch: Architecture,
    *,
    context_tokens: int,
    prefill_chunk: int,
    dtype_bytes: int = KV_BYTES,
    kv_bits: int | None = None,
    attention_heads: int = 0,
    dequantized_kv: bool = False,
    backend: str | None = None,
) -> int:
    """Peak memory above the weights while a prompt's last prefill chunk attends over its
    `context_tokens`: the sequence's cache, one layer's K/V update, the chunk's activations and,
    for quantized K/V, its attention scores and (`dequantized_kv`: MLX's CPU quantized matmul works
    on a float32 copy of its operand) one layer's K or V dequantized, broadcast to the query heads.
    `backend` ("cuda", "metal"; None: the CPU) picks how the chunk's activations are counted
    (prefill_workspace_bytes). What the engine's measured-peak test compares."""
    scores = quantized_scores_bytes(attention_heads, prefill_chunk, context_tokens) if kv_bits else 0
    if kv_bits and dequantized_kv:
        scores += attention_heads * arch.head_dim * context_tokens * SCORE_BYTES
    return (
        sequence_bytes(arch, context_tokens, dtype_bytes, kv_bits=kv_bits)
        + update_transient_bytes(arch, context_tokens, dtype_bytes, kv_bits=kv_bits)
        + prefill_workspace_bytes(
            arch, prefill_chunk, context_tokens, dtype_bytes=dtype_bytes, backend=backend, kv_bits=kv_bits
        )
        + scores
    )


def estimate(
    arch: Architecture,
    *,
    usable_bytes: int,
    weight_bytes: int,
    num_checkpoints: int = DEFAULT_CHECKPOINTS,
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    headroom_bytes: int = HEADROOM_BYTES,
    kv_bits: int | None = None,
    resident_conversations: int = DEFAULT_RESIDENT_CONVERSATIONS,
    prefetch_bytes: int = READ_AHEAD_BYTES,
    backend: str | None = None,
) -> MemoryEstimate:
    """How much context one sequence can hold in `usable_bytes`, and whether the model fits at all
    (`kv_bits`: with K/V quantized to 8 or 4 bits; `prefetch_bytes` 0: prefetch off; `backend`
    "cuda" / "metal" / None (the CPU): how a prefill chunk's activations are counted)."""
    state = recurrent_state_bytes(arch)
    # the context the chunk's attention scores are sized for: beyond it they run in bounded blocks
    chunk_workspace = prefill_workspace_bytes(
        arch, prefill_chunk, COMFORTABLE_CONTEXT, backend=backend, kv_bits=kv_bits
    )
    partial = MemoryEstimate(
        usable_bytes=usable_bytes,
        weights_bytes=weight_bytes,
        kv_bytes_per_token=kv_bytes_per_token(arch, kv_bits=kv_bits),
        state_bytes=state,
        checkpoint_bytes=checkpoints_kept(num_checkpoints, resident_conversations) * state,
        workspace_bytes=max(chunk_workspace, vision_workspace_bytes(arch)),
        headroom_bytes=headroom_bytes,
        max_context=0,
        verdict="too_big",
        kv_bits=kv_bits,
        prefetch_bytes=prefetch_bytes,
        scores_bytes=SCORES_BLOCK_BYTES * 5 // 4 if kv_bits else 0,  # and the block's mask, at most 1/4
    )
    free = usable_bytes - partial.fixed_bytes
    per_token = partial.kv_bytes_per_token + update_transient_bytes(arch, 1, kv_bits=kv_bits)
    max_context = _context_that_fits(arch, free, per_token)
    return MemoryEstimate(
        **{**_as_dict(partial), "max_context": max_context, "verdict": _verdict(arch, free, max_context)}
    )


def choose_kv_bits(arch: Architecture, *, usable_bytes: int, weight_bytes: int, **options: Any) -> int | None:
    """The K/V precision doctor's fit picks: bf16 (None) when it holds a comfortable context, else
    the fewest bits' reduction that does (8, then 4); 4 when nothing reaches it but 4 bits fit at all.
    `options` go to `estimate` (num_checkpoints, prefill_chunk, headroom_bytes, backend)."""
    comfortable = min(COMFORTABLE_CONTEXT, arch.context_length)
    for bits in (None, 8, 4):
        est = estimate(arch, usable_bytes=usable_bytes, weight_bytes=weight_bytes, kv_bits=bits, **options)
        if est.max_context >= comfortable:
            return bits
    return 4 if est.verdict != "too_big" else None


def _context_that_fits(arch: Architecture, free: int, kv_per_token: int) -> int:
    if free <= 0:
        return 0
    if kv_per_token == 0:
        return arch.context_length
    return min(arch.context_length, free // kv_per_token)


def _verdict(arch: Architecture, free: int, max_context: int) -> Verdict:
    comfortable = min(COMFORTABLE_CONTEXT, arch.context_length)
    if free <= 0 or max_context < min(MINIMUM_CONTEXT, arch.context_length):
        return "too_big"
    return "fits" if max_context >= comfortable else "tight"


def _as_dict(est: MemoryEstimate) -> dict[str, object]:
    return {name: getattr(est, name) for name in MemoryEstimate.__slots__}  # type: ignore[attr-defined]
