"""How the vision probe runs each batch layout with images in the rows, and its reference: each sequence alone.

The probe's sequences (``image_sequences``) are the user's processor's own rows (chat template, image tokens
expanded, its token-aligned extras and image tensors, ``vision.encode_row``) with 0, 1 and 2 images, then random
completion tokens; their token ids are mapped into the probe's shrunk vocabulary (the config's special ids to the
shrunk config's, other ids into the plain range). Per layout, the per-token log-probs of each sequence:

* ``padded``: one batch, left- or right-padded, rows with 0/1/2 images mixed (``ImageInputs`` builds the image
  tensors), the model computing its own positions (Qwen's 3-D mRoPE positions from the mask);
* ``packed``: every sequence one after the other in one row, its images concatenated in order, positions restarting
  per sequence; each sequence attends alone (``sdpa_varlen`` with ``sequence_sizes``);
* ``shared``: one row of segments ``[prompt, completion 1, completion 2]`` under a 4D mask (completions attend to
  their prompt and themselves), positions of each completion continuing its prompt's;
* ``generate``: greedy tokens of a left-padded batch of prompts with images, and of each prompt alone.

Positions of ``packed`` and ``shared`` rows (``positions``): ``"1d"`` is what lightalign's collators give them
(``arange`` per sequence); ``"model"``, for a model with ``get_rope_index`` (Qwen's mRoPE), the model's own 3-D
positions of each sequence alone, concatenated (for other models the same as ``"1d"``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from lightalign.vision.inputs import ImageInputs, model_inputs
from lightalign.vision.processor import ImageKeyLayout, encode_row

_TOKEN_ID = re.compile(r"_token_(id|index)$")
# (images, question): the probe's rows; their completions are random plain tokens
ROWS = ((1, "Describe the picture."), (0, "What is 1+2?"), (2, "Which of the two is brighter?"))
COMPLETION = (7, 4, 9)


@dataclass(frozen=True)
class ImageSequence:
    """One probe sequence: prompt ids (images expanded), completion ids, token extras, the row's image tensors."""

    prompt: list[int]
    completion: list[int]
    extras: dict[str, list[int]]  # token-aligned extras of the prompt (completion tokens take 0)
    images: dict[str, torch.Tensor]

    @property
    def ids(self) -> list[int]:
        return self.prompt + self.completion

    def extra(self, key: str) -> list[int]:
        return self.extras[key] + [0] * len(self.completion)


def _special_ids(config) -> dict[str, int]:
    out: dict[str, int] = {}

    def walk(d: dict, path: str) -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{path}{k}.")
            elif _TOKEN_ID.search(str(k)) and isinstance(v, int) and not isinstance(v, bool):
                out[path + k] = v
    walk(config.to_dict(), "")
    return out


def token_map(config, shrunk, vocab: int):
    """old id -> probe id: the config's special ids (image token, vision start, ...) to the shrunk config's values,
    every other id into ``[3, low)``, below the moved special ids."""
    old, new = _special_ids(config), _special_ids(shrunk)
    special = {old[k]: new[k] for k in old if k in new}
    low = min([v for v in special.values() if v >= 3] + [vocab])
    span = max(low - 3, 1)
    return lambda i: special.get(i, 3 + i % span if i >= low or i < 3 else i)


def image_sequences(processor, layout: ImageKeyLayout, config, shrunk, vocab: int, seed: int = 0
                    ) -> list[ImageSequence]:
    """The probe's sequences (``ROWS``), processed alone by the user's processor, ids mapped to the probe."""
    import numpy as np
    from PIL import Image

    mapping = token_map(config, shrunk, vocab)
    rng = np.random.RandomState(seed)
    g = torch.Generator().manual_seed(seed)
    low = min([v for v in _special_ids(shrunk).values() if v >= 3] + [vocab])
    out = []
    for (n, question), length in zip(ROWS, COMPLETION):
        content = [{"type": "image"}] * n + [{"type": "text", "text": question}]
        text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                             tokenize=False)
        images = [Image.fromarray(rng.randint(0, 256, (56, 56, 3), dtype=np.uint8)) for _ in range(n)]
        ids, extras, tensors = encode_row(processor, text, images, layout)
        completion = torch.randint(3, max(low, 4), (length,), generator=g).tolist()
        out.append(ImageSequence([mapping(i) for i in ids], completion, extras,
                                 {k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}))
    return out


