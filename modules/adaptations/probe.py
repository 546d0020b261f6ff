"""Whether a batch layout or a generation backend is exact on a model, decided by measuring it.

A *probe* is the user's own model class built from the user's config shrunk in size only
(``shrink.shrink_config``: every field that shapes attention, positions, token mixing or routing kept, token-count
thresholds such as sliding windows, attention chunks and LongRoPE's original context put where the probe's
sequences cross them exactly when the run's can). On it, the layout's per-token log-probs are compared with each
sequence's own plain forward (``probe_layouts``); a generation backend's greedy completions with ``generate`` on
each prompt alone. A layout that raises is not exact either (the error is part of the verdict).

A run that computes in bf16 (``precision: bf16-mixed`` / ``bf16-true``) has its log-prob layouts measured again in
that precision once they are exact in float32 (``probe_precision``: the same probe under the run's autocast, with
a tolerance derived from bf16's own effect on the per-sequence forward).

The verdict is cached on disk (``cache_dir()``), keyed by the model class, the transformers and torch versions, the
layout, the precision it was measured in and the shrunk config with its threshold facts, so a model pays once; ``LIGHTALIGN_CACHE_DIR`` moves the
cache, ``LIGHTALIGN_PROBE_CACHE=0`` turns it off.

Some models compute a sequence differently depending on what else is in its forward, whatever the layout
(Phi-3's LongRoPE picks its rope factors from the longest position of the forward). The probe measures that on
the plain ``padded`` layout too (``Verdict.batch_dependence``); the other layouts are then judged on sequences
that stay under the model's thresholds, and the run is told once how large the effect is and what avoids it.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

import lightalign.modules.adaptations.probe_layouts as pl
from lightalign.modules.adaptations.probe_precision import FLOAT32, measure_in_precision, probe_precision
from lightalign.modules.training.cache_folder import cache_root, read_verdict, write_verdict

PROBE_VERSION = 3  # bump when what the probe measures changes: old verdicts are then not reused
TOLERANCE = 1e-4  # nats per token (float32; bf16: probe_precision.bf16_tolerance)
GENERATION_BACKENDS = ("shared_prefill", "compact", "continuous", "static")
TRAIN_DETERMINISM = "train_determinism"  # not a layout: with disable_dropout, two train-mode forwards agree
# (prompt, chosen, rejected) lengths: long ones crossing the probe's thresholds (shrink.PROBE_THRESHOLD, 12),
# short ones under them (what LongRoPE-like models compute differently when batched with long ones)
LONG = ((14, 18, 9), (5, 4, 3), (22, 12, 20))
SHORT = ((4, 5, 2), (3, 2, 4), (6, 3, 5))
NEW_TOKENS = 24
SHORT_NEW_TOKENS = 5  # short prompts + 5 new tokens stay under the probe's thresholds
# measured in float32 whatever the run's precision (probe_precision's module docstring says why)
NOT_IN_PRECISION = (*GENERATION_BACKENDS, TRAIN_DETERMINISM)


@dataclass(frozen=True)
class Verdict:
    layout: str
    exact: bool
    difference: float  # max |Δ log-prob| (layouts, nats) or the number of differing tokens (backends)
    error: str | None = None  # what the layout raised on the probe, if it did
    batch_dependence: float = 0.0  # the plain padded batch's own difference on sequences crossing the thresholds
    seconds: float = 0.0
    cached: bool = False
    thresholds: dict = field(default_factory=dict)  # shrink_config's facts: each token-count threshold, binds or not
    not_measured: str = ""  # why no measurement could be made (e.g. a GPU-only attention implementation)
    precision: str = FLOAT32  # what the layout was measured in: "32", or the run's "bf16-mixed" / "bf16-true"
    tolerance: float = TOLERANCE  # the largest difference accepted as exact in that precision
    precision_effect: float = 0.0  # bf16: how far bf16 moves the per-sequence forward from float32 on the probe

    def describe(self, with_error: bool = True) -> str:
        if self.error:
            return f"fails on the probe ({self.error})" if with_error else "fails on the probe"
        if self.layout == TRAIN_DETERMINISM:
            return f"logits of two train-mode forwards differ by up to {self.difference:.1e}"
        if self.layout in GENERATION_BACKENDS:
            return f"{int(self.difference)} greedy tokens differ from generate on each prompt alone"
        if self.precision != FLOAT32:
            return (f"log-probs in {self.precision} differ from each sequence's own {self.precision} forward by up to "
                    f"{self.difference:.1e} nats (tolerance {self.tolerance:.1e}: twice the {self.precision_effect:.1e} "
                    f"nats bf16 itself moves that forward from float32, plus {TOLERANCE:.0e})")
        return f"log-probs differ from each sequence's own forward by up to {self.difference:.1e} nats"


def cache_dir() -> Path:
    return cache_root() / "probes"


def _base(model: torch.nn.Module) -> torch.nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _key(model_class: type, config, layout: str, facts: dict, precision: str = FLOAT32) -> str:
    import transformers

    cfg = config.to_dict()
    cfg.pop("transformers_version", None)
    cfg.pop("_name_or_path", None)
    material = {"class": f"{model_class.__module__}.{model_class.__qualname__}", "layout": layout,
                "precision": precision, "transformers": transformers.__version__, "torch": torch.__version__, "probe": PROBE_VERSION,
                "attn": getattr(config, "_attn_implementation", None), "config": cfg, "facts": facts}
    return hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode()).hexdigest()[:32]


def read_cached(name: str) -> dict | None:
    """A verdict file ``<name>.json`` of the probe's cache (None: absent, unreadable, or ``LIGHTALIGN_PROBE_CACHE=0``)."""
    return read_verdict(cache_dir(), name)


