"""Undo a module's scoped side effects when its run raises.

Lightning calls a LightningModule's ``teardown`` hook only when ``fit`` / ``validate`` / ``test`` / ``predict``
return; when one raises (an error, KeyboardInterrupt) it calls the callbacks' ``on_exception`` instead and skips
the module's ``teardown``. ``PolicyModule.configure_callbacks`` adds this callback so the allocator setting and a
user-passed model's adaptations are undone then too (``PolicyModule.undo_side_effects``)."""

from __future__ import annotations

import lightning as L


class UndoSideEffectsOnError(L.Callback):
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        undo = getattr(pl_module, "undo_side_effects", None)
        if undo is not None:
            undo()
