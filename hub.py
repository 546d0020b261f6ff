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


def _offline_env() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("0", "", "false", "no", "off")


_HUB_REACHABLE: dict[str, bool] = {}


def hub_reachable(timeout: float = 2.0) -> bool:
    """Whether the Hugging Face hub's host accepts a connection (one short TCP connect per process).

    Without network, transformers retries for about a minute before giving up; this check lets a hub name fail (or
    load from the local cache) at once. Behind an HTTP(S) proxy the direct connect says nothing, so it is skipped.
    """
    from urllib.parse import urlparse

    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    if endpoint not in _HUB_REACHABLE:
        if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")):
            _HUB_REACHABLE[endpoint] = True
        else:
            import socket

            url = urlparse(endpoint)
            port = url.port or (443 if url.scheme == "https" else 80)
            try:
                socket.create_connection((url.hostname, port), timeout=timeout).close()
                _HUB_REACHABLE[endpoint] = True
            except OSError:  # no route, no DNS, refused, timed out
                _HUB_REACHABLE[endpoint] = False
    return _HUB_REACHABLE[endpoint]


def _hub_kwargs(name: str) -> dict[str, Any]:
    """``local_files_only=True`` for a hub name when the hub cannot be reached: the local cache answers at once."""
    if Path(name).expanduser().exists() or _offline_env() or hub_reachable():
        return {}
    return {"local_files_only": True}


def _hub_unreachable_hint(name: str, example: str = "`--model.model_name_or_path /path/to/model`") -> str:
    if _looks_like_a_path(name):
        return (f"There is no folder '{name}' (looked in {Path.cwd()}), and a path like it is not a Hugging Face hub "
                "name. Check the path; if it is another run's export (e.g. runs/<name>/hf_model), run that config "
                "first.")
    if _offline_env():
        why = "HF_HUB_OFFLINE is set"
    elif not hub_reachable():
        why = "the Hugging Face hub cannot be reached (no network) and it is not in the local cache"
    else:
        why = "the Hugging Face hub has no such repository (or it is private)"
    return (
        f"'{name}' is not a local folder, and {why}. "
        f"Point at a local folder that holds config.json (and tokenizer files), e.g. {example}, or download it "
        "where there is network "
        f"(`hf download {name} --local-dir ./{Path(name).name}`) and use that folder."
    )


def _looks_like_a_path(name: str) -> bool:
    """A name that can only be a local path: it starts with ``.``, ``/`` or ``~``, or has more than one ``/`` (a hub
    name is ``org/name``)."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1


def _check_local_folder(name: str, what: str, knob: str | None = None) -> None:
    """A name that can only be a path (``_looks_like_a_path``) must be an existing folder; ``knob`` (the argument that
    names it) is said first."""
    path = Path(name).expanduser()
    said = f"{knob}: " if knob else ""
    if _looks_like_a_path(name) and not path.exists():
        export = " If it is another run's export (runs/<name>/version_N/hf_model), run that config first." \
            if path.name == "hf_model" else ""
        raise ModelNotFoundError(f"{said}{what} folder '{name}' does not exist (resolved to '{path.resolve()}')."
                                 + export)
    if path.is_file():
        raise ModelNotFoundError(f"{said}{what} path '{name}' is a file; pass the folder that holds config.json.")


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
        tok = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code,
                                            **{**_hub_kwargs(name_or_path), **kwargs})
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


def is_vision_language_config(config: Any) -> bool:
    """Whether a transformers config is one ``AutoModelForImageTextToText`` builds (a model that reads images)."""
    from transformers import AutoModelForImageTextToText

    return type(config) in AutoModelForImageTextToText._model_mapping and hasattr(config, "vision_config")


def is_vision_language_model(name_or_path: str, trust_remote_code: bool = False, revision: str | None = None) -> bool:
    """Whether the model named by a folder or hub name is a vision-language model (reads its config only)."""
    from transformers import AutoConfig

    kwargs = {"revision": revision} if revision else {}
    config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code,
                                        **_hub_kwargs(name_or_path), **kwargs)
    return is_vision_language_config(config)


def load_causal_lm(
    name_or_path: str,
    from_config: bool = False,
    init_kwargs: dict[str, Any] | None = None,
    trust_remote_code: bool = False,
):
    """Build an ``AutoModelForCausalLM`` — or, for a vision-language model's config, an
    ``AutoModelForImageTextToText`` (the class that reads images; ``AutoModelForCausalLM`` has no class for most of
    them) — with pretrained weights, or random weights from the config (``from_config``)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    revision = normalize_init_kwargs(init_kwargs).get("revision")
    _check_local_folder(name_or_path, "Model")
    try:
        vision = is_vision_language_model(name_or_path, trust_remote_code, revision)
    except (OSError, ValueError):  # no readable config: load_model raises the error that names the folder or hub
        vision = False
    auto_class = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    return load_model(auto_class, name_or_path, from_config, init_kwargs, trust_remote_code)


