"""``lightalign fit|validate|test --config ...``: a LightningCLI over lightalign's modules and datamodules.

The config names a module (``model: class_path: lightalign.SFTModule``) and a datamodule
(``data: class_path: lightalign.SFTDataModule``). The module's ``model_name_or_path`` is linked to the
datamodule's ``tokenizer``, so a config names the model once. Always present and configurable (one group per
callback of ``lightalign.trainer.RUN_CALLBACKS``, which ``lightalign.Trainer`` builds from too):
``--checkpoint.*`` (a ModelCheckpoint that keeps ``last.ckpt``, also at the final step), ``--export.*`` (the
Hugging Face export at the end of fit), ``--throughput.*`` (tokens/s in the progress bar and the logger),
``--progress_bar.*`` (one line every N steps when stdout is not a terminal), ``--summary.*`` (a table at the end of fit) and ``--plot.*`` (the
learning curves as ``curves.png``), and ``--hub.*`` (push the export to the Hugging Face Hub: docs/hub.md).
``config.yaml`` and ``versions.json`` are saved in every run's folder.
``lightalign plot RUN_DIR ...`` draws the curves of finished runs (``lightalign.plotting``).

Runs and resume (``lightalign.runs``): everything a run writes goes into one run folder; ``--ckpt_path last``
continues the newest run of the config in its folder, after checking the checkpoint against the config.
lightalign's own errors (bad data, config, checkpoint) print as one message and exit 1, config and option errors as
one message naming the file, line and key and exit 2 (``cli_errors``); ``--debug`` or ``LIGHTALIGN_DEBUG=1`` shows
the traceback.
"""

from __future__ import annotations

import os
import re
import sys
from argparse import RawDescriptionHelpFormatter

import lightning as L
from jsonargparse import DefaultHelpFormatter
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities import rank_zero_warn

from lightalign.callbacks import HFExport, HubPush, RunFolder, SaveRunConfig
from lightalign.cli_errors import OneLineErrorParser, OptionError, check_trainer_can_run, trainer_refusal
from lightalign.modules.training.policy import PolicyModule
from lightalign.quiet import ReleaseHeldLines
from lightalign.run_fit import fit_run
from lightalign.runs import RunError, callback_of
from lightalign.strategies.launch import check_multinode_env, cpu_processes_note
from lightalign.strategies.rank_death import rank_death, watch_ranks
from lightalign.trainer import RUN_CALLBACKS, TRAINER_DEFAULTS, run_callbacks


KNOB_HELP = """lightalign: LLM post-training on PyTorch Lightning: SFT, DPO, KTO, reward models, GRPO, RLOO, PPO,
distillation, online DPO, CPO/SimPO/AlphaPO and ORPO (iterative SFT from Python: lightalign.IterativeSFT).

The method and data knobs belong to the classes a config names; list them with
  lightalign fit --model.help lightalign.SFTModule     (also DPOModule, GRPOModule, RLOOModule, KTOModule,
                                                       RewardModule, PPOModule, DistillModule, OnlineDPOModule,
                                                       CPOModule, ORPOModule, TPOModule, GOLDModule,
                                                       SDFTModule, SDPOModule, A2POModule)
  lightalign fit --data.help lightalign.SFTDataModule  (also PreferenceDataModule, PromptDataModule,
                                                       UnpairedPreferenceDataModule, TriplePreferenceDataModule)
or, for the classes of a config: lightalign fit --config configs/sft.yaml --print_config
Learning curves of finished runs: lightalign plot RUN_DIR [RUN_DIR ...] (see lightalign plot --help)
The shipped configs, tiny model assets and example data, into a folder to run them from: lightalign examples DIR
Continue the newest run of a config in its folder: lightalign fit --config X --ckpt_path last
Errors print as one message; --debug (or LIGHTALIGN_DEBUG=1) prints the traceback.
"""
DEBUG_ENV = "LIGHTALIGN_DEBUG"
NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")



