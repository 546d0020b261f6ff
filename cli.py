"""``lightalign fit|validate|test --config ...``: a LightningCLI over lightalign's modules and datamodules.

The config names a module (``model: class_path: lightalign.SFTModule``) and a datamodule
(``data: class_path: lightalign.SFTDataModule``). The module's ``model_name_or_path`` is linked to the
datamodule's ``tokenizer``, so a config names the model once. Always present and configurable:
``--checkpoint.*`` (a ModelCheckpoint that keeps ``last.ckpt``), ``--export.*`` (the Hugging Face export at the
end of fit) and ``--throughput.*`` (tokens/s in the progress bar and the logger).
"""

from __future__ import annotations

import os

import lightning as L
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.cli import LightningCLI

from lightalign.callbacks import CompletionSamples, HFExport, TokenThroughput
from lightalign.modules.base import PolicyModule
from lightalign.strategies.launch import RankLogging, check_multinode_env

TRAINER_DEFAULTS = {
    "logger": {
        "class_path": "lightning.pytorch.loggers.CSVLogger",
        "init_args": {"save_dir": "runs", "name": "lightalign"},
    },
    "log_every_n_steps": 1,
    "plugins": [{"class_path": "lightalign.strategies.AtomicCheckpointIO"}],
}


KNOB_HELP = """lightalign: SFT, DPO and GRPO on PyTorch Lightning.

The method and data knobs belong to the classes a config names; list them with
  lightalign fit --model.help lightalign.SFTModule     (also DPOModule, GRPOModule)
  lightalign fit --data.help lightalign.SFTDataModule  (also PreferenceDataModule, PromptDataModule)
or, for the classes of a config: lightalign fit --config configs/sft.yaml --print_config
"""


class LightalignCLI(LightningCLI):
    """LightningCLI with lightalign's defaults (see the module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("model_class", PolicyModule)
        kwargs.setdefault("datamodule_class", L.LightningDataModule)
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("trainer_defaults", TRAINER_DEFAULTS)
        kwargs.setdefault("seed_everything_default", 42)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        # Optimizers and schedules belong to the module (they must see the lazily built model and step per
        # optimizer step), so the top-level --optimizer/--lr_scheduler of LightningCLI are not offered.
        kwargs.setdefault("auto_configure_optimizers", False)
        super().__init__(*args, **kwargs)

    def add_arguments_to_parser(self, parser) -> None:
        parser.description = KNOB_HELP
        parser.link_arguments("model.init_args.model_name_or_path", "data.init_args.tokenizer", apply_on="parse")
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.set_defaults({"checkpoint.save_last": True, "checkpoint.save_top_k": 0})
        parser.add_lightning_class_args(HFExport, "export")
        parser.add_lightning_class_args(TokenThroughput, "throughput")
        parser.add_lightning_class_args(LearningRateMonitor, "lr_monitor")
        parser.add_lightning_class_args(CompletionSamples, "completions")
        parser.set_defaults({"lr_monitor.logging_interval": "step"})
        parser.add_lightning_class_args(RankLogging, "logging")

    def before_fit(self) -> None:
        check_multinode_env(self.trainer.num_nodes)  # before any process group: a missing variable would hang


def main(args: list[str] | None = None) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    LightalignCLI(args=args)


if __name__ == "__main__":
    main()