def meta_causal_lm(name_or_path: str, init_kwargs: dict[str, Any] | None = None, trust_remote_code: bool = False):
    """The ``AutoModelForCausalLM`` that ``load_causal_lm`` would build, on the meta device: its class, config and
    attention implementation, no weights read or allocated (what the layout probe needs before the real load).
    None for models that ship their own code (their classes may not build on the meta device), under DeepSpeed
    ZeRO-3, and when the model cannot run the asked attention implementation (the real load then says so in one
    line)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations import is_deepspeed_zero3_enabled

    if trust_remote_code or is_deepspeed_zero3_enabled():  # ZeRO-3 would partition (and initialise) it as it is built
        return None
    kwargs = normalize_init_kwargs(init_kwargs)
    _check_local_folder(name_or_path, "Model")
    config = AutoConfig.from_pretrained(name_or_path, **_hub_kwargs(name_or_path),
                                        **{k: kwargs[k] for k in ("revision",) if k in kwargs})
    if type(config) not in AutoModelForCausalLM._model_mapping:
        return None
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, attn_implementation=kwargs.get("attn_implementation"))
    except ValueError as err:
        if "does not support an attention implementation" in str(err):
            return None  # load_causal_lm raises the one-line error naming the knob
        raise


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
    if not from_config:
        check_weights(name_or_path, kwargs)
    try:
        if from_config:
            config_kwargs = {k: kwargs.pop(k) for k in ("revision",) if k in kwargs}
            config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code,
                                                **_hub_kwargs(name_or_path), **config_kwargs, **overrides)
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
        kwargs = {**_hub_kwargs(name_or_path), **kwargs}
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


# Weight files ``from_pretrained`` reads (sharded checkpoints have an index beside their shards).
_WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "*.bin.index.json",
                    "tf_model.h5", "flax_model.msgpack", "*.gguf", "model.ckpt.index")


def check_weights(name_or_path: str, init_kwargs: dict[str, Any] | None = None) -> None:
    """A local model folder has weights, and its safetensors files are whole; checked before any data is tokenized.

    A hub name is left to transformers. Every ``.safetensors`` header is read (a few KB): a file that is shorter
    than its header says (an interrupted copy) or whose header is garbage fails here, naming the file.
    """
    folder = Path(name_or_path).expanduser()
    subfolder = (init_kwargs or {}).get("subfolder")
    if subfolder:
        folder = folder / subfolder
    if not folder.is_dir() or (init_kwargs or {}).get("gguf_file"):
        return
    weights = sorted({p for pattern in _WEIGHT_PATTERNS for p in folder.glob(pattern)})
    if not weights:
        raise ModelNotFoundError(
            f"Model folder '{name_or_path}' has no weights: none of model.safetensors, model-*-of-*.safetensors, "
            "pytorch_model.bin (or their .index.json) is there, only "
            f"{sorted(p.name for p in folder.iterdir())[:8]}. Copy the weight files into it, or train from random "
            "weights built from its config.json with `--model.from_config true` (from_config=True)."
        )
    for path in weights:
        if path.suffix == ".safetensors":
            check_safetensors(path)


def check_safetensors(path: Path) -> None:
    """Raise ``ModelNotFoundError`` naming ``path`` unless its header parses and its size matches the header."""
    import json
    import struct

    size = path.stat().st_size
    problem = None
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            problem = f"it has {size} bytes, fewer than a safetensors header"
        else:
            (length,) = struct.unpack("<Q", head)
            if length > size - 8:
                problem = f"its header claims {length} bytes but the file has {size}"
            else:
                try:
                    header = json.loads(f.read(length))
                    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
                except (ValueError, TypeError, KeyError, IndexError, AttributeError) as err:
                    problem = f"its header is not valid safetensors JSON ({type(err).__name__})"
                else:
                    expected = 8 + length + max(ends, default=0)
                    if size < expected:
                        problem = f"it has {size} bytes but its tensors need {expected}: it is truncated"
    if problem is not None:
        raise ModelNotFoundError(
            f"Weight file '{path}' is corrupt or truncated: {problem}. Copy or download it again (an interrupted copy "
            "leaves such a file)."
        )
