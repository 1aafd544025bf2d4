"""DeepSeek-V4's attention and hyper-connections in the planner's vocabulary (pure Python).

The attention (HF's ``DeepseekV4Attention``): a query LoRA (``q_a_proj`` H -> r_q, ``q_b_proj`` r_q -> n_h d), one
key-value head read as both (``kv_proj`` H -> d), learned sinks, a grouped low-rank output (``o_a_proj``: each of g
head groups to r_o, ``o_b_proj`` g r_o -> H), over a sliding window of w keys plus compressed keys per layer type:

* ``sliding``: none;
* ``csa`` (compressed sparse): a compressor pools every m_c tokens into one key (``kv_proj``, ``gate_proj`` H -> 2d)
  and a lightning indexer (its own compressor at d_i, ``q_b_proj`` r_q -> n_i d_i, ``weights_proj`` H -> n_i) scores
  every earlier compressed key; each query attends its top ``index_topk`` of them;
* ``hca`` (heavily compressed): every m_h tokens pooled into one key (H -> d), each query attends all earlier ones.

Hyper-connections: ``hc`` residual streams per token; around each of a layer's two blocks a ``HyperConnection``
projects the flattened streams (hc H) to its (2 + hc) hc weights and mixes the streams (comb^T @ streams, hc x hc
per token), and the hyper head projects them to hc weights before the final norm. FLOPs follow ``model.py``'s
conventions (matmuls only, 2mkn); the compressors' pooling and the indexer's top-k are elementwise and not counted.

Shape suffixes and symbols as above; s the sequence length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from disagmoe_ds.errors import ConfigError

KINDS = {"sliding_attention": "sliding", "compressed_sparse_attention": "csa", "heavily_compressed_attention": "hca"}
_RATIO_KINDS = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}


@dataclass(frozen=True)
class CompressedAttentionSpec:
    """DeepSeek-V4's attention shape, and per layer its kind (``sliding``, ``csa``, ``hca``)."""

    num_heads: int
    head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int
    csa_rate: int
    hca_rate: int
    index_heads: int
    index_head_dim: int
    index_topk: int
    kinds: tuple[str, ...]

    def projection_flops(self, h: int, layer: int | None) -> int:
        """Per token: query LoRA, the K=V projection, the grouped output, and the layer's compressor (and indexer)."""
        d, q = self.head_dim, self.num_heads * self.head_dim
        main = 2 * h * self.q_lora_rank + 2 * self.q_lora_rank * q + 2 * h * d
        out = 2 * q * self.o_lora_rank + 2 * self.o_groups * self.o_lora_rank * h
        kind = "sliding" if layer is None else self.kinds[layer]
        if kind == "hca":
            return main + out + 2 * 2 * h * d
        if kind == "csa":
            di, ni = self.index_head_dim, self.index_heads
            indexer = 2 * 2 * h * 2 * di + 2 * self.q_lora_rank * ni * di + 2 * h * ni
            return main + out + 2 * 2 * h * 2 * d + indexer
        return main + out

    def core_flops(self, seq_len: int, layer: int, window_pairs: float) -> float:
        """Per token, averaged over a causal sequence: scores and values over the window's keys (``window_pairs``
        per sequence) and the compressed keys each query attends; on csa layers the indexer's scores of every
        earlier compressed key too."""
        per_key = 2 * self.num_heads * (self.head_dim + self.head_dim)
        kind = self.kinds[layer]
        keys = window_pairs / seq_len
        if kind == "hca":
            keys += seq_len / (2 * self.hca_rate)
        elif kind == "csa":
            keys += _mean_top_k(seq_len, self.csa_rate, self.index_topk)
            indexer = 2 * self.index_heads * self.index_head_dim * seq_len / (2 * self.csa_rate)
            return per_key * keys + indexer
        return per_key * keys

    def params(self, h: int, layer: int | None) -> int:
        """One layer's attention parameters (norms of the latent, key and compressors included, sinks)."""
        d, q, r = self.head_dim, self.num_heads * self.head_dim, self.q_lora_rank
        main = h * r + r + r * q + h * d + d + self.o_lora_rank * q + self.o_groups * self.o_lora_rank * h
        main += self.num_heads  # sinks
        kind = "sliding" if layer is None else self.kinds[layer]
        if kind == "hca":
            return main + 2 * h * d + self.hca_rate * d + d
        if kind == "csa":
            di, ni, m = self.index_head_dim, self.index_heads, self.csa_rate
            indexer = 2 * h * 2 * di + m * 2 * di + di + r * ni * di + h * ni
            return main + 2 * h * 2 * d + m * 2 * d + d + indexer
        return main

    def activation_bytes(self, act_bytes: int, layer: int, seq_len: int) -> int:
        """Per token, what autograd keeps: the latent and its norm, queries, the key, the output before and after
        the grouped projection, and (eager attention: V4 ships no fused kernel) fp32 weights and probabilities per
        head and key attended; compressed layers add their compressors' projections."""
        d, q = self.head_dim, self.num_heads * self.head_dim
        kept = 2 * self.q_lora_rank + 2 * q + 2 * d + q + self.o_groups * self.o_lora_rank
        kind = self.kinds[layer]
        keys = min(self.window, seq_len)
        if kind == "csa":
            kept += 2 * 2 * d + 2 * 2 * self.index_head_dim
            keys += min(self.index_topk, seq_len // self.csa_rate)
        elif kind == "hca":
            kept += 2 * d
            keys += seq_len // self.hca_rate
        return act_bytes * kept + 2 * 4 * self.num_heads * keys


def _mean_top_k(seq_len: int, rate: int, top_k: int) -> float:
    """Compressed keys a query attends, averaged over a causal sequence: min(k, t / m) at position t."""
    ready = seq_len / rate  # the last query's
    if ready <= top_k:
        return ready / 2
    return top_k * (1 - top_k * rate / (2 * seq_len))


def hyper_connection_flops(h: int, hc: int) -> int:
    """One ``HyperConnection`` per token: its projection of the flattened streams and the streams' mix."""
    return 2 * hc * h * (2 + hc) * hc + 2 * hc * hc * h


def hyper_connection_params(h: int, hc: int) -> int:
    return (2 + hc) * hc * hc * h + (2 + hc) * hc + 3  # fn, base, scale


def hyper_head_params(h: int, hc: int) -> int:
    return hc * hc * h + hc + 1  # hc_fn, hc_base, hc_scale


def compressed_attention(cfg: dict[str, Any], num_layers: int) -> CompressedAttentionSpec:
    """The spec of a ``deepseek_v4`` config.json dict (HF's defaults where a field is absent)."""
    types = cfg.get("layer_types")
    if types is None and cfg.get("compress_ratios") is not None:  # the legacy per-layer ratios HF still reads
        types = [_RATIO_KINDS.get(r, str(r)) for r in cfg["compress_ratios"]]
    if types is None:  # HF's default: two heavily compressed layers, then heavily and compressed sparse alternating
        rest = range(max(num_layers - 2, 0))
        types = ["heavily_compressed_attention"] * min(num_layers, 2)
        types += ["compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in rest]
    types = list(types)[:num_layers]
    unknown = sorted({t for t in types if t not in KINDS})
    if len(types) != num_layers or unknown:
        raise ConfigError(f"layer_types of the deepseek_v4 config: {len(types)} entries, unknown {unknown}")
    rates = cfg.get("compress_rates") or {
        "compressed_sparse_attention": cfg.get("compress_rate_csa", 4),
        "heavily_compressed_attention": cfg.get("compress_rate_hca", 128),
    }
    return CompressedAttentionSpec(
        num_heads=cfg["num_attention_heads"],
        head_dim=cfg.get("head_dim", 512),
        q_lora_rank=cfg.get("q_lora_rank", 1024),
        o_groups=cfg.get("o_groups", 8),
        o_lora_rank=cfg.get("o_lora_rank", 1024),
        window=cfg.get("sliding_window", 128),
        csa_rate=rates.get("compressed_sparse_attention", 4),
        hca_rate=rates.get("heavily_compressed_attention", 128),
        index_heads=cfg.get("index_n_heads", 64),
        index_head_dim=cfg.get("index_head_dim", 128),
        index_topk=cfg.get("index_topk", 512),
        kinds=tuple(KINDS[t] for t in types),
    )
