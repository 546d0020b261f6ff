"""The ``compact`` generation backend: a sampling loop whose finished rows leave the batch.

``generate`` decodes every row until the longest completion ends; on a reasoning workload (completions of geometric
length, a long budget) most of that work is on rows that already emitted EOS. Here the loop is lightalign's own, on
a standard ``DynamicCache`` and the model's own attention (sdpa / eager, 2-D padding mask):

1. the prompts' prefill runs once per prompt and its cache is repeated ``num_generations`` times
   (``generate.prefill_shared_cache``; the full prompts when sharing does not apply);
2. each decode step feeds the live rows' last token with its position (``cumsum(mask) - 1``, ``generate``'s rule)
   and samples from the processed logits: the same ``LogitsProcessorList`` ``generate`` builds from the model's
   generation config updated with the knobs (temperature, top_k, top_p, min_p, repetition_penalty);
3. a row that emits an EOS is finished; once at least ``compact_fraction`` (a quarter on the CPU) of the live
   rows are finished, the live rows of every per-row state (tokens so far, attention mask, positions, every layer's
   keys and values) are gathered (``index_select`` on the batch dimension) and decoding continues on those only. A
   finished row not yet gathered out gets ``pad_token_id``, as in ``generate``.

Two CPU speed-ups that change no token, used by default only where they apply (``compact_grow_cache`` on any CPU,
``compact_prepack_linears`` where a first-use measurement on this machine says it gains: ``tuned``'s table, beside
``compact_fraction``):
- the cache's plain layers get room for the whole completion once the prompt is in (``grow_in_place``): a decode
  step writes its keys and values in place instead of ``torch.cat``-copying every layer's cache (bitwise the same
  tokens and log-probs; tests);
- on the CPU in float32 every plain ``nn.Linear`` runs on a oneDNN-prepacked copy of its weight for the duration of the
  call (``packed_linears``): the same product up to float32 rounding, faster sampling on the small model; only for
  models whose linear weights hold at least the small model's 116 MiB (``compact_prepack_min_mib``: on smaller matrices
  it is slower). Measured, see docs/performance.md 'Prepacked linears'.

What the loop changes besides its own tensors, and for how long: the linears' forwards for the duration of the
call (``packed_linears`` gives them back on exit), and the class of the cache layers it grows
(``layer.__class__``, ``_k`` / ``_v``). Those layers belong only to the cache the call itself creates (a fresh
``DynamicCache``, or the one ``prefill_shared_cache`` builds for it): ``compact_groups`` takes no cache, the
cache is never returned, stored or handed to anything but the model's forward, and it dies with the call.
``DynamicLayer`` itself, the model and any other cache are untouched.

A row's tokens depend only on its own cache, mask and positions, so leaving the batch changes no row's completion;
greedy (``top_k=1``) equals ``model.generate(do_sample=False)`` token for token (tests). Tokens are drawn with
``torch.multinomial`` from the processed distribution, as ``generate`` does, on the default torch generator: seeded
runs reproduce, but the draws differ from ``generate``'s once rows have left the batch.

Refused (``check_compact_model``): encoder-decoder models, stateful (recurrent / Mamba) models, and models whose
``DynamicCache`` holds anything but plain per-layer keys and values (hybrid linear-attention caches).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
from typing import Any

import torch

from lightalign.modules.sampling.generate import SAMPLING_KNOBS
from lightalign.modules.training.device_tuning import tuned


def _base(model: torch.nn.Module) -> torch.nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def check_compact_model(model: torch.nn.Module) -> None:
    """Refuse a model whose decode state is not a plain per-layer KV cache, naming the alternative."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    base = _base(model)
    config = base.config
    name = getattr(config, "model_type", type(base).__name__)
    why = None
    if getattr(config, "is_encoder_decoder", False):
        why = "it is an encoder-decoder model"
    elif getattr(base, "_is_stateful", False):
        why = "it keeps a recurrent state, not a KV cache"
    else:
        cache = DynamicCache(config=config)
        kinds = {type(layer) for layer in getattr(cache, "layers", [])}
        if any(not issubclass(kind, DynamicLayer) for kind in kinds):
            why = f"its cache holds {sorted(k.__name__ for k in kinds)}, not only per-layer keys and values"
    if why:
        raise ValueError(f"generation_backend 'compact' cannot sample from {name!r}: {why}; use "
                         "generation_backend: generate.")


