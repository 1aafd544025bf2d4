"""disagmoe-convert: bit-identical HF round trips for every family, re-layout with optimizer state, export of
co-located checkpoints, clear errors.

Layouts are written (M, N, p): attention ranks, FFN ranks, depth.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from disagmoe_ds.afpipe.build import build_rank
from disagmoe_ds.checkpoint.ds_state import _full_state
from disagmoe_ds.checkpoint.manifest import load_checkpoint, save_checkpoint
from disagmoe_ds.colocated.verify import _written
from disagmoe_ds.config import DisagMoEConfig
from disagmoe_ds.convert import main
from disagmoe_ds.errors import CheckpointError
from disagmoe_ds.launch.testing import run_ranks
from disagmoe_ds.models.split import hf_reference_loss
from disagmoe_ds.parity.reference import DTYPES, VerifyArgs, load_for_verify, make_batches
from disagmoe_ds.train import run as job
from disagmoe_ds.train.conversion import disagmoe_to_hf, hf_to_disagmoe
from disagmoe_ds.train.conversion_jobs import Job, open_checkpoint
from tests.conftest import all_families_only
from tests.runs import ROOT, SHORT, run_pretrain

# fp32: layouts differ only in the order of sums (lane reduction, expert partials, ZeRO partitions).
RESUME_TOL = 1e-5

# Hub key of expert 0's first projection in layer 1 (an MoE layer in every tiny config), as save_pretrained writes.
EXPERT_KEY = {
    "qwen2-moe": "model.layers.1.mlp.experts.0.gate_proj.weight",
    "qwen3-moe": "model.layers.1.mlp.experts.0.gate_proj.weight",
    "olmoe": "model.layers.1.mlp.experts.0.gate_proj.weight",
    "deepseek-v2": "model.layers.1.mlp.experts.0.gate_proj.weight",
    "deepseek-v3": "model.layers.1.mlp.experts.0.gate_proj.weight",
    "deepseek-v32": "model.layers.1.mlp.experts.0.gate_proj.weight",
    "glm4-moe": "model.layers.1.mlp.experts.0.gate_proj.weight",
    "qwen3-next": "model.layers.1.mlp.experts.0.gate_proj.weight",
    "qwen3.5-moe": "model.layers.1.mlp.experts.0.gate_proj.weight",
    "ernie4.5-moe": "model.layers.1.mlp.experts.0.gate_proj.weight",
    "hunyuan-v1-moe": "model.layers.1.mlp.experts.0.gate_proj.weight",
    "dots1": "model.layers.1.mlp.experts.0.gate_proj.weight",
    "minimax-m2": "model.layers.1.block_sparse_moe.experts.0.w1.weight",
    "mixtral": "model.layers.1.block_sparse_moe.experts.0.w1.weight",
    "gpt-oss": "model.layers.1.mlp.experts.gate_up_proj",  # GPT-OSS is fused on the Hub too
    "deepseek-v4": "model.layers.1.ffn.experts.0.w1.weight",  # DeepSeek's own names, as its Hub checkpoints have
}

# (family, layout, ZeRO stage, config overrides): one layout per family with the ZeRO stages spread over them, and
# a second qwen3-moe run at depth 2 with tied embeddings (save_pretrained writes one tensor for the tied pair).
ROUND_TRIPS = [
    ("qwen2-moe", (2, 2, 1), 0, {}),
    ("qwen3-moe", (2, 2, 1), 1, {}),
    ("qwen3-moe", (2, 2, 2), 2, {"tie_word_embeddings": True}),
    ("mixtral", (1, 2, 1), 2, {}),
    ("deepseek-v2", (2, 2, 1), 1, {}),
    ("deepseek-v3", (1, 2, 1), 0, {}),
    ("gpt-oss", (1, 2, 1), 1, {}),
    ("olmoe", (1, 2, 1), 2, {}),
    ("glm4-moe", (2, 2, 2), 1, {}),
    ("qwen3-next", (2, 2, 2), 2, {}),  # linear- and full-attention layers on each A-group
    all_families_only("qwen3.5-moe", (1, 2, 1), 1, {}),
    all_families_only("ernie4.5-moe", (1, 2, 1), 2, {}),
    all_families_only("hunyuan-v1-moe", (1, 2, 1), 0, {}),
    all_families_only("dots1", (1, 2, 1), 1, {}),
    all_families_only("minimax-m2", (1, 2, 1), 2, {}),
    all_families_only("deepseek-v32", (2, 2, 2), 1, {}),  # frozen indexers in the checkpoint
    # DeepSeek-V4: hyper-connections (attn_hc, ffn_hc, hc_head), tid2eid tables, frozen indexers, 2 ep ranks
    ("deepseek-v4", (1, 2, 1), 1, {}),
    all_families_only("deepseek-v4", (2, 4, 2), 2, {}),  # depth 2
]


@pytest.mark.parametrize("family,layout,zero,overrides", ROUND_TRIPS)
def test_hf_round_trip_is_bit_identical(tiny_checkpoint, tmp_path, family, layout, zero, overrides):
    from transformers import AutoModelForCausalLM

    src = tmp_path / "hf"
    shutil.copytree(tiny_checkpoint(family, **overrides), src)
    (src / "tokenizer_config.json").write_text('{"model_max_length": 64}\n')  # carried byte for byte
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    m, n, p = layout
    to_disagmoe = (
        f"hf-to-disagmoe --model {src} --out {ckpt} --zero {zero} --attention-gpus {m} --ffn-gpus {n} --depth {p}"
    )
    assert main(to_disagmoe.split()) == 0
    assert main(f"disagmoe-to-hf --ckpt {ckpt} --model {src} --out {out}".split()) == 0

    before, after = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(after) == sorted(before)
    assert EXPERT_KEY[family] in after
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name
    assert (out / "tokenizer_config.json").read_text() == (src / "tokenizer_config.json").read_text()
    assert not list(tmp_path.glob(".partial-*"))
    AutoModelForCausalLM.from_pretrained(out)


# ----------------------------------------------------------------------------------------------------------------
# Re-layout: (2,2,1) after 2 steps -> (1,3,1) continues like the uninterrupted (2,2,1) run
# ----------------------------------------------------------------------------------------------------------------


# The learning rate changes every step, so a re-layout that lost the scheduler state or the scheduled lr shows.
SCHEDULER = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 8}}


def _ds_config(args: VerifyArgs) -> dict:
    return {**args.ds_config(), "scheduler": SCHEDULER}


def _args(model: str, cfg: DisagMoEConfig) -> VerifyArgs:
    return VerifyArgs(model, cfg, zero=1, steps=5, seq_len=8, clip=0.05)


def _train_and_save(rank: int, args: VerifyArgs, ckpt: str) -> dict:
    """Train all steps, saving after step 2; also checks that ZeRO's module weights equal its fp32 masters."""
    rt = build_rank(args.model, _ds_config(args), args.cfg, micro_batch_size=1, model=load_for_verify(args))
    losses, masters_equal = [], True
    for step in range(args.steps):
        vocab = rt.module.config.vocab_size if rt.role.is_attention else 0
        batches = make_batches(args, vocab, step, rt.role.index) if rt.role.is_attention else None
        losses.append(rt.executor.train_batch(batches).loss)
        if step == 1:
            for param in rt.module.parameters():
                masters_equal &= torch.equal(_full_state(rt.engine, param, None), param.detach())
            save_checkpoint(
                rt.engine,
                rt.role,
                rt.layout,
                rt.module.config,
                ckpt,
                f"step{step + 1}",
                {"step": step + 1},
                ds_config=_ds_config(args),
            )
    return {"losses": losses, "masters_equal": masters_equal}


