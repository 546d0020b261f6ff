"""The prepared GPU check: one script that, on one GPU, runs SFT, DPO and GRPO in bf16 through lightalign's Python API
on a 0.5B-class random Qwen2 model, padding-free exactness on the device, every sampler backend, FSDP2 on one GPU,
the bf16 matmul peak (MFU is measured against it and against the datasheet), and TRL on the same workloads; then
writes ``gpu_check.json`` and ``gpu_check.md``.

    bash bench/gpu/run.sh                                   # on the GPU machine: carried wheels, then this script
    python bench/gpu/run_check.py --out /tmp/gpu            # the same, with the libraries already importable
    python bench/gpu/run_check.py --dry-run --out /tmp/dry  # every section on the CPU at tiny sizes (~30 s)

Each section runs in a process of its own (forked from this one after the libraries are imported, so none pays
the imports again; ``--isolation spawn`` starts a fresh interpreter per section instead) under a time box of its
own and the run's overall budget (workload.py's ``Sizes``). A section that raises, exceeds its box or kills its
process is recorded with its traceback or exit status and the next one runs; sections whose optional package is
missing (TRL, vLLM) are skipped. The exit status is 1 when any section failed or timed out, 0 otherwise; the JSON
and markdown are written in every case. docs/gpu.md says how to run it on the device machine and what it measures.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
for key, value in {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                   "WANDB_DISABLED": "true", "TQDM_DISABLE": "1",
                   # torch.cuda.is_available() through NVML: a library asking it at import leaves CUDA uninitialised,
                   # so the sections forked from this process can still use the GPU
                   "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}.items():
    os.environ.setdefault(key, value)


def put_lightalign_on_path() -> None:
    """Make ``import lightalign`` this checkout (the repository root is the package; its folder may have another
    name on the device machine, then a link named ``lightalign`` in a temporary folder points to it)."""
    if ROOT.name == "lightalign":
        parent = ROOT.parent
    else:
        parent = Path(tempfile.gettempdir()) / f"lightalign-checkout-{os.getuid()}"
        parent.mkdir(exist_ok=True)
        link = parent / "lightalign"
        if link.is_symlink() and link.resolve() != ROOT:
            link.unlink()
        if not link.exists():
            link.symlink_to(ROOT, target_is_directory=True)
    if str(parent) not in sys.path:
        sys.path.insert(1, str(parent))  # after this script's folder (sys.path[0])
    import lightalign

    if Path(lightalign.__file__).resolve().parent != ROOT:
        raise SystemExit(f"import lightalign gives {lightalign.__file__}, not this checkout ({ROOT}): "
                         "uninstall that copy or run from a clean environment.")


put_lightalign_on_path()
import exactness  # noqa: E402
import report  # noqa: E402
import sampler_sections  # noqa: E402
import sections  # noqa: E402
import trl_sections  # noqa: E402
import workload  # noqa: E402

ALL = {**sections.SECTIONS, **exactness.SECTIONS, **sampler_sections.SECTIONS, **trl_sections.SECTIONS}
#: Run order: the machine and the model first, then each workload with TRL's run of it right after (the ratios come
#: first if the budget runs out), FSDP2, the samplers, the slow optional ones last.
ORDER = ("environment", "matmul_peak", "model", "padding_free_exactness", "sft", "trl_sft", "dpo", "trl_dpo", "grpo",
         "trl_grpo", "fsdp2", "sampler_generate", "sampler_compact", "sampler_continuous", "sampler_static",
         "sampler_vllm")
ALWAYS = ("environment", "matmul_peak", "model")
PRELOAD = ("torch", "lightning.pytorch", "transformers", "transformers.models.qwen2.modeling_qwen2",
           "transformers.generation.utils", "datasets", "lightalign.modules", "lightalign.datamodules",
           "lightalign.modules.sampling.samplers", "lightalign.modules.adaptations.support", "lightalign.strategies")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="every section on the CPU at tiny sizes")
    p.add_argument("--out", help="folder of gpu_check.json / gpu_check.md (default: $OUT, else bench/results/gpu)")
    p.add_argument("--sections", nargs="+", choices=ORDER, help=f"run only these (plus {', '.join(ALWAYS)})")
    p.add_argument("--precision", default="bf16-mixed", help="Lightning precision of the lightalign sections "
                   "(TRL gets bf16=True for any bf16 setting)")
    p.add_argument("--budget", type=float, help="seconds for all sections (default: the mode's)")
    p.add_argument("--isolation", choices=("fork", "spawn"), default="fork")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", action="store_true", help="keep the working folder (model, data, per-section results)")
    p.add_argument("--section", help=argparse.SUPPRESS)  # a spawned child: run this one section
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    return p


def context(args: argparse.Namespace, workdir: Path) -> sections.Context:
    return sections.Context(dry_run=args.dry_run, device="cpu" if args.dry_run else "cuda", workdir=workdir,
                            sizes=workload.DRY if args.dry_run else workload.FULL, precision=args.precision,
                            seed=args.seed)


def write_record(workdir: Path, name: str, record: dict) -> None:
    path = workdir / "results" / f"{name}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2, default=str))
    tmp.replace(path)


def run_here(name: str, ctx: sections.Context) -> None:
    """Run section ``name`` in this process and write its record (its result, or the traceback)."""
    os.environ["HF_DATASETS_CACHE"] = str(ctx.workdir / f"datasets-{name}")
    print(f"\n=== {name} ===", flush=True)
    start = time.perf_counter()
    try:
        result = ALL[name](ctx)
        failed = result.get("failed_checks") or []
        record = {"status": "failed" if failed else "ok", "result": result, "error": "\n".join(failed) or None}
    except BaseException:  # noqa: BLE001 - a benchmark section's failure is its result; the next section runs
        record = {"status": "failed", "error": traceback.format_exc()}
        print(record["error"], file=sys.stderr, flush=True)
    record["seconds"] = time.perf_counter() - start
    write_record(ctx.workdir, name, record)


def kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


CPU_SECONDS: dict[str, float] = {}  # section -> CPU seconds of its forked process (all its threads)


def run_forked(name: str, ctx: sections.Context, timeout: float) -> str | None:
    """Fork a child for the section (its own process group), wait up to ``timeout`` s; returns why it ended
    without a record (a timeout or its exit status), else None."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child
        code = 0
        try:
            os.setpgid(0, 0)
            run_here(name, ctx)
        except BaseException:  # noqa: BLE001 - the child must reach os._exit whatever happened
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    try:
        os.setpgid(pid, pid)
    except (ProcessLookupError, PermissionError):
        pass  # the child did it first, or has already exited
    deadline = time.monotonic() + timeout
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            kill_group(pid)  # helpers it left behind (compile workers and the like)
            CPU_SECONDS[name] = usage.ru_utime + usage.ru_stime
            return None if status == 0 else f"exit status {os.waitstatus_to_exitcode(status)}"
        if time.monotonic() > deadline:
            kill_group(pid)
            os.waitpid(pid, 0)
            return f"timeout after {timeout:.0f} s"
        time.sleep(0.05)


