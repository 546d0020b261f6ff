"""Optimizer presets (bitsandbytes 8-bit, Lion, GaLore), schedules at known steps, the CLI's --model.optimizer."""

from __future__ import annotations

import sys

import pytest
import torch

from lightalign import SFTModule
from lightalign.hub import load_causal_lm
from lightalign.modules.training.optimizers import build_named_optimizer

PRESETS = [
    ("adamw_8bit", "bitsandbytes.optim:AdamW8bit"), ("adam_8bit", "bitsandbytes.optim:Adam8bit"),
    ("paged_adamw_8bit", "bitsandbytes.optim:PagedAdamW8bit"), ("lion", "lion_pytorch:Lion"),
    ("lion_8bit", "bitsandbytes.optim:Lion8bit"), ("galore_adamw", "galore_torch:GaLoreAdamW"),
    ("galore_adafactor", "galore_torch:GaLoreAdafactor"),
]


def _model(tiny_dir):
    torch.manual_seed(0)
    model = load_causal_lm(str(tiny_dir), from_config=True)
    for i in (0, 2, 3):  # frozen parts: they must stay out of the optimizer (and keep the test fast)
        model.model.layers[i].requires_grad_(False)
    return model


@pytest.mark.parametrize("optim,cls_name", PRESETS)
def test_preset_is_the_asked_class_and_steps_trainable_params_only(tiny_dir, optim, cls_name):
    import importlib

    module_name, attr = cls_name.split(":")
    expected_cls = getattr(importlib.import_module(module_name), attr)
    model = _model(tiny_dir)
    galore = optim.startswith("galore")
    opt = build_named_optimizer(optim, model, lr=1e-3, weight_decay=0.01,
                                optim_args={"rank": 8, "update_proj_gap": 2} if galore else None,
                                optim_target_modules=["self_attn", "mlp"] if galore else None)
    assert type(opt) is expected_cls
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert in_opt == trainable
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(0, 1024, (2, 12), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    for name, p in model.named_parameters():
        changed = not torch.equal(p, before[name])
        assert changed == p.requires_grad, name
    embed_state = opt.state[model.model.embed_tokens.weight]
    if "8bit" in optim:  # really 8-bit state on CPU (bitsandbytes 0.50; paged falls back to non-paged)
        assert embed_state["state1"].dtype == torch.uint8
    if galore:  # the targeted weights keep a low-rank projector and rank-8 moments
        q = model.model.layers[1].self_attn.q_proj.weight
        assert "projector" in opt.state[q]
        if optim == "galore_adamw":
            assert 8 in tuple(opt.state[q]["exp_avg"].shape) and opt.state[q]["exp_avg"].numel() < q.numel()


def test_preset_errors(tiny_dir):
    model = _model(tiny_dir)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs a CUDA GPU"):  # at construction, before the model loads
            SFTModule(str(tiny_dir), from_config=True, optim="galore_adamw_8bit", optim_target_modules=["mlp"])
    with pytest.raises(ValueError, match="needs optim_target_modules"):
        SFTModule(str(tiny_dir), from_config=True, optim="galore_adamw")
    with pytest.raises(ValueError, match="only applies to the galore"):
        SFTModule(str(tiny_dir), from_config=True, optim="lion", optim_target_modules=["mlp"])
    with pytest.raises(ValueError, match="matched no trainable"):
        build_named_optimizer("galore_adamw", model, lr=1e-3, optim_target_modules=["nothing_like_this"])
    with pytest.raises(ValueError, match="optim='adamw_9bit' is unknown"):
        SFTModule(str(tiny_dir), from_config=True, optim="adamw_9bit")
    with pytest.raises(ValueError, match="either optim"):
        SFTModule(str(tiny_dir), from_config=True, optim="lion", optimizer=lambda p: torch.optim.SGD(p, lr=1))
    with pytest.raises(ImportError, match=r"lightalign\[optim\]"):
        sys.modules["lion_pytorch"] = None  # as if not installed
        try:
            build_named_optimizer("lion", model, lr=1e-3)
        finally:
            del sys.modules["lion_pytorch"]


@pytest.mark.gpu
def test_galore_adamw_8bit_on_gpu(tiny_dir):
    model = _model(tiny_dir).cuda()
    opt = build_named_optimizer("galore_adamw_8bit", model, lr=1e-3, optim_args={"rank": 8}, optim_target_modules=["mlp"])
    ids = torch.randint(0, 1024, (2, 12), device="cuda")
    before = model.model.layers[1].mlp.up_proj.weight.detach().clone()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    assert not torch.equal(before, model.model.layers[1].mlp.up_proj.weight)


def _lrs(module, total, steps):
    module.configure_model()
    opt = module.create_optimizer()
    sched = module.create_lr_scheduler(opt, total_steps=total)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_schedules_at_known_steps_with_warmup_ratio(tiny_dir):
    make = lambda **kw: SFTModule(str(tiny_dir), from_config=True, learning_rate=1.0, **kw)  # noqa: E731
    # warmup_ratio 0.25 of 8 steps = 2 warmup steps; cosine over the 6 others
    cos = _lrs(make(lr_scheduler_type="cosine", warmup_ratio=0.25), 8, 8)
    assert cos[:3] == pytest.approx([0.0, 0.5, 1.0])
    assert cos[5] == pytest.approx(0.5)  # halfway through the decay
    min_lr = _lrs(make(lr_scheduler_type="cosine_with_min_lr", warmup_steps=1, min_lr_rate=0.1), 5, 6)
    assert min_lr[1] == pytest.approx(1.0) and min_lr[5] == pytest.approx(0.1)
    assert min_lr[3] == pytest.approx(0.1 + 0.9 * 0.5)
    assert _lrs(make(lr_scheduler_type="constant", warmup_steps=2), 10, 5) == pytest.approx([0.0, 0.5, 1.0, 1.0, 1.0])
    # warmup_steps wins over warmup_ratio
    assert _lrs(make(lr_scheduler_type="linear", warmup_steps=1, warmup_ratio=0.5), 5, 3) == pytest.approx([0.0, 1.0, 0.75])


def test_module_builds_the_preset(tiny_dir):
    module = SFTModule(str(tiny_dir), from_config=True, optim="lion", learning_rate=1e-4, weight_decay=0.1, warmup_steps=1)
    module.configure_model()
    opt = module.create_optimizer()
    assert type(opt).__name__ == "Lion" and {g["lr"] for g in opt.param_groups} == {1e-4}
    assert sorted(g["weight_decay"] for g in opt.param_groups) == [0.0, 0.1]  # none on norms and biases
    module.create_lr_scheduler(opt, total_steps=4)  # the warmup schedule applies to presets too
    assert opt.param_groups[0]["lr"] == 0.0


def test_optimizer_and_scheduler_instances(tiny_model):
    tiny_model.model.embed_tokens.requires_grad_(False)
    trainable = [p for p in tiny_model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trainable, lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    module = SFTModule(model=tiny_model, optimizer=opt, lr_scheduler=sched)
    config = module.configure_optimizers()
    assert config["optimizer"] is opt and config["lr_scheduler"]["scheduler"] is sched
    with pytest.raises(ValueError, match="not trainable"):  # the frozen embedding in it
        SFTModule(model=tiny_model, optimizer=torch.optim.SGD(tiny_model.parameters(), lr=0.1)).create_optimizer()


def test_default_adamw_is_fused_on_plain_tensors_and_steps_like_the_loop(tiny_dir):
    from lightalign import SFTModule
    from lightalign.modules.training.optimizers import decay_parameter_groups, fused_adamw_applies

    module = SFTModule(model=_model(tiny_dir), learning_rate=1e-3, weight_decay=0.01)
    opt = module.create_optimizer()
    assert all(g["fused"] for g in opt.param_groups)  # transformers' default adamw_torch_fused
    assert not fused_adamw_applies([{"params": [torch.zeros(2, dtype=torch.long)]}])  # not for integer tensors
    # the fused kernel steps like the per-tensor loop (TRL's adamw_torch)
    models = [_model(tiny_dir) for _ in range(2)]
    ids = torch.randint(0, 1024, (2, 12), generator=torch.Generator().manual_seed(0))
    for model, fused in zip(models, (True, False)):
        step = torch.optim.AdamW(decay_parameter_groups(model, 0.01), lr=1e-3, fused=fused)
        for _ in range(3):
            step.zero_grad()
            model(input_ids=ids, labels=ids).loss.backward()
            step.step()
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        if name.endswith("k_proj.bias"):  # softmax ignores key biases: their gradient is float noise, which
            continue                      # Adam scales to full-size steps, differently per kernel
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)


def test_fused_adamw_steps_aside_for_mixed_precision_and_deepspeed():
    from types import SimpleNamespace

    from lightning.pytorch.strategies import SingleDeviceStrategy

    from lightalign.modules.training.optimizers import fused_adamw_applies

    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))]}]
    assert fused_adamw_applies(groups, SimpleNamespace(precision="32-true", strategy=object()))
    assert not fused_adamw_applies(groups, SimpleNamespace(precision="16-mixed", strategy=SingleDeviceStrategy()))
    # bf16 autocast has no loss scaler: fused where lightalign clips itself, not where Lightning's plugins clip
    assert fused_adamw_applies(groups, SimpleNamespace(precision="bf16-mixed", strategy=SingleDeviceStrategy()))
    assert not fused_adamw_applies(groups, SimpleNamespace(precision="bf16-mixed", strategy=object()))

    class DeepSpeedStrategy:
        pass

    assert not fused_adamw_applies(groups, SimpleNamespace(precision="32-true", strategy=DeepSpeedStrategy()))