def _inputs(images: tuple[dict, ...], layout: ImageKeyLayout, extras: dict[str, torch.Tensor]) -> dict:
    """What a lightalign forward adds for these rows (``model_inputs`` of a batch carrying them)."""
    return model_inputs({"image_inputs": ImageInputs(images, layout), **extras})


def _logps(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return logits[:-1].float().log_softmax(-1).gather(-1, ids[1:, None])[:, 0]


def uses_mrope(model: torch.nn.Module) -> bool:
    inner = getattr(model, "model", None)
    return hasattr(inner, "get_rope_index")


def _rope_positions(model, seq: ImageSequence, layout: ImageKeyLayout) -> torch.Tensor:
    """The model's own 3-D positions ``[3, 1, L]`` of ``seq`` alone (``get_rope_index``)."""
    ids = torch.tensor([seq.ids])
    kwargs = {k: torch.tensor([seq.extra(k)]) for k in layout.token_keys}
    images = _inputs((seq.images,), layout, {})
    token_types = kwargs.get("mm_token_type_ids")
    positions, _ = model.model.get_rope_index(ids, token_types, image_grid_thw=images.get("image_grid_thw"),
                                              attention_mask=torch.ones_like(ids))
    return positions


@torch.no_grad()
def alone(model, seqs: list[ImageSequence], layout: ImageKeyLayout) -> list[torch.Tensor]:
    """Each sequence's log-probs in its own unpadded forward (every token after the first)."""
    out = []
    for s in seqs:
        ids = torch.tensor([s.ids])
        kwargs = {k: torch.tensor([s.extra(k)]) for k in layout.token_keys}
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False,
                       **_inputs((s.images,), layout, kwargs)).logits[0]
        out.append(_logps(logits, ids[0]))
    return out


@torch.no_grad()
def padded(model, seqs: list[ImageSequence], layout: ImageKeyLayout, side: str, pad: int = 0
           ) -> list[torch.Tensor]:
    width = max(len(s.ids) for s in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    extras = {k: torch.zeros_like(ids) for k in layout.token_keys}
    spans = []
    for r, s in enumerate(seqs):
        n = len(s.ids)
        span = slice(width - n, width) if side == "left" else slice(0, n)
        ids[r, span], mask[r, span] = torch.tensor(s.ids), 1
        for k in extras:
            extras[k][r, span] = torch.tensor(s.extra(k))
        spans.append(span)
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False,
                   **_inputs(tuple(s.images for s in seqs), layout, extras)).logits
    return [_logps(logits[r, span], ids[r, span]) for r, span in enumerate(spans)]


def _merged_images(seqs: list[ImageSequence], layout: ImageKeyLayout) -> dict[str, torch.Tensor]:
    """One row holding every sequence's images in order (per-image keys on dim 0, per-row keys on dim 1)."""
    rows = [s.images for s in seqs if s.images]
    if not rows:
        return {}
    merged: dict[str, torch.Tensor] = {}
    for keys, dim in ((layout.image_keys, 0), (layout.row_keys, 1)):
        for k in keys:
            parts = [r[k] for r in rows if k in r]
            if parts:
                merged[k] = torch.cat(parts, dim)
    return merged


@torch.no_grad()
def packed(model, seqs: list[ImageSequence], layout: ImageKeyLayout, positions: str = "1d") -> list[torch.Tensor]:
    from lightalign.modules.adaptations.attention import use_varlen_sdpa

    use_varlen_sdpa(model)
    ids = torch.tensor([sum((s.ids for s in seqs), [])])
    extras = {k: torch.tensor([sum((s.extra(k) for s in seqs), [])]) for k in layout.token_keys}
    if positions == "model" and uses_mrope(model):
        position_ids = torch.cat([_rope_positions(model, s, layout) for s in seqs], dim=-1)
    else:
        position_ids = torch.cat([torch.arange(len(s.ids)) for s in seqs])[None]
    sizes = [len(s.ids) for s in seqs]
    logits = model(input_ids=ids, position_ids=position_ids, sequence_sizes=sizes, use_cache=False,
                   **_inputs((_merged_images(seqs, layout),), layout, extras)).logits[0]
    out, start = [], 0
    for n in sizes:
        out.append(_logps(logits[start: start + n], ids[0, start: start + n]))
        start += n
    return out


