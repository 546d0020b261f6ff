"""The conformance matrix: on every model family of the catalogue, every layout and generation backend is exact or
refused, and the verdict (measured on a shrunk probe, ``adaptations.probe``) agrees with the truth on the model.

For each family (tests/helpers/conformance_models.py: tiny random configs of ~40 families, with sliding windows, chunked
attention, LongRoPE, ALiBi, hybrids with convolutions, Mamba2 and linear-attention layers) and each layout,
``check_layout`` either accepts or refuses it. The test then computes the truth on the family's model itself, on
its own sequences (not the probe's, longer than every window, chunk and rope threshold of the catalogue): an
accepted layout must give each sequence's own log-probs (1e-4), a refused one must not (or raise). Nothing here
lists which family runs which layout: when transformers changes a family, the verdict follows the measurement.

Mutations that fail this file: ``probe._measure`` returning an exact verdict always (every refused cell whose
truth differs: LFM2/granitemoehybrid packed, llama4 chunked, Falcon packed, GPT-Neo shared-prefix ...); returning
a refusal always (every exact cell); the probe ignoring ``max_tokens`` thresholds (windows: mistral-sliding
shared-prefix with eager attention).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from helpers.conformance_models import FAMILIES, build
from lightalign.modules.adaptations import LAYOUTS, LayoutRefused, check_layout
from lightalign.modules.adaptations import probe_layouts as pl
from lightalign.modules.adaptations.probe import unit_scale

TOL = 1e-4
# The test's own (prompt, chosen, rejected) lengths and seed: other sequences than the probe's
LONG = ((9, 13, 7), (4, 3, 5), (15, 6, 11))
SHORT = ((3, 4, 2), (4, 2, 3), (2, 5, 4))
LONGEST = max(p + max(c, r) for p, c, r in LONG)  # the run's max_tokens: a window longer than this never binds
BACKENDS = ("shared_prefill", "compact", "continuous")


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    """(name, plain model, the same weights adapted as lightalign trains them, the adaptation report)."""
    from lightalign.modules.adaptations import adapt_model

    name = request.param
    # every matrix ~ N(0, 1/fan_in), other draws than the probe's: a layout that leaks across sequences moves
    # log-probs by O(1) nats, not by float32 noise (the families' own 0.02-std init can hide a leak under 1e-4)
    plain = unit_scale(build(name), seed=7)
    adapted = copy.deepcopy(plain)
    report = adapt_model(adapted)
    return name, plain, adapted, report


def _truth(layout: str, adapted, plain, lengths) -> float:
    vocab = plain.get_output_embeddings().weight.shape[0]
    seqs = pl.probe_sequences(vocab, lengths, 12, seed=11)
    try:
        got = pl.layout_logps(layout, adapted, seqs)
    except (ValueError, RuntimeError, TypeError, IndexError, AttributeError):
        return math.inf  # e.g. ALiBi with a 4D mask: "too many values to unpack" inside transformers
    return pl.max_difference(got, pl.alone_logps(layout, plain, seqs))


@pytest.mark.parametrize("layout", [x for x in LAYOUTS if x != "shared_prefill"])
def test_layout_verdict_is_the_truth(family, layout):
    name, plain, adapted, _ = family
    try:
        verdict = check_layout(adapted, layout, max_tokens=LONGEST)
    except LayoutRefused as err:
        text = str(err)
        assert type(adapted).__name__ in text and "nats" in text or "fails on the probe" in text, text
        truth = _truth(layout, adapted, plain, LONG)
        assert truth > TOL, f"{name}/{layout} refused, but the model computes it within {truth:.1e}: {text}"
        return
    lengths = SHORT if verdict.batch_dependence > 0 else LONG
    truth = _truth(layout, adapted, plain, lengths)
    assert truth <= TOL, f"{name}/{layout} accepted ({verdict}), but the model is off by {truth:.1e}"
    if verdict.batch_dependence > 0:  # the model's own batching effect is real on sequences crossing its threshold
        assert _truth("padded", adapted, plain, LONG) > TOL, name


@pytest.mark.parametrize("backend", BACKENDS)
def test_generation_verdict_is_the_truth(family, backend):
    """An accepted backend (or the shared prefill) gives ``generate``'s greedy tokens on each prompt alone; a
    refused one does not (or fails)."""
    name, plain, adapted, _ = family
    vocab = plain.get_output_embeddings().weight.shape[0]
    try:
        verdict = check_layout(adapted, backend, max_tokens=LONGEST + 10)
        refused = None
    except LayoutRefused as err:
        verdict, refused = None, err
    long = pl.probe_sequences(vocab, LONG, 10, seed=11)
    seqs = pl.probe_sequences(vocab, SHORT, 4, seed=11) if verdict is not None and verdict.batch_dependence else long
    reference = pl.greedy_alone(plain, seqs)
    try:
        same = pl.greedy_tokens(adapted, backend, seqs) == reference
    except Exception:  # noqa: BLE001 - a backend that fails on this model is not exact on it
        same = False
    if refused is None:
        assert same, f"{name}/{backend} accepted but its greedy tokens differ from generate on each prompt"
    elif same:  # refused, yet equal here: only where these greedy completions are too uniform to show decoding
        degenerate = min(len(set(tokens)) for tokens in reference) < 3
        assert degenerate, f"{name}/{backend} refused but gives generate's varied tokens: {refused}"


def test_mlp_recompute_is_bitwise_where_applied(family):
    """Where recompute_mlp_activation switched an MLP, a training forward+backward is bitwise the plain one."""
    name, plain, adapted, report = family
    if not report.mlps_switched:
        return
    ids = torch.arange(3, 19)[None]
    grads = []
    for model in (plain, adapted):
        model.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for key in grads[0]:
        assert torch.equal(grads[0][key], grads[1][key]), f"{name}: {key}"


def supported_families_table() -> str:
    """docs/model_support.md's table: family x layout, the probe's verdicts on this machine's versions."""
    import transformers

    names = {"padded": "SFT padded", "padding_free": "SFT padding-free", "packed": "SFT packing",
             "dpo_shared": "DPO prompt sharing", "dpo_classic": "DPO padded", "grpo_padded": "GRPO padded",
             "grpo_shared": "GRPO prompt sharing", "grpo_packed": "GRPO padding-free",
             "shared_prefill": "GRPO shared prefill", "compact": "compact", "continuous": "continuous"}
    columns = list(LAYOUTS) + ["compact", "continuous"]
    lines = [f"transformers {transformers.__version__}, torch {torch.__version__}", "",
             "| model (tiny config) | attention | " + " | ".join(names[x] for x in columns) + " |",
             "|---" * (len(columns) + 2) + "|"]
    from lightalign.modules.adaptations import adapt_model

    for name in FAMILIES:
        model = build(name)
        report = adapt_model(model)
        cells = []
        for layout in columns:
            try:
                v = check_layout(model, layout, max_tokens=LONGEST)
                cells.append("exact" + (" (batch-dependent)" if v.batch_dependence else ""))
            except LayoutRefused:
                cells.append("refused")
        lines.append(f"| {name} | {report.attention} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":  # python tests/adaptations/test_conformance.py -> the table of docs/model_support.md
    print(supported_families_table())
