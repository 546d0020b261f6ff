"""Scale, for real on CPU with 2 gloo processes: DDP, FSDP2, FSDP (v1) and DeepSpeed ZeRO-2 equal a single process
with the same global batch (SFT, DPO, GRPO with seeded generation; under DDP also PPO, distillation, GOLD across
tokenizers and online DPO, under FSDP2 PPO and distillation), the frozen reference or teacher identical on every rank and unchanged; FSDP2, FSDP (v1, sharded and full state dict)
and ZeRO-2/3 checkpoints taken at step 1 resume to exactly the uninterrupted weights; ZeRO-3 trains with whole
references; every export reloads; 2 simulated nodes end equal; a rank that exits or hangs makes the other fail
within the preset's collective timeout; launch mistakes fail fast. FSDP (v1) and DeepSpeed run through CPU test
subclasses (tests/helpers/cpu_strategies.py): Lightning refuses both without a GPU."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers import console_script

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]
TESTS = Path(__file__).resolve().parents[1]
WORKER = TESTS / "workers" / "scale_worker.py"
REPO = TESTS.parent
METHODS = ("sft", "dpo", "grpo")
SAMPLERS = ("distill", "online_dpo")  # a second, frozen model beside the policy: the teacher / the reference
TEACHERS = {"distill": "teacher", "gold": "gold_teacher"}  # the worker's seeded teacher folders (GOLD's: another
# tokenizer than its student's)
# how far the few steps of each method move the weights at least (distillation's divergence gradients are small)
MOVED = {"distill": 1e-3, "gold": 1e-3}


def _env(**extra: str) -> dict[str, str]:
    """The tests' environment as they started (offline; not what in-process tests added since, such as Lightning's
    PL_GLOBAL_SEED: then ``_run`` can fork the worker from the console server), one thread, no rank variables."""
    env = {k: v for k, v in console_script.standard_env().items() if k not in (
        "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "WORLD_SIZE", "LOCAL_RANK", "RANK")}
    return dict(env, OMP_NUM_THREADS="1", **extra)


def _worker(out: Path, strategy: str, *extra: str) -> list[str]:
    return [sys.executable, str(WORKER), "--strategy", strategy, "--out", str(out), *extra]


def _run(cmd: list[str], **env: str) -> None:
    """A worker command of ``_worker``, forked from the console server when its environment allows."""
    assert cmd[0] == sys.executable
    proc = console_script.run_python(cmd[1], *cmd[2:], env=_env(**env), timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]


def _load(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_resumed(out: Path, strategy: str) -> None:
    """A checkpoint taken at step 1 and resumed to step 2 ends where the uninterrupted run did (optimizer state
    included: SGD momentum), to the bit."""
    assert _max_diff(_load(out / f"sft_resumed_{strategy}.pt"), _load(out / "sft.pt")) == 0.0, strategy


@pytest.fixture(scope="session")
def single(tmp_path_factory) -> Path:
    """One process, twice the per-device batch: the reference every 2-process run is compared with. Run once per
    test run: the pytest-xdist workers (which each take some of the tests that compare with it) share the folder
    and take turns under a file lock; ``DONE`` marks a finished run (a failed one is run again by the next user)."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # one run's folder either way
    out = shared / "scale_single"
    with FileLock(str(shared / "scale_single.lock")):
        if not (out / "DONE").is_file():
            _run(_worker(out, "single", "--batch-mult", "2", "--methods",
                         ",".join(METHODS + ("ppo", "ppo_vm") + SAMPLERS + ("gold",))))
            (out / "DONE").touch()
    return out


def _check_export(out: Path, method: str) -> None:
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(out / f"{method}_hf").state_dict()
    full = _load(out / f"{method}.pt")
    for name, value in full.items():
        if not name.startswith("value_head."):  # PPO's head sits beside the policy folder (_check_value_head_export)
            assert torch.equal(exported[name], value), f"{method}: exported {name} differs from the trained weights"


def _check_value_head_export(out: Path) -> None:
    """PPO's export holds the whole trained value head beside the policy."""
    from lightalign.modules.training.value_head import load_value_head

    head, trained = load_value_head(out / "ppo_hf"), _load(out / "ppo.pt")
    assert torch.equal(head.summary.weight, trained["value_head.summary.weight"])
    assert torch.equal(head.summary.bias, trained["value_head.summary.bias"])
    assert _max_diff({"w": trained["value_head.summary.weight"]}, {"w": _load(out / "ppo_init.pt")["value_head.summary.weight"]}) > 1e-3


