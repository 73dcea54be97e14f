"""Write a Hugging Face checkpoint folder as a GGUF file the way llama.cpp's convert_hf_to_gguf.py
does for qwen35 / qwen35moe / qwen3next / nemotron_h(_moe): same metadata keys, same tensor
transforms, tensor names from gguf-py's own TensorNameMap. Test support only."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT
from safetensors.numpy import load_file

from kapitsa.engine.loading.safetensors_io import bfloat16_bits_to_float32

_ARCHS = {
    "qwen3_5": gguf.MODEL_ARCH.QWEN35,
    "qwen3_5_moe": gguf.MODEL_ARCH.QWEN35MOE,
    "qwen3_next": gguf.MODEL_ARCH.QWEN3NEXT,
}


def _read_weights(folder: Path) -> dict[str, np.ndarray]:
    weights = {}
    for file in sorted(folder.glob("*.safetensors")):
        weights.update(load_file(str(file)))
    return {
        k: (bfloat16_bits_to_float32(v) if v.dtype == np.uint16 else v.astype(np.float32))
        for k, v in weights.items()
    }


def _reorder_v_heads(x: np.ndarray, axis: int, nk: int, per: int, head_dim: int) -> np.ndarray:
    x = np.moveaxis(x, axis, 0)
    rest = x.shape[1:]
    x = x.reshape(nk, per, head_dim, *rest).swapaxes(0, 1).reshape(-1, *rest)
    return np.moveaxis(x, 0, axis)


def _qwen35_reorder(name: str, x: np.ndarray, t: dict) -> np.ndarray:
    nk, nv = t["linear_num_key_heads"], t["linear_num_value_heads"]
    if nk == nv or "linear_attn." not in name:
        return x
    dk, dv, per = t["linear_key_head_dim"], t["linear_value_head_dim"], nv // nk
    qk = 2 * nk * dk
    if ".in_proj_qkv." in name:
        return np.concatenate([x[:qk], _reorder_v_heads(x[qk:], 0, nk, per, dv)])
    if ".in_proj_z." in name:
        return _reorder_v_heads(x, 0, nk, per, dv)
    if ".in_proj_b." in name or ".in_proj_a." in name or name.endswith((".A_log", ".dt_bias")):
        return _reorder_v_heads(x, 0, nk, per, 1)
    if ".conv1d" in name:
        x = x.squeeze()
        return np.concatenate([x[:qk], _reorder_v_heads(x[qk:], 0, nk, per, dv)])
    if ".out_proj." in name:
        return _reorder_v_heads(x, 1, nk, per, dv)
    return x


_MTP_SHARED = {
    "mtp.fc.weight": "nextn.eh_proj.weight",
    "mtp.pre_fc_norm_embedding.weight": "nextn.enorm.weight",
    "mtp.pre_fc_norm_hidden.weight": "nextn.hnorm.weight",
    "mtp.norm.weight": "nextn.shared_head_norm.weight",
}


def _mtp_renamed(name: str, x: np.ndarray, t: dict):
    """As _Qwen35MtpMixin: MTP layers become blocks after the decoder; shared tensors repeat per block."""
    n_layers, n_mtp = t["num_hidden_layers"], t.get("mtp_num_hidden_layers", 1)
    if name in _MTP_SHARED:
        values = x + 1 if name.endswith("norm.weight") else x
        for b in range(n_layers, n_layers + n_mtp):
            yield f"__gguf__blk.{b}.{_MTP_SHARED[name]}", values
        return
    j, rest = name.removeprefix("mtp.layers.").split(".", 1)
    yield f"model.layers.{int(j) + n_layers}.{rest}", x


def _qwen_tensors(weights: dict, t: dict, kind: str, *, mtp: bool):
    """(hf-style name for the tensor map, values) after convert's Qwen3Next/Qwen3.5 transforms."""
    renamed = []
    for name, x in weights.items():
        if name.startswith("model.visual.") or (name.startswith("mtp.") and not mtp):
            continue
        renamed.extend(_mtp_renamed(name, x, t) if name.startswith("mtp.") else [(name, x)])
    experts: dict[str, dict[str, np.ndarray]] = {}
    for name, x in renamed:
        if name.startswith("__gguf__"):
            yield name, x
            continue
        name = name.replace("language_model.", "")
        if kind != "qwen3_next":
            x = _qwen35_reorder(name, x, t)
        if name.endswith(".A_log"):
            x = -np.exp(x)
        elif name.endswith(".dt_bias"):
            name = name.replace(".dt_bias", ".dt_proj.bias")
        elif "conv1d" in name:
            x = x.squeeze()
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            x = x + 1
        if name.endswith("experts.gate_up_proj"):
            half = x.shape[1] // 2
            prefix = name.rsplit(".", 1)[0]
            yield f"{prefix}.gate_proj.weight", x[:, :half]
            yield f"{prefix}.up_proj.weight", x[:, half:]
        elif name.endswith("experts.down_proj"):
            yield name + ".weight", x
        elif ".experts." in name:
            prefix, rest = name.split(".experts.")
            expert, projection = rest.split(".", 1)
            experts.setdefault(f"{prefix}.experts.{projection}", {})[int(expert)] = x
        elif "in_proj_qkvz" in name:
            yield from _split_qkvz(name, x, t)
        else:
            yield name, x
    for name, per_expert in experts.items():
        yield name, np.stack([per_expert[e] for e in sorted(per_expert)])