def shared_sequences(seqs: list[ImageSequence]) -> list[tuple[ImageSequence, ImageSequence]]:
    """Per prompt with images, two completions: its own and the next sequence's (the shared layout's groups)."""
    with_images = [s for s in seqs if s.images]
    others = [s.completion for s in seqs[1:] + seqs[:1]]
    return [(s, ImageSequence(s.prompt, c, s.extras, s.images)) for s, c in zip(with_images, others)
            if s.completion != c]


@torch.no_grad()
def shared(model, seqs: list[ImageSequence], layout: ImageKeyLayout, positions: str = "1d") -> list[torch.Tensor]:
    """Completion log-probs of ``shared_sequences`` in one row of ``[prompt, completion 1, completion 2]``
    segments under a 4D mask."""
    groups = shared_sequences(seqs)
    ids, extras, position_ids, pieces = [], {k: [] for k in layout.token_keys}, [], []
    mrope = positions == "model" and uses_mrope(model)
    start = 0
    for a, b in groups:
        p = len(a.prompt)
        rope = [_rope_positions(model, s, layout) if mrope else torch.arange(len(s.ids))[None] for s in (a, b)]
        ids += a.prompt + a.completion + b.completion
        for k in extras:
            extras[k] += a.extra(k) + [0] * len(b.completion)
        position_ids += [rope[0][..., :p], rope[0][..., p:], rope[1][..., p:]]
        pieces.append((start, p, len(a.completion), len(b.completion)))
        start += p + len(a.completion) + len(b.completion)
    total = len(ids)
    allowed = torch.zeros(total, total, dtype=torch.bool)
    causal = lambda n: torch.ones(n, n, dtype=torch.bool).tril()  # noqa: E731
    for s, p, c1, c2 in pieces:
        allowed[s: s + p, s: s + p] = causal(p)
        for off, c in ((p, c1), (p + c1, c2)):
            allowed[s + off: s + off + c, s: s + p] = True
            allowed[s + off: s + off + c, s + off: s + off + c] = causal(c)
    ids_t = torch.tensor([ids])
    logits = model(input_ids=ids_t, attention_mask=allowed[None, None], position_ids=torch.cat(position_ids, -1),
                   use_cache=False, **_inputs((_merged_images([a for a, _ in groups], layout),), layout,
                                              {k: torch.tensor([v]) for k, v in extras.items()})).logits[0]
    out, lp = [], logits.float().log_softmax(-1)
    for s, p, c1, c2 in pieces:
        for first, c in ((p, c1), (p + c1, c2)):
            # the completion's first token is predicted from the prompt's last, the others from the completion
            rows = [s + p - 1] + list(range(s + first, s + first + c - 1))
            targets = ids_t[0, s + first: s + first + c]
            out.append(lp[rows].gather(-1, targets[:, None])[:, 0])
    return out


def shared_alone(model, seqs: list[ImageSequence], layout: ImageKeyLayout) -> list[torch.Tensor]:
    out = []
    for a, b in shared_sequences(seqs):
        for s in (a, b):
            out.append(alone(model, [s], layout)[0][len(s.prompt) - 1:])
    return out


def _generate(model, seqs: list[ImageSequence], layout: ImageKeyLayout, new_tokens: int) -> list[list[int]]:
    width = max(len(s.prompt) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    extras = {k: torch.zeros_like(ids) for k in layout.token_keys}
    for r, s in enumerate(seqs):
        ids[r, width - len(s.prompt):], mask[r, width - len(s.prompt):] = torch.tensor(s.prompt), 1
        for k in extras:
            extras[k][r, width - len(s.prompt):] = torch.tensor(s.extras[k])
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, pad_token_id=0, use_cache=True,
                         **_inputs(tuple(s.images for s in seqs), layout, extras))
    return out[:, width:].tolist()


@torch.no_grad()
def greedy_batched(model, seqs: list[ImageSequence], layout: ImageKeyLayout, new_tokens: int) -> list[list[int]]:
    """``generate``'s greedy tokens for the prompts in one left-padded batch."""
    return _generate(model, seqs, layout, new_tokens)


@torch.no_grad()
def greedy_alone(model, seqs: list[ImageSequence], layout: ImageKeyLayout, new_tokens: int) -> list[list[int]]:
    return [_generate(model, [s], layout, new_tokens)[0] for s in seqs]
