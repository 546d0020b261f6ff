"""Every sampler backend on the device: the GPU check's ``sampler_*`` sections (``sample_groups`` on the bf16 model;
vLLM through GRPO's ``use_vllm``, when vllm is importable)."""

from __future__ import annotations

import json
import time
from typing import Any

from sections import Context, grpo



def sampler(ctx: Context, backend: str) -> dict[str, Any]:
    """``backend`` (lightalign's sampler interface, ``sample_groups``) on the bf16 model: a first call (which
    compiles, for ``static``) and a timed second call of the same shapes. Completion tokens count up to each
    completion's first EOS."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lightalign.modules.sampling.samplers import sample_groups

    if ctx.dry_run and backend == "static":  # inductor's CPU compile takes minutes: the same graph, run eagerly
        import lightalign.modules.sampling.static as static

        static.COMPILE_BACKEND = "eager"
    info, size = ctx.model, ctx.sizes.sampler
    tok = AutoTokenizer.from_pretrained(info["model_dir"], padding_side="left")
    prompts = [json.loads(line)["prompt"] for line in open(info["data"]["prompts"]) if line.strip()][:size["prompts"]]
    enc = tok(prompts, padding=True, return_tensors="pt")
    ids, mask = enc["input_ids"].to(ctx.device), enc["attention_mask"].to(ctx.device)
    model = AutoModelForCausalLM.from_pretrained(info["model_dir"], dtype=torch.bfloat16).to(ctx.device).eval()
    eos = model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos)
    torch.manual_seed(ctx.seed)

    def call() -> tuple[float, Any]:
        ctx.sync()
        start = time.perf_counter()
        with torch.no_grad():
            out = sample_groups(model, ids, mask, size["generations"], backend=backend, eos=eos,
                                pad_token_id=tok.pad_token_id, max_new_tokens=size["new_tokens"], temperature=1.0,
                                top_p=1.0, top_k=0)
        ctx.sync()
        return time.perf_counter() - start, out

    first, _ = call()
    seconds, out = call()
    new = out.ids.cpu()
    ended = torch.isin(new, torch.tensor(eos))
    first_eos = torch.where(ended.any(1), ended.int().argmax(1) + 1, torch.full((new.shape[0],), new.shape[1]))
    tokens = int(first_eos.sum())
    return {"backend": backend, "completions": int(new.shape[0]), "max_new_tokens": size["new_tokens"],
            "completion_tokens": tokens, "first_call_seconds": first, "seconds": seconds,
            "completion_tokens_per_sec": tokens / seconds, "completions_per_sec": new.shape[0] / seconds,
            **({"compile_backend": "eager (dry run)"} if ctx.dry_run and backend == "static" else {}), **ctx.memory()}


def sampler_vllm(ctx: Context) -> dict[str, Any]:
    """vLLM through GRPO's ``use_vllm`` (colocate), when vllm is importable."""
    return {**grpo(ctx, extra={"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.3}),
            "backend": "vllm (colocate)"}


SECTIONS = {"sampler_generate": lambda ctx: sampler(ctx, "generate"),
            "sampler_compact": lambda ctx: sampler(ctx, "compact"),
            "sampler_continuous": lambda ctx: sampler(ctx, "continuous"),
            "sampler_static": lambda ctx: sampler(ctx, "static"), "sampler_vllm": sampler_vllm}
#: Sections that need an optional package, and the package.
NEEDS = {"sampler_vllm": "vllm"}
