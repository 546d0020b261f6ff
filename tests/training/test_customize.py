"""docs/customize.md, item by item: each test checks the knob's effect (CLI optimizer, callbacks, early stopping,
device cache, throughput/MFU, precision, NEFTune, torch.compile, Liger, subclassing points)."""

from __future__ import annotations

import copy
import importlib.util
import math
import sys
import types

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping

from lightalign import DeviceCacheCleanup, NEFTune, SFTDataModule, SFTModule, TokenThroughput
from lightalign.callbacks.throughput import training_flops_per_token
from lightalign.modules.sft import sft_loss


@pytest.fixture(scope="module")
def examples(repo):
    spec = importlib.util.spec_from_file_location("customize", repo / "examples" / "customize.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["customize"] = module  # so YAML/CLI class paths `customize.X` resolve
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("customize", None)


@pytest.fixture
def sft_data(tiny_dir, data_dir):
    def make(cls=SFTDataModule, **kw):
        kw.setdefault("batch_size", 4)
        return cls(str(data_dir / "arithmetic_sft.jsonl"), tokenizer=str(tiny_dir), max_length=32, **kw)

    return make


def test_cli_model_optimizer_scheduler_and_yaml_callbacks(examples, tiny_dir, data_dir, tmp_path):
    from lightalign.cli import LightalignCLI

    cli = LightalignCLI(args=[
        "fit", "--model", "lightalign.SFTModule", "--model.model_name_or_path", str(tiny_dir), "--model.from_config", "true",
        "--model.optimizer", "torch.optim.SGD", "--model.optimizer.lr", "0.05", "--model.optimizer.momentum", "0.9",
        "--model.lr_scheduler", "torch.optim.lr_scheduler.StepLR", "--model.lr_scheduler.step_size", "1",
        "--model.lr_scheduler.gamma", "0.5",
        "--data", "lightalign.SFTDataModule", "--data.path", str(data_dir / "arithmetic_sft.jsonl"), "--data.batch_size", "4",
        "--data.max_length", "32",
        "--trainer.callbacks+=customize.StopAfterSteps", "--trainer.callbacks.steps", "3",
        "--trainer.callbacks+=customize.StepLogger",
        "--trainer.max_steps", "20", "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
        "--trainer.logger.init_args.save_dir", str(tmp_path), "--trainer.default_root_dir", str(tmp_path), "--export.enabled", "false",
        "--checkpoint.save_last", "false",
    ])
    trainer = cli.trainer
    optimizer = trainer.optimizers[0]
    assert type(optimizer) is torch.optim.SGD and optimizer.defaults["momentum"] == 0.9
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == {id(p) for p in cli.model.model.parameters()}
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05 * 0.5**3)  # StepLR stepped once per optimizer step
    assert trainer.global_step == 3  # StopAfterSteps(3) from YAML stopped a max_steps=20 run
    logger = next(cb for cb in trainer.callbacks if type(cb).__name__ == "StepLogger")
    assert [step for step, _ in logger.history] == [1, 2, 3] and all(math.isfinite(v) for _, v in logger.history)


class CraftedMetric(SFTModule):
    """Logs a crafted val/score per epoch: best at epoch 1, then worse."""

    SCORES = [1.0, 0.5, 0.55, 0.52, 0.4, 0.3]

    def on_validation_epoch_end(self):
        super().on_validation_epoch_end()
        if not self.trainer.sanity_checking:
            self.log("val/score", self.SCORES[self.current_epoch])


def test_early_stopping_on_a_logged_metric(tiny_dir, sft_data, quiet_trainer, data_dir):
    stop = EarlyStopping(monitor="val/score", mode="min", patience=2, min_delta=0.01)
    trainer = quiet_trainer(max_steps=-1, max_epochs=6, limit_train_batches=1, limit_val_batches=1, callbacks=[stop])
    data = sft_data(val_path=str(data_dir / "arithmetic_sft_val.jsonl"))
    trainer.fit(CraftedMetric(str(tiny_dir), from_config=True), data)
    # epoch 1 is the best (0.5); epochs 2 and 3 do not improve by min_delta -> stops after epoch 3 (of 6)
    assert stop.stopped_epoch == 3 and trainer.current_epoch == 4 and trainer.global_step == 4
    assert stop.best_score.item() == pytest.approx(0.5)


def test_device_cache_throughput_mfu_and_lr(tiny_dir, sft_data, quiet_trainer):
    cache = DeviceCacheCleanup(every_n_steps=2)
    seen = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("train/")})

    throughput = TokenThroughput(peak_flops=1e12)
    module = SFTModule(str(tiny_dir), from_config=True, learning_rate=1e-3, warmup_steps=2, lr_scheduler_type="constant")
    quiet_trainer(max_steps=5, callbacks=[cache, throughput, Record()]).fit(module, sft_data())
    assert cache.cleanups == 2 and cache.freed == 0  # steps 2 and 4; nothing to free on CPU
    params = sum(p.numel() for p in module.model.parameters())
    cfg = module.model.config
    for m in seen:
        seq = m["train/tokens_per_sec"] / m["train/samples_per_sec"]
        expected = training_flops_per_token(params, cfg.num_hidden_layers, cfg.hidden_size, seq) * m["train/tokens_per_sec"]
        assert m["train/tflops_per_sec"] * 1e12 == pytest.approx(expected, rel=1e-4)
        assert m["train/mfu"] == pytest.approx(expected / 1e12, rel=1e-4)
    assert [m["train/lr"] for m in seen] == pytest.approx([0.0, 5e-4, 1e-3, 1e-3, 1e-3])  # the lr each step used
    assert training_flops_per_token(10) == 60 and training_flops_per_token(10, 2, 4, 8.0) == 60 + 12 * 2 * 4 * 8