def run_spawned(name: str, args: argparse.Namespace, workdir: Path, timeout: float) -> str | None:
    """The section in a fresh interpreter (``--section``), its own session, killed after ``timeout`` s."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--section", name, "--workdir", str(workdir),
            "--precision", args.precision, "--seed", str(args.seed)] + (["--dry-run"] if args.dry_run else [])
    proc = subprocess.Popen(argv, start_new_session=True)
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc.pid)
        proc.wait()
        return f"timeout after {timeout:.0f} s"
    kill_group(proc.pid)
    return None if code == 0 else f"exit status {code}"


def ok(path: Path) -> bool:
    return path.exists() and json.loads(path.read_text())["status"] == "ok"


def skip_reason(name: str, remaining: float) -> str | None:
    if name.startswith("trl_") and importlib.util.find_spec("trl") is None:
        return "TRL is not importable"
    if name in sampler_sections.NEEDS and importlib.util.find_spec(sampler_sections.NEEDS[name]) is None:
        return f"{sampler_sections.NEEDS[name]} is not importable"
    if remaining < 5:
        return "out of the run's time budget"
    return None


def main() -> int:
    args = build_parser().parse_args()
    if args.section:  # a spawned child
        run_here(args.section, context(args, Path(args.workdir)))
        return 0
    started, start = datetime.now(timezone.utc).isoformat(timespec="seconds"), time.monotonic()
    out = Path(args.out or os.environ.get("OUT") or ROOT / "bench" / "results" / "gpu")
    out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="lightalign-gpu-check-"))
    (workdir / "results").mkdir()
    ctx = context(args, workdir)
    isolation, preload_errors = args.isolation, {}
    if isolation == "fork":
        for module in PRELOAD:
            try:
                __import__(module)
            except Exception:  # noqa: BLE001 - recorded; the sections that need it fail with their own traceback
                preload_errors[module] = traceback.format_exc()
                print(preload_errors[module], file=sys.stderr, flush=True)
        import torch

        if torch.cuda.is_initialized():  # a forked child could not use the GPU: fresh interpreters instead
            isolation = "spawn (CUDA was initialised while importing)"
    budget = args.budget or ctx.sizes.budget
    chosen = [n for n in ORDER if args.sections is None or n in args.sections or n in ALWAYS]
    records: dict[str, dict] = {}
    for name in chosen:
        remaining = budget - (time.monotonic() - start)
        reason = skip_reason(name, remaining)
        if reason is not None:
            records[name] = {"status": "skipped", "reason": reason}
            print(f"\n=== {name}: skipped ({reason}) ===", flush=True)
            continue
        timeout = min(ctx.sizes.boxes.get(name, ctx.sizes.default_box), remaining)
        began = time.monotonic()
        ended = (run_forked(name, ctx, timeout) if isolation.startswith("fork")
                 else run_spawned(name, args, workdir, timeout))
        path = workdir / "results" / f"{name}.json"
        if name == "environment" and isolation == "fork" and not ctx.dry_run and not ok(path):
            # the first section on the GPU: if a forked process cannot use it, fresh interpreters from here on
            isolation = "spawn (the environment section failed forked)"
            print(f"=== {name} failed in a forked process: again in a fresh interpreter ===", flush=True)
            ended = run_spawned(name, args, workdir, timeout)
        if path.exists():
            records[name] = json.loads(path.read_text())
            if name in CPU_SECONDS:
                records[name]["cpu_seconds"] = CPU_SECONDS[name]
        else:
            records[name] = {"status": "timeout" if ended and ended.startswith("timeout") else "failed",
                             "error": f"the section's process ended without a result: {ended}",
                             "seconds": time.monotonic() - began}
        print(f"=== {name}: {records[name]['status']} ({time.monotonic() - began:.1f} s) ===", flush=True)
    report.add_mfu(records)
    payload = {"dry_run": args.dry_run, "device": ctx.device, "precision": args.precision, "isolation": isolation,
               "started": started, "seconds": time.monotonic() - start, "budget": budget,
               "cpu_seconds": time.process_time() + sum(CPU_SECONDS.values()),  # this process and its sections
               "sizes": {k: v for k, v in vars(ctx.sizes).items()}, "versions": sections.versions(),
               "preload_errors": preload_errors, "sections": records, "ratios": report.ratios(records)}
    (out / "gpu_check.json").write_text(json.dumps(payload, indent=2, default=str))
    (out / "gpu_check.md").write_text(report.markdown(payload))
    print("\n" + report.markdown(payload), flush=True)
    if args.keep:
        print(f"working folder kept: {workdir}")
    else:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    bad = [n for n, r in records.items() if r["status"] in ("failed", "timeout")]
    if bad:
        print(f"FAILED sections: {', '.join(bad)}", file=sys.stderr, flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
