"""How the probe runs each batch layout, and its reference: every sequence alone through a plain forward.

``layout_logps`` lays given sequences out exactly as lightalign's training code does (the same collators and
forward functions: ``PaddingCollator``, ``PaddingFreeCollator``, ``SharedPromptCollator``, ``PreferenceCollator``,
``sft_logits``, ``completion_token_logps``, ``grpo_token_logps``) and returns the per-token log-probs it trains
on, one tensor per sequence. ``alone_logps`` is the same tokens, one unpadded sequence per forward.
``greedy_tokens`` does the same for generation: a backend's greedy completions, and ``generate`` on each prompt
alone. The probe (``measure``) compares the two on a shrunk copy of the user's model; the conformance tests run the
same functions on their catalogue of models.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Pair = tuple[list[int], list[int]]


@dataclass(frozen=True)
class ProbeSequences:
    """Token ids of the probe: ``pairs`` (prompt, completion), one ``rejected`` completion per pair, and two
    generation ``prompts`` (of different lengths, so one is left-padded)."""

    pairs: tuple[Pair, ...]
    rejected: tuple[list[int], ...]
    prompts: tuple[list[int], ...]
    new_tokens: int


def probe_sequences(vocab_size: int, lengths: tuple[tuple[int, int, int], ...], new_tokens: int,
                    seed: int = 0, exclude: tuple[int, ...] = ()) -> ProbeSequences:
    """Random token ids (never 0-2: pad/bos/eos of the probe) for ``lengths`` = (prompt, chosen, rejected) sizes;
    an id in ``exclude`` (a vision-language model's image placeholders: text layouts are measured on text) is
    drawn as 3 instead."""
    g = torch.Generator().manual_seed(seed)
    high = max(vocab_size, 4)

    def ids(n: int) -> list[int]:
        return [3 if i in exclude else i for i in torch.randint(3, high, (n,), generator=g).tolist()]

    pairs = tuple((ids(p), ids(c)) for p, c, _ in lengths)
    rejected = tuple(ids(r) for _, _, r in lengths)
    prompts = (pairs[0][0], pairs[-1][0])
    return ProbeSequences(pairs, rejected, prompts, new_tokens)


def _sft_rows(seqs: ProbeSequences) -> list[dict]:
    return [{"input_ids": p + c, "completion_mask": [0] * len(p) + [1] * len(c)} for p, c in seqs.pairs]


def _grpo_micro_batch(seqs: ProbeSequences) -> dict[str, torch.Tensor]:
    """Left-padded prompts (as PromptCollator makes them), each with two completions (chosen, rejected),
    right-padded."""
    prompts = [p for p, _ in seqs.pairs for _ in range(2)]
    completions = [x for (_, c), r in zip(seqs.pairs, seqs.rejected) for x in (c, r)]
    width_p, width_c = max(map(len, prompts)), max(map(len, completions))
    mb = {"prompt_ids": torch.zeros(len(prompts), width_p, dtype=torch.long),
          "prompt_mask": torch.zeros(len(prompts), width_p, dtype=torch.long),
          "completion_ids": torch.zeros(len(prompts), width_c, dtype=torch.long),
          "completion_mask": torch.zeros(len(prompts), width_c, dtype=torch.long)}
    for i, (p, c) in enumerate(zip(prompts, completions)):
        mb["prompt_ids"][i, width_p - len(p):] = torch.tensor(p)
        mb["prompt_mask"][i, width_p - len(p):] = 1
        mb["completion_ids"][i, : len(c)] = torch.tensor(c)
        mb["completion_mask"][i, : len(c)] = 1
    return mb


@torch.no_grad()
def layout_logps(layout: str, model: torch.nn.Module, seqs: ProbeSequences) -> list[torch.Tensor]:
    """Per-token log-probs of every completion token (SFT layouts: every token after the first) the way
    lightalign's ``layout`` computes them, one tensor per sequence (the order of ``alone_logps``)."""
    from lightalign.datamodules.collators import PaddingCollator, PaddingFreeCollator
    from lightalign.datamodules.preference import PreferenceCollator
    from lightalign.datamodules.shared_prefix import SharedPromptCollator
    from lightalign.modules.training.preference_forward import completion_token_logps
    from lightalign.modules.adaptations.layouts import packed_completion_batch, prompt_group_batch
    from lightalign.modules.training.rollout_forward import grpo_token_logps
    from lightalign.modules.training.sft_forward import sft_logits

    if layout in ("padded", "padding_free", "packed"):
        rows = _sft_rows(seqs)
        if layout == "packed":  # the first two sequences share a bin, as SFTDataModule(packing=True) bins them
            rows = [{"input_ids": rows[0]["input_ids"] + rows[1]["input_ids"],
                     "seq_lengths": [len(rows[0]["input_ids"]), len(rows[1]["input_ids"])]}] + rows[2:]
        batch = (PaddingCollator(0) if layout == "padded" else PaddingFreeCollator())(rows)
        logits = sft_logits(model, batch).float()
        logps = logits[:, :-1].log_softmax(-1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
        lengths = [len(p) + len(c) for p, c in seqs.pairs]
        if layout == "padded":
            return [logps[i, : n - 1] for i, n in enumerate(lengths)]
        out, start = [], 0
        for n in lengths:
            out.append(logps[0, start: start + n - 1])
            start += n
        return out
    if layout in ("dpo_shared", "dpo_classic"):
        pairs = [{"prompt_input_ids": p, "chosen_input_ids": c, "rejected_input_ids": r}
                 for (p, c), r in zip(seqs.pairs, seqs.rejected)]
        width = max(len(p) + len(c) + len(r) for (p, c), r in zip(seqs.pairs, seqs.rejected))
        collate = SharedPromptCollator(0, pack_length=width + 8) if layout == "dpo_shared" else PreferenceCollator(0)
        logps, mask = completion_token_logps(model, collate(pairs))
        return [row[m.bool()].float() for row, m in zip(logps, mask)]
    if layout in ("grpo_padded", "grpo_shared", "grpo_packed"):
        mb = _grpo_micro_batch(seqs)
        if layout == "grpo_shared":
            width = max(len(p) + len(c) + len(r) for (p, c), r in zip(seqs.pairs, seqs.rejected))
            mb["shared"] = prompt_group_batch(mb, pad_token_id=0, pack_length=width + 8)
        if layout == "grpo_packed":
            mb["packed"] = packed_completion_batch(mb)
        logps = grpo_token_logps(model, mb)
        return [row[m.bool()].float() for row, m in zip(logps, mb["completion_mask"])]
    raise ValueError(f"No probe for layout {layout!r}.")


def is_causal_lm(model: torch.nn.Module) -> bool:
    """A model with a language-model head (log-probs per token); otherwise a sequence classifier (a score per
    sequence, read at its last token: reward and value models)."""
    return model.get_output_embeddings() is not None


@torch.no_grad()
def padded_scores(model: torch.nn.Module, seqs: ProbeSequences) -> list[torch.Tensor]:
    """A sequence classifier's scores of every ``prompt + chosen`` in one right-padded batch (``PreferenceCollator``'s
    rows, as ``RewardModule`` reads them)."""
    rows = [p + c for p, c in seqs.pairs]
    width = max(map(len, rows))
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
    return list(model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float())


@torch.no_grad()
def alone_scores(model: torch.nn.Module, seqs: ProbeSequences) -> list[torch.Tensor]:
    return [model(input_ids=torch.tensor([p + c]), use_cache=False).logits[0].float() for p, c in seqs.pairs]


@torch.no_grad()
def _alone(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    logits = model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]


def alone_logps(layout: str, model: torch.nn.Module, seqs: ProbeSequences) -> list[torch.Tensor]:
    """The reference of ``layout_logps``: each sequence in its own unpadded forward."""
    if layout in ("padded", "padding_free", "packed"):
        return [_alone(model, p + c) for p, c in seqs.pairs]
    if layout in ("dpo_shared", "dpo_classic"):
        pairs = list(seqs.pairs) + [(p, r) for (p, _), r in zip(seqs.pairs, seqs.rejected)]
    else:
        pairs = [(p, x) for (p, c), r in zip(seqs.pairs, seqs.rejected) for x in (c, r)]
    return [_alone(model, p + c)[len(p) - 1:] for p, c in pairs]


def max_difference(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """The largest |Δ log-prob| over every token of every sequence (inf if the shapes disagree)."""
    if len(got) != len(want) or any(g.shape != w.shape for g, w in zip(got, want)):
        return float("inf")
    return max(((g - w).abs().max().item() for g, w in zip(got, want)), default=0.0)


@torch.no_grad()
def greedy_tokens(model: torch.nn.Module, backend: str, seqs: ProbeSequences, share_prefill: bool = True
                  ) -> list[list[int]]:
    """Greedy completions of ``seqs.prompts`` (two per prompt, rows grouped by prompt) on ``backend``
    (``samplers.sample_groups``; ``shared_prefill``: ``generate`` with the shared prompt prefill), each cut
    after its first EOS."""
    from lightalign.modules.sampling.samplers import sample_groups

    width = max(map(len, seqs.prompts))
    ids = torch.zeros(len(seqs.prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(seqs.prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
    name = "generate" if backend == "shared_prefill" else backend
    new, _, _ = sample_groups(model, ids, mask, 2, backend=name, eos=[2], pad_token_id=0, max_new_tokens=seqs.new_tokens,
                           share_prefill=share_prefill or backend == "shared_prefill", top_k=1)
    return [_until_eos(row.tolist()) for row in new]


@torch.no_grad()
def greedy_alone(model: torch.nn.Module, seqs: ProbeSequences) -> list[list[int]]:
    """The reference of ``greedy_tokens``: ``generate`` on each prompt alone (no padding, no shared cache)."""
    out = []
    for p in seqs.prompts:
        new = model.generate(input_ids=torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                             do_sample=False, max_new_tokens=seqs.new_tokens, eos_token_id=[2], pad_token_id=0,
                             use_cache=True)[0, len(p):].tolist()
        out += [_until_eos(new)] * 2
    return out


def _until_eos(tokens: list[int]) -> list[int]:
    return tokens[: tokens.index(2) + 1] if 2 in tokens else tokens
