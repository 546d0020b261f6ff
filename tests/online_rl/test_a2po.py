"""A2POModule: TRL 1.16's value estimate and loss on identical inputs (tests/fixtures/trl_a2po_parity.pt, written by
bench/trl_parity/a2po.py in the bench venv), the value stage's cache (reused, resumed after an interruption, the
training stream untouched), the V* each rollout row regresses onto, ``filter_all_incorrect``, its knob checks and
the shipped quickstart through the console script."""

from __future__ import annotations

import csv
import functools
import logging
from pathlib import Path

import lightning as L
import pytest
import torch

from helpers import console_script
from helpers.a2po_runs import ZERO, Rewards, fit_a2po, prompts as a2po_prompts
from helpers.rollout_callbacks import KeepBuffer

from lightalign.modules.losses.a2po import A2POLossConfig, a2po_loss
from lightalign.modules.rollout.value_estimate import all_incorrect, optimal_values

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "trl_a2po_parity.pt"


@functools.cache
def parity() -> dict:
    return torch.load(FIXTURE, weights_only=True)


# ------------------------------------------------------------------------------------------------- parity with TRL
@pytest.mark.parametrize("index", range(6), ids=lambda i: f"value{i}")
def test_value_estimate_equals_trl(index):
    """``optimal_values`` and ``all_incorrect`` on TRL's seeded rewards give TRL's ``V*`` per prompt (relative 1e-6:
    a logsumexp of 4 terms in float32) and keep the prompts its ``filter_all_incorrect`` keeps. Fails when
    ``beta1`` is not the temperature (e.g. ``V* = logsumexp(r * beta1) / beta1``: every case), when the mean is a sum
    (no ``- log N``), or when the filter tests ``max == 0`` on the continuous rewards."""
    data = parity()
    assert data["trl_version"] == "1.16.0"
    case = data["value_cases"][index]
    ours = optimal_values(case["rewards"], case["beta1"])
    assert (ours - case["values"]).abs().max().item() <= 1e-6 * max(1.0, case["values"].abs().max().item())
    kept = (~all_incorrect(case["rewards"])).nonzero().flatten()
    assert torch.equal(kept, case["kept"])
    if case["kind"] == "binary":
        assert len(case["kept"]) < case["rewards"].shape[0]  # the filter acts in the binary cases


def _ours_loss(x: dict, beta2: float) -> tuple[torch.Tensor, torch.Tensor, dict]:
    logits = x["logits"].clone().requires_grad_(True)
    prompt, t = x["prompt_ids"].shape[1], x["completion_ids"].shape[1]
    logps = torch.log_softmax(logits[:, prompt - 1:prompt - 1 + t], -1)
    logps = logps.gather(-1, x["completion_ids"][..., None])[..., 0]
    ref = torch.zeros_like(logps)
    ref[:, 0] = x["ref_logps"]  # TRL's input is the reference's sequence log-prob: every row has a first token
    loss, stats = a2po_loss(logps, ref, x["completion_mask"], x["rewards"], x["v_star"], A2POLossConfig(beta2=beta2))
    loss.backward()
    return loss.detach(), logits.grad, stats


@pytest.mark.parametrize("index", range(3), ids=lambda i: f"loss{i}")
def test_loss_equals_trl(index):
    """Loss, gradient (with respect to the logits) and TRL's ``implicit_reward``/``advantage`` metrics within float32
    rounding (relative 1e-5: log-softmax over 11 logits, sums of 6 tokens, squares). Fails with the target's sign
    flipped (``V* - r``), the reference's log-ratio dropped (``beta2 * log pi``), ``beta2`` applied to the target
    instead, or a mean over tokens instead of sequences."""
    data = parity()
    case, x = data["loss_cases"][index], data["loss_inputs"]
    loss, grad, stats = _ours_loss(x, case["beta2"])
    assert (loss - case["loss"]).abs().item() <= 1e-5 * max(1.0, case["loss"].abs().item())
    assert (grad - case["grad"]).abs().max().item() <= 1e-5 * case["grad"].abs().max().item()
    assert case["grad"].abs().max() > 0
    for name in ("implicit_reward", "advantage"):
        assert (stats[name] - case[name]).abs().item() <= 1e-5 * max(1.0, case[name].abs().item()), name


