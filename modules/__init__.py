"""LightningModules: one per post-training method, on the shared ``PolicyModule`` base."""

from lightalign.modules.base import PolicyModule
from lightalign.modules.sft import SFTModule, sft_loss

__all__ = ["PolicyModule", "SFTModule", "sft_loss"]
