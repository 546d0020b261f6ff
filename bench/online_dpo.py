"""Online DPO throughput and peak memory: lightalign's OnlineDPOModule vs TRL 1.16's OnlineDPOTrainer
(trl.experimental.online_dpo), same model, prompts, reward function and settings.

Run by hand from the repository root in the bench venv (TRL never enters the dev venv):

    .venv-bench/bin/python bench/online_dpo.py [--steps 20] [--warmup 2] [--repeats 2] [--data arithmetic|english]

Model: the shipped `tiny` config (`--model`, e.g. assets/models/small) with random weights under a fixed seed, saved
with the tokenizer to a temporary folder both frameworks load; the reference is a frozen copy of it on both sides
(TRL's `create_reference_model`, lightalign's `Reference` component).

Data, the same plain-text prompts for both (no chat template on either side): `--data arithmetic` =
examples/data/arithmetic_prompts.jsonl (the online-DPO demo's prompts, the project's tuning data); `--data english` =
prompts made from assets/english_lines.txt by bench/data.py (long-tailed lengths, mean `--mean-length` words; data
no setting was tuned on). Reward: `lightalign.rewards.digit_fraction_reward` (the demo's) on both sides, called with
the prompts and the decoded completions.

Settings (`--variants`, `framework:setting`): `short` (8 new tokens per completion, the demo's) and `long`
(`--max-new-tokens`, 32). Common: `--batch-size` prompts per optimizer step (two completions each, no gradient
accumulation), loss sigmoid, beta 0.1, sampling at temperature 1 with top_k 0 / top_p 1 and a KV cache, no vLLM,
--precisions, no gradient checkpointing, torch AdamW (TRL: its fused default), weight decay 0, constant learning rate, grad
clip 1.0, dropout off (both defaults), 2 threads, no eval, checkpoints or loggers. lightalign samples with its device
default (`generation_backend` unset; the sampler is reported) or the backend of a `+<backend>` suffix
(`lightalign:long+generate`); TRL with `generate`. A random model rarely writes EOS, so completions run to the
token limit on both sides (the mean completion length is reported: compare only rows where they agree).

Each (framework, setting) runs in its own process (peak RSS = its ru_maxrss; peak PSS sampled every 0.25 s), settings
interleaved (lightalign, TRL, ...; reversed on odd repeats), --repeats times; medians reported. Optimizer steps
--warmup+1 .. --warmup+--steps are timed. The losses are not compared here (each side samples its own completions):
the DPO loss is checked against TRL on identical tensors in tests/ (dpo_loss).
Results: stdout and bench/results/online_dpo_<data>.json.

Precision (bench/harness.py, the same for every script): `--precisions fp32 bf16` (default: both where the CPU has
native bf16, else fp32) runs each variant in each precision, lightalign with `precision="bf16-mixed"` / `"32-true"`,
TRL with `bf16=True` / `False`, everything else identical; a `--variants` entry may name its precision
(`trl:long@bf16`). Both dtypes' matmul peaks are measured once at the start and printed; each run's efficiency is its
model FLOP/s over the peak of its own dtype. The closing report lists every variant (`framework:setting@precision`:
figure, efficiency, peak RSS and PSS), each lightalign variant against TRL at the same precision, and best vs best
(each side's fastest variant over all precisions) with that pair's peak memory ratios.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import data as bench_data  # noqa: E402
import harness  # noqa: E402

ROOT, FRAMEWORKS = harness.ROOT, harness.FRAMEWORKS
SETTINGS = ("short", "long")
BACKENDS = ("generate", "continuous", "static", "compact")  # OnlineDPOModule's generation_backend
DATA = {"arithmetic": ROOT / "examples" / "data" / "arithmetic_prompts.jsonl", "english": None}
REWARD = "lightalign.rewards.digit_fraction_reward"


def new_tokens(args: argparse.Namespace, setting: str) -> int:
    return 8 if setting == "short" else args.max_new_tokens


class Meter(harness.StepWindow):
    """The timed window, and the completions each optimizer step trained on."""

    def __init__(self, warmup: int, steps: int) -> None:
        super().__init__(warmup, steps)
        self.batches: list[dict] = []  # one per optimizer step

    def batch(self, completions: int, completion_tokens: int, lengths: list[int]) -> None:
        """One optimizer step's completions, their tokens, and each sequence's real length (prompt + completion)."""
        self.batches.append({"completions": completions, "completion_tokens": completion_tokens, "lengths": lengths})

    def summary(self) -> dict:
        timed = self.timed(self.batches)
        seconds, tokens = self.window.seconds, sum(b["completion_tokens"] for b in timed)
        return {"steps_per_sec": len(timed) / seconds, "completion_tokens_per_sec": tokens / seconds,
                "seconds": seconds, "steps_per_cpu_sec": len(timed) / self.cpu,
                "mean_completion_length": tokens / sum(b["completions"] for b in timed),
                "lengths": [n for b in timed for n in b["lengths"]],
                "others_cpu_share": self.window.others_cpu_share}


def run_lightalign(args: argparse.Namespace, meter: Meter) -> dict:
    import lightning as L

    from lightalign import OnlineDPOModule, PromptDataModule

    setting, _, backend = args.setting.partition("+")

    class Clock(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            meter.step_end(trainer.global_step)

    class TimedOnlineDPOModule(OnlineDPOModule):
        def pair_loss(self, rollout, stats):
            meter.batch(int(rollout["completion_ids"].shape[0]), int(rollout["completion_mask"].sum()),
                        (rollout["prompt_mask"].sum(-1) + rollout["completion_mask"].sum(-1)).tolist())
            return super().pair_loss(rollout, stats)

    L.seed_everything(args.seed, verbose=False)
    module = TimedOnlineDPOModule(
        args.model_dir, reward_funcs=[REWARD], beta=args.beta, loss_type="sigmoid",
        max_completion_length=new_tokens(args, setting), temperature=1.0,
        generation_backend=backend or None, learning_rate=args.lr, lr_scheduler_type="constant", weight_decay=0.0)
    data = PromptDataModule(args.prompts, tokenizer=args.model_dir, max_prompt_length=args.max_prompt_length,
                            batch_size=args.batch_size, num_workers=0, seed=args.seed)
    trainer = L.Trainer(accelerator="cpu", devices=1, precision=harness.lightning_precision(args.precision), max_steps=meter.last,
                        gradient_clip_val=args.max_grad_norm, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        num_sanity_val_steps=0, callbacks=[Clock()])
    trainer.fit(module, data)
    samplers = ", ".join(f"{who} {name[0]}" for who, name in module.sampling.chosen.items())
    return {"backend": samplers or "-", "attn": module.model.config._attn_implementation}


def run_trl(args: argparse.Namespace, meter: Meter) -> dict:
    from datasets import load_dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    from lightalign.rewards.functions import digit_fraction_reward

    class Clock(TrainerCallback):
        def on_step_end(self, targs, state, control, **kwargs):
            meter.step_end(state.global_step)

    class TimedOnlineDPOTrainer(OnlineDPOTrainer):
        def _forward(self, model, prompt_ids, prompt_mask, completion_ids, completion_mask, *rest):
            if model is self.model or getattr(model, "module", None) is self.model:  # the policy's forward
                meter.batch(int(completion_ids.shape[0]), int(completion_mask.sum()),
                            (prompt_mask.sum(-1) + completion_mask.sum(-1)).tolist())
            return super()._forward(model, prompt_ids, prompt_mask, completion_ids, completion_mask, *rest)

    config = OnlineDPOConfig(
        output_dir=str(Path(args.workdir) / "trl_out"), per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=1, max_new_tokens=new_tokens(args, args.setting), temperature=1.0, top_k=0,
        top_p=1.0, beta=[args.beta], loss_type="sigmoid", max_steps=meter.last, learning_rate=args.lr,
        lr_scheduler_type="constant", optim="adamw_torch_fused", weight_decay=0.0, max_grad_norm=args.max_grad_norm,
        bf16=harness.trl_bf16(args.precision), fp16=False, gradient_checkpointing=False, use_cpu=True, dataloader_num_workers=0,
        eval_strategy="no", save_strategy="no", report_to="none", disable_tqdm=True, logging_steps=10,
        seed=args.seed, disable_dropout=True)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    dataset = load_dataset("json", data_files=args.prompts, split="train").select_columns(["prompt"])
    trainer = TimedOnlineDPOTrainer(model=args.model_dir, reward_funcs=[digit_fraction_reward], args=config,
                                    train_dataset=dataset, processing_class=tokenizer, callbacks=[Clock()])
    trainer.train()
    return {"backend": "generate", "attn": trainer.model.config._attn_implementation}


def run_one(args: argparse.Namespace) -> dict:
    train = run_lightalign if args.framework == "lightalign" else run_trl
    return harness.measured_run(args, Meter(args.warmup, args.steps), train)


def spawn(args: argparse.Namespace, variant: str) -> dict | None:
    base, precision = harness.split_precision(variant)
    framework, _, setting = base.partition(":")
    argv = ["--framework", framework, "--setting", setting, "--precision", precision or "fp32", "--workdir",
            args.workdir]
    for name in ("model_dir", "prompts", "batch_size", "max_new_tokens", "max_prompt_length", "beta", "steps",
                 "warmup", "threads", "lr", "max_grad_norm", "seed"):
        argv += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    return harness.spawn(__file__, argv, args.threads, f"online_dpo {variant}")


def window_flops(args: argparse.Namespace, lengths: list[int]) -> float:
    """Model FLOPs of a run's timed window (bench/harness.py's formula on each sequence's real length): per sequence
    its sampling (one forward over prompt + completion with the KV cache), the policy's forward + backward and the
    frozen reference's forward. The same count for both frameworks: the work the method needs."""
    shape = harness.model_shape(args.model_dir)
    forward = harness.forward_flops(args.n_params, shape["layers"], shape["hidden"], lengths)
    return 2 * forward + harness.train_flops(args.n_params, shape["layers"], shape["hidden"], lengths)