@pytest.mark.parametrize("precision,dtype", [("bf16-true", torch.bfloat16), ("bf16-mixed", torch.float32)])
def test_precision_on_cpu(tiny_dir, sft_data, quiet_trainer, precision, dtype):
    losses, dtypes = [], set()

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))
            dtypes.update(p.dtype for p in pl_module.model.parameters())

    trainer = quiet_trainer(max_steps=2, precision=precision, callbacks=[Record()])
    trainer.fit(SFTModule(str(tiny_dir), from_config=True, learning_rate=1e-3), sft_data())
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)
    assert dtypes == {dtype}


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_bf16_mixed_steps_with_the_fused_adamw_and_still_clips(tiny_dir, sft_data, quiet_trainer, algorithm):
    """bf16 autocast has no loss scaler, so the fused AdamW is used there too (one kernel instead of a per-tensor
    loop: SFT on the `small` model, median step 1.05 -> 0.92 s here); the gradients it steps on are clipped, by lightalign's
    cached norms (``norm``) or by the base precision plugin (``value``, which Lightning's ``MixedPrecision`` refuses
    for a fused optimizer). Mutations: clipping skipped under bf16-mixed -> the bounds fail; ``fused_adamw_applies``
    refusing bf16-mixed -> not fused."""
    import lightning as L

    seen = []

    class Watch(L.Callback):
        def on_train_start(self, trainer, pl_module):
            opt = trainer.optimizers[0]
            seen.append(all(g["fused"] for g in opt.param_groups))

            def after_step(optimizer, args, kwargs):  # the closure (backward, clipping) ran inside the step
                grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
                seen.append((torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])),
                             max(g.abs().max() for g in grads)))

            opt.register_step_post_hook(after_step)

    clip = 1e-3  # far under this model's gradient norm (~1-10) and largest entries (~0.1-1): every step clips
    trainer = quiet_trainer(max_steps=2, precision="bf16-mixed", gradient_clip_val=clip,
                            gradient_clip_algorithm=algorithm, callbacks=[Watch()])
    trainer.fit(SFTModule(str(tiny_dir), from_config=True, learning_rate=1e-3), sft_data())
    assert seen[0] is True and len(seen) == 3, seen
    for norm, largest in seen[1:]:
        if algorithm == "norm":
            assert float(norm) <= clip * (1 + 1e-4), float(norm)
        else:
            assert float(largest) <= float(torch.tensor(clip)) and float(norm) > clip, (float(largest), float(norm))


def test_neftune_noise_in_train_only_and_restored(tiny_model):
    ids = torch.randint(0, 1024, (2, 10), generator=torch.Generator().manual_seed(0))
    embed = tiny_model.get_input_embeddings()
    clean = embed(ids).detach()
    neft = NEFTune(tiny_model, noise_alpha=5.0).attach()
    embed.train()
    noisy = embed(ids).detach()
    bound = 5.0 / math.sqrt(10 * clean.shape[-1])
    assert not torch.equal(noisy, clean) and (noisy - clean).abs().max() <= bound + 1e-6
    embed.eval()
    assert torch.equal(embed(ids), clean)  # eval: no noise
    neft.detach()
    embed.train()
    assert torch.equal(embed(ids), clean) and not embed._forward_hooks  # original forward back


