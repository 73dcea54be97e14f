"""Nemotron-H vision-language (the Super-VL class): the Nemotron-H language model plus a RADIO ViT and
a projector, as mlx-vlm 0.7.10's `nemotron_h_nano_omni` builds them (images only: the audio
encoder's tensors are dropped, and so is the video patch embedder).

Serves model_type nemotron_h_nano_omni, nemotron_h_omni and nemotronh_nano_omni_reasoning_v3. The
language model is `nemotron_h.Model` (same parameter paths; the checkpoint's `language_model.`
prefix is stripped); the tower lives under `vision_model.radio_model.` and the projector under
`mlp1.layers.` (mlx-vlm's names). An image is patches + learned positions (bilinearly resized to
the patch grid) after the class and register tokens, ViT blocks, then each 2x2 block of patch
features pixel-shuffled into one token and projected (RMSNorm, Linear, relu^2, Linear).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from kapitsa.engine.models import nemotron_h
from kapitsa.engine.models.base import known_fields
from kapitsa.engine.models.nemotron_h_args import ModelArgs as TextArgs
from kapitsa.engine.ops.norm import relu_squared

_DROPPED = (
    "sound_encoder.",
    "sound_projection.",
    "vision_model.summary_idxs",
    "vision_model.radio_model.summary_idxs",
)
_VIDEO = "patch_generator.video_embedder."


@dataclass
class RadioArgs:
    hidden_size: int = 1280
    num_hidden_layers: int = 32
    num_attention_heads: int = 16
    intermediate_size: int = 5120
    image_size: int = 224
    patch_size: int = 16
    max_resolution: int = 2048
    layer_norm_eps: float = 1e-6
    args: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> RadioArgs:
        out = cls(**known_fields(cls, config))
        out.args = dict(out.args or {})
        return out

    @property
    def grid_side(self) -> int:
        """Patches per side of the learned position table (`cpe_max_size`, else `max_resolution`)."""
        return int(self.args.get("cpe_max_size") or self.max_resolution) // self.patch_size

    @property
    def num_cls_tokens(self) -> int:
        teachers = self.args.get("teachers") or []
        if self.args.get("cls_token_per_teacher", True) and teachers:
            return len({t["name"] for t in teachers})
        return 1

    @property
    def num_registers(self) -> int:
        multiple = self.args.get("register_multiple")
        return multiple - (self.num_cls_tokens % multiple) if multiple else 0


@dataclass
class ModelArgs(TextArgs):
    radio: RadioArgs | None = None
    downsample_ratio: float = 0.5
    projector_hidden_size: int = 4096
    vit_hidden_size: int = 1280
    ps_version: str = "v1"
    vision_final_layernorm: bool | None = None
    img_context_token_id: int | None = None

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> ModelArgs:
        text = dict(config.get("text_config") or config.get("llm_config") or {})
        args = super().from_dict({**text, "model_type": config.get("model_type", "nemotron_h_nano_omni")})
        args.radio = RadioArgs.from_dict(config.get("vision_config") or {})
        for key in ("downsample_ratio", "projector_hidden_size", "vit_hidden_size", "ps_version"):
            if key in config:
                setattr(args, key, config[key])
        args.vision_final_layernorm = config.get("vision_final_layernorm")
        args.img_context_token_id = config.get("img_context_token_id", config.get("image_token_index"))
        return args


class PatchGenerator(nn.Module):
    def __init__(self, r: RadioArgs):
        super().__init__()
        self.r = r
        self.embedder = nn.Linear(3 * r.patch_size**2, r.hidden_size, bias=False)
        self.cls_token = ClsToken(r)
        self.pos_embed = mx.zeros((1, r.grid_side**2, r.hidden_size))

    def __call__(self, pixels: mx.array) -> mx.array:
        B, C, H, W = pixels.shape
        p = self.r.patch_size
        patches = pixels.reshape(B, C, H // p, p, W // p, p).transpose(0, 2, 4, 1, 3, 5)
        x = self.embedder(patches.reshape(B, (H // p) * (W // p), C * p * p))
        x = x + self._positions(H // p, W // p).astype(x.dtype)
        return self.cls_token(x)

    def _positions(self, rows: int, cols: int) -> mx.array:
        """The learned table for a rows x cols grid (mlx-vlm's `_get_pos_embeddings`)."""
        n, dim = self.r.grid_side, self.r.hidden_size
        if (rows, cols) == (n, n):
            return self.pos_embed
        table = self.pos_embed.astype(mx.float32).reshape(n, n, dim)
        if (n, n) != (self.r.image_size // self.r.patch_size,) * 2:  # cpe: stretch, then crop
            side = max(rows, cols)
            table = bilinear(table, side, side)[:rows, :cols]
        else:
            table = table[:rows, :cols]
        if table.shape[:2] != (rows, cols):
            table = bilinear(table, rows, cols)
        return table.reshape(1, rows * cols, dim)


class ClsToken(nn.Module):
    def __init__(self, r: RadioArgs):
        super().__init__()
        self.token = mx.zeros((r.num_cls_tokens + r.num_registers, r.hidden_size))

    def __call__(self, x: mx.array) -> mx.array:
        token = mx.broadcast_to(self.token[None], (x.shape[0], *self.token.shape)).astype(x.dtype)
        return mx.concatenate([token, x], axis=1)


class RadioAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.scale = heads, (dim // heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)

    def __call__(self, x: mx.array) -> mx.array:
        B, L, D = x.shape
        qkv = self.qkv(x).reshape(B, L, 3, self.heads, D // self.heads).transpose(2, 0, 3, 1, 4)
        out = mx.fast.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], scale=self.scale)
        return self.proj(out.transpose(0, 2, 1, 3).reshape(B, L, D))


class RadioMLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, bias=True)
        self.fc2 = nn.Linear(hidden, dim, bias=True)

    def __call__(self, x: mx.array) -> mx.array:
        return self.fc2(nn.gelu(self.fc1(x)))


class RadioBlock(nn.Module):
    def __init__(self, r: RadioArgs):
        super().__init__()
        self.norm1 = nn.LayerNorm(r.hidden_size, eps=1e-6)
        self.attn = RadioAttention(r.hidden_size, r.num_attention_heads)
        self.norm2 = nn.LayerNorm(r.hidden_size, eps=1e-6)
        self.mlp = RadioMLP(r.hidden_size, r.intermediate_size)

    def __call__(self, x: mx.array) -> mx.array:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class RadioBackbone(nn.Module):
    def __init__(self, r: RadioArgs):
        super().__init__()
        self.patch_generator = PatchGenerator(r)
        self.blocks = [RadioBlock(r) for _ in range(r.num_hidden_layers)]


class RadioModel(nn.Module):
    def __init__(self, r: RadioArgs):
        super().__init__()
        # the checkpoint's normalization buffers; images arrive normalized by the processor (as in mlx-vlm)
        self.input_conditioner = InputConditioner()
        self.model = RadioBackbone(r)
        self.skip = r.num_cls_tokens + r.num_registers

    def __call__(self, pixels: mx.array) -> mx.array:
        x = self.model.patch_generator(pixels)
        for block in self.model.blocks:
            x = block(x)
        return x[:, self.skip :]


class InputConditioner(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm_mean = mx.zeros((3, 1, 1))
        self.norm_std = mx.ones((3, 1, 1))


class VisionModel(nn.Module):
    def __init__(self, r: RadioArgs):
        super().__init__()
        self.radio_model = RadioModel(r)


class Projector(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        width = a.vit_hidden_size * int(1 / a.downsample_ratio) ** 2
        self.layers = [
            nn.RMSNorm(width, eps=1e-5),
            nn.Linear(width, a.projector_hidden_size, bias=False),
            SquaredReLU(),  # no parameters: keeps the checkpoint's Sequential indices (0, 1, 3)
            nn.Linear(a.projector_hidden_size, a.hidden_size, bias=False),
        ]

    def __call__(self, x: mx.array) -> mx.array:
        for layer in self.layers:
            x = layer(x)
        return x


class SquaredReLU(nn.Module):
    def __call__(self, x: mx.array) -> mx.array:
        return relu_squared(x)


class Model(nemotron_h.Model):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.vision_model = VisionModel(args.radio)
        self.mlp1 = Projector(args)
        final_norm = args.vision_final_layernorm
        if final_norm is None:
            final_norm = args.num_nextn_predict_layers > 0
        if final_norm:
            self.vision_final_layernorm = nn.LayerNorm(args.vit_hidden_size, eps=args.radio.layer_norm_eps)

    @property
    def takes_images(self) -> bool:
        return "vision_model" in self

    def encode_image(self, pixels: mx.array, grid: Any = None) -> mx.array:
        """Language-model embeddings `[tokens, hidden]` of one normalized image `[3, H, W]`."""
        x = pixels[None].astype(self.mlp1.layers[0].weight.dtype)
        features = self.vision_model.radio_model(x)
        if "vision_final_layernorm" in self:
            features = self.vision_final_layernorm(features)
        p = self.args.radio.patch_size
        grid = features.reshape(1, x.shape[2] // p, x.shape[3] // p, -1)
        shuffled = pixel_shuffle(grid, self.args.downsample_ratio, self.args.ps_version)
        return self.mlp1(shuffled.reshape(-1, shuffled.shape[-1]))

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        text, rest = {}, {}
        for key, value in weights.items():
            if key.startswith(_DROPPED) or _VIDEO in key:
                continue
            if key.startswith(("language_model.", "backbone.", "model.", "lm_head.", "mtp.")):
                text[key.removeprefix("language_model.")] = value
            else:
                rest[_projector_name(key.removeprefix("vision_projector."))] = value
        if not any(k.startswith("vision_model.") for k in rest):  # a text-only conversion
            for name in ("vision_model", "mlp1", "vision_final_layernorm"):
                self.pop(name, None)
            rest = {}
        return super().sanitize(text) | rest

    def quant_predicate(self, path: str, module: nn.Module) -> bool | dict:
        """The vision tower and projector stay in the checkpoint's precision."""
        if path.startswith(("vision_model.", "mlp1.", "vision_final_layernorm")):
            return False
        return super().quant_predicate(path, module)


def _projector_name(key: str) -> str:
    for i in ("0", "1", "3"):
        if key.startswith(f"mlp1.{i}."):
            return f"mlp1.layers.{i}." + key[len(f"mlp1.{i}.") :]
    return key


def pixel_shuffle(x: mx.array, ratio: float, version: str) -> mx.array:
    """`[B, rows, cols, C]` -> `[B, rows*r, cols*r, C/r^2]` (InternVL's shuffle, as mlx-vlm has it)."""
    B, w, h, c = x.shape
    x = x.reshape(B, w, int(h * ratio), int(c / ratio)).transpose(0, 2, 1, 3)
    x = x.reshape(B, int(h * ratio), int(w * ratio), int(c / (ratio * ratio)))
    return x if version == "v1" else x.transpose(0, 2, 1, 3)


def bilinear(table: mx.array, rows: int, cols: int) -> mx.array:
    """`[H, W, C]` resized to `[rows, cols, C]`, half-pixel centres, no antialiasing (mlx-vlm's
    `bilinear_interpolate`)."""
    H, W = table.shape[:2]

    def axis(n_out: int, n_in: int) -> tuple[mx.array, mx.array, mx.array]:
        pos = mx.array([0.0]) if n_out == 1 else (mx.arange(n_out) + 0.5) * n_in / n_out - 0.5
        lo = mx.floor(pos).astype(mx.int32)
        weight = pos - mx.clip(lo, 0, n_in - 1)
        return mx.clip(lo, 0, n_in - 1), mx.clip(lo + 1, 0, n_in - 1), weight

    r0, r1, wr = axis(rows, H)
    c0, c1, wc = axis(cols, W)
    wr, wc = wr[:, None, None], wc[None, :, None]

    def at(r: mx.array, c: mx.array) -> mx.array:
        return table[r][:, c]

    top = (1 - wr) * (1 - wc) * at(r0, c0) + (1 - wr) * wc * at(r0, c1)
    return top + wr * (1 - wc) * at(r1, c0) + wr * wc * at(r1, c1)