def _check_reference(out: Path, method: str, policy: dict[str, torch.Tensor]) -> None:
    ref = json.loads((out / f"{method}_ref.json").read_text())
    assert ref["trainable"] == 0 and not ref["in_optimizer"]
    # replicated and whole (not a shard, not an empty ZeRO-3 placeholder); tied embeddings count once
    assert ref["numel"] == sum(v.numel() for k, v in policy.items() if k != "lm_head.weight")


def _check_frozen(out: Path, method: str) -> None:
    """The frozen teacher (distill, gold: the worker's seeded folder) or reference (the policy's initial weights) is
    the same on both ranks after training and equal to what it was loaded as: whole, not a shard, and never trained."""
    if method in TEACHERS:
        from safetensors.torch import load_file

        initial = load_file(out / TEACHERS[method] / "model.safetensors")
    else:
        initial = _load(out / f"{method}_init.pt")
    for rank in (0, 1):
        frozen = _load(out / f"{method}_frozen_rank{rank}.pt")
        assert set(initial) <= set(frozen), f"{method} rank {rank}: {sorted(set(initial) - set(frozen))[:3]}"
        changed = [k for k in initial if not torch.equal(frozen[k], initial[k])]
        assert not changed, f"{method} rank {rank}: the frozen model changed ({changed[:3]})"


def test_ddp_two_processes_equal_single_process(single, tmp_path):
    """... and PPO: its advantages are whitened over both ranks' tokens, its value head trained like the policy;
    ppo_vm: the head on a separate value model, trained (and all-reduced) with it. Distillation (the student samples
    every batch, the teacher loaded from a folder) and online DPO (pairs ranked by a reward): each rank samples its
    own prompts, and the result equals one process with both ranks' prompts. GOLD (``use_uld_loss``): the student
    (tiny-bpe320's tokenizer) samples, the teacher (the tiny tokenizer's) re-tokenises the text; its ULD loss is a
    mean over sequences, so DDP's averaged gradient is one process's. Mutations that fail here: rank 1 loading a
    differently seeded teacher (``ddp`` differs from ``one``, rank 1's teacher from its folder), the ULD loss summed
    over a rank's sequences instead of averaged (DDP halves it), a parameter whose gradient is not all-reduced
    (the ranks diverge). The teacher is peaked (the worker's ``gold_teacher``): against a near-uniform one the sorted
    L1's gradient (its signs) ignores the teacher, and the first mutation passed."""
    ddp_methods = METHODS + ("ppo", "ppo_vm") + SAMPLERS + ("gold",)
    _run(_worker(tmp_path, "ddp", "--devices", "2", "--methods", ",".join(ddp_methods)))
    vm = {k: v for k, v in _load(single / "ppo_vm.pt").items() if k.startswith("value_model.")}
    assert _max_diff(vm, {k: _load(single / "ppo_vm_init.pt")[k] for k in vm}) > 1e-3  # the value model trained
    for method in ddp_methods:
        ddp, one, init = _load(tmp_path / f"{method}.pt"), _load(single / f"{method}.pt"), _load(single / f"{method}_init.pt")
        assert _max_diff(init, _load(tmp_path / f"{method}_init.pt")) == 0.0
        assert _max_diff(one, init) > MOVED.get(method, 1e-2), f"{method} did not train"
        assert _max_diff(ddp, one) < 1e-5, method
        rank0, rank1 = _load(tmp_path / f"{method}_rank0.pt"), _load(tmp_path / f"{method}_rank1.pt")
        assert all(torch.equal(rank0[k], rank1[k]) for k in rank0), f"{method}: ranks diverged"
    for method in ("dpo", "grpo") + SAMPLERS:
        _check_reference(tmp_path, method, _load(tmp_path / f"{method}.pt"))
    from safetensors.torch import load_file

    _check_reference(tmp_path, "gold", load_file(tmp_path / "gold_teacher" / "model.safetensors"))  # the teacher's size
    for method in SAMPLERS + ("gold",):
        _check_frozen(tmp_path, method)
    _check_export(tmp_path, "sft")


