"""Logging: every logger backend reads back the same metrics and steps, the saved config reloads, versions.json,
the non-interactive progress lines, the end-of-fit summary, once-per-optimizer-step logging under accumulation."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import struct

import lightning
import pytest
import torch
import transformers
import yaml

from lightalign.cli import main
from lightalign.plotting import read_csv_metrics, read_tensorboard_metrics

MAX_STEPS = 4
EXPECTED = {"train/loss", "train/token_accuracy", "train/tokens_seen", "train/tokens_per_sec", "train/samples_per_sec",
            "val/loss", "val/perplexity", "val/token_accuracy"}


@pytest.fixture(scope="module")
def sft_args(tmp_path_factory, repo, data_dir, tiny_dir):
    """A tiny SFT run of the quickstart config: 4 optimizer steps of 2 micro-batches of 4, validation every 2 steps."""
    folder = tmp_path_factory.mktemp("data")
    lines = (data_dir / "arithmetic_sft.jsonl").read_text().splitlines()
    (folder / "train.jsonl").write_text("\n".join(lines[:64]) + "\n")
    (folder / "val.jsonl").write_text("\n".join(lines[64:72]) + "\n")
    return ["fit", "--config", str(repo / "configs" / "quickstart.yaml"), "--model.model_name_or_path", str(tiny_dir),
            "--data.path", str(folder / "train.jsonl"), "--data.val_path", str(folder / "val.jsonl"),
            "--data.batch_size", "4", "--trainer.max_steps", str(MAX_STEPS), "--trainer.accumulate_grad_batches", "2",
            "--trainer.val_check_interval", "4", "--trainer.limit_val_batches", "1",
            "--trainer.num_sanity_val_steps", "0"]


def run_cli(args: list[str], tmp_path, logger: dict | list[dict], *extra: str) -> str:
    """Run ``lightalign fit`` in-process with ``trainer.logger`` from a YAML file; return what it printed."""
    logger_yaml = tmp_path / "logger.yaml"
    logger_yaml.write_text(yaml.safe_dump({"trainer": {"logger": logger}}))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):  # not a terminal: the progress bar prints lines
        main([*args, "--config", str(logger_yaml), *extra])
    return out.getvalue()


@pytest.fixture(scope="module")
def csv_run(sft_args, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("csv")
    logger = {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(tmp), "name": "run"}}
    printed = run_cli(sft_args, tmp, logger, "--plot.enabled", "true")
    return tmp / "run" / "version_0", printed


def train_val_steps(curves: dict) -> tuple[list[int], list[int]]:
    return [s for s, _ in curves["train/loss"]], [s for s, _ in curves["val/loss"]]


def test_csv_logs_once_per_optimizer_step(csv_run):
    run_dir, _ = csv_run
    curves = read_csv_metrics(run_dir / "metrics.csv")
    assert EXPECTED <= set(curves)
    train_steps, val_steps = train_val_steps(curves)
    assert train_steps == list(range(MAX_STEPS))  # 8 micro-batches, 4 rows
    assert len(val_steps) == 2 and val_steps[-1] == MAX_STEPS - 1
    assert curves["train/loss"][-1][1] < curves["train/loss"][0][1]


def read_wandb_history(run_file) -> list[dict]:
    """History rows of an offline W&B run file (a leveldb-style log of protobuf records, 32 KiB blocks)."""
    from wandb.proto import wandb_internal_pb2

    data, pos, pending, rows = run_file.read_bytes(), 7, b"", []  # 7 bytes of file header
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # block trailer
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):  # full record, or last fragment
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


def backend_curves(backend: str, tmp) -> tuple[dict, object]:
    """What each backend's own reader sees: {name: [(step, value)]}, and where the run folder is."""
    if backend == "tensorboard":
        run_dir = tmp / "run" / "version_0"
        return read_tensorboard_metrics(run_dir), run_dir
    if backend == "mlflow":
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=(tmp / "mlruns").as_uri())
        experiment = client.get_experiment_by_name("lightalign")
        (run,) = client.search_runs([experiment.experiment_id])
        names = run.data.metrics.keys()
        curves = {n: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, n)) for n in names}
        artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
        assert {"config.yaml", "versions.json"} <= artifacts
        return curves, tmp / "mlruns"
    if backend == "wandb":
        (run_dir,) = (tmp / "wandb").glob("offline-run-*")
        curves: dict = {}
        for row in read_wandb_history(next(run_dir.glob("run-*.wandb"))):
            for name, value in row.items():
                if "/" in name and name != "trainer/global_step":
                    curves.setdefault(name, []).append((row["trainer/global_step"], value))
        assert (run_dir / "files" / "config.yaml").is_file() and (run_dir / "files" / "versions.json").is_file()
        return curves, run_dir
    raise AssertionError(backend)


