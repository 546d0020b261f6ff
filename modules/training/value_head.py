"""PPO's value function: a scalar head on the policy's last hidden state (as TRL's
``AutoModelForCausalLMWithValueHead``), fed from the same forward as the log-probs.

The hidden states are read at the input of the policy's output embedding (``lm_head``) by a forward pre-hook
during ``policy_forward``: the positions the logits are computed at, so ``values[:, t]`` is the value of the state
that samples completion token ``t``, the position of ``logps[:, t]``. No second forward, no ``output_hidden_states``
(which would keep every layer's states).

The head is saved beside the Hugging Face export as ``value_head.safetensors`` (``weight [1, H]``, ``bias [1]``)
and ``value_head.json``; the export folder itself stays an ordinary causal-LM folder. A separate value network
(``PPOModule(value_model_name_or_path=...)``: a causal LM whose last hidden state feeds the head) is saved in its
``value_model/`` subfolder.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch

from lightalign.knobs import KnobGroup, knob
from lightalign.modules.training.rollout_forward import grpo_forward

__all__ = ["VALUE_HEAD_FILE", "ValueHead", "ValueModelKnobs", "find_hidden_size", "hidden_size_from_folder",
           "load_value_head", "policy_forward"]

VALUE_HEAD_FILE = "value_head.safetensors"
_HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model", "dim", "word_embed_proj_dim")


@dataclasses.dataclass(frozen=True)
class ValueModelKnobs(KnobGroup):
    """The network whose last hidden state feeds the value head (default: the policy's own)."""

    group = "value_model"
    value_model_name_or_path: str | None = knob(
        None, "a separate value network (a causal LM, loaded like the policy, ``from_config`` included) whose last "
              "hidden state feeds the value head, as newer PPO implementations use; trained by the value loss alone, "
              "checkpointed, exported to ``hf_model/value_model``. Default: the head sits on the policy's own hidden "
              "state.")
    value_model_init_kwargs: dict[str, Any] | None = knob(None, "``from_pretrained`` arguments of the value network.")


def find_hidden_size(config: Any, model: torch.nn.Module | None = None) -> int | None:
    """The width of the last hidden state: a config field (also a multimodal model's ``text_config``), else the
    input width of the model's output embedding; None when neither tells."""
    for cfg in (config, getattr(config, "text_config", None)):
        if cfg is None:
            continue
        get = cfg.get if isinstance(cfg, dict) else (lambda k, c=cfg: getattr(c, k, None))
        for key in _HIDDEN_KEYS:
            value = get(key)
            if isinstance(value, int) and value > 0:
                return value
        if isinstance(cfg, dict) and isinstance(cfg.get("text_config"), dict):
            return find_hidden_size(cfg["text_config"])
    if model is not None and hasattr(model, "get_output_embeddings"):
        head = model.get_output_embeddings()
        if isinstance(getattr(head, "in_features", None), int):
            return head.in_features
    return None


def hidden_size_from_folder(path: str | os.PathLike) -> int | None:
    """``find_hidden_size`` of a local model folder's ``config.json``; None when it is not a local folder."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    size = find_hidden_size(json.loads(config.read_text()))
    if size is None:
        raise unknown_architecture(str(path), json.loads(config.read_text()).get("architectures"))
    return size


def unknown_architecture(name: str, architectures: Any) -> ValueError:
    return ValueError(
        f"PPOModule's value head: cannot find the hidden size of model '{name}' (architectures {architectures}): its "
        f"config has none of {list(_HIDDEN_KEYS)} and it has no linear output embedding. Choose another "
        "model_name_or_path (or value_model_name_or_path, the network under the value head), or add the width of "
        "its last hidden state to its config.json as hidden_size.")


class ValueHead(torch.nn.Module):
    """``V(h) = h @ weight.T + bias``: one linear map from the last hidden state to a scalar, in float32."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.hidden_size = int(hidden_size)
        self.summary = torch.nn.Linear(self.hidden_size, 1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.summary(hidden.to(self.summary.weight.dtype)).squeeze(-1)

    def whole_tensors(self) -> dict[str, torch.Tensor]:
        """``weight`` and ``bias`` whole, on the CPU in float32 (gathered when sharded: call on every rank)."""
        return {k: _whole(v).detach().to("cpu", torch.float32).contiguous() for k, v in
                (("weight", self.summary.weight), ("bias", self.summary.bias))}

    def save(self, folder: str | os.PathLike, tensors: dict[str, torch.Tensor] | None = None) -> None:
        """``value_head.safetensors`` and ``value_head.json`` into ``folder`` (``tensors``: ``whole_tensors()``'s)."""
        from safetensors.torch import save_file

        folder = Path(folder)
        tensors = tensors if tensors is not None else self.whole_tensors()
        save_file(tensors, str(folder / VALUE_HEAD_FILE))
        (folder / "value_head.json").write_text(json.dumps({
            "hidden_size": self.hidden_size, "file": VALUE_HEAD_FILE, "written_by": "lightalign.PPOModule",
            "formula": "value = last_hidden_state @ weight.T + bias (the input of the causal LM's output embedding)",
        }, indent=2) + "\n")


def _whole(param: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a parameter: FSDP2 shards it (a DTensor), DeepSpeed ZeRO-3 partitions it (``ds_id``)."""
    if hasattr(param, "full_tensor"):
        return param.full_tensor()
    if hasattr(param, "ds_id"):
        import deepspeed

        with deepspeed.zero.GatheredParameters([param]):
            return param.data.clone()
    return param


def load_value_head(folder: str | os.PathLike) -> ValueHead:
    """The value head saved beside an export by ``ValueHead.save``."""
    from safetensors.torch import load_file

    folder = Path(folder)
    meta = json.loads((folder / "value_head.json").read_text())
    head = ValueHead(meta["hidden_size"])
    tensors = load_file(str(folder / VALUE_HEAD_FILE))
    with torch.no_grad():
        head.summary.weight.copy_(tensors["weight"])
        head.summary.bias.copy_(tensors["bias"])
    return head


def _values_of(model: torch.nn.Module, value_head: ValueHead, mb: dict[str, Any], temperature: float, forward):
    """Run ``forward`` (a ``grpo_forward`` call on ``model``) and the value head on the hidden states it fed into
    ``model``'s output embedding."""
    captured: list[torch.Tensor] = []
    handle = model.get_output_embeddings().register_forward_pre_hook(lambda module, args: captured.append(args[0]))
    try:
        out = forward()
    finally:
        handle.remove()
    if len(captured) != 1:
        raise RuntimeError(f"PPOModule's value head expected the output embedding to run once per forward, it ran "
                           f"{len(captured)} times; this model family is not supported by the value head.")
    t = mb["completion_ids"].shape[1]
    return out, value_head(captured[0][:, -(t + 1):-1])


def policy_forward(model: torch.nn.Module, value_head: ValueHead, mb: dict[str, Any], temperature: float = 1.0,
                   value_model: torch.nn.Module | None = None):
    """One forward of a (padded) GRPO micro-batch: per-token log-probs ``[B, T]`` of the completion tokens, the
    logits they came from, and the values ``[B, T]`` of the states sampling them. With ``value_model`` the values
    come from that model's own forward of the same rows (a separate value network) instead of the policy's."""
    if value_model is None:
        (logps, logits, _), values = _values_of(model, value_head, mb, temperature,
                                                lambda: grpo_forward(model, mb, temperature))
        return logps, logits, values
    logps, logits, _ = grpo_forward(model, mb, temperature)
    _, values = _values_of(value_model, value_head, mb, temperature, lambda: grpo_forward(value_model, mb, temperature))
    return logps, logits, values
