"""Our own knobs: the ``"disagmoe"`` section of a DeepSpeed config, parsed once and validated at the entry point.

The rest of the ds_config stays DeepSpeed's. Command-line overrides (``--attention-gpus`` ...) replace section
values before validation, so a bad value fails with the same message wherever it came from.

The section is flat JSON (the keys users write), but each key belongs to one typed section below, a small frozen
dataclass with one concept that checks its own keys: ``LayoutCounts`` (with ``LaneSlices``), ``Accumulation``,
``Pipeline``, ``Watchdog``, ``Exchange``, ``Kernels`` (with ``Fp8Compute``), ``MemoryLevers``, ``ZeroPerSide``,
``CostModel``, ``FineTuning`` and ``Colocation`` (which mode the file is for).
``DisagMoEConfig`` is composed of them as bases, so its fields are still exactly the section's keys (what
``from_ds_config``, ``dataclasses.replace`` and ``to_dict`` work on) and ``cfg.micro_batches`` is typed; a function
that needs one concept can be typed by that section alone. The co-located mode's ``ColocatedConfig`` is composed of
the sections both modes read (``Accumulation``, ``Watchdog``, ``Kernels``, ``FineTuning``).

sections   the typed sections
zero       each side's effective ZeRO stage (``effective_zero_stage``, the one rule every
           ZeRO check and build step goes through)
disagmoe   ``DisagMoEConfig``, the rules that span sections, reading a ds_config file
flags      the flag table (``SECTION_FLAGS``) from which run_pretrain.py, disagmoe-verify, the co-located verify and
           bench_e2e.py make their flags for section keys (``add_section_flags``)

>>> cfg = DisagMoEConfig.from_ds_config({"disagmoe": {"attention_gpus": 2, "ffn_gpus": 2}}, {"micro_batches": 4})
>>> cfg.attention_gpus, cfg.micro_batches, cfg.world_size
(2, 4, 4)
>>> cfg.zero_stage_of("ffn", {"zero_optimization": {"stage": 1}})  # no per-side stage: the ds_config's
1
"""

from disagmoe_ds.config.disagmoe import DisagMoEConfig, load_ds_config
from disagmoe_ds.config.flags import (
    CLIS,
    LAYOUT_KEYS,
    LEVER_KEYS,
    SECTION_FLAGS,
    add_section_flags,
    flag_of,
    section_values,
)
from disagmoe_ds.config.sections import (
    SECTION,
    SIDES,
    Accumulation,
    FineTuning,
    Kernels,
    LayoutCounts,
    Recompute,
    Watchdog,
)
from disagmoe_ds.config.zero import ZERO_STAGES, ds_stage, effective_zero_stage

__all__ = [
    "CLIS",
    "LAYOUT_KEYS",
    "LEVER_KEYS",
    "SECTION",
    "SECTION_FLAGS",
    "SIDES",
    "ZERO_STAGES",
    "Accumulation",
    "DisagMoEConfig",
    "FineTuning",
    "Kernels",
    "Recompute",
    "LayoutCounts",
    "Watchdog",
    "add_section_flags",
    "ds_stage",
    "effective_zero_stage",
    "flag_of",
    "load_ds_config",
    "section_values",
]
