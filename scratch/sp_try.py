import torch, deepspeed
import torch.distributed as dist
from disagmoe_ds.launch.testing import run_ranks

def body(rank, family):
    deepspeed.init_distributed(dist_backend="gloo")
    from transformers import AutoConfig, AutoModelForCausalLM
    from tests.conftest import ROOT
    from disagmoe_ds.models.parts import AttentionStage
    from disagmoe_ds.models.sequence_parallel import SequenceParallel, install_ulysses, slice_batch
    cfg = AutoConfig.from_pretrained(ROOT / "hf_models" / f"tiny-{family}")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float()
    layers = tuple(range(cfg.num_hidden_layers))
    full = AttentionStage(model, layers, with_embedding=True, with_head=True)
    torch.manual_seed(1)
    B, S = 2, 8
    h = torch.randn(B, S, cfg.hidden_size, requires_grad=True)
    ctx = full.context(h, None)
    out_full = full.part(0)(h, ctx, cfg)
    g = torch.randn_like(out_full.residual_BSH)
    (out_full.residual_BSH * g).sum().backward()
    want = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in full.part(0).parameters()]
    hgrad = h.grad.clone()
    for p in full.part(0).parameters(): p.grad = None
    sp = SequenceParallel(dist.group.WORLD, 2, rank)
    install_ulysses([full.part(0).self_attn], sp)
    hl = sp.slice_of(h.detach()).clone().requires_grad_()
    pos = sp.slice_of(torch.arange(S).expand(B, S))
    from disagmoe_ds.models.parts import build_context, LayerContext
    ctx_full_masks = build_context(cfg, full.rotary_emb, torch.empty(B, S, 1).expand(B, S, cfg.hidden_size), None).masks
    ctxl = LayerContext(pos, full.rotary_emb(hl, pos), ctx_full_masks)
    out = full.part(0)(hl, ctxl, cfg)
    (out.residual_BSH * sp.slice_of(g)).sum().backward()
    got = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in full.part(0).parameters()]
    for t in got: dist.all_reduce(t)
    err_out = (out.residual_BSH - sp.slice_of(out_full.residual_BSH)).abs().max().item()
    err_g = max((a - b).abs().max().item() for a, b in zip(got, want))
    err_h = (hl.grad - sp.slice_of(hgrad)).abs().max().item()
    return err_out, err_g, err_h

if __name__ == "__main__":
    import sys
    for fam in sys.argv[1:]:
        print(fam, run_ranks(body, 2, args=(fam,), timeout_s=120))
