"""Distillation throughput and peak memory: lightalign's DistillModule vs TRL 1.16's GKDTrainer, same model pair,
data and settings.

Run by hand from the repository root in the bench venv (TRL never enters the dev venv):

    .venv-bench/bin/python bench/distill.py [--steps 20] [--warmup 2] [--repeats 2] [--data arithmetic|english]

Models: the teacher is the shipped `small` config (~30M params) and the student the `tiny` one (same tokenizer and
vocabulary), each built once with random weights under a fixed seed and saved with the tokenizer to a temporary folder
that both frameworks load (no trained weights are shipped; the timings do not depend on what the weights say).

Data, the same rows for both, conversational (TRL's GKD collator reads a `messages` column and renders it with the
chat template; lightalign gets the same conversation as `prompt` / `completion` message lists, which it renders with
the same template): `--data arithmetic` = examples/data/arithmetic_sft.jsonl (the project's tuning data); `--data
english` = prompt-completion rows made from assets/english_lines.txt by bench/data.py (long-tailed lengths, mean
`--mean-length` words; data no setting was tuned on).

Settings, each run by both frameworks (`--variants`, `framework:setting`): `lmbda0` (the data's completions only),
`lmbda0.5` (the student samples half the batches: TRL draws with Python's `random`, lightalign with torch's RNG, so
the two draw different batches; the share each sampled in its timed window is reported), `lmbda1` (the student
samples every batch), `seq_kd` (lmbda 0 + seq_kd: the teacher samples every batch). Common: `--batch-size` rows per
optimizer step (no gradient accumulation), `--max-new-tokens` (lightalign's `max_completion_length`), beta 0.5,
temperature 1.0 (TRL's GKDTrainer compares the distributions at temperature 1 whatever its `temperature`, while
DistillModule divides both by it: at 1 both compute the same loss), sampling at temperature 1 with top_k 0 / top_p 1,
KV cache, no vLLM, --precisions, no gradient checkpointing (TRL's SFTConfig turns it on by default: turned off), torch AdamW
(TRL's fused default), weight decay 0, constant learning rate, grad clip 1.0, dropout off (both defaults), 2 threads,
no eval, checkpoints or loggers. Prompts are kept whole on both sides (`max_prompt_length` / TRL `max_length` are set
above the longest row). lightalign samples with its device default (`generation_backend` unset; the backend is
reported), or with the backend of a `+<backend>` suffix (`lightalign:lmbda1+generate`); TRL with `generate`.
lightalign's `padding_free` is its device default (unset: on on the CPU where both models run it exactly: no padding
through student or teacher; TRL's GKD collator pads); a `+padded` suffix sets it false, `+padding_free` true.

Each (framework, setting) runs in its own process (peak RSS = its ru_maxrss; peak PSS sampled every 0.25 s), settings
interleaved (lightalign, TRL, lightalign, TRL ...; reversed on odd repeats), --repeats times; medians reported.
A callback times optimizer steps --warmup+1 .. --warmup+--steps. tokens/s = the real (non-padding) prompt +
completion tokens of the rows trained on in that window per second. Each lightalign setting is compared with TRL's
same setting, and every variant with TRL's fastest setting.

Loss parity: before training, each process computes its loss on the first --batch-size rows of the data with the
data's completions (lmbda 0's batch), at the untrained student, through its own code path (lightalign:
`DistillModule.data_completions` + `distill_loss`; TRL: its collator + `compute_loss`); both are printed (`first
loss`) and must agree to float precision (TRL's forward passes no `position_ids`, so a left-padded row's positions
start at its padding while lightalign counts them from its first real token; with rotary position embeddings, as
these Qwen2 models have, a constant shift of a row's positions changes nothing).
Results: stdout and bench/results/distill_<data>.json.

Precision (bench/harness.py, the same for every script): `--precisions fp32 bf16` (default: both where the CPU has
native bf16, else fp32) runs each variant in each precision, lightalign with `precision="bf16-mixed"` / `"32-true"`,
TRL with `bf16=True` / `False`, everything else identical; a `--variants` entry may name its precision
(`trl:lmbda0@bf16`). Both dtypes' matmul peaks are measured once at the start and printed; each run's efficiency is
its model FLOP/s over the peak of its own dtype. The closing report lists every variant
(`framework:setting@precision`: figure, efficiency, peak RSS and PSS), each lightalign variant against TRL at the same
precision, and best vs best (each side's fastest variant over all precisions) with that pair's peak memory ratios.
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
SETTINGS = {  # setting -> (lmbda, seq_kd)
    "lmbda0": (0.0, False), "lmbda0.5": (0.5, False), "lmbda1": (1.0, False), "seq_kd": (0.0, True)}
BACKENDS = ("generate", "continuous", "static", "compact")  # DistillModule's generation_backend
DATA = {"arithmetic": ROOT / "examples" / "data" / "arithmetic_sft.jsonl", "english": None}


class Meter(harness.StepWindow):
    """The timed window, and what each optimizer step trained on."""

    def __init__(self, warmup: int, steps: int) -> None:
        super().__init__(warmup, steps)
        self.batches: list[dict] = []  # one per optimizer step (no gradient accumulation)
        self.first_loss: dict = {}

    def batch(self, source: str, tokens: int, completion_tokens: int, rows: int) -> None:
        self.batches.append({"source": source, "tokens": tokens, "completion_tokens": completion_tokens,
                             "rows": rows})

    def summary(self) -> dict:
        timed = self.timed(self.batches)
        seconds = self.window.seconds
        tokens, completion = sum(b["tokens"] for b in timed), sum(b["completion_tokens"] for b in timed)
        return {"steps_per_sec": len(timed) / seconds, "tokens_per_sec": tokens / seconds,
                "completion_tokens_per_sec": completion / seconds, "seconds": seconds,
                "steps_per_cpu_sec": len(timed) / self.cpu,  # what a busy machine skews least
                "mean_completion_length": completion / sum(b["rows"] for b in timed),
                "student_sampled": sum(b["source"] == "student" for b in timed) / len(timed),
                "teacher_sampled": sum(b["source"] == "teacher" for b in timed) / len(timed),
                "others_cpu_share": self.window.others_cpu_share, **self.first_loss}


# --------------------------------------------------------------------------- lightalign


def run_lightalign(args: argparse.Namespace, meter: Meter) -> dict:
    import lightning as L
    import torch

    from lightalign import DistillModule, PromptDataModule

    setting, *options = args.setting.split("+")
    backend = next((o for o in options if o in BACKENDS), None)
    lmbda, seq_kd = SETTINGS[setting]

    class Clock(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            meter.step_end(trainer.global_step)

    class TimedDistillModule(DistillModule):
        def training_step(self, batch, batch_idx):
            if not meter.first_loss:
                meter.first_loss = {"first_loss": self.parity_loss()}
            loss = super().training_step(batch, batch_idx)
            meter.batch(self.last_source, self.last_batch_tokens, self.last_completion_tokens,
                        self.last_batch_samples)
            return loss

        def distill_loss(self, rows, *args, **kwargs):
            self.last_completion_tokens = int(rows["completion_mask"].sum())
            return super().distill_loss(rows, *args, **kwargs)

        def parity_loss(self) -> float:
            """The loss of the data's first rows with their own completions, at the current (initial) student."""
            dm = self.trainer.datamodule
            batch = dm.collate_fn()([dm.train_dataset[i] for i in range(args.batch_size)])
            with torch.no_grad():
                return float(self.distill_loss(self.data_completions(batch))[0])

    L.seed_everything(args.seed, verbose=False)
    module = TimedDistillModule(
        args.student_dir, teacher_model_name_or_path=args.teacher_dir, loss_type="gkd", lmbda=lmbda, seq_kd=seq_kd,
        beta=args.beta, temperature=args.temperature, max_completion_length=args.max_new_tokens,
        generation_backend=backend,
        padding_free=True if "padding_free" in options else False if "padded" in options else None,
        learning_rate=args.lr, lr_scheduler_type="constant", weight_decay=0.0)
    data = PromptDataModule(args.la_data, tokenizer=args.student_dir, max_prompt_length=args.max_prompt_length,
                            batch_size=args.batch_size, num_workers=0, seed=args.seed)
    trainer = L.Trainer(accelerator="cpu", devices=1, precision=harness.lightning_precision(args.precision), max_steps=meter.last,
                        gradient_clip_val=args.max_grad_norm, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        num_sanity_val_steps=0, callbacks=[Clock()])
    trainer.fit(module, data)
    samplers = ", ".join(f"{who} {name[0]}" for who, name in module.sampling.chosen.items())
    rows = "packed rows" if module.padding_free_on else "padded rows"
    return {"backend": ", ".join(filter(None, [samplers, rows])), "attn": module.model.config._attn_implementation}


