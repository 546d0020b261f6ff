"""Iterative SFT: one optimisation step at a time, driven by the user's own loop (generate, filter, train).

``IterativeSFT`` holds an ``SFTModule`` (the same loss, hooks and export as Lightning training) with its optimizer
and schedule, and needs no Trainer::

    trainer = IterativeSFT("my-model", learning_rate=1e-5, max_length=512)
    for _ in range(rounds):
        completions = trainer.generate(prompts, max_new_tokens=64)
        keep = [(p, c) for p, c in zip(prompts, completions) if reward(c) > 0.5]
        stats = trainer.step(texts=[p for p, _ in keep], texts_labels=[c for _, c in keep])
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from lightalign.callbacks.device_cache import free_device_cache
from lightalign.datamodules.collators import IGNORE_INDEX, PaddingCollator
from lightalign.datamodules.sft import truncate
from lightalign.hub import load_tokenizer
from lightalign.modules.sft import SFTModule


class IterativeSFT:
    """Run SFT optimisation steps on batches you build, one ``step`` call at a time.

    Args:
        model: a hub name or folder, a built ``PreTrainedModel``, or an ``SFTModule``.
        tokenizer: a tokenizer or its name (default: ``model`` when it is a name); needed for ``texts`` and
            ``generate``.
        model_init_kwargs: passed to ``from_pretrained`` (``dtype``, ``attn_implementation`` …).
        max_length: sequences longer than this are truncated (``truncation_mode``: ``keep_end`` keeps the last
            tokens, ``keep_start`` the first).
        optimize_device_cache: free the accelerator's cached memory after every step (a no-op on CPU).
        max_grad_norm: gradient clipping by global norm (``None``: off).
        total_steps: the length of the schedule, needed by every ``lr_scheduler_type`` but ``constant``.
        device: where to train (default: CUDA when available, else CPU).
        **module_kwargs: any ``SFTModule`` argument (``learning_rate`` (default 1e-5), ``optim``, ``optimizer``,
            ``peft_config``, ``from_config``, ``neftune_noise_alpha``, ``lr_scheduler_type`` (default constant) …).
    """

    def __init__(
        self,
        model: str | torch.nn.Module | SFTModule,
        tokenizer: Any = None,
        *,
        model_init_kwargs: dict[str, Any] | None = None,
        max_length: int | None = None,
        truncation_mode: str = "keep_end",
        optimize_device_cache: bool = False,
        max_grad_norm: float | None = 1.0,
        total_steps: int | None = None,
        device: str | torch.device | None = None,
        **module_kwargs: Any,
    ) -> None:
        if truncation_mode not in ("keep_start", "keep_end"):
            raise ValueError(f"truncation_mode='{truncation_mode}' is unknown; use keep_start or keep_end.")
        if max_length is not None and max_length < 2:
            raise ValueError(f"max_length must be at least 2 (an input and a next token), got {max_length}.")
        module_kwargs.setdefault("learning_rate", 1e-5)
        module_kwargs.setdefault("lr_scheduler_type", "constant")
        if module_kwargs["lr_scheduler_type"] != "constant" and total_steps is None and "lr_scheduler" not in module_kwargs:
            raise ValueError(f"lr_scheduler_type='{module_kwargs['lr_scheduler_type']}' needs total_steps (the length of the schedule).")
        if isinstance(model, SFTModule):
            self.module = model
        elif isinstance(model, torch.nn.Module):
            self.module = SFTModule(model=model, **module_kwargs)
        else:
            self.module = SFTModule(model, model_init_kwargs=model_init_kwargs, **module_kwargs)
        if isinstance(tokenizer, str) or (tokenizer is None and isinstance(model, str)):
            tokenizer = load_tokenizer(tokenizer or model, trust_remote_code=bool(module_kwargs.get("trust_remote_code")))
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.truncation_mode = truncation_mode
        self.optimize_device_cache = optimize_device_cache
        self.max_grad_norm = max_grad_norm
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.module.configure_model()
        self.module.to(self.device)
        self.optimizer = self.module.create_optimizer()
        self.scheduler = self.module.create_lr_scheduler(self.optimizer, total_steps=total_steps)
        self.global_step = 0
        self.cache_cleanups = 0
        alpha = self.module.knobs.neftune.neftune_noise_alpha
        if alpha:
            from lightalign.modules.training.neftune import NEFTune

            self.module.neftune = NEFTune(self.module.model, alpha).attach()

    @property
    def model(self) -> torch.nn.Module:
        return self.module.model

    # ------------------------------------------------------------------------------------- batch building
    def _need_tokenizer(self, what: str) -> Any:
        if self.tokenizer is None:
            raise ValueError(f"{what} needs a tokenizer: pass tokenizer=... to IterativeSFT.")
        return self.tokenizer

    def _rows_from_ids(self, input_ids, attention_mask, labels) -> list[dict[str, list[int]]]:
        def as_list(x, i):
            row = x[i]
            return row.tolist() if isinstance(row, torch.Tensor) else list(row)

        rows = []
        for i in range(len(input_ids)):
            ids = as_list(input_ids, i)
            keep = as_list(attention_mask, i) if attention_mask is not None else [1] * len(ids)
            lab = as_list(labels, i) if labels is not None else None
            if len(keep) != len(ids) or (lab is not None and len(lab) != len(ids)):
                raise ValueError(f"step(): row {i} has input_ids, attention_mask and labels of different lengths.")
            positions = [j for j, k in enumerate(keep) if k]  # drop padding (left or right)
            ids_kept = [ids[j] for j in positions]
            if lab is None:
                mask = [1] * len(ids_kept)
            else:
                lab_kept = [lab[j] for j in positions]
                bad = [j for j, (t, y) in enumerate(zip(ids_kept, lab_kept)) if y != IGNORE_INDEX and y != t]
                if bad:
                    raise ValueError(
                        f"step(): labels of row {i} differ from its input_ids at position {bad[0]}; for a causal LM the "
                        f"labels are the input ids, with {IGNORE_INDEX} where no loss is wanted."
                    )
                mask = [int(y != IGNORE_INDEX) for y in lab_kept]
            rows.append({"input_ids": ids_kept, "completion_mask": mask})
        return rows

    def _rows_from_texts(self, texts: Sequence[str], texts_labels: Sequence[str] | None) -> list[dict[str, list[int]]]:
        tok = self._need_tokenizer("step(texts=...)")
        if texts_labels is not None and len(texts_labels) != len(texts):
            raise ValueError(f"step(): {len(texts)} texts but {len(texts_labels)} texts_labels; give one label per text.")
        rows = []
        for i, text in enumerate(texts):
            ids = tok(text, add_special_tokens=True)["input_ids"]
            if texts_labels is None:
                rows.append({"input_ids": ids, "completion_mask": [1] * len(ids)})
                continue
            target = tok(texts_labels[i], add_special_tokens=False)["input_ids"]
            if tok.eos_token_id is not None:
                target = target + [tok.eos_token_id]
            rows.append({"input_ids": ids + target, "completion_mask": [0] * len(ids) + [1] * len(target)})
        return rows

    def build_batch(self, input_ids=None, attention_mask=None, labels=None, texts=None, texts_labels=None) -> dict[str, torch.Tensor]:
        """The padded batch a ``step`` trains on (truncated to ``max_length``; labels -100 off target)."""
        if (input_ids is None) == (texts is None):
            raise ValueError("step() takes either input_ids (with optional attention_mask, labels) or texts (with optional texts_labels).")
        rows = self._rows_from_texts(texts, texts_labels) if texts is not None else self._rows_from_ids(input_ids, attention_mask, labels)
        if not rows:
            raise ValueError("step() got an empty batch.")
        for row in rows:
            row["input_ids"] = truncate(row["input_ids"], self.max_length, self.truncation_mode)
            row["completion_mask"] = truncate(row["completion_mask"], self.max_length, self.truncation_mode)
        pad = self.tokenizer.pad_token_id if self.tokenizer is not None else self.model.config.pad_token_id
        batch = PaddingCollator(pad if pad is not None else 0)(rows)
        return {k: v.to(self.device) for k, v in batch.items()}

    # ------------------------------------------------------------------------------------- training
    def step(self, input_ids=None, attention_mask=None, labels=None, texts=None, texts_labels=None) -> dict[str, float]:
        """One optimizer step on the given batch; returns ``loss``, ``token_accuracy``, ``num_tokens``,
        ``grad_norm``, ``lr`` (the one used) and ``step``.

        ``input_ids``: lists or tensors (padding removed via ``attention_mask``); ``labels`` default to the inputs.
        ``texts``: strings trained on entirely, or prompts whose ``texts_labels`` (completions, EOS appended)
        are the only loss targets.
        """
        batch = self.build_batch(input_ids, attention_mask, labels, texts, texts_labels)
        module = self.module
        module.train()
        lr = float(self.optimizer.param_groups[0]["lr"])
        logits = module._logits(batch)
        loss, stats = module.compute_loss(logits, batch)
        loss.backward()
        params = [p for p in module.model.parameters() if p.grad is not None]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm if self.max_grad_norm else float("inf"))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.global_step += 1
        if self.optimize_device_cache:
            self.cache_cleanups += 1
            free_device_cache()
        n = stats["num_tokens"].clamp(min=1)
        return {
            "loss": float(loss.detach()),
            "token_accuracy": float(stats["num_correct"] / n),
            "num_tokens": int(stats["num_tokens"]),
            "grad_norm": float(grad_norm),
            "lr": lr,
            "step": self.global_step,
        }

    @torch.no_grad()
    def generate(self, prompts: Sequence[str], **generate_kwargs: Any) -> list[str]:
        """Completions of ``prompts`` (left-padded batch, ``model.generate`` keyword arguments), decoded."""
        tok = self._need_tokenizer("generate()")
        side, tok.padding_side = tok.padding_side, "left"
        try:
            enc = tok(list(prompts), return_tensors="pt", padding=True).to(self.device)
        finally:
            tok.padding_side = side
        generate_kwargs.setdefault("pad_token_id", tok.pad_token_id)
        was_training = self.model.training
        self.model.eval()
        try:
            out = self.model.generate(**enc, **generate_kwargs)
        finally:
            self.model.train(was_training)
        return tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)

    def export_hf(self, output_dir, merge_lora: bool = False):
        """A Hugging Face model folder of the current weights (and the tokenizer)."""
        return self.module.export_hf(output_dir, tokenizer=self.tokenizer, merge_lora=merge_lora)
