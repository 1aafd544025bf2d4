"""Hugging Face MoE models, cut into the two halves DisagMoE places on different GPUs.

families       each family's facts (``capabilities.facts``) with how its modules are called: shared experts, router
               (Qwen2/3-MoE, Qwen3-Next, Qwen3.5-MoE, Mixtral, DeepSeek-V2/V3/V3.2/V4, GLM-4.5, GPT-OSS, OLMoE,
               ERNIE-4.5, Hunyuan, dots.llm1, MiniMax-M2), and what the cut refuses
moe_pattern    which layers route to experts, from the config alone (no torch)
attention_part the attention part of a layer and the head, built from HF's own modules
expert_shard   a slice of a layer's routed experts, in HF's own experts module
parts          what one rank holds: the attention stage and the expert stage, and compiling them
model_facts    facts of the whole model from its config: expert count, residual hand-off shape, routing
context        a micro-batch's masks, rotary tables and token ids, as HF's model builds them
hyper_connections  DeepSeek-V4's residual streams: enter/leave a block, the routed sum weighed per stream
aux_loss       HF's router aux loss, split into each layer's counts and probability sums
grouped_experts  the expert compute: grouped GEMMs over the routed (row, expert) pairs
loading        load a model or its config with clear errors; a meta model that allocates nothing
partial_load   fill the parts a rank cut from a meta model, reading only its own tensors
naming         our parameter names <-> HF's
hf_writer      write a ``save_pretrained`` directory atomically
split          single-process reference of the disaggregated data flow; check: it against HF's model
one_layer      one real-size layer and its parts as timed callables (benchmarks, ``disagmoe-plan profile``)
skew           a skewed router for tests and ``disagmoe-verify --skew``
"""