def _lanes(cfg: DisagMoEConfig) -> int:
    return cfg.attention_gpus // cfg.depth


def _resume(rank: int, args: VerifyArgs, data_args: VerifyArgs, ckpt: str) -> list[float]:
    """Load ``ckpt`` under ``args``' layout and train to step 5 on the global batches of ``data_args``' run.

    A step's loss is the mean over all lanes' micro-batches, so one lane with 2K micro-batches (lane 0's, then
    lane 1's) trains on the same sequences as two lanes with K each.
    """
    rt = build_rank(args.model, _ds_config(args), args.cfg, micro_batch_size=1, model=load_for_verify(args))
    _, client_state = load_checkpoint(rt.engine, rt.role, rt.layout, rt.module.config, ckpt)
    lanes_per_lane = _lanes(data_args.cfg) // _lanes(args.cfg)
    losses = []
    for step in range(client_state["step"], args.steps):
        batches = None
        if rt.role.is_attention:
            vocab = rt.module.config.vocab_size
            first = rt.role.index * lanes_per_lane
            batches = [
                b for lane in range(first, first + lanes_per_lane) for b in make_batches(data_args, vocab, step, lane)
            ]
        losses.append(rt.executor.train_batch(batches).loss)
    return losses


def test_relayout_continues_training_like_the_original_layout(tiny_checkpoint, tmp_path):
    model = str(tiny_checkpoint("qwen3-moe", num_experts=6))  # 6 experts split over 2 and over 3 FFN ranks
    args_221 = _args(model, DisagMoEConfig(attention_gpus=2, ffn_gpus=2, micro_batches=2))
    args_131 = _args(model, DisagMoEConfig(attention_gpus=1, ffn_gpus=3, micro_batches=4))
    src, dst, back = tmp_path / "src", tmp_path / "dst", tmp_path / "back"
    full = run_ranks(_train_and_save, 4, args=(args_221, str(src)), timeout_s=120)
    assert all(r["masters_equal"] for r in full)  # fp32 ZeRO-1: module weights == assembled fp32 masters, bitwise
    reference = full[0]["losses"][2:]

    # ZeRO 1 -> 0 on the way there (per-parameter state), 0 -> 1 on the way back (flat partitions).
    relayout = f"relayout --ckpt {src} --model {model} --out {dst} --zero 0 --attention-gpus 1 --ffn-gpus 3"
    assert main(relayout.split()) == 0
    resumed = run_ranks(_resume, 4, args=(replace(args_131, zero=0), args_221, str(dst)), timeout_s=120)[0]
    assert max(abs(a - b) for a, b in zip(resumed, reference)) <= RESUME_TOL, (resumed, reference)

    relayout = f"relayout --ckpt {dst} --model {model} --out {back} --zero 1 --attention-gpus 2 --ffn-gpus 2"
    assert main(relayout.split()) == 0
    assert run_ranks(_resume, 4, args=(args_221, args_221, str(back)), timeout_s=120)[0] == reference  # lossless


