"""``lightalign.Trainer``: a Python run writes what the console run of the same config writes
(``lightalign/trainer.py``), and ``fit(..., ckpt_path="last")`` continues its run folder as ``--ckpt_path last``
does (``lightalign/runs.py``).

The Python runs are built from the shipped YAML configs (the module, the datamodule, the ``trainer:`` section and the
callbacks' sections as ``Trainer`` keyword arguments), in-process, in a working folder of their own; the console
runs are the ``lightalign`` script on the same config (tests/helpers/console_script.py).
"""

from __future__ import annotations

import csv
import importlib
import logging
from pathlib import Path

import lightning as L
import pytest
import yaml

from helpers import console_script

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
# What differs between two runs of the same steps: wall-clock rates
TIMING = ("train/tokens_per_sec", "train/samples_per_sec", "train/tflops_per_sec")


def _absolute(value):
    """A repository-relative path of a shipped config as an absolute one (the Python runs work in tmp folders)."""
    relative = isinstance(value, str) and not Path(value).is_absolute() and (REPO / value).exists()
    return str(REPO / value) if relative else value


def _instance(section: dict):
    module, _, name = section["class_path"].rpartition(".")
    args = {k: _absolute(v) for k, v in (section.get("init_args") or {}).items()}
    return getattr(importlib.import_module(module), name)(**args)


def python_run(config: str, *, ckpt_path: str | None = None, **trainer_args):
    """Fit ``configs/<config>`` through ``lightalign.Trainer`` in the working folder (the console's run, seed
    included); ``trainer_args`` override the config's ``trainer:`` and callback sections. Returns the trainer."""
    from lightalign import Trainer
    from lightalign.trainer import RUN_CALLBACKS

    cfg = yaml.safe_load((REPO / "configs" / config).read_text())
    L.seed_everything(cfg.get("seed_everything", 42))
    module = _instance(cfg["model"])
    cfg["data"]["init_args"].setdefault("tokenizer", cfg["model"]["init_args"]["model_name_or_path"])  # the CLI's link
    data = _instance(cfg["data"])
    trainer = dict(cfg["trainer"])
    name = trainer.pop("logger")["init_args"]["name"]
    sections = {entry.key: cfg[entry.key] for entry in RUN_CALLBACKS if entry.key in cfg}
    trainer = Trainer(**{**trainer, **sections, **trainer_args}, name=name)
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return trainer


def console_run(config: str, save_dir: Path, *args: str) -> Path:
    """``lightalign fit --config configs/<config> ...`` writing under ``save_dir``; its run folder."""
    console_script.expect(REPO, "fit", "--config", f"configs/{config}", "--trainer.logger.init_args.save_dir",
                          str(save_dir), *args)
    name = yaml.safe_load((REPO / "configs" / config).read_text())["trainer"]["logger"]["init_args"]["name"]
    return save_dir / name / "version_0"


def rows(run: Path) -> tuple[list[str], list[dict[str, str]]]:
    with open(run / "metrics.csv", newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames), list(reader)


def steps_of(table: list[dict[str, str]], key: str) -> list[int]:
    return [int(row["step"]) for row in table if row.get(key)]


def files(run: Path) -> set[str]:
    return {str(p.relative_to(run)) for p in run.rglob("*") if p.is_file()}


