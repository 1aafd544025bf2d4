"""What LoRA trains: the ``"disagmoe": {"lora": {...}}`` section and its flags (``--lora-rank`` ...), torch-free so
that a command line and a ds_config are read without loading torch; ``models.lora`` holds the adapted modules."""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, fields
from typing import Any

from disagmoe_ds.errors import ConfigError

GROUPS = ("attention", "mlp", "experts")
DEFAULT_TARGETS = ("attention", "experts")  # PEFT loads no dense/shared-MLP adapter of most MoE models (peft_format)
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
EXPERT_PROJECTIONS = ("gate_up_proj", "down_proj")
A, B = "lora_A", "lora_B"


@dataclass(frozen=True)
class LoraSettings:
    """The ``"disagmoe": {"lora": {...}}`` section (``--lora-rank`` and its flags).

    Attributes:
        rank: r, the adapters' inner width.
        alpha: the update is scaled by alpha / r (None: alpha = r, a scale of 1).
        dropout: PEFT's ``lora_dropout`` on the input of the attention-side adapters (the expert side takes none).
        targets: what gets adapters: ``attention`` (every projection of the token mixer), ``mlp`` (dense MLPs and
            shared experts), ``experts`` (every routed expert's gate/up and down), or projection names such as
            ``q_proj`` / ``v_proj`` (the attention side's ``nn.Linear`` modules of that name). Default: attention
            and experts (``mlp`` adapters train and merge, but PEFT cannot load them as an adapter directory).
        train_router: the routers' weights train in full beside the adapters (else they stay frozen, like every
            other base weight).
        init_lora_weights: PEFT's: B starts at zero, so training starts from the base model; False: B random too
            (``verify`` checks the adapted forward from the first step).
    """

    rank: int
    alpha: float | None = None
    dropout: float = 0.0
    targets: tuple[str, ...] = DEFAULT_TARGETS
    train_router: bool = False
    init_lora_weights: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "targets", tuple(self.targets))
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise ConfigError(f'"disagmoe.lora.rank" must be a positive integer, got {self.rank!r}')
        if self.alpha is not None and (isinstance(self.alpha, bool) or not isinstance(self.alpha, int | float)):
            raise ConfigError(f'"disagmoe.lora.alpha" must be a number, got {self.alpha!r}')
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, int | float) or not 0 <= self.dropout < 1:
            raise ConfigError(f'"disagmoe.lora.dropout" must be in [0, 1), got {self.dropout!r}')
        if not self.targets or not all(isinstance(t, str) and t for t in self.targets):
            raise ConfigError(
                f'"disagmoe.lora.targets" must name what gets adapters ({", ".join(GROUPS)} or projection names), '
                f"got {list(self.targets)!r}"
            )
        for flag in ("train_router", "init_lora_weights"):
            if not isinstance(getattr(self, flag), bool):
                raise ConfigError(f'"disagmoe.lora.{flag}" must be true or false, got {getattr(self, flag)!r}')

    @classmethod
    def from_dict(cls, section: Any) -> LoraSettings:
        if isinstance(section, LoraSettings):
            return section
        if not isinstance(section, dict):
            raise ConfigError(f'"disagmoe.lora" must be an object like {{"rank": 8, "alpha": 16}}, got {section!r}')
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(section) - known)
        if unknown:
            raise ConfigError(
                f'unknown key(s) in "disagmoe.lora": {", ".join(unknown)}; known: {", ".join(sorted(known))}'
            )
        if "rank" not in section:
            raise ConfigError('"disagmoe.lora" needs a "rank" (the adapters\' inner width, e.g. 8)')
        return cls(**section)

    @property
    def scaling(self) -> float:
        return (self.rank if self.alpha is None else self.alpha) / self.rank

    @property
    def experts(self) -> bool:
        return "experts" in self.targets

    def adapts(self, group: str, name: str) -> bool:
        """Whether the attention-side projection ``name`` of ``group`` (``attention``: the token mixer, or ``mlp``)
        gets an adapter; in an MLP only the gate/up/down projections do (not Qwen2-MoE's shared-expert gate)."""
        if name in self.targets:
            return True
        return group in self.targets and (group == "attention" or name in MLP_PROJECTIONS)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["targets"] = list(self.targets)
        return out


def add_lora_args(p: argparse.ArgumentParser, *, verify: bool = True) -> None:
    """The LoRA flags of disagmoe-verify and run_pretrain.py (``lora_of`` turns them into ``LoraSettings``)."""
    g = p.add_argument_group(
        "LoRA",
        "low-rank adapters on both sides, every base weight frozen (a base shipped in FP8 blocks, DeepSeek-V3's, "
        "stays FP8 on the ranks: about 1 byte a parameter)",
    )
    g.add_argument("--lora-rank", type=int, metavar="R", help="train LoRA adapters of rank R instead of every weight")
    g.add_argument(
        "--lora-alpha", type=float, help="scale the adapters' update by alpha / R (default: R, a scale of 1)"
    )
    g.add_argument(
        "--lora-targets",
        help="what gets adapters, comma-separated: attention (the token mixer's projections), mlp (dense MLPs and "
        "shared experts), experts (every routed expert), or projection names such as q_proj,v_proj "
        f"(default: {','.join(DEFAULT_TARGETS)})",
    )
    if not verify:  # the reference is PEFT's, whose expert parameters take no dropout either
        g.add_argument("--lora-dropout", type=float, help="dropout on the attention-side adapters' input (default 0)")
    g.add_argument("--lora-train-router", action="store_true", help="the routers' weights train in full too")


def lora_of(a: argparse.Namespace, *, verify: bool = True) -> LoraSettings | None:
    """The ``LoraSettings`` of ``add_lora_args``' flags (None without --lora-rank). ``verify`` starts B random
    (PEFT's init_lora_weights=False), so that the first step already checks the adapted forward."""
    if a.lora_rank is None:
        given = [flag for flag, value in (("--lora-alpha", a.lora_alpha), ("--lora-targets", a.lora_targets),
                 ("--lora-dropout", getattr(a, "lora_dropout", None)), ("--lora-train-router", a.lora_train_router))
                 if value]  # fmt: skip
        if given:
            raise ConfigError(f"{given[0]} needs --lora-rank R: without it every weight trains")
        return None
    targets = DEFAULT_TARGETS if a.lora_targets is None else a.lora_targets.split(",")
    return LoraSettings(
        rank=a.lora_rank,
        alpha=a.lora_alpha,
        dropout=getattr(a, "lora_dropout", None) or 0.0,
        targets=tuple(t.strip() for t in targets if t.strip()),
        train_router=a.lora_train_router,
        init_lora_weights=not verify,
    )
