"""Regenerate the tiny per-family configs in hf_models/ (no weights; tests create weights with save_pretrained)."""

from pathlib import Path

import transformers as tf

COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    output_router_logits=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
# The DeepSeek-style MoE (DeepSeek-V2/V3, GLM-4.5): fine-grained routed experts, one shared expert, a dense first layer.
DEEPSEEK_MOE = dict(
    intermediate_size=96,
    moe_intermediate_size=32,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
)
FAMILIES = {
    "tiny-qwen2-moe": tf.Qwen2MoeConfig(
        **COMMON,
        intermediate_size=96,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_experts=8,
        num_experts_per_tok=2,
        mlp_only_layers=[0],
        router_aux_loss_coef=0.01,
    ),
    "tiny-qwen3-moe": tf.Qwen3MoeConfig(
        **{**COMMON, "tie_word_embeddings": True},
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        head_dim=16,
        norm_topk_prob=True,
        mlp_only_layers=[0],
        router_aux_loss_coef=0.01,
    ),
    "tiny-mixtral": tf.MixtralConfig(**COMMON, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2),
    "tiny-deepseek-v2": tf.DeepseekV2Config(
        **{**COMMON, "num_key_value_heads": 4},
        **DEEPSEEK_MOE,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        topk_method="greedy",
    ),
    "tiny-deepseek-v3": tf.DeepseekV3Config(
        **{**COMMON, "num_key_value_heads": 4},
        **DEEPSEEK_MOE,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        n_group=2,
        topk_group=1,
    ),
    "tiny-gpt-oss": tf.GptOssConfig(
        **COMMON,
        intermediate_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        head_dim=16,
        sliding_window=8,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4},
    ),
    "tiny-olmoe": tf.OlmoeConfig(**COMMON, intermediate_size=32, num_experts=8, num_experts_per_tok=2),
    "tiny-glm4-moe": tf.Glm4MoeConfig(
        **COMMON,
        head_dim=16,
        **DEEPSEEK_MOE,
        n_group=2,
        topk_group=1,
        use_qk_norm=True,
        routed_scaling_factor=2.5,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
    ),
}

if __name__ == "__main__":
    root = Path(__file__).resolve().parent.parent / "hf_models"
    for name, config in FAMILIES.items():
        config.save_pretrained(root / name)
        print("wrote", root / name)
