"""``disable_dropout``: training without dropout noise (TRL's ``disable_dropout``, default on for DPO)."""

from __future__ import annotations

import torch


def disable_dropout_in_model(model: torch.nn.Module) -> int:
    """Set every dropout probability of ``model`` to 0 and return how many were non-zero.

    Covers ``nn.Dropout`` modules (what TRL zeroes) and the float dropout rates Hugging Face attention modules keep
    as attributes (``attention_dropout``, ``dropout``) and pass to the attention function, which TRL leaves as they
    are: with those, a Llama-style model would still drop attention weights in training.
    """
    changed = 0
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            changed += module.p > 0
            module.p = 0.0
            continue
        for name, value in list(vars(module).items()):
            if name.endswith("dropout") and isinstance(value, float) and not isinstance(value, bool):
                changed += value > 0
                setattr(module, name, 0.0)
    return int(changed)
