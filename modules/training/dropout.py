"""``disable_dropout``: training without dropout noise (TRL's ``disable_dropout``, default on for DPO).

A Hugging Face model is random in train mode in more places than its ``nn.Dropout`` modules (all TRL zeroes):

- rates modules keep as float attributes and pass to the attention function or ``F.dropout``
  (``attention_dropout``, ``dropout``, ``hidden_dropout``, GPT-J's ``attn_pdrop`` …);
- rates read from the *config* at forward time (Falcon's ``config.hidden_dropout``, Persimmon's and GPT-Neo's
  ``config.attention_dropout``, GPT-J's ``config.attn_pdrop``, BLT's ``config.dropout``);
- layer drop, which skips whole layers at random (OPT, XGLM, BioGPT ``layerdrop``);
- multiplicative router noise of Mixture-of-Experts models (Mixtral's and MiniMax's ``router_jitter_noise``, PhiMoE's
  ``input_jitter_noise``, DBRX's ``moe_jitter_eps``).

``disable_dropout_in_model`` sets all of these to 0, on the modules and on every config the model holds: a float
whose name says ``drop`` or ``jitter``. Zeroing them changes nothing in eval mode, which is what makes it safe.

Config values are what an export writes, and the user's exported ``config.json`` must keep the user's values: the
values replaced are remembered on the model, and ``user_dropout_config(model)`` puts them back for the duration of
a block; ``export_hf`` (every lightalign export) writes the config inside it. (A bare
``model.save_pretrained`` outside it writes the zeros.)

Left alone, because zeroing would change the model rather than remove noise:

- PhiMoE's ``router_jitter_noise`` is not noise: it is the sparsemixer's routing threshold (which experts are
  close enough to the best one to be mixed), used in eval mode too. In train mode PhiMoE also *samples* its experts
  (Gumbel) among those, by design of its training algorithm. Such a model stays random in train mode whenever two
  experts' scores are within the threshold; the report says so (``DropoutReport.kept``) and
  ``train_mode_nondeterminism`` measures it.

``train_mode_nondeterminism(model, input_ids)`` is the measurement: two train-mode forwards of the same input,
the largest logit difference; 0.0 when the train-mode forward is deterministic.
"""

from __future__ import annotations

import contextlib
import inspect
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np
import torch

from lightalign.knobs import KnobGroup, knob

@dataclass(frozen=True)
class DropoutKnobs(KnobGroup):
    group = "dropout"
    disable_dropout: bool = knob(
        False, "set every dropout probability of the policy to 0 (``disable_dropout_in_model``; TRL's default: on for "
               "DPO, off for GRPO and SFT): ``nn.Dropout`` modules, the rates modules and configs keep (read at forward "
               "time), layer drop and MoE router jitter. The export's ``config.json`` keeps the user's values.")


# model_type -> config fields / module attributes that look like noise by name but also shape the eval-mode forward
_NOT_NOISE: dict[str, tuple[str, ...]] = {"phimoe": ("router_jitter_noise",)}
# model_type -> train-mode randomness that is part of the model's training algorithm and is not a rate to zero
_RANDOM_BY_DESIGN: dict[str, str] = {
    "phimoe": "PhiMoE samples its experts in train mode (sparsemixer: Gumbel sampling among the experts within "
              "router_jitter_noise of the best one; the threshold shapes eval routing too, so it is kept)",
}
_RECORD = "_lightalign_user_dropout"  # on the model: [(config, {field: the user's value})]


@dataclass
class DropoutReport:
    """What ``disable_dropout_in_model`` set to 0: ``zeroed`` maps what (``nn.Dropout``, a module attribute name,
    ``config.<field>``) to how many non-zero values; ``kept`` names train-mode randomness it left on purpose."""

    zeroed: dict[str, int] = field(default_factory=dict)
    kept: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.zeroed.values())

    def describe(self) -> str:
        """One line for the fit-start log."""
        if self.zeroed:
            what = ", ".join(f"{name} x{n}" for name, n in self.zeroed.items())
            line = f"dropout off ({what}"
            line += "; the export keeps the config's values)" if any(k.startswith("config.") for k in self.zeroed) else ")"
        else:
            line = "dropout off (no non-zero rate found)"
        return line + "".join(f"; still random in train mode: {k}" for k in self.kept)

    def kept_warning(self, model_name: str, difference: float) -> str:
        """The warning for randomness kept by design (``kept``), with its measured size: it reaches every training
        forward (losses and gradients carry it, a DPO policy's log-probs differ from the same weights' reference by
        it), so a user reading the fit-start info line alone missed it."""
        return (f"disable_dropout is on, but {model_name} stays random in train mode: {'; '.join(self.kept)}. Two "
                f"train-mode forwards of the same tokens differ by up to {difference:.1e} in the logits (measured on a "
                "shrunk model of its class and config); every training loss and gradient carries that noise. It is "
                "part of the model's training algorithm, so lightalign leaves it on.")


def _is_rate(name: str, value: Any) -> bool:
    lowered = name.lower()
    return isinstance(value, float) and value > 0 and ("drop" in lowered or "jitter" in lowered)


def _configs(model: torch.nn.Module) -> list[tuple[str, Any]]:
    """Every Hugging Face config the model's modules hold, nested sub-configs included, each once, with its path
    (``config``, ``config.text_config`` …)."""
    from transformers import PreTrainedConfig

    found: dict[int, tuple[str, Any]] = {}

    def visit(config: Any, path: str) -> None:
        if id(config) in found:
            return
        found[id(config)] = (path, config)
        for name, value in list(vars(config).items()):
            if isinstance(value, PreTrainedConfig):
                visit(value, f"{path}.{name}")

    for module in model.modules():
        config = getattr(module, "config", None)
        if isinstance(config, PreTrainedConfig):
            visit(config, "config")
    return list(found.values())


def disable_dropout_in_model(model: torch.nn.Module) -> DropoutReport:
    """Set every dropout rate, layer-drop probability and router jitter of ``model`` to 0, in its modules and in its
    config(s), and report what was non-zero (see the module docstring for what is covered and what is kept).

    The configs' replaced values are remembered on ``model``: ``user_dropout_config(model)`` restores them while an
    export is written. Calling this again is harmless (the first call's values stay remembered).
    """
    report = DropoutReport()
    zeroed: Counter[str] = Counter()
    configs = _configs(model)
    model_types = {getattr(config, "model_type", None) for _, config in configs}
    not_noise = {name for t in model_types for name in _NOT_NOISE.get(t, ())}
    report.kept = [_RANDOM_BY_DESIGN[t] for t in sorted(filter(None, model_types)) if t in _RANDOM_BY_DESIGN]

    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):  # Dropout, Dropout1d/2d/3d, AlphaDropout …
            if module.p > 0:
                zeroed["nn.Dropout"] += 1
                module.p = 0.0
            continue
        for name, value in list(vars(module).items()):
            if name not in not_noise and _is_rate(name, value):
                zeroed[name] += 1
                setattr(module, name, 0.0)

    for path, config in configs:
        for name, value in list(vars(config).items()):
            if name not in not_noise and _is_rate(name, value):
                zeroed[f"{path}.{name}"] += 1
                records = model.__dict__.setdefault(_RECORD, [])  # plain attribute: deep copies carry it along
                saved = next((values for c, values in records if c is config), None)
                if saved is None:
                    saved = {}
                    records.append((config, saved))
                saved.setdefault(name, value)
                setattr(config, name, 0.0)
    report.zeroed = dict(zeroed)
    return report


@contextlib.contextmanager
def user_dropout_config(model: torch.nn.Module) -> Iterator[None]:
    """The user's config values that ``disable_dropout_in_model`` replaced, back in ``model``'s configs while the
    block runs (an export's ``save_pretrained``), and 0 again after it. Finds the record through wrappers (LoRA,
    ``torch.compile``) and on deep copies; a no-op for a model whose dropout was not disabled."""
    records = [r for module in model.modules() for r in module.__dict__.get(_RECORD, ())]
    for config, values in records:
        for name, value in values.items():
            setattr(config, name, value)
    try:
        yield
    finally:
        for config, values in records:
            for name in values:
                setattr(config, name, 0.0)


def train_mode_nondeterminism(model: torch.nn.Module, input_ids: torch.Tensor, seed: int = 0) -> float:
    """How far two train-mode forwards of ``model`` on the same ``input_ids`` are apart: the largest absolute
    difference of their logits (``inf`` where only one of them is NaN). 0.0 means the train-mode forward is
    deterministic, i.e. nothing random is left (``disable_dropout_in_model`` did its job on this model).

    A pure measurement: the forwards run without gradients, every submodule's train/eval flag is put back as it
    was, and the random number generators (torch CPU, the CUDA device of ``input_ids``, numpy, ``random``) are
    restored, so nothing else in the process sees a difference. The forwards draw from a generator seeded with
    ``seed``, so the result is reproducible. On a GPU, non-deterministic kernels can make the result non-zero
    without any dropout; measure on CPU for a verdict about the model.
    """
    modes = [(module, module.training) for module in model.modules()]
    device = input_ids.device
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    kwargs: dict[str, Any] = {}
    try:
        if "use_cache" in inspect.signature(model.forward).parameters:
            kwargs["use_cache"] = False  # no KV cache to build (and no warning under gradient checkpointing)
    except (TypeError, ValueError):
        pass
    python_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=cuda), torch.no_grad():
            torch.random.default_generator.manual_seed(seed)
            if cuda:
                with torch.cuda.device(cuda[0]):
                    torch.cuda.manual_seed(seed)
            model.train()
            first = _logits(model(input_ids=input_ids, **kwargs))
            second = _logits(model(input_ids=input_ids, **kwargs))
    finally:
        for module, training in modes:
            module.training = training
        random.setstate(python_state)
        np.random.set_state(numpy_state)
    first, second = first.double(), second.double()
    difference = (first - second).abs()
    difference = difference.masked_fill(first.isnan() & second.isnan(), 0.0).nan_to_num(nan=float("inf"))
    return float(difference.max()) if difference.numel() else 0.0


def _logits(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    return logits if logits is not None else output[0]
