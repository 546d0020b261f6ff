"""RLOO throughput and peak memory: lightalign's RLOOModule vs TRL's RLOOTrainer, same model, data, reward, settings.

Run by hand from the repository root, in the bench venv (TRL never enters the dev venv):

    make .venv-bench/.installed
    .venv-bench/bin/python bench/rloo.py [--steps 8] [--warmup 2] [--repeats 3] [--grad-accum 4] [--beta 0.05]
    .venv-bench/bin/python bench/rloo.py --shape longtail      # generated prompts of a long-tailed length mix

bench/grpo.py's benchmark with the RLOO trainers on both sides (its Meter and checks are reused): the `small` config
(~30M params) built once under a fixed seed and saved with the tokenizer; prompts examples/data/arithmetic_prompts.jsonl
(or generated, --shape); reward `digit_fraction_reward` (TRL's signature, used as is by both).

TRL's knobs, mapped: one rollout of G = --generation-batch completions (--num-generations per prompt) is one
optimizer step on both sides. lightalign gets `generation_batch_size=G` and `accumulate_grad_batches=A`; TRL gets
`per_device_train_batch_size=G/A`, `gradient_accumulation_steps=A` and its default `steps_per_generation` (= A, so
its `generation_batch_size` is G). `num_iterations` 1, `beta` (default 0.05, TRL's; the KL goes into the reward on
both sides, so both run a reference forward over every rollout, and both keep the sampling policy's log-probs for it),
`normalize_advantages` off, `epsilon` 0.2, `generate` with the KV cache (no vLLM), temperature 1, top_p 1, top_k 0,
--precisions, no gradient checkpointing, constant learning rate, clip 1.0, torch AdamW, no eval, checkpoints or loggers.
With `--beta 0` lightalign skips the old-policy forward (on-policy, the ratio is 1 by definition) while TRL still
runs it: that is a difference of the implementations, measured as such. `--prompt-sharing on` trains each group's
prompt once on lightalign's side (RLOOModule's `prompt_sharing`, as in bench/grpo.py; TRL has no such layout).

Each framework runs in its own process (peak RSS = its ru_maxrss), alternating, --repeats times (medians). A
callback times optimizer steps --warmup+1 .. --warmup+--steps: completions/s = completions generated and trained in
that window per second; also the generation and reward shares of the window and the mean completion length.
Contention: as bench/grpo.py (wait for a quiet machine, measure the other processes' CPU share in the window, retry
above --max-contention). Results: stdout and bench/results/rloo.json.

Precision (bench/harness.py, the same for every script): `--precisions fp32 bf16` (default: both where the CPU has
native bf16, else fp32) runs each variant in each precision, lightalign with `precision="bf16-mixed"` / `"32-true"`,
TRL with `bf16=True` / `False`, everything else identical. Both dtypes' matmul peaks are measured once at the start
and printed; each run's efficiency is its model FLOP/s over the peak of its own dtype. The closing report lists every
variant (`framework:setting@precision`: figure, efficiency, peak RSS and PSS), each lightalign variant against TRL at
the same precision, and best vs best (each side's fastest variant over all precisions) with that pair's peak memory
ratios.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import data as bench_data  # noqa: E402
import grpo as bench_grpo  # noqa: E402
import harness  # noqa: E402

ROOT, FRAMEWORKS = harness.ROOT, harness.FRAMEWORKS
Meter = bench_grpo.Meter


def check(args: argparse.Namespace) -> None:
    if args.warmup < 1:
        raise SystemExit("--warmup must be >= 1 (the clock starts at the end of optimizer step --warmup).")
    if args.generation_batch % args.num_generations or args.generation_batch % args.grad_accum:
        raise SystemExit("--generation-batch must be divisible by --num-generations and by --grad-accum.")


def run_lightalign(args: argparse.Namespace, meter: Meter) -> dict:
    import lightning as L

    from lightalign import PromptDataModule, RLOOModule
    from lightalign.rewards import digit_fraction_reward

    class Clock(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            meter.step_end(trainer.global_step)

    class TimedRLOOModule(RLOOModule):
        def generate(self, batch, num_generations):
            start = time.perf_counter()
            out = super().generate(batch, num_generations)
            if self.training:
                meter.rollout(out["completion_mask"].sum(-1).tolist(), time.perf_counter() - start)
            return out

        def score(self, *a, **kw):
            start = time.perf_counter()
            out = super().score(*a, **kw)
            if self.training:
                meter.rollouts[-1]["reward_s"] = time.perf_counter() - start
            return out

    L.seed_everything(args.seed, verbose=False)
    module = TimedRLOOModule(
        args.model_dir, reward_funcs=[digit_fraction_reward], num_generations=args.num_generations,
        generation_batch_size=args.generation_batch, max_completion_length=args.max_completion_length,
        temperature=1.0, beta=args.beta, normalize_advantages=False, epsilon=0.2, learning_rate=args.lr,
        lr_scheduler_type="constant", prompt_sharing=args.prompt_sharing == "on")
    data = PromptDataModule(args.data, tokenizer=args.model_dir, num_workers=0, seed=args.seed)
    trainer = L.Trainer(accelerator="cpu", devices=1, precision=harness.lightning_precision(args.precision), max_steps=meter.last,
                        accumulate_grad_batches=args.grad_accum, gradient_clip_val=args.max_grad_norm, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, callbacks=[Clock()])
    trainer.fit(module, data)
    gen, steps, micro = module.rollout_shape
    return {"attn": module.model.config._attn_implementation,
            "shape": f"generation_batch_size={gen} steps_per_generation={steps} micro_batch={micro} "
                     f"accumulate_grad_batches={trainer.accumulate_grad_batches}"}


def run_trl(args: argparse.Namespace, meter: Meter, workdir: Path) -> dict:
    from datasets import load_dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import RLOOConfig, RLOOTrainer

    from lightalign.rewards import digit_fraction_reward

    class Clock(TrainerCallback):
        def on_step_end(self, targs, state, control, **kwargs):
            meter.step_end(state.global_step)

    class TimedRLOOTrainer(RLOOTrainer):
        def _generate(self, prompts):  # tokenize + generate + decode, as lightalign's generate()
            start = time.perf_counter()
            out = super()._generate(prompts)
            if self.model.training:  # out[1]: completion ids, cut after EOS
                meter.rollout([len(ids) for ids in out[1]], time.perf_counter() - start)
            return out

        def _calculate_rewards(self, *a, **kw):
            start = time.perf_counter()
            out = super()._calculate_rewards(*a, **kw)
            if self.model.training:
                meter.rollouts[-1]["reward_s"] = time.perf_counter() - start
            return out

    config = RLOOConfig(
        output_dir=str(workdir / "trl_out"), per_device_train_batch_size=args.generation_batch // args.grad_accum,
        gradient_accumulation_steps=args.grad_accum, num_generations=args.num_generations,
        max_completion_length=args.max_completion_length, temperature=1.0, top_p=1.0, top_k=0, beta=args.beta,
        normalize_advantages=False, epsilon=0.2, num_iterations=1, max_steps=meter.last, learning_rate=args.lr,
        lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch_fused", weight_decay=0.0,
        max_grad_norm=args.max_grad_norm, bf16=harness.trl_bf16(args.precision), fp16=False, gradient_checkpointing=False, use_vllm=False,
        use_cpu=True, dataloader_num_workers=0, eval_strategy="no", save_strategy="no", report_to="none",
        disable_tqdm=True, logging_steps=10, seed=args.seed,
    )
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    dataset = load_dataset("json", data_files=args.data, split="train")
    trainer = TimedRLOOTrainer(model=args.model_dir, reward_funcs=[digit_fraction_reward], args=config,
                               train_dataset=dataset, processing_class=tokenizer, callbacks=[Clock()])
    trainer.train()
    return {"attn": trainer.model.config._attn_implementation,
            "shape": f"generation_batch_size={config.generation_batch_size} "
                     f"steps_per_generation={config.steps_per_generation} "
                     f"micro_batch={config.per_device_train_batch_size} "
                     f"gradient_accumulation_steps={config.gradient_accumulation_steps}"}


def run_one(args: argparse.Namespace) -> dict:
    import os

    import torch

    torch.set_num_threads(args.threads)
    workdir = Path(tempfile.mkdtemp(prefix=f"rloo-{args.framework}-", dir=args.workdir))
    os.environ["HF_DATASETS_CACHE"] = str(workdir / "datasets")  # no dataset cache hit across runs
    meter = Meter(args.warmup, args.steps)
    pss = harness.PeakPSS()
    extra = run_lightalign(args, meter) if args.framework == "lightalign" else run_trl(args, meter, workdir)
    setting = "default" if args.framework == "lightalign" else "generate"  # lightalign's default sampler; TRL's
    return {"framework": args.framework, "setting": setting, "precision": args.precision,
            "variant": f"{args.framework}:{setting}@{args.precision}", **meter.summary(),
            "threads": torch.get_num_threads(), "peak_rss_mb": harness.peak_rss_mb(), "peak_pss_mb": pss.stop(),
            **extra}


def spawn(args: argparse.Namespace, framework: str, precision: str = "fp32") -> dict | None:
    argv = ["--framework", framework, "--precision", precision, "--model-dir", args.model_dir, "--workdir", args.workdir, "--data", args.data]
    for name in ("num_generations", "generation_batch", "grad_accum", "max_completion_length", "beta", "steps",
                 "warmup", "threads", "lr", "max_grad_norm", "seed", "prompt_sharing"):
        argv += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    return harness.spawn(__file__, argv, args.threads, f"rloo {framework}@{precision}")


def completion_flops(args: argparse.Namespace, mean_prompt: float, mean_completion: float) -> float:
    """Model FLOPs per completion (bench/harness.py's formula, on mean lengths): generation (one forward over prompt
    and completion, KV cache), the policy forward + backward, and with beta > 0 the reference forward and the
    sampling policy's forward the KL penalty needs (both sides run them). beta 0: generation + training only."""
    shape = harness.model_shape(args.model_dir)
    s = [round(mean_prompt + mean_completion)]
    forward = harness.forward_flops(args.n_params, shape["layers"], shape["hidden"], s)
    train = harness.train_flops(args.n_params, shape["layers"], shape["hidden"], s)
    return forward * (3 if args.beta > 0 else 1) + train


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(ROOT / "assets" / "models" / "small"), help="config + tokenizer folder")
    parser.add_argument("--data", default=str(ROOT / "examples" / "data" / "arithmetic_prompts.jsonl"))
    parser.add_argument("--shape", choices=bench_data.SHAPES, help="generate prompts of this length shape "
                        "(bench/data.py) instead of --data")
    parser.add_argument("--mean-length", type=int, default=24, help="mean words per generated prompt")
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--generation-batch", type=int, default=32, help="completions per rollout (= per step)")
    parser.add_argument("--grad-accum", type=int, default=4, help="micro-batches per step (micro-batch = G / A)")
    parser.add_argument("--max-completion-length", type=int, default=32)
    parser.add_argument("--beta", type=float, default=0.05, help="KL coefficient (TRL's default 0.05; 0: no "
                        "reference model)")
    parser.add_argument("--prompt-sharing", choices=("on", "off"), default="off",
                        help="lightalign trains each group's prompt once (RLOOModule prompt_sharing, as GRPO's)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-contention", type=float, default=0.03,
                        help="a run during which other processes used more of the machine is retried; a negative "
                             "value neither waits nor retries (figures then marked contended by their share)")
    parser.add_argument("--retries", type=int, default=2)
    parser.add_argument("--frameworks", nargs="+", default=list(FRAMEWORKS), choices=FRAMEWORKS)
    parser.add_argument("--out", default="rloo.json", help="file name under bench/results/")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    harness.add_precision_arguments(parser)
    for hidden in ("--framework", "--model-dir", "--workdir"):  # set by the parent for its subprocesses
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    return parser


