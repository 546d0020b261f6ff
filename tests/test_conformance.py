"""The conformance matrix: every model family x every batch layout lightalign has is exact or refused.

For each family (tests/conformance_models.py: tiny random configs, sliding-window and ALiBi variants) and each
layout, the per-token log-probs lightalign trains on equal a plain Hugging Face forward of each sequence alone
(1e-4), or ``check_layout`` refuses the layout with an error naming the family, the knob and the alternative.
The verdicts are pinned in ``EXPECTED_REFUSED``: a refusal that is not needed fails here, and so does a layout
that is accepted but not exact. This matrix is what the README's supported-families table says.
"""

from __future__ import annotations

import copy

import pytest
import torch

from conformance_models import FAMILIES, VOCAB, build
from lightalign.modules.adaptations import LAYOUTS, LayoutRefused, check_layout

TOL = 1e-4
# (prompt, completion) token ids; prompts and completions of several lengths, all longer than the test window
PAIRS = [
    ([5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17]),
    ([20, 21, 22, 23], [24, 25, 26, 27, 28, 29, 30, 31, 32]),
    ([40, 41, 42, 43, 44, 45, 46, 47, 48], [49, 50, 51]),
]
REJECTED = [[60, 61, 62, 63, 64, 65, 66, 67], [70, 71], [80, 81, 82, 83, 84, 85, 86]]

ALIBI = {"bloom", "falcon-alibi"}
# Packed rows need positions from position_ids and attention that never crosses a sequence: ALiBi takes its
# positions from the 2D mask, and Falcon builds its mask without position_ids (and its own attention call).
PACKING_REFUSED = ALIBI | {"falcon", "opt-eager"}  # OPT's own mask ignores position_ids (sdpa_varlen does not)
EXPECTED_REFUSED = (
    {(f, "padding_free") for f in PACKING_REFUSED}
    | {(f, "packed") for f in PACKING_REFUSED}
    | {(f, "grpo_packed") for f in PACKING_REFUSED}
    | {(f, layout) for f in ALIBI for layout in ("dpo_shared", "grpo_shared")}
    # eager-only Gemma2 with a window shorter than the sequences: the shared-prefix mask cannot hold the window
    | {("gemma2-sliding", "dpo_shared"), ("gemma2-sliding", "grpo_shared")}
)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    """(name, plain model, the same weights adapted as lightalign trains them)."""
    name = request.param
    plain = build(name)
    from lightalign.modules.adaptations import adapt_model

    adapted = copy.deepcopy(plain)
    report = adapt_model(adapted)
    return name, plain, adapted, report


def _alone(plain, tokens: list[int]) -> torch.Tensor:
    """Per-token log-probs of ``tokens[1:]`` from one unpadded sequence, the reference of every cell."""
    with torch.no_grad():
        logits = plain(input_ids=torch.tensor([tokens])).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]


def _sft_rows():
    return [{"input_ids": p + c, "completion_mask": [0] * len(p) + [1] * len(c)} for p, c in PAIRS]