def write_cached(name: str, data: dict) -> None:
    """Write a verdict file ``<name>.json`` of the probe's cache atomically."""
    write_verdict(cache_dir(), name, data)


def _read(key: str) -> Verdict | None:
    data = read_cached(key)
    try:
        return None if data is None else Verdict(**{**data, "cached": True})
    except TypeError:  # a verdict of another probe version's fields
        return None


def _write(key: str, verdict: Verdict) -> None:
    write_cached(key, asdict(verdict))


def measure(model: torch.nn.Module, layout: str, max_tokens: int | None = None,
            attn_implementation: str | None = None, precision: object = None) -> Verdict:
    """The verdict for ``layout`` (a batch layout of ``support.LAYOUTS`` or a backend of ``GENERATION_BACKENDS``)
    on ``model``'s class and config (``attn_implementation``: another attention implementation than the model's),
    from the disk cache or measured on a probe. ``precision``: the run's (``trainer.precision``); under bf16 a
    log-prob layout exact in float32 is measured again in bf16 (``probe_precision``), and that verdict returned."""
    from lightalign.modules.adaptations.shrink import shrink_config

    precision = probe_precision(precision) if layout not in NOT_IN_PRECISION else FLOAT32
    fp32 = None
    if precision != FLOAT32:
        fp32 = measure(model, layout, max_tokens, attn_implementation)
        if not fp32.exact:
            return fp32
    base = _base(model)
    # the structure shrink_config builds to count parameters is plain too: under ZeRO-3 it would be partitioned
    # (collectives for each build, on every fit start) and count 0 parameters
    with _plain_construction():
        shrunk, facts = shrink_config(base.config, max_tokens, model_class=type(base))
    if attn_implementation is not None:
        shrunk._attn_implementation = attn_implementation
    key = _key(type(base), shrunk, layout, facts, precision)
    cached = _read(key)
    if cached is not None:
        return cached
    start = time.perf_counter()
    with torch.random.fork_rng(devices=[]), _plain_construction():  # the run's random stream is untouched
        verdict = (_measure(type(base), shrunk, layout) if fp32 is None
                   else _measure_in(type(base), shrunk, layout, precision, fp32))
    verdict = Verdict(**{**asdict(verdict), "seconds": round(time.perf_counter() - start, 3), "thresholds": facts})
    _write(key, verdict)
    return verdict


