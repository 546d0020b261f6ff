"""PPOModule: the rollout's returns, gradients of the two losses, accumulation, bad input, exact resume, the console
script and its export (policy folder + value head)."""

import csv
import json

from helpers import console_script
from helpers.rollout_callbacks import KeepBuffer, PerturbPolicy
from helpers.rewards import Recorder, varied_reward
import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightalign.modules.ppo import PPOModule
from lightalign.rewards import RewardFunctionError


def ppo(tiny_dir, **kw):
    kw.setdefault("reward_funcs", [varied_reward])
    kw.setdefault("max_completion_length", 6)
    kw.setdefault("learning_rate", 1e-3)
    kw.setdefault("generation_batch_size", 8)
    return PPOModule(str(tiny_dir), from_config=True, **kw)


def varied_lengths(module):
    """Completions of 1..6 tokens (the random tiny model rarely samples EOS): micro-batches then hold different
    token counts, which the accumulation check needs."""
    original = module.generate

    def generate(batch, num_generations):
        out = original(batch, num_generations)
        mask = out["completion_mask"]
        for i in range(mask.shape[0]):
            mask[i, i % mask.shape[1] + 1:] = 0
        return out

    module.generate = generate
    return module


def in_rollout_order(buffer, key):
    rows = torch.cat([mb["row"] for mb in buffer])
    return torch.cat([mb[key] for mb in buffer])[torch.argsort(rows)]


def test_returns_are_the_score_minus_the_kl_to_go(tiny_dir, quiet_trainer, prompt_data):
    # gamma = lam = 1: the return of token t is the reward summed from t to the end, i.e. the completion's score
    # minus kl_coef times its per-token KL summed from t on
    recorder, keep = Recorder(), KeepBuffer()
    module = varied_lengths(ppo(tiny_dir, reward_funcs=[recorder], kl_coef=0.5, gamma=1.0, lam=1.0))
    quiet_trainer(max_steps=1, callbacks=[keep, PerturbPolicy()]).fit(module, prompt_data())
    buffer = keep.buffers[0]
    mask = in_rollout_order(buffer, "completion_mask").float()
    kl = (in_rollout_order(buffer, "old_logps") - in_rollout_order(buffer, "ref_logps")) * mask
    assert kl.abs().sum() > 1e-2
    kl_to_go = kl.flip(-1).cumsum(-1).flip(-1)
    expected = (recorder.rewards[0][:, None] - 0.5 * kl_to_go) * mask
    torch.testing.assert_close(in_rollout_order(buffer, "returns"), expected, atol=1e-5, rtol=1e-5)
    advantages = in_rollout_order(buffer, "advantages")
    assert abs(float(advantages[mask.bool()].mean())) < 1e-5  # whitened over the rollout's tokens
    assert (advantages[~mask.bool()] == 0).all()


def one_step_grads(tiny_dir, quiet_trainer, prompt_data, grad_capture, accumulate=1, **kw):
    L.seed_everything(0)
    module = varied_lengths(ppo(tiny_dir, optimizer=lambda p: torch.optim.SGD(p, lr=0.0), **kw))
    capture = grad_capture()
    quiet_trainer(max_steps=1, accumulate_grad_batches=accumulate, callbacks=[capture]).fit(module, prompt_data())
    return capture.grads[0]


def test_gradients_reach_value_head_and_policy_scaled_by_vf_coef(tiny_dir, quiet_trainer, prompt_data, grad_capture):
    head = "value_head.summary.weight"
    base = one_step_grads(tiny_dir, quiet_trainer, prompt_data, grad_capture, vf_coef=0.1)
    double = one_step_grads(tiny_dir, quiet_trainer, prompt_data, grad_capture, vf_coef=0.2)
    off = one_step_grads(tiny_dir, quiet_trainer, prompt_data, grad_capture, vf_coef=0.0)
    assert base[head].abs().sum() > 0 and base["value_head.summary.bias"].abs().sum() > 0
    assert any(n.startswith("model.") and g.abs().sum() > 0 for n, g in base.items())
    torch.testing.assert_close(double[head], 2 * base[head], atol=1e-7, rtol=1e-5)  # only the value loss reaches it
    assert head not in off and "value_head.summary.bias" not in off  # vf_coef 0: no value-head gradient
    assert any(n.startswith("model.") and g.abs().sum() > 0 for n, g in off.items())
    # the value loss also trains the shared trunk (the head reads its hidden states, not a detached copy)
    assert any(not torch.allclose(base[n], off[n]) for n in off if n.startswith("model."))


