"""The VLM part of the conformance matrix: on the six shipped tiny vision-language families, every layout and
generation backend with images in the rows is exact or refused, as measured by the vision probe
(``check_vision_layout``: the family's class on its config shrunk with its vision tower, the family's processor's
rows with 0/1/2 images, left and right padding).

Mutations that fail this file: ``model_inputs`` returning only the token extras (no ``pixel_values``: the probe's
images no longer reach its logits, every family's ``padded`` verdict turns into a refusal); ``vision_layouts.packed``
passing 1-D positions to a model with ``get_rope_index`` (the three Qwen families' packed verdicts); the
shared-prefix mask letting a completion attend to the other completion of its prompt (every shared verdict);
``generate`` in ``vision_layouts`` dropping the image inputs of the batch (every generate verdict).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lightalign.modules.adaptations import LayoutRefused
from lightalign.modules.adaptations.vision_probe import MIN_IMAGE_EFFECT, check_vision_layout

ASSETS = Path(__file__).resolve().parents[2] / "assets" / "models"
# one layout per measurement (the others share it: KINDS), then the backends; "refused" cells with their cause
MEASURED = ("padded", "padding_free", "dpo_shared", "generate")
BACKENDS = ("shared_prefill", "compact", "continuous", "static")
EXACT = {
    "tiny-qwen2-vl": MEASURED,
    "tiny-qwen2.5-vl": MEASURED,
    "tiny-qwen3-vl": MEASURED,
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


@pytest.mark.parametrize("family", list(EXACT))
def test_vision_matrix(family):
    """Each (family x layout x backend) cell: exact within float32's 1e-4 nats (or 0 differing greedy tokens), or
    refused with the knob; the probe's images reach its logits (else nothing here would show they follow rows)."""
    folder = str(ASSETS / family)
    for layout in MEASURED:
        try:
            verdict = check_vision_layout(folder, layout)
        except LayoutRefused as error:
            assert layout not in EXACT[family], f"{family}/{layout} refused: {error}"
            assert "nats" in str(error), str(error)
            continue
        assert layout in EXACT[family], f"{family}/{layout} accepted: {verdict}"
        assert verdict.image_effect > MIN_IMAGE_EFFECT and verdict.difference <= 1e-4, verdict
    for backend in BACKENDS:
        with pytest.raises(LayoutRefused, match="never reach the model"):
            check_vision_layout(folder, backend)
    # a second check is the cached verdict
    assert check_vision_layout(folder, "padded").cached


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