def write_prompts(args: argparse.Namespace) -> list[str]:
    if args.data == "english":
        n = max(256, 2 * args.batch_size * (args.warmup + args.steps))
        prompts = [r["prompt"] for r in bench_data.rows("prompts", args.shape, n, args.mean_length, args.seed)]
    else:
        prompts = [json.loads(line)["prompt"] for line in open(DATA[args.data]) if line.strip()]
    args.prompts = str(Path(args.workdir) / "prompts.jsonl")
    with open(args.prompts, "w") as f:
        f.writelines(json.dumps({"prompt": p}) + "\n" for p in prompts)
    return prompts


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(ROOT / "assets" / "models" / "tiny"), help="config + tokenizer")
    parser.add_argument("--data", choices=tuple(DATA), default="arithmetic")
    parser.add_argument("--mean-length", type=int, default=24, help="--data english: mean words per prompt")
    parser.add_argument("--shape", choices=bench_data.SHAPES, default="longtail",
                        help="--data english: the length shape of bench/data.py (uniform: the held-out one)")
    parser.add_argument("--variants", nargs="+", default=None, help="framework:setting entries (settings: "
                        f"{', '.join(SETTINGS)}; lightalign's may end in +<sampler>, e.g. lightalign:long+generate; "
                        "default: every setting for both frameworks)")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per optimizer step (2 completions each)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="the `long` setting's completion tokens")
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--out", default=None, help="file name under bench/results/ (default online_dpo_<data>.json)")
    harness.add_run_arguments(parser)
    for hidden in ("--framework", "--setting", "--workdir", "--model-dir", "--prompts"):  # set by the parent
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    parser.add_argument("--max-prompt-length", type=int, help=argparse.SUPPRESS)
    return parser


