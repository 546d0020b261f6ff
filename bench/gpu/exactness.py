"""Padding-free exactness on the device: the GPU check's ``padding_free_exactness`` section."""

from __future__ import annotations

import importlib.util
from typing import Any

from sections import Context


def padding_free_exactness(ctx: Context) -> dict[str, Any]:
    """The logits of sequences packed into one padding-free row (positions restarting at each) against each
    sequence's own forward, in bf16 on the device, for every attention path there (transformers' ``sdpa`` with the
    mask it builds from ``position_ids``, lightalign's ``sdpa_varlen``, ``flash_attention_2`` where installed, and
    ``sft_logits`` after the adaptations a padding-free fit makes). Tolerance from the arithmetic: 3x the largest
    difference between the per-sequence forward in bf16 and in float32 (bf16's own error on this model, at this
    depth). A control that lets attention cross the sequences must exceed it, or the tolerance could not tell."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    from lightalign.modules.adaptations import adapt_model
    from lightalign.modules.adaptations.attention import use_varlen_sdpa
    from lightalign.modules.adaptations.layouts import split_packed_attention
    from lightalign.modules.adaptations.support import packed_gpu_attention
    from lightalign.modules.training.sft_forward import sft_logits

    info = ctx.model
    lengths = list(ctx.sizes.exact_lengths)
    gen = torch.Generator().manual_seed(ctx.seed)
    seqs = [torch.randint(3, 1024, (n,), generator=gen).to(ctx.device) for n in lengths]
    row = torch.cat(seqs)[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None].to(ctx.device)
    fp32 = AutoModelForCausalLM.from_pretrained(info["model_dir"], dtype=torch.float32,
                                                attn_implementation="sdpa").to(ctx.device).eval()
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)

    def per_sequence(m):
        return [m(input_ids=s[None], use_cache=False).logits[0].float() for s in seqs]

    def packed_diff(logits):
        logits, out, start = logits[0].float(), 0.0, 0
        for s, ref in zip(seqs, single16):
            out = max(out, (logits[start:start + len(s)] - ref).abs().max().item())
            start += len(s)
        return out

    paths: dict[str, Any] = {}
    with torch.no_grad():
        single32, single16 = per_sequence(fp32), per_sequence(bf16)
        floor = max((a - b).abs().max().item() for a, b in zip(single16, single32))
        tolerance = 3 * floor
        paths["sdpa (mask from position_ids)"] = packed_diff(
            bf16(input_ids=row, position_ids=positions, use_cache=False).logits)
        varlen = copy.deepcopy(bf16)
        use_varlen_sdpa(varlen)
        paths["sdpa_varlen (one SDPA call per sequence)"] = packed_diff(
            varlen(input_ids=row, position_ids=positions, sequence_sizes=lengths, use_cache=False).logits)
        if ctx.device == "cuda" and importlib.util.find_spec("flash_attn") is not None:
            flash = copy.deepcopy(bf16)
            flash.set_attn_implementation("flash_attention_2")
            paths["flash_attention_2 (varlen from position_ids)"] = packed_diff(
                flash(input_ids=row, position_ids=positions, use_cache=False).logits)
        fitted = copy.deepcopy(bf16)
        adapt_model(fitted)
        choice = packed_gpu_attention(fitted, torch.device(ctx.device))
        if choice is not None:
            fitted.set_attn_implementation(choice)
        split = split_packed_attention(fitted, torch.device(ctx.device))  # one SDPA call per sequence, or one masked
        library_path = (f"sft_logits as a padding-free fit runs it ({fitted.config._attn_implementation}"
                        f"{', one call per sequence' if split else ''})")
        paths[library_path] = packed_diff(sft_logits(fitted, {"input_ids": row, "position_ids": positions,
                                                              "sequence_sizes": lengths}))
        control = packed_diff(bf16(input_ids=row, use_cache=False).logits)  # one causal sequence: attention leaks
    failed = [f"{name}: max |packed - per-sequence| {diff:.3g} > tolerance {tolerance:.3g}"
              for name, diff in paths.items() if not diff <= tolerance]
    if not control > tolerance:
        failed.append(f"the leaking control differs by {control:.3g}, within the tolerance {tolerance:.3g}: the "
                      "check cannot tell a leak from rounding on this model")
    return {"dtype": "bfloat16", "lengths": lengths, "tokens": sum(lengths), "bf16_vs_fp32_floor": floor,
            "tolerance": tolerance, "max_abs_diff": paths, "leaking_control_diff": control,
            "fit_attention": fitted.config._attn_implementation, "fit_splits_per_sequence": split,
            "exact": not failed, "failed_checks": failed}


SECTIONS = {"padding_free_exactness": padding_free_exactness}
