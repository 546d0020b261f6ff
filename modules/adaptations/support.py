"""Which batch layouts and generation backends a model can run exactly: decided by measurement, then explained.

A *layout* is how lightalign lays sequences out for one forward: ``padded`` rows (SFT), ``padding_free`` and
``packed`` rows (several sequences in one row, ``position_ids`` restarting), the DPO pair layouts
``dpo_shared`` (one ``[prompt, chosen, rejected]`` segment per pair under a 4D mask) and ``dpo_classic``
(padded rows), the GRPO layouts ``grpo_padded`` (left-padded prompts) and ``grpo_shared`` (one segment per
prompt group), ``grpo_packed`` (every ``[prompt, completion]`` one after the other in one row, no padding),
and ``shared_prefill`` (generation with the prompt's KV cache computed once per group); the generation backends
``compact``, ``continuous`` and ``static`` are checked the same way.

``check_layout`` runs the layout on a shrunk copy of the model (``probe.measure``: same class, config shrunk in
size only, verdict cached on disk) against each sequence's own forward, and raises ``LayoutRefused`` naming the
model, the knob, the measured difference, the likely cause (read off the config: ALiBi, token mixers that are not
attention, chunked attention, sliding windows, an attention implementation without 4D masks) and the setting
that avoids it. Nothing is accepted or refused by a list of families; nothing here changes a model.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

import lightalign.modules.adaptations.layouts as layouts
from lightalign.modules.adaptations.attention import VARLEN_SDPA
from lightalign.modules.adaptations.probe import GENERATION_BACKENDS, Verdict, _base, measure
from lightalign.modules.adaptations.probe_precision import FLOAT32, probe_precision
from lightalign.modules.training.logprobs import forward_accepts

LAYOUTS = ("padded", "padding_free", "packed", "dpo_shared", "dpo_classic", "grpo_padded", "grpo_shared",
           "grpo_packed", "shared_prefill")
SHARED_LAYOUTS = ("dpo_shared", "grpo_shared")
PACKED_LAYOUTS = ("padding_free", "packed", "grpo_packed")
PADDED_LAYOUTS = ("padded", "dpo_classic", "grpo_padded")
ATTENTION_KINDS = {"full_attention", "sliding_attention", "chunked_attention", "attention", "global", "local",
                   "hybrid"}
_KNOBS = {  # the knob as YAML / the command line names it, and the setting that avoids the layout
    "padding_free": ("data.padding_free / data.packing (SFTDataModule; data.padding_free of PreferenceDataModule)",
                     "data.padding_free: false and data.packing: false"),
    "packed": ("data.packing (SFTDataModule)", "data.packing: false"),
    "dpo_shared": ("data.prompt_sharing (PreferenceDataModule, on by default)", "data.prompt_sharing: false"),
    "grpo_shared": ("model.prompt_sharing (GRPOModule)", "model.prompt_sharing: false"),
    "grpo_packed": ("model.padding_free (GRPOModule / RLOOModule / DistillModule)", "model.padding_free: false"),
    "shared_prefill": ("model.share_prefill (GRPOModule / RLOOModule / PPOModule, on by default)",
                       "model.share_prefill: false"),
    "compact": ("model.generation_backend: compact", "model.generation_backend: generate"),
    "continuous": ("model.generation_backend: continuous", "model.generation_backend: generate"),
    "static": ("model.generation_backend: static", "model.generation_backend: generate"),
}
for _padded in PADDED_LAYOUTS:
    _KNOBS[_padded] = ("padded batches", "per-device batch size 1")


class LayoutRefused(ValueError):
    """A batch layout this model cannot compute exactly; the message names the model, the knob and what to do."""


@dataclass(frozen=True)
class ModelTraits:
    """What the config says about a model's token mixing (used to explain a measured verdict, never to decide)."""

    family: str  # config.model_type
    class_name: str
    attn: str  # the attention implementation the model runs
    alibi: bool  # positions as attention biases computed from the 2D mask
    takes_position_ids: bool
    attention_interface: bool  # attention goes through transformers' AttentionInterface
    sliding_window: int | None  # the window of its sliding-window layers; None: no such layer
    chunk: int | None = None  # attention_chunk_size
    other_mixers: tuple[str, ...] = ()  # layer kinds that are not attention (conv, mamba, linear_attention, ...)

    @property
    def name(self) -> str:
        return f"{self.class_name} (model_type '{self.family}')"


