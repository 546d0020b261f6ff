"""Side effects scoped (issue #33): a model the user passes to a module comes back with its own MLP forwards and
attention implementation after fit, also when the fit raises; the adaptations are switched on again for the next
fit; ``sdpa_varlen`` is registered in transformers only when a model is switched to it, once; the ``compact``
backend's class swap stays on the cache it creates."""

from __future__ import annotations

import gc
import subprocess
import sys

import lightning as L
import pytest
import torch

from lightalign import SFTDataModule, SFTModule
from lightalign.hub import load_causal_lm
from lightalign.modules.adaptations.attention import VARLEN_SDPA, register_varlen_sdpa, varlen_sdpa_forward
from lightalign.modules.adaptations.mlp_memory import mlp_report, recompute_mlp_activation, restore_mlp_forward


def _instance_forwards(model: torch.nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if "forward" in vars(m)]


class _SeeAdaptations(L.Callback):
    """What the model trains with: switched MLPs and the attention implementation at the first batch."""

    def __init__(self, fail: bool = False) -> None:
        self.seen, self.fail = [], fail

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.append((mlp_report(pl_module.model).switched, pl_module.model.config._attn_implementation))
        if self.fail:
            raise RuntimeError("boom")


def _fit(module, tiny_dir, data_dir, callback):
    data = SFTDataModule(str(data_dir / "arithmetic_sft.jsonl"), tokenizer=str(tiny_dir), batch_size=4)
    L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, callbacks=[callback]).fit(module, data)


def test_a_user_passed_model_is_handed_back_unchanged_after_fit_and_adapted_again_for_the_next(tiny_dir, data_dir):
    """Mutation: teardown not calling undo_side_effects (or restore_mlp_forward a no-op) -> the instance forwards
    stay; setup not re-adapting -> the second fit trains without them."""
    torch.manual_seed(0)
    model = load_causal_lm(str(tiny_dir), from_config=True)
    layers, attention = model.config.num_hidden_layers, model.config._attn_implementation
    assert attention == "sdpa" and not _instance_forwards(model)
    module = SFTModule(model=model)
    assert module.model is model and len(_instance_forwards(model)) == layers  # adapted for training
    for _ in range(2):  # fit, then fit again: adapted while training, the user's own after each
        spy = _SeeAdaptations()
        _fit(module, tiny_dir, data_dir, spy)
        assert spy.seen == [(layers, VARLEN_SDPA)]
        assert _instance_forwards(model) == [] and model.config._attn_implementation == attention


def test_a_user_passed_model_is_handed_back_when_the_fit_raises(tiny_dir, data_dir):
    """Lightning skips the module's teardown hook when fit raises; the callback's on_exception undoes instead.
    Mutation: UndoSideEffectsOnError left out of configure_callbacks -> the forwards stay switched."""
    torch.manual_seed(0)
    model = load_causal_lm(str(tiny_dir), from_config=True)
    module = SFTModule(model=model)
    with pytest.raises(RuntimeError, match="boom"):
        _fit(module, tiny_dir, data_dir, _SeeAdaptations(fail=True))
    assert _instance_forwards(model) == [] and model.config._attn_implementation == "sdpa"