def test_separate_value_model_takes_the_value_loss_alone(tiny_dir, quiet_trainer, prompt_data, grad_capture):
    kw = {"value_model_name_or_path": str(tiny_dir)}
    base = one_step_grads(tiny_dir, quiet_trainer, prompt_data, grad_capture, vf_coef=0.1, **kw)
    double = one_step_grads(tiny_dir, quiet_trainer, prompt_data, grad_capture, vf_coef=0.2, **kw)
    value_params = [n for n in base if n.startswith("value_model.")]
    assert value_params and all(torch.allclose(double[n], 2 * base[n], atol=1e-7, rtol=1e-4) for n in value_params)
    policy = [n for n in base if n.startswith("model.")]
    assert policy and any(base[n].abs().sum() > 0 for n in policy)
    for name in policy:  # the value loss no longer reaches the policy
        torch.testing.assert_close(double[name], base[name], atol=0, rtol=0, msg=name)


def test_accumulation_2x4_equals_1x8(tiny_dir, quiet_trainer, prompt_data, grad_capture):
    full = one_step_grads(tiny_dir, quiet_trainer, prompt_data, grad_capture, accumulate=1)
    accum = one_step_grads(tiny_dir, quiet_trainer, prompt_data, grad_capture, accumulate=2)
    assert full.keys() == accum.keys() and "value_head.summary.weight" in full
    for name in full:
        torch.testing.assert_close(accum[name], full[name], atol=1e-6, rtol=1e-5, msg=name)


def test_bad_knobs_refused(tiny_dir, tmp_path):
    for kw, message in [({"kl_coef": -0.1}, "kl_coef must be >= 0"),
                        ({"num_ppo_epochs": 0}, "num_ppo_epochs must be >= 1"),
                        ({"num_mini_batches": 0}, "num_mini_batches must be >= 1"),
                        ({"use_score_norm": True}, "set use_score_scaling true"),
                        ({"stop_token": None}, "stop_token=None is not supported"),
                        ({"lam": 1.5}, r"lam must be in \[0, 1\]"),
                        ]:
        with pytest.raises(ValueError, match=message):
            ppo(tiny_dir, **kw)
    for knob in ("beta", "epsilon", "num_iterations", "padding_free", "loss_type"):  # GRPO's: not PPO knobs at all
        with pytest.raises(TypeError, match=knob):
            ppo(tiny_dir, **{knob: 1})
    odd = tmp_path / "odd"
    odd.mkdir()
    config = json.loads((tiny_dir / "config.json").read_text())
    del config["hidden_size"]
    config["architectures"] = ["OddForCausalLM"]
    (odd / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"cannot find the hidden size of model '.*odd'.*OddForCausalLM"):
        PPOModule(str(odd), from_config=True, reward_funcs=[varied_reward])


class Constant:
    def __init__(self, value):
        self.value, self.__name__ = value, "constant"

    def __call__(self, prompts, completions, **kwargs):
        return [self.value] * len(completions)


@pytest.mark.parametrize("value, message", [(float("inf"), "'constant' returned inf at index 0"),
                                            (None, r"reward function\(s\) \['constant'\] returned None")])
def test_non_finite_scores_refused_naming_the_function(value, message, tiny_dir, quiet_trainer, prompt_data):
    module = ppo(tiny_dir, reward_funcs=[Constant(value)])
    with pytest.raises((ValueError, RewardFunctionError), match=message):
        quiet_trainer(max_steps=1).fit(module, prompt_data())


