"""``HubPush``: push the Hugging Face export (and, on request, the Lightning checkpoints) to the Hugging Face Hub, with
the knob names and semantics of the transformers Trainer (``push_to_hub``, ``hub_model_id``, ``hub_strategy``,
``hub_private_repo``, ``hub_revision``, ``hub_always_push``, ``hub_token``). docs/hub.md has the whole story.

What is pushed, and when (``hub_strategy``):

* ``end``: the final export (``HFExport``'s ``hf_model``) to the repository's root at the end of fit.
* ``every_save`` (the Trainer's default): also, during training, every per-step export ``checkpoint-<step>`` (HFExport
  with ``every_n_train_steps``) to the root, commit "Training in progress, step N".
* ``checkpoint``: like ``every_save``, plus the newest Lightning checkpoint (``last.ckpt``, with the run's
  ``config.yaml``) to ``last-checkpoint/`` each time one is written, so a run can continue from the Hub.
* ``all_checkpoints``: like ``every_save``, plus every per-step export and every Lightning checkpoint to its own
  ``checkpoint-<step>/`` folder.

Uploads during training run on one background thread (``upload_folder`` of huggingface_hub's ``HfApi``), from a
snapshot of the files (hard links, or copies where links are impossible) so the next save can replace them; the
run's own files are only read. A failed upload is retried ``upload_retries`` times with doubling waits, then
reported as a warning naming the folder and the error; training goes on. At the end of fit the final push waits for
pending uploads and runs on the training thread: if it fails, fit raises ``HubPushError`` (the console script: one
line, exit status 1) naming the repository, the local folder that holds the model and the ``hf upload`` command
that pushes it by hand. Only global rank 0 talks to the Hub.

Refused at setup, before the model loads (and by the console script before the data is read): ``HF_HUB_OFFLINE``
set, no repository name (none given and no ``--export.output_dir`` to derive it from), no token, or a Hub that
cannot be reached or refuses ``create_repo``.
"""

from __future__ import annotations

import os
import queue
import shutil
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info

from lightalign.callbacks.knob_range import check_at_least

STRATEGIES = ("end", "every_save", "checkpoint", "all_checkpoints")
STAGING = ".hub-staging"  # in the run folder: the snapshots being uploaded (removed once uploaded)


class HubPushError(RuntimeError):
    """A push to the Hub that is refused before training or failed at the end; the message says what to do."""


@dataclass
class Upload:
    """One ``upload_folder`` call: ``folder`` (a snapshot) to ``path_in_repo`` with ``commit_message``."""

    folder: Path
    path_in_repo: str | None
    commit_message: str
    source: str  # the run's own file or folder the snapshot was taken from (named in reports)
    step: int = 0  # the training step of the save it belongs to
    error: BaseException | None = None
    attempts: int = 0
    done: threading.Event = field(default_factory=threading.Event)