def _split_qkvz(name: str, x: np.ndarray, t: dict):
    nk, dk = t["linear_num_key_heads"], t["linear_key_head_dim"]
    per_v = t["linear_num_value_heads"] // nk * t["linear_value_head_dim"]
    hidden = x.shape[1]
    x = x.T.reshape(hidden, nk, 2 * dk + 2 * per_v)
    q, k, v, z = np.split(x, [dk, 2 * dk, 2 * dk + per_v], axis=-1)
    qkv = np.concatenate([p.reshape(hidden, -1) for p in (q, k, v)], axis=-1).T
    bid = name.split(".")[2]
    yield f"__gguf__blk.{bid}.attn_qkv.weight", qkv
    yield f"__gguf__blk.{bid}.attn_gate.weight", z.reshape(hidden, -1).T


def _nemotron_tensors(weights: dict, c: dict):
    experts: dict[str, dict[int, np.ndarray]] = {}
    for name, x in weights.items():
        if name.endswith("e_score_correction_bias"):
            name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        if name.endswith("mixer.dt_bias"):
            name = name.replace("dt_bias", "dt.bias")
        elif name.endswith("conv1d.weight"):
            x = x.squeeze()
        elif name.endswith("mixer.A_log"):
            x = -np.exp(x).reshape(-1, 1)
        elif name.endswith("mixer.D"):
            x = x.reshape(-1, 1)
        elif name.endswith("mixer.norm.weight"):
            x = x.reshape(c["n_groups"], -1)
        if ".mixer.experts." in name:
            prefix, rest = name.split(".mixer.experts.")
            expert, projection = rest.split(".", 1)
            bid = prefix.split(".")[2]
            experts.setdefault(f"model.layers.{bid}.mlp.experts.{projection}", {})[int(expert)] = x
            continue
        yield name, x
    for name, per_expert in experts.items():
        yield name, np.stack([per_expert[e] for e in sorted(per_expert)])


def _qtype_for(gguf_name: str, x: np.ndarray, qtype: QT) -> QT:
    keep_f32 = x.ndim < 2 or "ssm_conv1d" in gguf_name or "ffn_gate_inp" in gguf_name
    if keep_f32 or (qtype not in (QT.F16, QT.BF16, QT.F32) and x.shape[-1] % 32):
        return QT.F32
    return qtype


