"""Train every shipped tiny config a few steps and print a hash of the trained weights.

Run before and after a change that claims "behaviour unchanged": identical hashes mean bit-identical weights.

    python bench/weight_hashes.py [--steps 6] [--only grpo_quickstart,ppo_quickstart]

Each config runs through the ``lightalign`` console script in a subprocess (what users run) with loggers and
validation off; the hash covers every tensor of the last checkpoint's ``state_dict`` (policy, value head) and the
optimizer state. The iterative SFT example runs in-process through its Python API.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
# every shipped config that runs offline (sft.yaml, dpo.yaml, grpo.yaml and grpo_vllm.yaml name hub models or a GPU)
CONFIGS = ["quickstart", "dpo_tiny", "kto_tiny", "reward_tiny", "grpo_quickstart", "rloo_quickstart",
           "ppo_quickstart", "online_dpo_quickstart", "distill_quickstart", "tools_sft", "tools_grpo"]


def tensor_digest(obj, digest) -> None:
    if isinstance(obj, torch.Tensor):
        digest.update(obj.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, dict):
        for key in sorted(obj, key=str):
            digest.update(str(key).encode())
            tensor_digest(obj[key], digest)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            tensor_digest(item, digest)
    elif isinstance(obj, (int, float, str, bool)) or obj is None:
        digest.update(repr(obj).encode())


def seeded_teacher(folder: Path) -> str:
    """A teacher for distill_quickstart (whose config names the quickstart run's export): the tiny model's config with
    weights drawn from seed 0, saved with its tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    source = ROOT / "assets" / "models" / "tiny"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source)).save_pretrained(folder)
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    return str(folder)


def hash_config(name: str, steps: int, exe: str) -> tuple[str, str]:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [exe, "fit", "--config", str(ROOT / "configs" / f"{name}.yaml"), f"--trainer.max_steps={steps}",
               "--trainer.logger=false", "--trainer.limit_val_batches=0", f"--trainer.default_root_dir={tmp}",
               "--trainer.enable_progress_bar=false"]
        if name == "distill_quickstart":
            cmd.append(f"--model.teacher_model_name_or_path={seeded_teacher(Path(tmp) / 'teacher')}")
        run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                             env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
        if run.returncode != 0:
            raise SystemExit(f"{name} failed:\n{run.stderr[-3000:]}")
        ckpts = sorted(Path(tmp).rglob("*.ckpt"), key=lambda p: p.stat().st_mtime)
        if not ckpts:
            raise SystemExit(f"{name}: no checkpoint written under {tmp}")
        state = torch.load(ckpts[-1], map_location="cpu", weights_only=False)
        weights, optim = hashlib.sha256(), hashlib.sha256()
        tensor_digest(state["state_dict"], weights)
        tensor_digest([o.get("state") for o in state.get("optimizer_states", [])], optim)
        return weights.hexdigest()[:16], optim.hexdigest()[:16]


def hash_iterative_sft(rounds: int) -> tuple[str, str]:
    sys.path.insert(0, str(ROOT / "examples"))
    torch.set_num_threads(1)
    import iterative_sft  # noqa: E402

    import lightalign

    captured = {}
    original = lightalign.IterativeSFT.step

    def step(self, *args, **kwargs):
        captured["module"] = self
        return original(self, *args, **kwargs)

    lightalign.IterativeSFT.step = step
    try:
        iterative_sft.main(rounds=rounds)
    finally:
        lightalign.IterativeSFT.step = original
    weights = hashlib.sha256()
    tensor_digest(captured["module"].model.state_dict(), weights)
    return weights.hexdigest()[:16], "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--only", default="")
    args = parser.parse_args()
    exe = str(Path(sys.executable).with_name("lightalign"))
    names = [n for n in args.only.split(",") if n] or CONFIGS + ["iterative_sft"]
    for name in names:
        if name == "iterative_sft":
            weights, optim = hash_iterative_sft(rounds=3)
        else:
            weights, optim = hash_config(name, args.steps, exe)
        print(f"{name:18s} weights {weights}  optimizer {optim}", flush=True)


if __name__ == "__main__":
    main()
