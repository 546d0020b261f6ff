"""What a run changes outside the module's own model, applied at ``setup`` and undone at ``teardown`` (or, when the
run raises, by ``UndoSideEffectsOnError``):

* the allocator setting of ``retain_cpu_memory`` (glibc's mmap and trim thresholds), on the device type where its
  threshold was measured (``tuned``'s table) and only there;
* on a bf16 CPU run, the bound on oneDNN's primitive caches (``bound_onednn_caches``: environment variables read
  once per process, so this one is not undone);
* a model the user passed as ``model``: its own MLP forwards (``restore_mlp_forward``) and attention implementation
  are given back at teardown, and the module's adaptations applied again at the next ``setup``.

Not undone: LoRA adapters, activation checkpointing, ``torch.compile`` and ``disable_dropout`` on a user-passed model
(asked for by knobs), and the ``sdpa_varlen`` name in transformers' registry (``register_varlen_sdpa``).
"""

from __future__ import annotations

from typing import Any

import torch

from lightalign.modules.training.cpu_bf16 import bound_onednn_caches, computes_in_bf16
from lightalign.modules.training.device_tuning import tuned


def attention_of(model: torch.nn.Module) -> str | None:
    """The attention implementation a model's config names (its base model's under PEFT)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(getattr(base, "config", None), "_attn_implementation", None)


class ScopedSideEffects:
    """The side effects of one module, and whether each is in force (``apply`` and ``undo`` are idempotent)."""

    def __init__(self, user_model: torch.nn.Module | None) -> None:
        self.holds_cpu_memory = False  # the allocator setting is taken and not released yet
        self.user_model = user_model is not None  # handed back unchanged at teardown
        self.user_attention = attention_of(user_model) if user_model is not None else None
        self.user_model_restored = False

    def apply(self, module: Any) -> None:
        if self.user_model_restored:
            self.readapt_user_model(module)
        device = module.trainer.strategy.root_device
        if computes_in_bf16(module.trainer.precision):
            bound_onednn_caches(device)
        limit = tuned("retain_freed_cpu_memory_bytes", device)
        if module.knobs.cpu_memory.retain_cpu_memory and limit is not None and not self.holds_cpu_memory:
            from lightalign.modules.training.acceleration import retain_freed_cpu_memory

            module.cpu_memory_retained = self.holds_cpu_memory = retain_freed_cpu_memory(limit)

    def undo(self, module: Any) -> None:
        if self.holds_cpu_memory:
            from lightalign.modules.training.acceleration import release_freed_cpu_memory

            release_freed_cpu_memory()
            self.holds_cpu_memory = False
        if self.user_model and not self.user_model_restored:
            from lightalign.modules.adaptations.mlp_memory import restore_mlp_forward

            restore_mlp_forward(module.model)
            base = module.model.get_base_model() if hasattr(module.model, "get_base_model") else module.model
            if self.user_attention is not None and attention_of(base) != self.user_attention:
                base.set_attn_implementation(self.user_attention)
            self.user_model_restored = True

    def readapt_user_model(self, module: Any) -> None:
        """Switch a user-passed model back to the module's adaptations (after a teardown took them back), as
        ``PolicyModule._prepare_model`` did at construction (Liger's kernels were never taken back)."""
        from lightalign.modules.adaptations.attention import use_varlen_sdpa
        from lightalign.modules.adaptations.mlp_memory import recompute_mlp_activation

        compute = module.knobs.compute
        if compute.recompute_mlp_activation and not compute.use_liger_kernel:
            recompute_mlp_activation(module.model)
        use_varlen_sdpa(module.model)
        self.user_model_restored = False
