"""A reward model (``AutoModelForSequenceClassification``) as a reward function with TRL's signature."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

__all__ = ["RewardModel", "is_conversational"]


def is_conversational(value: Any) -> bool:
    """True for a list of messages (dicts with a ``role``), the conversational prompt/completion form."""
    return isinstance(value, list) and len(value) > 0 and isinstance(value[0], dict) and "role" in value[0]


class RewardModel:
    """Scores ``prompt + completion`` with a sequence-classification model; the reward is ``logits[:, 0]``.

    Like TRL's GRPOTrainer: conversational prompts and completions are joined and rendered with the reward
    tokenizer's chat template, strings are concatenated; texts are tokenized without special tokens and padded
    on the right. The model and tokenizer load lazily on the first call (eval mode, no grad). ``max_length``
    truncates from the left (the completion end is kept); None means no truncation, as in TRL.

    Args:
        name_or_path: local folder or hub name of the reward model.
        batch_size: texts scored per forward pass.
        device: where to run it; None picks CUDA when available, else CPU.
        tokenizer: tokenizer name or path when it differs from ``name_or_path``.
        dtype: e.g. ``"bfloat16"``; None keeps the checkpoint's.
        name: metric name; defaults to the last component of ``name_or_path``.
    """

    def __init__(
        self,
        name_or_path: str,
        batch_size: int = 8,
        device: str | torch.device | None = None,
        max_length: int | None = None,
        tokenizer: str | None = None,
        dtype: str | torch.dtype | None = None,
        trust_remote_code: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        name: str | None = None,
    ):
        if batch_size < 1:
            raise ValueError(f"RewardModel batch_size must be >= 1, got {batch_size}.")
        self.name_or_path = str(name_or_path)
        self.batch_size = int(batch_size)
        self.device = torch.device(device) if device is not None else None
        self.max_length = max_length
        self.tokenizer_name = tokenizer or self.name_or_path
        self.dtype = dtype
        self.trust_remote_code = trust_remote_code
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.__name__ = name or Path(self.name_or_path.rstrip("/")).name or "reward_model"
        self.model = None
        self.tokenizer = None

    def __repr__(self) -> str:
        return f"RewardModel({self.name_or_path!r}, name={self.__name__!r})"

    def to(self, device: str | torch.device) -> RewardModel:
        """Run on ``device`` from now on (moves the model if it is loaded)."""
        self.device = torch.device(device)
        if self.model is not None:
            self.model.to(self.device)
        return self

    def check(self) -> RewardModel:
        """Read the folder's (or hub name's) config.json now, before any model loads: a name that cannot be found
        and a folder that is no sequence-classification model (a causal LM has no score head) fail here."""
        from transformers import AutoConfig

        from lightalign.hub import ModelNotFoundError, _hub_kwargs, _hub_unreachable_hint, _remote_code_error

        try:
            config = AutoConfig.from_pretrained(self.name_or_path, trust_remote_code=self.trust_remote_code,
                                                **_hub_kwargs(self.name_or_path))
        except ValueError as err:
            if "trust_remote_code" in str(err):
                raise _remote_code_error(self.name_or_path, err) from err
            raise
        except OSError as err:
            hint = _hub_unreachable_hint(self.name_or_path, "`--model.reward_funcs '[/path/to/reward_model]'`")
            raise ModelNotFoundError(f"Reward model: {hint} (transformers said: {str(err)[:300]})") from err
        architectures = list(getattr(config, "architectures", None) or [])
        if architectures and not any(a.endswith("ForSequenceClassification") for a in architectures):
            raise ValueError(_no_score_head(self.name_or_path, f"its config.json names {architectures}"))
        return self

    def load(self) -> RewardModel:
        """Load the tokenizer and the model now (otherwise the first call does)."""
        if self.model is not None:
            return self
        from transformers import AutoModelForSequenceClassification

        from lightalign.hub import ModelNotFoundError, load_tokenizer, normalize_init_kwargs

        tokenizer = load_tokenizer(self.tokenizer_name, trust_remote_code=self.trust_remote_code)
        tokenizer.padding_side, tokenizer.truncation_side = "right", "left"
        kwargs = normalize_init_kwargs({"dtype": self.dtype} if self.dtype is not None else {})
        from lightalign.strategies.sharding import loading_whole

        try:
            with loading_whole():  # ZeRO-3: whole on every rank (DeepSpeed never wraps it)
                model, info = AutoModelForSequenceClassification.from_pretrained(
                    self.name_or_path, num_labels=1, trust_remote_code=self.trust_remote_code,
                    output_loading_info=True, **kwargs
                )
        except OSError as err:
            raise ModelNotFoundError(
                f"Could not load reward model '{self.name_or_path}' (a folder with config.json and weights, or a "
                f"hub name reachable from here): {err}"
            ) from err
        new_head = [k for k in info.get("missing_keys", []) if k.split(".")[0] in ("score", "classifier")]
        if new_head:
            raise ValueError(_no_score_head(self.name_or_path, f"its weights lack {sorted(new_head)}; architectures "
                                                               f"{getattr(model.config, 'architectures', None)}"))
        # The classifier reads the score at the last non-pad token, so the model must know the pad id.
        model.config.pad_token_id = tokenizer.pad_token_id
        if self.device is None:
            self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model, self.tokenizer = model.to(self.device).eval().requires_grad_(False), tokenizer
        return self

    def texts(self, prompts: list, completions: list) -> list[str]:
        """The texts the model scores: chat-template renderings or plain concatenations."""
        out = []
        for prompt, completion in zip(prompts, completions, strict=True):
            if is_conversational(prompt) or is_conversational(completion):
                if isinstance(prompt, str):
                    prompt = [{"role": "user", "content": prompt}]
                if isinstance(completion, str):
                    completion = [{"role": "assistant", "content": completion}]
                out.append(
                    self.tokenizer.apply_chat_template(
                        list(prompt) + list(completion), tokenize=False, **self.chat_template_kwargs
                    )
                )
            else:
                out.append(prompt + completion)
        return out

    @torch.inference_mode()
    def __call__(self, prompts: list, completions: list, **kwargs: Any) -> list[float]:
        self.load()
        texts = self.texts(prompts, completions)
        rewards: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(
                texts[start : start + self.batch_size],
                return_tensors="pt",
                padding=True,
                truncation=self.max_length is not None,
                max_length=self.max_length,
                add_special_tokens=False,
            ).to(self.device)
            logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            rewards.extend(logits[:, 0].float().cpu().tolist())
        return rewards


def _no_score_head(name_or_path: str, detail: str) -> str:
    return (f"Reward model '{name_or_path}' has no score head ({detail}): transformers would put a random head on "
            "it and its rewards would be noise. reward_funcs needs a sequence-classification folder: train one with "
            "lightalign.RewardModule (e.g. lightalign fit --config configs/reward_tiny.yaml) and name its hf_model "
            "export.")