def run(args: argparse.Namespace) -> dict:
    """Build the model (and prompts), run each framework --repeats times (retrying contended runs)."""
    from transformers import AutoTokenizer

    check(args)
    harness.peaks_of(args)
    contention = None if args.max_contention is None or args.max_contention < 0 else args.max_contention
    args.workdir = tempfile.mkdtemp(prefix="bench-rloo-")
    try:
        args.model_dir = str(Path(args.workdir) / "model")
        args.n_params = n_params = harness.build_model(args.model, Path(args.model_dir), args.seed)
        per_rollout = args.generation_batch // args.num_generations
        if args.shape:
            n = max(64, 2 * (args.warmup + args.steps) * per_rollout)
            args.data = str(bench_data.write(Path(args.workdir) / "prompts.jsonl", "prompts", args.shape, n,
                                             args.mean_length, args.seed))
        tok = AutoTokenizer.from_pretrained(args.model_dir)
        prompts = [json.loads(line)["prompt"] for line in open(args.data) if line.strip()]
        prompt_lens = [len(ids) for ids in tok(prompts)["input_ids"]]
        if (args.warmup + args.steps) * per_rollout > len(prompts):
            raise SystemExit(f"{args.data} has {len(prompts)} prompts: fewer than (warmup + steps) x {per_rollout}.")
        settings = {
            "model": f"{Path(args.model).name} ({n_params / 1e6:.1f}M params, seed {args.seed}, saved once, "
                     "loaded by both)",
            "data": (f"generated prompts, shape {args.shape}" if args.shape else Path(args.data).name)
            + f" ({len(prompts)} prompts, {min(prompt_lens)}-{max(prompt_lens)} tokens)",
            "reward": "lightalign.rewards.digit_fraction_reward", "num_generations": args.num_generations,
            "generation_batch_size": args.generation_batch, "micro_batch": args.generation_batch // args.grad_accum,
            "grad_accum": args.grad_accum, "steps_per_generation": f"default (= grad_accum = {args.grad_accum})",
            "num_iterations": 1, "max_completion_length": args.max_completion_length,
            "lightalign_prompt_sharing": args.prompt_sharing,
            "sampling": "temperature 1.0, top_p 1.0, top_k 0, generate() with KV cache, no vLLM",
            "loss": f"RLOO, beta {args.beta} (KL in the reward), epsilon 0.2, normalize_advantages off",
            "precisions": " / ".join(args.precisions) + " (fp32: lightalign 32-true, TRL bf16=False; bf16: lightalign bf16-mixed, TRL bf16=True)",
            "gradient_checkpointing": False,
            "optimizer": "torch AdamW fused (both defaults), wd 0",
            "lr": f"{args.lr} constant", "max_grad_norm": args.max_grad_norm, "threads": args.threads,
            "warmup_steps": args.warmup, "timed_steps": args.steps, "repeats": args.repeats,
            "max_contention": contention, "versions": harness.versions(),
        }
        harness.print_settings("RLOO benchmark: lightalign RLOOModule vs TRL RLOOTrainer "
                               "(one rollout = one optimizer step)", settings)
        mean_prompt = statistics.mean(prompt_lens)
        runs = []
        for r in range(args.repeats):
            for framework, precision in [(fw, p) for p in args.precisions
                                         for fw in harness.alternate(args.frameworks, r)]:
                for attempt in range(args.retries + 1):  # 2 shared cores: a busy machine skews everything
                    quiet = harness.wait_for_quiet(contention, timeout=900)
                    res = spawn(args, framework, precision)
                    if res is None or contention is None or res["others_cpu_share"] <= contention:
                        break
                    print(f"[{r + 1}/{args.repeats}] {framework:>10}: other processes used "
                          f"{100 * res['others_cpu_share']:.0f}% of the machine (before: {100 * quiet:.0f}%); "
                          f"{'retrying' if attempt < args.retries else 'kept, marked contended'}", flush=True)
                if res is None:
                    continue
                res["repeat"] = r + 1
                res["contended"] = contention is None or res["others_cpu_share"] > contention
                res["model_flops_per_sec"] = res["completions_per_sec"] * completion_flops(
                    args, mean_prompt, res["mean_completion_length"])
                runs.append(res)
                print(f"[{r + 1}/{args.repeats}] {res['variant']:>24}: {res['completions_per_sec']:6.2f} completions/s "
                      f"{res['completion_tokens_per_sec']:6.0f} tokens/s  "
                      f"mean length {res['mean_completion_length']:5.2f}"
                      f"  generation {100 * res['generation_share']:4.1f}%  reward {100 * res['reward_share']:4.2f}%"
                      f"  peak RSS {res['peak_rss_mb']:6.0f} MB (PSS {res['peak_pss_mb']:6.0f})\n{'':>16}threads {res['threads']} (CPU/wall "
                      f"{res['cpu_per_wall']:.2f}, other processes {100 * res['others_cpu_share']:.0f}% of the machine)"
                      f"  attn {res['attn']}  {res['shape']}", flush=True)
    finally:
        shutil.rmtree(args.workdir, ignore_errors=True)

    keys = ("completions_per_sec", "mean_completion_length", "peak_rss_mb", "peak_pss_mb", "generation_share",
            "reward_share", "others_cpu_share", "model_flops_per_sec")
    summary = {v: {k: harness.median_of(runs, k, variant=v) for k in keys}
               for v in dict.fromkeys(r["variant"] for r in runs)}
    report = harness.precision_report(runs, "completions_per_sec", args.peaks)
    return {"settings": settings, "runs": runs, "summary": summary,
            "ratio": (report["best_vs_best"] or {}).get("ratio"), "n_params": n_params, "precision_report": report}


def main() -> None:
    args = build_parser().parse_args()
    args.data = str(Path(args.data).resolve())
    if args.one:
        check(args)
        harness.emit(run_one(args))
        return
    result = run(args)
    print("\n| variant | completions/s | mean completion length | generation share | peak RSS MB |"
          "\n|---|---|---|---|---|")
    for fw, row in result["summary"].items():
        print(f"| {fw} | {row['completions_per_sec']:.2f} | {row['mean_completion_length']:.2f} "
              f"| {100 * row['generation_share']:.0f}% | {row['peak_rss_mb']:.0f} |")
    if result["ratio"] is not None:
        print(f"\nbest lightalign / best TRL completions/s: {result['ratio']:.2f}x (median of {args.repeats} run(s) "
              "each)")
    contended = sum(r["contended"] for r in result["runs"])
    if contended:
        print(f"WARNING: {contended} run(s) shared the machine with other processes (see above); figures are skewed.")
    harness.print_precision_report(result["precision_report"])
    print(f"\nwrote {harness.write_json(args.out, result).relative_to(ROOT)}")


if __name__ == "__main__":
    main()
