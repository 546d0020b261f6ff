"""The VLM part of the conformance matrix: on the six shipped tiny vision-language families, every layout and
generation backend with images in the rows is exact or refused, as measured by the vision probe
(``check_vision_layout``: the family's class on its config shrunk with its vision tower, the family's processor's
rows with 0/1/2 images, left and right padding).

Mutations that fail this file: ``model_inputs`` returning only the token extras (no ``pixel_values``: the probe's
images no longer reach its logits, every family's ``padded`` verdict turns into a refusal); ``vision_layouts.packed``
passing 1-D positions whatever ``positions`` says (the Qwen families' 3-D positions no longer exact); the
shared-prefix mask letting a completion attend to the other completion of its prompt (every shared verdict);
``vision_layouts.greedy_batched`` dropping the image inputs of the batch (every generate verdict);
``vision_probe._measure`` accepting every measured layout (Gemma 3's packed and shared cells).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest

from lightalign.modules.adaptations import LayoutRefused
from lightalign.modules.adaptations.vision_probe import MIN_IMAGE_EFFECT, _resolve, check_vision_layout, measure_vision

ASSETS = Path(__file__).resolve().parents[2] / "assets" / "models"
# one layout per measurement (the others share it: KINDS), then the backends; "refused" cells with their cause
MEASURED = ("padded", "padding_free", "dpo_shared", "generate")
BACKENDS = ("shared_prefill", "compact", "continuous", "static")
EXACT = {
    # mRoPE: packed and shared rows with lightalign's 1-D positions are refused; with the model's own 3-D positions
    # of each sequence they are exact (model_positions_difference, asserted below)
    "tiny-qwen2-vl": ("padded", "generate"),
    "tiny-qwen2.5-vl": ("padded", "generate"),
    "tiny-qwen3-vl": ("padded", "generate"),
    # Gemma 3's images attend to each other both ways (token_type_ids in its own mask): a packed row's or a shared
    # prefix's own mask replaces that mask, so those are refused
    "tiny-gemma3": ("padded", "generate"),
    "tiny-smolvlm": MEASURED,
    "tiny-llava": MEASURED,
}


@pytest.fixture(autouse=True, scope="module")
def fresh_cache(tmp_path_factory):
    """Measured here, not read from a previous run's cache."""
    saved = os.environ.get("LIGHTALIGN_CACHE_DIR")
    os.environ["LIGHTALIGN_CACHE_DIR"] = str(tmp_path_factory.mktemp("probe-cache"))
    yield
    if saved is None:
        os.environ.pop("LIGHTALIGN_CACHE_DIR")
    else:
        os.environ["LIGHTALIGN_CACHE_DIR"] = saved


@functools.lru_cache(maxsize=1)
def _family_model(family: str):
    """The family's own model (unit-scale weights of another seed than the probe's; Gemma 3's zero image
    projection redrawn too), its processor's batch layout and other sequences than the probe's."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from lightalign.modules.adaptations import vision_layouts as vl
    from lightalign.modules.adaptations.probe import unit_scale
    from lightalign.vision import load_processor, measure_key_layout

    folder = ASSETS / family
    config = AutoConfig.from_pretrained(folder)
    model = unit_scale(AutoModelForImageTextToText.from_config(config), seed=7).eval()
    processor = load_processor(str(folder))
    keys = measure_key_layout(processor)
    return model, keys, vl.image_sequences(processor, keys, config, config, config.get_text_config().vocab_size, seed=3)


def _truth(family: str, layout: str, positions: str = "1d") -> float:
    """The layout's largest log-prob difference on the family's own model (not the probe: full vocabulary, its
    own token ids, other weights and images), against each sequence alone."""
    from lightalign.modules.adaptations import vision_layouts as vl
    from lightalign.modules.adaptations.probe_layouts import max_difference

    model, keys, seqs = _family_model(family)
    if layout == "padding_free":
        return max_difference(vl.packed(model, seqs, keys, positions), vl.alone(model, seqs, keys))
    return max_difference(vl.shared(model, seqs, keys, positions), vl.shared_alone(model, seqs, keys))


@pytest.mark.parametrize("family", list(EXACT))
def test_vision_matrix(family):
    """Each (family x layout x backend) cell: exact within float32's 1e-4 nats (or 0 differing greedy tokens), or
    refused with the knob; the probe's images reach its logits (else nothing here would show they follow rows).
    The packed and shared verdicts are also the truth on the family's own model."""
    folder = str(ASSETS / family)
    for layout in MEASURED:
        try:
            verdict = check_vision_layout(folder, layout)
        except LayoutRefused as error:
            assert layout not in EXACT[family], f"{family}/{layout} refused: {error}"
            assert "nats" in str(error), str(error)
            assert _truth(family, layout) > 1e-4, f"{family}/{layout} refused, but the model computes it exactly"
            continue
        assert layout in EXACT[family], f"{family}/{layout} accepted: {verdict}"
        assert verdict.image_effect > MIN_IMAGE_EFFECT and verdict.difference <= 1e-4, verdict
        if layout in ("padding_free", "dpo_shared"):
            assert _truth(family, layout) <= 1e-4, f"{family}/{layout} accepted, but the model is not exact"
    for backend in BACKENDS:
        with pytest.raises(LayoutRefused, match="never reach the model"):
            check_vision_layout(folder, backend)
    # a second check is the cached verdict
    assert check_vision_layout(folder, "padded").cached
    if "qwen" in family:  # exact with the model's own 3-D positions of each sequence, on the probe and the model
        model_class, config, processor = _resolve(folder, None, None)
        for layout in ("padding_free", "dpo_shared"):
            verdict = measure_vision(model_class, config, processor, layout)
            assert verdict.difference > 1e-4 >= verdict.model_positions_difference, verdict
            assert _truth(family, layout, positions="model") <= 1e-4, layout