class HubPush(L.Callback):
    """Push the run's Hugging Face export to the Hub (the transformers Trainer's ``push_to_hub`` knobs).

    Args:
        push_to_hub: push at all (default False: this callback does nothing).
        hub_model_id: the repository, ``"user/name"`` or ``"org/name"``; a bare ``"name"`` goes to the token owner's
            namespace. Default: the name of ``--export.output_dir`` (the Trainer's rule, output_dir's name); with the
            default export folder (``<run folder>/hf_model``) there is nothing to derive it from and a push is refused.
        hub_strategy: what is pushed and when: ``end``, ``every_save``, ``checkpoint``, ``all_checkpoints``
            (see docs/hub.md).
        hub_private_repo: create the repository private (None: the account's default); ignored when it exists.
        hub_revision: the branch to push to (created from the default branch when missing); default: the default
            branch.
        hub_always_push: push every save; by default (False, as the Trainer) a save during training is not pushed
            while the previous push is still uploading (the final push always happens).
        hub_token: the token (Python API only; the console script reads ``HF_TOKEN`` or the ``hf auth login``
            token, so no token lands in config.yaml). Default: huggingface_hub's own resolution.
        upload_retries: attempts per upload before it is reported as failed.
        retry_backoff: seconds before the second attempt, doubling after each failed one.
        api: the ``huggingface_hub.HfApi`` to use (default: a new one; tests pass a fake).
    """

    def __init__(
        self,
        push_to_hub: bool = False,
        hub_model_id: str | None = None,
        hub_strategy: Literal["end", "every_save", "checkpoint", "all_checkpoints"] = "every_save",
        hub_private_repo: bool | None = None,
        hub_revision: str | None = None,
        hub_always_push: bool = False,
        hub_token: str | None = None,
        upload_retries: int = 3,
        retry_backoff: float = 2.0,
        api: Any = None,
    ) -> None:
        if hub_strategy not in STRATEGIES:
            raise ValueError(f"hub_strategy='{hub_strategy}' is unknown; use one of {', '.join(STRATEGIES)}.")
        check_at_least("hub", "upload_retries", upload_retries, 1, "the attempts per upload, the first included")
        check_at_least("hub", "retry_backoff", retry_backoff, 0.0, "the seconds before the second attempt")
        self.push_to_hub = push_to_hub
        self.hub_model_id = hub_model_id
        self.hub_strategy = hub_strategy
        self.hub_private_repo = hub_private_repo
        self.hub_revision = hub_revision
        self.hub_always_push = hub_always_push
        self.hub_token = hub_token
        self.upload_retries = upload_retries
        self.retry_backoff = retry_backoff
        self._api = api
        self.repo_id: str | None = None  # the repository, as create_repo answered
        self.uploads: list[Upload] = []  # every upload queued or done (rank 0)
        self.skipped: list[str] = []  # saves not pushed because the previous push was still running
        self._queue: queue.Queue[Upload | None] | None = None
        self._worker: threading.Thread | None = None
        self._staging: Path | None = None
        self._seen_export: Path | None = None
        self._seen_checkpoints: dict[int, Any] = {}
        self._unpushed_checkpoint: tuple[int, Path] | None = None
        self._counter = 0

    # --------------------------------------------------------------------------------------------- checks
    @property
    def api(self) -> Any:
        if self._api is None:
            from huggingface_hub import HfApi

            self._api = HfApi()
        return self._api

    def derive_repo_id(self, export_output_dir: str | os.PathLike | None) -> str:
        """``hub_model_id``, else the name of the export folder when the user chose it (the Trainer's rule)."""
        if self.hub_model_id:
            return self.hub_model_id
        if export_output_dir:
            return Path(export_output_dir).absolute().name
        raise HubPushError(
            "push_to_hub is set but there is no repository to push to: set --hub.hub_model_id (e.g. your-name/"
            "my-model); the default export folder (<run folder>/hf_model) does not name one.")

    def check_local(self, export_output_dir: str | os.PathLike | None) -> str | None:
        """The checks that need no network (HF_HUB_OFFLINE, a repository name): the repository name, or None when
        no push is requested. Raises ``HubPushError``."""
        if not self.push_to_hub:
            return None
        from lightalign.hub import _offline_env

        name = self.derive_repo_id(export_output_dir)  # a config error first: it needs no environment to be fixed
        if _offline_env():
            raise HubPushError(
                f"push_to_hub is set but HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE')} forbids every Hub call: "
                "unset HF_HUB_OFFLINE to push, or set --hub.push_to_hub false (the model is still exported locally).")
        return name

    def check_hub(self, name: str) -> str:
        """Token and Hub: ``whoami``, then ``create_repo(exist_ok=True)`` (and the branch of ``hub_revision``). Returns
        the full repository id. Raises ``HubPushError`` with one line naming the problem and the setting."""
        from lightalign.hub import hub_reachable

        endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
        if self._api is None and not hub_reachable():
            raise HubPushError(f"push_to_hub is set but the Hugging Face Hub ({endpoint}) cannot be reached from this "
                               "machine: check the network (or HF_ENDPOINT), or set --hub.push_to_hub false.")
        try:
            self.api.whoami(token=self.hub_token)
        except Exception as err:  # no token, a revoked token, no network
            from huggingface_hub.errors import LocalTokenNotFoundError

            if isinstance(err, LocalTokenNotFoundError):
                raise HubPushError("push_to_hub is set but no Hugging Face token was found: set HF_TOKEN or run "
                                   "`hf auth login` (a token with write access).") from err
            raise HubPushError(f"push_to_hub is set but the Hub ({endpoint}) refused the token or could not be "
                               f"reached: {_one_line(err)}. Check HF_TOKEN / `hf auth login` and the network.") from err
        try:
            url = self.api.create_repo(name, token=self.hub_token, private=self.hub_private_repo, exist_ok=True)
            repo_id = getattr(url, "repo_id", None) or name
            if self.hub_revision:
                self.api.create_branch(repo_id, branch=self.hub_revision, token=self.hub_token, exist_ok=True)
        except Exception as err:
            raise HubPushError(f"push_to_hub is set but the Hub refused to create or open repository '{name}'"
                               + (f" (branch '{self.hub_revision}')" if self.hub_revision else "")
                               + f": {_one_line(err)}. Check --hub.hub_model_id and that the token may write there."
                               ) from err
        return repo_id

    # --------------------------------------------------------------------------------------------- hooks
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if not self.push_to_hub or stage != "fit":
            return
        from lightalign.callbacks.run_folder import run_dir_of

        run_dir = run_dir_of(trainer)  # every rank (a collective without RunFolder)
        problem, repo_id = None, None
        if trainer.is_global_zero:
            try:
                export = self._export(trainer)
                if export is None or not export.enabled:
                    raise HubPushError("push_to_hub is set but the Hugging Face export is off: the push uploads what "
                                       "HFExport writes; set --export.enabled true.")
                if trainer.callbacks.index(export) > trainer.callbacks.index(self):
                    raise HubPushError("HubPush must come after HFExport in the Trainer's callbacks (it pushes what "
                                       "HFExport wrote at the same step).")
                repo_id = self.repo_id or self.check_hub(self.check_local(export.output_dir))
            except HubPushError as err:
                problem = str(err)
        problem, repo_id = trainer.strategy.broadcast((problem, repo_id))
        if problem is not None:
            raise HubPushError(problem)
        self.repo_id = repo_id
        export = self._export(trainer)
        if export is not None:
            export.hub_repo_id = repo_id  # the model card's loading snippet names the repository
        if trainer.is_global_zero:
            self._staging = run_dir / STAGING
            shutil.rmtree(self._staging, ignore_errors=True)  # snapshots of a killed run: its uploads died with it
            self._start_worker()
            rank_zero_info(f"Pushing to the Hugging Face Hub: {repo_id} (hub_strategy={self.hub_strategy}"
                           + (f", branch {self.hub_revision}" if self.hub_revision else "") + ").")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._active(trainer):
            self._seen_checkpoints = {id(cb): getattr(cb, "_last_global_step_saved", 0)
                                      for cb in trainer.checkpoint_callbacks}
            self._seen_export = self._export(trainer).last_export

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._collect(trainer)  # a checkpoint saved after this callback's batch-end hook (ModelCheckpoint runs last)

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self._collect(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._collect(trainer)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.push_to_hub or self.repo_id is None:
            return
        problem = None
        if trainer.is_global_zero:
            self._collect(trainer)
            try:
                self.final_push(trainer)
            except HubPushError as err:
                problem = str(err)
        problem = trainer.strategy.broadcast(problem)
        if problem is not None:
            raise HubPushError(problem)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._stop_worker(wait=False)  # queued uploads are dropped; the run's own files are untouched

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._worker is not None:
            self._stop_worker(wait=False)
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)

    # --------------------------------------------------------------------------------------------- pushes
    def _active(self, trainer: L.Trainer) -> bool:
        return self.push_to_hub and self.repo_id is not None and trainer.is_global_zero and self._queue is not None

    @staticmethod
    def _export(trainer: L.Trainer):
        from lightalign.callbacks.hf_export import HFExport

        return next((cb for cb in trainer.callbacks if isinstance(cb, HFExport)), None)

    def _collect(self, trainer: L.Trainer) -> None:
        """Push what was saved since the last look: a per-step export, a Lightning checkpoint."""
        if not self._active(trainer):
            return
        export = self._export(trainer)
        step = trainer.global_step
        new_export = None
        if export is not None and export.last_export is not None and export.last_export != self._seen_export:
            self._seen_export = export.last_export
            if export.last_export != export.resolve_output_dir(trainer):  # the final export: final_push's
                new_export = (export.last_export_step, export.last_export)
        new_checkpoint = None
        for cb in trainer.checkpoint_callbacks:
            saved = getattr(cb, "_last_global_step_saved", None)
            if isinstance(cb, ModelCheckpoint) and saved != self._seen_checkpoints.get(id(cb)):
                self._seen_checkpoints[id(cb)] = saved
                path = cb.last_model_path or getattr(cb, "_last_checkpoint_saved", "")
                if path and Path(path).is_file():
                    new_checkpoint = (saved, Path(path))
        if self.hub_strategy not in ("checkpoint", "all_checkpoints"):
            new_checkpoint = None  # every_save and end push models only
        if self.hub_strategy == "end" or (new_export is None and new_checkpoint is None):
            return
        if new_checkpoint is not None:
            self._unpushed_checkpoint = new_checkpoint  # pushed at the end if this save is skipped
        save_step = max(s for s, _ in filter(None, (new_export, new_checkpoint)))
        if not self.hub_always_push and self.pending(before=save_step):
            what = ", ".join(str(p) for _, p in filter(None, (new_export, new_checkpoint)))
            self.skipped.append(what)
            rank_zero_info(f"Hub push of step {step} skipped: the previous push is still uploading ({what}; "
                           "hub_always_push=true pushes every save).")
            return
        if new_export is not None:
            self._push_export(*new_export, final=False)
        if new_checkpoint is not None:
            self._push_checkpoint(*new_checkpoint, trainer=trainer)

    def _push_export(self, step: int, folder: Path, final: bool) -> list[Upload]:
        message = "End of training" if final else f"Training in progress, step {step}"
        uploads = [self._enqueue(folder, None, message, step, final=final)]
        if self.hub_strategy == "all_checkpoints" and not final:
            uploads.append(self._enqueue(folder, f"checkpoint-{step}", f"{message}, checkpoint", step, final=final))
        return uploads

    def _push_checkpoint(self, step: int, path: Path, trainer: L.Trainer, final: bool = False) -> Upload:
        from lightalign.callbacks.run_folder import run_dir_of

        files = [path]
        where = "last-checkpoint" if self.hub_strategy == "checkpoint" else f"checkpoint-{step}"
        if self.hub_strategy == "checkpoint":
            config = run_dir_of(trainer) / "config.yaml"
            if config.is_file():
                files.append(config)  # `lightalign fit --config last-checkpoint/config.yaml --ckpt_path ...`
        self._unpushed_checkpoint = None
        message = ("End of training" if final else f"Training in progress, step {step}") + ", checkpoint"
        return self._enqueue(files, where, message, step, final=final)

    def final_push(self, trainer: L.Trainer) -> None:
        """Wait for the uploads in flight, then push the final export (and, with ``checkpoint``/``all_checkpoints``,
        the newest Lightning checkpoint not pushed yet) on this thread. Raises ``HubPushError`` when it fails."""
        self.wait()
        failed_before = [u for u in self.uploads if u.error is not None]
        if failed_before:
            warnings.warn(f"{len(failed_before)} upload(s) to {self.repo_id} during training failed (first: "
                          f"{failed_before[0].source}: {_one_line(failed_before[0].error)}); the final push goes on.",
                          stacklevel=1)
        self._stop_worker(wait=True)
        export = self._export(trainer)
        folder = export.last_export if export is not None else None
        final = export.resolve_output_dir(trainer) if export is not None else None
        jobs: list[Upload] = []
        if folder is not None and final is not None and folder == final and folder.is_dir():
            jobs += self._push_export(trainer.global_step, folder, final=True)
        if self._unpushed_checkpoint is not None and self._unpushed_checkpoint[1].is_file():
            jobs.append(self._push_checkpoint(*self._unpushed_checkpoint, trainer=trainer, final=True))
        for job in jobs:
            self._run(job)
        failed = [job for job in jobs if job.error is not None]
        if not jobs:
            raise HubPushError(f"Nothing to push to {self.repo_id} at the end of fit: the final Hugging Face export "
                               f"({final}) was not written.")
        if failed:
            job = failed[0]
            where = f" {job.path_in_repo}" if job.path_in_repo else " ."
            revision = f" --revision {self.hub_revision}" if self.hub_revision else ""
            raise HubPushError(
                f"Push to {self.repo_id} failed after {job.attempts} attempt(s) ({_one_line(job.error)}); the model "
                f"is safe in {job.source}. Push it by hand: hf upload {self.repo_id} {job.source}{where}{revision}")
        rank_zero_info(f"Pushed to https://huggingface.co/{self.repo_id}" + (
            f" (branch {self.hub_revision})" if self.hub_revision else ""))

    # --------------------------------------------------------------------------------------------- worker
    def pending(self, before: int | None = None) -> bool:
        """Whether an upload is queued or running (``before``: one of a save before that step; the export and the
        checkpoint of one step are one save, seen at two hooks)."""
        return any(not u.done.is_set() and (before is None or u.step < before) for u in self.uploads)

    def wait(self) -> None:
        """Block until every queued upload has finished (succeeded or failed)."""
        for upload in list(self.uploads):
            if self._worker is not None and self._worker.is_alive():
                upload.done.wait()

    def _enqueue(self, source: Path | list[Path], path_in_repo: str | None, message: str, step: int,
                 final: bool) -> Upload:
        sources = source if isinstance(source, list) else [source]
        self._counter += 1
        snapshot = self._staging / f"{self._counter:04d}"
        for src in sources:
            _link_tree(src, snapshot / src.name if src.is_file() else snapshot)
        upload = Upload(snapshot, path_in_repo, message, source=str(sources[0]), step=step)
        self.uploads.append(upload)
        if not final:
            self._queue.put(upload)
        return upload

    def _start_worker(self) -> None:
        self._queue = queue.Queue()
        self._worker = threading.Thread(target=self._work, args=(self._queue,), name="lightalign-hub-push", daemon=True)
        self._worker.start()

    def _stop_worker(self, wait: bool) -> None:
        if self._queue is None:
            return
        if not wait:  # drop what has not started
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item.error = HubPushError("not uploaded: the run stopped first")
                    item.done.set()
        self._queue.put(None)
        if wait and self._worker is not None:
            self._worker.join()
        self._worker = self._queue = None

    def _work(self, jobs: queue.Queue) -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            self._run(job, report=True)

    def _run(self, job: Upload, report: bool = False) -> None:
        """``upload_folder`` with retries (waits of ``retry_backoff`` seconds, doubling); never raises."""
        delay = self.retry_backoff
        try:
            for attempt in range(1, self.upload_retries + 1):
                job.attempts = attempt
                try:
                    self.api.upload_folder(repo_id=self.repo_id, folder_path=str(job.folder),
                                           path_in_repo=job.path_in_repo, commit_message=job.commit_message,
                                           revision=self.hub_revision, token=self.hub_token)
                    job.error = None
                    return
                except Exception as err:  # noqa: BLE001 - any failure of one upload is retried, then reported
                    job.error = err
                    if attempt < self.upload_retries:
                        time.sleep(delay)
                        delay *= 2
        finally:
            shutil.rmtree(job.folder, ignore_errors=True)
            if report and job.error is not None:
                warnings.warn(f"Upload of {job.source} to {self.repo_id}"
                              + (f" ({job.path_in_repo})" if job.path_in_repo else "")
                              + f" failed after {job.attempts} attempt(s): {_one_line(job.error)}. Training goes on; "
                              "the local files are untouched.", stacklevel=1)
            job.done.set()


def _link_tree(src: Path, dst: Path) -> None:
    """A snapshot of ``src`` (file or folder) at ``dst``: hard links where possible, else copies. The run's files
    may then be replaced (atomic saves rename over them) without changing what is uploaded."""
    src = Path(src)
    if src.is_file():
        dst.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)
        return
    shutil.copytree(src, dst, copy_function=_link_or_copy, dirs_exist_ok=True)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _one_line(err: BaseException | None) -> str:
    text = " ".join(str(err).split()) if err is not None else ""
    text = text if len(text) <= 300 else text[:299] + "…"
    return f"{type(err).__name__}: {text}" if text else type(err).__name__