def test_reward_folder_without_score_head_refused(tiny_dir, tiny_model, tokenizer, tmp_path):
    folder = tmp_path / "causal_lm"  # a causal LM folder, not a sequence-classification one
    tiny_model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    with pytest.raises(ValueError, match=r"has no score head \(its config.json names \['Qwen2ForCausalLM'\]\)"):
        ppo(tiny_dir, reward_funcs=[str(folder)])  # at construction, from config.json: before any model loads


def test_reward_model_folder_scores_the_rollout(tiny_dir, tokenizer, tmp_path, quiet_trainer, prompt_data):
    from transformers import AutoConfig, AutoModelForSequenceClassification

    folder = tmp_path / "reward_model"  # a sequence-classification folder, as RewardModule exports
    config = AutoConfig.from_pretrained(tiny_dir, num_labels=1)
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    keep = KeepBuffer()
    module = ppo(tiny_dir, reward_funcs=[str(folder)])
    quiet_trainer(max_steps=1, callbacks=[keep]).fit(module, prompt_data())
    scores = [float(r["reward"]) for r in module.last_samples]
    assert len(set(scores)) > 1 and all(torch.isfinite(torch.tensor(scores)))
    mask = in_rollout_order(keep.buffers[0], "completion_mask").float()
    returns = in_rollout_order(keep.buffers[0], "returns")  # gamma 1, kl 0 at the first rollout: the score
    last = mask.sum(-1).long() - 1
    torch.testing.assert_close(returns[torch.arange(len(scores)), last], torch.tensor(scores), atol=1e-5, rtol=1e-5)


def test_every_pass_deals_the_rollout_into_new_mini_batches(tiny_dir, quiet_trainer, prompt_data):
    """num_ppo_epochs 3 x num_mini_batches 2 on one rollout of 8: each pass holds every completion once, with its own
    data, and the passes split the rollout differently (TRL reshuffles each pass)."""
    keep = KeepBuffer()
    torch.manual_seed(0)
    module = ppo(tiny_dir, num_ppo_epochs=3, num_mini_batches=2)
    quiet_trainer(max_steps=6, callbacks=[keep]).fit(module, prompt_data())
    assert module.generation_count == 1 and len(keep.buffers) == 3  # one rollout, a new order per pass
    splits = []
    for buffer in keep.buffers:
        assert len(buffer) == 2 and sorted(torch.cat([mb["row"] for mb in buffer]).tolist()) == list(range(8))
        splits.append(frozenset(buffer[0]["row"].tolist()))
        for key in ("advantages", "returns", "old_values", "old_logps", "completion_ids"):  # rows keep their data
            torch.testing.assert_close(in_rollout_order(buffer, key), in_rollout_order(keep.buffers[0], key),
                                       atol=0, rtol=0)
    assert len(set(splits)) > 1, splits


# ------------------------------------------------------------------------------ reference modes (kl_coef > 0)
def _first_chunk_ref_and_policy(module, keep):
    """The first rollout's first micro-batch: its stored reference and sampling-policy log-probs, and the reference
    log-probs recomputed now (the reference is frozen, so they must not have moved with training)."""
    mb = keep.buffers[0][0]
    if module.ref_model is not None:
        again, _ = module.token_logps(module.ref_model, mb)
    else:
        with module.model.disable_adapter():
            again, _ = module.token_logps(module.model, mb)
    mask = mb["completion_mask"].bool()
    return mb["ref_logps"][mask], mb["old_logps"][mask], again[mask]


