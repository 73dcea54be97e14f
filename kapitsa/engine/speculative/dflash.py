"""Block drafting in the DFlash style (z-lab/dflash; arXiv 2602.06036).

A small attention stack conditioned on the target's own hidden states drafts a whole block in one
forward: the input is `[last, MASK x (k)]`, every block position attends (non-causally) to the
block and to a context of `hidden_norm(fc(concat(target layer outputs at target_layer_ids)))`
rows, one per committed token, whose K/V are cached. Token embeddings and the LM head are the
target's own. Weights load from the published checkpoint layout: config.json with
`dflash_config: {target_layer_ids, mask_token_id}`, `block_size`, `num_target_layers`, and
tensors `fc.weight`, `hidden_norm.weight`, `layers.N.{self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm,
mlp.{gate,up,down}_proj, input_layernorm, post_attention_layernorm}.weight`, `norm.weight`.

The context covers the prompt's last positions (the prefill keeps their layer outputs:
runner/prompt_tail.py; positions restored from the prefix cache were never computed and are not in
it) and every position decoded since.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from kapitsa.engine.models.sparse_moe import MLP
from kapitsa.engine.ops.rope import Rope
from kapitsa.engine.speculative.drafter import Draft
from kapitsa.engine.speculative.tree import TREE_TOP_K, DraftTree, build_best_first, top_candidates
from kapitsa.errors import CheckpointError


def default_target_layers(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's spread of tapped layers when a config does not list them."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    rope_scaling: dict[str, Any] | None = None
    block_size: int = 16
    target_layer_ids: tuple[int, ...] = field(default_factory=tuple)
    mask_token_id: int = 0

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> DFlashConfig:
        extra = cfg.get("dflash_config") or {}
        layers = extra.get("target_layer_ids") or default_target_layers(
            cfg["num_target_layers"], cfg["num_hidden_layers"]
        )
        return cls(
            hidden_size=cfg["hidden_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg["num_key_value_heads"],
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
            intermediate_size=cfg["intermediate_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta", 1e6),
            rope_scaling=cfg.get("rope_scaling"),
            block_size=cfg.get("block_size", 16),
            target_layer_ids=tuple(layers),
            mask_token_id=int(extra.get("mask_token_id", cfg.get("mask_token_id", 0))),
        )


class _Attention(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = nn.RMSNorm(c.head_dim, eps=c.rms_norm_eps)
        self.k_norm = nn.RMSNorm(c.head_dim, eps=c.rms_norm_eps)

    def kv(self, x: mx.array, rope: Rope, offset: int) -> tuple[mx.array, mx.array]:
        B, T, _ = x.shape
        k = self.k_norm(self.k_proj(x).reshape(B, T, self.kv_heads, -1)).transpose(
            0, 2, 1, 3
        )  # [B, Hkv, T, D]
        v = self.v_proj(x).reshape(B, T, self.kv_heads, -1).transpose(0, 2, 1, 3)
        return rope(k, offset), v

    def __call__(self, x: mx.array, ctx_k: mx.array, ctx_v: mx.array, rope: Rope) -> mx.array:
        B, T, _ = x.shape
        offset = ctx_k.shape[2]
        q = self.q_norm(self.q_proj(x).reshape(B, T, self.heads, -1)).transpose(0, 2, 1, 3)  # [B, H, T, D]
        k, v = self.kv(x, rope, offset)
        keys, values = mx.concatenate([ctx_k, k], axis=2), mx.concatenate([ctx_v, v], axis=2)
        out = mx.fast.scaled_dot_product_attention(rope(q, offset), keys, values, scale=self.head_dim**-0.5)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, T, -1))


class _Layer(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.self_attn = _Attention(c)
        self.mlp = MLP(c.hidden_size, c.intermediate_size)  # Qwen3's SwiGLU, same weight names
        self.input_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)


class DFlashModel(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        c = config
        self.fc = nn.Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.layers = [_Layer(c) for _ in range(c.num_hidden_layers)]
        self.norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.rope = Rope(c.head_dim, c.rope_theta, c.rope_scaling)

    def context(self, taps: mx.array) -> mx.array:
        """Concatenated target layer outputs `[B, S, n*H]` -> context rows `[B, S, H]`."""
        return self.hidden_norm(self.fc(taps))

    def block(self, h: mx.array, ctx_kv: list[tuple[mx.array, mx.array]]) -> mx.array:
        """Embedded block `[B, T, H]` -> final hidden `[B, T, H]` given each layer's context K/V."""
        for layer, (k, v) in zip(self.layers, ctx_kv, strict=True):
            h = h + layer.self_attn(layer.input_layernorm(h), k, v, self.rope)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h)

    def context_kv(self, ctx: mx.array, offset: int) -> list[tuple[mx.array, mx.array]]:
        return [layer.self_attn.kv(ctx, self.rope, offset) for layer in self.layers]

    def empty_kv(self, batch: int, dtype: mx.Dtype) -> list[tuple[mx.array, mx.array]]:
        """Each layer's context K/V before any committed position."""
        empty = mx.zeros((batch, self.config.num_key_value_heads, 0, self.config.head_dim), dtype=dtype)
        return [(empty, empty) for _ in self.layers]

    def block_hidden(
        self, target, first: mx.array, ctx_kv: list[tuple[mx.array, mx.array]], depth: int
    ) -> mx.array:  # noqa: ANN001 - the served HybridLM
        """`[B, depth, H]`: the final hidden states of the MASK slots of the block `[first, MASK x
        depth]` per row, which the target's LM head reads."""
        embed = target.backbone_parts()[0]
        masks = mx.full((first.shape[0], depth), self.config.mask_token_id, dtype=mx.int32)
        hidden = self.block(embed(mx.concatenate([first.astype(mx.int32), masks], axis=1)), ctx_kv)
        return hidden[:, 1:]

    def block_logits(
        self, target, first: mx.array, ctx_kv: list[tuple[mx.array, mx.array]], depth: int
    ) -> mx.array:  # noqa: ANN001 - the served HybridLM
        """`[B, depth, V]`: the target's LM head over `block_hidden`."""
        return target.head()(self.block_hidden(target, first, ctx_kv, depth))