def test_neftune_through_fit(tiny_dir, sft_data, quiet_trainer):
    hooked = []

    class Record(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            hooked.append(len(pl_module.model.get_input_embeddings()._forward_hooks))

    module = SFTModule(str(tiny_dir), from_config=True, neftune_noise_alpha=5.0)
    quiet_trainer(max_steps=2, callbacks=[Record()]).fit(module, sft_data())
    assert hooked == [1, 1] and not module.model.get_input_embeddings()._forward_hooks
    with pytest.raises(ValueError, match="neftune_noise_alpha must be > 0"):
        SFTModule(str(tiny_dir), from_config=True, neftune_noise_alpha=0)


def test_torch_compile_gives_the_eager_loss(tiny_dir):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tiny_dir)
    config.num_hidden_layers, config.layer_types = 1, config.layer_types[:1]
    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(config)
    # aot_eager traces forward and backward through dynamo + AOTAutograd; inductor's C++ codegen alone takes
    # minutes on this CPU, so the test leaves it to users (torch_compile: true).
    module = SFTModule(model=copy.deepcopy(eager), torch_compile={"backend": "aot_eager", "dynamic": False})
    assert module.model._compiled_call_impl is not None
    assert list(module.model.state_dict()) == list(eager.state_dict())  # names unchanged: checkpoints, export
    ids = torch.randint(1, 1024, (2, 12), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    loss_c, _ = sft_loss(module._logits(batch), ids)
    loss_e, _ = sft_loss(eager(input_ids=ids, attention_mask=batch["attention_mask"], use_cache=False).logits, ids)
    loss_c.backward()
    loss_e.backward()
    assert loss_c.item() == pytest.approx(loss_e.item(), rel=1e-5)
    q_c = module.model.model.layers[0].self_attn.q_proj.weight.grad
    assert torch.allclose(q_c, eager.model.layers[0].self_attn.q_proj.weight.grad, atol=1e-5)


def test_liger_kernel_says_what_is_missing(tiny_model, monkeypatch):
    monkeypatch.setitem(sys.modules, "liger_kernel", None)
    with pytest.raises(ImportError, match=r"lightalign\[liger\]"):
        SFTModule(model=tiny_model, use_liger_kernel=True)
    if torch.cuda.is_available():
        return
    fake = types.ModuleType("liger_kernel.transformers")
    fake._apply_liger_kernel_to_instance = lambda model: pytest.fail("must not patch without a GPU")
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", fake)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        SFTModule(model=tiny_model, use_liger_kernel=True)


@pytest.mark.gpu
def test_liger_kernel_on_gpu(tiny_dir, sft_data):
    pytest.importorskip("liger_kernel")
    module = SFTModule(str(tiny_dir), from_config=True, use_liger_kernel=True)
    trainer = L.Trainer(accelerator="gpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False)
    trainer.fit(module, sft_data())
    assert math.isfinite(float(trainer.callback_metrics["train/loss"]))


# --------------------------------------------------------------------------------------------- subclassing points
def test_override_the_loss_only(examples, tiny_model, tokenizer):
    ids = tokenizer(["12+7=19", "3+4=7"], return_tensors="pt", padding=True)
    labels = ids["input_ids"].masked_fill(ids["attention_mask"] == 0, -100)
    batch = {**ids, "labels": labels}
    plain = SFTModule(model=tiny_model)
    logits = plain._logits(batch)
    base, base_stats = plain.compute_loss(logits, batch)
    same, _ = examples.WeightedTokenSFT(model=tiny_model).compute_loss(logits, batch)
    assert same.item() == pytest.approx(base.item(), rel=1e-6)
    tok = int(labels[0, 1])  # a target token: doubling its weight adds exactly its NLL(s) / num_tokens
    weighted, stats = examples.WeightedTokenSFT(model=tiny_model, token_weights={tok: 2.0}).compute_loss(logits, batch)
    logp = torch.log_softmax(logits[:, :-1].float(), -1)
    target = labels[:, 1:]
    hit = target == tok
    extra = -logp[hit].gather(-1, target[hit].unsqueeze(-1)).sum() / base_stats["num_tokens"]
    assert weighted.item() == pytest.approx(base.item() + extra.item(), rel=1e-5)
    assert torch.equal(stats["num_tokens"], base_stats["num_tokens"])  # logged stats untouched


def test_override_optimizer_step_hook_and_dataloader(examples, tiny_dir, sft_data, quiet_trainer):
    class Module(examples.SGDSFT, examples.GradNormSFT):
        pass

    sizes, grad_norms = [], []

    class Record(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            sizes.append(((batch["labels"][:, 1:] != -100).sum(1)).tolist())

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            grad_norms.append(float(trainer.callback_metrics["train/grad_norm"]))

    module = Module(str(tiny_dir), from_config=True, learning_rate=0.1, warmup_steps=2, lr_scheduler_type="constant")
    trainer = quiet_trainer(max_steps=3, callbacks=[Record()])
    trainer.fit(module, sft_data(examples.MinTargetsSFTData, min_targets=4, batch_size=8))
    assert type(trainer.optimizers[0]) is torch.optim.SGD  # create_optimizer overridden ...
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1)  # ... the warmup schedule kept (step 2 of 2)
    assert len(grad_norms) == 3 and all(g > 0 for g in grad_norms)  # the per-step hook logged
    assert "train/loss" in trainer.callback_metrics  # ... without losing the module's own logging
    assert sizes and all(n >= 4 for row in sizes for n in row)  # the collator changed the batch composition
    assert any(len(row) < 8 for row in sizes)  # (2/3 of the rows have fewer than 4 targets)


def test_grpo_eval_metrics_see_the_rewards(grpo_module, prompt_data, data_dir, quiet_trainer):
    module = grpo_module(eval_metrics={"mean_reward": lambda rewards, target: rewards.mean()})
    data = prompt_data(val_path=str(data_dir / "arithmetic_prompts.jsonl"), batch_size=4)
    logged = quiet_trainer(limit_val_batches=1).validate(module, datamodule=data)[0]
    assert logged["val/mean_reward"] == pytest.approx(logged["val/reward/mean"], abs=1e-6)
