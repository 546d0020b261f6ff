"""``HubPush`` (callbacks/hub_push.py) at the ``HfApi`` boundary: a fake api object, injected with ``api=``, records
every ``whoami`` / ``create_repo`` / ``create_branch`` / ``upload_folder`` call (arguments, the files of the uploaded
folder at call time, the calling thread) and can fail or block on purpose.

Exercised: what each ``hub_strategy`` uploads during a real short fit of the tiny model (4 steps, HFExport and
ModelCheckpoint every 2 steps) and at its end — folder contents, ``path_in_repo``, ``revision``, ``private``, commit
messages, order; retries then a warning for a failing upload while training goes on; the end-of-fit failure as one
``HubPushError`` naming the repository, the local folder and the ``hf upload`` command; a blocked upload not
blocking training steps (ordering by events, no timing thresholds); the pre-flight refusals (HF_HUB_OFFLINE, no
repository name, no token, Hub unreachable, create_repo refused) before the model loads; rank != 0 making no call.

Not exercised: huggingface_hub itself (HTTP, LFS/xet uploads, the real Hub's answers and its metadata validation),
``hub_reachable``'s TCP probe (skipped when an api is injected), a real multi-process DDP run (rank is simulated
with a stand-in trainer), and resuming a run from a ``last-checkpoint`` downloaded from the Hub.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from lightalign import HFExport, HubPush, SFTDataModule, SFTModule
from lightalign.callbacks.hub_push import STAGING, HubPushError
from lightalign.strategies import AtomicCheckpointIO


@pytest.fixture(autouse=True)
def online(monkeypatch):
    """The tests run with HF_HUB_OFFLINE=1 (tests/conftest.py), which refuses every push: lifted here (the fake api
    is all the "network" there is); tests of the refusal set it again."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")


class FakeApi:
    """Records HfApi calls. ``fail``: a predicate on an upload's kwargs -> raise ConnectionError (every attempt);
    ``fail_first``: that many upload attempts fail first; ``gate``: the first upload waits for it (up to 20 s)."""

    def __init__(self, fail=None, fail_first=0, gate: threading.Event | None = None, whoami_error=None,
                 create_error=None):
        self.calls: list[tuple[str, dict]] = []
        self.fail, self.fail_first, self.gate = fail, fail_first, gate
        self.whoami_error, self.create_error = whoami_error, create_error
        self.first_started = threading.Event()
        self.first_finished = threading.Event()
        self.lock = threading.Lock()

    def whoami(self, token=None):
        self.calls.append(("whoami", {"token": token}))
        if self.whoami_error is not None:
            raise self.whoami_error
        return {"name": "me"}

    def create_repo(self, repo_id, token=None, private=None, exist_ok=False):
        self.calls.append(("create_repo", {"repo_id": repo_id, "private": private, "exist_ok": exist_ok}))
        if self.create_error is not None:
            raise self.create_error
        return SimpleNamespace(repo_id=repo_id if "/" in repo_id else f"me/{repo_id}")

    def create_branch(self, repo_id, branch, token=None, exist_ok=False):
        self.calls.append(("create_branch", {"repo_id": repo_id, "branch": branch, "exist_ok": exist_ok}))

    def upload_folder(self, *, repo_id, folder_path, path_in_repo=None, commit_message=None, revision=None,
                      token=None):
        folder = Path(folder_path)
        files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
        with self.lock:
            first = not any(name == "upload_folder" for name, _ in self.calls)
            self.calls.append(("upload_folder", dict(repo_id=repo_id, folder=str(folder), files=files,
                                                     path_in_repo=path_in_repo, message=commit_message,
                                                     revision=revision, thread=threading.current_thread().name,
                                                     first_done=self.first_finished.is_set())))
            failing = self.fail_first > 0
            self.fail_first -= 1
        if first and self.gate is not None:
            self.first_started.set()
            released = self.gate.wait(20)
            self.calls.append(("gate", {"released": released}))
            self.first_finished.set()
        if failing or (self.fail is not None and self.fail(commit_message)):
            raise ConnectionError("the hub is down")

    def uploads(self) -> list[dict]:
        return [kw for name, kw in self.calls if name == "upload_folder"]


