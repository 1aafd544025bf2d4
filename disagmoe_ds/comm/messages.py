"""The exchange's messages: one frozen type per kind, whose wire spec is derived from its fields.

Legend: R rows of one message (one lane and one ep rank), T tokens of a lane's micro-batch, S rows of every ep
rank together, H hidden, K top-k, E experts, P ep ranks; W a token's residual (H, or hc x H with DeepSeek-V4's
hyper-connection streams), C the routed sum's weights per token (hc with hyper-connections, else 0: no tensor on
the wire), I token-id columns (1 where some layer routes by token id, else 0), Q the payload's scale columns (1 with
the FP8 exchange, else 0).

    kind        type           tensors                                                        host    variant
    m2n         Tokens         x_RH, local_idx_RK, w_RK, x_scale_RQ                           pairs
    n2m         ExpertOut      y_RH
    m2n_grad    TokenGrads     dx_RH, dw_RK
    n2m_grad    ExpertOutGrad  dy_RH                                                                  resent: Tokens
    resid       Residual       residual_TH [T, W], token_idx_S, position_ids_T, routed_w_TC,  rows_P  routed: Tokens
                               token_ids_TI, counts_E, prob_sum_E
    resid_grad  ResidualGrad   d_residual_TH [T, W], d_routed_w_TC, aux_grad_E

A field is a tensor on the wire (``tensor``: dtype, trailing shape, which size leads it), a host int or ints that
ride in the message's header (``host``), a nested message sent with it when the exchange resends tokens
(``variant``: the resend mode, its rows renamed), or local (not sent). ``spec`` derives the channel's
``MessageSpec`` from the tensors in field order, variants last. A ``payload`` tensor travels in the activation
dtype, or in e4m3 with the FP8 exchange (``Dims.fp8``; its rowwise scales in the Q columns beside it). ``Tokens`` is
also what an expert shard computes in the co-located mode (``comm.dispatch``), so both modes hand the experts
the same type.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeVar, overload

import torch

from disagmoe_ds.comm.channel import MessageSpec, TensorSpec
from disagmoe_ds.fp8.quantize import E4M3, Quantized, dequantize, quantize

M = TypeVar("M", bound="Message")
_TensorOf = tuple[torch.dtype, tuple[int, ...], str | None]  # one wire tensor: dtype, trailing shape, row symbol


@dataclass(frozen=True)
class Dims:
    """What the message shapes depend on: H, K, E, P (``ep_size``: a lane's messages per MoE layer, one per ep rank,
    or per node with ``Layout.node_dedup``), the two dtypes (activations; router weights), the residual's
    shape: ``streams`` per token (hyper-connections), ``routed_weights`` per token (one per stream with
    hyper-connections; 0: the routed sum is added as it is), ``token_ids`` columns (1: the hand-off carries them),
    and ``fp8``: the routed tokens travel in FP8 (the lever, ``"disagmoe.fp8"``)."""

    hidden: int
    top_k: int
    num_experts: int
    ep_size: int
    dtype: torch.dtype
    weight_dtype: torch.dtype
    streams: int = 1
    routed_weights: int = 0
    token_ids: int = 0
    fp8: bool = False

    def of(self, symbol: str | int) -> int:
        if isinstance(symbol, int):
            return symbol
        sizes = {"H": self.hidden, "K": self.top_k, "E": self.num_experts, "W": self.streams * self.hidden}
        return {**sizes, "C": self.routed_weights, "I": self.token_ids, "Q": int(self.fp8)}[symbol]

    def dtype_of(self, role: str | torch.dtype) -> torch.dtype:
        if isinstance(role, torch.dtype):
            return role
        payload = E4M3 if self.fp8 else self.dtype
        return {"activation": self.dtype, "weight": self.weight_dtype, "payload": payload}[role]


# The field helpers are typed as the field's value, as ``dataclasses.field`` is: ``x_RH: torch.Tensor = tensor(...)``.


def tensor(dtype: str | torch.dtype, shape: tuple[str | int, ...], rows: str | None) -> torch.Tensor:
    """A tensor field: ``dtype`` (or the role ``activation``, ``weight``, ``payload``), trailing ``shape``, leading
    ``rows`` (a size symbol: R, T, S; None for a fixed shape)."""
    spec: torch.Tensor = field(metadata={"tensor": (dtype, shape, rows)})
    return spec


@overload
def host(ints: int = 1) -> int | None: ...


@overload
def host(ints: Literal["P"]) -> tuple[int, ...] | None: ...


def host(ints: int | Literal["P"] = 1) -> int | tuple[int, ...] | None:
    """Host ints (1, or ``"P"``: one per ep rank) carried in the header where the channel has one; None unless
    given."""
    spec: int | tuple[int, ...] | None = field(default=None, metadata={"host": ints})
    return spec


def variant(message: type[M], rows: str) -> M | None:
    """A nested ``message`` sent along in the resend mode, its R rows counted as ``rows``; None otherwise."""
    spec: M | None = field(default=None, metadata={"variant": (message, rows)})
    return spec


@dataclass(frozen=True, eq=False)
class Message:
    """Base of every message type; see the module docstring."""

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The wire tensors in spec order (a variant's after the message's own, when present)."""
        own = tuple(getattr(self, f.name) for f in _fields(type(self), "tensor"))
        nested = tuple(
            t for f in _fields(type(self), "variant") if (v := getattr(self, f.name)) is not None for t in v.tensors()
        )
        return own + nested

    def host_ints(self) -> tuple[int, ...]:
        out: list[int] = []
        for f in _fields(type(self), "host"):
            value = getattr(self, f.name)
            out += list(value) if isinstance(value, Sequence) else [value]
        return tuple(out)

    @classmethod
    def spec(cls, dims: Dims, *, resend: bool = False) -> MessageSpec:
        tensors = _tensor_specs(cls, dims, rows_as={})
        if resend:
            for f in _fields(cls, "variant"):
                nested, rows = f.metadata["variant"]
                tensors += _tensor_specs(nested, dims, rows_as={"R": rows})
        specs = _sized(tensors)
        coalesced = len(specs) > 1 and all(s.size is not None for s in specs)  # one wire buffer per peer
        host_ints = sum(dims.ep_size if f.metadata["host"] == "P" else f.metadata["host"] for f in _fields(cls, "host"))
        return MessageSpec(specs, name=cls.__name__, metas=host_ints, coalesced=coalesced)

    @classmethod
    def from_wire(cls: type[M], tensors: Sequence[torch.Tensor], host_ints: Sequence[int] = (), **local: object) -> M:
        """The message of ``tensors`` (spec order; a variant's follow when there are more) and its header ints."""
        own = _fields(cls, "tensor")
        values: dict[str, object] = {f.name: t for f, t in zip(own, tensors[: len(own)], strict=True)}
        rest = list(tensors[len(own) :])
        for f in _fields(cls, "variant"):
            if rest:
                nested = f.metadata["variant"][0]
                width = len(_fields(nested, "tensor"))
                values[f.name], rest = nested.from_wire(rest[:width]), rest[width:]
        ints = list(host_ints)
        for f in _fields(cls, "host"):
            if ints:
                n = len(ints) if f.metadata["host"] == "P" else f.metadata["host"]
                chunk, ints = ints[:n], ints[n:]
                values[f.name] = tuple(chunk) if f.metadata["host"] == "P" else chunk[0]
        return cls(**values, **local)

    def detached(self: M) -> M:
        """The same message with every tensor detached (sent again, outside autograd); host and local fields kept."""
        cls = type(self)
        changes: dict[str, object] = {f.name: getattr(self, f.name).detach() for f in _fields(cls, "tensor")}
        for f in _fields(cls, "variant"):
            if (nested := getattr(self, f.name)) is not None:
                changes[f.name] = nested.detached()
        return dataclasses.replace(self, **changes)

    @classmethod
    def cat(cls: type[M], messages: Sequence[M]) -> M:
        """One message of every message's rows, in order (row tensors only; host ints summed)."""
        tensors = [torch.cat(parts) for parts in zip(*(m.tensors() for m in messages), strict=True)]
        return cls.from_wire(tensors, [sum(ints) for ints in zip(*(m.host_ints() for m in messages), strict=True)])

    def split(self: M, counts: Sequence[int]) -> list[M]:
        """One message per part of ``counts`` rows (every tensor a row tensor; host ints are not split)."""
        parts = [t.split(list(counts)) for t in self.tensors()]
        return [type(self).from_wire(piece) for piece in zip(*parts, strict=True)] if parts else []