# ------------------------------------------------------------------------------------------------- the module
def test_bad_knobs_refused(tiny_dir):
    """Mutations that made this fail: A2PO without ``without=`` (its dropped knobs accepted); ``build_tool_rollouts``
    or ``sampling_ahead`` reading their group without checking it is taken (AttributeError at construction)."""
    from lightalign import A2POModule

    def make(**kw):
        return A2POModule(str(tiny_dir), from_config=True, reward_funcs=[lambda prompts, completions, **k: [0.0]], **kw)

    for kw, message in (({"num_generations": 2}, "one completion per prompt"), ({"beta1": 0.0}, "beta1 must be > 0"),
                        ({"beta2": -1.0}, "beta2 must be > 0"), ({"num_value_samples": 0}, "num_value_samples")):
        with pytest.raises(ValueError, match=message):
            make(**kw)
    with pytest.raises(TypeError, match="beta"):  # GRPO's KL coefficient is not an A2PO knob
        make(beta=0.1)
    # the groups A2PO drops (takes_knobs(without=...)): the generic refusal, naming the methods that take the knob
    for kw, takers in (({"max_staleness": 2}, "GRPOModule and RLOOModule take it"),
                       ({"tools": [len]}, "GRPOModule and RLOOModule take it"),
                       ({"sync_ref_model": True}, "PPOModule and RLOOModule take it"),
                       ({"update_ref_model": True}, "PPOModule and RLOOModule take it")):
        with pytest.raises(TypeError, match=f"A2POModule has no knob '{next(iter(kw))}'; .*{takers}"):
            make(**kw)
    # the shared code reading those groups builds without them (single-turn, synchronous rollouts)
    module = make()
    assert module.tool_rollouts is None and module.sampling_ahead() == (0, None) == (module.off_policy.max_staleness,
                                                                                     module.off_policy.sampler_threads)


WORKER = Path(__file__).resolve().parents[1] / "workers" / "a2po_estimate_worker.py"


class DrawAtFitStart(L.Callback):
    """Draws from the torch stream before the module's fit start (a callback's hook runs first)."""

    def on_fit_start(self, trainer, pl_module):
        torch.rand(3)


def test_value_stage_cached_resumed_and_regressed_onto(tmp_path, caplog):
    """8 prompts in chunks of 2 (one rollout's prompts), 2 reference samples each.

    * A run SIGKILLed during the estimate (a worker; its third chunk's rewards kill it) leaves its first two chunks
      in the cache; the next run (which draws from torch's stream before the estimate) samples only the other two and
      ends with the V* of a run never killed (each chunk is sampled in its own seeded stream). Fails if finished
      chunks are not reused (4 calls), or if a chunk's stream depends on what ran before it (no per-chunk seed: the
      values differ).
    * A second run on the same cache samples nothing, and trains on the completions the sampling run trained on:
      the value stage leaves the training stream untouched (fails without the forked stream).
    * V* is ``optimal_values`` of the prompt's reference rewards, and each rollout row carries its own prompt's
      (fails with a lookup by the wrong row, or a wrong ``beta1``); the advantage is ``r - V*``.
    * ``filter_all_incorrect``: the prompt whose samples all scored 0 is never trained on."""
    caplog.set_level(logging.INFO)
    killed = console_script.run_python(WORKER, str(tmp_path / "x"), timeout=600,
                                       env=console_script.standard_env(OMP_NUM_THREADS="1"))
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert len(list((tmp_path / "x").rglob("chunk_*.pt"))) == 2
    resumed = Rewards()  # a process of its own draws from torch's stream before the estimate as it likes
    module_b, _ = fit_a2po(tmp_path / "x", resumed, [DrawAtFitStart()])
    assert len(resumed.value_calls) == 2 and "4 estimated now, 4 loaded from the cache" in caplog.text

    fresh, keep = Rewards(), KeepBuffer()
    module_c, data = fit_a2po(tmp_path / "y", fresh, [keep])
    assert len(fresh.value_calls) == 4 and "8 estimated now, 0 loaded from the cache" in caplog.text
    assert torch.equal(module_b.optimal.values, module_c.optimal.values)

    cached = Rewards()
    module_d, _ = fit_a2po(tmp_path / "y", cached)
    assert cached.value_calls == [] and "0 estimated now, 8 loaded from the cache" in caplog.text
    assert torch.equal(module_d.optimal.values, module_c.optimal.values)
    assert cached.rollouts == fresh.rollouts  # the same training completions, with or without sampling

    # V* per prompt from the value stage's rewards (calls in row order: chunk c holds prompts 2c, 2c+1)
    expected = {}
    for prompts, out in fresh.value_calls:
        rewards = torch.tensor(out).view(2, 2)
        for j, value in enumerate(optimal_values(rewards, 0.3).tolist()):
            expected[prompts[2 * j]] = value
    assert len(expected) == 8 and expected[ZERO[0]] == 0.0
    assert len({round(v, 6) for v in expected.values()}) > 3  # V* differs between prompts, or a mixed-up lookup passes
    for buffer, (prompts, out, _) in zip(keep.buffers, fresh.rollouts):
        order = torch.argsort(torch.cat([mb["row"] for mb in buffer]))
        v_star = torch.cat([mb["v_star"] for mb in buffer])[order]
        advantages = torch.cat([mb["advantages"] for mb in buffer])[order]
        torch.testing.assert_close(v_star, torch.tensor([expected[p] for p in prompts]), atol=1e-6, rtol=0)
        torch.testing.assert_close(advantages, torch.tensor(out) - v_star, atol=1e-6, rtol=0)
    assert len(keep.buffers) == 2 and all(p not in ZERO for prompts, _, _ in fresh.rollouts for p in prompts)
    assert len(data.train_dataset) == 7 and "filter_all_incorrect dropped 1 of 8 training prompts" in caplog.text