def test_restore_gives_back_the_class_forward_and_leaves_other_instance_forwards_alone(tiny_model):
    """restore_mlp_forward takes back exactly what recompute_mlp_activation switched; an MLP whose forward someone
    else replaced on the instance is neither switched nor restored (its forward is not ours to take).
    Mutation: recompute_mlp_activation overwriting foreign instance forwards -> the foreign forward is lost."""
    layers = tiny_model.model.layers
    theirs = layers[0].mlp

    def foreign(x):
        return type(theirs).forward(theirs, x)

    theirs.forward = foreign
    assert recompute_mlp_activation(tiny_model) == len(layers) - 1
    assert theirs.forward is foreign
    assert "replaced on the instance" in mlp_report(tiny_model).skipped[type(theirs).__name__]
    ids = torch.randint(3, tiny_model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        lean = tiny_model(input_ids=ids).logits
    assert restore_mlp_forward(tiny_model) == len(layers) - 1
    assert _instance_forwards(tiny_model) == ["model.layers.0.mlp"] and theirs.forward is foreign
    with torch.no_grad():
        assert torch.equal(tiny_model(input_ids=ids).logits, lean)
    assert restore_mlp_forward(tiny_model) == 0  # nothing left to restore


def test_importing_lightalign_registers_no_attention_function():
    """The registration is lazy: importing the package (every module, the adaptations) leaves transformers'
    registries alone. Mutation: register_varlen_sdpa() at attention.py's import -> fails."""
    code = ("import lightalign, lightalign.modules.adaptations, lightalign.modules.adaptations.layouts\n"
            "from lightalign import DPOModule, GRPOModule, SFTModule\n"
            "from transformers import AttentionInterface\n"
            "from transformers.masking_utils import AttentionMaskInterface\n"
            f"print({VARLEN_SDPA!r} in AttentionInterface._global_mapping, "
            f"{VARLEN_SDPA!r} in AttentionMaskInterface._global_mapping)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"], out.stderr[-2000:]


def test_registration_is_idempotent_and_never_replaces_another_function(monkeypatch):
    """Registering twice keeps one entry, ours; a different function under the name is refused, not replaced.
    Mutation: register_varlen_sdpa registering unconditionally -> the foreign function is replaced."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    monkeypatch.setattr(AttentionInterface, "_global_mapping", dict(AttentionInterface._global_mapping))
    monkeypatch.setattr(AttentionMaskInterface, "_global_mapping", dict(AttentionMaskInterface._global_mapping))
    AttentionInterface._global_mapping.pop(VARLEN_SDPA, None)
    AttentionMaskInterface._global_mapping.pop(VARLEN_SDPA, None)
    register_varlen_sdpa()
    register_varlen_sdpa()
    assert AttentionInterface._global_mapping[VARLEN_SDPA] is varlen_sdpa_forward
    assert AttentionMaskInterface._global_mapping[VARLEN_SDPA] is sdpa_mask

    def someone_elses(*args, **kwargs):
        raise AssertionError("not called")

    AttentionInterface._global_mapping[VARLEN_SDPA] = someone_elses
    with pytest.raises(RuntimeError, match="already holds another function"):
        register_varlen_sdpa()
    assert AttentionInterface._global_mapping[VARLEN_SDPA] is someone_elses


def test_compact_swaps_classes_only_on_the_cache_it_creates(monkeypatch):
    """The grown cache layers (their class swapped) are the call's own: none outlives it, DynamicLayer and a cache
    made outside are untouched, and the linears get their own forwards back. Mutation: the loop keeping its cache
    on the model (``model._last_cache = cache``) -> a grown layer outlives the call."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    from helpers.conformance_models import build
    from lightalign.modules.sampling import compact

    model = build("llama")
    prompts = torch.tensor([[11, 12, 13, 14, 15], [0, 0, 21, 22, 23]])
    mask = (prompts != 0).long()
    outside = DynamicCache(config=model.config)
    with torch.no_grad():
        cache_kwarg = "cache" if compact._forward_takes(model, "cache") else "past_key_values"
        model(input_ids=prompts, attention_mask=mask, use_cache=True, **{cache_kwarg: outside})
    layer_class = dict(vars(DynamicLayer))
    grown = []
    original = compact.grow_in_place
    monkeypatch.setattr(compact, "grow_in_place", lambda cache, room: grown.append(original(cache, room)) or grown[-1])
    compact.compact_groups(model, prompts, mask, 2, eos_token_ids=[10**6], pad_token_id=0, max_new_tokens=6, top_k=1,
                           grow_cache=True, prepack=True)
    assert grown and grown[0] > 0  # the call did grow (swap) layers
    gc.collect()
    growing = compact._growing_layer_class()
    assert not [o for o in gc.get_objects() if isinstance(o, growing)]
    assert dict(vars(DynamicLayer)) == layer_class
    assert all(type(layer) is DynamicLayer for layer in outside.layers)
    assert _instance_forwards(model) == []
