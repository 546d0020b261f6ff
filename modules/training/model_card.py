"""The model card (``README.md``) of an exported Hugging Face folder, as a pure function of what the run knows.

``model_card_text(...)`` takes plain values (names, hyperparameters and their defaults, final metrics, library
versions) and returns the card's text: YAML metadata built with huggingface_hub's ``ModelCardData`` (``base_model``,
``library_name``, ``tags``, ``datasets``, ``license``, ``pipeline_tag``) and a body naming the base model, the method
and its knobs, the data, the final metrics, the versions and how to load the model. ``HFExport``
gathers those values from the trainer (``card_inputs``) and writes the card into every
folder it exports.
"""

from __future__ import annotations

import inspect
import json
import math
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

#: A Hugging Face hub repository id ("org/name"): what may go into the ``base_model`` / ``datasets`` metadata (the
#: Hub rejects a card whose ``base_model`` is not a model id, e.g. a local path).
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
CARD_VERSIONS = ("lightalign", "torch", "transformers", "lightning", "peft")
_MAX_VALUE = 80


def is_hub_id(name: Any) -> bool:
    """Whether ``name`` reads as a hub repository id and is not a local path that exists."""
    return isinstance(name, str) and bool(HUB_ID.match(name)) and not Path(name).expanduser().exists()


def method_tag(method: str) -> str:
    """``SFTModule`` -> ``sft``, ``DPOModule`` -> ``dpo``: the tag naming the method."""
    return method.removesuffix("Module").lower() or method.lower()


def card_title(repo_id: str | None, run_name: str | None, folder: str | None) -> str:
    """The card's title: the hub repository when pushed, else the run (``quickstart/version_0``; a folder other than
    its ``hf_model`` export added, e.g. ``(checkpoint-100)``), else the folder's name."""
    if repo_id:
        return repo_id
    name = Path(folder).name if folder else None
    if run_name:
        return run_name if name in (None, "hf_model") else f"{run_name} ({name})"
    return name or "model"


def object_path(obj: Any) -> str:
    """How the card names a function, class or object given as a knob (a reward function, a judge): a reward
    model's folder or hub name, else the import path of the function or class (of the object's class)."""
    path = getattr(obj, "name_or_path", None)  # a RewardModel
    if isinstance(path, str):
        return path
    target = obj if isinstance(obj, type) or callable(obj) and hasattr(obj, "__qualname__") else type(obj)
    return f"{getattr(target, '__module__', '')}.{target.__qualname__}".lstrip(".")


def _value(value: Any) -> str:
    if isinstance(value, float):
        text = f"{value:.6g}"
    elif isinstance(value, (list, tuple)) and all(callable(v) for v in value):
        text = ", ".join(getattr(v, "__qualname__", repr(v)) for v in value)
    elif callable(value) and hasattr(value, "__qualname__"):
        text = object_path(value)
    else:
        text = repr(value) if not isinstance(value, str) else value
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= _MAX_VALUE else text[:_MAX_VALUE - 1] + "…"


def _metric(value: float) -> str:
    return f"{value:.4g}" if math.isfinite(value) else str(value)


