"""Per-token and per-sequence log-probabilities of given tokens, without a full-vocabulary float32 copy.

``selective_log_softmax`` computes ``log_softmax(logits)[token]`` as ``logit[token] - logsumexp(logits)`` row
chunk by row chunk, so at most ``chunk_rows x vocab`` float32 values exist at a time, whatever the batch.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor, chunk_rows: int = 4096) -> torch.Tensor:
    """``log_softmax(logits, -1).gather(-1, index)`` for ``logits [..., V]`` and ``index [...]``, memory-light."""
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_index = index.reshape(-1)
    out = torch.empty(flat_index.shape, dtype=torch.float32, device=logits.device)
    for start in range(0, flat_logits.shape[0], chunk_rows):
        rows = flat_logits[start : start + chunk_rows].float()
        picked = rows.gather(-1, flat_index[start : start + chunk_rows].unsqueeze(-1)).squeeze(-1)
        out[start : start + chunk_rows] = picked - torch.logsumexp(rows, dim=-1)
    return out.view(index.shape)


def log_sum_squared_probs(logits: torch.Tensor, chunk_rows: int = 4096) -> torch.Tensor:
    """``log(sum_v softmax(logits)_v^2)`` per position of ``logits [..., V]`` -> ``[...]`` float32, detached (WPO's
    alignment term: the log-probability that two samples of the distribution agree), row chunk by row chunk."""
    flat = logits.detach().reshape(-1, logits.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    for start in range(0, flat.shape[0], chunk_rows):
        rows = flat[start : start + chunk_rows].float()
        out[start : start + chunk_rows] = torch.logsumexp(2 * rows, -1) - 2 * torch.logsumexp(rows, -1)
    return out.view(logits.shape[:-1])


def completion_logps(
    logits: torch.Tensor, input_ids: torch.Tensor, completion_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs of the completion tokens: ``(token_logps [N, T-1], mask [N, T-1])``.

    Position ``t`` of the outputs is the log-prob of ``input_ids[:, t+1]`` given the tokens before it; the mask
    is ``completion_mask[:, 1:]`` (prompt and padding are 0). Masked positions hold 0.
    """
    targets = input_ids[:, 1:]
    mask = completion_mask[:, 1:].bool()
    token_logps = selective_log_softmax(logits[:, :-1, :], targets)
    return token_logps.masked_fill(~mask, 0.0), mask


