"""Qwen3.5 / Qwen3.6 (dense and MoE) with their vision tower, as the published checkpoints define them.

Serves model_type qwen3_5 and qwen3_5_moe: the language model is `qwen3_5.Model` (same parameter
paths), the tower lives under `vision_tower.` (Hugging Face `model.visual.*`, as mlx-vlm names it).
The tower is Qwen3-VL's without deepstack, as in mlx-vlm 0.7.10 (`qwen3_vl/vision.py`): a Conv3d
patch embedding plus bilinearly interpolated learned positions, ViT blocks with 2-D rope over the
patch grid, and a merger that folds each 2x2 patch block into one language-model token.

A checkpoint without tower tensors (a text-only conversion) loads as the text model: `sanitize`
drops the tower. Images reach the language model through `forward(..., media=MediaChunk)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from kapitsa.engine.models import qwen3_5
from kapitsa.engine.models.base import known_fields, require
from kapitsa.engine.models.qwen3_5_args import ModelArgs as TextArgs
from kapitsa.engine.ops.rope import rotate_at_angles

_TOWER_PREFIXES = ("model.visual.", "visual.", "vision_tower.", "model.vision_tower.")


@dataclass
class VisionArgs:
    depth: int = 27
    hidden_size: int = 1152
    intermediate_size: int = 4304
    out_hidden_size: int = 3584
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: list[int] = field(default_factory=list)

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> VisionArgs:
        args = cls(**known_fields(cls, config))
        require(not args.deepstack_visual_indexes, "Qwen3.5 vision towers have no deepstack layers")
        return args


@dataclass
class ModelArgs(TextArgs):
    vision: VisionArgs | None = None
    image_token_id: int = 248056
    video_token_id: int = 248057
    vision_start_token_id: int = 248045

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> ModelArgs:
        args = super().from_dict(config)
        vision = config.get("vision_config")
        args.vision = VisionArgs.from_dict(vision) if isinstance(vision, dict) else None
        for key in ("image_token_id", "video_token_id", "vision_start_token_id"):
            if isinstance(config.get(key), int):
                setattr(args, key, config[key])
        return args


class PatchEmbed(nn.Module):
    def __init__(self, v: VisionArgs):
        super().__init__()
        self.v = v
        kernel = (v.temporal_patch_size, v.patch_size, v.patch_size)
        self.proj = nn.Conv3d(v.in_channels, v.hidden_size, kernel_size=kernel, stride=kernel, bias=True)

    def __call__(self, pixels: mx.array) -> mx.array:
        v = self.v
        x = pixels.reshape(-1, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
        return self.proj(x.moveaxis(1, 4)).reshape(-1, v.hidden_size)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.scale = heads, (dim // heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.proj = nn.Linear(dim, dim)

    def __call__(self, x: mx.array, angles: mx.array) -> mx.array:
        n = x.shape[0]
        qkv = self.qkv(x).reshape(n, 3, self.heads, -1).transpose(1, 2, 0, 3)  # [3, H, N, D]
        head_dim = qkv.shape[-1]
        q, k, v = (qkv[i][None] for i in range(3))
        # the tower's rope rotates the whole head: angles [N, D/2] for every head
        q = rotate_at_angles(q, head_dim, angles[None]).astype(x.dtype)
        k = rotate_at_angles(k, head_dim, angles[None]).astype(x.dtype)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale)
        return self.proj(out[0].transpose(1, 0, 2).reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, hidden, bias=True)
        self.linear_fc2 = nn.Linear(hidden, dim, bias=True)

    def __call__(self, x: mx.array) -> mx.array:
        return self.linear_fc2(nn.gelu_approx(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, v: VisionArgs):
        super().__init__()
        self.norm1 = nn.LayerNorm(v.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(v.hidden_size, eps=1e-6)
        self.attn = VisionAttention(v.hidden_size, v.num_heads)
        self.mlp = VisionMLP(v.hidden_size, v.intermediate_size)

    def __call__(self, x: mx.array, angles: mx.array) -> mx.array:
        x = x + self.attn(self.norm1(x), angles)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, v: VisionArgs):
        super().__init__()
        self.merged = v.hidden_size * v.spatial_merge_size**2
        self.norm = nn.LayerNorm(v.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged, self.merged)
        self.linear_fc2 = nn.Linear(self.merged, v.out_hidden_size)

    def __call__(self, x: mx.array) -> mx.array:
        x = self.norm(x).reshape(-1, self.merged)
        return self.linear_fc2(nn.gelu(self.linear_fc1(x)))


class VisionTower(nn.Module):
    def __init__(self, v: VisionArgs):
        super().__init__()
        self.v = v
        self.patch_embed = PatchEmbed(v)
        self.pos_embed = nn.Embedding(v.num_position_embeddings, v.hidden_size)
        self.grid_side = int(v.num_position_embeddings**0.5)
        self.blocks = [VisionBlock(v) for _ in range(v.depth)]
        self.merger = PatchMerger(v)
        head_dim = v.hidden_size // v.num_heads
        rotary = head_dim // 2
        self._inv_freq = 1.0 / (10000.0 ** (mx.arange(0, rotary, 2, dtype=mx.float32) / rotary))
        mx.eval(self._inv_freq)  # built on the loading thread, read on the engine thread

    def __call__(self, pixels: mx.array, grid: tuple[int, int, int]) -> mx.array:
        """One image's patches `[t*h*w, C*T*P*P]` (merge-block order) -> features `[t*h*w / m^2, out]`."""
        x = self.patch_embed(pixels) + self._position_embedding(*grid)
        angles = self._rope_angles(*grid)
        for block in self.blocks:
            x = block(x, angles)
        return self.merger(x)

    def _position_embedding(self, t: int, h: int, w: int) -> mx.array:
        """The learned square grid of positions, bilinearly resized to h x w (mlx-vlm's
        `fast_pos_embed_interpolate`), in merge-block order."""
        n, m = self.grid_side, self.v.spatial_merge_size
        hi, wi = mx.linspace(0, n - 1, h), mx.linspace(0, n - 1, w)
        h0, w0 = hi.astype(mx.int32), wi.astype(mx.int32)
        h1, w1 = mx.minimum(h0 + 1, n - 1), mx.minimum(w0 + 1, n - 1)
        dh, dw = hi - h0.astype(mx.float32), wi - w0.astype(mx.float32)
        corners = [(h0, w0, 1 - dh, 1 - dw), (h0, w1, 1 - dh, dw), (h1, w0, dh, 1 - dw), (h1, w1, dh, dw)]
        total = None
        for rows, cols, wr, wc in corners:
            emb = self.pos_embed((rows[:, None] * n + cols[None, :]).flatten())
            part = emb * (wr[:, None] * wc[None, :]).flatten().astype(emb.dtype)[:, None]
            total = part if total is None else total + part
        dim = total.shape[-1]
        grid = mx.tile(total, (t, 1)).reshape(t, h // m, m, w // m, m, dim)
        return grid.transpose(0, 1, 3, 2, 4, 5).reshape(-1, dim)

    def _rope_angles(self, t: int, h: int, w: int) -> mx.array:
        """`[t*h*w, head_dim/2]`: the row frequencies then the column frequencies of each patch."""
        m = self.v.spatial_merge_size
        rows = mx.arange(h // m)[:, None, None, None] * m + mx.arange(m)[None, None, :, None]
        cols = mx.arange(w // m)[None, :, None, None] * m + mx.arange(m)[None, None, None, :]
        shape = (h // m, w // m, m, m)
        rows, cols = mx.broadcast_to(rows, shape).reshape(-1), mx.broadcast_to(cols, shape).reshape(-1)
        table = mx.arange(max(h, w), dtype=mx.float32)[:, None] * self._inv_freq[None, :]
        angles = mx.concatenate([table[rows], table[cols]], axis=-1)
        return mx.tile(angles, (t, 1)) if t > 1 else angles


class Model(qwen3_5.Model):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        if args.vision is not None:
            self.vision_tower = VisionTower(args.vision)

    @property
    def takes_images(self) -> bool:
        return "vision_tower" in self  # a Module's children are its dict entries

    def encode_image(self, pixels: mx.array, grid: tuple[int, int, int]) -> mx.array:
        """Language-model embeddings `[tokens, hidden]` of one preprocessed image."""
        return self.vision_tower(pixels.astype(self.vision_tower.patch_embed.proj.weight.dtype), grid)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        tower = {}
        for key in [k for k in weights if k.startswith(_TOWER_PREFIXES)]:
            prefix = next(p for p in _TOWER_PREFIXES if key.startswith(p))
            name = "vision_tower." + key[len(prefix) :]
            tower[name] = self._tower_tensor(name, weights.pop(key))
        out = super().sanitize(weights)
        if self.takes_images and self._tower_names() <= tower.keys():
            out.update({k: v for k, v in tower.items() if "position_ids" not in k})
        else:  # a text-only conversion of a vision-language checkpoint (or a partial tower)
            self.pop("vision_tower", None)
        return out

    def _tower_names(self) -> set[str]:
        from mlx.utils import tree_flatten

        return {f"vision_tower.{k}" for k, _ in tree_flatten(self.vision_tower.parameters())}

    def _tower_tensor(self, name: str, value: mx.array) -> mx.array:
        # PyTorch's Conv3d weight is [out, C, T, P, P]; MLX's is [out, T, P, P, C]
        channels = self.args.vision.in_channels if self.args.vision else 3
        is_conv = name.endswith("patch_embed.proj.weight") and value.ndim == 5
        if is_conv and value.shape[1] == channels and value.shape[-1] != channels:
            return value.transpose(0, 2, 3, 4, 1)
        return value

    def quant_predicate(self, path: str, module: nn.Module) -> bool | dict:
        """The tower stays in the checkpoint's precision (small, and features feed every later token)."""
        return not path.startswith("vision_tower.") and super().quant_predicate(path, module)