# --------------------------------------------------------------------------- TRL


def run_trl(args: argparse.Namespace, meter: Meter) -> dict:
    import torch
    from datasets import load_dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    lmbda, seq_kd = SETTINGS[args.setting]

    class Clock(TrainerCallback):
        def on_step_end(self, targs, state, control, **kwargs):
            meter.step_end(state.global_step)

    class TimedGKDTrainer(GKDTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            if not meter.first_loss:
                meter.first_loss = self.parity_losses(model)
            self.source = "data"
            return super().training_step(model, inputs, num_items_in_batch)

        def generate_on_policy_outputs(self, model, inputs, generation_config):  # a static method in TRL
            self.source = "teacher" if model is self.teacher_model else "student"
            return GKDTrainer.generate_on_policy_outputs(model, inputs, generation_config)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if model.training:  # the row counts of the batch trained on (after any sampling)
                labels = inputs["labels"][:, 1:]
                meter.batch(self.source, int(inputs["attention_mask"].sum()), int((labels != -100).sum()),
                            int(labels.shape[0]))
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

        def parity_losses(self, model) -> dict:
            """TRL's loss on the data's first rows (its collator, its compute_loss), at the initial student."""
            batch = self.data_collator([self.train_dataset[i] for i in range(args.batch_size)])
            batch = {k: v.to(model.device) if hasattr(v, "to") else v for k, v in batch.items()}
            with torch.no_grad():
                return {"first_loss": float(GKDTrainer.compute_loss(self, model, batch))}

    config = GKDConfig(
        output_dir=str(Path(args.workdir) / "trl_out"), per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=1, lmbda=lmbda, seq_kd=seq_kd, beta=args.beta, temperature=args.temperature,
        max_new_tokens=args.max_new_tokens, max_length=args.max_length, max_steps=meter.last,
        learning_rate=args.lr, lr_scheduler_type="constant", optim="adamw_torch_fused", weight_decay=0.0,
        max_grad_norm=args.max_grad_norm, bf16=harness.trl_bf16(args.precision), fp16=False, gradient_checkpointing=False, use_cpu=True,
        dataloader_num_workers=0, eval_strategy="no", save_strategy="no", report_to="none", disable_tqdm=True,
        logging_steps=10, seed=args.seed, disable_dropout=True)
    tokenizer = AutoTokenizer.from_pretrained(args.student_dir)
    dataset = load_dataset("json", data_files=args.trl_data, split="train")
    trainer = TimedGKDTrainer(model=args.student_dir, teacher_model=args.teacher_dir, args=config,
                              train_dataset=dataset, processing_class=tokenizer, callbacks=[Clock()])
    trainer.train()
    return {"backend": "generate", "attn": trainer.model.config._attn_implementation}


# --------------------------------------------------------------------------- one run, the parent


def run_one(args: argparse.Namespace) -> dict:
    train = run_lightalign if args.framework == "lightalign" else run_trl
    return harness.measured_run(args, Meter(args.warmup, args.steps), train)


def spawn(args: argparse.Namespace, variant: str) -> dict | None:
    base, precision = harness.split_precision(variant)
    framework, _, setting = base.partition(":")
    argv = ["--framework", framework, "--setting", setting, "--precision", precision or "fp32", "--workdir",
            args.workdir]
    for name in ("student_dir", "teacher_dir", "la_data", "trl_data", "batch_size", "max_new_tokens",
                 "max_prompt_length", "max_length", "beta", "temperature", "steps", "warmup", "threads", "lr",
                 "max_grad_norm", "seed"):
        argv += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    return harness.spawn(__file__, argv, args.threads, f"distill {variant}")


def fit_completion(text: str, tokenizer, max_tokens: int) -> str:
    """``text`` cut to its first words whose rendered completion (the text, then the template's ``<|im_end|>`` and
    newline: 2 tokens) holds at most ``max_tokens`` tokens. DistillModule cuts the data's completions to
    ``max_completion_length`` tokens, TRL's collator does not cut them to ``max_new_tokens``: rows that fit make the
    two train on the same tokens."""
    words = text.split()

    def fits(n: int) -> bool:
        return len(tokenizer(" ".join(words[:n]), add_special_tokens=False)["input_ids"]) + 2 <= max_tokens

    if fits(len(words)):
        return text
    low, high = 0, len(words)  # fits(low), not fits(high): bisect (token counts grow with the words kept)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return " ".join(words[:low])


def write_data(args: argparse.Namespace, tokenizer) -> list[dict]:
    """The benchmark rows (prompt, completion strings; completions cut to fit ``--max-new-tokens``) as two files of
    the same conversations: lightalign's prompt/completion message lists and TRL's `messages`."""
    if args.data == "english":
        n = max(256, 2 * args.batch_size * (args.warmup + args.steps))
        rows = bench_data.rows("sft", args.shape, n, args.mean_length, args.seed)
    else:
        rows = [json.loads(line) for line in open(DATA[args.data]) if line.strip()]
    rows = [{"prompt": r["prompt"], "completion": fit_completion(r["completion"], tokenizer, args.max_new_tokens)}
            for r in rows]
    la, trl = Path(args.workdir) / "lightalign.jsonl", Path(args.workdir) / "trl.jsonl"
    with la.open("w") as f_la, trl.open("w") as f_trl:
        for r in rows:
            user = {"role": "user", "content": r["prompt"]}
            assistant = {"role": "assistant", "content": r["completion"]}
            f_la.write(json.dumps({"prompt": [user], "completion": [assistant]}) + "\n")
            f_trl.write(json.dumps({"messages": [user, assistant]}) + "\n")
    args.la_data, args.trl_data = str(la), str(trl)
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--teacher", default=str(ROOT / "assets" / "models" / "small"), help="config + tokenizer")
    parser.add_argument("--student", default=str(ROOT / "assets" / "models" / "tiny"), help="config + tokenizer")
    parser.add_argument("--data", choices=tuple(DATA), default="arithmetic")
    parser.add_argument("--mean-length", type=int, default=24, help="--data english: mean words per row")
    parser.add_argument("--shape", choices=bench_data.SHAPES, default="longtail",
                        help="--data english: the length shape of bench/data.py (uniform: the held-out one)")
    parser.add_argument("--variants", nargs="+", default=None, help="framework:setting entries (settings: "
                        f"{', '.join(SETTINGS)}; lightalign's may end in +<sampler> and/or +padded / "
                        "+padding_free, e.g. lightalign:lmbda1+generate, lightalign:lmbda0+padded; "
                        "default: every setting for both frameworks)")
    parser.add_argument("--batch-size", type=int, default=8, help="rows per optimizer step")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="sampled completion tokens at most")
    parser.add_argument("--beta", type=float, default=0.5)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--out", default=None, help="file name under bench/results/ (default distill_<data>.json)")
    harness.add_run_arguments(parser)
    for hidden in ("--framework", "--setting", "--workdir", "--student-dir", "--teacher-dir", "--la-data",
                   "--trl-data"):  # set by the parent for its subprocesses
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    for hidden in ("--max-prompt-length", "--max-length"):
        parser.add_argument(hidden, type=int, help=argparse.SUPPRESS)
    return parser


