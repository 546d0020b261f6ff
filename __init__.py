"""lightalign: LLM post-training built on PyTorch Lightning: SFT, DPO, KTO, reward modelling, GRPO, RLOO, PPO and
iterative SFT.

Python API::

    import lightning as L
    from lightalign import SFTModule, SFTDataModule

    trainer = L.Trainer(max_steps=100)
    trainer.fit(SFTModule("Qwen/Qwen2.5-0.5B"), SFTDataModule("data.jsonl", tokenizer="Qwen/Qwen2.5-0.5B"))
"""

from pathlib import Path

from lightalign.callbacks import CompletionSamples, DeviceCacheCleanup, HFExport, NonFiniteGuard, TokenThroughput
from lightalign.datamodules import DataFormatError, PreferenceDataModule, PromptDataModule, SFTDataModule, UnpairedPreferenceDataModule
from lightalign.hub import ModelNotFoundError, load_causal_lm, load_tokenizer
from lightalign.strategies import AtomicCheckpointIO, CheckpointError
from lightalign.modules import (DPOModule, GRPOModule, IterativeSFT, KTOModule, NEFTune, PolicyModule, PPOModule, RewardModule, RLOOModule,
                                SFTModule, create_reference_model, dpo_loss, grpo_loss, kto_loss, reward_loss, sft_loss)

__version__ = "0.1.0"

#: Folder of the shipped tokenizer and tiny model configs (``assets/models/tiny`` etc.).
ASSETS_DIR = Path(__file__).resolve().parent / "assets"

__all__ = [
    "ASSETS_DIR",
    "AtomicCheckpointIO",
    "CheckpointError",
    "CompletionSamples",
    "DPOModule",
    "DeviceCacheCleanup",
    "DataFormatError",
    "GRPOModule",
    "RLOOModule",
    "HFExport",
    "IterativeSFT",
    "KTOModule",
    "ModelNotFoundError",
    "NEFTune",
    "NonFiniteGuard",
    "PolicyModule",
    "PPOModule",
    "PreferenceDataModule",
    "PromptDataModule",
    "RewardModule",
    "SFTDataModule",
    "SFTModule",
    "TokenThroughput",
    "UnpairedPreferenceDataModule",
    "create_reference_model",
    "dpo_loss",
    "grpo_loss",
    "kto_loss",
    "load_causal_lm",
    "load_tokenizer",
    "reward_loss",
    "sft_loss",
]
