"""Knobs DPO and GRPO (and SFT, where TRL has them) share, implemented once in PolicyModule: disable_dropout,
router_aux_loss_coef, activation_offloading, sync_ref_model with ref_model_mixup_alpha / ref_model_sync_steps."""

from __future__ import annotations

import contextlib

import lightning as L
import pytest
import torch

from helpers.conformance_models import build
from lightalign import DPOModule, GRPOModule, SFTModule
from lightalign.callbacks.reference_sync import ReferenceSync
from lightalign.modules.training.activation_offload import activation_offload_context
from lightalign.modules.reference.sync import mix_into_reference

ROWS = [  # hand-made token ids: (prompt, chosen, rejected)
    {"prompt_input_ids": [5, 6, 7], "chosen_input_ids": [8, 9], "rejected_input_ids": [10, 11, 12]},
    {"prompt_input_ids": [13], "chosen_input_ids": [14, 15, 16, 17], "rejected_input_ids": [18]},
]


def _classic_batch():
    from lightalign.datamodules.preference import PreferenceCollator

    return PreferenceCollator(pad_token_id=0)(ROWS)


# ----------------------------------------------------------------------------------------------- dropout
def _dropout_model():
    from transformers import AutoConfig, AutoModelForCausalLM

    from helpers.conformance_models import FAMILIES

    _, kwargs = FAMILIES["llama"]
    config = AutoConfig.for_model("llama", **dict(kwargs, attention_dropout=0.5))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.model.layers[0].mlp.extra = torch.nn.Dropout(0.5)  # an nn.Dropout module too (not on the forward path)
    return model


def _two_train_forwards_agree(model) -> bool:
    ids = torch.arange(3, 11).view(1, 8)
    model.train()
    torch.manual_seed(1)
    a = model(input_ids=ids).logits
    torch.manual_seed(2)
    b = model(input_ids=ids).logits
    return torch.equal(a, b)


def test_disable_dropout_defaults_follow_trl():
    assert not _two_train_forwards_agree(_dropout_model())  # the model does drop attention weights in training
    dpo = DPOModule(model=_dropout_model())  # TRL's DPO default: on
    assert _two_train_forwards_agree(dpo.model)
    assert dpo.model.model.layers[0].mlp.extra.p == 0.0
    assert all(layer.self_attn.attention_dropout == 0.0 for layer in dpo.model.model.layers)
    kept = DPOModule(model=_dropout_model(), disable_dropout=False)
    assert not _two_train_forwards_agree(kept.model)
    sft = SFTModule(model=_dropout_model())  # SFT and GRPO (TRL's default off) keep the model's dropout
    assert not _two_train_forwards_agree(sft.model)
    assert _two_train_forwards_agree(SFTModule(model=_dropout_model(), disable_dropout=True).model)


# ----------------------------------------------------------------------------------------------- MoE aux loss
def test_router_aux_loss_is_added_with_its_coefficient():
    model = build("mixtral")
    batch = _classic_batch()
    module = DPOModule(model=model, reference_free=True, router_aux_loss_coef=0.5)
    module.check_model_layout()  # fit start: the classic layout without a trainer
    assert "router load-balancing loss x 0.5" in module.adaptations.notes
    model.train()
    module.model.zero_grad()
    total = module.training_step(batch, 0)
    total.backward()
    grad_total = model.model.layers[0].mlp.gate.weight.grad.clone()

    model.zero_grad()
    dpo_only = module._step(batch, module.train_stats)
    assert module.router_aux.take() is not None  # the forward's aux loss was collected ...
    dpo_only.backward()
    grad_dpo = model.model.layers[0].mlp.gate.weight.grad.clone()
    model.zero_grad()
    aux = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_router_logits=True).aux_loss
    aux.backward()
    grad_aux = model.model.layers[0].mlp.gate.weight.grad.clone()

    assert total.item() == pytest.approx(dpo_only.item() + 0.5 * aux.item(), abs=1e-6)
    torch.testing.assert_close(grad_total, grad_dpo + 0.5 * grad_aux, atol=1e-6, rtol=1e-5)
    module.router_aux.take()  # (the hand forward above was collected too)
    with torch.no_grad():  # reference / generation / evaluation forwards are not collected, even asked for it
        model(input_ids=batch["input_ids"], output_router_logits=True)
    assert module.router_aux.take() is None


def test_router_aux_loss_default_coefficient_and_refusals():
    model = build("mixtral")
    module = DPOModule(model=model, reference_free=True)  # null: the config's coefficient
    module.check_model_layout()
    assert module.router_aux.coef == model.config.router_aux_loss_coef > 0
    off = DPOModule(model=build("mixtral"), reference_free=True, router_aux_loss_coef=0.0)
    off.check_model_layout()
    assert off.router_aux is None
    with pytest.raises(ValueError, match="router_aux_loss_coef=0.1 but .* is not a Mixture-of-Experts"):
        DPOModule(model=build("llama"), router_aux_loss_coef=0.1).check_model_layout()
    with pytest.raises(ValueError, match="router_aux_loss_coef must be >= 0"):
        DPOModule(model=build("mixtral"), router_aux_loss_coef=-1.0)
    from lightalign.modules.losses.router_aux import attach_router_aux_loss

    with pytest.raises(ValueError, match="needs a padded layout.*'dpo_shared'"):
        attach_router_aux_loss(build("mixtral"), 0.1, "dpo_shared")
    collector, note = attach_router_aux_loss(build("mixtral"), None, "dpo_shared")
    assert collector is None and "router load-balancing loss off" in note