def test_fsdp2_two_processes_equal_single_process_and_resume(single, tmp_path):
    """... and PPO: its value head is sharded beside the policy (FSDP2Strategy shards `sharded_submodules()`), its
    gradient reduced over ranks, its export gathered on every rank. Distillation: the teacher placed whole beside the
    sharded student, as the reference is."""
    _run(_worker(tmp_path, "fsdp2", "--devices", "2", "--resume-check", "--methods",
                 ",".join(METHODS + ("ppo", "distill"))))
    for method in METHODS + ("ppo", "distill"):
        fsdp, one = _load(tmp_path / f"{method}.pt"), _load(single / f"{method}.pt")
        assert _max_diff(fsdp, one) < 1e-5, method
        _check_export(tmp_path, method)
    _check_value_head_export(tmp_path)
    # a sharded checkpoint (one folder, a shard per rank) taken at step 1 and resumed to step 2 = uninterrupted
    assert (tmp_path / "ckpt_fsdp2" / "last.ckpt").is_dir()
    _check_resumed(tmp_path, "fsdp2")
    for method in ("dpo", "distill"):
        _check_reference(tmp_path, method, _load(tmp_path / f"{method}.pt"))
    _check_frozen(tmp_path, "distill")


def test_fsdp_v1_two_processes_equal_single_process_and_resume(single, tmp_path):
    """FSDP (v1), one unit per decoder layer (CPUFSDPStrategy: DecoderFSDPStrategy with device_id=cpu)."""
    _run(_worker(tmp_path, "cpu_fsdp", "--devices", "2", "--resume-check", "cpu_fsdp", "cpu_fsdp_full"))
    for method in METHODS:
        assert _max_diff(_load(tmp_path / f"{method}.pt"), _load(single / f"{method}.pt")) < 1e-5, method
        _check_export(tmp_path, method)
    for method in ("dpo", "grpo"):
        _check_reference(tmp_path, method, _load(tmp_path / f"{method}.pt"))
    # sharded state dict: a folder with one shard per rank; full: one file gathered on rank 0
    assert len(list((tmp_path / "ckpt_cpu_fsdp" / "last.ckpt").glob("*.distcp"))) == 2
    assert (tmp_path / "ckpt_cpu_fsdp_full" / "last.ckpt").is_file()
    _check_resumed(tmp_path, "cpu_fsdp")
    _check_resumed(tmp_path, "cpu_fsdp_full")


def test_deepspeed_zero2_equals_single_process_and_resumes(single, tmp_path):
    pytest.importorskip("deepspeed")
    _run(_worker(tmp_path, "zero2", "--devices", "2", "--resume-check", "--methods", ",".join(METHODS + ("ppo",))))
    for method in METHODS + ("ppo",):  # PPO: policy and value head
        assert _max_diff(_load(tmp_path / f"{method}.pt"), _load(single / f"{method}.pt")) < 1e-5, method
    _check_export(tmp_path, "sft")
    _check_value_head_export(tmp_path)
    for method in ("dpo", "grpo"):
        _check_reference(tmp_path, method, _load(tmp_path / f"{method}.pt"))
    assert (tmp_path / "ckpt_zero2" / "last.ckpt" / "checkpoint").is_dir()  # DeepSpeed's folder, a shard per rank
    _check_resumed(tmp_path, "zero2")


def test_deepspeed_zero3_trains_exports_and_resumes(tmp_path):
    pytest.importorskip("deepspeed")
    # ZeRO-3: transformers initialises the partitioned random weights itself (other values than one process),
    # so check training moved them, the export holds the gathered weights, and the references are whole. Nothing
    # is compared with one process, so GRPO and PPO sample with the modules' own batched generate (--batched-sampling).
    # Distillation: the teacher loaded whole beside the partitioned student, as the references are.
    _run(_worker(tmp_path, "zero3", "--devices", "2", "--resume-check", "--batched-sampling",
                 "--methods", ",".join(METHODS + ("ppo", "distill"))))
    for method in METHODS + ("ppo", "distill"):
        moved = _max_diff(_load(tmp_path / f"{method}.pt"), _load(tmp_path / f"{method}_init.pt"))
        assert moved > MOVED.get(method, 1e-2), method
        _check_export(tmp_path, method)
    _check_value_head_export(tmp_path)  # gathered whole from ZeRO-3's partitions
    for method in ("dpo", "grpo", "distill"):
        _check_reference(tmp_path, method, _load(tmp_path / f"{method}.pt"))
    _check_frozen(tmp_path, "distill")
    # the resumed run starts from other random weights too, which the checkpoint overwrites (weights and momentum)
    _check_resumed(tmp_path, "zero3")


