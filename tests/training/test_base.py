"""PolicyModule: loading (folder, config, instance, kwargs), LoRA, optimizers and schedules, HF export."""

from __future__ import annotations

from unittest import mock

import lightning as L
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightalign import SFTDataModule, SFTModule
from lightalign.hub import load_causal_lm, normalize_init_kwargs
from lightalign.modules.training.optimizers import decay_parameter_groups, schedule_factor


def _trainer(**kw):
    kw.setdefault("max_steps", 2)
    return L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, **kw)


def test_schedules():
    assert schedule_factor(0, 100, 10, "linear") == 0.0
    assert schedule_factor(5, 100, 10, "cosine") == pytest.approx(0.5)
    assert schedule_factor(10, 100, 10, "cosine") == pytest.approx(1.0)
    assert schedule_factor(55, 100, 10, "cosine") == pytest.approx(0.5)
    assert schedule_factor(55, 100, 10, "linear") == pytest.approx(0.5)
    assert schedule_factor(100, 100, 10, "cosine_with_min_lr", min_lr_rate=0.1) == pytest.approx(0.1)
    assert schedule_factor(80, 100, 0, "constant") == 1.0


def test_scheduler_steps_per_optimizer_step(tiny_dir, data_dir):
    lrs = []

    class Record(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            lrs.append(optimizer.param_groups[0]["lr"])

    module = SFTModule(str(tiny_dir), from_config=True, learning_rate=1e-3, warmup_steps=2, lr_scheduler_type="linear")
    data = SFTDataModule(str(data_dir / "arithmetic_sft.jsonl"), tokenizer=str(tiny_dir), batch_size=4)
    _trainer(max_steps=6, accumulate_grad_batches=2, callbacks=[Record()]).fit(module, data)
    # warmup 0, 0.5, then linear decay over the remaining 4 steps: 1, .75, .5, .25 (x 1e-3)
    assert lrs == pytest.approx([0.0, 5e-4, 1e-3, 7.5e-4, 5e-4, 2.5e-4])


def test_no_weight_decay_on_norms_and_biases(tiny_model):
    groups = decay_parameter_groups(tiny_model, 0.1)
    decayed = {id(p) for p in groups[0]["params"]}
    for name, p in tiny_model.named_parameters():
        assert (id(p) in decayed) == (p.ndim >= 2 and "norm" not in name), name


def test_custom_optimizer_and_scheduler_factories(tiny_dir, data_dir):
    made = {}

    def opt(params):
        params = list(params)
        made["n_params"] = len(params)
        return torch.optim.SGD(params, lr=0.1)

    def sched(optimizer):
        made["sched"] = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return made["sched"]

    module = SFTModule(str(tiny_dir), from_config=True, optimizer=opt, lr_scheduler=sched)
    data = SFTDataModule(str(data_dir / "arithmetic_sft.jsonl"), tokenizer=str(tiny_dir), batch_size=4)
    _trainer(max_steps=3).fit(module, data)
    assert made["n_params"] == len(list(module.model.parameters()))
    assert made["sched"].get_last_lr()[0] == pytest.approx(0.1 * 0.5**3)  # stepped every optimizer step


def test_model_init_kwargs_dtype_strings():
    assert normalize_init_kwargs({"dtype": "bfloat16"})["dtype"] is torch.bfloat16
    assert normalize_init_kwargs({"torch_dtype": "torch.float16"})["dtype"] is torch.float16
    assert normalize_init_kwargs({"dtype": "auto"})["dtype"] == "auto"
    with pytest.raises(ValueError, match="not a torch dtype"):
        normalize_init_kwargs({"dtype": "float99"})


def test_load_from_config_with_kwargs(tiny_dir):
    model = load_causal_lm(str(tiny_dir), from_config=True, init_kwargs={"dtype": "bfloat16", "attn_implementation": "eager"})
    assert next(model.parameters()).dtype is torch.bfloat16
    assert model.config._attn_implementation == "eager"


def test_load_pretrained_folder_and_instance(tiny_model, tmp_path, tiny_dir):
    tiny_model.save_pretrained(tmp_path / "m")
    module = SFTModule(str(tmp_path / "m"))
    module.configure_model()
    for a, b in zip(module.model.parameters(), tiny_model.parameters()):
        assert torch.equal(a, b)
    inst = SFTModule(model=tiny_model)
    assert inst.model is tiny_model


def test_trust_remote_code_is_off_by_default(tiny_model, tmp_path, monkeypatch):
    seen = {}
    import transformers

    tiny_model.save_pretrained(tmp_path)  # a folder with weights: from_pretrained really runs
    real = transformers.AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy)
    load_causal_lm(str(tmp_path))
    assert seen["trust_remote_code"] is False