LOGGERS = {
    "tensorboard": lambda tmp: {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                                "init_args": {"save_dir": str(tmp), "name": "run"}},
    "mlflow": lambda tmp: {"class_path": "lightning.pytorch.loggers.MLFlowLogger",
                           "init_args": {"experiment_name": "lightalign", "tracking_uri": (tmp / "mlruns").as_uri()}},
    "wandb": lambda tmp: {"class_path": "lightning.pytorch.loggers.WandbLogger",
                          "init_args": {"save_dir": str(tmp), "offline": True, "project": "lightalign"}},
}


@pytest.fixture(scope="module")
def backends_run(sft_args, tmp_path_factory):
    """The same tiny run as csv_run, logged to TensorBoard, MLflow (file store) and W&B (offline) at once (one
    run for the three keeps the test time down; each backend is still read back with its own reader)."""
    tmp = tmp_path_factory.mktemp("backends")
    installed = [name for name in LOGGERS if importlib.util.find_spec(name) is not None]
    if not installed:
        pytest.skip("none of tensorboard, mlflow, wandb is installed (pip install 'lightalign[loggers]')")
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true", "WANDB_DISABLE_CODE": "true",
           "WANDB_DIR": str(tmp), "WANDB_CONFIG_DIR": str(tmp), "WANDB_CACHE_DIR": str(tmp), "WANDB_DATA_DIR": str(tmp),
           "MLFLOW_ALLOW_FILE_STORE": "true"}  # mlflow 3 wants an opt-in for its file store
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        run_cli(sft_args, tmp, [LOGGERS[name](tmp) for name in installed], "--export.enabled", "false",
                "--checkpoint.save_last", "false")
        if "wandb" in installed:
            import wandb

            wandb.finish()  # flush the offline run file
    return tmp, installed


@pytest.mark.parametrize("backend", list(LOGGERS))
def test_logger_backend_reads_back_names_and_steps(backend, backends_run, csv_run):
    tmp, installed = backends_run
    if backend not in installed:
        pytest.skip(f"{backend} is not installed (pip install 'lightalign[loggers]')")
    curves, _ = backend_curves(backend, tmp)
    reference = read_csv_metrics(csv_run[0] / "metrics.csv")
    assert EXPECTED <= set(curves), sorted(curves)
    assert train_val_steps(curves) == train_val_steps(reference)
    # the same seeded run: the same losses, whichever backend recorded them
    for name in ("train/loss", "val/loss", "train/tokens_seen"):
        assert [v for _, v in curves[name]] == pytest.approx([v for _, v in reference[name]], rel=1e-5), name


def test_saved_config_reloads_into_the_same_config(csv_run, sft_args, tmp_path, capsys):
    run_dir, _ = csv_run

    def printed_config(*args: str) -> dict:
        with pytest.raises(SystemExit):
            main([*args, "--print_config"])
        return yaml.safe_load(capsys.readouterr().out)

    logger = {"class_path": "lightning.pytorch.loggers.CSVLogger",
              "init_args": {"save_dir": str(run_dir.parent.parent), "name": "run"}}
    (tmp_path / "logger.yaml").write_text(yaml.safe_dump({"trainer": {"logger": logger}}))
    original = printed_config(*sft_args, "--config", str(tmp_path / "logger.yaml"), "--plot.enabled", "true")
    reloaded = printed_config("fit", "--config", str(run_dir / "config.yaml"))
    assert reloaded == original
    assert reloaded["trainer"]["accumulate_grad_batches"] == 2 and reloaded["plot"]["enabled"] is True


def test_versions_saved_beside_the_config(csv_run):
    versions = json.loads((csv_run[0] / "versions.json").read_text())
    assert versions["torch"] == torch.__version__ and versions["lightning"] == lightning.__version__
    assert versions["transformers"] == transformers.__version__
    assert {"python", "datasets", "lightalign"} <= set(versions)


def test_progress_lines_and_summary(csv_run):
    run_dir, printed = csv_run
    assert "\r" not in printed  # no redrawn bar in a log file
    lines = printed.splitlines()
    steps = [line.split(" | ")[0] for line in lines if line.startswith("step ")]
    assert steps == [f"step {k}/{MAX_STEPS}" for k in range(1, MAX_STEPS + 1)]
    first = next(line for line in lines if line.startswith("step 1/"))
    assert "train/loss" in first and "lr " in first and "train/tokens_per_sec" in first
    assert sum(line.startswith("validation step") and "val/loss" in line for line in lines) == 2

    curves = read_csv_metrics(run_dir / "metrics.csv")
    summary = dict(line.strip().split(None, 1) for line in printed.split("lightalign run summary\n")[1].splitlines()
                   if line.startswith("  ") and line.strip().split(None, 1)[0] in ("steps", "tokens", "checkpoint"))
    assert summary["steps"] == str(MAX_STEPS)
    assert int(summary["tokens"].replace(",", "")) == int(curves["train/tokens_seen"][-1][1])
    assert summary["checkpoint"] == str(run_dir / "checkpoints" / "last.ckpt")
    losses = [v for _, v in curves["train/loss"]]
    loss_line = next(line for line in printed.splitlines() if line.strip().startswith("train/loss "))
    assert f"final {losses[-1]:.4g}" in loss_line and f"best {min(losses):.4g}" in loss_line
    assert "HF export" in printed and str(run_dir / "hf_model") in printed
    assert str(run_dir / "curves.png") in printed
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(run_dir / "curves.png").shape  # loss, token_accuracy, lr panels
    assert (width, height) == (3 * 450, 320)


