"""Whether a batch layout or a generation backend is exact on a vision-language model with images in the rows,
decided by measuring it (``check_vision_layout``; the text-only probe is ``probe.measure``).

The probe is the user's model class on the user's config shrunk in size only, vision tower included
(``shrink.shrink_config``), weights at unit scale (``probe.unit_scale``), fed the user's own processor's rows with
0, 1 and 2 images (``vision_layouts``). Each layout's per-token log-probs are compared with each sequence's own
forward; ``generate`` on a left-padded batch of image prompts with each prompt alone. First the probe shows that its
images reach its logits (``image_effect``: dropping them moves the log-probs by O(1) nats); where they do not, no
layout can be shown to keep images with their rows, and every layout is refused. Packed and shared rows are measured
with the 1-D positions lightalign's collators give them; for an mRoPE model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) also
with the model's own 3-D positions of each sequence (``model_positions_difference``), what such a layout would have
to pass to be exact. The sampling backends other than
``generate`` (and the shared prefill) take token ids and masks only, so the image tensors never reach the model:
refused without building a probe.

Each layout lightalign has maps to one measurement (``KINDS``): the padded layouts (SFT, DPO, GRPO) to ``padded``,
the padding-free and packed ones to ``packed``, DPO's ``prompt_sharing`` and GRPO's shared-prefix rows to
``shared``. Verdicts are cached on disk next to the text probe's (``probe.cache_dir``), keyed by the model class,
the versions, the shrunk config and the processor's settings.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from lightalign.modules.adaptations.probe import (GENERATION_BACKENDS, TOLERANCE, _base, _key, _plain_construction,
                                                  read_cached, unit_scale, write_cached)
from lightalign.modules.adaptations.support import _KNOBS, LAYOUTS, LayoutRefused

VISION_PROBE_VERSION = 2
KINDS = {"padded": "padded", "dpo_classic": "padded", "grpo_padded": "padded",
         "padding_free": "packed", "packed": "packed", "grpo_packed": "packed",
         "dpo_shared": "shared", "grpo_shared": "shared", "generate": "generate",
         **{backend: "backend" for backend in GENERATION_BACKENDS}}
MIN_IMAGE_EFFECT = 1e-2  # nats: at unit scale, dropping the images moves the probe's log-probs by O(1)
NEW_TOKENS = 6


@dataclass(frozen=True)
class VisionVerdict:
    layout: str
    exact: bool
    difference: float  # max |Δ log-prob| (nats), or the number of differing greedy tokens (generate)
    error: str | None = None
    image_effect: float = 0.0  # max |Δ log-prob| when the images are dropped from the probe's forwards
    # packed / shared rows of an mRoPE model: the difference with the model's own 3-D positions per sequence instead
    # of the 1-D positions lightalign's collators give (None: not an mRoPE model, or another layout)
    model_positions_difference: float | None = None
    seconds: float = 0.0
    cached: bool = False

    def describe(self) -> str:
        if self.error:
            return f"is not exact ({self.error})"
        if KINDS[self.layout] == "generate":
            return f"gives {int(self.difference)} greedy tokens that differ from generate on each prompt alone"
        text = f"gives log-probs that differ from each sequence's own forward by up to {self.difference:.1e} nats"
        if self.model_positions_difference is not None and not self.exact:
            text += (f" with the 1-D position_ids lightalign gives its sequences (with the model's own multimodal "
                     f"positions of each sequence, get_rope_index, {self.model_positions_difference:.1e} nats)")
        return text


def _fingerprint(processor) -> str:
    parts = {"image_processor": getattr(getattr(processor, "image_processor", None), "to_dict", dict)(),
             "template": getattr(processor, "chat_template", None), "class": type(processor).__name__}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _read(key: str) -> VisionVerdict | None:
    data = read_cached(f"vision-{key}")
    try:
        return None if data is None else VisionVerdict(**{**data, "cached": True})
    except TypeError:  # a verdict of another probe version's fields
        return None


def _write(key: str, verdict: VisionVerdict) -> None:
    write_cached(f"vision-{key}", asdict(verdict))


def sampler_takes_images(backend: str) -> bool:
    """Whether the backend's ``sample`` has a parameter for image inputs."""
    from lightalign.modules.sampling.samplers import get_sampler

    name = "generate" if backend == "shared_prefill" else backend
    return "image_inputs" in inspect.signature(get_sampler(name).sample).parameters


_SHRUNK: dict[tuple[str, str], tuple] = {}  # the last model's (shrunk config, facts)
_PROBES: dict[str, tuple] = {}  # per shrunk config and processor: (probe, generation probe, sequences, layout)