class StepLog(L.Callback):
    """Records, in order, each finished training step and the moment training ended; ``on_train_end`` runs
    ``at_train_end`` (e.g. releasing a blocked upload)."""

    def __init__(self, events: list, at_train_end=None):
        self.events, self.at_train_end = events, at_train_end

    def on_train_batch_end(self, trainer, *args):
        self.events.append(("step", trainer.global_step))

    def on_train_end(self, trainer, pl_module):
        self.events.append(("train_end", trainer.global_step))
        if self.at_train_end is not None:
            self.at_train_end()


@pytest.fixture(scope="module")
def small_data(tmp_path_factory, data_dir) -> str:
    rows = (data_dir / "arithmetic_sft.jsonl").read_text().splitlines()[:48]
    path = tmp_path_factory.mktemp("hubdata") / "data.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return str(path)


def fit(tmp_path: Path, tiny_dir: Path, data: str, push: HubPush, extra=(), max_steps: int = 4) -> L.Trainer:
    run = tmp_path / "run"
    callbacks = [HFExport(output_dir=str(run / "hf_model"), every_n_train_steps=2), push,
                 ModelCheckpoint(dirpath=str(run / "checkpoints"), every_n_train_steps=2, save_last=True, save_top_k=0,
                                 enable_version_counter=False), *extra]
    trainer = L.Trainer(accelerator="cpu", max_steps=max_steps, logger=False, default_root_dir=str(run),
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, callbacks=callbacks, plugins=[AtomicCheckpointIO()])
    module = SFTModule(str(tiny_dir), from_config=True, learning_rate=1e-3)
    trainer.fit(module, SFTDataModule(data, tokenizer=str(tiny_dir), max_length=32, batch_size=4))
    return trainer


MODEL_FILES = {"README.md", "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
               "tokenizer_config.json"}


def summary(api: FakeApi) -> list[tuple]:
    return [(u["path_in_repo"], u["message"], "model" if MODEL_FILES <= set(u["files"]) else tuple(u["files"]))
            for u in api.uploads()]


EXPECTED = {
    "end": [(None, "End of training", "model")],
    "every_save": [(None, "Training in progress, step 2", "model"), (None, "Training in progress, step 4", "model"),
                   (None, "End of training", "model")],
    "checkpoint": [(None, "Training in progress, step 2", "model"),
                   ("last-checkpoint", "Training in progress, step 2, checkpoint", ("last.ckpt",)),
                   (None, "Training in progress, step 4", "model"),
                   ("last-checkpoint", "Training in progress, step 4, checkpoint", ("last.ckpt",)),
                   (None, "End of training", "model")],
    "all_checkpoints": [(None, "Training in progress, step 2", "model"),
                        ("checkpoint-2", "Training in progress, step 2, checkpoint", "model"),
                        ("checkpoint-2", "Training in progress, step 2, checkpoint", ("last.ckpt",)),
                        (None, "Training in progress, step 4", "model"),
                        ("checkpoint-4", "Training in progress, step 4, checkpoint", "model"),
                        ("checkpoint-4", "Training in progress, step 4, checkpoint", ("last.ckpt",)),
                        (None, "End of training", "model")],
}


@pytest.mark.parametrize("strategy", list(EXPECTED))
def test_each_hub_strategy_pushes_what_the_trainer_pushes(tmp_path, tiny_dir, small_data, strategy):
    api = FakeApi()
    push = HubPush(push_to_hub=True, hub_model_id="me/x", hub_strategy=strategy, hub_private_repo=True,
                   hub_revision="dev", hub_always_push=True, api=api)
    fit(tmp_path, tiny_dir, small_data, push)
    assert summary(api) == EXPECTED[strategy]
    assert [name for name, _ in api.calls[:3]] == ["whoami", "create_repo", "create_branch"]
    assert api.calls[1][1] == {"repo_id": "me/x", "private": True, "exist_ok": True}
    assert api.calls[2][1]["branch"] == "dev"
    uploads = api.uploads()
    assert all(u["repo_id"] == "me/x" and u["revision"] == "dev" for u in uploads)
    # during training on the background thread, the final push on the training thread
    assert all(u["thread"] == "lightalign-hub-push" for u in uploads[:-1])
    assert uploads[-1]["thread"] == threading.main_thread().name
    run = tmp_path / "run"
    for folder in ("checkpoint-2", "checkpoint-4", "hf_model"):  # the local export, intact
        assert MODEL_FILES <= {p.name for p in (run / folder).iterdir()}
    assert (run / "checkpoints" / "last.ckpt").is_file() and not (run / STAGING).exists()