def sequence_logps(
    logits: torch.Tensor, input_ids: torch.Tensor, completion_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed completion log-prob of each sequence and its completion length: ``(logps [N], lengths [N])``."""
    token_logps, mask = completion_logps(logits, input_ids, completion_mask)
    return token_logps.sum(-1), mask.sum(-1)


# ---------------------------------------------------------------------------------- shared-prefix layout
def forward_accepts(model: torch.nn.Module, argument: str) -> bool:
    """Whether the (base) model's ``forward`` takes ``argument`` (``logits_to_keep``, ``position_ids`` ...)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return argument in inspect.signature(base.forward).parameters


def shared_prefix_logits(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """One forward of a shared-prefix batch (``shared_prefix_batch``) -> ``[targets, V]`` logits, the
    row ``j`` predicting ``batch["targets"][j]``. Logits are computed only at ``logits_mask`` positions when the
    model takes ``logits_to_keep``. Which models may run this layout: ``adaptations.check_layout``."""
    import lightalign.modules.adaptations.attention as attention
    from lightalign.modules.adaptations.attention import VARLEN_SDPA
    from lightalign.modules.training.device_tuning import tuned

    attn = getattr(getattr(model, "config", None), "_attn_implementation", None) or "sdpa"
    if attn not in ("sdpa", VARLEN_SDPA, "eager"):
        raise ValueError(
            f"The shared-prefix layout needs a custom 4D attention mask, which attn_implementation='{attn}' does "
            "not take. Set prompt_sharing=False (PreferenceDataModule / GRPOModule) for the classic padded "
            "layout, or load the model with attn_implementation='sdpa'."
        )
    mask = batch["attention_mask"]
    if attn == "eager":  # eager attention adds the mask to the scores
        dtype = next(model.parameters()).dtype
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
    inputs = dict(input_ids=batch["input_ids"], attention_mask=mask, position_ids=batch["position_ids"],
                  use_cache=False)
    if attn == VARLEN_SDPA:
        # the mask replaces the model's sliding-window masks: sdpa_varlen puts each layer's window back
        inputs["window_positions"] = batch["position_ids"]
        device = batch["input_ids"].device
        compiled = getattr(model, "_compiled_call_impl", None) is not None
        if tuned("min_saved_scores_per_call", device) is not None and not compiled:
            # each segment attends on its own when that saves enough work (a threshold measured on CPU, so CPU
            # only: device_tuning; elsewhere the edges are not even read off the device); not under torch.compile,
            # where a list of per-batch edges would force a recompile per batch
            bounds = segment_bounds(batch)
            if attention.worth_splitting(bounds, batch["input_ids"].shape[1], device):
                inputs["segment_bounds"] = bounds
    if forward_accepts(model, "logits_to_keep"):
        logits = model(**inputs, logits_to_keep=batch["logits_mask"]).logits
        if logits.dim() == 3:  # a model that ignores a boolean mask returns [R, T, V]
            logits = logits[batch["logits_mask"]]
    else:
        logits = model(**inputs).logits[batch["logits_mask"]]
    return logits[batch["target_logit_index"]]


def segment_bounds(batch: dict[str, torch.Tensor]) -> list[list[int]]:
    """Per row of a shared-prefix batch, the edges of its segments: every segment starts with its prompt at
    position 0, and padding fills only the tail of a row."""
    branch, positions = batch["branch"], batch["position_ids"]
    starts = (branch == 0) & (positions == 0)
    ends = (branch >= 0).sum(-1).tolist()
    return [torch.nonzero(row).flatten().tolist() + [end] for row, end in zip(starts, ends)]


def scatter_to_sequences(values: torch.Tensor, batch: dict[str, torch.Tensor], num_sequences: int,
                         width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-target values of a shared-prefix batch -> ``([num_sequences, width], mask)`` by (sequence, offset)."""
    sequences, offsets = batch["target_sequence"], batch["target_offset"]
    width = int(offsets.max()) + 1 if width is None else width
    out = values.new_zeros(num_sequences, width).index_put((sequences, offsets), values)
    seen = torch.zeros(num_sequences, width, dtype=torch.bool, device=values.device).index_put(
        (sequences, offsets), torch.ones_like(sequences, dtype=torch.bool))
    return out, seen


def shared_prefix_token_logps(model: torch.nn.Module, batch: dict[str, torch.Tensor], num_sequences: int, width: int,
                              temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs ``[num_sequences, width]`` of the branch tokens of a shared-prefix batch (0 where a
    sequence has no token), and the ``[targets, V]`` logits they came from (divided by ``temperature``)."""
    logits = shared_prefix_logits(model, batch)
    if temperature != 1.0:
        logits = logits / temperature
    logps = selective_log_softmax(logits, batch["targets"])
    out, _ = scatter_to_sequences(logps, batch, num_sequences, width)
    return out, logits


@torch.no_grad()
def mean_entropy(logits: torch.Tensor, scored: torch.Tensor) -> torch.Tensor | None:
    """Mean entropy of the token distributions of ``logits[scored]`` (detached; None when nothing is scored)."""
    flat = logits.detach()[scored].float()
    if not flat.numel():
        return None
    probs = flat.softmax(-1)
    return (torch.logsumexp(flat, -1) - (probs * flat).sum(-1)).mean()


def padded_position_ids(mask: torch.Tensor) -> torch.Tensor:
    """Positions of left-padded rows, as ``generate`` counts them: ``cumsum(mask) - 1`` (padding at 0)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def image_token_ids(model: torch.nn.Module) -> list[int]:
    """The placeholder token ids a vision-language model's config names (``image_token_id``, ``video_token_id``,
    ``image_token_index``); ``[]`` for a text model."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    ids = (getattr(config, name, None) for name in ("image_token_id", "video_token_id", "image_token_index"))
    return sorted({int(i) for i in ids if isinstance(i, int)})


def prompt_image_kwargs(model: torch.nn.Module, rows: dict[str, Any], completion_width: int
                        ) -> dict[str, torch.Tensor]:
    """What a forward of ``[left-padded prompt, completion]`` rows adds for their prompts' images: the rows' image
    tensors (``prompt_image_inputs``) and each token-aligned extra (``prompt_<key>``) continued with 0 over the
    ``completion_width`` completion tokens (text). ``{}`` when no row has an image; rows whose prompts hold the
    model's image placeholder tokens without their images are refused (a model would read the placeholders as
    plain tokens, silently)."""
    images = rows.get("prompt_image_inputs")
    if images is None or not any(images.images_per_row):
        placeholders = image_token_ids(model)
        if placeholders and torch.isin(rows["prompt_ids"], torch.tensor(placeholders, device=rows["prompt_ids"].device)
                                       ).any():
            raise ValueError("These prompts hold image placeholder tokens but no images reached the forward that "
                             "scores their completions; a prompt batch with images carries them as "
                             "'prompt_image_inputs' (PromptDataModule with a vision-language model's processor).")
        return {}
    out = dict(images.tensors())
    for key in images.layout.token_keys:
        prompt = rows.get(f"prompt_{key}")
        if prompt is not None:
            out[key] = torch.cat([prompt, prompt.new_zeros(prompt.shape[0], completion_width)], dim=1)
    return out


def computes_own_positions(model: torch.nn.Module) -> bool:
    """Whether the model computes its own multi-axis positions from the image inputs (mRoPE: Qwen2-VL, Qwen2.5-VL,
    Qwen3-VL, whose model has ``get_rope_index``); 1-D positions handed to such a model would be wrong for image
    tokens."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return any(callable(getattr(m, "get_rope_index", None)) for m in (base, getattr(base, "model", None)))


def forward_positions(model: torch.nn.Module, attention_mask: torch.Tensor, images: dict[str, torch.Tensor]
                      ) -> dict[str, torch.Tensor]:
    """The ``position_ids`` a forward of left-padded rows passes: counted from each row's first real token
    (``padded_position_ids``, as the samplers count) when the model takes them, none when the rows carry images
    and the model computes its own positions from them (``computes_own_positions``; it then also counts from
    each row's first attended token)."""
    if not forward_accepts(model, "position_ids") or (images and computes_own_positions(model)):
        return {}
    return {"position_ids": padded_position_ids(attention_mask)}


def completion_logits(model: torch.nn.Module, rows: dict[str, torch.Tensor], through_last: bool = False,
                      ) -> torch.Tensor:
    """The logits ``[B, T, V]`` predicting each completion token of padded ``[left-padded prompt, completion]``
    rows (positions counted from each row's first real token, as the samplers used), a view of the model's output:
    no copy, untempered. ``through_last``: ``[B, T + 1, V]``, the logits at the last completion position too
    (what cross-tokenizer ULD's ``observed`` strategy reads)."""
    t = rows["completion_ids"].shape[1]
    input_ids = torch.cat([rows["prompt_ids"], rows["completion_ids"]], dim=1)
    attention_mask = torch.cat([rows["prompt_mask"], rows["completion_mask"]], dim=1)
    images = prompt_image_kwargs(model, rows, t)
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=t + 1,
                  **images, **forward_positions(model, attention_mask, images))
    logits = model(**inputs).logits
    return logits if through_last else logits[:, :-1]
