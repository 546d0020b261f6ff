"""The ``compact`` generation backend (modules/sampling/compact.py): finished rows leave the batch and no row's
completion changes for it. Greedy equals ``model.generate(do_sample=False)`` token for token on GPT-2 (learned
positions) and Llama with rows ending at different lengths; each row equals its prompt generated alone; a logits
processor knob changes the tokens as transformers' processor does; models without a plain KV cache are refused.
(The contract tests shared with the other backends live in test_generation_backends.py.)"""

from __future__ import annotations

import pytest
import torch

from helpers.conformance_models import build
from lightalign.modules.sampling.generate import forward_cache_kwarg
from lightalign.modules.sampling.samplers import sample_groups
from lightalign.modules.sampling.compact import compact_groups

# left-padded prompts of 5, 3 and 4 tokens (pad 0)
PROMPTS = torch.tensor([[11, 12, 13, 14, 15], [0, 0, 21, 22, 23], [0, 31, 32, 33, 34]])
MASK = (PROMPTS != 0).long()
NEW = 16
NEVER = 10**6  # an EOS id no model emits: rows run to the budget


def greedy_generate(model, prompts, mask, eos, **kw):
    out = model.generate(input_ids=prompts, attention_mask=mask, do_sample=False, max_new_tokens=NEW,
                         eos_token_id=eos, pad_token_id=0, **kw)
    return out[:, prompts.shape[1]:]


def spread_eos(model):
    """EOS ids at which the prompts' greedy completions end after different numbers of tokens (one row runs to the
    budget): chosen from the completions themselves, so the test does not depend on a random model's EOS logit."""
    free = greedy_generate(model, PROMPTS, MASK, eos=[NEVER])  # no early stop
    for a in free[0, 2:8].tolist():
        for b in free[1, 3:12].tolist():
            ends = []
            for row in free:
                hits = torch.isin(row, torch.tensor([a, b])).nonzero().flatten()
                ends.append(int(hits[0]) + 1 if len(hits) else NEW)
            if len(set(ends)) == 3 and max(ends) == NEW and min(ends) < NEW:
                return [a, b], ends
    return None, [NEW] * len(free)


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def family(request):
    return build(request.param)


def test_greedy_equals_generate_with_rows_ending_at_different_lengths(family):
    eos, ends = spread_eos(family)
    assert eos is not None, "no token pair spreads the greedy completions' lengths"
    ids, _ = compact_groups(family, PROMPTS, MASK, 2, eos_token_ids=eos, pad_token_id=0, max_new_tokens=NEW,
                            temperature=1.0, top_k=1, top_p=1.0, min_p=None)
    reference = greedy_generate(family, PROMPTS, MASK, eos).repeat_interleave(2, 0)
    assert torch.equal(ids, reference)
    assert len(set(ends)) == 3  # rows left the batch at different steps


def test_a_rows_completion_does_not_depend_on_the_others_finishing(family):
    """Each prompt generated alone (nothing ever leaves its batch) gives the rows of the batched run, where the
    other prompts' rows left the batch at other steps."""
    eos, _ = spread_eos(family)
    knobs = dict(eos_token_ids=eos, pad_token_id=0, max_new_tokens=NEW, temperature=1.0, top_k=1, top_p=1.0)
    together, _ = compact_groups(family, PROMPTS, MASK, 2, **knobs)
    for i, (prompt, mask) in enumerate(zip(PROMPTS, MASK)):
        alone, _ = compact_groups(family, prompt[mask.bool()][None], mask[mask.bool()][None], 2, **knobs)
        n = alone.shape[1]
        assert torch.equal(together[2 * i:2 * i + 2, :n], alone), f"prompt {i}"
        assert (together[2 * i:2 * i + 2, n:] == 0).all()