def test_shared_layer_reference_shares_and_freezes_the_first_layers(tiny_dir, quiet_trainer, prompt_data):
    from lightalign.modules.reference.model import shared_parameter_names

    keep = KeepBuffer()
    torch.manual_seed(0)
    module = ppo(tiny_dir, kl_coef=0.1, num_shared_layers=2, num_ppo_epochs=1)
    quiet_trainer(max_steps=2, callbacks=[PerturbPolicy(), keep]).fit(module, prompt_data())
    shared = set(shared_parameter_names(module.model, 2))
    ref = dict(module.ref_model.named_parameters())
    assert any(".layers.1." in n for n in shared) and not any(".layers.2." in n for n in shared)
    for name, param in module.model.named_parameters():
        if name in shared:  # one tensor, frozen in both
            assert param is ref[name] and not param.requires_grad, name
        elif name in ref:
            assert param.data_ptr() != ref[name].data_ptr() and param.requires_grad and not ref[name].requires_grad
    stored, policy, again = _first_chunk_ref_and_policy(module, keep)
    torch.testing.assert_close(stored, again, atol=1e-6, rtol=0)
    assert (stored - policy).abs().max() > 1e-3  # the perturbed policy's own layers differ from the reference's


def test_lora_reference_is_the_base_model_with_the_adapters_disabled(tiny_dir, quiet_trainer, prompt_data):
    class PerturbAdapters(L.Callback):
        def on_fit_start(self, trainer, pl_module):
            torch.manual_seed(1)
            with torch.no_grad():
                for name, p in pl_module.model.named_parameters():
                    if "lora_" in name:
                        p.add_(torch.randn_like(p) * 0.3)

    keep = KeepBuffer()
    torch.manual_seed(0)
    module = ppo(tiny_dir, kl_coef=0.1, num_ppo_epochs=1, peft_config={"r": 4, "lora_alpha": 8, "target_modules": "all-linear"})
    quiet_trainer(max_steps=2, callbacks=[PerturbAdapters(), keep]).fit(module, prompt_data())
    assert module.ref_model is None  # no copy: the base weights under the adapters are the reference
    stored, policy, again = _first_chunk_ref_and_policy(module, keep)
    torch.testing.assert_close(stored, again, atol=1e-6, rtol=0)
    assert (stored - policy).abs().max() > 1e-3  # the adapters were on for the policy, off for the reference


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_reference_is_a_separate_quantized_copy(bits, tiny_dir, tiny_model, tokenizer, quiet_trainer,
                                                          prompt_data, tmp_path):
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("accelerate")
    tiny_model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    qc = {"load_in_8bit": True} if bits == 8 else {"load_in_4bit": True, "bnb_4bit_compute_dtype": "float32"}
    keep = KeepBuffer()
    torch.manual_seed(0)
    module = PPOModule(str(tmp_path / "m"), reward_funcs=[varied_reward], max_completion_length=6, learning_rate=1e-3,
                       generation_batch_size=8, kl_coef=0.1, num_ppo_epochs=1,
                       ref_model_init_kwargs={"quantization_config": qc})
    quiet_trainer(max_steps=1, callbacks=[keep]).fit(module, prompt_data())
    assert getattr(module.ref_model, f"is_loaded_in_{bits}bit")
    ref_bytes = sum(p.numel() * p.element_size() for p in module.ref_model.parameters())
    assert ref_bytes < sum(p.numel() * p.element_size() for p in module.model.parameters())
    stored, policy, again = _first_chunk_ref_and_policy(module, keep)
    torch.testing.assert_close(stored, again, atol=1e-5, rtol=0)
    # the same weights, quantized: close to the (unperturbed) policy's log-probs, not equal to them
    gap = (stored - policy).abs().max()
    assert 0 < gap < 0.5, gap


def test_a_rollout_that_does_not_split_into_the_mini_batches_is_refused_at_construction(tiny_dir):
    """``generation_batch_size`` (``RolloutKnobs``) against ``num_mini_batches`` (``PPOScheduleKnobs``): a check across
    two groups, before any model loads. Mutation: drop it from ``check_knob_combinations`` -> this builds."""
    with pytest.raises(ValueError, match=r"generation_batch_size \(3\) must split evenly into num_mini_batches \(2\)"):
        ppo(tiny_dir, generation_batch_size=3, num_mini_batches=2)
    assert ppo(tiny_dir, generation_batch_size=4, num_mini_batches=2).model is None