def _probe(model_class: type, config, shrunk, processor, key: str):
    from lightalign.modules.adaptations import vision_layouts as vl
    from lightalign.modules.adaptations.shrink import probe_model
    from lightalign.vision.processor import measure_key_layout

    if key not in _PROBES:
        layout = measure_key_layout(processor)
        probe = unit_scale(probe_model(model_class, shrunk), seed=0)
        vocab = int(probe.get_input_embeddings().weight.shape[0])
        _PROBES.clear()  # one model's probe at a time
        _PROBES[key] = (probe, vl.image_sequences(processor, layout, config, shrunk, vocab), layout)
    return _PROBES[key]


def _generation_probe(model_class: type, shrunk, seqs, layout, seeds: int = 4):
    """The probe untied, norms of random sign and size, the first seed whose greedy tokens vary (else the last):
    decoding that repeats one token would hide a broken step."""
    import copy

    from lightalign.modules.adaptations import vision_layouts as vl
    from lightalign.modules.adaptations.shrink import probe_model

    shrunk = copy.deepcopy(shrunk)
    for config in {id(c): c for c in (shrunk, shrunk.get_text_config())}.values():
        if getattr(config, "tie_word_embeddings", False):
            config.tie_word_embeddings = False
    for seed in range(seeds):
        probe = unit_scale(probe_model(model_class, shrunk, seed=seed), seed, random_norms=True)
        reference = vl.greedy_alone(probe, seqs, layout, NEW_TOKENS)
        if min(len(set(t)) for t in reference) >= 3:
            break
    return probe, reference


def _measure(model_class: type, config, shrunk, processor, layout: str, key: str) -> VisionVerdict:
    from lightalign.modules.adaptations import vision_layouts as vl
    from lightalign.modules.adaptations.probe_layouts import max_difference

    probe, seqs, keys = _probe(model_class, config, shrunk, processor, key)
    want = vl.alone(probe, seqs, keys)
    try:
        dropped = vl.alone(probe, [vl.ImageSequence(s.prompt, s.completion, s.extras, {}) for s in seqs], keys)
        effect = max_difference(dropped, want)
    except Exception:  # noqa: BLE001 - the forward refuses image tokens without their images: they reach it
        effect = math.inf
    if not effect > MIN_IMAGE_EFFECT:
        return VisionVerdict(layout, False, math.inf, error=f"the probe's images do not reach its logits (dropping "
                             f"them changes the log-probs by {effect:.1e} nats), so no layout can be shown to keep "
                             "each row's images with it", image_effect=effect)
    kind = KINDS[layout]
    try:
        if kind == "padded":
            diff = max(max_difference(vl.padded(probe, seqs, keys, side), want) for side in ("left", "right"))
        elif kind in ("packed", "shared"):
            run = vl.packed if kind == "packed" else vl.shared
            reference = want if kind == "packed" else vl.shared_alone(probe, seqs, keys)
            diff = max_difference(run(probe, seqs, keys), reference)
            if vl.uses_mrope(probe):
                own = max_difference(run(probe, seqs, keys, positions="model"), reference)
                return VisionVerdict(layout, diff <= TOLERANCE, diff, image_effect=effect,
                                     model_positions_difference=own)
        else:  # generate
            gen, reference = _generation_probe(model_class, shrunk, seqs, keys)
            got = vl.greedy_batched(gen, seqs, keys, NEW_TOKENS)
            diff = float(sum(a != b for g, w in zip(got, reference) for a, b in zip(g, w)))
            return VisionVerdict(layout, diff == 0, diff, image_effect=effect)
    except Exception as error:  # noqa: BLE001 - a layout that fails on the probe is not exact; the error says why
        return VisionVerdict(layout, False, math.inf, error=f"{type(error).__name__}: {str(error)[:300]}",
                             image_effect=effect)
    return VisionVerdict(layout, diff <= TOLERANCE, diff, image_effect=effect)