def test_compacting_every_step_or_never_gives_the_same_completions(family):
    """Rows ending at spread lengths give the same tokens and log-probs whether finished rows leave the batch at
    once, at a quarter of the live rows, or never (then they decode padding until the longest ends, as generate
    does). Greedy: sampled draws depend on how many rows are live, so only their distribution is comparable
    (test_generation_backends.py::test_backends_sample_the_same_distribution)."""
    eos, _ = spread_eos(family)
    knobs = dict(eos_token_ids=eos, pad_token_id=0, max_new_tokens=NEW, top_k=1, return_logprobs=True)
    runs = [compact_groups(family, PROMPTS, MASK, 2, compact_fraction=fraction, **knobs)
            for fraction in (0.0, 0.25, 2.0)]
    for ids, logps in runs[1:]:
        assert torch.equal(ids, runs[0][0])
        torch.testing.assert_close(logps, runs[0][1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["llama", "qwen2-sliding", "gpt2"])
@pytest.mark.parametrize("share_prefill", [True, False])
def test_the_in_place_cache_samples_exactly_what_the_growing_one_does(name, share_prefill):
    """Greedy and sampled (the same seed): the cache whose plain layers have room for the completion up front gives
    the very tokens and log-probs of the ``torch.cat`` cache, with rows leaving the batch as soon as they end; a
    sliding-window layer keeps its own cache type."""
    from transformers import DynamicCache

    from lightalign.modules.sampling.compact import grow_in_place

    model = build(name)
    eos, ends = spread_eos(model)
    assert eos is not None and len(set(ends)) == 3  # greedy rows leave the batch at three different steps
    for knobs in (dict(top_k=1), dict(temperature=1.0)):
        runs = []
        for grow in (True, False):
            torch.manual_seed(7)
            runs.append(compact_groups(model, PROMPTS, MASK, 3, eos_token_ids=eos, pad_token_id=0, max_new_tokens=NEW,
                                       share_prefill=share_prefill, grow_cache=grow, return_logprobs=True,
                                       compact_fraction=0.0, **knobs))
        assert torch.equal(runs[0][0], runs[1][0]), knobs
        assert torch.equal(runs[0][1], runs[1][1]), knobs
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=PROMPTS, attention_mask=MASK, use_cache=True, **{forward_cache_kwarg(model): cache})
    plain = sum(type(layer).__name__ == "DynamicLayer" for layer in cache.layers)
    assert grow_in_place(cache, NEW) == plain == (1 if name == "qwen2-sliding" else 2)


@pytest.mark.parametrize("knob", [dict(repetition_penalty=1.5), dict(top_p=0.5, temperature=0.7)])
def test_a_processor_knob_acts_as_transformers_processor(knob):
    """Greedy under a processor knob equals generate's greedy under it, and differs from greedy without it."""
    model = build("llama")
    eos = [NEVER]
    plain, _ = compact_groups(model, PROMPTS, MASK, 1, eos_token_ids=eos, pad_token_id=0, max_new_tokens=NEW,
                              top_k=1)
    # top_k=1 after the knob's processor picks the argmax of the processed logits: do_sample=False under the knob
    ids, _ = compact_groups(model, PROMPTS, MASK, 1, eos_token_ids=eos, pad_token_id=0, max_new_tokens=NEW,
                            top_k=1, **knob)
    if "repetition_penalty" in knob:
        reference = greedy_generate(model, PROMPTS, MASK, eos, **knob)
        assert torch.equal(ids, reference)
        assert not torch.equal(ids, plain)
    else:  # top_p / temperature keep the argmax: greedy unchanged, as transformers' warpers leave it
        assert torch.equal(ids, plain)
        torch.manual_seed(0)
        a, logps = compact_groups(model, PROMPTS, MASK, 4, eos_token_ids=eos, pad_token_id=0, max_new_tokens=NEW,
                                  return_logprobs=True, top_k=0, **knob)
        # top_p 0.5 keeps the smallest set holding half the mass: each chosen token had probability >= what the
        # transformers warper keeps, so every sampled token is in the warped support (finite log-prob)
        assert torch.isfinite(logps).all() and (logps <= 0).all()


def test_top_p_matches_transformers_warper_on_the_same_logits():
    """The processed scores the loop samples from are transformers' TopP(Temperature(logits))."""
    from transformers import TemperatureLogitsWarper, TopPLogitsWarper

    from lightalign.modules.sampling.compact import logits_processors

    model = build("llama")
    torch.manual_seed(0)
    logits = torch.randn(3, 1024) * 3
    ids = PROMPTS
    ours = logits_processors(model, ids.shape[1], [2], 0, temperature=0.7, top_p=0.5, top_k=0, min_p=None,
                             repetition_penalty=1.0)(ids, logits.clone())
    theirs = TopPLogitsWarper(0.5)(ids, TemperatureLogitsWarper(0.7)(ids, logits.clone()))
    assert torch.equal(ours, theirs) and torch.isinf(ours).any()


def test_max_new_tokens_cuts_and_eos_pads(family):
    eos, ends = spread_eos(family)
    ids, logps = compact_groups(family, PROMPTS, MASK, 1, eos_token_ids=eos, pad_token_id=0, max_new_tokens=NEW,
                                top_k=1, return_logprobs=True)
    assert ids.shape == (3, NEW)
    for row, lp, n in zip(ids, logps, ends):
        assert (row[n:] == 0).all() and (lp[n:] == 0).all() and (lp[:n] <= 0).all()
        assert n == NEW or int(row[n - 1]) in eos


# Every other family of the catalogue: tests/adaptations/test_conformance.py::test_generation_verdict_is_the_truth[*-compact]
# (compact is exact there, or refused by measurement and shown not exact).