class HelpFormatter(RawDescriptionHelpFormatter, DefaultHelpFormatter):
    """jsonargparse's help pages, with KNOB_HELP's lines kept as written."""


class LightalignCLI(LightningCLI):
    """LightningCLI with lightalign's defaults (see the module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        import lightalign
        import lightalign.datamodules as datamodules

        for package in (lightalign, datamodules):  # every method and data module imported: `--model GRPOModule`,
            for name in package.__all__:  # `--data PromptDataModule` and the help list them
                getattr(package, name)
        kwargs.setdefault("parser_class", OneLineErrorParser)  # option errors in one line, no usage dump
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
        self.run_folder = RunFolder()
        super().__init__(*args, **kwargs)

    def init_parser(self, **kwargs):
        kwargs.setdefault("description", KNOB_HELP)  # `lightalign --help` names the subcommands and `plot`
        kwargs.setdefault("formatter_class", HelpFormatter)
        parser = super().init_parser(**kwargs)
        # argparse takes `-1e-3` for an option (its negative-number pattern has no exponent), so
        # `--model.learning_rate -1e-3` failed with "expected one argument" instead of reaching the knob's check.
        parser._negative_number_matcher = NEGATIVE_NUMBER
        return parser

    def add_core_arguments_to_parser(self, parser) -> None:
        # As LightningCLI's, except that the modules' `model` argument (a built torch.nn.Module, Python API only)
        # is not offered (nor DistillModule's `teacher_model`): `--model.help` would list every torch.nn.Module subclass
        # for it.
        parser.add_lightning_class_args(self.trainer_class, "trainer")
        parser.set_defaults({"trainer." + k: v for k, v in self.trainer_defaults.items() if k != "callbacks"})
        parser.add_subclass_arguments(self._model_class, "model", fail_untyped=False, required=True,
                                     skip={"model", "teacher_model"})
        parser.add_subclass_arguments(self._datamodule_class, "data", fail_untyped=False, required=True)

    def add_arguments_to_parser(self, parser) -> None:
        parser.description = KNOB_HELP
        parser.link_arguments("model.init_args.model_name_or_path", "data.init_args.tokenizer", apply_on="parse")
        for entry in RUN_CALLBACKS:  # --checkpoint.*, --export.*, ...: one group per callback every run gets
            parser.callback_keys.append(entry.key)
            parser.add_class_arguments(entry.cls, entry.key, fail_untyped=False, sub_configs=True,
                                       skip=set(entry.skip) or None)
            parser.set_defaults({f"{entry.key}.{name}": value for name, value in entry.defaults.items()})

    def _parse_ckpt_path(self) -> None:
        # LightningCLI would replace the config's --model.* with the checkpoint's hyperparameters (another model
        # trains, silently); lightalign keeps the config and checks the checkpoint against it instead (fit below).
        return

    def instantiate_trainer(self, **kwargs):
        # The --<key>.* groups' callbacks that run_callbacks keeps, as for lightalign.Trainer: a callback of the
        # config's own (trainer.callbacks) of a group's class replaces that group's; a feature switched off
        # (enable_progress_bar, enable_checkpointing, logger) drops the callback that needs it.
        config = {**self._get(self.config_init, "trainer", default={}), **kwargs}
        own = config.get("callbacks") or []
        own = own if isinstance(own, list) else [own]
        run = run_callbacks(config, own, lambda entry: self._get(self.config_init, entry.key))
        try:
            return self._instantiate_trainer(config, [ReleaseHeldLines(), self.run_folder, *run])
        except Exception as err:  # an unknown strategy, a GPU that is not there: one line naming the settings
            refusal = trainer_refusal(err, config)
            if refusal is None:
                raise
            raise refusal from err

    def before_fit(self) -> None:
        check_multinode_env(self.trainer.num_nodes)  # before any process group: a missing variable would hang
        watch_ranks(self.trainer)  # a child rank that dies: one line naming it (RankWatch)
        check_trainer_can_run(self.trainer)  # DeepSpeed on CPU, an unwritable logger folder
        note = cpu_processes_note(type(self.trainer.accelerator).__name__.replace("Accelerator", "").lower(),
                                  self.trainer.num_devices)
        if note:
            rank_zero_warn(note)
        hub = callback_of(self.trainer, HubPush)
        if hub is not None:  # HF_HUB_OFFLINE, no repository name: refused before the data is read or the model loads
            export = callback_of(self.trainer, HFExport)
            hub.check_local(export.output_dir if export is not None and export.enabled else None)

    def fit(self, model: L.LightningModule, datamodule: L.LightningDataModule | None = None,
            ckpt_path: str | None = None, **kwargs) -> None:
        try:
            fit_run(self.trainer, self.trainer.fit, model, datamodule, ckpt_path, **kwargs)  # --ckpt_path last: fit_run
        except Exception as err:
            death = rank_death(self.trainer, err)  # None unless a rank this process started died
            if death is None:
                raise
            raise death from err


def main(args: list[str] | None = None) -> int:
    """The ``lightalign`` console script: 0 on success, 1 on an error of lightalign's own (printed as one message)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    argv = list(sys.argv[1:] if args is None else args)
    if "--debug" in argv:
        os.environ[DEBUG_ENV] = "1"  # also for the processes a DDP launch starts
        argv = [a for a in argv if a != "--debug"]
        if args is None:
            sys.argv = [sys.argv[0], *argv]
    debug = os.environ.get(DEBUG_ENV, "") not in ("", "0")
    try:
        if argv[:1] == ["plot"]:  # not a Trainer subcommand: handled before LightningCLI parses
            from lightalign.plotting import main as plot_main

            return plot_main(argv[1:])
        if argv[:1] == ["examples"]:  # copies the shipped configs and data out of an installed package
            from lightalign.shipped import main as examples_main

            return examples_main(argv[1:])
        from lightalign.quiet import console_quiet

        with console_quiet():  # library messages a user cannot act on (console_quiet), for this command only
            LightalignCLI(args=None if args is None else argv)
        return 0
    except OptionError as err:
        if debug:
            raise
        print(f"lightalign: error: {err.describe(argv)}", file=sys.stderr)
        return 2
    except Exception as err:
        user = user_error_of(err)
        if debug or user is None:
            raise
        print(f"lightalign: error: {user}\n(run with --debug or {DEBUG_ENV}=1 for the traceback)", file=sys.stderr)
        return 1


