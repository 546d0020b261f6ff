"""Asynchronous rollouts (``max_staleness``): the sampling process samples ahead on the weights of the optimizer
step it claims, never more than ``max_staleness`` steps old, the importance-sampling ratio is computed from the
sampler's log-probs and reaches the loss, the prompts are the loader's, and a failing sampler is an error."""

from __future__ import annotations

import os
import signal

import lightning as L
import pytest
import torch

from helpers.rewards import varied_reward
from lightalign.modules.training.rollout_forward import grpo_forward
from lightalign.modules.rollout.offpolicy.ahead import SamplerProcessError
from lightalign.modules.losses.importance_sampling import importance_sampling_ratio

pytestmark = pytest.mark.multiprocess


class Snapshots(L.Callback):
    """The policy's weights at the start of every optimizer step (by ``global_step``)."""

    def __init__(self):
        self.weights = {}

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step not in self.weights:
            self.weights[trainer.global_step] = {k: v.detach().clone() for k, v in module.model.state_dict().items()}


def record_rollouts(module):
    """Every rollout the component hands the loop (index, the optimizer step it trains from, the version its
    weights were taken at) and every corrected micro-batch."""
    taken, corrected = [], []
    sample, ratio_of = module.off_policy.sample, module.off_policy.importance_ratio

    def recording_sample(mod, batch):
        rollout = sample(mod, batch)
        taken.append({"index": mod.generation_count, "step": mod.global_step, "rollout": rollout,
                      "in_flight": dict(mod.off_policy.ahead.in_flight)})
        return rollout

    def recording_ratio(mod, mb, logps):
        ratio = ratio_of(mod, mb, logps)
        corrected.append({**{k: v.detach().clone() for k, v in mb.items()}, "logps": logps.detach().clone(),
                          "is_ratio": ratio, "index": mod.generation_count - 1, "step": mod.global_step})
        return ratio

    versions = {}  # rollout index -> the optimizer step of the weights it was sampled with

    def install_take(ahead):
        take = ahead.take

        def recording_take(index):
            rollout, version, seconds = take(index)
            versions[index] = version
            return rollout, version, seconds
        recording_take.installed = True
        ahead.take = recording_take

    module.off_policy.sample = recording_sample
    module.off_policy.importance_ratio = recording_ratio
    started = module.off_policy._started

    def starting(mod, probe):
        ahead = started(mod, probe)
        if not hasattr(ahead.take, "installed"):
            install_take(ahead)
        return ahead
    module.off_policy._started = starting
    return taken, corrected, lambda: versions


def fit_async(grpo_module, quiet_trainer, prompt_data, steps=6, **knobs):
    L.seed_everything(0)
    knobs.setdefault("reward_funcs", [varied_reward])
    module = grpo_module(learning_rate=2e-2, max_completion_length=8, generation_batch_size=8, **knobs)
    snapshots = Snapshots()
    taken, corrected, versions = record_rollouts(module)
    quiet_trainer(max_steps=steps, callbacks=[snapshots]).fit(module, prompt_data())
    return module, snapshots.weights, taken, corrected, versions()


