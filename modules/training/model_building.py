"""The policy model: where it comes from (``ModelKnobs``) and how it is built and prepared (``ModelBuilding``)."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any

import torch

from lightalign.hub import load_causal_lm, normalize_init_kwargs
from lightalign.knobs import KnobGroup, knob
from lightalign.modules.adaptations import adapt_model
from lightalign.modules.training.lora import (apply_peft, check_quantized_policy, enable_activation_checkpointing,
                                              is_peft_model, prepare_quantized_base)


@dataclasses.dataclass(frozen=True)
class ModelKnobs(KnobGroup):
    """Which model is trained and how it is loaded."""

    group = "model"
    model_name_or_path: str | None = knob(None, "a hub name (``Qwen/Qwen2.5-0.5B``) or a local folder with "
                                                "``config.json``.")
    model: torch.nn.Module | None = knob(None, "an already built ``PreTrainedModel`` (Python API only); used instead "
                                               "of ``model_name_or_path``.", saved=False)
    from_config: bool = knob(False, "build the model with random weights from the folder's ``config.json`` (the tiny "
                                    "models).")
    model_init_kwargs: dict[str, Any] | None = knob(
        None, "passed to ``from_pretrained``: ``dtype`` (``bfloat16``/``float32``/``auto``), ``attn_implementation`` "
              "(``sdpa``, ``eager``, ``flash_attention_2``), ``revision``, ``quantization_config`` …")
    trust_remote_code: bool = knob(False, "allow code shipped with the model repository (off unless asked).")
    peft_config: dict[str, Any] | None = knob(
        None, "LoRA settings (``{r: 16, lora_alpha: 32, target_modules: all-linear}``) or a peft config object; only "
              "adapter parameters are trained. With a ``quantization_config``: QLoRA (``prepare_quantized_base``).")

    def check(self) -> None:
        if self.model is None and self.model_name_or_path is None:
            raise ValueError("Pass model_name_or_path (a hub name or a local folder) or a built model.")
        if self.model is None:  # the model's folder, named by its knob (the datamodule's tokenizer would name it first)
            from lightalign.hub import _check_local_folder

            _check_local_folder(self.model_name_or_path, "model", knob="model_name_or_path")
        if self.model is None and self.from_config and self.model_name_or_path and _has_weights(self.model_name_or_path):
            warnings.warn(f"from_config: true builds random weights from {self.model_name_or_path}/config.json and "
                          "does not load the weights in that folder; set from_config: false to train from them.",
                          stacklevel=2)
        check_quantized_policy(self.model_init_kwargs if self.model is None else None, self.peft_config,
                               self.from_config)  # QLoRA
        if self.model is None and not self.from_config:
            from lightalign.hub import check_weights

            check_weights(self.model_name_or_path, normalize_init_kwargs(self.model_init_kwargs))  # before any data


@dataclasses.dataclass(frozen=True)
class ComputeKnobs(KnobGroup):
    """How the policy's forward and backward are computed: the same numbers, less memory or time."""

    group = "compute"
    gradient_checkpointing: bool = knob(False, "recompute activations in backward (non-reentrant) to save memory.")
    torch_compile: bool | dict[str, Any] = knob(False, "``torch.compile`` the model in place (``True`` or "
                                                       "``torch.compile`` keyword arguments).")
    use_liger_kernel: bool = knob(False, "Liger's fused Triton kernels (needs ``liger-kernel`` and a CUDA GPU).")
    recompute_mlp_activation: bool = knob(
        True, "gated SiLU MLPs (Llama, Qwen, Mistral …) keep ``gate(x)`` and ``up(x)`` for the backward pass and "
              "recompute ``silu(gate(x))`` there instead of keeping it: a quarter less MLP activation memory, bitwise "
              "the same values and gradients (``adapt_model``). ``False`` keeps the model's own MLP forward. A model "
              "passed as ``model`` gets its own forwards back at teardown (and its attention implementation: "
              "``sdpa_varlen`` or a GPU's flash attention are the module's choice), and the switch again at the next "
              "setup.")
    activation_offloading: bool = knob(False, "keep activations saved for backward in pinned CPU memory (CUDA; on CPU "
                                              "it has no effect, which the fit-start line says).")