# ----------------------------------------------------------------------------------------------- offloading
def test_activation_offloading_up_to_the_gpu_boundary(tiny_model):
    on_gpu = activation_offload_context(True, torch.device("cuda", 0))
    assert isinstance(on_gpu, torch.autograd.graph.save_on_cpu)
    assert isinstance(activation_offload_context(False, torch.device("cuda", 0)), contextlib.nullcontext)
    assert isinstance(activation_offload_context(True, torch.device("cpu")), contextlib.nullcontext)
    module = DPOModule(model=tiny_model, activation_offloading=True)
    module.check_model_layout()
    assert any("activation_offloading has no effect on device 'cpu'" in n for n in module.adaptations.notes)


# ----------------------------------------------------------------------------------------------- sync_ref_model
def test_mix_into_reference_by_hand(tiny_model):
    import copy

    ref = copy.deepcopy(tiny_model)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(1.0)
    before = {n: p.clone() for n, p in ref.named_parameters()}
    policy = dict(tiny_model.named_parameters())
    assert mix_into_reference(tiny_model, ref, 0.25) == len(before)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(p, 0.25 * policy[name] + 0.75 * before[name])


def test_sync_ref_model_refusals(tiny_model, tiny_dir):
    cases = [
        (lambda: DPOModule(model=tiny_model, sync_ref_model=True, precompute_ref_log_probs=True), "stale"),
        (lambda: DPOModule(model=tiny_model, sync_ref_model=True, reference_free=True), "reference_free"),
        (lambda: DPOModule(model=tiny_model, sync_ref_model=True, peft_config={"r": 4}), "LoRA"),
        (lambda: DPOModule(str(tiny_dir), from_config=True, sync_ref_model=True,
                           ref_model_init_kwargs={"quantization_config": {"load_in_8bit": True}}), "quantized"),
        (lambda: GRPOModule(model=tiny_model, reward_funcs=[len], sync_ref_model=True), "beta=0"),
        (lambda: DPOModule(model=tiny_model, ref_model_mixup_alpha=1.5), "ref_model_mixup_alpha must lie in"),
        (lambda: DPOModule(model=tiny_model, ref_model_sync_steps=0), "ref_model_sync_steps must be an integer"),
    ]
    for make, message in cases:
        with pytest.raises(ValueError, match=message):
            make()
    with pytest.raises(TypeError, match="SFTModule has no knob 'sync_ref_model'; DPOModule, GRPOModule, KTOModule, "
                                        "PPOModule and RLOOModule take it"):  # a method without a reference
        SFTModule(model=tiny_model, sync_ref_model=True)


def test_sync_happens_every_n_optimizer_steps(tiny_dir, data_dir, tmp_path):
    import json

    from datasets import Dataset

    from lightalign import PreferenceDataModule

    lines = (data_dir / "arithmetic_preference.jsonl").read_text().splitlines()[:16]
    data = PreferenceDataModule(Dataset.from_list([json.loads(x) for x in lines]), tokenizer=str(tiny_dir),
                                batch_size=2)
    module = DPOModule(str(tiny_dir), from_config=True, learning_rate=1e-2, sync_ref_model=True,
                       ref_model_mixup_alpha=0.5, ref_model_sync_steps=2)

    class Watch(L.Callback):
        """Before each micro-batch: the reference equals the expected mix of the policy snapshots."""

        def __init__(self):
            self.expected, self.checked = None, 0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            ref = dict(pl_module.ref_model.named_parameters())
            if self.expected is None:
                self.expected = {n: p.detach().clone() for n, p in pl_module.model.named_parameters()}
            for name, value in self.expected.items():
                torch.testing.assert_close(ref[name], value, atol=1e-6, rtol=0)
            self.checked += 1

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            # accumulation 2: an optimizer step every second micro-batch; a sync after steps 2 and 4
            if batch_idx % 2 == 1 and trainer.global_step % 2 == 0:
                for name, p in pl_module.model.named_parameters():
                    self.expected[name] = 0.5 * p.detach() + 0.5 * self.expected[name]

    watch = Watch()
    trainer = L.Trainer(accelerator="cpu", max_steps=4, accumulate_grad_batches=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[watch])
    trainer.fit(module, data)
    assert watch.checked == 8
    sync = next(c for c in trainer.callbacks if isinstance(c, ReferenceSync))
    assert sync.syncs == 2 and sync.last_step == 4
    assert "reference" in sync.state_dict()