_FIELDS: dict[tuple[type, str], tuple[dataclasses.Field[object], ...]] = {}


def _fields(cls: type, key: str) -> tuple[dataclasses.Field[object], ...]:
    # Cached: every send and receive reads a message's fields several times (the host path of the exchange).
    found = _FIELDS.get((cls, key))
    if found is None:
        found = _FIELDS[cls, key] = tuple(f for f in dataclasses.fields(cls) if key in f.metadata)
    return found


def _tensor_specs(cls: type, dims: Dims, rows_as: dict[str, str]) -> list[_TensorOf]:
    out = []
    for f in _fields(cls, "tensor"):
        dtype, shape, rows = f.metadata["tensor"]
        out.append((dims.dtype_of(dtype), tuple(dims.of(s) for s in shape), rows_as.get(rows, rows)))
    return out


def _sized(tensors: Sequence[_TensorOf]) -> tuple[TensorSpec, ...]:
    """Row symbols become size indices in order of first appearance (T before S in a resid message)."""
    symbols: list[str] = []
    for *_, rows in tensors:
        if rows is not None and rows not in symbols:
            symbols.append(rows)
    return tuple(
        TensorSpec(dtype, shape, size=None if rows is None else symbols.index(rows)) for dtype, shape, rows in tensors
    )