def test_a_failing_upload_is_retried_then_reported_and_training_goes_on(tmp_path, tiny_dir, small_data):
    api = FakeApi(fail=lambda message: message.startswith("Training in progress"))
    push = HubPush(push_to_hub=True, hub_model_id="me/x", hub_strategy="checkpoint", hub_always_push=True,
                   upload_retries=3, retry_backoff=0, api=api)
    with pytest.warns(UserWarning, match=r"Upload of .*checkpoint-2 to me/x failed after 3 attempt\(s\): "
                                         r"ConnectionError: the hub is down\. Training goes on"):
        trainer = fit(tmp_path, tiny_dir, small_data, push)
    assert trainer.global_step == 4
    messages = [u["message"] for u in api.uploads()]
    assert messages.count("Training in progress, step 2") == 3  # three attempts, then given up
    assert messages.count("Training in progress, step 4, checkpoint") == 3
    assert messages[-1] == "End of training" and messages.count("End of training") == 1
    assert all(u.attempts == 3 and u.error is not None for u in push.uploads[:-1])
    run = tmp_path / "run"
    for folder in ("checkpoint-2", "checkpoint-4", "hf_model"):
        assert MODEL_FILES <= {p.name for p in (run / folder).iterdir()}


def test_a_flaky_upload_succeeds_on_a_later_attempt(tmp_path, tiny_dir, small_data, recwarn):
    api = FakeApi(fail_first=2)
    push = HubPush(push_to_hub=True, hub_model_id="me/x", hub_strategy="end", retry_backoff=0, api=api)
    fit(tmp_path, tiny_dir, small_data, push, max_steps=2)
    assert [u["message"] for u in api.uploads()] == ["End of training"] * 3
    assert push.uploads[-1].error is None and push.uploads[-1].attempts == 3
    assert not [w for w in recwarn if "Upload of" in str(w.message)]


def test_a_failed_final_push_is_one_error_naming_repo_folder_and_command(tmp_path, tiny_dir, small_data):
    api = FakeApi(fail=lambda message: True)
    push = HubPush(push_to_hub=True, hub_model_id="me/x", hub_strategy="end", hub_revision="dev", retry_backoff=0,
                   api=api)
    with pytest.raises(HubPushError) as info:
        fit(tmp_path, tiny_dir, small_data, push, max_steps=2)
    final = tmp_path / "run" / "hf_model"
    text = str(info.value)
    assert "\n" not in text and text.startswith("Push to me/x failed after 3 attempt(s) (ConnectionError: the hub is down)")
    assert f"the model is safe in {final}" in text and text.endswith(f"hf upload me/x {final} . --revision dev")
    assert MODEL_FILES <= {p.name for p in final.iterdir()}  # the local export is still there


def test_a_slow_upload_does_not_block_training_and_fit_end_waits_for_it(tmp_path, tiny_dir, small_data):
    gate, events = threading.Event(), []
    api = FakeApi(gate=gate)
    push = HubPush(push_to_hub=True, hub_model_id="me/x", hub_strategy="every_save", api=api)

    def at_train_end():
        events.append(("upload_still_running", api.first_started.is_set() and not api.first_finished.is_set()))

    wait = push.wait

    def wait_then_release():  # the final push waits for the uploads in flight: only then is the gate opened
        events.append(("fit_end_waits", api.first_started.is_set() and not api.first_finished.is_set()))
        gate.set()
        wait()

    push.wait = wait_then_release
    fit(tmp_path, tiny_dir, small_data, push, extra=[StepLog(events, at_train_end=at_train_end)])
    # the step-2 upload started and was still blocked when the 4 steps had run and training ended
    assert events[-2:] == [("upload_still_running", True), ("fit_end_waits", True)] and ("step", 4) in events
    assert ("gate", {"released": True}) in api.calls
    uploads = api.uploads()
    assert [u["message"] for u in uploads] == ["Training in progress, step 2", "End of training"]
    # the step-4 save was not pushed while step 2's was uploading (hub_always_push=False, as the Trainer)
    assert len(push.skipped) == 1 and "checkpoint-4" in push.skipped[0]
    # the final push started after the blocked upload had finished
    assert uploads[-1]["first_done"] and uploads[-1]["thread"] == threading.main_thread().name


