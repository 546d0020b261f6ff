"""A sampling method's training statistics (``StatMetrics``): the ones something reads at every step (progress bar,
run summary, a callback's ``monitor``) are logged at every optimizer step, the others only on the steps the loggers
write (``log_every_n_steps``) and at the fit's last step, and what the loggers receive is the same as when every
statistic is logged at every step."""

from __future__ import annotations

import csv
import time

import lightning as L
import pytest
import torch

from lightalign.modules.training import stat_metrics
from lightalign.modules.training.stat_metrics import StatMetrics


def length_reward(prompts, completions, **columns):
    return [float(len(c)) for c in completions]


class Seen(L.Callback):
    """The train/ keys in ``trainer.callback_metrics`` after each optimizer step, with their values."""

    def __init__(self):
        self.steps = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.steps.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("train/")})


def _fit(tiny_dir, data_dir, tmp_path, callbacks=(), every=2, steps=5):
    from lightalign import OnlineDPOModule, PromptDataModule

    torch.manual_seed(0)
    module = OnlineDPOModule(str(tiny_dir), from_config=True, reward_funcs=[length_reward], max_completion_length=3,
                             learning_rate=1e-3)
    data = PromptDataModule(str(data_dir / "arithmetic_prompts.jsonl"), tokenizer=str(tiny_dir), batch_size=2,
                            max_prompt_length=16)
    seen = Seen()
    L.seed_everything(1)
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, log_every_n_steps=every, enable_checkpointing=bool(callbacks),
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, logger=L.pytorch.loggers.CSVLogger(tmp_path, name="run", version=0),
                        callbacks=[seen, *callbacks])
    trainer.fit(module, data)
    with open(tmp_path / "run" / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    return seen.steps, rows


def test_other_statistics_only_on_the_loggers_steps_and_the_files_are_unchanged(tiny_dir, data_dir, tmp_path,
                                                                                monkeypatch):
    def monitor(name):
        return L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / name / "ckpt", monitor="train/objective/kl",
                                                   every_n_train_steps=1, save_top_k=1, mode="min")

    seen, rows = _fit(tiny_dir, data_dir, tmp_path / "gated", [monitor("gated")])
    every_step = {"train/loss", "train/reward/mean", "train/rewards/accuracies", "train/rewards/margins",
                  "train/objective/kl"}  # bar, summary, the checkpoint's monitor
    assert every_step <= set(seen[0]) and "train/logps/chosen" not in seen[0]  # step 1: not a loggers' step
    assert "train/logps/chosen" in seen[1]  # step 2 (log_every_n_steps=2)
    assert seen[2]["train/logps/chosen"] == seen[1]["train/logps/chosen"]  # step 3: step 2's value still there
    assert seen[3]["train/logps/chosen"] != seen[1]["train/logps/chosen"]  # step 4: written
    assert seen[4]["train/logps/chosen"] != seen[3]["train/logps/chosen"]  # step 5, the last: all, for after fit
    assert all(s["train/loss"] != seen[0]["train/loss"] for s in seen[1:])  # the loss: fresh at every step

    from lightalign.modules.sampling import module as sampling_module

    monkeypatch.setattr(sampling_module, "loggers_write_this_step", lambda trainer: True)  # all, every step
    seen_all, rows_all = _fit(tiny_dir, data_dir, tmp_path / "all", [monitor("all")])
    assert "train/logps/chosen" in seen_all[0]
    assert rows == rows_all and len(rows) == 2 and all(r["train/logps/chosen"] for r in rows)
    for gated, full in zip(seen, seen_all):  # what is read at every step is the same
        assert {k: gated[k] for k in every_step} == {k: full[k] for k in every_step}


def test_log_every_n_steps_1_logs_every_statistic_at_every_step(tiny_dir, data_dir, tmp_path):
    seen, rows = _fit(tiny_dir, data_dir, tmp_path, every=1, steps=2)
    assert all("train/logps/chosen" in s and "train/objective/entropy" in s for s in seen)
    assert len(rows) == 2


def test_statmetrics_log_only_the_named_and_resets_all():
    stats = StatMetrics(["a", "b/c"])
    logged = []

    class Module:
        def log(self, name, value, prog_bar=False):
            logged.append((name, float(value), prog_bar))

    for key, value in (("a", 1.0), ("a", 3.0), ("b__c", 5.0)):
        stats[key].update(torch.tensor(value))
    stats.log(Module(), "train", prog_bar=("a",), only={"a"})
    assert logged == [("train/a", 2.0, True)]
    assert not any(m.update_called for m in stats.values())  # b/c reset, not carried into the next step
    stats["b__c"].update(torch.tensor(7.0))
    stats.log(Module(), "train")
    assert logged[-1] == ("train/b/c", 7.0, False)


@pytest.mark.parametrize("monitor", ["train/objective/kl", "val/reward/mean", None])
def test_read_every_step_names_the_bar_the_summary_and_train_monitors(monitor):
    from lightalign.modules.online_dpo import OnlineDPOModule

    class Trainer:
        callbacks = [L.pytorch.callbacks.ModelCheckpoint(monitor=monitor)]

    names = stat_metrics.read_every_step(Trainer(), OnlineDPOModule)
    assert {"loss", "reward/mean", "win_rate", "rewards/margins"} <= names
    assert ("objective/kl" in names) == (monitor == "train/objective/kl")


def _log_on_ranks(rank: int, world: int, port: str, out: str) -> None:
    """One rank of test_a_statistic_of_one_rank_is_logged_by_every_rank: rank 1 updates ``only_rank1`` (a reward
    function's ``log_metric`` on its own completions), rank 0 never heard of it; both update ``shared``."""
    import os

    import torch.distributed as dist

    from lightalign.modules.training.stat_metrics import StatMetrics

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        stats = StatMetrics(["shared", "zeta"])
        stats["shared"].update(torch.tensor(float(rank + 1)))
        if rank == 1:
            stats.add("only_rank1").update(torch.tensor(4.0))
            stats.add("alpha").update(torch.tensor(8.0))  # added after zeta here: another order than rank 0's
        logged = {}

        class Module:
            def log(self, name, value, prog_bar=False):
                logged[name] = float(value)

        stats.log(Module(), "train")
        torch.save(logged, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_a_statistic_of_one_rank_is_logged_by_every_rank(tmp_path):
    """``compute`` is a collective: a statistic only one rank updated (or added) is computed and logged on every
    rank, in one order, with the value over all ranks (mutation: each rank logs only what it updated -> the ranks'
    collectives pair up wrongly or wait for good; the timeout of the spawn below turns a hang into a failure)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    context = mp.start_processes(_log_on_ranks, args=(2, port, str(tmp_path)), nprocs=2, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + 120
    try:
        while not context.join(timeout=1):
            assert time.monotonic() < deadline, "the ranks hung"
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    for rank in range(2):
        logged = torch.load(tmp_path / f"rank{rank}.pt")
        assert logged == {"train/shared": 1.5, "train/only_rank1": 4.0, "train/alpha": 8.0}, (rank, logged)
