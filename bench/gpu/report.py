"""The GPU check's results: MFU of each training workload against the bf16 matmul rate measured in the run and
against the datasheet's, lightalign-to-TRL ratios, and the markdown written beside the JSON."""

from __future__ import annotations

from typing import Any

#: (workload, lightalign section, TRL section, throughput key, unit).
PAIRS = (("SFT", "sft", "trl_sft", "tokens_per_sec", "tokens/s"),
         ("DPO", "dpo", "trl_dpo", "pairs_per_sec", "pairs/s"),
         ("GRPO", "grpo", "trl_grpo", "completions_per_sec", "completions/s"))


def add_mfu(records: dict[str, dict[str, Any]]) -> None:
    """``mfu_measured`` / ``mfu_datasheet`` on every result with ``model_flops_per_sec``."""
    peak = records.get("matmul_peak", {}).get("result") or {}
    for record in records.values():
        res = record.get("result") or {}
        flops = res.get("model_flops_per_sec")
        if flops:
            for key, ceiling in (("mfu_measured", peak.get("bf16_flops_per_sec")),
                                 ("mfu_datasheet", peak.get("datasheet_bf16_flops_per_sec"))):
                res[key] = flops / ceiling if ceiling else None


def ratios(records: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for name, ours, theirs, key, unit in PAIRS:
        a = (records.get(ours, {}).get("result") or {}).get(key)
        b = (records.get(theirs, {}).get("result") or {}).get(key)
        rows.append({"workload": name, "unit": unit, "lightalign": a, "trl": b,
                     "ratio": a / b if a and b else None})
    return rows


def fmt(value: Any, spec: str = ".3g") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


def pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def headline(res: dict[str, Any]) -> str:
    """One line of a section's main figures."""
    keys = ("tokens_per_sec", "pairs_per_sec", "completions_per_sec", "completion_tokens_per_sec",
            "bf16_flops_per_sec", "n_params", "exact", "attn_implementation", "sampler", "gpu")
    parts = [f"{k} {fmt(res[k])}" for k in keys if res.get(k) is not None]
    if res.get("mfu_measured") is not None:
        parts.append(f"MFU {pct(res['mfu_measured'])} of measured peak, {pct(res.get('mfu_datasheet'))} of datasheet")
    if res.get("peak_gpu_allocated_mib") is not None:
        parts.append(f"peak GPU {res['peak_gpu_allocated_mib']:.0f} MiB")
    return "; ".join(parts)


def markdown(payload: dict[str, Any]) -> str:
    records, env = payload["sections"], payload["versions"]
    machine = (records.get("environment", {}).get("result") or {})
    peak = records.get("matmul_peak", {}).get("result") or {}
    lines = [f"# lightalign GPU check ({'CPU dry run' if payload['dry_run'] else 'GPU run'})", "",
             f"- started {payload['started']}, {payload['seconds']:.0f} s, precision {payload['precision']}, "
             f"device {payload['device']}, isolation {payload['isolation']}",
             f"- GPU: {machine.get('gpu') or '-'}; nvidia-smi: {machine.get('nvidia_smi') or '-'}; "
             f"CUDA (torch) {machine.get('torch_cuda') or '-'}",
             "- " + ", ".join(f"{k} {v['version'] if isinstance(v, dict) else v}" for k, v in env.items()
                              if k in ("python", "torch", "transformers", "lightning", "datasets", "peft", "trl",
                                       "flash_attn", "vllm", "lightalign_commit")),
             f"- bf16 matmul: measured {fmt(peak.get('bf16_flops_per_sec'))} FLOP/s "
             f"(n={peak.get('n')}), datasheet {fmt(peak.get('datasheet_bf16_flops_per_sec'))} FLOP/s", "",
             "| section | status | seconds | figures |", "|---|---|---|---|"]
    for name, record in records.items():
        res = record.get("result") or {}
        status = record["status"] + (f" ({record['reason']})" if record.get("reason") else "")
        lines.append(f"| {name} | {status} | {fmt(record.get('seconds'), '.1f')} | {headline(res)} |")
    lines += ["", "| workload | unit | lightalign | TRL 1.16 | ratio | lightalign MFU (measured / datasheet) "
              "| TRL MFU (measured / datasheet) |", "|---|---|---|---|---|---|---|"]
    for row, (_, ours, theirs, _, _) in zip(payload["ratios"], PAIRS):
        mfu = [(records.get(s, {}).get("result") or {}) for s in (ours, theirs)]
        lines.append(f"| {row['workload']} | {row['unit']} | {fmt(row['lightalign'])} | {fmt(row['trl'])} "
                     f"| {fmt(row['ratio'], '.2f')} | {pct(mfu[0].get('mfu_measured'))} / "
                     f"{pct(mfu[0].get('mfu_datasheet'))} | {pct(mfu[1].get('mfu_measured'))} / "
                     f"{pct(mfu[1].get('mfu_datasheet'))} |")
    exact = records.get("padding_free_exactness", {}).get("result")
    if exact:
        lines += ["", f"Padding-free exactness ({exact['dtype']}, {exact['tokens']} tokens in "
                  f"{len(exact['lengths'])} sequences): tolerance {fmt(exact['tolerance'])} (3x the bf16-vs-fp32 "
                  f"floor {fmt(exact['bf16_vs_fp32_floor'])}); leaking control {fmt(exact['leaking_control_diff'])}",
                  "", "| attention path | max abs diff |", "|---|---|"]
        lines += [f"| {path} | {fmt(diff)} |" for path, diff in exact["max_abs_diff"].items()]
    for module, error in (payload.get("preload_errors") or {}).items():
        lines += ["", f"Importing {module} before the sections failed:", "", "```", error.rstrip(), "```"]
    failures = [(n, r) for n, r in records.items() if r["status"] in ("failed", "timeout")]
    if failures:
        lines += ["", "## Failures", ""]
        for name, record in failures:
            lines += [f"### {name} ({record['status']})", "", "```", (record.get("error") or "").rstrip(), "```", ""]
    return "\n".join(lines) + "\n"
