"""Rotary position embedding with per-sequence offsets (ragged batches) and partial rotation.

`rope_reference` is the definition (NeoX "rotate half" layout, as Qwen uses); `Rope` calls
`mx.fast.rope`, which accepts one offset per batch row.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx

from kapitsa.errors import UnsupportedModel


def rope_frequencies(dims: int, base: float, scaling: dict[str, Any] | None) -> mx.array:
    """Inverse frequencies `[dims/2]` for the rotated part, after the config's scaling rule."""
    inv = 1.0 / (base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind in (None, "default", "mrope"):
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "yarn":
        return _yarn_frequencies(inv, dims, base, scaling)
    raise UnsupportedModel(f"rope scaling {kind!r} is not supported (default, linear, yarn are)")


def complete_yarn(scaling: dict[str, Any] | None, max_position_embeddings: int) -> dict[str, Any] | None:
    """A YaRN block with transformers' defaults filled in from the config: the pre-training window
    (`original_max_position_embeddings`) is the config's `max_position_embeddings` when absent, and a
    missing `factor` is the ratio of the two. Other rope blocks come back unchanged."""
    if not scaling or scaling.get("rope_type", scaling.get("type")) != "yarn":
        return scaling
    done = dict(scaling)
    if done.get("original_max_position_embeddings") is None:
        done["original_max_position_embeddings"] = max_position_embeddings
    if done.get("factor") is None:
        done["factor"] = max_position_embeddings / float(done["original_max_position_embeddings"])
    return done


def _yarn_frequencies(inv: mx.array, dims: int, base: float, scaling: dict[str, Any]) -> mx.array:
    factor = float(scaling["factor"])
    original = float(scaling.get("original_max_position_embeddings") or 4096)
    beta_fast, beta_slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dims * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):  # gpt-oss-style blocks set false: the ramp's ends stay fractional
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    ramp = (mx.arange(dims // 2, dtype=mx.float32) - low) / max(high - low, 1e-3)
    extrapolate = 1.0 - mx.clip(ramp, 0.0, 1.0)
    return inv / factor * (1 - extrapolate) + inv * extrapolate


def _yarn_get_mscale(factor: float, mscale: float = 1.0) -> float:
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def yarn_mscale(scaling: dict[str, Any] | None) -> float:
    """YaRN scales cos/sin (so q·k by its square) as transformers does: by the block's
    `attention_factor` when it sets one, else `0.1 ln(factor) + 1`, or with both `mscale` and
    `mscale_all_dim` set, the ratio of those two scales."""
    if not scaling or scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _yarn_get_mscale(factor, float(mscale)) / _yarn_get_mscale(factor, float(mscale_all_dim))
    return _yarn_get_mscale(factor)


def rope_reference(x: mx.array, dims: int, inv_freq: mx.array, offsets: mx.array | int) -> mx.array:
    """x `[B, H, T, D]`; rotate the first `dims` features at positions `offset_b + t`."""
    B, _, T, _ = x.shape
    offsets = mx.broadcast_to(mx.array(offsets, dtype=mx.int32).reshape(-1), (B,))
    return rope_at_positions(x, dims, inv_freq, offsets[:, None] + mx.arange(T))


def rope_at_positions(x: mx.array, dims: int, inv_freq: mx.array, positions: mx.array) -> mx.array:
    """x `[B, H, T, D]` rotated at arbitrary per-token positions `[B, T]` (draft trees)."""
    return rotate_at_angles(x, dims, positions.astype(mx.float32)[..., None] * inv_freq)


def rotate_at_angles(x: mx.array, dims: int, angles: mx.array) -> mx.array:
    """x `[B, H, T, D]` with its first `dims` features rotated by `angles [B, T, dims/2]` (NeoX layout)."""
    cos, sin = mx.cos(angles)[:, None], mx.sin(angles)[:, None]
    rot, rest = x[..., :dims].astype(mx.float32), x[..., dims:]
    x1, x2 = rot[..., : dims // 2], rot[..., dims // 2 :]
    rotated = mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return mx.concatenate([rotated.astype(x.dtype), rest], axis=-1)


class Rope:
    """Callable `(x [B,H,T,D], offsets int | [B] int32) -> x` (not a Module: no parameters)."""

    def __init__(self, dims: int, base: float, scaling: dict[str, Any] | None = None):
        self.dims = dims
        self.base = base
        self.inv_freq = rope_frequencies(dims, base, scaling)
        self.mscale = yarn_mscale(scaling)
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        # mx.fast.rope takes periods (1 / inverse frequency) when the frequencies are not plain base^-i
        self._periods = None if kind in (None, "default", "mrope") else 1.0 / self.inv_freq
        # Evaluate now: a lazy array built on this thread's stream cannot be evaluated later on the
        # engine thread (MLX streams are per thread), and models are built before the engine starts.
        mx.eval(self.inv_freq, *(() if self._periods is None else (self._periods,)))

    def at_positions(self, x: mx.array, positions: mx.array) -> mx.array:
        """Per-token positions `[B, T]` (draft trees); `mx.fast.rope` takes one offset per row."""
        if self.mscale != 1.0:
            x = mx.concatenate([x[..., : self.dims] * self.mscale, x[..., self.dims :]], axis=-1)
        return rope_at_positions(x, self.dims, self.inv_freq, positions)

    def __call__(self, x: mx.array, offsets: mx.array | int) -> mx.array:
        if self.mscale != 1.0:
            x = mx.concatenate([x[..., : self.dims] * self.mscale, x[..., self.dims :]], axis=-1)
        if self._periods is None:
            return mx.fast.rope(x, self.dims, traditional=False, base=self.base, scale=1.0, offset=offsets)
        return mx.fast.rope(
            x, self.dims, traditional=False, base=None, scale=1.0, offset=offsets, freqs=self._periods
        )


def interleaved_axis_selector(section: list[int], freq_dim: int) -> list[int]:
    """Qwen3.5-VL's interleaved multi-axis rope: which position axis (0 time, 1 height, 2 width)
    each rotary frequency reads; height takes frequencies 1, 4, 7..., width 2, 5, 8... (mlx-vlm's
    `_interleaved_position_selector`)."""
    selector = [0] * freq_dim
    for axis in (1, 2):
        for i in range(axis, min(section[axis] * 3, freq_dim), 3):
            selector[i] = axis
    return selector


class MRope(Rope):
    """A `Rope` that also rotates at multi-axis positions `[3, B, T]` (image tokens of a vision
    prompt). Text positions are equal on every axis, which is the plain rope of `Rope`."""

    def __init__(self, dims: int, base: float, scaling: dict[str, Any] | None, section: list[int]):
        super().__init__(dims, base, scaling)
        self.selector = mx.array(interleaved_axis_selector(section, dims // 2), dtype=mx.int32)
        mx.eval(self.selector)  # built on the loading thread, read on the engine thread (see Rope)

    def at_axes(self, x: mx.array, positions: mx.array) -> mx.array:
        """x `[B, H, T, D]` rotated at per-token multi-axis positions `[3, B, T]`."""
        if self.mscale != 1.0:  # YaRN's magnitude scale, as every other path of `Rope` applies it
            x = mx.concatenate([x[..., : self.dims] * self.mscale, x[..., self.dims :]], axis=-1)
        per_freq = mx.take(positions, self.selector, axis=0).transpose(1, 2, 0)  # [B, T, dims/2]
        return rotate_at_angles(x, self.dims, per_freq.astype(mx.float32) * self.inv_freq)
