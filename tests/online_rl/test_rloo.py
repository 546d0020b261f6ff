"""RLOOModule: leave-one-out advantages on real rollouts, the KL in the reward, accumulation, the console script."""

import csv

import lightning as L
import pytest

from helpers import console_script
from helpers.rollout_callbacks import KeepBuffer, PerturbPolicy
from helpers.rewards import Recorder, ranked_reward
import torch

from lightalign.modules.rloo import RLOOModule

G = 4


def rloo(tiny_dir, **kw):
    kw.setdefault("reward_funcs", [ranked_reward])  # rewards that differ inside every group
    kw.setdefault("num_generations", G)
    kw.setdefault("max_completion_length", 6)
    kw.setdefault("learning_rate", 1e-3)
    return RLOOModule(str(tiny_dir), from_config=True, **kw)


def in_rollout_order(buffer, key):
    rows = torch.cat([mb["row"] for mb in buffer])
    return torch.cat([mb[key] for mb in buffer])[torch.argsort(rows)]


def leave_one_out(values):
    """Each value minus the mean of the others in its group of G."""
    grouped = values.view(-1, G)
    return (grouped - (grouped.sum(1, keepdim=True) - grouped) / (G - 1)).flatten()


@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_advantage_is_reward_minus_the_others_mean(beta, tiny_dir, quiet_trainer, prompt_data):
    """The advantages are the KL-penalised rewards minus the mean of the group's others. The recorded rewards
    (``ranked_reward``) differ inside every group by construction. With ``beta``, the penalty's own share of the
    advantages must be far above the tolerance, or a module that dropped it (or took the wrong log-probs) would
    pass: PerturbPolicy moves every weight by N(0, 0.05^2) noise, 2.5 times the tiny model's initial scale, so the
    policy and its reference are different random networks, and each completion's KL is a sum of six per-token
    log-ratios of order 1. This is not constructed: the check fails only if, in every group, the four sampled
    completions' KLs agree to within 1e-3 / beta."""
    recorder = Recorder()
    keep = KeepBuffer()
    module = rloo(tiny_dir, reward_funcs=[recorder], beta=beta, generation_batch_size=8)
    quiet_trainer(max_steps=1, accumulate_grad_batches=2, callbacks=[keep, PerturbPolicy()]).fit(module, prompt_data())
    buffer = keep.buffers[0]
    rewards = recorder.rewards[0].float()
    assert rewards.view(-1, G).std(dim=1).min() > 0  # variance inside every group, or the check proves nothing
    if beta:  # the penalty uses the sampling policy's and the reference's log-probs of each completion
        kl = ((in_rollout_order(buffer, "old_logps") - in_rollout_order(buffer, "ref_logps"))
              * in_rollout_order(buffer, "completion_mask")).sum(-1)
        assert leave_one_out(beta * kl).abs().max() > 1e-3, kl  # 100 times atol below
        rewards = rewards - beta * kl
    expected = []
    for i, r in enumerate(rewards.tolist()):
        group = rewards[(i // G) * G:(i // G + 1) * G].tolist()
        others = [x for j, x in enumerate(group) if j != i % G]
        expected.append(r - sum(others) / len(others))
    torch.testing.assert_close(in_rollout_order(buffer, "advantages"), torch.tensor(expected), atol=1e-5, rtol=1e-5)


def test_accumulation_2x4_equals_1x8(tiny_dir, quiet_trainer, prompt_data, grad_capture):
    def one_step_grads(accumulate):
        L.seed_everything(0)
        module = rloo(tiny_dir, generation_batch_size=8, beta=0.1, optimizer=lambda p: torch.optim.SGD(p, lr=0.0))
        capture = grad_capture()
        quiet_trainer(max_steps=1, accumulate_grad_batches=accumulate, callbacks=[capture]).fit(module, prompt_data())
        return capture.grads[0]

    full, accum = one_step_grads(1), one_step_grads(2)
    assert full.keys() == accum.keys() and full
    for name in full:
        torch.testing.assert_close(accum[name], full[name], atol=1e-6, rtol=1e-5, msg=name)
    assert any(g.abs().sum() > 0 for g in full.values())


def test_bad_knobs_refused(tiny_dir):
    with pytest.raises(ValueError, match="num_generations >= 2"):
        rloo(tiny_dir, num_generations=1)
    with pytest.raises(ValueError, match="beta must be >= 0"):
        rloo(tiny_dir, beta=-0.1)
    with pytest.raises(ValueError, match="reward_clip_range"):
        rloo(tiny_dir, reward_clip_range=(1.0, -1.0))
    for knob in ("scale_rewards", "entropy_coef", "loss_type"):  # GRPO's: not RLOO knobs at all
        with pytest.raises(TypeError, match=knob):
            rloo(tiny_dir, **{knob: 1})


def test_reward_clip_range_clamps_before_the_baseline(tiny_dir, quiet_trainer, prompt_data):
    """``ranked_reward`` gives row ``i`` of the rollout a reward in ``[i, i + 1)``: the range [1, 5] raises row 0's
    and lowers rows 5 to 7's, and leaves variance inside both groups."""
    keep = KeepBuffer()
    recorder = Recorder()
    module = rloo(tiny_dir, reward_funcs=[recorder], beta=0.0, generation_batch_size=8, reward_clip_range=(1.0, 5.0))
    quiet_trainer(max_steps=1, callbacks=[keep]).fit(module, prompt_data())
    raw = recorder.rewards[0].float()
    rewards = raw.clamp(1.0, 5.0)
    assert raw[0] < 1.0 and (raw[5:] > 5.0).all() and rewards.view(-1, G).std(dim=1).min() > 0
    adv = in_rollout_order(keep.buffers[0], "advantages")
    torch.testing.assert_close(adv, leave_one_out(rewards), atol=1e-6, rtol=1e-6)


def _run(args, cwd, **env):
    return console_script.run(cwd, *args, env=console_script.standard_env(**env), timeout=600)


def test_console_quickstart_runs_and_logs(repo, tmp_path):
    out = _run(["fit", "--config", str(repo / "configs" / "rloo_quickstart.yaml"), "--trainer.max_steps", "2",
                "--model.beta", "0.05",
                "--trainer.val_check_interval", "2", "--trainer.logger.init_args.save_dir", str(tmp_path),
                "--plot.enabled", "false"], cwd=repo)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = list(csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))))
    logged = {k for row in rows for k, v in row.items() if v}
    assert {"train/reward/mean", "train/kl", "train/loss", "val/reward/mean"} <= logged
    assert next(tmp_path.rglob("hf_model/config.json"))
    # the run records RLOO's own knobs, and no knob of GRPO's (RLOO has none of them)
    hparams = torch.load(next(tmp_path.rglob("last.ckpt")), weights_only=False, map_location="cpu")["hyper_parameters"]
    assert hparams["beta"] == 0.05 and not {"loss_type", "scale_rewards", "entropy_coef"} & set(hparams)
    hparams_yaml = next(tmp_path.rglob("hparams.yaml")).read_text()
    assert "beta: 0.05" in hparams_yaml and "loss_type" not in hparams_yaml


def test_console_refuses_a_group_of_one(repo, tmp_path):
    out = _run(["fit", "--config", str(repo / "configs" / "rloo_quickstart.yaml"), "--model.num_generations", "1",
                "--trainer.logger.init_args.save_dir", str(tmp_path)], cwd=repo)
    assert out.returncode != 0
    assert "RLOOModule needs num_generations >= 2" in out.stderr and "Traceback" not in out.stderr
