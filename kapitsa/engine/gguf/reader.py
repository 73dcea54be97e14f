"""GGUF files (as llama.cpp's convert_hf_to_gguf.py writes them) back to a Hugging Face config
and Hugging Face tensor names, so the model's own `sanitize` takes them like any checkpoint.

Architectures: qwen35, qwen35moe, qwen3next (Qwen3.5 / Qwen3-Next) and nemotron_h,
nemotron_h_moe. Quantized tensors are dequantized (gguf_quants) and later re-quantized to MLX.
The conversions undone here are llama.cpp's: A_log stored as -exp(A_log), Qwen norms stored as
1 + w, conv weights squeezed to [C, K], Qwen3.5 value heads reordered from grouped to tiled,
Qwen3-Next `in_proj_qkvz` split into attn_qkv/attn_gate, experts stacked per tensor.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from gguf import GGMLQuantizationType, GGUFReader

from kapitsa.engine.gguf.config import config_from_gguf, metadata_of
from kapitsa.engine.gguf.names import NEMOTRON_BLOCK_NAMES, QWEN_BLOCK_NAMES, QWEN_MTP_SHARED_NAMES
from kapitsa.engine.gguf.quants import dequantize_mx
from kapitsa.engine.gguf.tokenizer import tokenizer_from_gguf
from kapitsa.engine.text.tokenizer import Tokenizer
from kapitsa.errors import CheckpointError, UnsupportedModel

QWEN_ARCHS = ("qwen35", "qwen35moe", "qwen3next")
NEMOTRON_ARCHS = ("nemotron_h", "nemotron_h_moe")
SUPPORTED_ARCHS = QWEN_ARCHS + NEMOTRON_ARCHS

# the MLX quantization a GGUF's predominant tensor type maps to (None: keep floats)
_MLX_QUANTIZATION = {
    GGMLQuantizationType.Q8_0: "8bit",
    GGMLQuantizationType.Q6_K: "6bit",
    GGMLQuantizationType.Q5_K: "5bit",
    GGMLQuantizationType.Q5_0: "5bit",
    GGMLQuantizationType.Q4_K: "4bit",
    GGMLQuantizationType.Q4_0: "4bit",
    GGMLQuantizationType.Q4_1: "4bit",
    GGMLQuantizationType.MXFP4: "mxfp4",
    GGMLQuantizationType.Q3_K: "3bit",
    GGMLQuantizationType.Q2_K: "2bit",
}


@dataclass(frozen=True, slots=True)
class GGUFCheckpoint:
    config: dict[str, Any]  # a Hugging Face config.json equivalent
    weights: dict[str, mx.array]  # Hugging Face tensor names
    tokenizer: Tokenizer
    suggested_quantization: str | None  # MLX quantization matching the file's, e.g. "8bit"


def _open(path: Path) -> GGUFReader:
    try:
        return GGUFReader(str(path))
    except (ValueError, OSError, IndexError, KeyError) as e:
        raise CheckpointError(f"{path} is not a readable GGUF file: {e}") from e


def _suggested_quantization(reader: GGUFReader) -> str | None:
    bytes_by_type: dict[GGMLQuantizationType, int] = {}
    for tensor in reader.tensors:
        if len(tensor.shape) >= 2:
            bytes_by_type[tensor.tensor_type] = bytes_by_type.get(tensor.tensor_type, 0) + int(tensor.n_bytes)
    if not bytes_by_type:
        return None
    return _MLX_QUANTIZATION.get(max(bytes_by_type, key=bytes_by_type.__getitem__))


def read_gguf(path: Path) -> GGUFCheckpoint:
    """Read a GGUF file of a supported architecture.

    Raises:
        CheckpointError: unreadable or inconsistent file.
        UnsupportedModel: a GGUF of another architecture.
    """
    reader = _open(path)
    meta = metadata_of(reader)
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise UnsupportedModel(
            f"{path.name} is a GGUF of architecture {arch!r}; kapitsa runs GGUF architectures: "
            f"{', '.join(SUPPORTED_ARCHS)}"
        )
    raw = {t.name: t for t in reader.tensors}
    config = config_from_gguf(
        arch, meta, {n: tuple(int(x) for x in reversed(t.shape)) for n, t in raw.items()}
    )
    tensors = _LazyDequantized(raw)
    stored_dtypes = {name: _FLOAT_TYPES.get(t.tensor_type, mx.bfloat16) for name, t in raw.items()}
    convert = _qwen_weights if arch in QWEN_ARCHS else _nemotron_weights
    # a float GGUF keeps its precision; dequantized blocks become bf16 until re-quantized
    dtype = mx.bfloat16 if any(d == mx.bfloat16 for d in stored_dtypes.values()) else _widest(stored_dtypes)
    return GGUFCheckpoint(
        config=config,
        weights={name: _to_mx(values, dtype) for name, values in convert(tensors, config)},
        tokenizer=tokenizer_from_gguf(meta, config),
        suggested_quantization=_suggested_quantization(reader),
    )


_FLOAT_TYPES = {
    GGMLQuantizationType.F32: mx.float32,
    GGMLQuantizationType.F16: mx.float16,
    GGMLQuantizationType.BF16: mx.bfloat16,
}


def _widest(dtypes: dict[str, mx.Dtype]) -> mx.Dtype:
    return mx.float16 if any(d == mx.float16 for d in dtypes.values()) else mx.float32


class _LazyDequantized(dict):
    """GGUF tensors by name, dequantized (with MLX) on access."""

    def __init__(self, raw: dict[str, Any]) -> None:
        super().__init__(raw)

    def __getitem__(self, name: str) -> mx.array:
        tensor = super().__getitem__(name)
        return dequantize_mx(tensor.data, tensor.tensor_type)


def _to_mx(values: mx.array, dtype: mx.Dtype) -> mx.array:
    # 1-D tensors (norms, biases, A, D) stay float32 as llama.cpp stores them. Evaluated now, one
    # tensor at a time, so its copy of the quantized bytes and float32 intermediates are freed.
    out = values if values.ndim == 1 else values.astype(dtype)
    mx.eval(out)
    return out


def _split_block_name(name: str) -> tuple[int, str] | None:
    if not name.startswith("blk."):
        return None
    _, index, rest = name.split(".", 2)
    return int(index), rest


def _untile_v_heads(x: mx.array, axis: int, num_k_heads: int, v_per_k: int, head_dim: int) -> mx.array:
    """Inverse of llama.cpp's grouped -> tiled value-head reorder along `axis`."""
    x = mx.moveaxis(x, axis, 0)
    rest = x.shape[1:]
    x = x.reshape(v_per_k, num_k_heads, head_dim, *rest).swapaxes(0, 1).reshape(-1, *rest)
    return mx.moveaxis(x, 0, axis)


