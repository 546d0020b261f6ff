"""Generation only, on the reasoning workload: lightalign's generation backends against the calls TRL 1.16 makes.

    .venv/bin/python bench/generation.py [--models tiny small] [--repeats 3] [--variants ...]

The `bench/grpo.py --shape reasoning` rollout without the training half: 4 arithmetic prompts x 8 completions
(32 rows), `max_new_tokens` 256, temperature 1, top_p 1, top_k 0, and an EOS logit bias of +2.3 (a forward hook on
the output embedding, `grpo.add_eos_bias`) so the random-weight model's completions end at geometric lengths (mean
about 100 tokens, some at 256). Random weights from the shipped config under a fixed seed (`harness.build_model`).

Variants (one process, `torch.set_num_threads(1)`; each repeat draws the next 4 prompts and runs every variant on them
in an order that alternates between repeats, after one untimed warm-up call per variant):
- `lightalign:generate` / `continuous` / `compact`: `sampling.samplers.sample_groups` with that `generation_backend`
  (prompt prefill shared), on the model as lightalign loads it (`hub.load_causal_lm`);
- `trl:generate`: what TRL 1.16's GRPOTrainer calls without vLLM: the prompts repeated 8 times, left-padded,
  `model.generate(generation_config=GenerationConfig(max_new_tokens, do_sample, pad/bos/eos, temperature, top_p,
  top_k, min_p, repetition_penalty, cache_implementation=None, disable_compile=True))`;
- `trl:continuous`: TRL's `use_transformers_continuous_batching` call: `model.generate_batch(the 32 prompt lists,
  that GenerationConfig, ContinuousBatchingConfig(max_memory_percent=0.5, the paged cache sized like lightalign's),
  progress_bar=False)`, with no `gc.freeze` (TRL has none); on the model as transformers loads it.

Reported per variant: completions/s (wall) and process CPU seconds per completion (`time.process_time`: the
machine is shared, so CPU time is the figure to compare), mean of the repeats, the mean completion length (through
the first EOS) and CPU milliseconds per completion token (the samples differ between variants, so do lengths).
Results: stdout and bench/results/generation.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from grpo import add_eos_bias  # noqa: E402

ROOT = harness.ROOT
VARIANTS = ["lightalign:generate", "lightalign:continuous", "lightalign:compact", "trl:generate", "trl:continuous"]


def prompt_batches(path: Path, tokenizer, per_batch: int, count: int):
    import torch

    prompts = [json.loads(line)["prompt"] for line in open(path) if line.strip()]
    for i in range(count):
        texts = [prompts[(i * per_batch + j) % len(prompts)] for j in range(per_batch)]
        rows = [torch.tensor(ids) for ids in tokenizer(texts)["input_ids"]]
        width = max(len(r) for r in rows)
        ids = torch.full((per_batch, width), tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros(per_batch, width, dtype=torch.long)
        for k, r in enumerate(rows):
            ids[k, width - len(r):], mask[k, width - len(r):] = r, 1
        yield ids, mask


def trl_generation_config(tokenizer, eos: list[int], max_new_tokens: int):
    from transformers import GenerationConfig

    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=True, pad_token_id=tokenizer.pad_token_id,
                            bos_token_id=tokenizer.bos_token_id, eos_token_id=eos, temperature=1.0, top_p=1.0,
                            top_k=0, min_p=None, repetition_penalty=1.0, cache_implementation=None,
                            disable_compile=True)


def completions(variant: str, models: dict, tokenizer, ids, mask, args) -> list[int]:
    """Run one variant on one batch of prompts; the completion lengths (through the first EOS)."""
    import torch

    from lightalign.modules.sampling.completions import cut_after_eos, eos_token_ids, sample_groups

    framework, _, backend = variant.partition(":")
    model = models[framework]
    eos = eos_token_ids(model, tokenizer)
    g, new = args.num_generations, args.max_new_tokens
    if framework == "lightalign":
        out, _, _ = sample_groups(model, ids, mask, g, backend=backend, eos=eos, pad_token_id=tokenizer.pad_token_id,
                               max_new_tokens=new, temperature=1.0, top_p=1.0, top_k=0, min_p=None)
    elif backend == "generate":
        config = trl_generation_config(tokenizer, eos, new)
        with torch.no_grad():
            seq = model.generate(input_ids=ids.repeat_interleave(g, 0), attention_mask=mask.repeat_interleave(g, 0),
                                 generation_config=config)
        out = seq[:, ids.shape[1]:]
    else:
        from transformers.generation import ContinuousBatchingConfig

        from lightalign.modules.sampling.continuous import cache_sizing

        prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask) for _ in range(g)]
        sizes = cache_sizing(len(prompts), max(map(len, prompts)), int(mask.sum()), new)
        cb = ContinuousBatchingConfig(max_memory_percent=0.5, **sizes)
        with torch.no_grad():
            outputs = model.generate_batch(prompts, generation_config=trl_generation_config(tokenizer, eos, new),
                                           continuous_batching_config=cb, progress_bar=False)
        return [len(o.generated_tokens) for o in outputs.values()]
    _, completion_mask, _ = cut_after_eos(out, eos, tokenizer.pad_token_id)
    return completion_mask.sum(-1).tolist()


def bench_model(name: str, args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lightalign.hub import load_causal_lm

    workdir = Path(tempfile.mkdtemp(prefix=f"bench-gen-{name}-"))
    model_dir = workdir / "model"
    n_params = harness.build_model(ROOT / "assets" / "models" / name, model_dir, args.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    models = {"lightalign": load_causal_lm(str(model_dir)).eval(),
              "trl": AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()}
    for model in models.values():
        add_eos_bias(model, tokenizer.eos_token_id, args.eos_bias)
    batches = list(prompt_batches(Path(args.data), tokenizer, args.prompts, args.repeats + 1))
    runs = {v: [] for v in args.variants}
    for r, (ids, mask) in enumerate(batches):
        order = harness.alternate(args.variants, r)
        for variant in order:
            torch.manual_seed(args.seed + r)
            wall, cpu = time.perf_counter(), time.process_time()
            lengths = completions(variant, models, tokenizer, ids, mask, args)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            if r == 0:  # warm-up
                continue
            n = len(lengths)
            runs[variant].append({"completions_per_sec": n / wall, "cpu_s_per_completion": cpu / n,
                                  "mean_length": statistics.mean(lengths),
                                  "cpu_ms_per_token": 1000 * cpu / sum(lengths), "wall_s": wall, "cpu_s": cpu})
            print(f"{name:>5} [{r}/{args.repeats}] {variant:>22}: {len(lengths) / wall:6.2f} completions/s  "
                  f"{cpu / len(lengths):6.3f} CPU s/completion  mean length {statistics.mean(lengths):6.1f}",
                  flush=True)
    summary = {v: {k: statistics.mean(x[k] for x in rs) for k in rs[0]} for v, rs in runs.items() if rs}
    return {"n_params": n_params, "runs": runs, "summary": summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny", "small"], help="folders under assets/models")
    parser.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS)
    parser.add_argument("--data", default=str(ROOT / "examples" / "data" / "arithmetic_prompts.jsonl"))
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--eos-bias", type=float, default=2.3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="generation.json", help="file name under bench/results/")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    results = {"settings": {**vars(args), "versions": harness.versions()}, "models": {}}
    for name in args.models:
        results["models"][name] = bench_model(name, args)
    print("\n| model | variant | completions/s | CPU s / completion | mean length | CPU ms / token |\n"
          "|---|---|---|---|---|---|")
    for name, res in results["models"].items():
        for variant, row in res["summary"].items():
            print(f"| {name} | {variant} | {row['completions_per_sec']:.2f} | {row['cpu_s_per_completion']:.3f} "
                  f"| {row['mean_length']:.1f} | {row['cpu_ms_per_token']:.2f} |")
    print(f"\nwrote {harness.write_json(args.out, results)}")


if __name__ == "__main__":
    main()
