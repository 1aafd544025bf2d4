import os, torch, deepspeed
from transformers import AutoConfig, AutoModelForCausalLM
from disagmoe_ds.launch.testing import run_ranks

def compat():
    from transformers.utils import output_capturing as oc
    reg = oc._CAN_RECORD_REGISTRY
    base = type(reg)
    class Compat(base):
        def get(self, key, default=None):
            if isinstance(key, str):
                return dict.get(self, key, default)
            return base.get(self, key)
    reg.__class__ = Compat

def body(rank, ep):
    compat()
    deepspeed.init_distributed(dist_backend="gloo")
    cfg = AutoConfig.from_pretrained("hf_models/tiny-qwen3-moe")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).train()
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
          "expert_parallel": {"enabled": True, "autoep_size": ep, "preset_model": "qwen3_moe"}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()], config=ds)
    ids = torch.randint(0, cfg.vocab_size, (1, 16))
    out = engine(input_ids=ids, labels=ids)
    engine.backward(out.loss)
    engine.step()
    return float(out.loss.detach()), [type(l.mlp).__name__ for l in engine.module.model.layers]

if __name__ == "__main__":
    print(run_ranks(body, 2, args=(2,), timeout_s=120))
