"""One record per family DisagMoE-DS cuts: everything the runtime (``models``), the planner (``planner.hf_config``)
and the tests read of a family by its ``model_type`` (pure Python: no torch, no transformers).

Adding a family is one ``FamilyFacts`` entry in ``FACTS`` (and its tiny model in hf_models/): its MoE block's
names, which layers route (``moe_pattern``), how its attention and MLPs are laid out (the planner's field maps), and
the levers its cut cannot hold yet, each with its reason (``not_with``, read by ``capabilities.rules``). What the
runtime calls on its modules (``models.families``) is chosen by the kinds named here, so a family whose modules are
called as another's needs nothing more.

>>> FACTS["deepseek_v3"].moe_layers, FACTS["deepseek_v3"].first_dense, FACTS["deepseek_v3"].attention
('first_k_dense', 3, 'mla')
>>> facts_of("qwen3_5_moe").model_type  # a vision-language config.json names its text model's family
'qwen3_5_moe_text'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

# Which decoder layers route to experts (``moe_pattern.moe_layer_pattern`` reads the config fields named):
#   every            every layer
#   first_k_dense    from ``first_k_dense_replace`` on (``first_dense`` where absent or null)
#   mlp_layer_types  where ``mlp_layer_types`` says "sparse", else as first_k_dense
#   sparse_step      unless in ``mlp_layer_types``, and only every ``decoder_sparse_step``-th layer (Qwen)
#   interval         from ``moe_layer_start_index`` to ``moe_layer_end_index``, every ``moe_layer_interval`` (ERNIE)
MoeLayers = Literal["every", "first_k_dense", "mlp_layer_types", "sparse_step", "interval"]
# Shared experts on the attention side: a sigmoid-gated shared expert (Qwen2-MoE), ``shared_experts`` (DeepSeek; a
# count of the experts' size, ``shared_count``), or one ungated shared MLP of the experts' size (Hunyuan).
SharedExperts = Literal["gated", "experts", "mlp"]
# Sliding windows where config.json has no ``layer_types``: none, every layer, even layers (GPT-OSS), even layers
# below ``max_window_layers`` (Qwen2-MoE); ``window_switch``: only with ``use_sliding_window``.
Windows = Literal["none", "every", "even", "even_below_max"]


@dataclass(frozen=True)
class FamilyFacts:
    """What DisagMoE-DS knows of one HF MoE family.

    Attributes:
        model_type: its language model's ``config.model_type``.
        tiny: its tiny model, ``hf_models/tiny-<tiny>`` (the tests' checkpoints).
        hub_type: the ``model_type`` of a vision-language config.json whose ``text_config`` is this family's
            (Qwen3.5-MoE's Hub config), or None.
        num_experts_attr: the config attribute that sets the experts module's expert count.
        router_attr: the MoE block's attribute holding the router (``gate``; ``router`` for GPT-OSS).
        router_weight: the router's [E, H] weight, as a dotted path from the router (``wg.weight`` for Hunyuan).
        router_call: how the block calls its router where it is not ``router(x)``: ``bias_argument`` (MiniMax-M2
            hands it the block's correction bias), ``token_ids`` (DeepSeek-V4's hash-routed layers take the ids).
        router_bias: the router has a bias (GPT-OSS; ERNIE's correction bias is a frozen parameter of that size).
        has_aux_loss: HF adds ``router_aux_loss_coef * load_balancing_loss`` when ``output_router_logits``.
        expert_bias_path: the correction bias of DeepSeek-V3 style auxiliary-loss-free balancing, as a dotted path
            from the MoE block, or None.
        token_table: a hash router's token id -> experts table, as a dotted path from the MoE block, or None.
        experts: ``gated_fused`` (gate_up_proj [E, 2I, H], down_proj [E, H, I]: the grouped-GEMM path) or
            ``gpt_oss`` (transposed, interleaved, biased, clamped: HF's own module).
        shared_experts: the kind of shared experts (``SharedExperts``), or None.
        shared_count: for ``experts``: the config field counting them and its default.
        moe_intermediate: the experts' size is ``moe_intermediate_size`` and dense MLPs are ``intermediate_size``
            (else the experts are ``intermediate_size`` and no layer is dense).
        moe_layers: which layers route (``MoeLayers``); ``first_dense``: HF's default ``first_k_dense_replace``.
        hash_layers: HF's default count of hash-routed first layers (DeepSeek-V4's ``num_hash_layers``), or None.
        attention: ``gqa`` (MHA/GQA/MQA), ``mla`` (DeepSeek's latent attention: a K and V per query head) or
            ``compressed`` (DeepSeek-V4: one K=V head, a sliding window and compressed keys).
        linear_attention: hybrid layers of Gated DeltaNet beside gated softmax attention: its input projections
            (``qkvz``: Qwen3-Next's fused ones, ``split``: Qwen3.5's), or "" for none.
        qk_norm: ``head`` (per-head q/k RMSNorm), ``full`` (over the whole projection), or "" (a config's
            ``use_qk_norm`` turns on ``head``).
        bias: the config field that turns on the q/k/v projections' bias, and its default.
        o_bias: the output projection takes that bias too (Qwen2-MoE: no).
        sinks: learned attention sinks, one per head (GPT-OSS).
        indexer: a lightning indexer beside MLA (DeepSeek-V3.2's sparse attention).
        windows, window_switch: sliding windows without ``layer_types`` (``Windows``).
        mrope: the rotary embedding takes M-RoPE's (3, B, S) position ids (Qwen3.5).
        hyper_connections: the residual is several streams (DeepSeek-V4, ``models.hyper_connections``).
        rotary_tables: the rotary embedding's tables by name (DeepSeek-V4: ``main``, ``compress``); () for one.
        mask_types: (layer type, the layer type whose mask it takes) pairs.
        not_with: (lever, why) pairs: the levers (``capabilities.rules.LEVERS``) this family's cut cannot run
            with yet, each refused before launch with its reason.
    """

    model_type: str
    tiny: str
    hub_type: str | None = None
    num_experts_attr: str = "num_experts"
    router_attr: str = "gate"
    router_weight: str = "weight"
    router_call: Literal["bias_argument", "token_ids"] | None = None
    router_bias: bool = False
    has_aux_loss: bool = True
    expert_bias_path: str | None = None
    token_table: str | None = None
    experts: Literal["gated_fused", "gpt_oss"] = "gated_fused"
    shared_experts: SharedExperts | None = None
    shared_count: tuple[str, int] = ("n_shared_experts", 0)
    moe_intermediate: bool = False
    moe_layers: MoeLayers = "every"
    first_dense: int = 0
    hash_layers: int | None = None
    attention: Literal["gqa", "mla", "compressed"] = "gqa"
    linear_attention: Literal["", "qkvz", "split"] = ""
    qk_norm: Literal["", "head", "full"] = ""
    bias: tuple[str, bool] = ("attention_bias", False)
    o_bias: bool = True
    sinks: bool = False
    indexer: bool = False
    windows: Windows = "none"
    window_switch: bool = False
    mrope: bool = False
    hyper_connections: bool = False
    rotary_tables: tuple[str, ...] = ()
    mask_types: tuple[tuple[str, str], ...] = ()
    not_with: tuple[tuple[str, str], ...] = ()

    @property
    def expert_width_field(self) -> str:
        """The config field holding a routed expert's intermediate size (``moe_intermediate``)."""
        return "moe_intermediate_size" if self.moe_intermediate else "intermediate_size"

    def mask_type(self, layer_type: str) -> str:
        """The layer type whose mask a layer of ``layer_type`` takes (itself, unless ``mask_types`` says another)."""
        return dict(self.mask_types).get(layer_type, layer_type)


_GATED_DELTANET = (
    ("sequence_parallel", "its Gated DeltaNet layers are recurrent over the sequence"),
    ("tensor_parallel", "its Gated DeltaNet layers are not head-sharded attention modules"),
)
_ALL_HEADS_NORM = (
    ("tensor_parallel", "its q_norm and k_norm normalise all heads together (a TP rank holds only its own)"),
)


def _deepseek_v3_moe(model_type: str, tiny: str, **facts: Any) -> FamilyFacts:
    """A family with DeepSeek-V3's MoE block: a sigmoid router with grouped top-k and a correction bias, shared
    experts, dense first layers."""
    return FamilyFacts(
        model_type,
        tiny,
        num_experts_attr="n_routed_experts",
        has_aux_loss=False,
        expert_bias_path="gate.e_score_correction_bias",
        shared_experts="experts",
        moe_intermediate=True,
        **{"moe_layers": "first_k_dense", **facts},
    )


FACTS: dict[str, FamilyFacts] = {
    f.model_type: f
    for f in (
        FamilyFacts(
            "qwen2_moe",
            "qwen2-moe",
            shared_experts="gated",
            moe_intermediate=True,
            moe_layers="sparse_step",
            bias=("qkv_bias", True),
            o_bias=False,
            windows="even_below_max",
            window_switch=True,
        ),
        FamilyFacts(
            "qwen3_moe",
            "qwen3-moe",
            num_experts_attr="num_local_experts",
            moe_intermediate=True,
            moe_layers="sparse_step",
            qk_norm="head",
            windows="every",
            window_switch=True,
        ),
        FamilyFacts("mixtral", "mixtral", num_experts_attr="num_local_experts", windows="every"),
        FamilyFacts("olmoe", "olmoe", qk_norm="full", not_with=_ALL_HEADS_NORM),
        FamilyFacts(
            "deepseek_v2",
            "deepseek-v2",
            num_experts_attr="n_routed_experts",
            has_aux_loss=False,
            shared_experts="experts",
            moe_intermediate=True,
            moe_layers="first_k_dense",
            attention="mla",
        ),
        _deepseek_v3_moe("deepseek_v3", "deepseek-v3", first_dense=3, attention="mla"),
        # DeepSeek-V3.2: DeepSeek-V3's MoE; its MLA attention adds a lightning indexer (DeepSeek Sparse Attention),
        # all inside ``self_attn``; layers are "indexed_attention", MoE where ``mlp_layer_types`` says "sparse".
        _deepseek_v3_moe(
            "deepseek_v32",
            "deepseek-v32",
            moe_layers="mlp_layer_types",
            first_dense=3,
            attention="mla",
            indexer=True,
            not_with=(
                (
                    "sequence_parallel",
                    "its lightning indexer scores every key of the sequence outside the attention function",
                ),
                (
                    "tensor_parallel",
                    "its lightning indexer scores every key with all heads outside the attention module",
                ),
            ),
        ),
        # GLM-4.5 / 4.6 / 4.7 (Air too): DeepSeek-V3's router (sigmoid, grouped top-k, a correction bias) and shared
        # experts, dense first layers, GQA attention with partial rotary embeddings.
        _deepseek_v3_moe("glm4_moe", "glm4-moe", first_dense=1),
        FamilyFacts(
            "gpt_oss",
            "gpt-oss",
            num_experts_attr="num_local_experts",
            router_attr="router",
            router_bias=True,
            experts="gpt_oss",
            sinks=True,
            windows="even",
            not_with=(
                ("fp8", "its experts run HF's own module (transposed, interleaved, biased), not the FP8 grouped GEMMs"),
            ),
        ),
        # Qwen3-Next and Qwen3.5-MoE: Qwen2-MoE's softmax router and sigmoid-gated shared expert; layers alternate
        # Gated DeltaNet linear attention (``linear_attn``) and gated softmax attention (``self_attn``).
        FamilyFacts(
            "qwen3_next",
            "qwen3-next",
            shared_experts="gated",
            moe_intermediate=True,
            moe_layers="sparse_step",
            linear_attention="qkvz",
            qk_norm="head",
            not_with=_GATED_DELTANET,
        ),
        FamilyFacts(
            "qwen3_5_moe_text",
            "qwen3.5-moe",
            hub_type="qwen3_5_moe",
            shared_experts="gated",
            moe_intermediate=True,
            linear_attention="split",
            qk_norm="head",
            mrope=True,
            not_with=_GATED_DELTANET,
        ),
        # ERNIE-4.5-MoE: softmax router whose top-k choice adds a correction bias (``gate.moe_statics``), ungated
        # shared experts, MoE layers from moe_layer_start_index to moe_layer_end_index every moe_layer_interval.
        FamilyFacts(
            "ernie4_5_moe",
            "ernie4.5-moe",
            router_bias=True,
            expert_bias_path="gate.moe_statics.e_score_correction_bias",
            shared_experts="experts",
            shared_count=("moe_num_shared_experts", 2),
            moe_intermediate=True,
            moe_layers="interval",
            bias=("use_bias", False),
        ),
        # Hunyuan-MoE v1 (Hunyuan-A13B): fp32 softmax router (``gate.wg``), one ungated shared MLP, every layer MoE.
        FamilyFacts(
            "hunyuan_v1_moe",
            "hunyuan-v1-moe",
            num_experts_attr="num_local_experts",
            router_weight="wg.weight",
            has_aux_loss=False,
            shared_experts="mlp",
        ),
        # dots.llm1: DeepSeek-V3's router and shared experts with Qwen3's attention, dense first layers.
        _deepseek_v3_moe("dots1", "dots1", qk_norm="head"),
        # MiniMax-M2: sigmoid router with a correction bias kept on the MoE block, no shared expert, every layer MoE.
        FamilyFacts(
            "minimax_m2",
            "minimax-m2",
            num_experts_attr="num_local_experts",
            router_call="bias_argument",
            expert_bias_path="e_score_correction_bias",
            qk_norm="full",
            not_with=_ALL_HEADS_NORM,
        ),
        # DeepSeek-V4: hyper-connections (hc_mult residual streams), one shared KV head over a sliding window plus
        # compressed keys (a compressor, and on compressed-sparse layers a frozen lightning indexer, inside
        # ``self_attn``), hash-routed first layers (``mlp_layer_types`` "hash_moe"), then a sqrt-softplus router
        # with a correction bias; one ungated shared expert; experts with a clamped SwiGLU (``swiglu_limit``).
        FamilyFacts(
            "deepseek_v4",
            "deepseek-v4",
            num_experts_attr="n_routed_experts",
            router_call="token_ids",
            expert_bias_path="gate.e_score_correction_bias",
            token_table="gate.tid2eid",
            shared_experts="experts",
            moe_intermediate=True,
            hash_layers=3,  # HF's default_num_hash_layers
            attention="compressed",
            hyper_connections=True,
            rotary_tables=("main", "compress"),
            mask_types=(
                ("compressed_sparse_attention", "sliding_attention"),
                ("heavily_compressed_attention", "sliding_attention"),
            ),
            not_with=(
                (
                    "cuda_graphs",
                    "its parts take the micro-batch's token ids (hash-routed layers) and hand on the "
                    "routed sum's weights per stream, which the graphed parts' static inputs and outputs do not hold",
                ),
                (
                    "sequence_parallel",
                    "its compressors pool windows of the whole sequence and its lightning indexer "
                    "scores every compressed key, outside the attention function that Ulysses splits",
                ),
                ("tensor_parallel", "its attention modules are not among those the runtime shards by heads"),
                ("fp8", "its grouped output projection (o_a_proj) computes with a forward of its own, not in FP8"),
            ),
        ),
    )
}
# config.json model_type -> its text_config's: Qwen3.5-MoE's Hub config is its vision-language model's.
VISION_LANGUAGE: dict[str, str] = {f.hub_type: f.model_type for f in FACTS.values() if f.hub_type is not None}


def facts_of(model_type: str | None) -> FamilyFacts | None:
    """The facts of the family ``model_type`` names (a vision-language config.json's through its text model), or
    None for a model type DisagMoE-DS does not cut."""
    return FACTS.get(VISION_LANGUAGE.get(str(model_type), str(model_type)))