# ----------------------------------------------------------------------------------------------------------------
# Co-located checkpoints (run_pretrain.py --mode colocated) -> HF
# ----------------------------------------------------------------------------------------------------------------

COLOCATED_MODEL = ROOT / "hf_models" / "tiny-qwen3-moe-lm"  # run_pretrain's default: 8 experts, its tokenizer's vocab
PROBE = torch.randint(3, 512, (2, 16), generator=torch.Generator().manual_seed(0))  # every rank's batch at the save
# The split forward sums in another order than HF's (expert partials, combine); bf16 rounds those sums.
LOSS_TOL = {"fp32": 1e-5, "bf16": 1e-2}


@dataclass(frozen=True)
class ColocatedRun:
    ckpt: Path
    trained: dict[str, torch.Tensor]  # every parameter at the save, by HF name (float32, exact for bf16 too)
    loss: float  # the ranks' model on PROBE (LM loss + HF's aux loss, as HF computes it)


def _recording_save(save: Callable, record: Path) -> Callable:
    """run_pretrain's ``save``, after which every rank records its share of the trained parameters (one copy of
    each, as ``colocated.verify`` takes it) and its model's loss on PROBE."""

    def save_and_record(runtime, root, step, loader, **kwargs) -> Path:
        path = save(runtime, root, step, loader, **kwargs)
        with torch.no_grad():
            loss = runtime.module(PROBE, PROBE.clone()).loss  # collective: the all-to-alls of the EP group
        params = _written(runtime, {n: p.detach() for n, p in runtime.module.named_parameters()})
        torch.save({"params": params, "loss": loss.item()}, record / f"rank{dist.get_rank()}.pt")
        return path

    return save_and_record