def load_dflash(path: str | Path) -> DFlashModel:
    """Load a DFlash drafter folder (config.json + *.safetensors) as published by z-lab."""
    folder = Path(path)
    try:
        config = DFlashConfig.from_dict(json.loads((folder / "config.json").read_text()))
    except (OSError, KeyError, ValueError) as err:
        raise CheckpointError(f"{folder} is not a DFlash drafter checkpoint: {err}") from err
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder} has no .safetensors files")
    weights = {k.removeprefix("model."): v for f in files for k, v in mx.load(str(f)).items()}
    model = DFlashModel(config)
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as err:
        raise CheckpointError(f"DFlash weights in {folder} do not match its config: {err}") from err
    mx.eval(model.parameters())
    return model


class DFlashDrafter:
    """Per-sequence drafting state: the context K/V and the target taps not yet folded in."""

    name = "block"
    needs_hidden = False

    def __init__(self, drafter: DFlashModel, target) -> None:  # noqa: ANN001 - the served HybridLM
        self.drafter = drafter
        self.target = target
        self.tap_layers = drafter.config.target_layer_ids
        self._kv: list[tuple[mx.array, mx.array]] | None = None
        self._length = 0
        self._pending: mx.array | None = None  # [S, n*H] taps of committed positions

    def observe(self, new_tokens: Sequence[int]) -> None:
        pass

    def after_verify(self, hidden: mx.array | None, tokens: Sequence[int], taps: dict[int, mx.array]) -> None:
        rows = mx.concatenate([taps[i] for i in self.tap_layers], axis=-1)
        self._pending = rows if self._pending is None else mx.concatenate([self._pending, rows], axis=0)

    def _fold_pending(self) -> None:
        if self._pending is None:
            return
        new = self.drafter.context_kv(self.drafter.context(self._pending[None]), self._length)
        self._kv = (
            new
            if self._kv is None
            else [
                (mx.concatenate([k0, k1], axis=2), mx.concatenate([v0, v1], axis=2))
                for (k0, v0), (k1, v1) in zip(self._kv, new, strict=True)
            ]
        )
        self._length += self._pending.shape[0]
        self._pending = None

    def propose(self, context: Sequence[int], max_tokens: int) -> Draft:
        if max_tokens <= 0 or not context:
            self._fold_pending()
            return Draft(())
        return Draft(tuple(mx.argmax(self._block_logits(context, max_tokens), axis=-1).tolist()))

    def _block_logits(self, context: Sequence[int], depth: int) -> mx.array:
        """[depth, V]: the target's LM head over the drafter's block after the last token."""
        self._fold_pending()
        first = mx.array([[context[-1]]], dtype=mx.int32)
        kv = self._kv or self.drafter.empty_kv(1, self._embed_dtype())
        return self.drafter.block_logits(self.target, first, kv, depth)[0]

    def propose_tree(self, context: Sequence[int], budget: int, *, top_k: int = TREE_TOP_K) -> DraftTree:
        """A best-first tree over one block forward: the block gives each depth's distribution
        given the context alone, so a node's candidates are its depth's `top_k`, and nodes are
        grown by summed log-probability until `budget` draft nodes (KFlash)."""
        root = int(context[-1]) if context else 0
        if budget <= 0 or not context:
            return DraftTree.chain(root, ())
        logits = self._block_logits(context, budget)  # [budget, V]
        per_depth = [top_candidates(logits[d], top_k) for d in range(budget)]
        return build_best_first(
            root, lambda path: per_depth[len(path)] if len(path) < budget else [], budget=budget, top_k=top_k
        )

    def _embed_dtype(self) -> mx.Dtype:
        """The dtype of the target's token embeddings (the block's activations)."""
        return self.target.backbone_parts()[0](mx.array([[0]], dtype=mx.int32)).dtype