def check(args: argparse.Namespace) -> None:
    harness.check_variants(args, SETTINGS, BACKENDS)


def run(args: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer

    check(args)
    harness.peaks_of(args)
    args.workdir = tempfile.mkdtemp(prefix="bench-online-dpo-")
    try:
        args.model_dir = str(Path(args.workdir) / "model")
        args.n_params = n_params = harness.build_model(args.model, Path(args.model_dir), args.seed)
        prompts = write_prompts(args)
        tok = AutoTokenizer.from_pretrained(args.model_dir)
        lengths = [len(tok(p, add_special_tokens=False)["input_ids"]) for p in prompts]
        args.max_prompt_length = max(lengths)  # prompts kept whole on both sides
        if (args.warmup + args.steps) * args.batch_size > len(prompts):
            raise SystemExit(f"{len(prompts)} prompts: fewer than (warmup + steps) x batch size.")
        settings = {
            "model": f"{Path(args.model).name} ({n_params / 1e6:.1f}M params, random, seed {args.seed}); reference: "
                     "a frozen copy",
            "data": (f"english_lines prompts (bench/data.py {args.shape}, mean {args.mean_length} words)"
                     if args.data == "english" else Path(DATA[args.data]).name)
            + f", plain text, {len(prompts)} prompts of {min(lengths)}-{max(lengths)} tokens",
            "reward": REWARD, "batch_size": f"{args.batch_size} prompts x 2 completions", "grad_accum": 1,
            "max_new_tokens": f"short 8, long {args.max_new_tokens}", "loss": f"sigmoid, beta {args.beta}",
            "sampling": "temperature 1, top_k 0, top_p 1, KV cache, no vLLM", "variants": args.variants,
            "gradient_checkpointing": False, "optimizer": "torch AdamW fused, wd 0",
            **harness.run_settings(args),
        }
        harness.print_settings("Online DPO benchmark: lightalign OnlineDPOModule vs TRL OnlineDPOTrainer", settings)
        runs = harness.interleaved_runs(args, spawn, lambda res: (
            f"{res['steps_per_sec']:6.2f} steps/s ({res['steps_per_cpu_sec']:.2f} per CPU-s) "
            f"{res['completion_tokens_per_sec']:7.0f} completion tokens/s  completion length "
            f"{res['mean_completion_length']:5.1f}  peak RSS {res['peak_rss_mb']:5.0f} MB "
            f"(PSS {res['peak_pss_mb']:5.0f})"
            f"  other processes {100 * res['others_cpu_share']:.0f}%  sampler {res['backend']}"))
        for res in runs:
            res["model_flops_per_sec"] = window_flops(args, res.pop("lengths")) / res["seconds"]
    finally:
        shutil.rmtree(args.workdir, ignore_errors=True)
    result = summarise(settings, runs)
    result["precision_report"] = harness.precision_report(runs, "steps_per_sec", args.peaks)
    return result


def summarise(settings: dict, runs: list[dict]) -> dict:
    keys = ("steps_per_sec", "steps_per_cpu_sec", "completion_tokens_per_sec", "mean_completion_length",
            "peak_rss_mb", "peak_pss_mb", "others_cpu_share")
    summary = {v: {k: harness.median_of(runs, k, variant=v) for k in keys}
               for v in dict.fromkeys(r["variant"] for r in runs)}
    for variant, row in summary.items():
        row["vs_trl_same_setting"] = harness.ratio(
            row["steps_per_sec"], summary.get(harness.trl_same_setting(variant), {}).get("steps_per_sec"))
    return {"settings": settings, "runs": runs, "summary": summary}


def main() -> None:
    args = build_parser().parse_args()
    if args.one:
        harness.emit(run_one(args))
        return
    result = run(args)
    print("\n| variant | steps/s | steps per CPU-s | completion tokens/s | completion length | peak RSS MB "
          "| peak PSS MB | vs TRL same setting |\n" + "|---" * 8 + "|")
    for variant, row in result["summary"].items():
        print(f"| {variant} | {harness.fmt(row['steps_per_sec'], '.2f')} "
              f"| {harness.fmt(row['steps_per_cpu_sec'], '.2f')} "
              f"| {harness.fmt(row['completion_tokens_per_sec'], '.0f')} "
              f"| {harness.fmt(row['mean_completion_length'], '.1f')} "
              f"| {harness.fmt(row['peak_rss_mb'], '.0f')} | {harness.fmt(row['peak_pss_mb'], '.0f')} "
              f"| {harness.fmt(row['vs_trl_same_setting'], '.2f')}x |")
    busy = [r for r in result["runs"] if r["others_cpu_share"] > 0.03]
    if busy:
        print(f"WARNING: {len(busy)} run(s) shared the machine with other processes (>3% of it): figures are skewed.")
    harness.print_precision_report(result["precision_report"])
    out = args.out or f"online_dpo_{args.data}.json"
    print(f"\nwrote {harness.write_json(out, result).relative_to(ROOT)}")


if __name__ == "__main__":
    main()