def user_error_of(err: BaseException) -> BaseException | None:
    """``err``, or the error it was raised from, when that is a user error (``is_user_error``): jsonargparse
    re-raises a class's construction error (e.g. ``learning_rate must be > 0``) as its own."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        if is_user_error(err):
            return err
        seen.add(id(err))
        err = err.__cause__
    return None


def is_user_error(err: BaseException) -> bool:
    """An error lightalign raised about the user's input (data, config, checkpoint, reward function): its message
    says what to do, so the traceback is noise. Anything else (a bug, an error inside a library) keeps it."""
    from lightalign.callbacks.hub_push import HubPushError
    from lightalign.datamodules.formats import DataFormatError
    from lightalign.hub import ModelNotFoundError
    from lightalign.modules.agent.environments import EnvironmentCallError
    from lightalign.rewards.resolve import RewardImportError
    from lightalign.rewards.runner import RewardFunctionError
    from lightalign.strategies.checkpoint_io import CheckpointError

    if isinstance(err, (DataFormatError, CheckpointError, RunError, ModelNotFoundError, RewardFunctionError,
                        RewardImportError, EnvironmentCallError, HubPushError)):
        return True
    if not isinstance(err, (ValueError, TypeError, FileNotFoundError, FloatingPointError)):
        return False
    if err.__traceback__ is None:
        return False
    module = _module_of(err.__traceback__)
    return module == "lightalign" or module.startswith("lightalign.")


def _module_of(tb) -> str:
    """The module of the innermost frame of a traceback (where the exception was raised)."""
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_globals.get("__name__", "")


if __name__ == "__main__":
    sys.exit(main())