def test_accumulated_loss_is_the_token_mean_of_the_step(tiny_dir, data_dir, tmp_path):
    """accumulate_grad_batches=2: one train/loss row per optimizer step, equal to the step's token-weighted mean
    NLL over its two micro-batches (learning rate 0, so every step sees the initial weights)."""
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger

    from lightalign import SFTDataModule, SFTModule, sft_loss

    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n".join((data_dir / "arithmetic_sft.jsonl").read_text().splitlines()[:24]) + "\n")

    def data():
        return SFTDataModule(str(rows), tokenizer=str(tiny_dir), max_length=32, batch_size=3)

    torch.manual_seed(0)
    module = SFTModule(str(tiny_dir), from_config=True, learning_rate=0.0)
    trainer = L.Trainer(accelerator="cpu", max_steps=3, accumulate_grad_batches=2, logger=CSVLogger(tmp_path, "acc"),
                        log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module, data())
    logged = read_csv_metrics(tmp_path / "acc" / "version_0" / "metrics.csv")["train/loss"]
    assert [s for s, _ in logged] == [0, 1, 2]

    dm = data()
    dm.setup("fit")
    batches = iter(dm.train_dataloader())
    expected = []
    with torch.no_grad():
        for _ in range(3):
            nll = tokens = 0.0
            for batch in (next(batches), next(batches)):
                _, stats = sft_loss(module._logits(batch), batch["labels"])
                nll, tokens = nll + float(stats["nll_sum"]), tokens + float(stats["num_tokens"])
            expected.append(nll / tokens)
    assert [v for _, v in logged] == pytest.approx(expected, rel=1e-5)


def test_grpo_completions_table_reaches_tensorboard(grpo_module, prompt_data, tmp_path, capsys):
    """CompletionSamples writes the rollout's prompts, completions and rewards as a TensorBoard text table; the
    progress line shows the reward mean."""
    pytest.importorskip("tensorboard")
    import lightning as L
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lightalign import CompletionSamples
    from lightalign.callbacks import StepProgressBar

    module = grpo_module(generation_batch_size=8)
    logger = TensorBoardLogger(tmp_path, name="grpo")
    trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=logger, log_every_n_steps=1,
                        callbacks=[CompletionSamples(every_n_steps=1, max_rows=3), StepProgressBar(interactive=False)],
                        enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0)
    trainer.fit(module, prompt_data())
    logger.experiment.flush()
    events = EventAccumulator(logger.log_dir, size_guidance={"tensors": 0})
    events.Reload()
    assert "train/reward/mean" in events.Tags()["scalars"]
    (tag,) = [t for t in events.Tags()["tensors"] if t.startswith("completions")]
    tables = {e.step: e.tensor_proto.string_val[0].decode() for e in events.Tensors(tag)}
    assert sorted(tables) == [1, 2]  # every optimizer step
    lines = tables[2].strip().splitlines()
    assert lines[0].startswith("| step | prompt | completion | reward") and len(lines) == 2 + 3  # header, rule, 3 rows
    last = module.last_samples[0]
    cells = [c.strip() for c in lines[2].strip("|").split(" | ")]
    assert cells[0] == "2" and cells[1] == str(last["prompt"]).replace("\n", " ").replace("|", "\\|").strip()
    assert float(cells[3]) == pytest.approx(last["reward"])
    reward = events.Scalars("train/reward/mean")[-1].value
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step 2/2")][0]
    assert f"train/reward/mean {reward:.4g}" in line and "lr " in line


def test_completion_table_cells_stay_on_one_line():
    """Generated text holds any line break (\\r, \\u2028 ...), not only \\n: each would split a markdown row."""
    from lightalign.callbacks.completions import _cell

    assert _cell("a\rb|c\u2028d\ne\x85f") == "a b\\|c d e f"