def test_two_nodes_on_localhost_plain_and_torchrun(tmp_path):
    """2 nodes x 1 process: two launches with NODE_RANK 0/1 (Lightning's environment), then torchrun --nnodes 2."""
    plain = [tmp_path / "plain0", tmp_path / "plain1"]
    port = str(_free_port())
    procs = [subprocess.Popen(_worker(out, "ddp", "--num-nodes", "2", "--methods", "sft"),
                              env=_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NODE_RANK=str(rank)),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for rank, out in enumerate(plain)]
    port = str(_free_port())
    elastic = [tmp_path / "elastic0", tmp_path / "elastic1"]
    torchrun = [[sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                 "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", port, *_worker(out, "ddp", "--num-nodes", "2", "--methods", "sft")[1:]]
                for rank, out in enumerate(elastic)]
    for proc in procs:
        _, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, err[-4000:]
    procs = [subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for cmd in torchrun]
    for proc in procs:
        _, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, err[-4000:]
    for a, b in (plain, elastic):
        w0, w1 = _load(a / "sft_rank0.pt"), _load(b / "sft_rank1.pt")
        assert all(torch.equal(w0[k], w1[k]) for k in w0)
        assert _max_diff(w0, _load(a / "sft_init.pt")) > 1e-2
    assert _max_diff(_load(plain[0] / "sft_rank0.pt"), _load(elastic[0] / "sft_rank0.pt")) < 1e-6


def test_dead_or_stuck_rank_fails_within_the_timeout(tmp_path):
    """2 nodes x 1 process, each launched on its own (no launcher watches the other process, as across machines),
    the ddp preset with timeout_s=10. When step 1 starts, rank 1 exits (os._exit) in one run and hangs alive in the
    other; rank 0 must stop with an error instead of waiting (the default timeout is 30 min, the bound here 5)."""
    runs = {}
    for mode in ("exit", "hang"):
        port = str(_free_port())
        runs[mode] = []
        for rank in (0, 1):
            log = open(tmp_path / f"{mode}{rank}.err", "w")
            cmd = _worker(tmp_path / f"{mode}{rank}", "ddp", "--num-nodes", "2", "--methods", "sft", "--steps", "3",
                          "--fail-at-step", "1", "--fail-mode", mode, "--timeout-s", "10")
            runs[mode].append(subprocess.Popen(cmd, env=_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NODE_RANK=str(rank)),
                                               stdout=subprocess.DEVNULL, stderr=log))
            log.close()
    try:
        for mode in runs:  # the safety net: rank 0 waiting for the 30 min default would fail here
            runs[mode][0].wait(timeout=300)
        hung_alive = runs["hang"][1].poll() is None
    finally:
        for proc in runs["exit"] + runs["hang"]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    err = {f"{mode}{rank}": (tmp_path / f"{mode}{rank}.err").read_text() for mode in runs for rank in (0, 1)}
    for mode in runs:  # rank 1 failed mid-training (after the process group and step 0 worked), rank 0 did not finish
        assert f"rank 1: {mode} at step 1" in err[f"{mode}1"], err[f"{mode}1"][-3000:]
        assert runs[mode][0].returncode != 0 and "DONE" not in err[f"{mode}0"], err[f"{mode}0"][-3000:]
    assert runs["exit"][1].returncode == 3
    # an exited peer's sockets are closed by its OS: gloo fails the pending collective at once
    assert re.search(r"Connection (reset|closed) by peer|Broken pipe", err["exit0"]), err["exit0"][-3000:]
    # a live but silent peer: the collective gives up after the preset's timeout_s, not the 30 min default
    assert hung_alive
    assert re.search(r"Timed out waiting 10000ms for (send|recv) operation", err["hang0"]), err["hang0"][-3000:]


