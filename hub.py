"""Resolving model and tokenizer names: a local folder or a Hugging Face hub name, with clear errors.

Everything that turns a user-supplied name or path into a tokenizer or a model goes through here, so that
"not found" reads the same everywhere and says what to do when the hub cannot be reached.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch


class ModelNotFoundError(OSError):
    """A model or tokenizer name that is neither a local folder nor reachable on the hub."""


def _hub_unreachable_hint(name: str) -> str:
    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
    why = "HF_HUB_OFFLINE is set" if offline else "the Hugging Face hub could not be reached or has no such repository"
    return (
        f"'{name}' is not a local folder, and {why}. "
        "Point at a local folder that holds config.json (and tokenizer files), e.g. "
        "`--model.model_name_or_path /path/to/model`, or download it where there is network "
        f"(`hf download {name} --local-dir ./{Path(name).name}`) and use that folder."
    )


def _check_local_folder(name: str, what: str) -> None:
    path = Path(name).expanduser()
    if name.startswith((".", "/", "~")) and not path.exists():
        raise ModelNotFoundError(f"{what} folder '{name}' does not exist (resolved to '{path.resolve()}').")
    if path.is_file():
        raise ModelNotFoundError(f"{what} path '{name}' is a file; pass the folder that holds config.json.")


def _remote_code_error(name: str, err: Exception) -> ValueError:
    return ValueError(
        f"'{name}' ships its own Python code (auto_map in its config) and lightalign does not run downloaded code "
        "unless asked. If you trust its source, set `model.trust_remote_code: true` (and review the code first); "
        f"otherwise use a model that transformers supports natively. (transformers said: {str(err)[:200]})"
    )


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False, **kwargs: Any):
    """Load a tokenizer from a local folder or a hub name; make sure it has a pad token."""
    from transformers import AutoTokenizer

    _check_local_folder(name_or_path, "Tokenizer")
    try:
        tok = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code, **kwargs)
    except ValueError as err:
        if "trust_remote_code" in str(err):
            raise _remote_code_error(name_or_path, err) from err
        raise
    except OSError as err:
        if Path(name_or_path).expanduser().is_dir():
            raise ModelNotFoundError(
                f"Could not load a tokenizer from folder '{name_or_path}': {err}. "
                "The folder needs tokenizer.json or the tokenizer files of a Hugging Face model."
            ) from err
        raise ModelNotFoundError(_hub_unreachable_hint(name_or_path) + f" (transformers said: {err})") from err
    if tok.pad_token is None:
        # Same choice as TRL: pad with EOS; padded positions are masked out of every loss.
        tok.pad_token = tok.eos_token
    return tok


_DTYPE_KEYS = ("dtype", "torch_dtype")


def normalize_init_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """Turn YAML-friendly values into what ``from_pretrained`` wants (e.g. ``"bfloat16"`` -> ``torch.bfloat16``)."""
    kwargs = dict(kwargs or {})
    for key in _DTYPE_KEYS:
        if key in kwargs:
            value = kwargs.pop(key)
            if isinstance(value, str) and value != "auto":
                name = value.removeprefix("torch.")
                dtype = getattr(torch, name, None)
                if not isinstance(dtype, torch.dtype):
                    raise ValueError(
                        f"model_init_kwargs.{key}='{value}' is not a torch dtype; use e.g. bfloat16, float16, float32 or auto."
                    )
                value = dtype
            kwargs["dtype"] = value
    return kwargs


def load_causal_lm(
    name_or_path: str,
    from_config: bool = False,
    init_kwargs: dict[str, Any] | None = None,
    trust_remote_code: bool = False,
):
    """Build an ``AutoModelForCausalLM``: pretrained weights, or random weights from the config (``from_config``)."""
    from transformers import AutoModelForCausalLM

    return load_model(AutoModelForCausalLM, name_or_path, from_config, init_kwargs, trust_remote_code)


def load_model(
    auto_class: Any,
    name_or_path: str,
    from_config: bool = False,
    init_kwargs: dict[str, Any] | None = None,
    trust_remote_code: bool = False,
    config_overrides: dict[str, Any] | None = None,
    loading_info: dict[str, Any] | None = None,
):
    """Build a model of a transformers auto class (``AutoModelForCausalLM``, ``AutoModelForSequenceClassification``)
    with the errors of ``load_causal_lm``. ``config_overrides`` are set on the config (e.g. ``num_labels``);
    ``loading_info``, when given, receives transformers' loading report (``missing_keys`` …) of pretrained weights."""
    from transformers import AutoConfig

    kwargs = normalize_init_kwargs(init_kwargs)
    overrides = dict(config_overrides or {})
    _check_local_folder(name_or_path, "Model")
    try:
        if from_config:
            config_kwargs = {k: kwargs.pop(k) for k in ("revision",) if k in kwargs}
            config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code, **config_kwargs,
                                                **overrides)
            attn = kwargs.pop("attn_implementation", None)
            if attn is not None:
                config._attn_implementation = attn
            dtype = kwargs.pop("dtype", None)
            if kwargs:
                raise ValueError(
                    f"model_init_kwargs {sorted(kwargs)} have no meaning with from_config=True "
                    "(only dtype, attn_implementation and revision apply)."
                )
            model = auto_class.from_config(config, trust_remote_code=trust_remote_code)
            if isinstance(dtype, torch.dtype):
                model = model.to(dtype)
            return model
        if loading_info is None:
            return auto_class.from_pretrained(name_or_path, trust_remote_code=trust_remote_code, **overrides, **kwargs)
        model, info = auto_class.from_pretrained(name_or_path, trust_remote_code=trust_remote_code, **overrides,
                                                 output_loading_info=True, **kwargs)
        loading_info.update(info)
        return model
    except ValueError as err:
        if "trust_remote_code" in str(err):
            raise _remote_code_error(name_or_path, err) from err
        if "does not support an attention implementation" in str(err):
            attn = (init_kwargs or {}).get("attn_implementation")
            raise ValueError(
                f"'{name_or_path}' cannot run attn_implementation '{attn}' (model_init_kwargs): {err.args[0].split('.')[0]}. "
                "Set model.init_args.model_init_kwargs.attn_implementation to eager (or remove it: transformers then "
                "picks what the model supports)."
            ) from err
        raise
    except OSError as err:
        if Path(name_or_path).expanduser().is_dir():
            raise ModelNotFoundError(f"Could not load a model from folder '{name_or_path}': {err}") from err
        raise ModelNotFoundError(_hub_unreachable_hint(name_or_path) + f" (transformers said: {err})") from err