def sampled_token_logps(module, weights, rollout):
    """The log-probs of the rollout's sampled tokens under ``weights`` (the plain padded forward)."""
    model = type(module.model)(module.model.config)
    model.load_state_dict(weights)
    model.eval()
    mb = {k: rollout[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}
    with torch.no_grad():
        logps = grpo_forward(model, mb, module.hparams.temperature)[0]
    return logps * mb["completion_mask"]


def test_the_sampler_runs_ahead_on_the_weights_it_claims_never_staler_than_max_staleness(
        grpo_module, quiet_trainer, prompt_data):
    module, weights, taken, corrected, versions = fit_async(grpo_module, quiet_trainer, prompt_data,
                                                            max_staleness=2)
    # one rollout per optimizer step (accumulation 1, one micro-batch): 2 rollouts ahead
    assert [t["index"] for t in taken] == list(range(6))
    staleness = [t["step"] - versions[t["index"]] for t in taken]
    assert staleness == [0, 1, 2, 2, 2, 2], staleness
    assert all(len(t["in_flight"]) <= 2 for t in taken)
    moved = 0
    for t in taken:
        mask = t["rollout"]["completion_mask"].bool()
        sampler = t["rollout"]["sampling_logps"]
        claimed = sampled_token_logps(module, weights[versions[t["index"]]], t["rollout"])
        torch.testing.assert_close(sampler[mask], claimed[mask], atol=2e-4, rtol=0)
        if t["step"] != versions[t["index"]]:  # stale: the policy training on it gives other log-probs
            current = sampled_token_logps(module, weights[t["step"]], t["rollout"])
            moved += int((current[mask] - claimed[mask]).abs().max() > 1e-3)
    assert moved >= 3, "the weights did not move between steps: staleness is not exercised"


def test_the_importance_ratio_is_the_policys_over_the_samplers_and_reaches_the_loss(
        grpo_module, quiet_trainer, prompt_data):
    module, weights, taken, corrected, versions = fit_async(
        grpo_module, quiet_trainer, prompt_data, steps=4, max_staleness=1,
        vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=1.01)
    stale_ratios = 0
    assert [mb["index"] for mb in corrected] == [t["index"] for t in taken]  # one micro-batch per rollout here
    for t, mb in zip(taken, corrected):
        rows = mb["row"]
        sampler = sampled_token_logps(module, weights[versions[t["index"]]], t["rollout"])[rows]
        mask = mb["completion_mask"]
        # the policy's side is the training forward's own log-probs (one pass, one step per rollout: no old pass)
        assert "old_logps" not in mb
        expected, _ = importance_sampling_ratio(mb["logps"], sampler, mask, "token_truncate", None, 1.01)
        torch.testing.assert_close(mb["is_ratio"] * mask, expected * mask, atol=1e-3, rtol=1e-3)
        if t["step"] != versions[t["index"]]:
            stale_ratios += int(((mb["is_ratio"] - 1).abs() * mask).max() > 1e-3)
    assert stale_ratios >= 2
    # the ratio reaches the loss: the same run without the correction trains to other weights
    plain, *_ = fit_async(grpo_module, quiet_trainer, prompt_data, steps=4, max_staleness=1,
                          vllm_importance_sampling_correction=False)
    assert any(not torch.equal(a, b) for a, b in zip(module.model.state_dict().values(),
                                                     plain.model.state_dict().values()))


def test_rollout_prompts_are_the_loaders_batches_across_epochs(prompt_data, quiet_trainer):
    dm = prompt_data()
    dm.setup("fit")
    dm.configure_rollout(3, 2)
    loader = dm.train_dataloader()
    seen = []
    for epoch in range(2):
        loader.sampler.set_epoch(epoch)
        seen += [batch["prompts"] for i, batch in enumerate(loader) if i % 2 == 0]
    assert len(seen) > 4
    assert [dm.rollout_prompts(i)["prompts"] for i in range(len(seen))] == seen
    assert seen[0] != seen[len(seen) // 2]  # the second epoch is another order


def test_a_sampling_process_that_dies_is_an_error_not_a_hang(grpo_module, quiet_trainer, prompt_data):
    class KillSampler(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step == 2:
                os.kill(module.off_policy.ahead.process.pid, signal.SIGKILL)

    L.seed_everything(0)
    threads = torch.get_num_threads()
    module = grpo_module(reward_funcs=[varied_reward], max_staleness=1, generation_batch_size=8)
    with pytest.raises(SamplerProcessError,
                       match=r"sampling process of the asynchronous rollouts \(pid \d+\) was killed by SIGKILL"):
        quiet_trainer(max_steps=6, callbacks=[KillSampler()]).fit(module, prompt_data())
    assert module.off_policy.ahead is None  # stopped on the way out
    assert torch.get_num_threads() == threads  # the training process has its threads back


def test_a_module_fitted_twice_samples_ahead_for_the_second_fits_loader(grpo_module, quiet_trainer, prompt_data):
    L.seed_everything(0)
    module = grpo_module(reward_funcs=[varied_reward], max_staleness=2, generation_batch_size=8)
    data = prompt_data()
    quiet_trainer(max_steps=3).fit(module, data)
    assert module.off_policy.ahead is None  # the first fit's sampling process and rollouts are gone
    taken, _, _ = record_rollouts(module)
    quiet_trainer(max_steps=3).fit(module, data)  # its loader starts over: rollouts 0, 1, 2 of its own order
    assert module.generation_count == 6
    assert [t["rollout"]["prompts"][::4] for t in taken] == [data.rollout_prompts(i)["prompts"] for i in range(3)]


def test_a_policy_whose_forward_is_more_than_its_class_and_weights_is_refused_with_the_measured_gap(
        grpo_module, quiet_trainer, prompt_data):
    class Hooked(L.Callback):  # a forward hook on the output embedding: the rebuilt copy would not have it
        def on_fit_start(self, trainer, module):
            module.model.get_output_embeddings().register_forward_hook(lambda m, i, out: out + 0.5 * out.detach())

    module = grpo_module(reward_funcs=[varied_reward], max_staleness=1, generation_batch_size=8)
    with pytest.raises(SamplerProcessError, match=r"copy of Qwen2ForCausalLM .* differ from the policy's by "
                                                  r"\d\.\d+e[-+]\d+ .*max_staleness: 0"):
        quiet_trainer(max_steps=2, callbacks=[Hooked()]).fit(module, prompt_data())


def test_sampling_ahead_under_mixed_precision_is_refused_at_setup(grpo_module, quiet_trainer, prompt_data):
    """The sampling process computes in float32; under bf16-mixed the policy computes under autocast, so sampling
    ahead is refused at setup, before any model loads or process starts, naming both knobs. Mutation: the
    precision check dropped from check_setup -> the refusal comes from the first rollout's probe (another error)."""
    module = grpo_module(reward_funcs=[varied_reward], max_staleness=1, generation_batch_size=8)
    with pytest.raises(ValueError, match=r"max_staleness > 0 samples in a separate process .* trainer.precision "
                                         r"bf16-mixed .* trainer.precision: 32-true .* model.max_staleness: 0"):
        quiet_trainer(max_steps=1, precision="bf16-mixed").fit(module, prompt_data())
    assert getattr(module, "model", None) is None  # refused before configure_model built the policy


@pytest.mark.parametrize("knobs, message", [
    (dict(max_staleness=1, steps_per_generation=2), r"max_staleness=1 is less than the 2 optimizer steps one rollout"),
    (dict(async_sampler_threads=1), r"async_sampler_threads .* only with max_staleness > 0"),
    (dict(max_staleness=-1), r"max_staleness must be an integer >= 0"),
    (dict(vllm_importance_sampling_cap=2.0), r"former name of vllm_importance_sampling_clip_max"),
    (dict(vllm_importance_sampling_mode="token"), r"vllm_importance_sampling_mode"),
])
def test_async_knobs_are_checked(grpo_module, quiet_trainer, prompt_data, knobs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        module = grpo_module(**knobs)
        quiet_trainer(max_steps=1).fit(module, prompt_data())


def test_rloo_takes_only_sequence_importance_weights(tiny_dir):
    from lightalign import RLOOModule

    with pytest.raises(ValueError, match="RLOO's loss is one clipped ratio per completion"):
        RLOOModule(str(tiny_dir), from_config=True, reward_funcs=[varied_reward],
                   vllm_importance_sampling_mode="token_mask")


class PlainLoop:
    """What the loop did before rollouts could be sampled ahead: the policy samples, nothing is corrected."""

    max_staleness = 0
    ahead = None

    def check_setup(self, module):
        pass

    def sampler_is_stale(self, module):
        return False

    def sample(self, module, batch):
        return module.generate(batch, module.hparams.num_generations)

    def importance_ratio(self, module, mb, logps):
        return None

    def note(self, module):
        return None

    def state_dict(self):
        return {}


def test_max_staleness_0_trains_bit_for_bit_as_the_plain_synchronous_loop(tmp_path, tiny_dir, quiet_trainer,
                                                                          prompt_data):
    import json
    import shutil

    folder = tmp_path / "dropout"  # dropout on: any extra forward or RNG draw would change the weights
    shutil.copytree(tiny_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.1}))

    def fit(plain: bool):
        from lightalign import GRPOModule

        L.seed_everything(0)
        module = GRPOModule(str(folder), from_config=True, reward_funcs=[varied_reward], num_generations=4,
                            generation_batch_size=8, steps_per_generation=2, max_completion_length=6,
                            learning_rate=2e-2, max_staleness=0)
        if plain:
            object.__setattr__(module, "off_policy", PlainLoop())
        quiet_trainer(max_steps=4).fit(module, prompt_data())
        return module.model.state_dict()

    synchronous, plain = fit(False), fit(True)
    assert all(torch.equal(synchronous[k], plain[k]) for k in plain)


def test_rollouts_kept_in_a_checkpoint_are_dropped_with_a_note_when_resumed_synchronously(caplog):
    from lightalign.modules.rollout.offpolicy.component import OffPolicyRollouts

    state = {"ahead_rollouts": {2: {"rollout": {}, "version": 1, "seconds": 0.1}}}
    synchronous, ahead = OffPolicyRollouts(max_staleness=0), OffPolicyRollouts(max_staleness=1)
    with caplog.at_level("INFO"):
        synchronous.load_state_dict(state)
    assert synchronous.state_dict() == {"ahead_rollouts": {}}
    assert "holds 1 rollout(s) sampled ahead; with max_staleness 0" in caplog.text
    ahead.load_state_dict(state)
    assert list(ahead.state_dict()["ahead_rollouts"]) == [2]