@dataclass(frozen=True, eq=False)
class Tokens(Message):
    """The rows an expert shard computes: a lane's tokens for one ep rank (m2n), or gathered from every lane (the
    F side) or every ep peer (co-located), grouped by source."""

    x_RH: torch.Tensor = tensor("payload", ("H",), "R")  # e4m3 with the FP8 exchange, scaled by ``x_scale_RQ``
    local_idx_RK: torch.Tensor = tensor(torch.int64, ("K",), "R")  # ``experts_per_rank``: the expert is elsewhere
    w_RK: torch.Tensor = tensor("weight", ("K",), "R")  # 0 at those sentinel ids
    x_scale_RQ: torch.Tensor = tensor(torch.float32, ("Q",), "R")  # [R, 1] with the FP8 exchange, else [R, 0]
    pairs: int | None = host()  # ids that are not the sentinel: the expert work, known on the host
    bounded: bool = False  # local: ``pairs`` is only an upper bound (messages padded to a ``Capacity``)

    @classmethod
    def of(
        cls, x_RH: torch.Tensor, local_idx_RK: torch.Tensor, w_RK: torch.Tensor, pairs: int | None, *, fp8: bool
    ) -> Tokens:
        """The message of these rows; ``fp8``: ``x_RH`` quantized rowwise for the wire (``fp8.quantize``)."""
        if not fp8:
            return cls(x_RH, local_idx_RK, w_RK, x_RH.new_empty(x_RH.shape[0], 0, dtype=torch.float32), pairs)
        q = quantize(x_RH, -1)
        return cls(q.data, local_idx_RK, w_RK, q.scale, pairs)

    def rows(self, dtype: torch.dtype) -> torch.Tensor:
        """``x_RH`` in ``dtype``: dequantized where it travelled in FP8 (exactly: the scales are powers of two)."""
        if self.x_scale_RQ.shape[1] == 0:
            return self.x_RH
        return dequantize(Quantized(self.x_RH, self.x_scale_RQ), dtype)

    def shard_args(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int | None, bool]:
        """What an ``ExpertShard`` (or its graphs) takes; ``dtype``: the shard's activations."""
        return self.rows(dtype), self.local_idx_RK, self.w_RK, self.pairs, self.bounded


@dataclass(frozen=True, eq=False)
class ExpertOut(Message):
    y_RH: torch.Tensor = tensor("activation", ("H",), "R")


@dataclass(frozen=True, eq=False)
class TokenGrads(Message):
    dx_RH: torch.Tensor = tensor("activation", ("H",), "R")
    dw_RK: torch.Tensor = tensor("weight", ("K",), "R")


@dataclass(frozen=True, eq=False)
class ExpertOutGrad(Message):
    dy_RH: torch.Tensor = tensor("activation", ("H",), "R")
    resent: Tokens | None = variant(Tokens, "R")  # resend: the tokens again, for the expert side to recompute from


@dataclass(frozen=True, eq=False)
class Residual(Message):
    """The residual hand-off from A_g to A_next (p > 1): what A_next needs to combine layer l's expert outputs and
    go on; ``rows_P`` are the combine plan's rows per ep rank (-1 each: a dense layer, no n2m follows)."""

    residual_TH: torch.Tensor = tensor("activation", ("W",), "T")  # [T, W]: the streams flattened
    token_idx_S: torch.Tensor = tensor(torch.int64, (), "S")  # the combine plan
    position_ids_T: torch.Tensor = tensor(torch.int64, (), "T")
    routed_w_TC: torch.Tensor = tensor("activation", ("C",), "T")  # the routed sum's weight per stream
    token_ids_TI: torch.Tensor = tensor(torch.int64, ("I",), "T")  # for the layers that route by token id
    counts_E: torch.Tensor = tensor(torch.float32, ("E",), None)  # router statistics so far (the pooled aux loss)
    prob_sum_E: torch.Tensor = tensor(torch.float32, ("E",), None)
    rows_P: tuple[int, ...] | None = host("P")
    routed: Tokens | None = variant(Tokens, "S")  # resend: every ep rank's m2n rows, for A_next's n2m_grad

    @property
    def is_moe(self) -> bool:
        return self.rows_P is not None and self.rows_P[0] >= 0


@dataclass(frozen=True, eq=False)
class ResidualGrad(Message):
    d_residual_TH: torch.Tensor = tensor("activation", ("W",), "T")
    d_routed_w_TC: torch.Tensor = tensor("activation", ("C",), "T")
    aux_grad_E: torch.Tensor = tensor(torch.float32, ("E",), None)