def model_card_text(
    *,
    method: str,
    base_model: str | None,
    hparams: Mapping[str, Any],
    defaults: Mapping[str, Any],
    metrics: Mapping[str, float],
    versions: Mapping[str, str | None],
    step: int | None = None,
    data: str | None = None,
    data_format: str | None = None,
    data_module: str | None = None,
    repo_id: str | None = None,
    folder: str | None = None,
    run_name: str | None = None,
    method_name: str | None = None,
    switched_knobs: Mapping[str, Sequence[str]] | None = None,
    library_name: str = "transformers",
    auto_class: str = "AutoModelForCausalLM",
    pipeline_tag: str | None = "text-generation",
    license: str | None = None,
    random_init: bool = False,
    vision_language: bool = False,
) -> str:
    """The text of ``README.md`` (YAML metadata + markdown body); pure: the same inputs give the same text.

    Args:
        method: the module class (``SFTModule``); its tag (``sft``) goes into ``tags``. ``method_name``: the
            method's proper name (``Online DPO``), said beside the class (None: the class alone).
        base_model: the model the run started from (hub id or local folder); only a hub id goes into the metadata.
        hparams: the run's hyperparameters (the module's ``hparams``); ``defaults``: the class defaults, so the knobs
            that differ come first in the table. ``switched_knobs``: switch knob -> the knobs that act only when it
            is on (``use_vllm`` -> the ``vllm_*`` knobs); with the switch off, those still at their defaults are left
            out (and counted).
        metrics: the last logged value of each metric (``train/loss``, ``val/loss`` …); ``step``: the step they
            were read at.
        versions: package -> version (``None``: not installed; left out).
        data, data_format, data_module: the training data's path or hub name, its format and the data module class;
            a hub dataset name also goes into the ``datasets`` metadata.
        repo_id / folder: what the loading snippet names (the hub repository when pushed, else the local folder:
            give it absolute, the snippet must work from anywhere). The title: ``card_title(repo_id, run_name,
            folder)``, ``run_name`` being the run's ``<name>/version_N``.
        library_name, auto_class, pipeline_tag: how the folder loads (``peft`` + ``AutoPeftModelForCausalLM`` for an
            adapter, ``AutoModelForSequenceClassification`` for a reward model).
        license: the license, when known (otherwise left out).
        random_init: the run started from random weights (``from_config``): no base model in the metadata.
        vision_language: a vision-language model (reads images): the card says so, and the snippet loads the folder's
            processor (``AutoProcessor``: tokenizer, image processor, chat template) beside the model.
    """
    from huggingface_hub import ModelCard, ModelCardData

    tag = method_tag(method)
    hub_base = base_model if not random_init and is_hub_id(base_model) else None
    hub_data = data if is_hub_id(data) else None
    card_data = ModelCardData(
        base_model=hub_base, library_name=library_name, license=license, pipeline_tag=pipeline_tag,
        datasets=[hub_data] if hub_data else None, tags=["lightalign", tag],
        model_name=repo_id.split("/")[-1] if repo_id else None,
    )
    named = f"{method_name} (`{method}`)" if method_name else f"`{method}`"

    lines: list[str] = [f"# {card_title(repo_id, run_name, folder)}", ""]
    origin = (f"random weights built from the config of `{base_model}`" if random_init
              else f"[`{base_model}`](https://huggingface.co/{base_model})" if hub_base else f"`{base_model}`")
    lines += [f"Trained with lightalign's {named} from {origin}"
              + (f", {step} optimizer steps." if step is not None else "."), ""]
    if vision_language:
        lines += ["This is a vision-language model: it reads images and text and writes text. The folder holds its "
                  "processor (tokenizer, image processor and chat template) beside the weights.", ""]
    preprocessor = "AutoProcessor" if vision_language else "AutoTokenizer"
    loaded = "processor" if vision_language else "tokenizer"

    # a vision-language adapter: peft's AutoPeftModelForCausalLM would load the base with AutoModelForCausalLM, which
    # has no class for most VLMs, so the base is loaded with AutoModelForImageTextToText and the adapter put on it
    vlm_adapter = vision_language and auto_class.startswith("AutoPeft")
    lines += ["## How to load", "", "```python", f"from transformers import {preprocessor}"]
    if vlm_adapter:
        lines[-1] = f"from transformers import AutoModelForImageTextToText, {preprocessor}"
        lines += ["from peft import PeftModel", ""]
    elif auto_class.startswith("AutoPeft"):
        lines += [f"from peft import {auto_class}", ""]
    else:
        lines[-1] = f"from transformers import {auto_class}, {preprocessor}"
        lines += [""]
    where = json.dumps(repo_id) if repo_id else "folder"
    if not repo_id:
        lines += ["# the folder this card is in (moved or copied: its new path)",
                  f"folder = {json.dumps(folder or 'path/to/this/folder', ensure_ascii=False)}"]
    if vlm_adapter:
        lines += [f"base = AutoModelForImageTextToText.from_pretrained({json.dumps(base_model)})",
                  f"model = PeftModel.from_pretrained(base, {where})"]
    else:
        lines += [f"model = {auto_class}.from_pretrained({where})"]
    lines += [f"{loaded} = {preprocessor}.from_pretrained({where})", "```", ""]

    lines += ["## Data", ""]
    if data is not None:
        lines += [f"- path or name: `{data}`" + (" (Hugging Face dataset)" if hub_data else "")]
    if data_format:
        lines += [f"- format: {data_format.replace('_', '-')}"]
    if data_module:
        lines += [f"- data module: `{data_module}`"]
    if data is None and not data_format and not data_module:
        lines += ["- not recorded (the model was trained without a lightalign data module)"]
    lines += [""]

    lines += ["## Final metrics", ""]
    if metrics:
        lines += ["| metric | value |", "|---|---|"]
        order = sorted((k for k in metrics if not k.endswith(("_per_sec", "/lr"))),  # throughput, schedule: not results
                       key=lambda k: (not k.startswith("train/"), k))
        lines += [f"| `{name}` | {_metric(float(metrics[name]))} |" for name in order]
    else:
        lines += ["No metric was logged."]
    lines += [""]

    hparams = {k: v for k, v in hparams.items() if not k.startswith("_")}  # jsonargparse's _class_path, _instantiator
    changed = {k: v for k, v in hparams.items() if k not in defaults or not _same(defaults[k], v)}
    unchanged = {k: v for k, v in hparams.items() if k not in changed}
    left_out = {switch: [k for k in knobs if k in unchanged]
                for switch, knobs in (switched_knobs or {}).items() if switch in hparams and not hparams[switch]}
    unchanged = {k: v for k, v in unchanged.items() if not any(k in knobs for knobs in left_out.values())}
    lines += [f"## Method: {named}", "", "Knobs set for this run (differing from the defaults):", ""]
    if changed:
        lines += ["| knob | value |", "|---|---|"] + [f"| `{k}` | `{_value(v)}` |" for k, v in changed.items()]
    else:
        lines += ["None: every knob at its default."]
    if unchanged:
        lines += ["", "<details><summary>The other knobs (defaults)</summary>", "", "| knob | value |", "|---|---|"]
        lines += [f"| `{k}` | `{_value(v)}` |" for k, v in unchanged.items()] + ["", "</details>"]
    gone = [f"{len(knobs)} knobs that act only when `{switch}` is on" for switch, knobs in left_out.items() if knobs]
    lines += ["", "Left out (off here): " + "; ".join(gone) + "."] if gone else []
    lines += [""]

    shown = [(name, versions.get(name)) for name in CARD_VERSIONS if versions.get(name)]
    lines += ["## Framework versions", ""] + [f"- {name}: {version}" for name, version in shown] + [""]
    return str(ModelCard.from_template(card_data, template_str="---\n{{ card_data }}\n---\n\n{{ body }}\n",
                                       body="\n".join(lines).rstrip() + "\n"))


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # tensors, arrays: not comparable to a plain default
        return False


def class_defaults(cls: type) -> dict[str, Any]:
    """The default of every ``__init__`` parameter of ``cls`` and its bases (the nearest class's wins)."""
    defaults: dict[str, Any] = {}
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        try:
            parameters = inspect.signature(init).parameters.values()
        except (TypeError, ValueError):
            continue
        for p in parameters:
            if p.default is not inspect.Parameter.empty and p.name not in defaults:
                defaults[p.name] = p.default
    return defaults
