"""GRPO throughput and peak memory: lightalign's GRPOModule vs TRL's GRPOTrainer, same model, data, reward, settings.

Run by hand from the repository root, in a separate venv so TRL never enters the dev venv:

    python3 -m venv /work/benchvenv && /work/benchvenv/bin/pip install torch==2.13.0
    /work/benchvenv/bin/pip install -e '.[bench]'
    /work/benchvenv/bin/python bench/grpo.py [--steps 8] [--warmup 2] [--repeats 3] [--grad-accum 4]
    /work/benchvenv/bin/python bench/grpo.py --shape longtail      # generated prompts of a long-tailed length mix
    /work/benchvenv/bin/python bench/grpo.py --shape reasoning     # short prompts, long completions of varied length

`--shape reasoning` is the RL-for-reasoning workload: the short arithmetic prompts, `--max-completion-length` 256
and an EOS logit bias (`--eos-bias`, default 2.3 there) added to the model's output logits by a forward hook on its
output embedding in both frameworks (generation and training alike: it is part of the benchmark model), so the
random-weight model's completions end at geometric, varied lengths; on lightalign's side the hook is registered by the
model's class (bench/eos_bias.py), so the asynchronous sampling process, which rebuilds the class, has it too (EOS probability about 1% per token: mean about
95 tokens, some hit 256). It runs each `--variants` entry: `lightalign:<generation_backend>` (generate, continuous,
static, compact; a `+padding_free` suffix trains that variant padding-free instead of with --prompt-sharing, and
`+async<N>` samples ahead in a sampling process with `max_staleness: N`: the training process then logs the time it
waited as its generation share, and the sampling process's busy share is reported beside it)
and `trl:generate` / `trl:continuous` (TRL's `use_transformers_continuous_batching`, its paged cache sized like
lightalign's instead of from half the machine's RAM, which is TRL's CPU default).

The `small` config (~30M params) is built once under a fixed seed and saved with the tokenizer to a temporary folder
that both frameworks load. Prompts: examples/data/arithmetic_prompts.jsonl; reward: `digit_fraction_reward` (TRL's
signature, used as is by both). One rollout of G = --generation-batch completions (--num-generations per prompt) is
one optimizer step on both sides: lightalign gets `generation_batch_size=G`, `accumulate_grad_batches=A`; TRL gets
`per_device_train_batch_size=G/A`, `gradient_accumulation_steps=A` and the default `steps_per_generation` (= A, so
`generation_batch_size` = G). `generate` with the KV cache (no vLLM), --precisions, no gradient checkpointing, beta 0 (no
reference), dapo, constant learning rate, clip 1.0, torch AdamW, 2 threads, no eval, checkpoints or loggers.

Each framework runs in its own process (peak RSS = its ru_maxrss), alternating, --repeats times (medians reported).
A callback times optimizer steps --warmup+1 .. --warmup+--steps; completions/s = completions generated and trained
in that window per second. Also reported: generation and reward time shares and the mean completion length (tokens,
EOS included: completions may stop early). Two threads on two shared cores collapse when anything else runs, so each
run waits for a quiet machine, measures the CPU share other processes took during its window (/proc/stat) and is
retried above --max-contention (kept and marked after --retries). Results: stdout and bench/results/grpo.json.
MFU: completions/s x the model FLOPs of one completion (`completion_flops`), over the measured matmul peak.

Precision (bench/harness.py, the same for every script): `--precisions fp32 bf16` (default: both where the CPU has
native bf16, else fp32) runs each variant in each precision, lightalign with `precision="bf16-mixed"` / `"32-true"`,
TRL with `bf16=True` / `False`, everything else identical; a `--variants` entry may name its precision
(`lightalign:compact@bf16`); `+async<N>` (max_staleness > 0) is refused under bf16-mixed by design and skipped with a
note. Both dtypes' matmul peaks are measured once at the start and printed; each run's efficiency is its model FLOP/s
over the peak of its own dtype. The closing report lists every variant (`framework:setting@precision`: figure,
efficiency, peak RSS and PSS), each lightalign variant against TRL at the same precision, and best vs best (each
side's fastest variant over all precisions) with that pair's peak memory ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import data as bench_data  # noqa: E402
import harness  # noqa: E402
from harness import machine_busy_seconds  # noqa: E402

ROOT, FRAMEWORKS = harness.ROOT, harness.FRAMEWORKS


class Meter:
    """Times optimizer steps warmup+1 .. warmup+steps; records every rollout (lengths, generation/reward seconds)."""

    def __init__(self, warmup: int, steps: int) -> None:
        self.warmup, self.last = warmup, warmup + steps
        self.start = self.end = self.cpu = self.busy = None
        self.seen = 0
        self.rollouts: list[dict] = []  # one per generation, in order: rollout k serves optimizer step k + 1

    def step_end(self, step: int, helper_cpu: float = 0.0) -> None:
        """Called after every micro-batch / optimizer step with the optimizer steps done so far (acts on changes);
        ``helper_cpu``: CPU seconds so far of the run's own helper processes (lightalign's sampling process)."""
        if step == self.seen:
            return
        self.seen = step
        if step == self.warmup:
            self.start, self.busy = time.perf_counter(), machine_busy_seconds()
            self.cpu = time.process_time() + helper_cpu
        elif step == self.last:
            self.end = time.perf_counter()
            self.cpu = time.process_time() + helper_cpu - self.cpu
            self.busy = machine_busy_seconds() - self.busy

    def rollout(self, lengths: list[int], gen_seconds: float, sampler_seconds: float | None = None) -> None:
        """One rollout: its completion lengths, the seconds the training process spent on (or waited for) its
        sampling, and (sampled ahead) the seconds the sampling process took."""
        self.rollouts.append({"n": len(lengths), "tokens": sum(lengths), "gen_s": gen_seconds, "reward_s": 0.0,
                              "sampler_s": gen_seconds if sampler_seconds is None else sampler_seconds,
                              "reward": None})

    def summary(self) -> dict:
        if self.end is None:
            raise RuntimeError(f"training stopped before optimizer step {self.last}: too few prompts?")
        timed = self.rollouts[self.warmup:self.last]
        if len(timed) != self.last - self.warmup:
            raise RuntimeError(f"{len(timed)} rollouts in the timed window of {self.last - self.warmup} steps: "
                               "one rollout per optimizer step was expected.")
        seconds = self.end - self.start
        n, tokens = sum(r["n"] for r in timed), sum(r["tokens"] for r in timed)
        return {"completions_per_sec": n / seconds, "completion_tokens_per_sec": tokens / seconds,
                "mean_completion_length": tokens / n, "seconds": seconds, "completions": n,
                "cpu_per_wall": self.cpu / seconds,  # ~threads when nothing else runs
                "others_cpu_share": max(0.0, self.busy - self.cpu) / (seconds * (os.cpu_count() or 1)),
                "generation_share": sum(r["gen_s"] for r in timed) / seconds,  # sampling, or waiting for it
                "sampler_busy_share": sum(r["sampler_s"] for r in timed) / seconds,
                "reward_share": sum(r["reward_s"] for r in timed) / seconds,
                "rewards": [r["reward"] for r in self.rollouts[:self.last]]}


def run_lightalign(args: argparse.Namespace, meter: Meter, workdir: Path) -> dict:
    import lightning as L

    from lightalign import GRPOModule, PromptDataModule
    from lightalign.rewards import digit_fraction_reward

    class Clock(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            ahead = pl_module.off_policy.ahead
            meter.step_end(trainer.global_step, process_cpu_seconds(ahead.process.pid) if ahead and ahead.process else 0.0)

    class TimedGRPOModule(GRPOModule):
        def sample_rollout(self, batch):  # sampling, or (sampled ahead) waiting for the sampling process
            start = time.perf_counter()
            out = super().sample_rollout(batch)
            ahead = self.off_policy.ahead
            meter.rollout(out["completion_mask"].sum(-1).tolist(), time.perf_counter() - start,
                          None if ahead is None else self.off_policy.sampled_seconds)
            return out

        def score(self, rollout, stats):
            start = time.perf_counter()
            out = super().score(rollout, stats)
            if self.training:
                meter.rollouts[-1]["reward_s"] = time.perf_counter() - start
                meter.rollouts[-1]["reward"] = float(out[1].nanmean())
            return out

    parts = (args.backend or "").split("+")  # e.g. compact+padding_free+async1
    backend, extras = parts[0], parts[1:]
    staleness = [int(e.removeprefix("async")) for e in extras if e.startswith("async")]
    layout = "padding_free" if "padding_free" in extras else ""
    if set(extras) - {"padding_free", *(f"async{n}" for n in staleness)}:
        raise SystemExit(f"unknown lightalign variant suffix in {args.backend!r} (known: padding_free, async<N>)")
    L.seed_everything(args.seed, verbose=False)
    from eos_bias import EOSBiasedQwen2ForCausalLM  # the EOS bias in the model's own class (see bench/eos_bias.py)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(args.model_dir)
    config.bench_eos_bias, config.bench_eos_token = args.eos_bias, eos_id(args.model_dir)
    policy = EOSBiasedQwen2ForCausalLM.from_pretrained(args.model_dir, config=config, dtype="float32")
    module = TimedGRPOModule(
        args.model_dir, model=policy, max_staleness=staleness[0] if staleness else 0,
        reward_funcs=[digit_fraction_reward], num_generations=args.num_generations,
        generation_batch_size=args.generation_batch, max_completion_length=args.max_completion_length,
        temperature=1.0, loss_type="dapo", beta=0.0, learning_rate=args.lr, lr_scheduler_type="constant",
        prompt_sharing=args.prompt_sharing == "on" and not layout, padding_free=layout == "padding_free",
        generation_backend=backend or None)
    data = PromptDataModule(args.data, tokenizer=args.model_dir, max_prompt_length=args.max_prompt_length,
                            num_workers=0, seed=args.seed)
    trainer = L.Trainer(accelerator="cpu", devices=1, precision=harness.lightning_precision(args.precision), max_steps=meter.last,
                        accumulate_grad_batches=args.grad_accum, gradient_clip_val=args.max_grad_norm, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, callbacks=[Clock()])
    trainer.fit(module, data)
    gen, steps, micro = module.rollout_shape
    return {"attn": module.model.config._attn_implementation, "backend": args.backend or "default",
            "shape": f"generation_batch_size={gen} steps_per_generation={steps} micro_batch={micro} "
                     f"accumulate_grad_batches={trainer.accumulate_grad_batches}"}


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a running process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_trl(args: argparse.Namespace, meter: Meter, workdir: Path) -> dict:
    from datasets import load_dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from lightalign.rewards import digit_fraction_reward

    class Clock(TrainerCallback):
        def on_step_end(self, targs, state, control, **kwargs):
            meter.step_end(state.global_step)

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate(self, prompts):  # tokenize + generate + decode, as lightalign's generate()
            start = time.perf_counter()
            out = super()._generate(prompts)
            if self.model.training:  # out[1]: completion ids, cut after EOS
                meter.rollout([len(ids) for ids in out[1]], time.perf_counter() - start)
            return out

        def _calculate_rewards(self, *a, **kw):
            start = time.perf_counter()
            out = super()._calculate_rewards(*a, **kw)
            meter.rollouts[-1]["reward_s"] = time.perf_counter() - start
            return out

    config = GRPOConfig(
        output_dir=str(workdir / "trl_out"), per_device_train_batch_size=args.generation_batch // args.grad_accum,
        gradient_accumulation_steps=args.grad_accum, num_generations=args.num_generations,
        max_completion_length=args.max_completion_length, temperature=1.0, top_p=1.0, top_k=0, loss_type="dapo",
        beta=0.0, max_steps=meter.last, learning_rate=args.lr, lr_scheduler_type="constant", optim="adamw_torch_fused",
        weight_decay=0.0, max_grad_norm=args.max_grad_norm, bf16=harness.trl_bf16(args.precision), fp16=False, gradient_checkpointing=False,
        use_vllm=False, use_cpu=True, dataloader_num_workers=0, eval_strategy="no", save_strategy="no",
        report_to="none", disable_tqdm=True, logging_steps=10, seed=args.seed,
        **trl_generation(args),
    )
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    dataset = load_dataset("json", data_files=args.data, split="train")
    trainer = TimedGRPOTrainer(model=args.model_dir, reward_funcs=[digit_fraction_reward], args=config,
                               train_dataset=dataset, processing_class=tokenizer, callbacks=[Clock()])
    add_eos_bias(trainer.model, eos_id(args.model_dir), args.eos_bias)
    trainer.train()
    return {"attn": trainer.model.config._attn_implementation, "backend": args.backend or "generate",
            "shape": f"generation_batch_size={config.generation_batch_size} "
                     f"steps_per_generation={config.steps_per_generation} "
                     f"micro_batch={config.per_device_train_batch_size} "
                     f"gradient_accumulation_steps={config.gradient_accumulation_steps}"}


def eos_id(model_dir: str) -> int:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir).eos_token_id


def add_eos_bias(model, eos: int, bias: float | None) -> None:
    """Raise the EOS logit by ``bias`` in every forward (a hook on the output embedding; same in both frameworks)."""
    import torch

    if not bias:
        return
    head = model.get_output_embeddings()
    vector = None

    def hook(module, inputs, logits):
        nonlocal vector
        if vector is None or vector.device != logits.device or vector.dtype != logits.dtype:
            vector = torch.zeros(logits.shape[-1], dtype=logits.dtype, device=logits.device)
            vector[eos] = bias
        return logits + vector

    head.register_forward_hook(hook)


def trl_generation(args: argparse.Namespace) -> dict:
    """TRL's generation settings of the variant: plain generate, or its continuous batching with lightalign's
    rollout-sized paged cache (TRL's own CPU default sizes it from half the machine's RAM)."""
    if args.backend != "continuous":
        return {}
    from lightalign.modules.sampling.continuous import cache_sizing

    prompts = [json.loads(line)["prompt"] for line in open(args.data) if line.strip()]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model_dir)
    lengths = sorted(len(ids) for ids in tok(prompts)["input_ids"])
    per_rollout = args.generation_batch // args.num_generations
    sizes = cache_sizing(args.generation_batch, lengths[-1], sum(lengths[-per_rollout:]), args.max_completion_length)
    return {"use_transformers_continuous_batching": True, "transformers_continuous_batching_config": sizes}


def run_one(args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    workdir = Path(tempfile.mkdtemp(prefix=f"grpo-{args.framework}-", dir=args.workdir))
    os.environ["HF_DATASETS_CACHE"] = str(workdir / "datasets")  # no dataset cache hit across runs
    meter = Meter(args.warmup, args.steps)
    pss = harness.PeakPSS()
    extra = (run_lightalign if args.framework == "lightalign" else run_trl)(args, meter, workdir)
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # the sampling process, if any
    return {"framework": args.framework, "setting": extra["backend"].split("+")[0], "precision": args.precision,
            "variant": f"{args.framework}:{extra['backend']}@{args.precision}", **meter.summary(),
            "threads": args.threads, "peak_rss_mb": harness.peak_rss_mb() + children, "peak_pss_mb": pss.stop(),
            **extra}


def spawn(args: argparse.Namespace, variant: str) -> dict | None:
    base, precision = harness.split_precision(variant)
    framework, _, backend = base.partition(":")
    argv = ["--framework", framework, "--backend", backend, "--precision", precision or "fp32", "--model-dir", args.model_dir, "--workdir", args.workdir, "--data", args.data]
    for name in ("num_generations", "generation_batch", "grad_accum", "max_completion_length", "max_prompt_length",
                 "steps", "warmup", "threads", "lr", "max_grad_norm", "seed", "prompt_sharing", "eos_bias"):
        if getattr(args, name) is not None:
            argv += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    return harness.spawn(__file__, argv, args.threads, f"grpo {variant}")


def completion_flops(args: argparse.Namespace, mean_prompt: float, mean_completion: float) -> float:
    """Model FLOPs per completion (bench/harness.py's formula, on mean lengths): generation (one forward over the
    prompt and completion tokens, with the KV cache) plus the policy forward + backward over prompt + completion.
    beta 0 and one iteration per rollout: no reference and no old-policy pass is needed."""
    shape = harness.model_shape(args.model_dir)
    s = [round(mean_prompt + mean_completion)]
    return (harness.forward_flops(args.n_params, shape["layers"], shape["hidden"], s)
            + harness.train_flops(args.n_params, shape["layers"], shape["hidden"], s))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(ROOT / "assets" / "models" / "small"), help="config + tokenizer folder")
    parser.add_argument("--data", default=str(ROOT / "examples" / "data" / "arithmetic_prompts.jsonl"))
    parser.add_argument("--shape", choices=(*bench_data.SHAPES, "reasoning"), help="generate prompts of this length "
                        "shape (bench/data.py) instead of --data; reasoning: see above")
    parser.add_argument("--eos-bias", type=float, default=None, help="added to the EOS logit in both frameworks "
                        "(default: 2.3 with --shape reasoning, else none)")
    parser.add_argument("--variants", nargs="+", default=None, help="framework:backend entries, e.g. "
                        "lightalign:compact+padding_free trl:continuous (default: --frameworks with their default "
                        "generation; with --shape reasoning lightalign compact+padding_free and generate, and TRL with and without "
                        "continuous batching)")
    parser.add_argument("--mean-length", type=int, default=24, help="mean words per generated prompt")
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--generation-batch", type=int, default=32, help="completions per rollout (= per step)")
    parser.add_argument("--grad-accum", type=int, default=4, help="micro-batches per step (micro-batch = G / A)")
    parser.add_argument("--max-completion-length", type=int, default=None, help="default 32; 256 with --shape reasoning")
    parser.add_argument("--max-prompt-length", type=int, default=None, help="lightalign only; TRL 1.x has none")
    parser.add_argument("--prompt-sharing", choices=("on", "off"), default="off",
                        help="lightalign trains each group's prompt once (GRPOModule prompt_sharing); for long prompts")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-contention", type=float, default=0.03,
                        help="a run during which other processes used more of the machine is retried; a negative "
                             "value neither waits nor retries")
    parser.add_argument("--retries", type=int, default=2)
    parser.add_argument("--frameworks", nargs="+", default=list(FRAMEWORKS), choices=FRAMEWORKS)
    parser.add_argument("--out", default="grpo.json", help="file name under bench/results/")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    harness.add_precision_arguments(parser)
    for hidden in ("--framework", "--backend", "--model-dir", "--workdir"):  # set by the parent for its subprocesses
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    return parser


def check(args: argparse.Namespace) -> None:
    reasoning = args.shape == "reasoning"
    if args.max_completion_length is None:
        args.max_completion_length = 256 if reasoning else 32
    if args.eos_bias is None and reasoning and not args.one:
        args.eos_bias = 2.3
    if args.variants is None:
        args.variants = (["lightalign:compact+padding_free", "lightalign:generate", "trl:generate", "trl:continuous"]
                         if reasoning else [f"{fw}:" for fw in args.frameworks])
    if args.warmup < 1:
        raise SystemExit("--warmup must be >= 1 (the clock starts at the end of optimizer step --warmup).")
    if args.generation_batch % args.num_generations or args.generation_batch % args.grad_accum:
        raise SystemExit("--generation-batch must be divisible by --num-generations and by --grad-accum.")


def run(args: argparse.Namespace) -> dict:
    """Build the model (and prompts), run each framework --repeats times (retrying contended runs)."""
    from transformers import AutoTokenizer

    check(args)
    if args.max_contention is not None and args.max_contention < 0:  # negative: neither wait nor retry
        args.max_contention = None
    harness.peaks_of(args)
    args.variants = harness.drop_refused(harness.expand_precisions(args.variants, args.precisions))
    args.workdir = tempfile.mkdtemp(prefix="bench-grpo-")
    try:
        args.model_dir = str(Path(args.workdir) / "model")
        args.n_params = n_params = harness.build_model(args.model, Path(args.model_dir), args.seed)
        per_rollout = args.generation_batch // args.num_generations
        if args.shape and args.shape != "reasoning":
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
            "data": (f"generated prompts, shape {args.shape}" if args.shape and args.shape != "reasoning"
                     else Path(args.data).name)
            + f" ({len(prompts)} prompts, {min(prompt_lens)}-{max(prompt_lens)} tokens)",
            "reward": "lightalign.rewards.digit_fraction_reward", "num_generations": args.num_generations,
            "generation_batch_size": args.generation_batch, "micro_batch": args.generation_batch // args.grad_accum,
            "grad_accum": args.grad_accum, "steps_per_generation": f"default (= grad_accum = {args.grad_accum})",
            "num_iterations": 1, "max_completion_length": args.max_completion_length,
            "lightalign_prompt_sharing": args.prompt_sharing,
            "max_prompt_length": f"{args.max_prompt_length} (lightalign; TRL 1.x has no such knob)",
            "sampling": "temperature 1.0, top_p 1.0, top_k 0, KV cache, no vLLM",
            "eos_bias": args.eos_bias, "variants": args.variants,
            "loss": "dapo, beta 0 (no reference), epsilon 0.2, scale_rewards group",
            "precisions": " / ".join(args.precisions) + " (fp32: lightalign 32-true, TRL bf16=False; bf16: lightalign bf16-mixed, TRL bf16=True)",
            "gradient_checkpointing": False, "optimizer": "torch AdamW fused (both defaults), wd 0",
            "lr": f"{args.lr} constant", "max_grad_norm": args.max_grad_norm, "threads": args.threads,
            "warmup_steps": args.warmup, "timed_steps": args.steps, "repeats": args.repeats,
            "versions": harness.versions(),
        }
        harness.print_settings("GRPO benchmark: lightalign GRPOModule vs TRL GRPOTrainer "
                               "(one rollout = one optimizer step)", settings)
        mean_prompt = statistics.mean(prompt_lens)
        runs = []
        for r in range(args.repeats):
            for framework in harness.alternate(args.variants, r):
                for attempt in range(args.retries + 1):  # 2 shared cores: a busy machine skews everything
                    quiet = harness.wait_for_quiet(args.max_contention, timeout=900)
                    res = spawn(args, framework)
                    if res is None or args.max_contention is None or res["others_cpu_share"] <= args.max_contention:
                        break
                    print(f"[{r + 1}/{args.repeats}] {framework:>10}: other processes used "
                          f"{100 * res['others_cpu_share']:.0f}% of the machine (before: {100 * quiet:.0f}%); "
                          f"{'retrying' if attempt < args.retries else 'kept, marked contended'}", flush=True)
                if res is None:
                    continue
                res["repeat"] = r + 1
                res["contended"] = args.max_contention is not None and res["others_cpu_share"] > args.max_contention
                res["model_flops_per_sec"] = res["completions_per_sec"] * completion_flops(
                    args, mean_prompt, res["mean_completion_length"])
                runs.append(res)
                print(f"[{r + 1}/{args.repeats}] {framework:>10}: {res['completions_per_sec']:6.2f} completions/s "
                      f"{res['completion_tokens_per_sec']:6.0f} tokens/s  "
                      f"mean length {res['mean_completion_length']:5.2f}"
                      f"  generation {100 * res['generation_share']:4.1f}% (sampler busy "
                      f"{100 * res['sampler_busy_share']:4.1f}%)  reward {100 * res['reward_share']:4.2f}%"
                      f"  peak RSS {res['peak_rss_mb']:6.0f} MB (PSS {res['peak_pss_mb']:6.0f})\n{'':>16}threads {res['threads']} (CPU/wall "
                      f"{res['cpu_per_wall']:.2f}, other processes {100 * res['others_cpu_share']:.0f}% of the machine)"
                      f"  attn {res['attn']}  {res['shape']}", flush=True)
    finally:
        shutil.rmtree(args.workdir, ignore_errors=True)

    keys = ("completions_per_sec", "mean_completion_length", "peak_rss_mb", "peak_pss_mb", "generation_share", "sampler_busy_share",
            "reward_share",
            "others_cpu_share", "model_flops_per_sec")
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
    print("\n| variant | completions/s | mean completion length | generation share | peak RSS MB | peak PSS MB |\n"
          "|---|---|---|---|---|---|")
    for fw, row in result["summary"].items():
        print(f"| {fw} | {row['completions_per_sec']:.2f} | {row['mean_completion_length']:.2f} "
              f"| {100 * row['generation_share']:.0f}% | {row['peak_rss_mb']:.0f} | {row['peak_pss_mb']:.0f} |")
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
