"""``lightalign fit|validate|test --config ...``: a LightningCLI over lightalign's modules and datamodules.

The config names a module (``model: class_path: lightalign.SFTModule``) and a datamodule
(``data: class_path: lightalign.SFTDataModule``). The module's ``model_name_or_path`` is linked to the
datamodule's ``tokenizer``, so a config names the model once. Always present and configurable:
``--checkpoint.*`` (a ModelCheckpoint that keeps ``last.ckpt``), ``--export.*`` (the Hugging Face export at the
end of fit), ``--throughput.*`` (tokens/s in the progress bar and the logger), ``--progress_bar.*`` (one line
every N steps when stdout is not a terminal), ``--summary.*`` (a table at the end of fit) and ``--plot.*`` (the
learning curves as ``curves.png``). ``config.yaml`` and ``versions.json`` are saved in every run's folder.
``lightalign plot RUN_DIR ...`` draws the curves of finished runs (``lightalign.plotting``).
"""

from __future__ import annotations

import os
import sys

import lightning as L
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint, ProgressBar
from lightning.pytorch.cli import LightningCLI

from lightalign.callbacks import (CompletionSamples, HFExport, PlotCurves, RunSummary, SaveRunConfig, StepProgressBar,
                                  TokenThroughput)
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
Learning curves of finished runs: lightalign plot RUN_DIR [RUN_DIR ...] (see lightalign plot --help)
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
        kwargs.setdefault("save_config_callback", SaveRunConfig)  # config.yaml + versions.json in the run folder
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
        parser.add_lightning_class_args(StepProgressBar, "progress_bar")
        parser.add_lightning_class_args(PlotCurves, "plot")
        parser.add_lightning_class_args(RunSummary, "summary")  # after PlotCurves: the table names the PNG
        parser.add_lightning_class_args(RankLogging, "logging")

    def instantiate_trainer(self, **kwargs):
        # The StepProgressBar steps aside when the progress bar is off or the config brings its own (Lightning
        # refuses both situations otherwise).
        config = {**self._get(self.config_init, "trainer", default={}), **kwargs}
        own = config.get("callbacks") or []
        own = own if isinstance(own, list) else [own]
        skip_bar = config.get("enable_progress_bar") is False or any(isinstance(c, ProgressBar) for c in own)
        keys = [k for k in self._parser(self.subcommand).callback_keys if not (k == "progress_bar" and skip_bar)]
        return self._instantiate_trainer(config, [self._get(self.config_init, k) for k in keys])

    def before_fit(self) -> None:
        check_multinode_env(self.trainer.num_nodes)  # before any process group: a missing variable would hang


def main(args: list[str] | None = None):
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    argv = list(sys.argv[1:] if args is None else args)
    if argv[:1] == ["plot"]:  # not a Trainer subcommand: handled before LightningCLI parses
        from lightalign.plotting import main as plot_main

        return plot_main(argv[1:])  # the matplotlib Figure
    LightalignCLI(args=args)


if __name__ == "__main__":
    main()