def logits_processors(model: torch.nn.Module, prompt_length: int, eos: list[int], pad_token_id: int,
                      **sampling: Any):
    """``generate``'s logits processors for these sampling knobs: the model's generation config updated with them,
    built by transformers itself (same classes, same order)."""
    unknown = set(sampling) - set(SAMPLING_KNOBS)
    if unknown:
        raise ValueError(f"generation_backend 'compact' applies only {list(SAMPLING_KNOBS)}; got {sorted(unknown)}: "
                         "use generation_backend: generate.")
    base = _base(model)
    config = copy.deepcopy(base.generation_config)
    config.update(do_sample=True, num_beams=1, eos_token_id=eos, pad_token_id=pad_token_id, **sampling)
    config._eos_token_tensor = torch.tensor(eos)
    config._pad_token_tensor = torch.tensor(pad_token_id)
    return base._get_logits_processor(generation_config=config, input_ids_seq_length=prompt_length,
                                      encoder_input_ids=None, prefix_allowed_tokens_fn=None, logits_processor=None,
                                      device=str(next(base.parameters()).device), model_kwargs={})


@functools.cache
def _growing_layer_class():
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        """A ``DynamicLayer`` whose keys and values live in a buffer with room for the whole completion: a decode step
        writes its token in place instead of copying the whole cache (``torch.cat``). ``keys`` / ``values`` stay
        what ``DynamicLayer`` exposes: ``[B, heads, length, dim]`` (views of the buffer)."""

        def update(self, key_states, value_states, *args, **kwargs):
            n, new = self.keys.shape[-2], key_states.shape[-2]
            if n + new > self._k.shape[-2]:  # (never on the sampling loop: sized for the prompt + max_new_tokens)
                keys, values = super().update(key_states, value_states, *args, **kwargs)
                self._k, self._v = keys, values
                return keys, values
            self._k[..., n:n + new, :] = key_states
            self._v[..., n:n + new, :] = value_states
            self.keys, self.values = self._k[..., :n + new, :], self._v[..., :n + new, :]
            return self.keys, self.values

        def batch_select_indices(self, indices):
            n = self.keys.shape[-2]
            self._k, self._v = self._k[indices], self._v[indices]
            self.keys, self.values = self._k[..., :n, :], self._v[..., :n, :]

    return GrowingLayer


def grow_in_place(cache, room: int) -> int:
    """Give every plain ``DynamicLayer`` of ``cache`` (already holding the prompt) a buffer with ``room`` more
    positions; returns how many layers were converted (sliding-window and other layer types are left as they are).
    The layers' class is swapped on the instance: call it only on a cache the caller created and owns (``_sample``
    calls it on its own, never on a cache from outside)."""
    from transformers.cache_utils import DynamicLayer

    growing = _growing_layer_class()
    converted = 0
    for layer in getattr(cache, "layers", []):
        if type(layer) is not DynamicLayer or not layer.is_initialized or layer.keys.dim() != 4:
            continue
        keys, values = layer.keys, layer.values
        shape = list(keys.shape)
        shape[-2] += room
        layer._k, layer._v = keys.new_empty(shape), values.new_empty(shape[:-1] + [values.shape[-1]])
        layer._k[..., : keys.shape[-2], :] = keys
        layer._v[..., : values.shape[-2], :] = values
        layer.__class__ = growing
        layer.keys, layer.values = layer._k[..., : keys.shape[-2], :], layer._v[..., : values.shape[-2], :]
        converted += 1
    return converted


def _forward_takes(model: torch.nn.Module, name: str) -> bool:
    return name in inspect.signature(_base(model).forward).parameters


