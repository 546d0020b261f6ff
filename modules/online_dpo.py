"""Online DPO: ``OnlineDPOModule``, DPO on pairs the policy samples itself and a reward (or a judge) ranks.

Per batch of prompts (``PromptDataModule``): two completions per prompt from the policy (``SamplingModule``'s
``Sampling`` component), scored by the reward functions (the online-RL scoring stage, ``score_rollout``) with
``missing_eos_penalty`` taken off a completion without EOS, or compared by a pairwise judge; the better one is
``chosen``. The loss is the project's ``dpo_loss`` (``sigmoid`` or ``ipo``) on the completion-token log-prob sums of the
policy (with gradients) and of the reference (``Reference`` component, under ``no_grad``; for a LoRA policy the base
with adapters off). TRL 1.16's ``OnlineDPOTrainer`` (docs/online_dpo.md).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch

from lightalign.knobs import KnobGroup, knob, takes_knobs
from lightalign.modules.losses.advantages import MissingEOSKnobs, apply_missing_eos_penalty
from lightalign.modules.losses.dpo import dpo_loss
from lightalign.modules.losses.implicit_reward import ImplicitRewardKnobs
from lightalign.modules.reference.bema import BEMAKnobs
from lightalign.modules.reference.component import Reference, ReferenceKnobs
from lightalign.modules.reference.sync import quantized_reference
from lightalign.modules.rollout.scoring import fallback_stat, score_rollout
from lightalign.modules.sampling.module import SamplingModule
from lightalign.modules.training.stat_metrics import StatMetrics, metric_key
from lightalign.rewards import reward_func_names
from lightalign.rewards.resolve import import_object
from lightalign.rewards.runner import RewardKnobs

__all__ = ["ONLINE_DPO_LOSS_TYPES", "JudgeKnobs", "OnlineDPOLossKnobs", "OnlineDPOModule", "apply_missing_eos_penalty",
           "beta_for_epoch", "chosen_rejected_rows", "judged_win_rate", "masked_sums", "pair_from_judge",
           "pair_from_rewards"]

ONLINE_DPO_LOSS_TYPES = ("sigmoid", "ipo")


@dataclasses.dataclass(frozen=True)
class OnlineDPOLossKnobs(KnobGroup):
    """Online DPO's loss on each sampled pair (``dpo_loss``'s ``sigmoid`` or ``ipo``)."""

    group = "online_dpo_loss"
    loss_type: Literal["sigmoid", "ipo"] = knob(
        "sigmoid", "``sigmoid`` (DPO) or ``ipo`` (length-normalised log-ratios, as the project's ``dpo_loss``); the "
                   "other DPO loss types need offline pairs and are refused.")

    def check(self) -> None:
        if self.loss_type not in ONLINE_DPO_LOSS_TYPES:
            raise ValueError(f"loss_type={self.loss_type!r} is not available online: OnlineDPOModule takes "
                             f"{list(ONLINE_DPO_LOSS_TYPES)} (as TRL's OnlineDPOTrainer); the other DPO loss types are "
                             "DPOModule's, on offline preference pairs.")


@dataclasses.dataclass(frozen=True)
class JudgeKnobs(KnobGroup):
    """A pairwise judge that ranks each pair instead of reward functions (TRL's ``BasePairwiseJudge``)."""

    group = "judge"
    judge: str | Callable | None = knob(
        None, "a pairwise judge instead of rewards: a callable (or an object with a ``judge`` method, TRL's "
              "``BasePairwiseJudge``) or its import path; called as ``judge(prompts, [[completion_a, completion_b], "
              "...])`` with the data's prompts and the decoded completions, it returns per prompt the index (0 or 1) "
              "of the better completion. At validation it also compares the policy with the reference "
              "(``val/win_rate``).", saved=False)

    def resolved(self) -> Any:
        """The judge, imported when named by its path (None without one)."""
        judge = import_object(self.judge, "judge") if isinstance(self.judge, str) else self.judge
        if judge is not None and not callable(getattr(judge, "judge", judge)):
            raise TypeError(f"judge must be callable (or have a judge method), got {type(judge).__name__}.")
        return judge


def beta_for_epoch(beta: float | Sequence[float], epoch: int) -> float:
    """The beta of an epoch: a number is used throughout; a list gives one value per epoch, its last one reused
    after (TRL's ``OnlineDPOConfig.beta``)."""
    if isinstance(beta, (int, float)):
        return float(beta)
    values = list(beta)
    return float(values[min(epoch, len(values) - 1)])


def pair_from_rewards(rewards: torch.Tensor) -> torch.Tensor:
    """Which completion of each pair is chosen (0 or 1, ``[N]``), from the rewards ``[2N]`` of rows grouped by prompt
    (``[a_0, b_0, a_1, b_1, ...]``): the higher reward; a tie goes to the first (as TRL). A NaN reward (no function
    scored the completion) ranks below any number."""
    pairs = torch.nan_to_num(rewards.float().view(-1, 2), nan=float("-inf"))
    return (pairs[:, 1] > pairs[:, 0]).long()


def pair_from_judge(judge: Any, prompts: list[Any], texts: list[str]) -> torch.Tensor:
    """Which completion of each pair is chosen (``[N]``), as ``judge(prompts, [[a, b], ...])`` says (TRL's pairwise
    judge convention: the index of the better completion; an object with a ``judge`` method is called through it)."""
    call = judge.judge if hasattr(judge, "judge") and not inspect.isfunction(judge) else judge
    pairs = [[texts[2 * i], texts[2 * i + 1]] for i in range(len(prompts))]
    ranks = list(call(prompts, pairs))
    if len(ranks) != len(prompts) or any(int(r) not in (0, 1) or r != int(r) for r in ranks):
        raise ValueError(f"The judge {getattr(call, '__qualname__', call)!r} must return one index per prompt, 0 or 1 "
                         f"(which of the two completions is better), for {len(prompts)} prompts; it returned "
                         f"{ranks!r}.")
    return torch.tensor([int(r) for r in ranks], dtype=torch.long)


def judged_win_rate(judge: Any, prompts: list[Any], policy_texts: list[str], reference_texts: list[str],
                    policy_second: torch.Tensor) -> torch.Tensor:
    """The share of ``prompts`` on which ``judge`` prefers the policy's completion to the reference's, each pair shown
    in the order ``policy_second`` (``[N]`` bool) says (TRL's win rate against the reference, order shuffled)."""
    texts = []
    for policy, reference, second in zip(policy_texts, reference_texts, policy_second.tolist()):
        texts += [reference, policy] if second else [policy, reference]
    choice = pair_from_judge(judge, prompts, texts)
    return (choice == policy_second.long()).float().mean()


def chosen_rejected_rows(first_is_rejected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row indices ``[N]`` of the chosen and the rejected completion of each prompt's pair (rows grouped by prompt),
    from the pair choice (0: the first, 1: the second is chosen)."""
    base = 2 * torch.arange(first_is_rejected.shape[0], device=first_is_rejected.device)
    return base + first_is_rejected, base + 1 - first_is_rejected


def masked_sums(token_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-row sums of per-token log-probs over the completion mask (zero elsewhere, whatever the value there)."""
    return torch.where(mask.bool(), token_logps, torch.zeros_like(token_logps)).sum(-1)


TRAIN_STATS = ("loss", "objective/scores", "objective/scores_margin", "objective/kl", "objective/entropy",
               "objective/non_score_reward", "objective/rlhf_reward", "rewards/chosen", "rewards/rejected",
               "rewards/margins", "rewards/accuracies", "logps/chosen", "logps/rejected", "contain_eos_token", "beta",
               "reward/mean", "reward/std", "completions/mean_length", "completions/clipped_ratio")


@takes_knobs(RewardKnobs, JudgeKnobs, ImplicitRewardKnobs, OnlineDPOLossKnobs, MissingEOSKnobs, ReferenceKnobs, BEMAKnobs,
             defaults={"max_completion_length": 64, "temperature": 0.9, "disable_dropout": True})
class OnlineDPOModule(SamplingModule):
    """Online DPO on the prompts of ``PromptDataModule``: two completions per prompt sampled from the policy, ranked
    by reward functions or a pairwise judge, the DPO loss on the (chosen, rejected) pair against the reference.

    TRL 1.16's ``OnlineDPOTrainer`` (docs/online_dpo.md). Each training batch is ``data.batch_size`` prompts (so
    twice as many completions, one pair per prompt); the loss is the mean over the pairs. Its knobs: the reward
    functions (``RewardKnobs``, the online-RL methods' reward plumbing) or a judge (``JudgeKnobs``), exactly one of
    them; the loss (``OnlineDPOLossKnobs``); ``missing_eos_penalty`` (``MissingEOSKnobs``, reward functions only);
    the reference (``ReferenceKnobs``); on the shared sampling knobs, with TRL's defaults ``max_completion_length``
    64 (TRL's ``max_new_tokens``), ``temperature`` 0.9 (the two completions' sampling only: the log-probs of the loss
    are the model's own, untempered, as TRL's), ``disable_dropout`` on and ``vllm_gpu_memory_utilization`` 0.55 (TRL
    ``OnlineDPOConfig``'s).

    Logged per optimizer step, with TRL's names under ``train/``: ``objective/scores`` (mean reward, after
    ``missing_eos_penalty``), ``objective/scores_margin`` (chosen minus rejected reward), ``objective/kl``,
    ``objective/entropy``, ``objective/non_score_reward``, ``objective/rlhf_reward``, ``rewards/chosen``,
    ``rewards/rejected``, ``rewards/margins``, ``rewards/accuracies`` (the implicit DPO rewards), ``logps/chosen``,
    ``logps/rejected``, ``contain_eos_token`` (TRL's ``val/contain_eos_token``), ``beta``; plus the online-RL
    scoring stage's ``reward/mean``, ``reward/std``, ``reward/<function>``, ``completions/mean_length``,
    ``completions/clipped_ratio``. Per validation (two samples per held prompt): ``val/reward/mean`` (reward
    functions only), ``val/contain_eos_token``, ``val/completions/mean_length``; with a judge, ``val/win_rate``: the
    share of held prompts on which the judge prefers the policy's (first) completion to one the reference model
    samples for the same prompt, the two shown to the judge in a random order (TRL's ``WinRateCallback``).

    With ``use_vllm`` the policy's two completions per prompt come from a vLLM engine holding its weights (pushed at
    fit start and after every optimizer step; docs/vllm.md); the loss reads the policy's own log-probs of them, as
    TRL's does, with no importance-sampling correction for the engine not being the policy to the last bit. The
    reference's completions of the win rate (validation, with a judge) are sampled with transformers.
    """

    method_name = "Online DPO"
    takes_images = True  # prompts with images: sampled and scored with them (check_image_prompts)
    uses_reference_model = True
    knob_equivalents = {"max_new_tokens": "max_completion_length", "reward_model_path": "reward_funcs (a RewardModel)"}
    progress_stats = ("loss", "reward/mean")  # with a judge: ("loss", "win_rate")
    summary_stats = {"win_rate": "max"}  # the run summary's lines beyond the shared ones (RunSummary)
    _unregistered_attributes = SamplingModule._unregistered_attributes | {"reward_funcs", "judge"}
    vllm_gpu_memory_utilization_default = 0.55  # TRL's OnlineDPOConfig

    def check_knob_combinations(self) -> None:
        super().check_knob_combinations()  # the sampling knobs
        reward_funcs, judge = self.knobs.rewards.reward_funcs, self.knobs.judge.judge
        if (reward_funcs is None) == (judge is None):
            raise ValueError(f"{type(self).__name__} ranks each pair of completions by reward_funcs or by a pairwise "
                             "judge: give exactly one of them (" + ("got both: set --model.reward_funcs null to use "
                                                                    "the judge, or --model.judge null to use the "
                                                                    "reward functions" if judge is not None
                                                                    else "got neither") + ").")
        penalty = self.knobs.missing_eos.missing_eos_penalty
        if penalty is not None and judge is not None:
            raise ValueError(f"missing_eos_penalty must be a positive number subtracted from a reward, got {penalty} "
                             "with a judge, which gives no reward to subtract it from; drop it.")

    def reference_sync_blocker(self) -> str | None:
        return super().reference_sync_blocker() or quantized_reference(self.knobs.reference.ref_model_init_kwargs)

    def compose(self) -> None:
        super().compose()
        rewards = self.knobs.rewards
        funcs = rewards.resolved()
        self.reward_funcs = funcs
        self.reward_weights = list(rewards.reward_weights or [1.0] * len(funcs))
        self.reward_names = reward_func_names(funcs)
        self.reward_fallbacks_warned: set[str] = set()
        self.judge = self.knobs.judge.resolved()
        self.reference = Reference(self.knobs.reference.ref_model_name_or_path,
                                   self.knobs.reference.ref_model_init_kwargs)
        names = [*TRAIN_STATS, *(["win_rate"] if self.judge is not None else []),
                 *(f"reward/{n}" for n in self.reward_names),
                 *(fallback_stat(n) for n in self.reward_names if rewards.reward_fallback_value is not None)]
        self.train_stats = StatMetrics(names)
        self.eval_stats = StatMetrics(names)
        if self.judge is not None:  # no reward to show: the judge's win rate (validation) instead
            self.progress_stats = ("loss", "win_rate")
        self.last_pair: dict[str, torch.Tensor] | None = None  # the last training batch's pair (tests, logs)

    # ------------------------------------------------------------------------------------- model, setup
    def configure_model(self) -> None:
        super().configure_model()
        if self.ref_model is None:
            with torch.inference_mode(False):
                self.ref_model = self.reference.build(self.model, self.model_name_or_path,
                                                      self.hparams.trust_remote_code)

    def on_fit_start(self) -> None:
        super().on_fit_start()  # the sampler is decided again in fit_start_notes
        self.reference.move(self.ref_model, self.device, self.model)

    def fit_start_notes(self) -> list[str]:
        self.sampling.backend(self.model, largest_group=2)
        if self.judge is None:
            return [self.sampling.note()]
        with self.reference.model_for(self.ref_model, self.model) as ref:  # it samples for the win rate
            self.sampling.backend(ref, "reference")
        return [self.sampling.note(), f"reference {self.sampling.note('reference')}"]

    @property
    def beta(self) -> float:
        """This epoch's beta."""
        return beta_for_epoch(self.hparams.beta, self.current_epoch if self._trainer is not None else 0)

    # ------------------------------------------------------------------------------------- stages
    def sample_pairs(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Two completions per prompt, rows grouped by prompt."""
        return self.sampling.sample(self.model, self.tokenizer, batch, 2)

    def rank(self, rollout: dict[str, Any], stats: torch.nn.ModuleDict) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(which completion of each pair is chosen ``[N]``, the rewards ``[2N]`` after ``missing_eos_penalty`` or
        None with a judge)."""
        if self.judge is not None:
            return pair_from_judge(self.judge, rollout["prompts"][::2], rollout["texts"]).to(self.device), None
        _, total = score_rollout(self, rollout, stats)
        rewards = apply_missing_eos_penalty(total, ~rollout["truncated"].to(self.device), self.hparams.missing_eos_penalty)
        return pair_from_rewards(rewards), rewards

    def pair_logps(self, rollout: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Per-token log-probs ``[2N, T]`` of the sampled completions under the policy (with gradients when
        enabled) and the reference (no_grad), each row with its prompt's images when it has them."""
        from lightalign.modules.training.rollout_forward import grpo_forward

        from lightalign.datamodules.image_prompts import prompt_image_entries

        rows = {k: rollout[k].to(self.device) for k in ("prompt_ids", "prompt_mask", "completion_ids",
                                                        "completion_mask")}
        rows.update({k: v.to(self.device) for k, v in prompt_image_entries(rollout).items()})  # the prompts' images
        with self.training_forward_context():
            policy = grpo_forward(self.model, rows, 1.0)[0]
        with torch.no_grad(), self.reference.model_for(self.ref_model, self.model) as ref:
            reference = grpo_forward(ref, rows, 1.0)[0]
        return {"policy": policy, "reference": reference, "mask": rows["completion_mask"]}

    def pair_loss(self, rollout: dict[str, Any], stats: torch.nn.ModuleDict) -> torch.Tensor:
        choice, rewards = self.rank(rollout, stats)
        chosen, rejected = chosen_rejected_rows(choice)
        logps = self.pair_logps(rollout)
        mask = logps["mask"]
        policy, reference = masked_sums(logps["policy"], mask), masked_sums(logps["reference"], mask)
        lengths = mask.sum(-1).float()
        beta = self.beta
        losses, chosen_rewards, rejected_rewards = dpo_loss(
            policy[chosen], policy[rejected], reference[chosen], reference[rejected], beta=beta,
            loss_type=self.hparams.loss_type, chosen_lengths=lengths[chosen], rejected_lengths=lengths[rejected])
        loss = losses.mean()
        self.last_pair = {"chosen": chosen, "rejected": rejected, "rewards": rewards}
        with torch.no_grad():  # TRL's statistics
            kl = (policy - reference).detach()
            has_eos = (~rollout["truncated"]).float().to(self.device)
            update = {"loss": loss.detach(), "rewards/chosen": chosen_rewards.mean(),
                      "rewards/rejected": rejected_rewards.mean(),
                      "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
                      "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
                      "logps/chosen": policy[chosen].detach().mean(), "logps/rejected": policy[rejected].detach().mean(),
                      "objective/kl": kl.mean(), "objective/entropy": -policy.detach().mean(),
                      "objective/non_score_reward": (-beta * kl).mean(), "contain_eos_token": has_eos.mean(),
                      "beta": torch.tensor(beta)}
            if rewards is not None:
                update.update({"objective/scores": torch.nanmean(rewards),
                               "objective/scores_margin": torch.nanmean(rewards[chosen] - rewards[rejected]),
                               "objective/rlhf_reward": torch.nanmean(rewards - beta * kl)})
            for key, value in update.items():
                if not torch.isnan(value):
                    stats[metric_key(key)].update(value)
        return loss

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        rollout = self.sample_pairs(batch)
        self.last_batch_tokens = int(rollout["prompt_mask"].sum() + rollout["completion_mask"].sum())
        self.last_batch_samples = int(rollout["completion_ids"].shape[0])
        loss = self.pair_loss(rollout, self.train_stats)
        return self.add_router_aux_loss(loss)

    # ------------------------------------------------------------------------------------- validation
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        """Two samples per held prompt (a seeded stream of their own: validating changes no training draw), scored
        as in training (reward/mean, contain_eos_token, completion lengths); with a judge, the win rate."""
        with self.sampling.validation_stream(self, batch_idx):
            rollout = self.sample_pairs(batch)
            if self.judge is not None:
                self.eval_stats["win_rate"].update(self.win_rate(batch, rollout))
        if self.judge is None:
            score_rollout(self, rollout, self.eval_stats)
        else:
            self.eval_stats[metric_key("completions/mean_length")].update(
                rollout["completion_mask"].sum(-1).float().mean())
        self.eval_stats[metric_key("contain_eos_token")].update((~rollout["truncated"]).float().mean())

    def win_rate(self, batch: dict[str, Any], rollout: dict[str, Any]) -> torch.Tensor:
        """The judge's win rate of the policy's first completion of each pair against a completion the reference
        model samples for the same prompt (in validation's seeded stream, as the order of each pair shown)."""
        with self.reference.model_for(self.ref_model, self.model) as ref:
            reference = self.sampling.sample(ref, self.tokenizer, batch, 1, who="reference")
        policy_second = torch.rand(len(reference["texts"])) < 0.5
        return judged_win_rate(self.judge, rollout["prompts"][::2], rollout["texts"][::2], reference["texts"],
                               policy_second).to(self.device)
