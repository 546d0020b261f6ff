"""``HFExport``: write a Hugging Face model folder (model + tokenizer) at the end of fit, optionally every N steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_info

from lightalign.callbacks.run_folder import run_dir_of
from lightalign.runs import RunError, check_writable


class HFExport(L.Callback):
    """Save the policy with ``save_pretrained`` (and the tokenizer) so ``from_pretrained(folder)`` loads it.

    Args:
        output_dir: where the final model goes; default ``<run folder>/hf_model`` (e.g. ``runs/sft/version_0/hf_model``).
            Checked at fit start: a folder that cannot be written stops the run before training.
        every_n_train_steps: also export to ``<output_dir>/../checkpoint-<step>`` every N optimizer steps (0: never).
        merge_lora: with LoRA, export merged full weights instead of the adapters.
        enabled: set False to skip the export.
    """

    def __init__(
        self,
        output_dir: str | None = None,
        every_n_train_steps: int = 0,
        merge_lora: bool = False,
        enabled: bool = True,
    ) -> None:
        self.output_dir = output_dir
        self.every_n_train_steps = every_n_train_steps
        self.merge_lora = merge_lora
        self.enabled = enabled
        self.last_export: Path | None = None
        self._exported_final = False

    def resolve_output_dir(self, trainer: L.Trainer) -> Path:
        if self.output_dir is not None:
            return Path(self.output_dir)
        return run_dir_of(trainer) / "hf_model"

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if not self.enabled or stage != "fit":
            return
        self._exported_final = False
        problem, out = None, self.resolve_output_dir(trainer)  # every rank (log_dir broadcasts)
        if trainer.is_global_zero:
            try:
                check_writable(out, "the Hugging Face export", "--export.output_dir")
            except RunError as err:
                problem = str(err)
        problem = trainer.strategy.broadcast(problem)
        if problem is not None:
            raise RunError(problem)

    def _tokenizer(self, trainer: L.Trainer, pl_module: L.LightningModule) -> Any:
        datamodule = getattr(trainer, "datamodule", None)
        tok = getattr(datamodule, "tokenizer", None)
        return tok if tok is not None else getattr(pl_module, "tokenizer", None)

    def export(self, trainer: L.Trainer, pl_module: L.LightningModule, output_dir: Path) -> None:
        if not hasattr(pl_module, "export_hf"):
            raise TypeError(f"{type(pl_module).__name__} has no export_hf(); HFExport works with lightalign modules.")
        from lightalign.strategies.sharding import full_state_dict

        # sharded (FSDP, FSDP2, ZeRO-3): a collective, so every rank gathers
        state = full_state_dict(pl_module.model, root=trainer.strategy.model)
        # a module's other exported weights (PPO's value head and value model), gathered on every rank too
        extra = pl_module.gather_export_extras() if hasattr(pl_module, "gather_export_extras") else None
        if trainer.is_global_zero:
            pl_module.export_hf(output_dir, tokenizer=self._tokenizer(trainer, pl_module), merge_lora=self.merge_lora,
                                state_dict=state, **({} if extra is None else {"extras": extra}))
            self.last_export = output_dir
            rank_zero_info(f"Hugging Face model written to {output_dir}")
        trainer.strategy.barrier("hf_export")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if not self.enabled or self.every_n_train_steps <= 0:
            return
        step = trainer.global_step
        if step > 0 and step % self.every_n_train_steps == 0 and step != getattr(self, "_last_step", None):
            self._last_step = step
            out = self.resolve_output_dir(trainer)
            self.export(trainer, pl_module, out.parent / f"checkpoint-{step}")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.enabled:
            self.export(trainer, pl_module, self.resolve_output_dir(trainer))
            self._exported_final = True

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # A run resumed from a checkpoint already at max_steps trains nothing, and Lightning then skips
        # on_train_end: export here, so a run killed during its export finishes on resume.
        if self.enabled and not self._exported_final and trainer.max_steps is not None \
                and 0 <= trainer.max_steps <= trainer.global_step:
            self.export(trainer, pl_module, self.resolve_output_dir(trainer))
            self._exported_final = True
