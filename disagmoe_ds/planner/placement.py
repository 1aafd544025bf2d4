"""Where layout ranks sit on nodes, and which NIC splits that allows (pure Python).

Two placements of the ``Layout`` ranks (attention ranks [0, M), FFN ranks [M, W)):

* contiguous: ranks fill nodes in order, so attention nodes come first and at most one node holds both
  sides; NICs follow their GPUs except in that shared node, whose NICs can be split 1..n-1 either way.
  This is what a DeepSpeed hostfile produces by itself (launcher rank = node * slots + local rank).
* spread: every node holds a = M/nodes attention GPUs and f = N/nodes FFN GPUs and splits its NICs
  n_a + n_f (any 1..n-1, GPUs reach the other NICs of the node through NVLink, NCCL's PXN). This is the
  DisagMoE paper's free NIC split (M_a + M_f = all NICs). The runtime must map the
  launcher rank (node, local) to the layout rank: node * a + local if local < a, else
  M + node * f + (local - a).

>>> Placement.spread(nodes=2, gpus_per_node=8, attention_gpus=4).node_of(3, attention_gpus=4)
1
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

from disagmoe_ds.planner.cluster import Cluster


@dataclass(frozen=True)
class Placement:
    kind: Literal["contiguous", "spread"]
    nodes: int
    gpus_per_node: int
    attention_per_node: int = 0  # spread only: a

    @classmethod
    def contiguous(cls, nodes: int, gpus_per_node: int) -> Placement:
        return cls("contiguous", nodes, gpus_per_node)

    @classmethod
    def spread(cls, nodes: int, gpus_per_node: int, attention_gpus: int) -> Placement:
        return cls("spread", nodes, gpus_per_node, attention_gpus // nodes)

    def node_of(self, rank: int, *, attention_gpus: int) -> int:
        """Node of layout rank ``rank``."""
        if self.kind == "contiguous":
            return rank // self.gpus_per_node
        if rank < attention_gpus:
            return rank // self.attention_per_node
        return (rank - attention_gpus) // (self.gpus_per_node - self.attention_per_node)

    def spans_nodes(self, ranks: tuple[int, ...], *, attention_gpus: int) -> bool:
        """Whether layout ranks ``ranks`` sit on more than one node (their collectives then cross NICs)."""
        return _spans_nodes(self, tuple(ranks), attention_gpus)

    def launcher_to_layout_rank(self, node: int, local: int, *, attention_gpus: int) -> int:
        """Layout rank of the process the launcher starts as local rank ``local`` on ``node``."""
        if self.kind == "contiguous":
            return node * self.gpus_per_node + local
        a, f = self.attention_per_node, self.gpus_per_node - self.attention_per_node
        return node * a + local if local < a else attention_gpus + node * f + (local - a)

    def nic_splits(self, cluster: Cluster, attention_gpus: int) -> list[tuple[int, int]]:
        """(M_a, M_f) NIC splits this placement allows."""
        n = cluster.nics_per_node
        if self.kind == "spread":
            return [(self.nodes * j, self.nodes * (n - j)) for j in range(1, n)]
        full, shared = divmod(attention_gpus, self.gpus_per_node)
        if not shared:
            return [(full * n, cluster.total_nics - full * n)]
        if cluster.nodes == 1:
            return [(n, n)]  # one node: no transfer crosses a NIC, so the sides need not split them
        return [(full * n + j, cluster.total_nics - full * n - j) for j in range(1, n)]

    def describe(self, attention_gpus: int) -> str:
        if self.kind == "contiguous":
            return "contiguous (attention nodes first; DeepSpeed hostfile order)"
        return (
            f"spread ({self.attention_per_node} attention + {self.gpus_per_node - self.attention_per_node} FFN GPUs "
            f"on every node; planned, not launched: DeepSpeed and torchrun place ranks contiguously, see "
            "docs/planner.md)"
        )


@lru_cache(maxsize=65536)  # every candidate of a layout asks for the same replica groups (sync, ZeRO, lanes)
def _spans_nodes(placement: Placement, ranks: tuple[int, ...], attention_gpus: int) -> bool:
    return len({placement.node_of(r, attention_gpus=attention_gpus) for r in ranks}) > 1


def placements(cluster: Cluster, attention_gpus: int, wanted: str, granularity: int) -> list[Placement]:
    """Placements to try for ``attention_gpus`` attention ranks: ``wanted`` is contiguous, spread or auto."""
    out = []
    if wanted in ("contiguous", "auto") and attention_gpus % granularity == 0:
        out.append(Placement.contiguous(cluster.nodes, cluster.gpus_per_node))
    a, rest = divmod(attention_gpus, cluster.nodes)
    if wanted in ("spread", "auto") and not rest and 0 < a < cluster.gpus_per_node and cluster.nodes > 1:
        out.append(Placement.spread(cluster.nodes, cluster.gpus_per_node, attention_gpus))
    return out