def test_lora_trains_only_adapters(tiny_dir, data_dir, tmp_path):
    pytest.importorskip("peft")
    module = SFTModule(str(tiny_dir), from_config=True, learning_rate=1e-2,
                       peft_config={"r": 4, "lora_alpha": 8, "target_modules": "all-linear"})
    module.configure_model()
    before = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    trainable = {n for n, p in module.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    data = SFTDataModule(str(data_dir / "arithmetic_sft.jsonl"), tokenizer=str(tiny_dir), batch_size=4)
    _trainer(max_steps=3).fit(module, data)
    for n, p in module.model.named_parameters():
        if "lora_" not in n:
            assert torch.equal(before[n], p.detach()), f"frozen base weight {n} changed"
    assert any(not torch.equal(before[n], p) for n, p in module.model.named_parameters() if "lora_B" in n)
    # export: merged full weights on request; on a from_config model also by default (its random base is saved
    # nowhere, so an adapter alone would be unusable; adapters of pretrained models: test_data_errors.py)
    tok = AutoTokenizer.from_pretrained(str(tiny_dir))
    with pytest.warns(UserWarning, match="LoRA on a from_config model"):
        module.export_hf(tmp_path / "default", tokenizer=tok)
    assert not (tmp_path / "default" / "adapter_config.json").exists()
    module.export_hf(tmp_path / "merged", tokenizer=tok, merge_lora=True)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any("lora" in n for n, _ in merged.named_parameters())
    ids = torch.tensor([tok("3+4=")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, module.model(ids).logits, atol=1e-5, rtol=1e-5)
    assert module.model.peft_config  # training model untouched by the merge


def test_gradient_checkpointing(tiny_dir, data_dir):
    module = SFTModule(str(tiny_dir), from_config=True, gradient_checkpointing=True)
    module.configure_model()
    layers = [m for m in module.model.modules() if getattr(m, "gradient_checkpointing", False)]
    assert layers and module.model.config.use_cache is False
    data = SFTDataModule(str(data_dir / "arithmetic_sft.jsonl"), tokenizer=str(tiny_dir), batch_size=4)
    _trainer(max_steps=2).fit(module, data)


def test_export_reloads_and_generates(tiny_dir, data_dir, tmp_path):
    module = SFTModule(str(tiny_dir), from_config=True, learning_rate=1e-3)
    data = SFTDataModule(str(data_dir / "arithmetic_sft.jsonl"), tokenizer=str(tiny_dir), batch_size=8)
    _trainer(max_steps=3).fit(module, data)
    out = module.export_hf(tmp_path / "hf", tokenizer=data.tokenizer)
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    for a, b in zip(model.parameters(), module.model.parameters()):
        assert torch.equal(a, b)
    ids = tok("12+7=", return_tensors="pt")
    gen = model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert gen.shape[1] > ids["input_ids"].shape[1]
    assert isinstance(tok.decode(gen[0]), str)
    # a second export replaces the first atomically and leaves no temporary folders behind
    module.export_hf(out, tokenizer=data.tokenizer)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_user_eval_metrics_torchmetrics_and_callable(tiny_dir, data_dir):
    from torchmetrics.classification import MulticlassAccuracy

    calls = []

    def exact_match(preds, target):
        calls.append(preds.shape[0])
        return (preds == target).float().mean()

    module = SFTModule(str(tiny_dir), from_config=True,
                       eval_metrics={"acc": MulticlassAccuracy(num_classes=1024, average="micro"), "match": exact_match})
    data = SFTDataModule(str(data_dir / "arithmetic_sft.jsonl"), tokenizer=str(tiny_dir), batch_size=8,
                         val_path=str(data_dir / "arithmetic_sft_val.jsonl"))
    trainer = _trainer(max_steps=2, limit_val_batches=3, num_sanity_val_steps=0)
    trainer.fit(module, data)
    logged = trainer.validate(module, datamodule=data)[0]
    assert len(calls) == 3
    # both equal the module's own token accuracy (same predictions, same targets)
    assert logged["val/acc"] == pytest.approx(logged["val/token_accuracy"], abs=1e-6)
    assert logged["val/match"] == pytest.approx(logged["val/token_accuracy"], abs=1e-2)


def test_gradients_freed_right_after_the_optimizer_step(tiny_dir, data_dir):
    """Lightning zeroes gradients only after the next step's forward; the module frees them after the step, so no
    forward runs with a model's worth of stale gradients (the step's memory peak). Accumulation keeps them."""
    seen = []  # (micro-batch index, any gradient alive when the micro-batch starts)

    class Record(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append((batch_idx, any(p.grad is not None for p in pl_module.parameters())))

    module = SFTModule(str(tiny_dir), from_config=True, learning_rate=1e-3)
    data = SFTDataModule(str(data_dir / "arithmetic_sft.jsonl"), tokenizer=str(tiny_dir), batch_size=4)
    _trainer(max_steps=3, accumulate_grad_batches=2, callbacks=[Record()]).fit(module, data)
    # odd micro-batches continue an accumulation (gradients present), even ones start a step (none)
    assert seen == [(i, i % 2 == 1) for i in range(6)]


@pytest.mark.parametrize("clip", [1e-3, 1e6])  # clipped, and under the limit
def test_clipping_from_the_guards_norms_equals_lightning_clipping(tiny_dir, data_dir, clip):
    """The module clips with the per-tensor norms the non-finite guard computed; the gradients the optimizer sees
    are bit-equal to Lightning's own clip_grad_norm_ path."""

    class Recording(torch.optim.SGD):
        seen: list = []

        def step(self, closure=None):
            loss = super().step(closure)
            Recording.seen.append([p.grad.clone() for g in self.param_groups for p in g["params"] if p.grad is not None])
            return loss

    class LightningClipping(SFTModule):
        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
            L.LightningModule.configure_gradient_clipping(self, optimizer, gradient_clip_val, gradient_clip_algorithm)

    second_pass = []  # Lightning's path: clip_grad_norm_ computes the norms again
    original = torch.nn.utils.clip_grad_norm_

    def counting(*args, **kwargs):
        second_pass.append(1)
        return original(*args, **kwargs)

    runs, passes = [], []
    for cls in (SFTModule, LightningClipping):
        Recording.seen, second_pass[:] = [], []
        L.seed_everything(0)
        module = cls(str(tiny_dir), from_config=True, optimizer=lambda p: Recording(p, lr=1e-2))
        data = SFTDataModule(str(data_dir / "arithmetic_sft.jsonl"), tokenizer=str(tiny_dir), batch_size=4)
        with mock.patch.object(torch.nn.utils, "clip_grad_norm_", counting):
            _trainer(max_steps=2, gradient_clip_val=clip).fit(module, data)
        runs.append(Recording.seen)
        passes.append(len(second_pass))
    assert len(runs[0]) == 2
    assert passes == [0, 2]  # ours used the guard's norms (NonFiniteGuard), no second pass
    for ours, theirs in zip(*runs):
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    total = torch.linalg.vector_norm(torch.stack([g.norm() for g in runs[0][0]]))
    assert total <= clip * 1.001 if clip < 1 else total > 1e-2  # the small limit did clip, the large one did not


def test_from_config_on_a_folder_with_weights_warns_that_they_are_not_loaded(tiny_dir, tiny_model, tmp_path):
    """A quickstart config (from_config: true) pointed at the user's model folder would train random weights."""
    import warnings

    from lightalign import SFTModule

    tiny_model.save_pretrained(tmp_path / "mine")
    with pytest.warns(UserWarning, match="does not load the weights in that folder; set from_config: false"):
        SFTModule(str(tmp_path / "mine"), from_config=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SFTModule(str(tiny_dir), from_config=True)  # the shipped config-only folder: nothing to warn about
