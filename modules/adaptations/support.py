"""What each batch layout needs from a model, and the check that refuses a layout a model cannot run exactly.

A *layout* is how lightalign lays sequences out for one forward: ``padded`` rows (SFT), ``padding_free`` and
``packed`` rows (several sequences in one row, ``position_ids`` restarting), the DPO pair layouts
``dpo_shared`` (one ``[prompt, chosen, rejected]`` segment per pair under a 4D mask) and ``dpo_classic``
(padded rows), the GRPO layouts ``grpo_padded`` (left-padded prompts) and ``grpo_shared`` (one segment per
prompt group), ``grpo_packed`` (every ``[prompt, completion]`` one after the other in one row, no padding),
and ``shared_prefill`` (generation with the prompt's KV cache computed once per group).

The requirements, read off the model's structure (``ModelTraits``):

* positions from ``position_ids``: packed and shared-prefix rows restart positions inside a row. ALiBi models
  (Bloom, Falcon with ``alibi``, MPT) compute positions from the 2D attention mask and cannot.
* attention that never crosses a sequence of a packed row: either lightalign's ``sdpa_varlen`` runs the model's
  attention (each sequence on its own, ``attention.py``), or the family builds its masks from ``position_ids``
  (``PACKED_MASK_FAMILIES``, checked family by family in tests/test_conformance.py; Falcon and OPT do not).
* a custom 4D mask that reaches every layer unchanged: the shared-prefix layouts need ``sdpa``/``sdpa_varlen``/
  ``eager`` attention in a family of the conformance matrix (``MATRIX_FAMILIES``) or one whose attention goes
  through transformers' attention interface.
* sliding windows: a shared-prefix mask replaces the model's own, so the window must be put back into it.
  ``sdpa_varlen`` does so for every layer that announces its window (``WINDOW_KWARG_FAMILIES``); with other
  attention the layout is refused when sequences can be longer than the window.

``check_layout`` raises ``LayoutRefused`` naming the model, the knob and the alternative; nothing here changes a
model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightalign.modules.adaptations.attention import VARLEN_SDPA
from lightalign.modules.logprobs import forward_accepts

LAYOUTS = ("padded", "padding_free", "packed", "dpo_shared", "dpo_classic", "grpo_padded", "grpo_shared",
           "grpo_packed", "shared_prefill")
SHARED_LAYOUTS = ("dpo_shared", "grpo_shared")
PACKED_LAYOUTS = ("padding_free", "packed", "grpo_packed")

# Families whose masks come from transformers' masking_utils given position_ids (packed sequences detected).
PACKED_MASK_FAMILIES = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "gemma2",
                                  "gemma3_text", "phi3", "gpt2", "gpt_neox"})
# Every family of the conformance matrix (tests/conformance_models.py).
MATRIX_FAMILIES = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3_text",
                             "phi3", "gpt2", "gpt_neox", "opt", "falcon", "bloom"})
# Families whose sliding-window layers pass their window to the attention function (``sliding_window=``).
WINDOW_KWARG_FAMILIES = frozenset({"mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3_text",
                                   "phi3"})
_KNOBS = {  # the knob as YAML / the command line names it, and the setting that avoids the layout
    "padding_free": ("data.padding_free / data.packing (SFTDataModule; data.padding_free of PreferenceDataModule)",
                     "data.padding_free: false and data.packing: false"),
    "packed": ("data.packing (SFTDataModule)", "data.packing: false"),
    "dpo_shared": ("data.prompt_sharing (PreferenceDataModule, on by default)", "data.prompt_sharing: false"),
    "grpo_shared": ("model.prompt_sharing (GRPOModule)", "model.prompt_sharing: false"),
    "grpo_packed": ("model.padding_free (GRPOModule / RLOOModule)", "model.padding_free: false"),
}


class LayoutRefused(ValueError):
    """A batch layout this model cannot compute exactly; the message names the model, the knob and what to do."""


@dataclass(frozen=True)
class ModelTraits:
    family: str  # config.model_type
    class_name: str
    attn: str  # the attention implementation the model runs
    alibi: bool  # positions as attention biases computed from the 2D mask
    takes_position_ids: bool
    attention_interface: bool  # attention goes through transformers' AttentionInterface
    sliding_window: int | None  # the window of its sliding-window layers; None: no such layer

    @property
    def name(self) -> str:
        return f"{self.class_name} (model_type '{self.family}')"


def _base(model: torch.nn.Module) -> torch.nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def uses_alibi(config) -> bool:
    attn_config = getattr(config, "attn_config", None)
    mpt_alibi = attn_config.get("alibi") if isinstance(attn_config, dict) else getattr(attn_config, "alibi", False)
    return (getattr(config, "model_type", "") == "bloom" or bool(getattr(config, "alibi", False)) or bool(mpt_alibi)
            or getattr(config, "position_embedding_type", None) == "alibi")


def sliding_window_of(config) -> int | None:
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


def model_traits(model: torch.nn.Module) -> ModelTraits:
    base = _base(model)
    config = base.config
    try:
        takes_position_ids = forward_accepts(base, "position_ids")
    except (TypeError, ValueError):
        takes_position_ids = False
    return ModelTraits(
        family=str(getattr(config, "model_type", "?")),
        class_name=type(base).__name__,
        attn=str(getattr(config, "_attn_implementation", None) or "eager"),
        alibi=uses_alibi(config),
        takes_position_ids=takes_position_ids,
        attention_interface=bool(getattr(type(base), "_supports_attention_backend", False)),
        sliding_window=sliding_window_of(config),
    )


def check_layout(model: torch.nn.Module, layout: str, max_tokens: int | None = None) -> ModelTraits:
    """Refuse (``LayoutRefused``) a layout the model cannot compute exactly; return the model's traits.

    ``max_tokens``: the longest sequence (prompt + completion) the run can have, when known; a sliding window
    at least that long never binds."""
    if layout not in LAYOUTS:
        raise ValueError(f"Unknown layout '{layout}'; one of {LAYOUTS}.")
    t = model_traits(model)
    if layout in PACKED_LAYOUTS + SHARED_LAYOUTS:
        knob, alternative = _KNOBS[layout]
        if t.alibi or not t.takes_position_ids:
            why = ("uses ALiBi: its positions come from the 2D attention mask, not from position_ids"
                   if t.alibi else "takes no position_ids")
            _refuse(t, knob, alternative, f"it {why}, and this layout restarts positions inside a row")
        window_binds = t.sliding_window is not None and (max_tokens is None or max_tokens > t.sliding_window)
        if window_binds and t.family not in WINDOW_KWARG_FAMILIES:
            _refuse(t, knob, alternative, f"it has sliding-window attention (window {t.sliding_window}) and is not "
                    "in lightalign's conformance matrix, so the window cannot be kept exactly")
        if layout in PACKED_LAYOUTS:
            varlen = t.attn == VARLEN_SDPA and t.attention_interface
            if not varlen and t.family not in PACKED_MASK_FAMILIES:
                _refuse(t, knob, alternative,
                        f"with attn_implementation '{t.attn}' its attention mask is not built from position_ids, so "
                        "attention would cross the sequences of a packed row (lightalign's sdpa_varlen keeps them "
                        "apart on models that route attention through transformers' attention interface)")
        else:
            if t.attn not in ("sdpa", VARLEN_SDPA, "eager"):
                _refuse(t, knob, alternative,
                        f"this layout needs a custom 4D attention mask to reach every layer, which "
                        f"attn_implementation '{t.attn}' does not take (use sdpa or eager)")
            if t.family not in MATRIX_FAMILIES and not t.attention_interface:
                _refuse(t, knob, alternative,
                        "its code neither routes attention through transformers' attention interface nor is in "
                        "lightalign's conformance matrix, so a custom 4D mask may not reach every layer")
            if window_binds and t.attn != VARLEN_SDPA:
                _refuse(t, knob, alternative,
                        f"it has sliding-window attention (window {t.sliding_window} tokens, shorter than the "
                        f"sequences{'' if max_tokens is None else f' of up to {max_tokens} tokens'}) and runs "
                        f"attn_implementation '{t.attn}', where the shared-prefix mask would replace the window "
                        "(lightalign keeps the window under sdpa, which it runs as sdpa_varlen)")
    return t


def _refuse(t: ModelTraits, knob: str, alternative: str, why: str) -> None:
    raise LayoutRefused(f"{knob} cannot run exactly on {t.name}: {why}. Set {alternative} to train this model "
                        "with padded rows.")


def packed_gpu_attention(model: torch.nn.Module, device: torch.device) -> str | None:
    """``flash_attention_2`` for packed rows on a CUDA device when flash-attn is installed, the model supports it
    and runs in half precision: transformers' own varlen path, sequences found from ``position_ids``. None
    otherwise (CPU runs keep ``sdpa_varlen``, measured here; a user's explicit attention choice is kept)."""
    import importlib.util

    if device.type != "cuda" or importlib.util.find_spec("flash_attn") is None:
        return None
    base = _base(model)
    traits = model_traits(model)
    if traits.attn not in ("sdpa", VARLEN_SDPA) or not getattr(base, "_supports_flash_attn", False):
        return None
    if traits.alibi or traits.family not in PACKED_MASK_FAMILIES:
        return None
    dtype = next(base.parameters()).dtype
    return "flash_attention_2" if dtype in (torch.float16, torch.bfloat16) else None