@torch.no_grad()
def compact_groups(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, num_generations: int,
                   *, eos_token_ids: list[int], pad_token_id: int, max_new_tokens: int, share_prefill: bool = True,
                   return_logprobs: bool = False, compact_fraction: float | None = None,
                   prepack: bool | None = None, grow_cache: bool | None = None, **sampling: Any
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Completion ids ``[P * G, new]`` (rows grouped by prompt, ``pad_token_id`` after a completion's EOS, ``new`` =
    the longest completion) and, with ``return_logprobs``, the sampler's log-prob of each token (0 after the end).
    ``compact_fraction``: finished rows are gathered out once at least this share of the live rows has finished.
    ``prepack``: on the CPU in float32, the linears run on oneDNN-prepacked weights (``packed_linear``).
    ``grow_cache``: the cache's plain layers get room for the whole completion up front (``grow_in_place``).
    Unset (None), each is the value measured for the prompts' device type (``tuned``'s table): on the
    CPU a quarter, on (for a model with at least ``compact_prepack_min_mib`` of eligible linear weights), on;
    elsewhere 0 (at once), off, off."""
    from lightalign.modules.sampling.packed_linear import packed_linears

    device = prompt_ids.device
    compact_fraction = tuned("compact_fraction", device) if compact_fraction is None else compact_fraction
    if prepack is None:  # measured to pay off on large weights only (compact_prepack_min_mib)
        from lightalign.modules.sampling.packed_linear import eligible_mib

        prepack = bool(tuned("compact_prepack_linears", device)) and eligible_mib(model) >= tuned(
            "compact_prepack_min_mib", device)
    grow_cache = tuned("compact_grow_cache", device) if grow_cache is None else grow_cache
    check_compact_model(model)
    with packed_linears(model) if prepack else contextlib.nullcontext():
        return _sample(model, prompt_ids, prompt_mask, num_generations, eos_token_ids, pad_token_id, max_new_tokens,
                       share_prefill, return_logprobs, compact_fraction, grow_cache, sampling)


def _sample(model, prompt_ids, prompt_mask, num_generations, eos_token_ids, pad_token_id, max_new_tokens,
            share_prefill, return_logprobs, compact_fraction, grow_cache, sampling):
    from transformers import DynamicCache

    from lightalign.modules.sampling.generate import forward_cache_kwarg, prefill_shared_cache

    processors = logits_processors(model, prompt_ids.shape[1], eos_token_ids, pad_token_id, **sampling)
    device = prompt_ids.device
    rows = prompt_ids.shape[0] * num_generations
    ids = prompt_ids.repeat_interleave(num_generations, 0)  # each live row's tokens so far (processors read them)
    mask = prompt_mask.repeat_interleave(num_generations, 0).long()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    if share_prefill and num_generations > 1 and prompt_ids.shape[1] >= 2:
        cache = prefill_shared_cache(model, prompt_ids, prompt_mask, num_generations)
        step_ids, step_positions = ids[:, -1:], positions[:, -1:]
    else:
        cache = DynamicCache(config=_base(model).config)
        step_ids, step_positions = ids, positions
    extra = {"logits_to_keep": 1} if _forward_takes(model, "logits_to_keep") else {}
    cache_kwarg = forward_cache_kwarg(model)  # `cache` from transformers 5.24 on, `past_key_values` before
    use_positions = _forward_takes(model, "position_ids")
    grown = not grow_cache  # (the cache grown below is this call's own: created above, never returned)
    eos = torch.tensor(eos_token_ids, device=device)

    out = torch.full((rows, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    logps = torch.zeros(rows, max_new_tokens, device=device) if return_logprobs else None
    live = torch.arange(rows, device=device)  # the output row of each live row
    done = torch.zeros(rows, dtype=torch.bool, device=device)
    steps = 0
    for step in range(max_new_tokens):
        steps = step + 1
        if use_positions:
            extra["position_ids"] = step_positions
        if not grown and cache.get_seq_length() > 0:  # (without the shared prefill: after the first step)
            grow_in_place(cache, max_new_tokens - step)  # the tokens this and every later step may still write
            grown = True
        logits = model(input_ids=step_ids, attention_mask=mask, use_cache=True, **{cache_kwarg: cache},
                       **extra).logits[:, -1].float()
        scores = processors(ids, logits)
        tokens = torch.multinomial(torch.softmax(scores, -1), 1).squeeze(1)
        tokens = tokens.masked_fill(done, pad_token_id)
        out[live, step] = tokens
        if logps is not None:
            chosen = torch.log_softmax(scores, -1).gather(-1, tokens[:, None]).squeeze(1)
            logps[live, step] = chosen.masked_fill(done, 0.0)
        done = done | torch.isin(tokens, eos)
        finished = int(done.sum())
        if finished == done.shape[0]:
            break
        ids = torch.cat([ids, tokens[:, None]], 1)
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
        step_ids, step_positions = tokens[:, None], step_positions[:, -1:] + 1
        if finished and finished >= compact_fraction * done.shape[0]:
            keep = (~done).nonzero().squeeze(1)
            cache.batch_select_indices(keep)
            ids, mask, step_ids, step_positions = ids[keep], mask[keep], step_ids[keep], step_positions[keep]
            live, done = live[keep], done[keep]
    out = out[:, :steps]
    return out, None if logps is None else logps[:, :steps]