class ModelBuilding:
    """``PolicyModule``'s model seam: build the policy lazily (``configure_model``) and prepare it (dropout, activation
    checkpointing, adaptations, LoRA, compile)."""

    def configure_model(self) -> None:
        """Build the policy lazily, so strategies (FSDP, DeepSpeed) can shard it as it is created."""
        if self.model is not None:
            return
        model = self.knobs.model
        self.check_layout_before_loading()
        with torch.inference_mode(False):  # validate() before fit() calls this under inference mode
            self.model = load_causal_lm(self.model_name_or_path, from_config=model.from_config,
                                        init_kwargs=model.model_init_kwargs, trust_remote_code=model.trust_remote_code)
            self._prepare_model()

    def check_layout_before_loading(self) -> None:
        """Fitting a batch layout other than plain padded rows: measure it on the model's class and config (built
        on the meta device: no weights) before the weights load, so a refusal costs seconds, not a model load. The
        same check runs again at fit start on the loaded model (``check_model_layout``; its verdict is then read
        from the cache)."""
        from lightalign.hub import meta_causal_lm
        from lightalign.modules.adaptations import check_layout
        from lightalign.modules.adaptations.attention import use_varlen_sdpa
        from lightalign.modules.adaptations.support import PADDED_LAYOUTS

        if self._trainer is None or getattr(self.trainer, "datamodule", None) is None:
            return
        layout, longest = self.batch_layout()
        if layout in PADDED_LAYOUTS:
            return
        model = self.knobs.model
        meta = meta_causal_lm(self.model_name_or_path, model.model_init_kwargs, model.trust_remote_code)
        if meta is not None:
            use_varlen_sdpa(meta)  # as adapt_model does for the real model
            check_layout(meta, layout, max_tokens=longest, precision=self.trainer.precision)

    def _prepare_model(self) -> None:
        from lightalign.hub import is_vision_language_config
        from lightalign.modules.training.vision_model import excluding_frozen, freeze_vision

        compute, peft_config = self.knobs.compute, self.knobs.model.peft_config
        # a vision-language policy (AutoModelForImageTextToText): its export holds the processor, its card says so
        self.is_vision_language = is_vision_language_config(getattr(self.model, "config", None))
        self.frozen_vision_parameters = freeze_vision(self.model, self.knobs.vision_model)
        self.model.train()  # from_pretrained returns eval mode; Lightning keeps submodule modes as they are
        if self.knobs.dropout.disable_dropout:
            from lightalign.modules.training.dropout import disable_dropout_in_model

            self.dropout_report = disable_dropout_in_model(self.model)
        if compute.gradient_checkpointing:
            enable_activation_checkpointing(self.model)
        # model adaptations: Liger or MLP recompute, sdpa -> sdpa_varlen; each is exact where it is applied, and the
        # layout of the run is checked against the model at fit start (check_model_layout)
        self.adaptations = adapt_model(self.model, recompute_mlp=compute.recompute_mlp_activation,
                                       liger=compute.use_liger_kernel)
        self.lean_mlps = self.adaptations.mlps_switched
        if peft_config is not None and not is_peft_model(self.model):
            prepare_quantized_base(self.model)  # QLoRA
            self.model = apply_peft(self.model, excluding_frozen(peft_config, self.model, self.knobs.vision_model))
        if compute.torch_compile:
            from lightalign.modules.training.acceleration import compile_model

            compile_model(self.model, compute.torch_compile)


def _has_weights(name_or_path: str) -> bool:
    """Whether a local model folder holds weight files (safetensors or PyTorch bins)."""
    folder = Path(name_or_path)
    return folder.is_dir() and any(any(folder.glob(p)) for p in ("*.safetensors", "pytorch_model*.bin"))