def _qwen_weights(tensors: dict[str, mx.array], config: dict[str, Any]) -> Iterator[tuple[str, mx.array]]:
    n_layers = config["num_hidden_layers"]
    # tensors consumed together with another one (read when that one is)
    joined = (
        ("ffn_up_exps.weight", "attn_gate.weight")
        if config["model_type"] == "qwen3_next"
        else ("ffn_up_exps.weight",)
    )
    for name in tensors:
        if name.endswith(joined):
            continue
        values = tensors[name]
        if name == "token_embd.weight":
            yield "model.embed_tokens.weight", values
        elif name == "output.weight":
            yield "lm_head.weight", values
        elif name == "output_norm.weight":
            yield "model.norm.weight", values - 1.0
        elif (parsed := _split_block_name(name)) is not None:
            index, rest = parsed
            if index >= n_layers:  # the MTP blocks come after the decoder layers
                yield from _qwen_mtp_tensor(index - n_layers, rest, values, tensors, config)
                continue
            for hf_name, hf_values in _qwen_block_tensor(rest, values, tensors, index, config):
                yield f"model.layers.{index}.{hf_name}", hf_values


def _qwen_mtp_tensor(
    mtp_index: int, rest: str, values: mx.array, tensors: dict[str, mx.array], config: dict[str, Any]
) -> Iterator[tuple[str, mx.array]]:
    if rest.startswith("nextn."):
        # the file repeats the shared MTP tensors in every MTP block; embeddings/head are the model's
        hf_name = QWEN_MTP_SHARED_NAMES.get(rest)
        if hf_name is not None and mtp_index == 0:
            yield hf_name, values - 1.0 if hf_name.endswith("norm.weight") else values
        return
    index = mtp_index + config["num_hidden_layers"]
    for hf_name, hf_values in _qwen_block_tensor(rest, values, tensors, index, config):
        yield f"mtp.layers.{mtp_index}.{hf_name}", hf_values