@pytest.fixture(scope="module")
def colocated_run(tmp_path_factory, tok_cache) -> Callable[..., ColocatedRun]:
    """``colocated_run(ep_size, zero, dtype)``: 2 co-located ranks trained 2 steps by run_pretrain.py and saved by
    its --save-dir; run once per module and setting."""
    cache: dict[tuple, ColocatedRun] = {}

    def get(ep_size: int, zero: int, dtype: str) -> ColocatedRun:
        if (ep_size, zero, dtype) in cache:
            return cache[ep_size, zero, dtype]
        out = tmp_path_factory.mktemp(f"colocated-ep{ep_size}-zero{zero}-{dtype}")
        ds_config = json.loads((ROOT / "ds_configs" / "tiny-cpu.json").read_text())
        ds_config["zero_optimization"] = {"stage": zero}
        (out / "ds.json").write_text(json.dumps(ds_config))
        argv = [*SHORT, "--seq-len", 16, "--tokenizer-cache", tok_cache, "--mode", "colocated", "--world-size", 2,
                "--ep-size", ep_size, "--deepspeed_config", out / "ds.json", "--dtype", dtype, "--steps", 2,
                "--save-dir", out / "ck"]  # fmt: skip
        with pytest.MonkeyPatch.context() as patch:  # the forked ranks inherit it
            patch.setattr(job, "save", _recording_save(job.save, out))
            assert run_pretrain.main([str(a) for a in argv]) == 0
        ranks = [torch.load(out / f"rank{r}.pt") for r in range(2)]
        slices: dict[str, list[tuple[int, torch.Tensor]]] = {}
        for rank in ranks:
            for name, piece in rank["params"].items():
                slices.setdefault(name, []).append(piece)
        trained = {n: torch.cat([t for _, t in sorted(parts, key=lambda p: p[0])]) for n, parts in slices.items()}
        assert ranks[0]["loss"] == ranks[1]["loss"]  # one model: every rank runs the same batch through it
        cache[ep_size, zero, dtype] = ColocatedRun(out / "ck", trained, ranks[0]["loss"])
        return cache[ep_size, zero, dtype]

    return get


@pytest.mark.parametrize(
    "ep_size,zero,dtype",
    [(2, 0, "fp32"), (1, 1, "bf16")],  # EP 2 (all-to-all); EP 1 x EDP 2 (expert replicas), ZeRO-partitioned
    ids=["ep2-zero0-fp32", "ep1-edp2-zero1-bf16"],
)
def test_colocated_checkpoint_exports_to_hf(colocated_run, tmp_path, ep_size, zero, dtype):
    from transformers import AutoModelForCausalLM

    run = colocated_run(ep_size, zero, dtype)
    assert json.loads((run.ckpt / "step2" / "manifest.json").read_text())["mode"] == "colocated"
    out = tmp_path / "hf"
    assert main(f"disagmoe-to-hf --ckpt {run.ckpt} --model {COLOCATED_MODEL} --out {out}".split()) == 0

    model = AutoModelForCausalLM.from_pretrained(out, dtype=DTYPES[dtype])
    exported = dict(model.named_parameters())
    assert sorted(exported) == sorted(run.trained)
    for name, tensor in exported.items():  # bit-exact in the training dtype (bf16 -> fp32 is exact)
        assert tensor.dtype == DTYPES[dtype] and torch.equal(tensor.float(), run.trained[name]), name
    assert all(t.dtype == DTYPES[dtype] for t in load_file(out / "model.safetensors").values())
    with torch.no_grad():
        loss = hf_reference_loss(model, model(PROBE, labels=PROBE)).item()  # the model's balancing, as trained
    assert abs(loss - run.loss) <= LOSS_TOL[dtype], (loss, run.loss)