def _stand_in_trainer(tmp_path: Path, rank_zero: bool, export: HFExport, push: HubPush):
    return SimpleNamespace(is_global_zero=rank_zero, callbacks=[export, push], checkpoint_callbacks=[],
                           global_step=2, log_dir=str(tmp_path), default_root_dir=str(tmp_path),
                           strategy=SimpleNamespace(broadcast=lambda obj: (None, "me/x") if isinstance(obj, tuple)
                                                    else None))


@pytest.mark.parametrize("rank_zero", [True, False])
def test_only_global_rank_zero_talks_to_the_hub(tmp_path, rank_zero):
    """Rank simulated with a stand-in trainer (``is_global_zero``; ``broadcast`` answers rank 0's result)."""
    api = FakeApi()
    export = HFExport(output_dir=str(tmp_path / "hf_model"), every_n_train_steps=2)
    push = HubPush(push_to_hub=True, hub_model_id="me/x", hub_strategy="all_checkpoints", api=api)
    trainer = _stand_in_trainer(tmp_path, rank_zero, export, push)
    push.setup(trainer, None, "fit")
    push.on_train_start(trainer, None)
    for folder in ("checkpoint-2", "hf_model"):  # what rank 0's HFExport would have written
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "config.json").write_text(json.dumps({}))
    export.last_export, export.last_export_step = tmp_path / "checkpoint-2", 2
    push.on_train_batch_end(trainer)
    export.last_export = Path(export.output_dir)
    push.on_train_end(trainer, None)
    push.on_fit_end(trainer, None)
    push.teardown(trainer, None, "fit")
    if rank_zero:
        assert [u["message"] for u in api.uploads()] == ["Training in progress, step 2",
                                                         "Training in progress, step 2, checkpoint", "End of training"]
    else:
        assert api.calls == [] and push._worker is None and not (tmp_path / STAGING).exists()
    assert push.repo_id == "me/x" and export.hub_repo_id == "me/x"


@pytest.mark.parametrize("case, match", [
    ("offline", r"HF_HUB_OFFLINE=1 forbids every Hub call: unset HF_HUB_OFFLINE to push, or set --hub.push_to_hub false"),
    ("no_id", r"no repository to push to: set --hub.hub_model_id"),
    ("no_token", r"no Hugging Face token was found: set HF_TOKEN or run `hf auth login`"),
    ("unreachable", r"the Hub \(.*\) refused the token or could not be reached: ConnectionError: no route"),
    ("create_refused", r"refused to create or open repository 'me/x': PermissionError: not yours\. Check --hub.hub_model_id"),
])
def test_a_push_that_cannot_happen_is_refused_before_the_model_loads(tmp_path, tiny_dir, small_data, monkeypatch,
                                                                       case, match):
    from huggingface_hub.errors import LocalTokenNotFoundError

    monkeypatch.setenv("HF_HUB_OFFLINE", "1" if case == "offline" else "0")
    api = FakeApi(whoami_error={"no_token": LocalTokenNotFoundError("no token"),
                                "unreachable": ConnectionError("no route")}.get(case),
                  create_error=PermissionError("not yours") if case == "create_refused" else None)
    push = HubPush(push_to_hub=True, hub_model_id=None if case == "no_id" else "me/x", api=api)
    run = tmp_path / "run"
    export = HFExport(every_n_train_steps=2)  # default output folder: no repository name to derive
    module = SFTModule(str(tiny_dir), from_config=True)
    trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=False, default_root_dir=str(run), callbacks=[export, push],
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    with pytest.raises(HubPushError, match=match) as info:
        trainer.fit(module, SFTDataModule(small_data, tokenizer=str(tiny_dir), max_length=32, batch_size=4))
    assert "\n" not in str(info.value)
    assert module.model is None  # refused in setup, before configure_model built the model
    assert not any(name == "upload_folder" for name, _ in api.calls) and not list(run.rglob("*.ckpt"))
    if case in ("offline", "no_id"):
        assert api.calls == []  # decided without the network


def test_the_repository_name_defaults_to_the_export_folder_name(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    api = FakeApi()
    push = HubPush(push_to_hub=True, api=api)
    assert push.check_local(tmp_path / "my-model") == "my-model"
    assert push.check_hub("my-model") == "me/my-model"  # create_repo puts a bare name in the token's namespace
    assert HubPush(push_to_hub=False).check_local(None) is None
    with pytest.raises(ValueError, match="hub_strategy='sometimes' is unknown"):
        HubPush(hub_strategy="sometimes")
