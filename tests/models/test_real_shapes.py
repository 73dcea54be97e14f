"""Real published shapes (no weights: MLX allocates lazily) give the state sizes of hybrid-engine.md §4."""

from __future__ import annotations

import mlx.core as mx

from kapitsa.engine.models import nemotron_h, qwen3_5

MiB, KiB = 1 << 20, 1 << 10

QWEN35_4B = {
    "model_type": "qwen3_5",
    "text_config": {
        "model_type": "qwen3_5_text", "hidden_size": 2560, "num_hidden_layers": 32, "num_attention_heads": 16,
        "num_key_value_heads": 4, "head_dim": 256, "intermediate_size": 9216, "vocab_size": 248320,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
        "mtp_num_hidden_layers": 1, "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                            "mrope_interleaved": True, "mrope_section": [11, 11, 10]},
    },
}  # fmt: skip

NEMOTRON_NANO = {
    "model_type": "nemotron_h", "vocab_size": 131072, "hidden_size": 2688, "num_attention_heads": 32,
    "num_key_value_heads": 2, "head_dim": 128, "mamba_num_heads": 64, "mamba_head_dim": 64,
    "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4, "n_routed_experts": 128, "num_experts_per_tok": 6,
    "moe_intermediate_size": 1856, "moe_shared_expert_intermediate_size": 3712, "n_shared_experts": 1,
    "routed_scaling_factor": 2.5, "time_step_limit": [0.0, float("inf")],
    "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
}  # fmt: skip


def test_qwen35_4b_state_sizes():
    model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict(QWEN35_4B))
    recurrent, kv = model.state_bytes(mx.bfloat16)
    assert recurrent == 24 * (2 * MiB + 48 * KiB)  # 49.1 MiB per sequence
    assert kv == 32 * KiB
    assert sum(layer.is_linear for layer in model.layers) == 24


def test_nemotron_nano_state_sizes():
    model = nemotron_h.Model(nemotron_h.ModelArgs.from_dict(NEMOTRON_NANO))
    recurrent, kv = model.state_bytes(mx.bfloat16)
    assert recurrent == 23 * (2 * MiB + 36 * KiB)  # 46.8 MiB per sequence
    assert kv == 6 * KiB
    assert model.args.pattern.count("E") == 23 and len(model.layers) == 52