def _add_tensor(writer: gguf.GGUFWriter, name: str, x: np.ndarray, qtype: QT) -> None:
    qtype = _qtype_for(name, x, qtype)
    if qtype == QT.F32:
        writer.add_tensor(name, np.ascontiguousarray(x, dtype=np.float32))
    elif qtype == QT.F16:
        writer.add_tensor(name, np.ascontiguousarray(x, dtype=np.float16))
    else:
        writer.add_tensor(
            name, gguf.quants.quantize(np.ascontiguousarray(x, dtype=np.float32), qtype), raw_dtype=qtype
        )


def _add_vocab(writer: gguf.GGUFWriter, folder: Path, vocab_size: int, pre: str) -> None:
    tok = json.loads((folder / "tokenizer.json").read_text())
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    gen = json.loads((folder / "generation_config.json").read_text())
    id_to_token = {i: t for t, i in tok["model"]["vocab"].items()}
    kinds = {}
    for added in tok["added_tokens"]:
        id_to_token[added["id"]] = added["content"]
        kinds[added["id"]] = gguf.TokenType.CONTROL if added["special"] else gguf.TokenType.USER_DEFINED
    tokens = [id_to_token.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    types = [
        kinds.get(i, gguf.TokenType.NORMAL if i in id_to_token else gguf.TokenType.UNUSED)
        for i in range(vocab_size)
    ]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    eos = tok_config["eos_token"]
    writer.add_eos_token_id(tokens.index(eos))
    if gen.get("bos_token_id") is not None:
        writer.add_bos_token_id(gen["bos_token_id"])
    writer.add_chat_template(tok_config["chat_template"])


def _qwen_metadata(writer: gguf.GGUFWriter, t: dict, *, mtp_layers: int) -> None:
    writer.add_context_length(t["max_position_embeddings"])
    writer.add_embedding_length(t["hidden_size"])
    writer.add_block_count(t["num_hidden_layers"] + mtp_layers)
    if mtp_layers:
        writer.add_nextn_predict_layers(mtp_layers)
    writer.add_feed_forward_length(t.get("intermediate_size", 0))
    writer.add_head_count(t["num_attention_heads"])
    writer.add_head_count_kv(t["num_key_value_heads"])
    writer.add_key_length(t["head_dim"])
    writer.add_value_length(t["head_dim"])
    rope = t.get("rope_parameters") or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta", t.get("rope_theta", 10000))))
    writer.add_layer_norm_rms_eps(t["rms_norm_eps"])
    if t.get("num_experts"):
        writer.add_expert_count(t["num_experts"])
        writer.add_expert_used_count(t["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(t["moe_intermediate_size"])
        writer.add_expert_shared_feed_forward_length(t["shared_expert_intermediate_size"])
    writer.add_ssm_conv_kernel(t["linear_conv_kernel_dim"])
    writer.add_ssm_state_size(t["linear_key_head_dim"])
    writer.add_ssm_group_count(t["linear_num_key_heads"])
    writer.add_ssm_time_step_rank(t["linear_num_value_heads"])
    writer.add_ssm_inner_size(t["linear_value_head_dim"] * t["linear_num_value_heads"])
    writer.add_full_attention_interval(t.get("full_attention_interval", 4))
    writer.add_rope_dimension_count(int(t["head_dim"] * t.get("partial_rotary_factor", 0.25)))
    if "mrope_section" in rope:
        writer.add_rope_dimension_sections([*rope["mrope_section"], 0])
    scaling = rope if rope.get("rope_type") == "yarn" else t.get("rope_scaling") or {}
    if scaling.get("rope_type") == "yarn":  # as convert_hf_to_gguf.py writes a YaRN block
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(scaling["factor"])
        writer.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
        if "attention_factor" in scaling:
            writer.add_rope_scaling_yarn_attn_factor(scaling["attention_factor"])


def _nemotron_metadata(writer: gguf.GGUFWriter, c: dict) -> None:
    pattern = c["hybrid_override_pattern"]
    is_moe = "E" in pattern
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    writer.add_block_count(len(pattern))
    ff = c["moe_intermediate_size"] if is_moe else c["intermediate_size"]
    writer.add_feed_forward_length([ff if s in "E-" else 0 for s in pattern])
    writer.add_head_count(c["num_attention_heads"])
    writer.add_head_count_kv([c["num_key_value_heads"] if s == "*" else 0 for s in pattern])
    writer.add_key_length(c["head_dim"])
    writer.add_value_length(c["head_dim"])
    writer.add_layer_norm_rms_eps(c["layer_norm_epsilon"])
    writer.add_ssm_conv_kernel(c["conv_kernel"])
    writer.add_ssm_state_size(c["ssm_state_size"])
    writer.add_ssm_group_count(c["n_groups"])
    writer.add_ssm_time_step_rank(c["mamba_num_heads"])
    writer.add_ssm_inner_size(c["mamba_num_heads"] * c["mamba_head_dim"])
    if is_moe:
        writer.add_expert_used_count(c["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(c["moe_intermediate_size"])
        writer.add_expert_shared_feed_forward_length(c["moe_shared_expert_intermediate_size"])
        writer.add_expert_count(c["n_routed_experts"])
        writer.add_expert_shared_count(c["n_shared_experts"])
        writer.add_expert_weights_norm(c["norm_topk_prob"])
        writer.add_expert_weights_scale(c["routed_scaling_factor"])
        writer.add_expert_group_count(c["n_group"])
        writer.add_expert_group_used_count(c["topk_group"])


RawTensor = tuple[np.ndarray, QT]  # bytes as gguf stores them, and their type


def export_gguf(
    folder: Path,
    out: Path,
    qtype: QT = QT.Q8_0,
    *,
    arch_override: str | None = None,
    mtp: bool = False,
    raw_tensor: Callable[[str, np.ndarray], RawTensor | None] | None = None,
) -> Path:
    """`raw_tensor(gguf_name, values)` may supply a tensor's stored bytes itself (e.g. K-quant blocks)."""
    config = json.loads((folder / "config.json").read_text())
    kind = config["model_type"]
    weights = _read_weights(folder)
    if kind == "nemotron_h":
        arch = (
            gguf.MODEL_ARCH.NEMOTRON_H_MOE
            if "E" in config["hybrid_override_pattern"]
            else gguf.MODEL_ARCH.NEMOTRON_H
        )
        # the tiny tokenizers split text with Qwen's pattern, which llama.cpp calls "qwen2"
        text, tensors, pre = config, _nemotron_tensors(weights, config), "qwen2"
    else:
        arch = _ARCHS[kind]
        text = config.get("text_config", config)
        tensors, pre = _qwen_tensors(weights, text, kind, mtp=mtp), "qwen35"
    arch_name = arch_override or gguf.MODEL_ARCH_NAMES[arch]
    writer = gguf.GGUFWriter(str(out), arch_name)
    writer.add_name(folder.name)
    if kind == "nemotron_h":
        _nemotron_metadata(writer, text)
    else:
        _qwen_metadata(writer, text, mtp_layers=text.get("mtp_num_hidden_layers", 1) if mtp else 0)
    _add_vocab(writer, folder, text["vocab_size"], pre)
    blocks = len(text["hybrid_override_pattern"]) if kind == "nemotron_h" else text["num_hidden_layers"]
    if mtp:
        blocks += text.get("mtp_num_hidden_layers", 1)
    tensor_map = gguf.get_tensor_name_map(arch, blocks)
    for name, x in tensors:
        if name.startswith("__gguf__"):
            gguf_name = name.removeprefix("__gguf__")
        else:
            gguf_name = tensor_map.get_name(name, try_suffixes=(".weight", ".bias"))
            assert gguf_name is not None, f"no GGUF name for {name}"
        supplied = raw_tensor(gguf_name, x) if raw_tensor else None
        if supplied is not None:
            writer.add_tensor(gguf_name, supplied[0], raw_dtype=supplied[1])
        else:
            _add_tensor(writer, gguf_name, x, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
