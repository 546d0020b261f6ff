"""lightalign: LLM post-training built on PyTorch Lightning: SFT, DPO, KTO, reward modelling, GRPO, RLOO, PPO,
iterative SFT and distillation (GKD, on-policy).

Python API::

    from lightalign import SFTModule, SFTDataModule, Trainer

    trainer = Trainer(max_steps=100, name="my-sft")  # the console's logger, checkpoints, export: runs/my-sft/version_N
    trainer.fit(SFTModule("Qwen/Qwen2.5-0.5B"), SFTDataModule("data.jsonl", tokenizer="Qwen/Qwen2.5-0.5B"))

``lightning.Trainer`` works too; it writes only what its own arguments ask for (``lightalign.trainer``).
"""

from pathlib import Path

from lightalign._lazy import lazy_attributes

__version__ = "0.1.0"

#: Folder of the shipped tokenizer and tiny model configs (``assets/models/tiny`` etc.).
ASSETS_DIR = Path(__file__).resolve().parent / "assets"

_EXPORTS = {
    **dict.fromkeys(["CompletionSamples", "DeviceCacheCleanup", "HFExport", "HubPush", "NonFiniteGuard",
                     "TokenThroughput"],
                    "lightalign.callbacks"),
    **dict.fromkeys(["DataFormatError", "PreferenceDataModule", "PromptDataModule", "SFTDataModule",
                     "UnpairedPreferenceDataModule"], "lightalign.datamodules"),
    **dict.fromkeys(["ModelNotFoundError", "load_causal_lm", "load_tokenizer"], "lightalign.hub"),
    **dict.fromkeys(["AtomicCheckpointIO", "CheckpointError"], "lightalign.strategies"),
    "Trainer": "lightalign.trainer",
    "GOLDModule": "lightalign.modules",
    **dict.fromkeys(["A2POModule"], "lightalign.modules"),
    **dict.fromkeys(["DistillModule", "DPOModule", "GRPOModule", "IterativeSFT", "KTOModule", "NEFTune", "OnlineDPOModule", "PolicyModule", "PPOModule",
                     "RewardModule", "RLOOModule", "SDFTModule", "SDPOModule", "SFTModule", "create_reference_model", "dpo_loss", "grpo_loss",
                     "kto_loss", "reward_loss", "sft_loss"], "lightalign.modules"),
    **dict.fromkeys(["CPOModule", "ORPOModule", "cpo_loss", "orpo_loss"], "lightalign.modules"),
    **dict.fromkeys(["TPOModule", "tpo_loss"], "lightalign.modules"),
    "TriplePreferenceDataModule": "lightalign.datamodules",
}
__getattr__, __dir__ = lazy_attributes(__name__, _EXPORTS)

__all__ = [
    "A2POModule",
    "ASSETS_DIR",
    "AtomicCheckpointIO",
    "CheckpointError",
    "CompletionSamples",
    "CPOModule",
    "DPOModule",
    "DeviceCacheCleanup",
    "DistillModule",
    "GOLDModule",
    "SDFTModule",
    "SDPOModule",
    "DataFormatError",
    "GRPOModule",
    "RLOOModule",
    "HFExport",
    "HubPush",
    "IterativeSFT",
    "KTOModule",
    "ModelNotFoundError",
    "NEFTune",
    "OnlineDPOModule",
    "ORPOModule",
    "NonFiniteGuard",
    "PolicyModule",
    "PPOModule",
    "PreferenceDataModule",
    "PromptDataModule",
    "RewardModule",
    "SFTDataModule",
    "SFTModule",
    "TokenThroughput",
    "TPOModule",
    "Trainer",
    "TriplePreferenceDataModule",
    "UnpairedPreferenceDataModule",
    "create_reference_model",
    "cpo_loss",
    "dpo_loss",
    "grpo_loss",
    "kto_loss",
    "load_causal_lm",
    "load_tokenizer",
    "orpo_loss",
    "reward_loss",
    "sft_loss",
    "tpo_loss",
]