def test_refuses_a_model_without_a_plain_kv_cache():
    from transformers import AutoConfig, AutoModelForSeq2SeqLM

    config = AutoConfig.for_model("t5", vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2)
    model = AutoModelForSeq2SeqLM.from_config(config)
    with pytest.raises(ValueError, match="'compact' cannot sample from 't5': it is an encoder-decoder model; use "
                                         "generation_backend: generate"):
        compact_groups(model, PROMPTS, MASK, 2, eos_token_ids=[2], pad_token_id=0, max_new_tokens=4, top_k=1)


def test_refuses_several_processes_and_unknown_knobs(monkeypatch):
    import lightalign.modules.sampling.samplers as samplers

    model = build("llama")
    with pytest.raises(ValueError, match="applies only .* got \\['no_repeat_ngram_size'\\]"):
        sample_groups(model, PROMPTS, MASK, 2, backend="compact", eos=[2], pad_token_id=0, max_new_tokens=4,
                      no_repeat_ngram_size=2)
    monkeypatch.setattr(samplers, "several_processes", lambda: True)
    with pytest.raises(ValueError, match="'compact' is not supported with several processes"):
        sample_groups(model, PROMPTS, MASK, 2, backend="compact", eos=[2], pad_token_id=0, max_new_tokens=4)


def test_grpo_module_samples_on_compact(grpo_module, prompt_data, kwargs_spy):
    """generation_backend: compact reaches the loop with the module's sampling knobs (repetition_penalty too)."""
    import lightalign.modules.sampling.compact as compact

    seen = kwargs_spy(compact, "compact_groups")
    data = prompt_data(batch_size=2)
    data.setup("fit")
    module = grpo_module(generation_backend="compact", temperature=0.9, top_p=0.95, repetition_penalty=1.1)
    module.configure_model()
    module.tokenizer = data.tokenizer
    out = module.generate(next(iter(data.train_dataloader())), 4)
    assert out["completion_ids"].shape[0] == 8 and out["completion_ids"].shape[1] <= 6
    assert seen["temperature"] == 0.9 and seen["top_p"] == 0.95 and seen["repetition_penalty"] == 1.1


@pytest.mark.slow
def test_console_fits_on_compact(repo, tmp_path):
    """The user path: a 2-step GRPO fit through the console script sampling on compact (about 25 s)."""
    from test_generation_backends import console

    out = console(repo, tmp_path, "--model.generation_backend", "compact")
    assert "step 2/2" in out and "Traceback" not in out


@pytest.mark.parametrize("knobs, backend", [
    (dict(), "compact"),
    (dict(repetition_penalty=1.1), "compact"),  # compact applies it: no reason to leave the default
    (dict(generation_kwargs={"no_repeat_ngram_size": 2}), "generate"),  # only generate honours it
    (dict(cache_implementation="static", share_prefill=False), "generate"),
])
def test_the_cpu_default_is_compact_unless_only_generate_can_serve(grpo_module, prompt_data, knobs, backend,
                                                                   monkeypatch, recwarn):
    import lightalign.modules.sampling.completions as generation

    seen = {}
    real = generation.sample_groups
    monkeypatch.setattr(generation, "sample_groups", lambda *a, **kw: seen.update(kw) or real(*a, **kw))
    data = prompt_data(batch_size=2)
    data.setup("fit")
    module = grpo_module(**knobs)  # generation_backend unset
    module.configure_model()
    module.tokenizer = data.tokenizer
    module.generate(next(iter(data.train_dataloader())), 4)
    assert seen["backend"] == backend
    assert not [w for w in recwarn if "generation backend" in str(w.message)]


def test_the_default_is_generate_for_a_model_compact_cannot_sample_from(grpo_module, prompt_data, monkeypatch,
                                                                        recwarn):
    """(A recurrent or hybrid-cache model: compact's check refuses it; the default then picks generate, silently,
    while an explicit generation_backend: compact is refused, naming the alternative.)"""
    import lightalign.modules.sampling.completions as generation
    import lightalign.modules.sampling.compact as compact

    def refuse(model):
        raise ValueError("generation_backend 'compact' cannot sample from 'x': it keeps a recurrent state, not a KV "
                         "cache; use generation_backend: generate.")

    monkeypatch.setattr(compact, "check_compact_model", refuse)
    seen = {}
    real = generation.sample_groups
    monkeypatch.setattr(generation, "sample_groups", lambda *a, **kw: seen.update(kw) or real(*a, **kw))
    data = prompt_data(batch_size=2)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    module = grpo_module()
    module.configure_model()
    module.tokenizer = data.tokenizer
    module.generate(batch, 4)
    assert seen["backend"] == "generate" and not [w for w in recwarn if "generation backend" in str(w.message)]
    module = grpo_module(generation_backend="compact")
    module.configure_model()
    module.tokenizer = data.tokenizer
    with pytest.raises(ValueError, match="use generation_backend: generate"):
        module.generate(batch, 4)
