"""LoRA (peft), QLoRA (LoRA on a bitsandbytes-quantized base) and activation checkpointing: how the policy is
wrapped before training (``PolicyModule``)."""

from __future__ import annotations

from typing import Any

import torch


def apply_peft(model: torch.nn.Module, peft_config: Any) -> torch.nn.Module:
    """Wrap ``model`` with LoRA (or any peft config); only the adapter parameters stay trainable."""
    try:
        import peft
    except ImportError as err:
        raise ImportError("peft_config needs the peft package: pip install 'lightalign[peft]'") from err
    if isinstance(peft_config, dict):
        cfg = dict(peft_config)
        cfg.setdefault("task_type", "CAUSAL_LM")
        peft_type = cfg.pop("peft_type", "LORA").upper()
        config_cls = {"LORA": peft.LoraConfig}.get(peft_type)
        if config_cls is None:
            raise ValueError(f"peft_config.peft_type '{peft_type}' is not supported from YAML; use LORA or pass a peft config object.")
        peft_config = config_cls(**cfg)
    return peft.get_peft_model(model, peft_config)


def check_quantized_policy(model_init_kwargs: dict[str, Any] | None, peft_config: Any, from_config: bool) -> None:
    """Before any weight loads: a policy loaded through ``model_init_kwargs.quantization_config`` trains only as QLoRA.

    Quantized weights take no gradient, so without ``peft_config`` only the few unquantized tensors (embeddings,
    norms, biases) would train, silently; ``from_config`` builds random float weights and quantizes nothing; and
    bitsandbytes must be importable (the ``bnb`` extra). Each is refused in one line naming the knob."""
    qc = (model_init_kwargs or {}).get("quantization_config")
    if qc is None:
        return
    if from_config:
        raise ValueError("model_init_kwargs.quantization_config quantizes pretrained weights as they load; with "
                         "from_config: true there are none. Save the model to a folder and set from_config: false.")
    if peft_config is None:
        raise ValueError("model_init_kwargs.quantization_config loads the policy quantized, and quantized weights "
                         "cannot be trained: set peft_config (QLoRA, e.g. {r: 16, lora_alpha: 32, target_modules: "
                         "all-linear}) or remove the quantization_config.")
    if isinstance(qc, dict) and (qc.get("load_in_4bit") or qc.get("load_in_8bit")):
        try:
            import bitsandbytes  # noqa: F401
        except ImportError as err:
            raise ImportError("model_init_kwargs.quantization_config needs bitsandbytes: "
                              "pip install 'lightalign[bnb]'") from err


def is_bnb_quantized(model: torch.nn.Module) -> bool:
    """Whether ``model`` was loaded 8-bit or 4-bit by bitsandbytes (``model_init_kwargs.quantization_config``)."""
    return str(getattr(getattr(model, "quantization_method", None), "value", "")) == "bitsandbytes"


def disable_cpu_4bit_repacking(model: torch.nn.Module) -> None:
    """Keep bitsandbytes' 4-bit weights in their trainable layout.

    On CPUs with AVX512-BF16, ``bitsandbytes.nn.Linear4bit`` (0.50) repacks its weight *in place* into an
    inference-only layout at the first forward in eval mode without gradients (Lightning's sanity-check validation,
    any ``eval()`` + ``no_grad`` forward). Every later forward, training ones included, then takes the inference
    kernel (``gemv_4bit``: computed in bfloat16 whatever ``bnb_4bit_compute_dtype`` says, no backward, its bias added
    in place), so the next training step fails with "a view of a leaf Variable that requires grad is being used in an
    in-place operation". A model that trains, or a frozen reference that gains nothing from it, turns it off."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def prepare_quantized_base(model: torch.nn.Module) -> bool:
    """QLoRA: ready a bitsandbytes-quantized base for LoRA before ``apply_peft``; False (nothing done) otherwise.

    Every base parameter is frozen, the biases of the quantized linears included (only the adapters train, so the
    exported adapter folder is everything training changed), and the 4-bit weights stay in their trainable layout
    (``disable_cpu_4bit_repacking``). Unlike peft's ``prepare_model_for_kbit_training``, nothing is upcast (the
    unquantized layers keep ``model_init_kwargs.dtype``) and activation checkpointing stays lightalign's own
    (non-reentrant, ``gradient_checkpointing``), which needs no ``enable_input_require_grads``."""
    if not is_bnb_quantized(model):
        return False
    for param in model.parameters():
        param.requires_grad_(False)
    disable_cpu_4bit_repacking(model)
    return True


def drop_quantization_state(module: torch.nn.Module, state_dict: dict[str, Any]) -> None:
    """Resume of a QLoRA run: remove from a checkpoint's ``state_dict`` the quantization state bitsandbytes writes
    beside each 4-bit weight (``<weight>.absmax``, ``.quant_map``, ``.quant_state.bitsandbytes__nf4`` …), which
    ``load_state_dict`` rejects as unexpected keys. The frozen base it describes was quantized again, identically,
    from ``model_name_or_path`` when the resumed run built its model; the packed weights themselves still load."""
    prefixes = tuple(f"{name}." for name, param in module.named_parameters() if hasattr(param, "quant_state"))
    if prefixes:
        for key in [k for k in state_dict if k.startswith(prefixes)]:
            del state_dict[key]


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Non-reentrant activation (gradient) checkpointing; transformers 5 renamed the method."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.config.use_cache = False


def is_peft_model(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "merge_and_unload")
