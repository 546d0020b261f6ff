"""``lightalign plot``: the figure's panels and lines hold what the runs logged; default selections; bad input."""

from __future__ import annotations

import csv
import sys

import pytest

from lightalign.plotting import (DPI, PANEL_HEIGHT, PANEL_WIDTH, default_metrics, find_run_dir, panel_of,
                                 plot_from_args, plot_runs)

pytest.importorskip("matplotlib")


def write_run(folder, train_loss, val_loss, lr):
    """A metrics.csv laid out as Lightning's CSVLogger writes it (one row per step, blanks elsewhere)."""
    folder.mkdir(parents=True)
    with open(folder / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["epoch", "lr-AdamW", "step", "train/loss", "val/loss"])
        writer.writeheader()
        for step, (loss, rate) in enumerate(zip(train_loss, lr)):
            writer.writerow({"epoch": 0, "step": step, "train/loss": loss, "lr-AdamW": rate})
            if step in val_loss:
                writer.writerow({"epoch": 0, "step": step, "val/loss": val_loss[step]})
    return folder


@pytest.fixture
def two_runs(tmp_path):
    runs = tmp_path / "runs"
    a = write_run(runs / "a" / "version_0", [7.0, 5.0, 4.0, 3.5], {1: 5.5, 3: 4.1}, [1e-3, 2e-3, 2e-3, 1e-3])
    write_run(runs / "b" / "version_0", [9.0, 9.0], {}, [0.1, 0.1])  # an older version of b
    b = write_run(runs / "b" / "version_1", [6.5, 4.0, 3.0, 2.5], {1: 5.0, 3: 3.0}, [1e-3, 1e-3, 1e-3, 1e-3])
    return a, b


def lines_of(figure):
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
            for ax in figure.axes if ax.get_visible() for line in ax.get_lines()}


def test_plot_cli_compares_runs_one_line_per_metric_and_run(two_runs, tmp_path, capsys):
    a, b = two_runs
    out = tmp_path / "curves.png"
    # the parent folder of b resolves to its newest version
    figure = plot_from_args([str(a), str(b.parent), "--metrics", "train/loss", "val/loss", "lr-AdamW", "--out", str(out)])
    assert f"Learning curves written to {out}" in capsys.readouterr().out
    panels = [ax.get_title() for ax in figure.axes if ax.get_visible()]
    assert panels == ["loss", "lr-AdamW"]  # train/loss and val/loss share a panel
    lines = lines_of(figure)
    assert len(lines) == 3 * 2  # 3 metrics x 2 runs
    assert lines["a/version_0: train/loss"] == ([0, 1, 2, 3], [7.0, 5.0, 4.0, 3.5])
    assert lines["b/version_1: val/loss"] == ([1, 3], [5.0, 3.0])
    assert lines["b/version_1: lr-AdamW"][1] == [1e-3] * 4
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(out).shape
    assert (width, height) == (round(2 * PANEL_WIDTH * DPI), round(PANEL_HEIGHT * DPI))


def test_plot_default_out_is_inside_the_run(two_runs):
    a, _ = two_runs
    figure = plot_from_args([str(a)])
    assert (a / "curves.png").is_file()
    assert set(lines_of(figure)) == {"train/loss", "val/loss", "lr-AdamW"}  # the SFT default selection


def test_default_selection_per_method():
    sft = ["train/loss", "val/loss", "train/token_accuracy", "train/tokens_seen", "lr-AdamW/pg1", "lr-AdamW/pg2"]
    assert default_metrics(sft) == ["train/loss", "val/loss", "train/token_accuracy", "lr-AdamW/pg1"]
    dpo = ["train/loss", "train/rewards/margins", "train/rewards/accuracies", "val/loss", "train/logps/chosen"]
    assert default_metrics(dpo) == ["train/loss", "val/loss", "train/rewards/accuracies", "train/rewards/margins"]
    grpo = ["train/loss", "train/reward/mean", "train/kl", "train/completions/mean_length", "train/clip_ratio",
            "train/reward/std", "train/reward/format", "train/reward/accuracy", "val/reward/mean"]
    assert default_metrics(grpo) == ["train/reward/mean", "val/reward/mean", "train/reward/accuracy",
                                     "train/reward/format", "train/loss", "train/kl", "train/completions/mean_length"]


def test_reward_fallback_counts_are_not_drawn_as_rewards():
    """reward/<name>/fallbacks (reward_fallback_value) counts substitutions: not a reward function's curve."""
    grpo = ["train/loss", "train/reward/mean", "train/reward/format", "train/reward/format/fallbacks"]
    assert default_metrics(grpo) == ["train/reward/mean", "train/reward/format", "train/loss"]
    assert panel_of("train/reward/format/fallbacks") == panel_of("val/reward/format/fallbacks") == (
        "reward fallbacks per function")
    assert panel_of("train/reward/format") == "reward per function"


def test_grpo_curves_draw_each_reward_function(tmp_path):
    """Each reward function's curve is drawn (in one "reward per function" panel), beside the weighted mean."""
    run = tmp_path / "grpo" / "version_0"
    run.mkdir(parents=True)
    names = ["step", "train/loss", "train/reward/mean", "train/reward/std", "train/reward/format", "train/reward/accuracy"]
    with open(run / "metrics.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(names)
        for step in range(3):
            writer.writerow([step, 1.0, 0.5 * step, 0.1, 0.2 * step, 0.8 * step])
    figure = plot_from_args([str(run)])
    panels = {ax.get_title(): sorted(line.get_label() for line in ax.get_lines())
              for ax in figure.axes if ax.get_visible()}
    assert panels["reward per function"] == ["train/reward/accuracy", "train/reward/format"]
    assert panels["reward/mean"] == ["train/reward/mean"]
    assert lines_of(figure)["train/reward/accuracy"] == ([0, 1, 2], [0.0, 0.8, 1.6])


def test_plot_reads_tensorboard_runs(tmp_path):
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "tb"))
    for step, value in enumerate([3.0, 2.0, 1.5]):
        writer.add_scalar("train/loss", value, step)
    writer.close()
    figure = plot_runs([tmp_path / "tb"], metrics=["train/loss"])
    assert lines_of(figure) == {"train/loss": ([0, 1, 2], [3.0, 2.0, 1.5])}


def test_plot_bad_inputs_say_what_to_do(two_runs, tmp_path, monkeypatch):
    a, _ = two_runs
    with pytest.raises(ValueError, match=r"'train/reward/mean' was not logged .*Logged metrics: lr-AdamW, train/loss"):
        plot_runs([a], metrics=["train/reward/mean"])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        find_run_dir(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="expected a metrics.csv"):
        find_run_dir(tmp_path / "empty")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    with pytest.raises(ImportError, match=r"lightalign\[plot\]"):
        plot_runs([a])
    from lightalign.callbacks import PlotCurves

    with pytest.raises(ImportError, match=r"lightalign\[plot\]"):  # at setup, not after the run
        PlotCurves(enabled=True).setup(None, None, "fit")
