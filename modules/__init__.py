"""LightningModules: one per post-training method, on the shared ``PolicyModule`` base."""

from lightalign.modules.training.policy import PolicyModule
from lightalign.modules.dpo import LOSS_TYPES, DPOModule, dpo_loss
from lightalign.modules.grpo import GRPOModule, grpo_loss
from lightalign.modules.ppo import PPOModule
from lightalign.modules.rloo import RLOOModule
from lightalign.modules.iterative_sft import IterativeSFT
from lightalign.modules.kto import KTOModule, kto_loss
from lightalign.modules.training.neftune import NEFTune
from lightalign.modules.reference.model import create_reference_model
from lightalign.modules.reward import RewardModule, reward_loss
from lightalign.modules.sft import SFTModule, sft_loss

__all__ = [
    "LOSS_TYPES", "DPOModule", "GRPOModule", "IterativeSFT", "KTOModule", "NEFTune", "PolicyModule", "PPOModule", "RewardModule", "RLOOModule",
    "SFTModule", "create_reference_model", "dpo_loss", "grpo_loss", "kto_loss", "reward_loss", "sft_loss",
]
