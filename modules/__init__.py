"""LightningModules, one per post-training method, composed from the concept folders beside them: training/ (the
shared ``PolicyModule`` plumbing), losses/, rollout/ (the online-RL loop GRPO, RLOO and PPO build on), generation/
(samplers), reference/ and adaptations/."""

from lightalign.modules.dpo import LOSS_TYPES, DPOModule, dpo_loss
from lightalign.modules.grpo import GRPOModule, grpo_loss
from lightalign.modules.iterative_sft import IterativeSFT
from lightalign.modules.kto import KTOModule, kto_loss
from lightalign.modules.ppo import PPOModule
from lightalign.modules.reference.model import create_reference_model
from lightalign.modules.reward import RewardModule, reward_loss
from lightalign.modules.rloo import RLOOModule
from lightalign.modules.rollout.critic_free import CriticFreeModule
from lightalign.modules.rollout.module import OnlineRLModule
from lightalign.modules.sft import SFTModule, sft_loss
from lightalign.modules.training.neftune import NEFTune
from lightalign.modules.training.policy import PolicyModule

__all__ = [
    "LOSS_TYPES", "CriticFreeModule", "DPOModule", "GRPOModule", "IterativeSFT", "KTOModule", "NEFTune",
    "OnlineRLModule", "PolicyModule", "PPOModule", "RewardModule", "RLOOModule", "SFTModule", "create_reference_model",
    "dpo_loss", "grpo_loss", "kto_loss", "reward_loss", "sft_loss",
]
