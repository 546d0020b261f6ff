"""What the layout probe adds at fit start: first run (measured) and later runs (cached verdict), per layout.

    python bench/probe_cost.py                  # the shipped tiny model and real-size default configs
    python bench/probe_cost.py --models llama qwen2 --layouts packed dpo_shared

The real-size configs are transformers' defaults for the family (e.g. LlamaConfig(): 4096 wide, 32 layers): only
the config is built (on the meta device), never the real model; the probe shrinks it. Prints seconds per layout.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODELS = ["tiny", "llama", "qwen2", "mixtral", "gemma3_text", "phi3", "lfm2", "granitemoehybrid"]
DEFAULT_LAYOUTS = ["padded", "packed", "dpo_shared", "grpo_shared", "shared_prefill", "compact"]


def meta_model(name: str):
    """The model class and config of ``name`` without building real weights (the probe needs only these)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if name == "tiny":
        config = AutoConfig.from_pretrained(REPO / "assets" / "models" / "tiny")
    else:
        config = AutoConfig.for_model(name)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=DEFAULT_MODELS)
    parser.add_argument("--layouts", nargs="+", default=DEFAULT_LAYOUTS)
    args = parser.parse_args()
    os.environ["LIGHTALIGN_CACHE_DIR"] = tempfile.mkdtemp(prefix="probe-cost-")
    from lightalign.modules.adaptations.attention import use_varlen_sdpa
    from lightalign.modules.adaptations.probe import measure

    print(f"torch threads {torch.get_num_threads()}; seconds per layout: first run (measured) / cached")
    print("| model | " + " | ".join(args.layouts) + " | total first | total cached |")
    print("|---" * (len(args.layouts) + 3) + "|")
    for name in args.models:
        model = meta_model(name)
        use_varlen_sdpa(model)
        first, cached = [], []
        for layout in args.layouts:
            for times in (first, cached):
                start = time.perf_counter()
                measure(model, layout, None)
                times.append(time.perf_counter() - start)
        cells = [f"{a:.2f} / {b:.3f}" for a, b in zip(first, cached)]
        print(f"| {name} | " + " | ".join(cells) + f" | {sum(first):.2f} | {sum(cached):.3f} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
