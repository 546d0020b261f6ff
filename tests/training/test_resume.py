"""Exact resume: a run SIGKILLed twice (once mid-epoch at a step that is not a checkpoint step, once just after an
epoch-end checkpoint; the DDP cases once, mid-epoch) and resumed each time ends bit-for-bit where an uninterrupted run ends: every weight, the
optimizer state, and the logged losses of the steps they share. The workers train with attention dropout, NEFTune
(SFT) and sampling with a reward that varies (GRPO), so every RNG stream of training matters."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import pytest
import torch

from helpers import console_script

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]
WORKER = Path(__file__).resolve().parents[1] / "workers" / "resume_worker.py"


def _run(out: Path, method: str, *extra: str, killed: bool = False):
    """The worker to its end, forked from the console server (tests/helpers/console_script.py: torch, Lightning and
    transformers imported once, not once per launch), one thread each. The worker makes itself a session leader, so
    a kill (``--kill-at``) takes its whole process group (every rank, every sampling process) and nothing else."""
    proc = console_script.run_python(WORKER, "--method", method, "--out", str(out), *extra,
                                     env=console_script.standard_env(OMP_NUM_THREADS="1"), timeout=600)
    assert proc.returncode == (-9 if killed else 0), proc.stderr[-3000:]
    return proc


def _losses(out: Path, key: str = "train/loss") -> dict[int, float]:
    """Logged losses by step over the run's process runs (one logger version each; later runs win)."""
    values = {}
    for version in sorted((out / "logs").glob("version_*"), key=lambda p: int(p.name.split("_")[1])):
        with open(version / "metrics.csv") as f:
            for row in csv.DictReader(f):
                if row.get(key):
                    values[int(row["step"])] = float(row[key])
    return values