def test_cli_progress_bar_steps_aside(repo, tiny_dir, tmp_path):
    """enable_progress_bar: false, or a progress bar of the config's own, replaces the StepProgressBar (which
    is the default: test_progress_lines_and_summary reads its lines)."""
    from lightning.pytorch.callbacks import TQDMProgressBar

    from lightalign.cli import LightalignCLI

    base = ["--config", str(repo / "configs" / "quickstart.yaml"), "--model.model_name_or_path", str(tiny_dir),
            "--trainer.logger.init_args.save_dir", str(tmp_path)]
    off = LightalignCLI(args=[*base, "--trainer.enable_progress_bar", "false"], run=False)
    assert off.trainer.progress_bar_callback is None
    own = LightalignCLI(args=[*base, "--trainer.callbacks+", "TQDMProgressBar", "--trainer.callbacks.refresh_rate",
                              "7"], run=False).trainer.progress_bar_callback
    assert type(own) is TQDMProgressBar and own.refresh_rate == 7


def test_throughput_after_resume_is_measured_over_the_step(tiny_dir, data_dir, tmp_path, monkeypatch):
    """The first step after a mid-epoch resume gets no on_train_epoch_start; its tokens/s must still be measured
    from the start of training (it was divided by 1e-9 s: ~3e11 tokens/s)."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightalign import SFTDataModule, SFTModule, TokenThroughput
    from lightalign.callbacks import throughput

    class Clock:  # one second per reading: a step's tokens/s is at most its token count
        now = 0.0

        def perf_counter(self):
            self.now += 1.0
            return self.now

    monkeypatch.setattr(throughput, "time", Clock())
    logged = {}

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if "train/tokens_per_sec" in trainer.callback_metrics:
                logged[trainer.global_step] = float(trainer.callback_metrics["train/tokens_per_sec"])

    def fit(max_steps, ckpt_path=None):
        module = SFTModule(str(tiny_dir), from_config=True)
        data = SFTDataModule(str(data_dir / "arithmetic_sft.jsonl"), tokenizer=str(tiny_dir), batch_size=4,
                             max_length=32)
        trainer = L.Trainer(accelerator="cpu", max_steps=max_steps, accumulate_grad_batches=2, logger=False,
                            enable_progress_bar=False, enable_model_summary=False,
                            callbacks=[TokenThroughput(), Record(),
                                       ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=2)])
        trainer.fit(module, data, ckpt_path=ckpt_path)

    fit(2)
    fit(4, ckpt_path=str(tmp_path / "last.ckpt"))  # resumed at step 2, inside the first epoch
    assert sorted(logged) == [1, 2, 3, 4], logged
    most = 2 * 4 * 32  # a step: 2 micro-batches of 4 rows of at most 32 tokens
    assert all(0 < value <= most for value in logged.values()), logged


def test_rank_logging_setup_sets_every_library_logger_per_rank():
    import logging
    from types import SimpleNamespace

    from lightalign.strategies import RankLogging
    from lightalign.strategies.launch import LOGGERS

    saved = {name: logging.getLogger(name).level for name in LOGGERS}
    callback = RankLogging(log_level="debug", log_level_replica="error", log_on_each_node=True)
    try:
        callback.setup(SimpleNamespace(local_rank=1, global_rank=3), None, "fit")  # a replica
        assert {name: logging.getLogger(name).level for name in LOGGERS} == dict.fromkeys(LOGGERS, logging.ERROR)
        callback.setup(SimpleNamespace(local_rank=0, global_rank=2), None, "fit")  # a node's first process
        assert {name: logging.getLogger(name).level for name in LOGGERS} == dict.fromkeys(LOGGERS, logging.DEBUG)
        assert set(LOGGERS) >= {"lightalign", "lightning.pytorch", "transformers", "datasets"}
        # at info, transformers and datasets stay at WARNING: their INFO is the model config of every load
        # (mutation: CHATTY ignored -> INFO)
        RankLogging(log_level="info").setup(SimpleNamespace(local_rank=0, global_rank=0), None, "fit")
        levels = {name: logging.getLogger(name).level for name in LOGGERS}
        assert levels == {name: logging.WARNING if name in ("transformers", "datasets") else logging.INFO
                          for name in LOGGERS}
    finally:
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)


def test_a_validate_runs_lines_show_the_time_since_it_started(monkeypatch, capsys):
    """`lightalign validate` prints `validation step 0 | ... | 0:00:00`, not the time since the machine's clock
    started (no train start to count from). Mutation: no start taken at setup -> hours, fails."""
    from types import SimpleNamespace

    from lightning.pytorch.callbacks import TQDMProgressBar

    from lightalign.callbacks import StepProgressBar

    monkeypatch.setattr(TQDMProgressBar, "setup", lambda *args: None)
    bar = StepProgressBar(interactive=False)
    trainer = SimpleNamespace(is_global_zero=True, max_steps=-1, global_step=0)
    bar.setup(trainer, None, "validate")
    bar.print_line(trainer, None, {"val/divergence": 0.665}, prefix="validation ")
    assert capsys.readouterr().out.strip() == "validation step 0 | val/divergence 0.665 | 0:00:00"