def test_a_colocated_checkpoint_is_refused_where_hf_weights_belong(colocated_run, tmp_path, capfd):
    """hf-to-disagmoe reads HF weights; relayout reads checkpoints of either mode (test_colocated_pipeline)."""
    ckpt = colocated_run(2, 0, "fp32").ckpt
    argv = f"hf-to-disagmoe --model {ckpt} --out {tmp_path / 'out'} --attention-gpus 1 --ffn-gpus 1"
    capfd.readouterr()
    assert main(argv.split()) == 2
    lines = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    message = f"{ckpt} is a DisagMoE checkpoint, not an HF directory; hf-to-disagmoe reads HF weights"
    assert len(lines) == 1 and lines[0].startswith(f"disagmoe-convert: error: {message}"), lines
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_ckpt(tiny_checkpoint, tmp_path_factory):
    model = tiny_checkpoint("qwen3-moe")
    root = tmp_path_factory.mktemp("qwen3-ckpt")
    hf_to_disagmoe(Job(str(model), DisagMoEConfig(attention_gpus=1, ffn_gpus=1), {}), root)
    return root


def test_checkpoint_of_another_model_is_refused(tiny_checkpoint, qwen3_ckpt, tmp_path, capsys):
    other = tiny_checkpoint("mixtral")
    assert main(f"disagmoe-to-hf --ckpt {qwen3_ckpt} --model {other} --out {tmp_path / 'o'}".split()) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("disagmoe-convert")]
    assert len(errors) == 1 and "was written for another model" in errors[0]
    assert not (tmp_path / "o").exists()
    with pytest.raises(CheckpointError, match="6 experts; the checkpoint has 4 layers, 8 experts"):
        open_checkpoint(qwen3_ckpt, tiny_checkpoint("qwen3-moe", num_experts=6))  # same fingerprint, other experts


def test_missing_and_incomplete_checkpoints_are_refused(tiny_checkpoint, qwen3_ckpt, tmp_path):
    model = tiny_checkpoint("qwen3-moe")
    with pytest.raises(CheckpointError, match="does not exist"):
        open_checkpoint(tmp_path / "nowhere", model)
    (tmp_path / "step3" / "attention_g0").mkdir(parents=True)
    (tmp_path / "latest").write_text("step3")
    with pytest.raises(CheckpointError, match=r"step3: it has no manifest.json \(a save that did not finish"):
        open_checkpoint(tmp_path, model)
    unrecorded = tmp_path / "unrecorded"
    shutil.copytree(qwen3_ckpt, unrecorded)
    manifest = json.loads((unrecorded / "step0" / "manifest.json").read_text())
    manifest["ds_config"] = None
    (unrecorded / "step0" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="does not record its DeepSpeed config; pass --ds-config"):
        open_checkpoint(unrecorded, model)
    assert open_checkpoint(unrecorded, model, ds_config={"zero_optimization": {"stage": 0}}).job.ds_config


def test_hf_directory_without_weights_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="no weight file in"):
        hf_to_disagmoe(Job("hf_models/tiny-qwen3-moe", DisagMoEConfig(), {}), tmp_path)  # a config-only directory


def test_existing_output_is_never_overwritten(tiny_checkpoint, qwen3_ckpt, tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(CheckpointError, match="already exists"):
        disagmoe_to_hf(open_checkpoint(qwen3_ckpt, tiny_checkpoint("qwen3-moe")), tmp_path / "out")
    with pytest.raises(CheckpointError, match="already exists"):
        hf_to_disagmoe(Job(str(tiny_checkpoint("qwen3-moe")), DisagMoEConfig(), {}), qwen3_ckpt)  # its tag step0