def _assert_equal_tree(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys differ"
        for k in a:
            _assert_equal_tree(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_equal_tree(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a} != {b}"


# (method, devices, max_steps, every, first kill, second kill, steps per epoch). The first kill resumes from a
# checkpoint inside an epoch (and, for GRPO, inside a rollout); the second from the checkpoint at an epoch end.
CASES = [
    # 11 batches/epoch, accumulation 2: 6 steps/epoch. Kill at 5 -> resume 3 (mid-epoch 0); kill at 7 -> resume 6
    ("sft", 1, 9, 3, 5, 7, 6),
    ("dpo", 1, 9, 3, 5, 7, 6),
    # a rollout serves 4 steps, 2 rollouts/epoch: 8 steps/epoch. Kill at 3 -> resume 2 (mid-rollout); 9 -> 8
    ("grpo", 1, 10, 2, 3, 9, 8),
    # DDP SDFT: 8 prompts per rank, 4 steps per epoch, an EMA teacher (kept in checkpoints); killed once, at 3 ->
    # resume 2 (mid-epoch)
    ("sdft", 2, 4, 2, 3, None, 4),
    # DDP SDPO: GRPO's schedule over 2 ranks (a rollout of 2 prompts, 1 per rank, serves 4 steps; 2 prompts per
    # rank: 8 steps/epoch), an EMA teacher; killed once, at 3 -> resume 2 (mid-rollout: each rank's buffered rollout
    # and teacher prompts come back with it; a resume that skips the teacher's restore ends on other weights)
    ("sdpo", 2, 4, 2, 3, None, 8),
    # The DDP cases take 2 prompts per rank (one rollout, 4 steps per epoch) and are killed once, at 3 -> resume 2
    # (mid-rollout; the resumed run crosses the epoch end at 4): a resume from an epoch end is the cases' above.
    # DDP GRPO with tool calls (the single-process case's knobs): each rank its own prompts, multi-turn rollouts
    # (a scripted call, the tool's result, then sampled turns) in flight at the kill, and reward normaliser
    ("grpo_tools", 2, 6, 2, 3, None, 4),
    # DDP GRPO sampled one rollout ahead (max_staleness 4) by a sampling process per rank: the kill comes with the
    # next rollout (the next epoch's) sampled ahead, kept in the step-2 checkpoint; the resumed run samples on in
    # step across the epoch end
    ("grpo_async", 2, 6, 2, 3, None, 4),
    # DDP CPO (SimPO), no reference: 12 pairs per rank in batches of 4, 3 steps per epoch; killed at 3 -> resume 2
    # (mid-epoch), the resumed run crosses the epoch end. ORPO shares CPO's base and adds no state of its own
    # (tests/cpo/test_cpo_orpo_modules.py checks that): this case is its resume too
    ("cpo", 2, 4, 2, 3, None, 3),
    # DDP TPO (reference-free; 8 triples per rank, 2 per micro-batch: 4 steps per epoch), killed at 3 -> resume 2;
    # its running train/num_tokens count resumes too
    ("tpo", 2, 6, 2, 3, None, 4),
    # DDP DPO with a BEMA reference (update_ref_model): 3 steps per epoch, killed at 3 -> resume 2, whose checkpoint
    # holds theta_0 of step 1 (neither the initial nor the resumed policy) and the reference written at steps 1-2
    ("dpo_bema", 2, 6, 2, 3, None, 3),
    # GRPO with a BEMA reference, one process: one rollout (2 prompts) per epoch of 4 steps, killed at 3 -> resume 2
    # (mid-rollout: the buffered rollout's reference log-probs were scored with the BEMA reference of step 0)
    ("grpo_bema", 1, 6, 2, 3, None, 4),
]


@pytest.mark.parametrize("method, devices, max_steps, every, kill1, kill2, epoch_steps", CASES,
                         ids=[f"{c[0]}-{c[1]}proc" for c in CASES])
def test_killed_and_resumed_equals_uninterrupted(tmp_path, method, devices, max_steps, every, kill1, kill2,
                                                 epoch_steps):
    resume1 = (kill1 // every) * every
    assert kill1 % every and resume1 % epoch_steps  # killed between checkpoints (the work since is redone), mid-epoch
    if kill2 is not None:
        resume2 = (kill2 // every) * every
        assert kill2 % every and resume2 % epoch_steps == 0 and resume2 < max_steps  # then from an epoch end
    a, b = tmp_path / "a", tmp_path / "b"
    common = ["--max-steps", str(max_steps), "--every", str(every), "--devices", str(devices)]
    if method.startswith("grpo"):  # a rollout of 2 prompts serves 4 steps
        common += ["--prompts-per-rank", str(epoch_steps // 2)]
    if method == "sdpo":  # a rollout of 2 prompts in all (2 / devices per rank) serves 4 steps
        common += ["--prompts-per-rank", str(epoch_steps // 2 // devices)]
    # the uninterrupted run, then the run that gets killed (one after the other: each launch is forked from the one
    # console server, which serves one call at a time; side by side they would only share the same cores)
    _run(a, method, *common)
    _run(b, method, *common, "--kill-at", str(kill1), killed=True)
    assert not (b / "final.pt").exists()
    if method == "grpo_async":  # the checkpoint the first resume starts from holds every rank's next rollout
        kept = torch.load(next((b / "ckpt").glob(f"*step={resume1}.ckpt")), weights_only=False)
        ranks = kept["lightalign_rollout"]["ranks"]
        assert len(ranks) == devices and all(list(r["ahead_rollouts"]) == [1] for r in ranks), ranks
    if kill2 is not None:
        _run(b, method, *common, "--resume", "--kill-at", str(kill2), "--log-version", "1", killed=True)
        assert torch.load(b / "ckpt" / "last.ckpt", weights_only=True)["global_step"] == resume2
    _run(b, method, *common, "--resume", "--log-version", "2")

    final_a = torch.load(a / "final.pt", weights_only=True)
    final_b = torch.load(b / "final.pt", weights_only=True)
    _assert_equal_tree(final_a["model"], final_b["model"], f"{method}: weights after resume")
    _assert_equal_tree(final_a["optimizer"], final_b["optimizer"], f"{method}: optimizer state after resume")
    # DPO syncs its reference (TR-DPO) every 2 steps: the resumed runs restored the mixed reference
    _assert_equal_tree(final_a.get("reference"), final_b.get("reference"), f"{method}: reference after resume")
    _assert_equal_tree(final_a.get("bema"), final_b.get("bema"), f"{method}: BEMA state after resume")
    la, lb = _losses(a), _losses(b)
    assert sorted(la) == list(range(max_steps)), sorted(la)
    shared = [s for s in la if s >= resume1]
    assert all(la[s] == lb[s] for s in shared), {s: (la[s], lb.get(s)) for s in shared}
    # the weights moved, and (GRPO) the loss is not the zero of a reward without variance
    init = torch.load(a / "init.pt", weights_only=True)
    assert not all(torch.equal(init[k], final_a["model"][k]) for k in init)
    if final_a.get("reference") is not None:  # the synced reference is not the initial policy any more
        assert not all(torch.equal(init[k], final_a["reference"][k]) for k in init)
    assert any(abs(v) > 1e-6 for v in la.values()), la
    if method == "tpo":  # the running token count (a buffer) continues where it stopped
        ta, tb = _losses(a, "train/num_tokens"), _losses(b, "train/num_tokens")
        assert sorted(ta) == list(range(max_steps)) and all(ta[s] == tb[s] for s in shared), (ta, tb)
    if method == "grpo_tools":  # the rollouts were multi-turn: every trajectory's first turn is the scripted call
        calls = _losses(a, "train/tools/call_frequency")
        assert calls and all(v >= 1 for v in calls.values()), calls


def test_a2po_resumed_after_the_estimate_equals_uninterrupted(tmp_path):
    """A2PO over DDP on 2 ranks (8 prompts in 4 chunks of 2, rank r estimating chunks r and r + 2; 8 steps per
    epoch). Run ``b`` starts with the cache a run killed during the estimate leaves (the uninterrupted run's first two
    chunks, copied): it samples only the other two (the fit-start line says so), and is SIGKILLed at step 3; its cache
    folder is then deleted, and the run resumed from the step-2 checkpoint does not estimate again (V* comes from the
    checkpoint: the folder stays absent). It ends bit-for-bit where the uninterrupted run ``a`` ends (weights,
    optimizer, logged losses). Fails when a partly cached estimate differs from a whole one (with no seeded stream
    per chunk, chunk 2 follows chunk 0's draws in ``a`` and is the first draw in ``b``), when the checkpoint does not
    keep V* (the deleted cache is rebuilt), or when any RNG stream of training is not restored."""
    a, b = tmp_path / "a", tmp_path / "b"
    common = ["--max-steps", "6", "--every", "2", "--devices", "2", "--prompts-per-rank", "4"]
    _run(a, "a2po", *common)
    chunks = sorted((a / "values").rglob("chunk_*.pt"))
    assert [p.name for p in chunks] == [f"chunk_00000{i}.pt" for i in range(4)]
    folder = b / "values" / chunks[0].parent.name  # the same key: the same reference, data, knobs and seed
    folder.mkdir(parents=True)
    for chunk in chunks[:2]:
        shutil.copy(chunk, folder / chunk.name)
    proc = console_script.run_python(WORKER, "--method", "a2po", "--out", str(b), *common, "--kill-at", "3",
                                     env=console_script.standard_env(OMP_NUM_THREADS="1"), timeout=600)
    assert proc.returncode == -9, proc.stderr[-3000:]
    assert "A2PO: V* of 8 training prompts (2 reference samples each): 4 estimated now, 4 loaded from the cache" in (
        proc.stdout + proc.stderr)
    assert len(list(folder.glob("chunk_*.pt"))) == 4
    shutil.rmtree(b / "values")
    _run(b, "a2po", *common, "--resume", "--log-version", "1")
    assert not (b / "values").exists()
    final_a, final_b = torch.load(a / "final.pt", weights_only=True), torch.load(b / "final.pt", weights_only=True)
    _assert_equal_tree(final_a["model"], final_b["model"], "a2po: weights after resume")
    _assert_equal_tree(final_a["optimizer"], final_b["optimizer"], "a2po: optimizer state after resume")
    la, lb = _losses(a), _losses(b)
    assert sorted(la) == list(range(6)) and all(la[s] == lb[s] for s in range(2, 6)), (la, lb)
    init = torch.load(a / "init.pt", weights_only=True)
    assert not all(torch.equal(init[k], final_a["model"][k]) for k in init)
    assert any(abs(v) > 1e-6 for v in la.values()), la


# (method, extra arguments): kill at step 3, resume from the step-2 checkpoint, end at step 4. SFT: 6 steps per epoch
# (resumed mid-epoch, NEFTune and attention dropout drawing); GRPO: one rollout of 2 prompts serves the 4 steps
# (resumed mid-rollout, sampling and dropout drawing under autocast).
BF16_CASES = [("sft", ()), ("grpo", ("--prompts-per-rank", "2"))]


@pytest.mark.parametrize("method, extra", BF16_CASES, ids=[c[0] for c in BF16_CASES])
def test_killed_and_resumed_equals_uninterrupted_in_bf16(tmp_path, method, extra):
    """Under ``precision: bf16-mixed`` (Lightning's CPU autocast) a run SIGKILLed mid-epoch and resumed ends
    bit-for-bit where the uninterrupted bf16 run ends: weights, optimizer state and the logged losses from the
    resumed step on. Fails when the resumed run computes in another precision (the autocast is part of what a resume
    must reproduce) or when any restored state (RNG streams, the rollout buffer, the optimizer) is skipped."""
    a, b = tmp_path / "a", tmp_path / "b"
    common = ["--max-steps", "4", "--every", "2", "--precision", "bf16-mixed", *extra]
    started = _run(a, method, *common)
    # the run's layout was measured in its precision (trainer.precision reached the probe)
    assert "exact, in bf16-mixed within" in started.stdout + started.stderr, started.stderr[-3000:]
    _run(b, method, *common, "--kill-at", "3", killed=True)
    _run(b, method, *common, "--resume", "--log-version", "1")
    final_a = torch.load(a / "final.pt", weights_only=True)
    final_b = torch.load(b / "final.pt", weights_only=True)
    _assert_equal_tree(final_a["model"], final_b["model"], f"{method} bf16: weights after resume")
    _assert_equal_tree(final_a["optimizer"], final_b["optimizer"], f"{method} bf16: optimizer state after resume")
    la, lb = _losses(a), _losses(b)
    assert sorted(la) == list(range(4)), sorted(la)
    assert all(la[s] == lb[s] for s in (2, 3)), {s: (la[s], lb.get(s)) for s in (2, 3)}
    init = torch.load(a / "init.pt", weights_only=True)
    assert not all(torch.equal(init[k], final_a["model"][k]) for k in init)
    assert any(abs(v) > 1e-6 for v in la.values()), la
    assert final_a["precision"] == final_b["precision"] == "bf16-mixed"  # (both runs computed in bf16)