# ------------------------------------------------------------------------------------------- fast checks
def test_multinode_missing_variables_fail_fast():
    from lightalign.strategies import check_multinode_env

    with pytest.raises(RuntimeError, match="MASTER_PORT, NODE_RANK are not set"):
        check_multinode_env(2, {"MASTER_ADDR": "10.0.0.1"})
    with pytest.raises(RuntimeError, match="NODE_RANK='2' must be an integer in 0..1"):
        check_multinode_env(2, {"MASTER_ADDR": "a", "MASTER_PORT": "29500", "NODE_RANK": "2"})
    check_multinode_env(2, {"MASTER_ADDR": "a", "MASTER_PORT": "29500", "NODE_RANK": "1"})
    check_multinode_env(2, {"TORCHELASTIC_RUN_ID": "x"})  # torchrun sets everything itself
    check_multinode_env(1, {})


def test_cli_refuses_multinode_without_variables(monkeypatch, tmp_path):
    from lightalign.cli import LightalignCLI

    for name in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "TORCHELASTIC_RUN_ID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="NODE_RANK"):
        LightalignCLI(args=["fit", "--config", str(REPO / "configs" / "quickstart.yaml"), "--trainer.num_nodes", "2",
                            "--trainer.strategy", "ddp", "--trainer.logger", "false",
                            "--trainer.default_root_dir", str(tmp_path)])


def test_rank_logging_levels():
    from lightalign.strategies import RankLogging

    def trainer(local, glob):
        return SimpleNamespace(local_rank=local, global_rank=glob)

    per_node = RankLogging(log_level="debug", log_level_replica="error", log_on_each_node=True)
    assert per_node.level_for(trainer(0, 0)) == 10 and per_node.level_for(trainer(0, 4)) == 10
    assert per_node.level_for(trainer(1, 1)) == 40
    global_main = RankLogging(log_level="info", log_level_replica="warning", log_on_each_node=False)
    assert global_main.level_for(trainer(0, 0)) == 20 and global_main.level_for(trainer(0, 4)) == 30
    with pytest.raises(ValueError, match="Unknown log level 'loud'"):
        RankLogging(log_level="loud")


def test_presets_and_shipped_configs():
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

    from lightalign.strategies import PRESETS, make_strategy

    kinds = {"ddp": DDPStrategy, "fsdp": FSDPStrategy, "fsdp_full": FSDPStrategy, "fsdp_offload": FSDPStrategy,
             "fsdp2": ModelParallelStrategy}
    for name in PRESETS:
        assert isinstance(make_strategy(name), kinds.get(name, DeepSpeedStrategy)), name
    assert make_strategy("deepspeed_zero3_offload").config["zero_optimization"]["offload_param"]["device"] == "cpu"
    with pytest.raises(ValueError, match="Unknown strategy preset 'zero4'"):
        make_strategy("zero4")
    shipped = sorted((REPO / "configs" / "strategies").glob("deepspeed_*.json"))
    assert len(shipped) == 5
    for path in shipped:  # DeepSpeed's own parser, with the batch keys Lightning fills in at run time
        config = dict(json.loads(path.read_text()), train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1)
        parsed = DeepSpeedConfig(config)
        assert parsed.zero_optimization_stage == int(path.stem.split("zero")[1][0])


def test_fsdp_wrap_policy_reads_decoder_layers(tiny_model):
    from lightalign.strategies import DecoderLayerPolicy
    from lightalign.strategies.sharding import decoder_layer_names

    names = decoder_layer_names(tiny_model)
    assert names == set(tiny_model._no_split_modules)
    policy = DecoderLayerPolicy()
    wrapped = policy._run_policy(tiny_model, set(), {})
    layers = [m for m in tiny_model.modules() if type(m).__name__ in names]
    assert layers and all(m in wrapped for m in layers) and len(wrapped) == len(layers)
    with pytest.raises(ValueError, match="declares no decoder-layer classes"):
        decoder_layer_names(torch.nn.Linear(2, 2))


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["fsdp", "fsdp_full", "fsdp2", "deepspeed_zero3", "deepspeed_zero3_offload"])
def test_sharded_presets_on_two_gpus(single, tmp_path, preset):
    """The shipped presets themselves (no CPU subclass) on 2 GPUs: SFT/DPO/GRPO train and export."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    _run(_worker(tmp_path, preset, "--devices", "2", "--accelerator", "gpu"))
    for method in METHODS:
        assert _max_diff(_load(tmp_path / f"{method}.pt"), _load(tmp_path / f"{method}_init.pt")) > 1e-2, method
        _check_export(tmp_path, method)