def measure_vision(model_class: type, config, processor, layout: str) -> VisionVerdict:
    """The verdict for ``layout`` (``KINDS``) with images on ``model_class`` / ``config`` and the user's
    ``processor``, from the disk cache or measured on a probe."""
    from lightalign.modules.adaptations.shrink import shrink_config

    if KINDS[layout] == "backend":
        if not sampler_takes_images(layout):
            return VisionVerdict(layout, False, math.inf, error=f"the {layout} backend takes token ids and masks only: "
                                 "the image tensors never reach the model, so its tokens are those of a model that "
                                 "has not seen the images")
        raise NotImplementedError(f"the {layout} backend takes image inputs: measure it here before accepting it")
    memo = (f"{model_class.__module__}.{model_class.__qualname__}",
            hashlib.sha256(config.to_json_string(use_diff=False).encode()).hexdigest())
    if memo not in _SHRUNK:  # the layouts of one model share its shrunk config
        with _plain_construction():
            _SHRUNK.clear()
            _SHRUNK[memo] = shrink_config(config, None, model_class=model_class)
    shrunk, facts = _SHRUNK[memo]
    key = _key(model_class, shrunk, f"vision:{KINDS[layout]}",
               {**facts, "processor": _fingerprint(processor), "vision_probe": VISION_PROBE_VERSION})
    cached = _read(key)
    if cached is not None:
        return VisionVerdict(**{**asdict(cached), "layout": layout})
    start = time.perf_counter()
    with torch.random.fork_rng(devices=[]), _plain_construction():
        verdict = _measure(model_class, config, shrunk, processor, layout, facts["config_sha256"] + _fingerprint(
            processor))
    verdict = VisionVerdict(**{**asdict(verdict), "seconds": round(time.perf_counter() - start, 3)})
    _write(key, verdict)
    return verdict


def _resolve(model_or_name: Any, processor, processor_kwargs):
    """(model class, config, processor) of a model object or a model folder / hub name."""
    if isinstance(model_or_name, torch.nn.Module):
        base = _base(model_or_name)
        model_class, config = type(base), base.config
        name = getattr(config, "_name_or_path", "")
    else:
        from transformers import AutoConfig
        from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

        from lightalign.hub import _hub_kwargs

        name = str(model_or_name)
        config = AutoConfig.from_pretrained(name, **_hub_kwargs(name))
        model_class = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(config)]
    if processor is None:
        from lightalign.vision.processor import load_processor

        if not name:
            raise ValueError("check_vision_layout needs the run's processor (the model carries no folder name).")
        processor = load_processor(name, processor_kwargs)
    return model_class, config, processor


def check_vision_layout(model_or_name: Any, layout: str, processor=None,
                        processor_kwargs: dict[str, Any] | None = None) -> VisionVerdict:
    """Refuse (``LayoutRefused``) a layout or generation backend that is not exact with images in the rows on this
    model, as measured on its probe with the run's ``processor``; return the verdict. ``layout``: a name of
    ``support.LAYOUTS``, ``generate`` or a backend of ``GENERATION_BACKENDS``; ``model_or_name``: the model (its
    base is probed) or its folder / hub name."""
    if layout not in KINDS:
        raise ValueError(f"Unknown layout '{layout}'; one of {list(KINDS)}.")
    model_class, config, processor = _resolve(model_or_name, processor, processor_kwargs)
    verdict = measure_vision(model_class, config, processor, layout)
    if not verdict.exact:
        knob, alternative = _KNOBS.get(layout, ("batched generation (model.generation_backend: generate)",
                                                 "per-device batch size 1"))
        cause = likely_cause(processor, layout, verdict)
        raise LayoutRefused(
            f"{knob} cannot run exactly with images on {model_class.__name__} (model_type "
            f"'{getattr(config, 'model_type', '?')}'): measured on a shrunk copy of its config with images in the "
            f"rows, the {layout} layout {verdict.describe()}{f' ({cause})' if cause else ''}. Set {alternative} for "
            "image rows.")
    return verdict


def refuse_image_layout(model_or_name: Any, layout: str, processor, not_built: str) -> None:
    """Refuse image rows in a layout lightalign does not build with images: with the measured difference when the
    model cannot run the layout exactly with images (``check_vision_layout``), else saying it measured exact on this
    model and what is missing (``not_built``)."""
    verdict = check_vision_layout(model_or_name, layout, processor)
    model_class, config, _ = _resolve(model_or_name, processor, None)
    knob, alternative = _KNOBS[layout]
    raise LayoutRefused(
        f"{knob} with image rows: {model_class.__name__} (model_type '{getattr(config, 'model_type', '?')}') can run "
        f"the {layout} layout exactly with images (measured on a shrunk copy: at most {verdict.difference:.1e} nats "
        f"from each sequence alone), but {not_built} yet. Set {alternative} for image rows.")


def likely_cause(processor, layout: str, verdict: VisionVerdict) -> str:
    """What explains a refused packed or shared layout (only an explanation: the measurement decided)."""
    from lightalign.vision.processor import measure_key_layout

    if KINDS[layout] not in ("packed", "shared") or verdict.error or verdict.model_positions_difference is not None:
        return ""  # (an mRoPE model's verdict says itself what its own positions give)
    if "token_type_ids" in measure_key_layout(processor).token_keys:
        return ("its image tokens attend to each other both ways (token_type_ids in the model's own mask), which "
                "this layout's mask does not give them")
    return ""


assert set(KINDS) == set(LAYOUTS) | {"generate"} | set(GENERATION_BACKENDS)
