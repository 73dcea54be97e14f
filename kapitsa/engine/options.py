"""The engine's one options surface: frozen values made once by whoever opens an engine, passed down.

`EngineConfig` holds the engine thread's knobs (batching, caches, memory), `KernelOptions` which
backend kernels and graph rewrites a model uses. No engine knob comes from the environment: the
opener may build `KernelOptions.from_environ(os.environ)` so lab runs can A/B a kernel against its
reference without code edits, and every default is the path measured fastest.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

# `--speculative` modes. "auto" is the default everywhere (serve, run, the launchers, the TUI,
# bench): it drafts with what the checkpoint offers (a draft model, its MTP head, else n-gram
# lookup) and costs nothing measurable while drafts do not pay (speculative/shadow.py).
SPECULATIVE_MODES = ("none", "ngram", "mtp", "draft", "block", "auto")
DEFAULT_SPECULATIVE = "auto"

GIB = 1024**3
KV_BITS_CHOICES = (None, 8, 4)  # `--kv-bits`: None keeps K/V in the activation dtype
READ_AHEAD_BYTES = 256 * 1024**2  # disk-tier files read ahead of their lookup, at most (cache/read_ahead.py)
# One block of the quantized attention's float32 scores, at most (cache/quantized_kv.py).
SCORES_BLOCK_BYTES = 64 * 1024**2

# Kernel families a model can route through (kernels/): the Gated DeltaNet step, the MoE expert
# kernels, the quantized mat-vecs, the Mamba-2 step, the fused MoE router, attention's decode kernels.
KERNEL_FAMILIES = ("gdn", "moe", "qmv", "mamba", "route", "attn")
# What the one-row mat-vec may fuse: the RMSNorm before it, the residual add after it, the input
# activation of a down projection, the SwiGLU of a [gate | up] projection.
FUSED_PARTS = ("norm", "residual", "act", "glu")
DEFAULT_FUSED_PARTS = frozenset({"norm", "residual"})
DEFAULT_SSD_CHUNK = 256  # Mamba-2 prefill chunk: the fastest of 64/128/256 for the Nemotron shapes
# (token, expert) pairs the MoE expert decode kernels (kernels/moe.py) hold at most, and the limit up
# to which a model's MoE layers take them rather than gather_qmm's sorted matmul. The kernels beat
# gather_qmm at 1-2 tokens of top-6/8 routing (6-16 pairs) and lose from 3 tokens on (18-24 pairs:
# 0.66-0.9x, 48-64 pairs: 0.28-0.52x; docs/results.md), which covers a decode batch of 3+ streams and
# a 3+-token speculative verify alike.
MOE_KERNEL_PAIRS = 72
DEFAULT_MOE_MAX_PAIRS = 16


@dataclass(slots=True, frozen=True)
class KernelOptions:
    """Which kernels and rewrites a model uses. Each alternative computes the same product or step."""

    families: frozenset[str] | None = None  # None: the backend's default families (kernels.DEFAULT_FAMILIES)
    fused_parts: frozenset[str] = DEFAULT_FUSED_PARTS  # parts fused into one-row mat-vecs (FUSED_PARTS)
    routed_linears: bool = True  # quantized linears pick their mat-mul by rows (CUDA); False: MLX's stock op
    moe_dequant: bool = True  # long MoE prefill: dequantized experts + one grouped GEMM (CUDA)
    ssd_chunk: int = DEFAULT_SSD_CHUNK  # tokens per chunk of the Mamba-2 chunked scan at prefill
    fold_shared_experts: bool = False  # shared experts folded into the routed stack as extra experts
    compile_decode: bool = True  # plain decode steps run as mx.compile'd layer functions
    moe_max_pairs: int = DEFAULT_MOE_MAX_PAIRS  # (token, expert) pairs the MoE decode kernels take, at most
    # a speculative verify's quantized linears (up to MAX_ROWS rows, their fused norm and residual
    # included) through the one-row kernel a decode step uses, whose rows do not depend on how many
    # it computes: greedy speculation then writes plain decoding's tokens in bf16 on CUDA too, where
    # the tensor-core kernel's verify rows round differently (ops/linear.py)
    exact_verify: bool = False
    # CPU device: decode steps of at least this many rows run op by op, their linears and tied
    # head through BLAS on the float32 copies (kernels/cpu_blas.py); 0: never. MLX's CPU quantized
    # product costs each row a full pass over the weights, BLAS a fraction of one. The model
    # runner sets it when every linear keeps its copy.
    cpu_blas_rows: int = 0

    def __post_init__(self) -> None:
        if self.families is not None and not self.families <= set(KERNEL_FAMILIES):
            raise ValueError(f"unknown kernel families {sorted(self.families - set(KERNEL_FAMILIES))}")
        if not self.fused_parts <= set(FUSED_PARTS):
            raise ValueError(f"unknown fused parts {sorted(self.fused_parts - set(FUSED_PARTS))}")
        if self.ssd_chunk < 1:
            raise ValueError("ssd_chunk must be >= 1")
        if not 0 <= self.moe_max_pairs <= MOE_KERNEL_PAIRS:
            raise ValueError(f"moe_max_pairs must be between 0 and {MOE_KERNEL_PAIRS}")

    @property
    def moe_pairs(self) -> int:
        """The pair limit a model's MoE layers give the expert decode kernels: with exact_verify all
        they take, so a verify's tokens go through the kernels a decode step's token does."""
        return MOE_KERNEL_PAIRS if self.exact_verify else self.moe_max_pairs

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> KernelOptions:
        """The options the `KAPITSA_*` lab variables name; unset ones keep their defaults.

        KAPITSA_KERNELS: "all", "none" or a comma list of KERNEL_FAMILIES; KAPITSA_FUSED_NORMS: "0",
        "all" or a comma list of FUSED_PARTS; KAPITSA_QLINEAR=stock; KAPITSA_MOE_DEQUANT=0;
        KAPITSA_SSD_CHUNK=N; KAPITSA_FOLD_SHARED_EXPERTS=1; KAPITSA_COMPILE_DECODE=0;
        KAPITSA_MOE_MAX_PAIRS=N (0-72); KAPITSA_EXACT_VERIFY=1."""
        values: dict = {}
        if kernels := environ.get("KAPITSA_KERNELS", "").strip().lower():
            values["families"] = _names(kernels, KERNEL_FAMILIES, "KAPITSA_KERNELS")
        if fused := environ.get("KAPITSA_FUSED_NORMS", "").strip().lower():
            values["fused_parts"] = _names(fused, FUSED_PARTS, "KAPITSA_FUSED_NORMS")
        if environ.get("KAPITSA_QLINEAR", "").strip().lower() == "stock":
            values["routed_linears"] = False
        if _switch(environ, "KAPITSA_MOE_DEQUANT") is False:
            values["moe_dequant"] = False
        if chunk := environ.get("KAPITSA_SSD_CHUNK", "").strip():
            if not chunk.isdigit():
                raise ValueError(f"KAPITSA_SSD_CHUNK={chunk!r} is not a positive integer")
            values["ssd_chunk"] = int(chunk)
        if pairs := environ.get("KAPITSA_MOE_MAX_PAIRS", "").strip():
            if not pairs.isdigit():
                raise ValueError(
                    f"KAPITSA_MOE_MAX_PAIRS={pairs!r} is not an integer from 0 to {MOE_KERNEL_PAIRS}"
                )
            values["moe_max_pairs"] = int(pairs)
        if _switch(environ, "KAPITSA_FOLD_SHARED_EXPERTS"):
            values["fold_shared_experts"] = True
        if _switch(environ, "KAPITSA_COMPILE_DECODE") is False:
            values["compile_decode"] = False
        if _switch(environ, "KAPITSA_EXACT_VERIFY"):
            values["exact_verify"] = True
        return cls(**values)


def _names(value: str, known: tuple[str, ...], variable: str) -> frozenset[str]:
    """ "all", "1", "on" -> every name; "none", "0", "off" -> none; else a comma list of known names."""
    if value in ("all", "1", "on"):
        return frozenset(known)
    if value in ("none", "0", "off"):
        return frozenset()
    names = frozenset(v.strip() for v in value.split(",") if v.strip())
    if unknown := names - set(known):
        raise ValueError(f"{variable}: unknown {sorted(unknown)} (known: {', '.join(known)})")
    return names


def _switch(environ: Mapping[str, str], variable: str) -> bool | None:
    value = environ.get(variable, "").strip().lower()
    if not value:
        return None
    if value in ("1", "on", "true", "yes"):
        return True
    if value in ("0", "off", "false", "no"):
        return False
    raise ValueError(f"{variable}={value!r}: use 1 or 0")


@dataclass(slots=True, frozen=True)
class EngineConfig:
    """Engine knobs. `None` means "derive from the model and device"."""

    max_running: int = 8  # sequences in prefill + decode at once
    prefill_chunk: int = 512
    prefix_cache_bytes: int | None = None  # None: a quarter of the memory left next to the weights
    checkpoint_interval: int | None = None  # None: from the checkpoint / KV-per-token size ratio
    disk_cache_dir: Path | None = None  # None: no disk tier
    disk_cache_bytes: int = 8 * GIB  # the whole disk_cache_dir, every model's folder in it together
    disk_write_delay_s: float = 1.0  # a new system/turn checkpoint is on disk this long after it is made
    memory_limit_bytes: int | None = None  # None: the device's limit
    # freed buffers MLX keeps for reuse while the engine runs; None: an eighth of the memory limit
    # (runner/memory.py, at least 1 GiB), 0: none kept
    buffer_cache_bytes: int | None = None
    # Python's GIL switch interval while the engine runs (runner/process_settings.py): how long the
    # engine thread may wait for the GIL from a busy neighbour thread; None: the process's own
    gil_switch_interval_s: float | None = 0.001
    queue_timeout_s: float = 120.0  # a request waiting longer for memory gets EngineBusy
    max_queued: int = 256
    model_key: str = "model"  # names the disk-tier folder: weights + dtype + template identity
    cpu_float32_bytes: int = 2 * GIB  # CPU device only: float32 weights and BLAS copies (model_runner.py)
    kv_bits: int | None = None  # attention K/V at 8 or 4 bits (cache/quantized_kv.py); None: activation dtype
    resident_conversations: int = 4  # conversations whose newest checkpoints eviction spares (0: plain LRU)
    # read disk-tier checkpoints ahead: a request's file as it arrives, spilled conversations when idle
    prefetch: bool = True
    read_ahead_bytes: int = READ_AHEAD_BYTES
    kernels: KernelOptions = field(default_factory=KernelOptions)
    # decode batch sizes traced and compiled while idle (runner/warmup.py): () none (a one-user
    # engine forms no batches), None every size on a GPU (a server: `open_engine(warm_batches=True)`)
    warm_batches: tuple[int, ...] | None = ()
    # prefill chunk lengths run once while idle, from an empty cache and after a first chunk, so a
    # first request's prompt compiles nothing (runner/warmup.py): () none, None this device's default
    # (on CUDA the lengths the recurrent kernels compile for, up to prefill_chunk; none elsewhere)
    warm_prefill: tuple[int, ...] | None = ()

    def __post_init__(self) -> None:
        if self.prefill_chunk < 1 or self.max_running < 1:
            raise ValueError("prefill_chunk and max_running must be >= 1")
        if self.warm_batches is not None and not all(1 <= n <= self.max_running for n in self.warm_batches):
            raise ValueError(f"warm_batches must lie between 1 and max_running ({self.max_running})")
        if self.warm_prefill is not None and not all(1 <= n <= self.prefill_chunk for n in self.warm_prefill):
            raise ValueError(
                f"warm_prefill lengths must lie between 1 and prefill_chunk ({self.prefill_chunk})"
            )
        if self.buffer_cache_bytes is not None and self.buffer_cache_bytes < 0:
            raise ValueError("buffer_cache_bytes must be >= 0 (0: keep no freed buffers)")
        if self.gil_switch_interval_s is not None and not self.gil_switch_interval_s >= 1e-6:
            raise ValueError("gil_switch_interval_s must be >= 1e-6 s (None: leave the process's)")
        if self.resident_conversations < 0:
            raise ValueError("resident_conversations must be >= 0")
        if self.kv_bits not in KV_BITS_CHOICES:
            raise ValueError(f"kv_bits must be one of {KV_BITS_CHOICES[1:]} or None, not {self.kv_bits}")