def _build(model_class: type, shrunk, seed: int = 0, random_norms: bool = False):
    """The probe with weights of unit scale (``N(0, 1/fan_in)`` for every matrix, norms and biases as built): with
    a family's own small initialisation a token mixer that leaks across sequences can move log-probs by less than
    float32's noise; at unit scale a leak moves them by O(1) nats while exact layouts stay within ~1e-6 (measured,
    see docs/performance.md 'Layout probe')."""
    from lightalign.modules.adaptations.shrink import probe_model

    return unit_scale(probe_model(model_class, shrunk, seed=seed), seed, random_norms).eval()


def unit_scale(model: torch.nn.Module, seed: int, random_norms: bool = False) -> torch.nn.Module:
    """Every floating matrix of ``model`` redrawn as ``N(0, 1/fan_in)`` from ``seed`` (in place); with
    ``random_norms`` also the norm weights, as ``N(0, 1)`` (generation probes that otherwise repeat one token)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and p.is_floating_point():
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) / math.sqrt(p.shape[-1]))
            elif random_norms and p.dim() == 1 and "norm" in name.lower() and p.is_floating_point():
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32))
    return model


def _measure(model_class: type, shrunk, layout: str) -> Verdict:
    if layout == TRAIN_DETERMINISM:
        return _measure_determinism(_build(model_class, shrunk))
    reference = None  # generate's greedy completions of ``long``, when already computed
    if layout in GENERATION_BACKENDS:
        probe, long, reference = _diverse_generator(model_class, shrunk)
        if probe is None:
            return Verdict(layout, False, float("inf"), error="its probe's greedy completions repeat one or two tokens "
                           "whatever the seed, so a backend's decoding cannot be shown exact")
    else:
        probe = _build(model_class, shrunk)
        long = pl.probe_sequences(_vocab(probe), LONG, NEW_TOKENS, exclude=_placeholders(probe))
    padded = _run(probe, "padded", long)
    if padded.error or padded.difference <= TOLERANCE:
        return _run_any(probe, layout, long, reference) if layout != "padded" else padded
    # The model's own batching is not exact on sequences crossing its thresholds: every layout (padded included)
    # and backend is judged on sequences under them, and the verdict carries the size of the model's own effect.
    verdict = _run_any(probe, layout, pl.probe_sequences(_vocab(probe), SHORT, SHORT_NEW_TOKENS, seed=1,
                                                       exclude=_placeholders(probe)))
    return Verdict(layout, verdict.exact, verdict.difference, verdict.error, batch_dependence=padded.difference)


def _measure_in(model_class: type, shrunk, layout: str, precision: str, fp32: Verdict) -> Verdict:
    """``layout`` in ``precision`` on the probe and sequences its float32 verdict ``fp32`` was judged on (the short
    ones when the model's own batching depends on length)."""
    probe = _build(model_class, shrunk)
    lengths, new_tokens, seed = (SHORT, SHORT_NEW_TOKENS, 1) if fp32.batch_dependence > 0 else (LONG, NEW_TOKENS, 0)
    seqs = pl.probe_sequences(_vocab(probe), lengths, new_tokens, seed=seed, exclude=_placeholders(probe))
    m = measure_in_precision(probe, layout, seqs, precision, TOLERANCE)
    return Verdict(layout, m.exact, m.difference, m.error, batch_dependence=fp32.batch_dependence,
                   precision=precision, tolerance=m.tolerance, precision_effect=m.effect)


def _run_any(probe, layout: str, seqs: pl.ProbeSequences, reference: list[list[int]] | None = None) -> Verdict:
    if layout in GENERATION_BACKENDS:
        return _measure_backend(probe, layout, seqs, reference)
    return _run(probe, layout, seqs)


def _run(probe, layout: str, seqs: pl.ProbeSequences) -> Verdict:
    causal = pl.is_causal_lm(probe)
    if not causal and layout != "padded":
        return Verdict(layout, False, float("inf"), error="a sequence classifier reads whole padded sequences only")
    try:
        got = pl.layout_logps(layout, probe, seqs) if causal else pl.padded_scores(probe, seqs)
    except Exception as error:  # noqa: BLE001 - any failure of the layout on this model is its verdict
        return Verdict(layout, False, float("inf"), error=f"{type(error).__name__}: {str(error)[:300]}")
    want = pl.alone_logps(layout, probe, seqs) if causal else pl.alone_scores(probe, seqs)
    diff = pl.max_difference(got, want)
    return Verdict(layout, diff <= TOLERANCE, diff)


def _measure_backend(probe, backend: str, seqs: pl.ProbeSequences, want: list[list[int]] | None = None
                     ) -> Verdict:
    """``want``: ``generate``'s greedy completions of ``seqs`` on each prompt alone, if already computed."""
    try:
        want = pl.greedy_alone(probe, seqs) if want is None else want
    except Exception as error:  # noqa: BLE001 - generate itself fails: no backend can be shown exact
        return Verdict(backend, False, float("inf"), error=f"generate itself fails: {type(error).__name__}: "
                       f"{str(error)[:300]}")
    try:
        got = pl.greedy_tokens(probe, backend, seqs)
    except Exception as error:  # noqa: BLE001 - any failure of the backend on this model is its verdict
        return Verdict(backend, False, float("inf"), error=f"{type(error).__name__}: {str(error)[:300]}")
    differing = sum(sum(a != b for a, b in zip(g, w)) + abs(len(g) - len(w)) for g, w in zip(got, want))
    return Verdict(backend, differing == 0, float(differing))


def _measure_determinism(probe) -> Verdict:
    """``disable_dropout`` on the probe (built from the run's config, whose rates it already zeroed), then two
    train-mode forwards of the same tokens: the largest logit difference."""
    from lightalign.modules.training.dropout import disable_dropout_in_model, train_mode_nondeterminism

    disable_dropout_in_model(probe)
    vocab = _vocab(probe)
    ids = torch.tensor([pl.probe_sequences(vocab, LONG, NEW_TOKENS, exclude=_placeholders(probe)).pairs[0][0] * 2])
    try:
        diff = train_mode_nondeterminism(probe, ids)
    except Exception as error:  # noqa: BLE001 - reported as the verdict; the run's own forward will say more
        return Verdict(TRAIN_DETERMINISM, False, float("inf"), error=f"{type(error).__name__}: {str(error)[:300]}")
    return Verdict(TRAIN_DETERMINISM, diff == 0.0, diff)


def _vocab(probe) -> int:
    return int(probe.get_input_embeddings().weight.shape[0])


def _placeholders(probe) -> tuple[int, ...]:
    """The probe's image placeholder ids (none for a text model): never drawn into its text sequences."""
    from lightalign.modules.training.logprobs import image_token_ids

    return tuple(image_token_ids(probe))


def _diverse_generator(model_class: type, shrunk, seeds: int = 8, distinct: int = 3):
    """A probe whose greedy completions are varied enough to show a backend's decode steps: the output head untied
    from the embeddings (tied, at unit scale, greedy decoding tends to repeat the input token, and broken decode
    steps then still agree), the first of ``seeds`` weight draws whose every reference completion has at least
    ``distinct`` different tokens (every other draw with norm weights of random sign and size), with its sequences
    and those reference completions. (None, None, None) if none has."""
    shrunk = copy.deepcopy(shrunk)
    for config in {id(c): c for c in (shrunk, shrunk.get_text_config())}.values():
        if getattr(config, "tie_word_embeddings", False):
            config.tie_word_embeddings = False
    for seed in range(seeds):
        probe = _build(model_class, shrunk, seed=seed // 2, random_norms=bool(seed % 2))
        seqs = pl.probe_sequences(_vocab(probe), LONG, NEW_TOKENS, seed=seed, exclude=_placeholders(probe))
        try:
            reference = pl.greedy_alone(probe, seqs)
        except Exception:  # noqa: BLE001 - measured again (and reported) by _measure_backend
            return probe, seqs, None
        if min(len(set(tokens)) for tokens in reference) >= distinct:
            return probe, seqs, reference
    return None, None, None


@contextlib.contextmanager
def _plain_construction():
    """Build the probe as a plain CPU model even under DeepSpeed ZeRO-3, whose live config makes transformers
    partition (and initialise through DeepSpeed) every model built meanwhile; the run's config is put back after."""
    import transformers.integrations.deepspeed as hf_deepspeed

    saved = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved
