"""NEFTune: uniform noise on the input embeddings while training (Jain et al., 2023, "NEFTune").

The noise of each sequence is uniform in ``[-m, m]`` with ``m = alpha / sqrt(seq_len * hidden)``. It is added by
a forward hook on the input embedding layer, only when that layer is in training mode; removing the hook gives
the original embedding forward back.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from lightalign.knobs import KnobGroup, knob


@dataclasses.dataclass(frozen=True)
class NEFTuneKnobs(KnobGroup):
    group = "neftune"
    neftune_noise_alpha: float | None = knob(None, "NEFTune noise on the input embeddings during training (e.g. 5); "
                                                   "off when None.")

    def check(self) -> None:
        if self.neftune_noise_alpha is not None and self.neftune_noise_alpha <= 0:
            raise ValueError(f"neftune_noise_alpha must be > 0 (TRL suggests 5), got {self.neftune_noise_alpha}.")


class NEFTune:
    """Attach with ``NEFTune(model, alpha).attach()``; ``detach()`` restores the plain embedding forward."""

    def __init__(self, model: torch.nn.Module, noise_alpha: float) -> None:
        self.model = model
        self.noise_alpha = float(noise_alpha)
        self._handle: torch.utils.hooks.RemovableHandle | None = None

    @property
    def attached(self) -> bool:
        return self._handle is not None

    def embedding(self) -> torch.nn.Module:
        get = getattr(self.model, "get_input_embeddings", None)
        layer = get() if get is not None else None
        if layer is None:
            raise ValueError(f"NEFTune needs a model with get_input_embeddings(); {type(self.model).__name__} has none.")
        return layer

    def _hook(self, module: torch.nn.Module, args, output: torch.Tensor) -> torch.Tensor:
        if not module.training:
            return output
        magnitude = self.noise_alpha / math.sqrt(output.size(1) * output.size(2))
        return output + torch.zeros_like(output).uniform_(-magnitude, magnitude)

    def attach(self) -> "NEFTune":
        if self._handle is None:
            self._handle = self.embedding().register_forward_hook(self._hook)
        return self

    def detach(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