def test_refusal_message_names_model_knob_difference_and_setting():
    folder = str(ASSETS / "tiny-gemma3")
    with pytest.raises(LayoutRefused) as info:
        check_vision_layout(folder, "packed")
    text = str(info.value)
    for part in ("Gemma3ForConditionalGeneration", "data.packing", "nats", "data.packing: false", "images"):
        assert part in text, text
    with pytest.raises(LayoutRefused) as info:
        check_vision_layout(folder, "grpo_shared")
    assert "model.prompt_sharing" in str(info.value) and "model.prompt_sharing: false" in str(info.value)
    with pytest.raises(LayoutRefused) as info:
        check_vision_layout(folder, "continuous")
    assert "model.generation_backend: continuous" in str(info.value)
    assert "model.generation_backend: generate" in str(info.value)
    with pytest.raises(ValueError, match="Unknown layout"):
        check_vision_layout(folder, "sideways")


def test_check_takes_the_model_and_the_run_processor():
    """At setup the caller passes its model (a PEFT wrapper's base is probed) and the processor it loaded."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from lightalign.vision import load_processor

    folder = ASSETS / "tiny-llava"
    model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(folder))
    processor = load_processor(str(folder))
    assert check_vision_layout(model, "grpo_packed", processor=processor).exact
    with pytest.raises(LayoutRefused, match="LlavaForConditionalGeneration"):
        check_vision_layout(model, "static", processor=processor)


def vision_families_table() -> str:
    """docs/model_support.md's VLM table: family x measurement, the vision probe's verdicts on this machine."""
    import transformers
    import torch

    columns = {"padded": "padded rows (SFT, DPO, KTO, GRPO)", "padding_free": "padding-free / packing",
               "dpo_shared": "prompt sharing (DPO, GRPO)", "generate": "generate (left-padded batch)",
               "shared_prefill": "shared prefill", "compact": "compact", "continuous": "continuous",
               "static": "static"}
    lines = [f"transformers {transformers.__version__}, torch {torch.__version__}", "",
             "| folder (class) | " + " | ".join(columns.values()) + " |", "|---" * (len(columns) + 1) + "|"]
    for family in EXACT:
        model_class, config, processor = _resolve(str(ASSETS / family), None, None)
        cells = []
        for layout in columns:
            v = measure_vision(model_class, config, processor, layout)
            if v.error:
                cells.append("refused (takes no image inputs)" if "never reach" in v.error else "refused (fails)")
                continue
            size = f"{int(v.difference)} tokens" if layout == "generate" else f"{v.difference:.0e}"
            own = f"; 3-D positions {v.model_positions_difference:.0e}" if v.model_positions_difference else ""
            cells.append(f"{'exact' if v.exact else 'refused'} ({size}{own})")
        lines.append(f"| {family} ({model_class.__name__}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":  # python tests/adaptations/test_vision_conformance.py -> docs/model_support.md's VLM table
    print(vision_families_table())
