"""``HFExport``: write a Hugging Face model folder (model + tokenizer + model card) at the end of fit, optionally every
N steps."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_info

from lightalign.callbacks.knob_range import check_at_least
from lightalign.callbacks.run_folder import run_dir_of
from lightalign.runs import RunError, check_writable


class HFExport(L.Callback):
    """Save the policy with ``save_pretrained`` (and the tokenizer) so ``from_pretrained(folder)`` loads it, with a
    model card (``README.md``: ``model_card_text``) in every folder it writes.

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
        check_at_least("export", "every_n_train_steps", every_n_train_steps, 0, "the optimizer steps between two "
                       "exports during training (0: only at the end)")
        self.output_dir = output_dir
        self.every_n_train_steps = every_n_train_steps
        self.merge_lora = merge_lora
        self.enabled = enabled
        self.last_export: Path | None = None
        self.last_export_step: int | None = None
        self.hub_repo_id: str | None = None  # set by HubPush: the model card's loading snippet names the repository
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
            if problem is None:
                self.remove_unfinished_exports(out)
        problem = trainer.strategy.broadcast(problem)
        if problem is not None:
            raise RunError(problem)

    @staticmethod
    def remove_unfinished_exports(out: Path) -> None:
        """Remove what an export killed midway left beside ``out`` (only ``export_hf``'s own temporary folders)."""
        import shutil

        from lightalign.modules.training.export import unfinished_exports

        left = unfinished_exports(out)
        for folder in left:
            shutil.rmtree(folder, ignore_errors=True)
        if left:
            rank_zero_info(f"Removed {len(left)} unfinished export folder(s) an interrupted run left in {out.parent}: "
                           + ", ".join(p.name for p in left))

    def _tokenizer(self, trainer: L.Trainer, pl_module: L.LightningModule) -> Any:
        """What is saved beside the model: the data module's processor for a vision-language model (tokenizer, image
        processor and chat template), else its tokenizer."""
        datamodule = getattr(trainer, "datamodule", None)
        tok = getattr(datamodule, "processor", None) or getattr(datamodule, "tokenizer", None)
        return tok if tok is not None else getattr(pl_module, "tokenizer", None)

    def export(self, trainer: L.Trainer, pl_module: L.LightningModule, output_dir: Path) -> None:
        if not hasattr(pl_module, "export_hf"):
            raise TypeError(f"{type(pl_module).__name__} has no export_hf(); HFExport works with lightalign modules.")
        from lightalign.strategies.sharding import full_state_dict

        # sharded (FSDP, FSDP2, ZeRO-3): a collective, so every rank gathers
        state = full_state_dict(pl_module.model, root=trainer.strategy.model)
        # a module's other exported weights (PPO's value head and value model), gathered on every rank too
        extra = pl_module.gather_export_extras() if hasattr(pl_module, "gather_export_extras") else None
        run_dir = run_dir_of(trainer)  # every rank (log_dir broadcasts): the card's title names the run
        if trainer.is_global_zero:
            pl_module.export_hf(output_dir, tokenizer=self._tokenizer(trainer, pl_module), merge_lora=self.merge_lora,
                                state_dict=state, **({} if extra is None else {"extras": extra}))
            write_model_card(output_dir, trainer, pl_module, repo_id=self.hub_repo_id, run_dir=run_dir)
            self.last_export, self.last_export_step = output_dir, trainer.global_step
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


def card_inputs(folder: Path, trainer: L.Trainer, pl_module: L.LightningModule, repo_id: str | None = None,
                run_dir: Path | None = None) -> dict:
    """What ``model_card_text`` needs, read from the run: the module's hparams and class defaults, the last logged
    train/val metrics, the data module's path and format, the package versions, how the folder loads (its absolute
    path) and the run's ``<name>/version_N`` (``run_dir``, a run folder; None or another folder: no run name)."""
    from lightalign.callbacks.run_config import package_versions
    from lightalign.modules.training.model_card import class_defaults, object_path
    from lightalign.runs import version_of

    hparams = dict(getattr(pl_module, "hparams", {}) or {})
    for knob in ("reward_funcs", "judge"):  # objects, kept out of the saved hyperparameters: named here
        given = getattr(pl_module, knob, None)
        if given and knob not in hparams:
            hparams[knob] = [object_path(f) for f in given] if isinstance(given, (list, tuple)) else object_path(given)
    metrics = {}
    for name, value in trainer.callback_metrics.items():
        if name.startswith(("train/", "val/")):
            try:
                metrics[name] = float(value)
            except (TypeError, ValueError, RuntimeError):
                continue
    datamodule = getattr(trainer, "datamodule", None)
    data = getattr(datamodule, "path", None)
    adapter = (folder / "adapter_config.json").is_file()
    classifier = type(pl_module).__name__ == "RewardModule"
    vision = bool(getattr(pl_module, "is_vision_language", False)) and not classifier
    return dict(
        method=type(pl_module).__name__,
        method_name=getattr(pl_module, "method_name", None),
        switched_knobs=getattr(pl_module, "switched_knobs", None),
        run_name=f"{run_dir.parent.name}/{run_dir.name}" if run_dir is not None and version_of(run_dir) is not None
        else None,
        base_model=hparams.get("model_name_or_path"),
        random_init=bool(hparams.get("from_config")),
        hparams=hparams,
        defaults=class_defaults(type(pl_module)),
        metrics=dict(sorted(metrics.items())),
        versions=package_versions(),
        step=trainer.global_step,
        data=str(data) if isinstance(data, (str, os.PathLike)) else (type(data).__name__ if data is not None else None),
        data_format=getattr(datamodule, "data_format", None),
        data_module=type(datamodule).__name__ if datamodule is not None else None,
        repo_id=repo_id,
        folder=str(Path(folder).resolve()),
        library_name="peft" if adapter else "transformers",
        auto_class=("AutoPeftModelForSequenceClassification" if classifier else "AutoPeftModelForCausalLM") if adapter
        else ("AutoModelForSequenceClassification" if classifier else
              "AutoModelForImageTextToText" if vision else "AutoModelForCausalLM"),
        pipeline_tag="text-classification" if classifier else "image-text-to-text" if vision else "text-generation",
        vision_language=vision,
    )


def write_model_card(folder: Path, trainer: L.Trainer, pl_module: L.LightningModule, repo_id: str | None = None,
                     run_dir: Path | None = None) -> Path:
    """Write ``folder/README.md`` (written to a temporary name, then renamed into place)."""
    from lightalign.modules.training.model_card import model_card_text

    text = model_card_text(**card_inputs(folder, trainer, pl_module, repo_id, run_dir))
    path = Path(folder) / "README.md"
    tmp = path.with_name(f".README.md.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path