def test_shared_layers_refused_where_they_cannot_apply(tiny_dir):
    for kw, message in [({"num_shared_layers": 0}, "num_shared_layers must be >= 1"),
                        ({"num_shared_layers": 1, "kl_coef": 0.0}, "kl_coef 0 uses none"),
                        ({"num_shared_layers": 1, "ref_model_init_kwargs": {"dtype": "float32"}}, "separately loaded"),
                        ({"num_shared_layers": 1, "peft_config": {"r": 4}}, "LoRA policy")]:
        with pytest.raises(ValueError, match=message):
            ppo(tiny_dir, **kw)


def _fit(tiny_dir, prompt_data, max_steps, ckpt_dir=None, ckpt_path=None):
    L.seed_everything(3)
    module = ppo(tiny_dir, kl_coef=0.2, adap_kl_ctrl=True, target=0.01, horizon=20, use_score_scaling=True,
                 use_score_norm=True, num_ppo_epochs=2, num_mini_batches=2, learning_rate=1e-2)
    callbacks = [PerturbPolicy()] if ckpt_path is None else []
    if ckpt_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=1, save_top_k=-1))
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, max_steps=max_steps, callbacks=callbacks,
                        enable_checkpointing=ckpt_dir is not None)
    trainer.fit(module, prompt_data(), ckpt_path=ckpt_path)
    return module


def test_resume_inside_a_rollout_equals_uninterrupted(tiny_dir, prompt_data, tmp_path):
    # 2 passes x 2 mini-batches: 4 optimizer steps per rollout. The checkpoint at step 2 is between the first
    # rollout's passes (the resumed run deals the second pass's mini-batches with the restored RNG), the one at step 3
    # inside its second pass (the dealt order comes back from the checkpoint); the second rollout is made after the
    # resume, with the restored KL coefficient and score statistics
    full = _fit(tiny_dir, prompt_data, 6, ckpt_dir=tmp_path)
    assert full.generation_count == 2 and full.kl_ctl.value != 0.2
    for step in (2, 3):
        resumed = _fit(tiny_dir, prompt_data, 6, ckpt_path=str(tmp_path / f"epoch=0-step={step}.ckpt"))
        _assert_same_run(full, resumed)


def _assert_same_run(full, resumed):
    assert resumed.kl_ctl.value == full.kl_ctl.value
    assert resumed.score_processor.state_dict() == full.score_processor.state_dict()
    a, b = full.state_dict(), resumed.state_dict()
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=0, rtol=0, msg=name)


def test_console_fit_exports_policy_and_value_head(repo, tmp_path):
    out = console_script.run(repo, "fit", "--config", str(repo / "configs" / "ppo_quickstart.yaml"),
                             "--trainer.max_steps", "2", "--model.kl_coef", "0.05", "--model.num_ppo_epochs", "2",
                             "--model.generation_batch_size", "8", "--trainer.logger.init_args.save_dir", str(tmp_path),
                             "--plot.enabled", "false", timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = list(csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))))
    logged = {k for row in rows for k, v in row.items() if v}
    assert {"train/objective/kl", "train/objective/entropy", "train/objective/scores", "train/policy/approxkl",
            "train/policy/clipfrac", "train/val/clipfrac", "train/val/value_loss", "train/val/explained_variance",
            "train/lr", "train/completions/mean_length"} <= logged
    # num_ppo_epochs 2 (through LightningCLI's config): both optimizer steps train on the one rollout
    last = torch.load(next(tmp_path.rglob("last.ckpt")), map_location="cpu", weights_only=False)
    assert last["lightalign_rollout"]["generation_count"] == 1
    export = next(tmp_path.rglob("hf_model"))
    from transformers import AutoModelForCausalLM

    from lightalign.modules.training.value_head import load_value_head

    policy = AutoModelForCausalLM.from_pretrained(export)  # an ordinary causal-LM folder
    head = load_value_head(export)
    assert head.hidden_size == policy.config.hidden_size
    from safetensors import safe_open

    with safe_open(str(export / "model.safetensors"), "pt") as f:
        assert not [k for k in f.keys() if "value_head" in k]
