"""GGUF block tensor names (after `blk.N.`, as gguf-py's TensorNameMap gives them for llama.cpp's
qwen35/qwen35moe/qwen3next and nemotron_h(_moe) architectures) -> Hugging Face names (after
`model.layers.N.` / `backbone.layers.N.`)."""

from __future__ import annotations

QWEN_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ssm_a": "linear_attn.A_log",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_ba.weight": "linear_attn.in_proj_ba.weight",
    "ssm_in.weight": "linear_attn.in_proj_qkvz.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
}

NEMOTRON_BLOCK_NAMES = {
    "attn_norm.weight": "norm.weight",
    "ssm_in.weight": "mixer.in_proj.weight",
    "ssm_conv1d.weight": "mixer.conv1d.weight",
    "ssm_conv1d.bias": "mixer.conv1d.bias",
    "ssm_dt.bias": "mixer.dt_bias",
    "ssm_a": "mixer.A_log",
    "ssm_d": "mixer.D",
    "ssm_norm.weight": "mixer.norm.weight",
    "ssm_out.weight": "mixer.out_proj.weight",
    "attn_q.weight": "mixer.q_proj.weight",
    "attn_k.weight": "mixer.k_proj.weight",
    "attn_v.weight": "mixer.v_proj.weight",
    "attn_output.weight": "mixer.o_proj.weight",
    "ffn_up.weight": "mixer.up_proj.weight",
    "ffn_down.weight": "mixer.down_proj.weight",
    "ffn_gate_inp.weight": "mixer.gate.weight",
    "exp_probs_b.bias": "mixer.gate.e_score_correction_bias",
    "ffn_up_shexp.weight": "mixer.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mixer.shared_experts.down_proj.weight",
    "ffn_latent_down.weight": "mixer.fc1_latent_proj.weight",
    "ffn_latent_up.weight": "mixer.fc2_latent_proj.weight",
}

# Qwen MTP tensors shared by the MTP block(s), stored as `blk.{n_layers + i}.nextn.*`
QWEN_MTP_SHARED_NAMES = {
    "nextn.eh_proj.weight": "mtp.fc.weight",
    "nextn.enorm.weight": "mtp.pre_fc_norm_embedding.weight",
    "nextn.hnorm.weight": "mtp.pre_fc_norm_hidden.weight",
    "nextn.shared_head_norm.weight": "mtp.norm.weight",
}