def test_a_filter_that_leaves_too_few_prompts_is_refused_at_fit_start(tiny_dir, quiet_trainer, tmp_path):
    """Every reference sample scores 0: the filter would leave no prompt; the fit stops before any training step
    with a message naming the knob."""
    from datasets import Dataset

    from lightalign import A2POModule, PromptDataModule

    module = A2POModule(str(tiny_dir), from_config=True, reward_funcs=[lambda prompts, completions, **k: [0.0] * len(
        prompts)], generation_batch_size=2, num_value_samples=2, max_completion_length=2, value_cache_dir=str(tmp_path))
    data = PromptDataModule(Dataset.from_list(a2po_prompts()[:2]), tokenizer=str(tiny_dir), max_prompt_length=16)
    with pytest.raises(ValueError, match=r"filter_all_incorrect dropped 2 of 2 training prompts .* needs \(2\); set "
                                         "filter_all_incorrect: false"):
        quiet_trainer(max_steps=1).fit(module, data)
    assert module.global_step == 0


def test_log_probs_are_the_models_own_at_any_sampling_temperature(tiny_dir, data_dir, quiet_trainer, tmp_path):
    """TRL's A2POTrainer samples at ``temperature`` and takes the log-probs of the model's own distribution (no
    division of the logits): the reference log-probs of a rollout sampled at temperature 0.5 are the log-softmax of
    the reference's plain logits at the sampled tokens, recomputed here from the padded ids. Fails without
    ``logprob_temperature`` returning 1 (the logits divided by 0.5: every log-prob changes by far more than 1e-4)."""
    from datasets import Dataset

    from lightalign import A2POModule, PromptDataModule

    L.seed_everything(0)
    keep = KeepBuffer()
    module = A2POModule(str(tiny_dir), from_config=True, reward_funcs=[Rewards()], generation_batch_size=2,
                        num_value_samples=1, temperature=0.5, max_completion_length=4, filter_all_incorrect=False,
                        value_cache_dir=str(tmp_path))
    data = PromptDataModule(Dataset.from_list(a2po_prompts()[:2]), tokenizer=str(tiny_dir), max_prompt_length=16)
    quiet_trainer(max_steps=1, callbacks=[keep]).fit(module, data)
    mb = keep.buffers[0][0]
    ids = torch.cat([mb["prompt_ids"], mb["completion_ids"]], 1)
    mask = torch.cat([mb["prompt_mask"], mb["completion_mask"]], 1)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = module.ref_model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()
    t, p = mb["completion_ids"].shape[1], mb["prompt_ids"].shape[1]
    own = torch.log_softmax(logits[:, p - 1:p - 1 + t], -1).gather(-1, mb["completion_ids"][..., None])[..., 0]
    real = mb["completion_mask"].bool()
    torch.testing.assert_close(mb["ref_logps"][real], own[real], atol=1e-4, rtol=0)


def test_console_quickstart_runs_and_logs(repo, data_dir, tmp_path):
    """The shipped config through the console script, shortened (2 steps; the first 48 of its prompts, 2 reference
    samples each, cached in the test's folder): the fit-start line of the value stage, TRL's metric names, the
    export."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join((data_dir / "arithmetic_prompts.jsonl").read_text().splitlines()[:48]) + "\n")
    out = console_script.run(
        repo, "fit", "--config", str(repo / "configs" / "a2po_quickstart.yaml"), "--trainer.max_steps", "2",
        "--data.path", str(prompts),
        "--trainer.val_check_interval", "2", "--trainer.logger.init_args.save_dir", str(tmp_path),
        "--model.value_cache_dir", str(tmp_path / "values"), "--model.num_value_samples", "2",
        "--plot.enabled", "false", env=console_script.standard_env(), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "A2PO: V* of 32 training prompts (2 reference samples each): 32 estimated now, 0 loaded" in (
        out.stdout + out.stderr)
    rows = list(csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))))
    logged = {k for row in rows for k, v in row.items() if v}
    assert {"train/loss", "train/v_star", "train/implicit_reward", "train/advantage", "train/reward/mean",
            "val/reward/mean"} <= logged
    assert next(tmp_path.rglob("hf_model/config.json"))