def check(args: argparse.Namespace) -> None:
    harness.check_variants(args, tuple(SETTINGS), BACKENDS, options=("padding_free", "padded"))
    if args.temperature != 1.0:
        print(f"note: --temperature {args.temperature}: TRL's GKDTrainer compares the distributions at 1, "
              "DistillModule at this temperature: the two compute different losses.", flush=True)


def run(args: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer

    check(args)
    harness.peaks_of(args)
    args.workdir = tempfile.mkdtemp(prefix="bench-distill-")
    try:
        args.teacher_dir, args.student_dir = (str(Path(args.workdir) / n) for n in ("teacher", "student"))
        n_teacher = harness.build_model(args.teacher, Path(args.teacher_dir), args.seed)
        n_student = harness.build_model(args.student, Path(args.student_dir), args.seed + 1)
        tok = AutoTokenizer.from_pretrained(args.student_dir)
        rows = write_data(args, tok)
        full_lens = [len(tok(tok.apply_chat_template([{"role": "user", "content": r["prompt"]},
                                                      {"role": "assistant", "content": r["completion"]}],
                                                     tokenize=False), add_special_tokens=False)["input_ids"])
                     for r in rows]
        prompt_lens = [len(tok(tok.apply_chat_template([{"role": "user", "content": r["prompt"]}],
                                                       add_generation_prompt=True, tokenize=False),
                               add_special_tokens=False)["input_ids"]) for r in rows]
        args.max_prompt_length = max(prompt_lens)  # prompts kept whole on both sides
        args.max_length = max(full_lens) + args.max_new_tokens  # TRL's collator keeps whole rows too
        if (args.warmup + args.steps) * args.batch_size > len(rows):
            raise SystemExit(f"{len(rows)} rows: fewer than (warmup + steps) x batch size.")
        settings = {
            "teacher": f"{Path(args.teacher).name} ({n_teacher / 1e6:.1f}M params, random, seed {args.seed})",
            "student": f"{Path(args.student).name} ({n_student / 1e6:.1f}M params, random, seed {args.seed + 1})",
            "data": (f"english_lines rows (bench/data.py sft {args.shape}, mean {args.mean_length} words)"
                     if args.data == "english" else Path(DATA[args.data]).name)
            + f", conversational, {len(rows)} rows, prompts {min(prompt_lens)}-{max(prompt_lens)} tokens",
            "batch_size": args.batch_size, "grad_accum": 1, "max_new_tokens": args.max_new_tokens,
            "beta": args.beta, "temperature": f"{args.temperature} (sampling; TRL's divergence is always at 1)",
            "sampling": "top_k 0, top_p 1, KV cache, no vLLM", "variants": args.variants,
            "gradient_checkpointing": False, "optimizer": "torch AdamW fused, wd 0",
            **harness.run_settings(args),
        }
        harness.print_settings("Distillation benchmark: lightalign DistillModule vs TRL GKDTrainer", settings)
        runs = harness.interleaved_runs(args, spawn, lambda res: (
            f"{res['steps_per_sec']:6.2f} steps/s ({res['steps_per_cpu_sec']:.2f} per CPU-s) "
            f"{res['tokens_per_sec']:7.0f} tokens/s  completion length {res['mean_completion_length']:5.1f}"
            f"  student/teacher sampled {res['student_sampled']:.2f}/{res['teacher_sampled']:.2f}"
            f"  peak RSS {res['peak_rss_mb']:5.0f} MB (PSS {res['peak_pss_mb']:5.0f})"
            f"  first loss {res['first_loss']:.6f}"
            f"\n{'':>30}other processes {100 * res['others_cpu_share']:.0f}% of the machine  "
            f"sampler {res['backend']}  attn {res['attn']}"))
    finally:
        shutil.rmtree(args.workdir, ignore_errors=True)
    result = summarise(settings, runs)
    result["precision_report"] = harness.precision_report(runs, "steps_per_sec", args.peaks)
    return result


def summarise(settings: dict, runs: list[dict]) -> dict:
    keys = ("steps_per_sec", "steps_per_cpu_sec", "tokens_per_sec", "completion_tokens_per_sec",
            "mean_completion_length", "student_sampled", "teacher_sampled", "peak_rss_mb", "peak_pss_mb",
            "others_cpu_share", "first_loss")
    summary = {v: {k: harness.median_of(runs, k, variant=v) for k in keys}
               for v in dict.fromkeys(r["variant"] for r in runs)}
    trl = {v: row["steps_per_sec"] for v, row in summary.items() if v.startswith("trl:")}
    fastest = max(trl, key=lambda v: trl[v] or 0, default=None)
    for variant, row in summary.items():
        same = summary.get(harness.trl_same_setting(variant), {}).get("steps_per_sec")
        row["vs_trl_same_setting"] = harness.ratio(row["steps_per_sec"], same)
        row["vs_trl_fastest"] = harness.ratio(row["steps_per_sec"], trl.get(fastest))
    return {"settings": settings, "runs": runs, "summary": summary, "trl_fastest": fastest}


def main() -> None:
    args = build_parser().parse_args()
    if args.one:
        harness.emit(run_one(args))
        return
    result = run(args)
    print(f"\n| variant | steps/s | steps per CPU-s | tokens/s | completion length | student/teacher sampled "
          f"| peak RSS MB | peak PSS MB | vs TRL same setting | vs TRL fastest ({result['trl_fastest']}) |\n"
          + "|---" * 10 + "|")
    for variant, row in result["summary"].items():
        print(f"| {variant} | {harness.fmt(row['steps_per_sec'], '.2f')} "
              f"| {harness.fmt(row['steps_per_cpu_sec'], '.2f')} "
              f"| {harness.fmt(row['tokens_per_sec'], '.0f')} "
              f"| {harness.fmt(row['mean_completion_length'], '.1f')} "
              f"| {harness.fmt(row['student_sampled'], '.2f')}/{harness.fmt(row['teacher_sampled'], '.2f')} "
              f"| {harness.fmt(row['peak_rss_mb'], '.0f')} | {harness.fmt(row['peak_pss_mb'], '.0f')} "
              f"| {harness.fmt(row['vs_trl_same_setting'], '.2f')}x | {harness.fmt(row['vs_trl_fastest'], '.2f')}x |")
    busy = [r for r in result["runs"] if r["others_cpu_share"] > 0.03]
    if busy:
        print(f"WARNING: {len(busy)} run(s) shared the machine with other processes (>3% of it): figures are skewed.")
    harness.print_precision_report(result["precision_report"])
    out = args.out or f"distill_{args.data}.json"
    print(f"\nwrote {harness.write_json(out, result).relative_to(ROOT)}")


if __name__ == "__main__":
    main()