def layout_logps(layout: str, model, rows=None) -> list[torch.Tensor]:
    """Per-token log-probs of every completion token (for SFT: every token after the first) the way lightalign's
    ``layout`` computes them, one tensor per sequence."""
    from lightalign.datamodules.collators import PaddingCollator, PaddingFreeCollator
    from lightalign.datamodules.preference import PreferenceCollator
    from lightalign.datamodules.shared_prefix import SharedPromptCollator
    from lightalign.modules.dpo import completion_token_logps
    from lightalign.modules.layouts import grpo_token_logps, packed_completion_batch, prompt_group_batch, sft_logits

    with torch.no_grad():
        if layout in ("padded", "padding_free", "packed"):
            rows = _sft_rows()
            if layout == "packed":  # two bins of packed sequences, as SFTDataModule(packing=True) makes them
                rows = [{"input_ids": rows[0]["input_ids"] + rows[1]["input_ids"],
                         "seq_lengths": [len(rows[0]["input_ids"]), len(rows[1]["input_ids"])]}, rows[2]]
            collate = PaddingCollator(0) if layout == "padded" else PaddingFreeCollator()
            batch = collate(rows)
            logits = sft_logits(model, batch).float()
            logps = logits[:, :-1].log_softmax(-1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
            if layout == "padded":
                return [logps[i, : len(p) + len(c) - 1] for i, (p, c) in enumerate(PAIRS)]
            out, start = [], 0
            for p, c in PAIRS:
                n = len(p) + len(c)
                out.append(logps[0, start : start + n - 1])
                start += n
            return out
        if layout in ("dpo_shared", "dpo_classic"):
            pairs = [{"prompt_input_ids": p, "chosen_input_ids": c, "rejected_input_ids": r}
                     for (p, c), r in zip(PAIRS, REJECTED)]
            collate = SharedPromptCollator(0, pack_length=24) if layout == "dpo_shared" else PreferenceCollator(0)
            batch = collate(pairs)
            logps, mask = completion_token_logps(model, batch)
            return [row[m.bool()] for row, m in zip(logps, mask)]
        if layout in ("grpo_padded", "grpo_shared", "grpo_packed"):
            mb = _grpo_micro_batch()
            if layout == "grpo_shared":
                mb["shared"] = prompt_group_batch(mb, pad_token_id=0, pack_length=32)
            if layout == "grpo_packed":
                mb["packed"] = packed_completion_batch(mb)
            logps = grpo_token_logps(model, mb)
            return [row[m.bool()] for row, m in zip(logps, mb["completion_mask"])]
    raise ValueError(layout)


def _grpo_micro_batch() -> dict[str, torch.Tensor]:
    """Left-padded prompts (as PromptCollator makes them), each prompt with two completions, right-padded."""
    prompts = [p for p, _ in PAIRS for _ in range(2)]
    completions = [x for (_, c), r in zip(PAIRS, REJECTED) for x in (c, r)]
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


def reference_logps(layout: str, plain) -> list[torch.Tensor]:
    if layout in ("padded", "padding_free", "packed"):
        return [_alone(plain, p + c) for p, c in PAIRS]
    if layout in ("dpo_shared", "dpo_classic"):
        seqs = [(p, c) for p, c in PAIRS] + [(p, r) for (p, _), r in zip(PAIRS, REJECTED)]
    else:
        seqs = [(p, x) for (p, c), r in zip(PAIRS, REJECTED) for x in (c, r)]
    return [_alone(plain, p + c)[len(p) - 1:] for p, c in seqs]


@pytest.mark.parametrize("layout", [x for x in LAYOUTS if x != "shared_prefill"])
def test_layout_is_exact_or_refused(family, layout):
    name, plain, adapted, _ = family
    try:
        check_layout(adapted, layout, max_tokens=32)
    except LayoutRefused as err:
        assert (name, layout) in EXPECTED_REFUSED, f"{name}/{layout} refused but exact: {err}"
        text = str(err)
        assert type(adapted).__name__ in text or adapted.config.model_type in text
        assert any(k in text for k in ("prompt_sharing", "packing", "padding_free"))
        return
    assert (name, layout) not in EXPECTED_REFUSED, f"{name}/{layout} accepted; the matrix expects a refusal"
    got, want = layout_logps(layout, adapted), reference_logps(layout, plain)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, (name, layout, i)
        err = (g - w).abs().max().item()
        assert err < TOL, f"{name}/{layout}: sequence {i} off by {err:.2e}"


def test_shared_prefill_generates_what_generate_does(family):
    from lightalign.modules.generation import generate_groups

    name, plain, adapted, _ = family
    prompt_ids = torch.tensor([[0, 0, 5, 6, 7, 8, 9], [20, 21, 22, 23, 24, 25, 26]])
    prompt_mask = (prompt_ids != 0).long()
    kwargs = dict(do_sample=True, top_k=1, max_new_tokens=6, pad_token_id=0, eos_token_id=VOCAB - 1)  # greedy
    try:
        check_layout(adapted, "shared_prefill")
    except LayoutRefused:
        pytest.fail(f"{name}: share_prefill refused")
    got = generate_groups(adapted, prompt_ids, prompt_mask, 2, share_prefill=True, **kwargs)
    want = plain.generate(input_ids=prompt_ids, attention_mask=prompt_mask, num_return_sequences=2, **kwargs)
    assert torch.equal(got, want), name


def test_mlp_recompute_is_bitwise_where_applied(family):
    """Where recompute_mlp_activation switched an MLP, a training forward+backward is bitwise the plain one."""
    name, plain, adapted, report = family
    switched, total = report.mlps_switched, report.mlps_total
    if not switched:
        return
    ids = torch.tensor([PAIRS[0][0] + PAIRS[0][1]])
    grads = []
    for model in (plain, adapted):
        model.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for key in grads[0]:
        assert torch.equal(grads[0][key], grads[1][key]), f"{name}: {key}"


@pytest.mark.parametrize("layout", ["padding_free", "dpo_shared", "grpo_shared", "grpo_packed"])
def test_every_refusal_is_needed(family, layout):
    """A refused cell computed anyway is wrong (or fails inside transformers): no refusal is over-cautious."""
    name, plain, adapted, _ = family
    if (name, layout) not in EXPECTED_REFUSED:
        return
    try:
        got = layout_logps(layout, adapted)
    except (ValueError, RuntimeError, TypeError, IndexError):
        return  # e.g. ALiBi with a 4D mask: "too many values to unpack" from inside transformers
    want = reference_logps(layout, plain)
    worst = max((g - w).abs().max().item() for g, w in zip(got, want))
    assert worst > 1e-3, f"{name}/{layout} is refused but computes within {worst:.1e}"


def supported_families_table() -> str:
    """The README's table: family x layout, from ``check_layout``'s verdicts that this file holds to."""
    names = {"padded": "SFT padded", "padding_free": "SFT padding-free", "packed": "SFT packing",
             "dpo_shared": "DPO prompt sharing", "dpo_classic": "DPO padded", "grpo_padded": "GRPO padded",
             "grpo_shared": "GRPO prompt sharing", "grpo_packed": "GRPO padding-free",
             "shared_prefill": "GRPO shared prefill"}
    lines = ["| model (tiny config) | attention | " + " | ".join(names[x] for x in LAYOUTS) + " |",
             "|---" * (len(LAYOUTS) + 2) + "|"]
    from lightalign.modules.adaptations import adapt_model

    for name in FAMILIES:
        model = build(name)
        report = adapt_model(model)
        cells = []
        for layout in LAYOUTS:
            try:
                check_layout(model, layout, max_tokens=32)
                cells.append("exact")
            except LayoutRefused:
                cells.append("refused")
        lines.append(f"| {name} | {report.attention} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def test_readme_table_is_the_matrix(repo):
    assert supported_families_table() in (repo / "README.md").read_text(), (
        "README's supported-families table differs from the matrix: regenerate it with "
        "`python tests/test_conformance.py`")


if __name__ == "__main__":  # python tests/test_conformance.py -> the README table
    print(supported_families_table())