def loads_with_transformers(folder: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    out = model.generate(**tokenizer("12+7=", return_tensors="pt"), max_new_tokens=2, do_sample=False)
    assert out.shape[1] > 1


@pytest.mark.parametrize("config, steps, args", [
    # SFT: the quickstart, validating at step 2 (plot.enabled in the config: curves.png)
    ("quickstart.yaml", 3, {"val_check_interval": 2, "limit_val_batches": 1}),
    # GRPO: the sampling statistics go to the logger only on its steps (log_every_n_steps: 1 -> every step)
    ("grpo_quickstart.yaml", 2, {"val_check_interval": 2}),
], ids=["sft", "grpo"])
def test_a_python_run_writes_what_the_console_run_of_its_config_writes(config, steps, args, tmp_path, monkeypatch):
    """Mutations, each failing here: HFExport dropped from RUN_CALLBACKS (no hf_model/ in the Python run, no
    --export group); log_every_n_steps back to Lightning's 50 (train/loss of step 0 only, sampling columns missing);
    no RunVersions (no versions.json); RankLogging without its teardown (the log levels stay changed)."""
    from lightalign.strategies.launch import LOGGERS

    console = console_run(config, tmp_path / "console", "--trainer.max_steps", str(steps),
                          *[a for k, v in args.items() for a in (f"--trainer.{k}", str(v))])
    monkeypatch.chdir(tmp_path)
    import datasets
    import transformers

    datasets.logging.get_verbosity(), transformers.logging.get_verbosity()  # each sets its own level on first use
    levels = {name: logging.getLogger(name).level for name in LOGGERS}
    trainer = python_run(config, max_steps=steps, **args)
    run = trainer.run_dir.resolve()
    assert run == (tmp_path / "runs" / console.parent.name / "version_0").resolve()
    # the same files (the console's config.yaml is LightningCLI's config; the module's knobs are in hparams.yaml)
    assert files(console) - files(run) == {"config.yaml"} and files(run) == files(console) - {"config.yaml"}
    assert {"metrics.csv", "versions.json", "hparams.yaml", "checkpoints/last.ckpt", "hf_model/README.md",
            "curves.png"} <= files(run)
    columns, table = rows(run)
    console_columns, console_table = rows(console)
    assert columns == console_columns
    assert steps_of(table, "train/loss") == list(range(steps)) == steps_of(console_table, "train/loss")
    assert steps_of(table, "val/loss" if config == "quickstart.yaml" else "val/reward/mean") == [1]  # after step 2
    if config == "grpo_quickstart.yaml":  # a sampling statistic of every step (not only the logger's every 50th)
        assert steps_of(table, "train/completions/mean_length") == list(range(steps))
    loads_with_transformers(run / "hf_model")
    assert {name: logging.getLogger(name).level for name in LOGGERS} == levels  # RankLogging undone at teardown


def test_python_and_console_runs_get_the_same_callbacks_with_the_same_settings(tmp_path, monkeypatch):
    """The console's trainer and lightalign.Trainer, from the same config, carry callbacks of the same classes in the
    same order with the same arguments (one table). Mutation: LightalignCLI.instantiate_trainer keeping its own list
    (e.g. the learning-rate monitor dropped) -> fails."""
    from lightalign import Trainer
    from lightalign.cli import LightalignCLI
    from lightalign.trainer import RUN_CALLBACKS

    monkeypatch.chdir(tmp_path)
    cli = LightalignCLI(args=["--config", str(REPO / "configs" / "quickstart.yaml"), "--model.model_name_or_path",
                              str(REPO / "assets" / "models" / "tiny")], run=False)
    cfg = yaml.safe_load((REPO / "configs" / "quickstart.yaml").read_text())
    python = Trainer(accelerator="cpu", name="quickstart", checkpoint=cfg["checkpoint"], plot=cfg["plot"])
    classes = tuple(entry.cls for entry in RUN_CALLBACKS)

    def run_callbacks(trainer):
        return [c for c in trainer.callbacks if isinstance(c, classes)]

    def settings(callback):
        return {k: v for k, v in vars(callback).items() if isinstance(v, (int, float, str, bool, type(None)))}

    console_side, python_side = run_callbacks(cli.trainer), run_callbacks(python)
    # Lightning moves the checkpoint callbacks last, in both
    assert [type(c) for c in console_side] == [type(c) for c in python_side]
    assert sorted(type(c).__name__ for c in python_side) == sorted(cls.__name__ for cls in classes)
    for a, b in zip(console_side, python_side):
        assert settings(a) == settings(b), type(a).__name__
    assert python.log_every_n_steps == cli.trainer.log_every_n_steps == 1
    assert type(python.strategy.checkpoint_io) is type(cli.trainer.strategy.checkpoint_io)
    assert type(python.strategy.checkpoint_io).__name__ == "AtomicCheckpointIO"


def test_own_callbacks_replace_the_defaults_and_switches_drop_them(tmp_path, monkeypatch):
    """A callback of a run class replaces the default one; logger/checkpointing/progress bar off drop what needs
    them; a keyword section and its own callback together, or a name beside another logger, are refused. Mutation:
    run_callbacks not skipping replaced entries -> two HFExports, fails."""
    import inspect

    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint, TQDMProgressBar
    from lightning.pytorch.loggers import CSVLogger

    from lightalign import HFExport, Trainer
    from lightalign.callbacks import StepProgressBar
    from lightalign.trainer import RUN_CALLBACKS

    monkeypatch.chdir(tmp_path)

    def of(trainer, cls):
        return [c for c in trainer.callbacks if isinstance(c, cls)]

    mine = HFExport(output_dir="mine")
    assert of(Trainer(callbacks=[mine]), HFExport) == [mine]
    assert of(Trainer(export={"every_n_train_steps": 5}), HFExport)[0].every_n_train_steps == 5
    bar = TQDMProgressBar(refresh_rate=3)
    assert of(Trainer(callbacks=[bar]), TQDMProgressBar) == [bar]
    assert not of(Trainer(enable_progress_bar=False), StepProgressBar)
    assert not of(Trainer(enable_checkpointing=False), ModelCheckpoint)
    off = Trainer(logger=False)
    assert not off.loggers and not of(off, LearningRateMonitor)
    assert of(off, HFExport) and of(off, ModelCheckpoint)
    with pytest.raises(ValueError, match="Pass one of them"):
        Trainer(export={"output_dir": "a"}, callbacks=[HFExport(output_dir="b")])
    with pytest.raises(ValueError, match="names the default CSVLogger"):
        Trainer(name="x", logger=CSVLogger("elsewhere"))
    # the callbacks' keyword arguments never shadow one of Lightning's
    assert not {entry.key for entry in RUN_CALLBACKS} & set(inspect.signature(L.Trainer.__init__).parameters)


def test_own_export_and_no_logger_fit(tmp_path, monkeypatch):
    """logger=False: the run trains, checkpoints and exports into runs/lightalign/version_0 (runs.py's folder for a
    run without a logger); the user's HFExport(output_dir=...) writes there instead of the default hf_model/."""
    from lightalign import HFExport, SFTDataModule, SFTModule, Trainer

    monkeypatch.chdir(tmp_path)
    tiny = str(REPO / "assets" / "models" / "tiny")
    trainer = Trainer(accelerator="cpu", max_steps=2, logger=False, callbacks=[HFExport(output_dir="mine")])
    trainer.fit(SFTModule(tiny, from_config=True),
                SFTDataModule(str(REPO / "examples" / "data" / "arithmetic_sft.jsonl"), tokenizer=tiny, batch_size=4))
    run = trainer.run_dir
    assert run.resolve() == (tmp_path / "runs" / "lightalign" / "version_0").resolve()
    assert (run / "checkpoints" / "last.ckpt").is_file() and not (run / "hf_model").exists()
    assert not (run / "metrics.csv").exists()
    loads_with_transformers(tmp_path / "mine")


def test_a_python_run_resumed_with_ckpt_path_last_continues_its_folder(tmp_path, monkeypatch):
    """Stopped at max_steps 2, the same script with max_steps 4 and ckpt_path="last" continues version_0 (no
    version_1), and its metrics.csv is the uninterrupted 4-step run's, row for row (wall-clock rates aside).
    Mutations: prepare_resume not pinning the version -> version_1, fails; continue_logs skipped -> the rows of
    steps 0-1 are lost (Lightning's CSVLogger rewrites the file), fails."""
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    python_run("quickstart.yaml", max_steps=4, val_check_interval=2, limit_val_batches=1, plot={"enabled": False})
    monkeypatch.chdir(tmp_path / "b")
    args = dict(val_check_interval=2, limit_val_batches=1, plot={"enabled": False})
    first = python_run("quickstart.yaml", max_steps=2, ckpt_path="last", **args)  # no earlier run: a new one
    resumed = python_run("quickstart.yaml", max_steps=4, ckpt_path="last", **args)
    run = Path("runs/quickstart/version_0")
    assert first.run_dir == resumed.run_dir == run and sorted(p.name for p in run.parent.iterdir()) == ["version_0"]
    columns, table = rows(run)
    whole_columns, whole = rows(tmp_path / "a" / run)
    assert columns == whole_columns and len(table) == len(whole)
    for got, want in zip(table, whole):
        assert {k: v for k, v in got.items() if k not in TIMING} == {k: v for k, v in want.items() if k not in TIMING}
    assert steps_of(table, "train/loss") == [0, 1, 2, 3] and steps_of(table, "val/loss") == [1, 3]


def test_max_steps_zero_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    """Lightning stops at once at max_steps=0 and the export would write the untrained model with a model card:
    refused in the Python API as on the console (``run_fit.fit_run``; mutation: the check left in the CLI only -> the
    Python fit exports random weights)."""
    from lightalign import SFTDataModule, SFTModule, Trainer
    from lightalign.runs import RunError

    monkeypatch.chdir(tmp_path)
    tiny = str(REPO / "assets" / "models" / "tiny")
    trainer = Trainer(accelerator="cpu", max_steps=0, name="zero")
    with pytest.raises(RunError, match=r"max_steps is 0 \(max_steps=0\): there is nothing to train"):
        trainer.fit(SFTModule(tiny, from_config=True),
                    SFTDataModule(str(REPO / "examples" / "data" / "arithmetic_sft.jsonl"), tokenizer=tiny))
    assert not list(tmp_path.rglob("hf_model")) and not list(tmp_path.rglob("metrics.csv"))


def test_lightnings_refusal_names_the_setting_it_is_about():
    """``trainer_refusal`` names the ``--trainer.*`` settings the refusal mentions (a negative max_steps), not the
    accelerator and devices beside them (mutation: the fixed list of accelerator/strategy/devices/precision -> the
    message names --trainer.accelerator cpu)."""
    from lightalign.cli_errors import trainer_refusal

    with pytest.raises(Exception) as raised:
        L.Trainer(accelerator="cpu", devices=1, max_steps=-5, max_epochs=0)
    refusal = trainer_refusal(raised.value, {"accelerator": "cpu", "devices": 1, "max_steps": -5, "max_epochs": 0})
    assert str(refusal).startswith("Lightning refused the trainer settings (--trainer.max_steps -5)"), refusal