def _qwen_block_tensor(
    rest: str, values: mx.array, tensors: dict[str, mx.array], index: int, config: dict[str, Any]
):
    if rest == "ffn_gate_exps.weight":
        up = tensors[f"blk.{index}.ffn_up_exps.weight"]
        yield "mlp.experts.gate_up_proj", mx.concatenate([values, up], axis=1)  # [E, 2I, H]
        return
    hf_name = QWEN_BLOCK_NAMES.get(rest)
    if hf_name is None:
        raise CheckpointError(f"unexpected tensor blk.{index}.{rest} in a Qwen GGUF")
    if hf_name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight")):
        values = values - 1.0  # llama.cpp folds Qwen's (1 + w) norms
    elif rest == "ssm_a":
        values = mx.log(-values)  # stored as -exp(A_log)
    elif rest == "ssm_conv1d.weight":
        values = values[:, None, :]  # [C, K] -> [C, 1, K]
    if config["model_type"] == "qwen3_next":
        if rest == "attn_qkv.weight":
            yield (
                "linear_attn.in_proj_qkvz.weight",
                _qwen_next_qkvz(values, tensors[f"blk.{index}.attn_gate.weight"], config),
            )
            return
    else:
        values = _qwen35_untile(rest, values, config)
    yield hf_name, values


def _qwen35_untile(rest: str, values: mx.array, config: dict[str, Any]) -> mx.array:
    nk, nv = config["linear_num_key_heads"], config["linear_num_value_heads"]
    if nk == nv or not rest.startswith(("attn_qkv", "attn_gate", "ssm_")):
        return values
    dk, dv, per = config["linear_key_head_dim"], config["linear_value_head_dim"], nv // nk
    if rest in ("attn_qkv.weight", "ssm_conv1d.weight"):
        qk = 2 * nk * dk
        return mx.concatenate([values[:qk], _untile_v_heads(values[qk:], 0, nk, per, dv)], axis=0)
    if rest == "attn_gate.weight":
        return _untile_v_heads(values, 0, nk, per, dv)
    if rest in ("ssm_beta.weight", "ssm_alpha.weight", "ssm_a", "ssm_dt.bias"):
        return _untile_v_heads(values, 0, nk, per, 1)
    if rest == "ssm_out.weight":
        return _untile_v_heads(values, 1, nk, per, dv)
    return values


def _qwen_next_qkvz(qkv: mx.array, z: mx.array, config: dict[str, Any]) -> mx.array:
    """Re-interleave [q; k; v] and z into Qwen3-Next's per-key-head [q_h, k_h, v_h, z_h] rows."""
    nk, dk = config["linear_num_key_heads"], config["linear_key_head_dim"]
    per_head_v = config["linear_num_value_heads"] // nk * config["linear_value_head_dim"]
    hidden = qkv.shape[1]
    q, k, v = mx.split(qkv, [nk * dk, 2 * nk * dk], axis=0)
    parts = [p.reshape(nk, -1, hidden) for p in (q, k, v, z)]  # [nk, rows_per_head, hidden]
    assert parts[2].shape[1] == per_head_v
    return mx.concatenate(parts, axis=1).reshape(-1, hidden)


def _nemotron_weights(tensors: dict[str, mx.array], config: dict[str, Any]) -> Iterator[tuple[str, mx.array]]:
    n_layers = len(config["hybrid_override_pattern"])
    top_level = {"token_embd.weight": "backbone.embeddings.weight", "output_norm.weight": "backbone.norm_f.weight",
                 "output.weight": "lm_head.weight"}  # fmt: skip
    for name in tensors:
        values = tensors[name]
        if name in top_level:
            yield top_level[name], values
        elif (parsed := _split_block_name(name)) is not None and parsed[0] < n_layers:  # later blocks: MTP
            index, rest = parsed
            for hf_name, hf_values in _nemotron_block_tensor(rest, values):
                yield f"backbone.layers.{index}.{hf_name}", hf_values


def _nemotron_block_tensor(rest: str, values: mx.array):
    if rest in ("ffn_up_exps.weight", "ffn_down_exps.weight"):
        projection = rest.split("_")[1]  # "up" / "down"
        for e in range(values.shape[0]):
            yield f"mixer.experts.{e}.{projection}_proj.weight", values[e]
        return
    hf_name = NEMOTRON_BLOCK_NAMES.get(rest)
    if hf_name is None:
        raise CheckpointError(f"unexpected tensor blk.N.{rest} in a Nemotron-H GGUF")
    if rest == "ssm_a":
        values = mx.log(-values.reshape(-1))  # stored as -exp(A_log), shape [H, 1]
    elif rest == "ssm_d":
        values = values.reshape(-1)
    elif rest == "ssm_norm.weight":
        values = values.reshape(-1)  # stored per group [G, inner / G]
    elif rest == "ssm_conv1d.weight":
        values = values[:, None, :]
    yield hf_name, values