def uses_alibi(config) -> bool:
    attn_config = getattr(config, "attn_config", None)
    mpt_alibi = attn_config.get("alibi") if isinstance(attn_config, dict) else getattr(attn_config, "alibi", False)
    return (getattr(config, "model_type", "") == "bloom" or bool(getattr(config, "alibi", False)) or bool(mpt_alibi)
            or getattr(config, "position_embedding_type", None) == "alibi")


def sliding_window_of(config) -> int | None:
    window = getattr(config, "sliding_window", None) or getattr(config, "window_size", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


def _other_mixers(config) -> tuple[str, ...]:
    kinds: set[str] = set()
    for field in ("layer_types", "layers_block_type", "block_types", "hybrid_override_pattern"):
        value = getattr(config, field, None)
        if isinstance(value, (list, tuple)):
            kinds |= {str(k) for k in value}
        elif isinstance(value, str) and field == "hybrid_override_pattern":
            kinds |= {{"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}.get(c, c) for c in value}
    kinds -= ATTENTION_KINDS | {"mlp", "moe"}
    return tuple(sorted(kinds))


def model_traits(model: torch.nn.Module) -> ModelTraits:
    base = _base(model)
    config = base.config
    try:
        takes_position_ids = forward_accepts(base, "position_ids")
    except (TypeError, ValueError):
        takes_position_ids = False
    chunk = getattr(config, "attention_chunk_size", None)
    return ModelTraits(
        family=str(getattr(config, "model_type", "?")),
        class_name=type(base).__name__,
        attn=str(getattr(config, "_attn_implementation", None) or "eager"),
        alibi=uses_alibi(config),
        takes_position_ids=takes_position_ids,
        attention_interface=bool(getattr(type(base), "_supports_attention_backend", False)),
        sliding_window=sliding_window_of(config),
        chunk=int(chunk) if chunk else None,
        other_mixers=_other_mixers(config),
    )


_MEMO: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def measured(model: torch.nn.Module, layout: str, max_tokens: int | None = None,
             attn_implementation: str | None = None, precision: object = None) -> Verdict:
    """``probe.measure`` remembered per model object for this process (per-batch callers pay once)."""
    base = _base(model)
    memo = _MEMO.setdefault(base, {})
    key = (layout, max_tokens, attn_implementation, getattr(base.config, "_attn_implementation", None),
           probe_precision(precision))
    if key not in memo:
        memo[key] = measure(base, layout, max_tokens, attn_implementation=attn_implementation, precision=precision)
    return memo[key]


def check_layout(model: torch.nn.Module, layout: str, max_tokens: int | None = None,
                 precision: object = None) -> Verdict:
    """Refuse (``LayoutRefused``) a layout or generation backend the model does not compute exactly, as measured
    on its probe; return the verdict. ``max_tokens``: the longest sequence (prompt + completion) the run can have,
    when known (a sliding window, chunk or rope threshold at least that long never binds). ``precision``: the
    run's ``trainer.precision``; a bf16 run's log-prob layouts are measured in bf16 too (``probe_precision``)."""
    if layout not in LAYOUTS + GENERATION_BACKENDS:
        raise ValueError(f"Unknown layout '{layout}'; one of {LAYOUTS + GENERATION_BACKENDS}.")
    t = model_traits(model)
    knob, alternative = _KNOBS[layout]
    if gpu_only_attention(t.attn):
        if layout in SHARED_LAYOUTS:
            raise LayoutRefused(f"{knob} cannot run on {t.name}: this layout needs a custom 4D attention mask to reach "
                                f"every layer, which attn_implementation '{t.attn}' does not take (use sdpa or eager). "
                                f"Set {alternative}.")
        return Verdict(layout, True, float("nan"), not_measured=f"attn_implementation '{t.attn}' does not run on the "
                       "CPU probe")
    verdict = measured(model, layout, max_tokens, precision=precision)
    if not verdict.exact and verdict.precision != FLOAT32:
        raise LayoutRefused(
            f"{knob} cannot run exactly on {t.name} under trainer.precision {verdict.precision}: measured on a shrunk "
            f"copy of its config, the {layout} layout is exact in float32, but its {verdict.describe()}. Set "
            f"{alternative}, or trainer.precision: 32-true, to train this model exactly.")
    if not verdict.exact:
        cause = likely_cause(t, layout)
        raise LayoutRefused(
            f"{knob} cannot run exactly on {t.name}: measured on a shrunk copy of its config, the {layout} layout "
            f"{verdict.describe(with_error=not cause)}{f' ({cause})' if cause else ''}. Set {alternative} to train "
            "this model exactly.")
    return verdict


def gpu_only_attention(attn: str) -> bool:
    """Attention implementations the CPU probe cannot run (flash attention, hub kernels)."""
    return attn.startswith(("flash_attention", "kernels-", "paged|")) or "/" in attn


def likely_cause(t: ModelTraits, layout: str) -> str:
    """What in the config explains a refused layout (only an explanation: the measurement decided)."""
    restarts = layout in PACKED_LAYOUTS + SHARED_LAYOUTS
    if restarts and t.alibi:
        return "it uses ALiBi: its positions come from the 2D attention mask, not from position_ids"
    if restarts and not t.takes_position_ids:
        return "it takes no position_ids"
    if t.other_mixers and (restarts or layout in ("shared_prefill", *GENERATION_BACKENDS)):
        return (f"its token mixers {list(t.other_mixers)} are not attention, so no attention mask keeps sequences "
                "apart in them" if restarts else f"its cache holds state of {list(t.other_mixers)} layers")
    if t.chunk and restarts:
        return f"it attends in chunks of {t.chunk} tokens, which this layout's mask does not keep"
    if t.sliding_window and layout in SHARED_LAYOUTS and t.attn != VARLEN_SDPA:
        return (f"its sliding window ({t.sliding_window} tokens) is replaced by the shared-prefix mask under "
                f"attn_implementation '{t.attn}'")
    if restarts and t.attn not in ("sdpa", VARLEN_SDPA, "eager"):
        return f"attn_implementation '{t.attn}' does not take lightalign's masks"
    if restarts and t.attn != VARLEN_SDPA:
        return f"with attn_implementation '{t.attn}' its own mask lets attention cross the sequences of a row"
    return ""


def batch_dependence_note(model: torch.nn.Module, verdict: Verdict) -> str | None:
    """One line when the model's own batching is not exact whatever the layout (e.g. LongRoPE), else None."""
    if verdict.batch_dependence <= 0:
        return None
    t = model_traits(model)
    limits = ", ".join(f"{name} {fact['value']}" for name, fact in verdict.thresholds.items()
                       if isinstance(fact, dict) and fact.get("binds"))
    return (f"{t.name} computes a sequence differently when its batch holds longer ones, whatever the layout "
            f"(measured on its probe: up to {verdict.batch_dependence:.1e} nats per token in a plain padded batch; "
            f"the layouts themselves are exact). Exact only when no batch mixes sequences across its threshold"
            f"{f' ({limits})' if limits else ''}: keep max_length at or under it, or train with batch size 1.")


def native_packing_exact(model: torch.nn.Module) -> bool:
    """Whether the model's own ``sdpa`` masks keep the sequences of a packed row apart (measured on its probe):
    then a GPU run may hand packed rows to the model's own attention (or flash-attention's varlen path)."""
    return measured(model, "padding_free", attn_implementation="sdpa").exact


layouts.native_packing_exact = native_packing_exact  # the packed forwards ask the probe (see native_packing_exact)


def packed_gpu_attention(model: torch.nn.Module, device: torch.device) -> str | None:
    """``flash_attention_2`` for packed rows on a CUDA device when flash-attn is installed, the model supports it,
    runs in half precision and its own masks keep packed sequences apart (measured, ``native_packing_exact``):
    transformers' own varlen path, sequences found from ``position_ids``. None otherwise (CPU runs keep
    ``sdpa_varlen``, measured here; a user's explicit attention choice is kept)."""
    import importlib.util

    if device.type != "cuda" or importlib.util.find_spec("flash_attn") is None:
        return None
    base = _base(model)
    traits = model_traits(model)
    if traits.attn not in ("sdpa", VARLEN_SDPA) or not getattr(base, "_supports_flash_attn", False):
        return None
    if traits.alibi or not native_packing_exact(model):
        return None
    dtype = next(base.parameters()).dtype
    return "flash_attention_2" if dtype in (torch.float16, torch.bfloat16) else None
