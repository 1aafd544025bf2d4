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
# DeepSeek-V3 (V3.2 adds its indexer): MLA with a query LoRA, grouped top-k.
DEEPSEEK_V3 = dict(
    **{**COMMON, "num_key_value_heads": 4},
    **DEEPSEEK_MOE,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=16,
    n_group=2,
    topk_group=1,
)
# Qwen3-Next / Qwen3.5-MoE: linear (Gated DeltaNet) and full (gated) attention layers alternate, every second one
# full; a sigmoid-gated shared expert. Partial rotary (HF's default factor 0.25) on the full layers' head_dim 16.
HYBRID = dict(
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    num_experts=8,
    num_experts_per_tok=2,
    router_aux_loss_coef=0.01,
    layer_types=["linear_attention", "full_attention"] * 2,
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
    "tiny-deepseek-v3": tf.DeepseekV3Config(**DEEPSEEK_V3),
    # DeepSeek-V3.2: DeepSeek-V3 with DeepSeek Sparse Attention, a lightning indexer choosing each query's top
    # index_topk keys (4 of up to 16 here, so the tests' sequences are really sparse).
    "tiny-deepseek-v32": tf.DeepseekV32Config(**DEEPSEEK_V3, index_topk=4, index_n_heads=2, index_head_dim=16),
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
    # Layer 0 dense (a linear-attention layer with no MoE block), as mlp_only_layers allows.
    "tiny-qwen3-next": tf.Qwen3NextConfig(
        **COMMON, **HYBRID, intermediate_size=96, norm_topk_prob=True, mlp_only_layers=[0]
    ),
    # The text model of Qwen3.5-MoE, as Qwen3_5MoeForCausalLM saves it (the Hub's config is the vision-language
    # qwen3_5_moe one around it: hf_models/Qwen3.5-35B-A3B); every layer MoE, the router always renormalises.
    "tiny-qwen3.5-moe": tf.Qwen3_5MoeTextConfig(**COMMON, **HYBRID),
    # Layer 0 dense (moe_layer_start_index 1, HF's default); two ungated shared experts.
    "tiny-ernie4.5-moe": tf.Ernie4_5_MoeConfig(
        **COMMON,
        intermediate_size=96,
        moe_intermediate_size=32,
        moe_num_experts=8,
        moe_k=2,
        moe_num_shared_experts=2,
        moe_layer_start_index=1,
        router_aux_loss_coef=0.01,
    ),
    # Hunyuan-A13B's layout: qk norm, one shared MLP of the experts' size, every layer MoE.
    "tiny-hunyuan-v1-moe": tf.HunYuanMoEV1Config(
        **COMMON, head_dim=16, intermediate_size=32, num_experts=8, moe_topk=2, use_qk_norm=True
    ),
    # dots.llm1: DeepSeek-V3's router (one group here, as in dots.llm1) and a shared expert, a dense first layer.
    "tiny-dots1": tf.Dots1Config(
        **COMMON,
        head_dim=16,
        **DEEPSEEK_MOE,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    ),
    "tiny-minimax-m2": tf.MiniMaxM2Config(
        **COMMON,
        head_dim=16,
        intermediate_size=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
    ),
    # Refused before launch (capabilities.uncut), kept so the refusal is tested on what HF builds. DeepSeek-V4: every
    # attention layer type (sliding, compressed sparse, heavily compressed; compression 2 and 4 so 12 tokens compress),
    # hash-routed and learned MoE layers, 4 hyper-connection streams as in the real model.
    "tiny-deepseek-v4": tf.DeepseekV4Config(
        **{**COMMON, "num_key_value_heads": 1},
        head_dim=32,
        partial_rotary_factor=0.25,
        q_lora_rank=24,
        moe_intermediate_size=32,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        layer_types=[
            "sliding_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
            "compressed_sparse_attention",
        ],
        mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
        hc_mult=4,
        hc_sinkhorn_iters=4,
        sliding_window=4,
        o_groups=2,
        o_lora_rank=16,
        index_n_heads=2,
        index_head_dim=16,
        index_topk=2,
    ),
    # Gemma 4's text MoE (gemma4_text, Gemma4ForCausalLM; refused, capabilities.uncut): sliding and full attention
    # layers (the full ones with their own head size, keys as values), every layer a dense MLP beside 8 experts, top-2;
    # no per-layer embeddings or shared keys and values (tests/test_uncut.py adds them to see them refused too).
    "tiny-gemma4": tf.Gemma4TextConfig(
        **COMMON,
        head_dim=16,
        global_head_dim=32,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        intermediate_size=96,
        enable_moe_block=True,
        num_experts=8,
        top_k_experts=2,
        moe_intermediate_size=32,
        hidden_size_per_layer_input=0,
        num_kv_shared_layers=0,
        sliding_window=8,
        final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "full_attention"] * 2,
    ),
}

if __name__ == "__main__":
    root = Path(__file__).resolve().parent.parent / "hf_models"
    for name, config in FAMILIES.items():
        config.save_pretrained(root / name)
        print("wrote", root / name)
