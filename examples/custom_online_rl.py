"""A new online-RL method from the shared components: REINFORCE with a group-mean baseline in ~40 lines.

The loop (sampling on any backend, rewards, the rollout buffer, exact resume, every strategy, the fit-start checks)
is ``OnlineRLModule``'s; ``CriticFreeModule`` adds TRL's rollout schedule and the training layouts. The method
declares only its own knob (``baseline``, a knob group: defined, described and checked once) and objective
(``rollout_advantages`` and ``training_step``).

Run from the repository root:  python examples/custom_online_rl.py [--steps 4]
(It is also a LightningCLI class: ``lightalign fit --model examples.custom_online_rl.ReinforceModule ...`` with the
repository root on PYTHONPATH.)
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch

from lightalign import PromptDataModule
from lightalign.knobs import KnobGroup, knob, takes_knobs
from lightalign.modules.rollout.buffer import in_rollout_order, scatter_rows
from lightalign.modules.rollout.critic_free import CriticFreeModule
from lightalign.modules.rollout.scoring import metric_key

ROOT = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class ReinforceKnobs(KnobGroup):
    group = "reinforce"
    baseline: Literal["group", "none"] = knob("group", "``group``: the mean reward of the completion's group; "
                                                       "``none``: no baseline.")

    def check(self) -> None:
        if self.baseline not in ("group", "none"):
            raise ValueError(f"baseline={self.baseline!r} is unknown; use 'group' or 'none'.")


@takes_knobs(ReinforceKnobs)
class ReinforceModule(CriticFreeModule):
    """REINFORCE: ``loss = -mean_i(A_i * sum_t log pi(y_it))`` with ``A_i = r_i - baseline`` (every knob of
    ``CriticFreeModule``, ``OnlineRLModule`` and ``PolicyModule`` too)."""

    @property
    def uses_reference(self) -> bool:
        return False  # no KL term: no reference model is built

    def rollout_advantages(self, chunks: list[dict[str, torch.Tensor]]) -> None:
        (rewards,) = in_rollout_order(chunks, "rewards")
        rewards = torch.nan_to_num(rewards)  # a completion no reward function scored counts 0
        if self.knobs.reinforce.baseline == "group":
            groups = rewards.view(-1, self.hparams.num_generations)
            rewards = (groups - groups.mean(1, keepdim=True)).flatten()
        scatter_rows(chunks, advantages=rewards)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        mb, _ = self.next_micro_batch(batch)
        with self.training_forward_context():
            logps, _ = self.token_logps(self.model, mb)
        sequence_logps = (logps * mb["completion_mask"]).sum(-1)
        loss = -(mb["advantages"] * sequence_logps).mean()
        self.train_stats[metric_key("loss")].update(loss.detach())
        return loss


def main(steps: int = 4) -> ReinforceModule:
    from lightalign.rewards import digit_fraction_reward

    L.seed_everything(0)
    module = ReinforceModule(str(ROOT / "assets" / "models" / "tiny"), from_config=True,
                             reward_funcs=[digit_fraction_reward], num_generations=4, max_completion_length=8,
                             learning_rate=1e-2)
    data = PromptDataModule(str(ROOT / "examples" / "data" / "arithmetic_prompts.jsonl"),
                            tokenizer=str(ROOT / "assets" / "models" / "tiny"), max_prompt_length=16)
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0)
    trainer.fit(module, data)
    print(f"trained {trainer.global_step} steps; last rollout's mean reward "
          f"{sum(s['reward'] for s in module.last_samples) / len(module.last_samples):.3f}")
    return module


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    main(parser.parse_args().steps)
