"""Rollouts sampled ahead by a vLLM server (``use_vllm``, ``vllm_mode: server``, ``max_staleness``), up to the GPU
boundary: an engine stand-in that scores its completions with the weights pushed to it shows that the server samples
one rollout ahead on a background thread while the policy trains, that weights are pushed only between rollouts
(never under a running one) and that a run resumed from a checkpoint trains as the uninterrupted one; and the
server engine's weight pushes end with an error, not a hang, when the server fails or the transfer stalls."""

from __future__ import annotations

import dataclasses

import json
import sys
import threading
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from helpers.rewards import varied_reward
from lightalign.modules.training.rollout_forward import grpo_forward
from lightalign.modules.sampling.vllm_engines import ServerEngine

GATE_SECONDS = 20.0


class AheadEngine:
    """A vLLM engine at the ``generate`` / ``load_weights`` boundary: random completions from the request's seed,
    scored (the sampler's log-probs) by a model holding the last weights pushed; records which weights each rollout
    saw, on which thread, and fails a push that arrives while a rollout is being sampled. ``gated``: sampling call
    ``c >= 1`` may finish only after training step ``c - 1`` has ended, so a loop that does not overlap them stalls."""

    def __init__(self, module, gated: bool) -> None:
        self.module, self.gated = module, gated
        self.model = type(module.model)(module.model.config).eval()
        self.version: int | None = None
        self.loads: list[int] = []
        self.calls: list[dict] = []
        self.busy = threading.Lock()
        self.step_ended = [threading.Event() for _ in range(64)]
        self.errors: list[str] = []

    def load_weights(self, weights, send=True):
        if not self.busy.acquire(blocking=False):
            self.errors.append(f"weights pushed at step {self.module.global_step} during a rollout")
            return
        try:
            missing, unexpected = self.model.load_state_dict({n: t.detach().clone() for n, t in weights()},
                                                             strict=False)
            assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embeddings
            self.model.tie_weights()
            self.version = self.module.global_step
            self.loads.append(self.version)
        finally:
            self.busy.release()

    @torch.no_grad()
    def generate(self, prompts, params):
        with self.busy:
            call = len(self.calls)
            self.calls.append({"thread": threading.current_thread().name, "version": self.version})
            g = torch.Generator().manual_seed(params["seed"])
            completions = [torch.randint(3, 200, (int(torch.randint(1, params["max_tokens"] + 1, (), generator=g)),),
                                         generator=g).tolist() for _ in prompts for _ in range(params["n"])]
            logps = []
            for k, ids in enumerate(completions):
                prompt = prompts[k // params["n"]]
                logits = self.model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].float()
                logps.append(torch.log_softmax(logits / params["temperature"], -1)
                             .gather(-1, torch.tensor(ids)[:, None])[:, 0].tolist())
            if self.gated and call >= 1 and not self.step_ended[call - 1].wait(GATE_SECONDS):
                self.errors.append(f"sampling call {call} waited for training step {call - 1} in vain")
            self.calls[-1]["overlapped"] = self.step_ended[call - 1].is_set() if call >= 1 else None
        return completions, logps


class StepEnded(L.Callback):
    def __init__(self, engines):
        self.engines = engines

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.engines[-1].step_ended[trainer.global_step - 1].set()


def vllm_server_module(grpo_module, **knobs):
    """A GRPOModule set up as with ``use_vllm: true, vllm_mode: server`` (construction refuses use_vllm without
    CUDA: the flags are set after it, as on a GPU machine)."""
    L.seed_everything(0)
    module = grpo_module(reward_funcs=[varied_reward], learning_rate=2e-2, max_completion_length=6,
                         generation_batch_size=8, temperature=0.9, **knobs)
    as_on_a_gpu(module, use_vllm=True, vllm_mode="server")
    return module


def as_on_a_gpu(module, **vllm):
    """The vLLM knobs set after construction, in the module's group and its saved hyperparameters alike."""
    module.knobs.vllm = dataclasses.replace(module.knobs.vllm, **vllm)
    module.hparams.update(vllm)


@pytest.fixture
def engines(monkeypatch):
    """The engines the run's own ``VLLMRollouts`` (added by the module for ``use_vllm``) builds: stand-ins."""
    from lightalign.modules.sampling import vllm_engines

    made = Engines()
    monkeypatch.setattr(vllm_engines, "build_engine",
                        lambda module, trainer, *_: made.append(AheadEngine(module, made.gated)) or made[-1])
    return made


class Engines(list):
    gated = False


def fit_on_engine(module, engines, trainer_factory, prompt_data, **trainer_kw):
    fit = trainer_kw.pop("fit", {})
    callbacks = [StepEnded(engines), *trainer_kw.pop("callbacks", [])]
    trainer_factory(callbacks=callbacks, **trainer_kw).fit(module, prompt_data(), **fit)
    # A request sent before fit ended runs on after it (``close`` drops its rollout without waiting): wait for the
    # server's threads, so the records a test reads are complete however loaded the machine is.
    for thread in threading.enumerate():
        if thread.name.startswith("lightalign-vllm"):
            thread.join(timeout=2 * GATE_SECONDS)
    return engines[-1]


def test_the_vllm_server_samples_one_rollout_ahead_while_the_policy_trains_with_pushes_between_rollouts(
        grpo_module, quiet_trainer, prompt_data, engines):
    module = vllm_server_module(grpo_module, max_staleness=3)  # allows 3 rollouts ahead; the server holds one
    engines.gated = True
    engine = fit_on_engine(module, engines, quiet_trainer, prompt_data, max_steps=5)
    assert engine.errors == []
    # rollouts 0 and 1 asked for at once on the first weights, then rollout j on the weights of step j - 1
    assert [c["version"] for c in engine.calls] == [0, 0, 1, 2, 3, 4]
    assert engine.loads == [0, 1, 2, 3, 4]  # fit start, then one push between rollouts (no repeat of step 0's)
    assert all(c["thread"].startswith("lightalign-vllm") for c in engine.calls)
    assert all(c["overlapped"] for c in engine.calls[1:])  # each rollout sampled while the previous one trained
    assert module.off_policy.ahead is None  # the thread is shut down at fit end


def test_the_sampler_log_probs_and_staleness_of_rollouts_sampled_ahead_by_vllm(grpo_module, quiet_trainer,
                                                                                prompt_data, engines):
    module = vllm_server_module(grpo_module, max_staleness=1)
    seen = []
    ratio_of = module.off_policy.importance_ratio

    def recording(mod, mb, logps):
        seen.append({"step": mod.global_step, "mb": {k: v.detach().clone() for k, v in mb.items()},
                     "weights": {k: v.detach().clone() for k, v in mod.model.state_dict().items()}})
        return ratio_of(mod, mb, logps)

    module.off_policy.importance_ratio = recording
    engine = fit_on_engine(module, engines, quiet_trainer, prompt_data, max_steps=4)
    assert [c["version"] for c in engine.calls[:4]] == [0, 0, 1, 2]
    moved = 0
    for j, entry in enumerate(seen):  # the sampler's log-probs are those of the weights of step max(0, j - 1)
        mb, mask = entry["mb"], entry["mb"]["completion_mask"].bool()
        claimed = seen[max(0, j - 1)]["weights"]
        model = type(module.model)(module.model.config).eval()
        model.load_state_dict(claimed)
        with torch.no_grad():
            expected = grpo_forward(model, mb, module.hparams.temperature)[0]
        torch.testing.assert_close(mb["sampling_logps"][mask], expected[mask], atol=2e-4, rtol=0)
        model.load_state_dict(entry["weights"])
        with torch.no_grad():
            current = grpo_forward(model, mb, module.hparams.temperature)[0]
        moved += int((current[mask] - expected[mask]).abs().max() > 1e-3)
    assert moved >= 2  # stale rollouts: the policy moved since their weights were pushed


def test_a_run_resumed_with_a_vllm_rollout_in_flight_trains_as_the_uninterrupted_run(
        grpo_module, prompt_data, tmp_path, engines):
    def run(**fit):
        module = vllm_server_module(grpo_module, max_staleness=1)
        checkpoints = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
        trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                            num_sanity_val_steps=0, max_steps=4, callbacks=[checkpoints])
        trainer.fit(module, prompt_data(), **fit)
        return module.model.state_dict(), engines[-1]

    whole, _ = run()
    checkpoint = tmp_path / "epoch=0-step=2.ckpt"
    resumed, engine = run(ckpt_path=str(checkpoint))
    # rollout 2 was in flight at the step-2 checkpoint: kept there, the resumed run asks only for rollout 3 on
    assert [c["version"] for c in engine.calls] == [2, 3]
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)


@pytest.mark.parametrize("knobs, message", [
    (dict(max_staleness=1, vllm_mode="colocate"), r"Set vllm_mode: server, or max_staleness: 0"),
    (dict(max_staleness=1, async_sampler_threads=1), r"the vLLM server samples: drop async_sampler_threads"),
])
def test_vllm_ahead_refusals(grpo_module, quiet_trainer, prompt_data, engines, knobs, message):
    mode = knobs.pop("vllm_mode", "server")
    module = vllm_server_module(grpo_module, **knobs)
    as_on_a_gpu(module, vllm_mode=mode)
    with pytest.raises(ValueError, match=message):
        fit_on_engine(module, engines, quiet_trainer, prompt_data, max_steps=1)


# ------------------------------------------------------------------------------------------------ weight pushes
@pytest.fixture
def weight_server(monkeypatch):
    """A ``vllm serve`` stand-in for the weight-transfer routes, and vLLM's trainer-side NCCL functions replaced
    by stand-ins: ``state["update"]`` is how the server answers ``/update_weights`` (``ok``, ``fail``: HTTP 500,
    ``hang``: never within the timeout); ``state["broadcast"]``: ``ok`` (reads every tensor) or ``stall`` (blocks
    forever, as NCCL does when the other side is gone)."""
    state = {"update": "ok", "broadcast": "ok", "routes": [], "sent": []}
    release = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        log_message = lambda self, *args: None  # noqa: E731

        def reply(self, body, status=200):
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            state["routes"].append(self.path)
            if self.path == "/v1/models":
                return self.reply({"data": [{"id": "tiny"}]})
            if self.path == "/get_world_size":
                return self.reply({"world_size": 1})
            self.reply({"detail": "Not Found"}, 404)

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            state["routes"].append(self.path)
            if self.path == "/update_weights" and state["update"] == "fail":
                return self.reply({"detail": "CUDA out of memory"}, 500)
            if self.path == "/update_weights" and state["update"] == "hang":
                release.wait(30)
            self.reply({})

    def broadcast(iterator, group, src, post_iter_func):
        if state["broadcast"] == "stall":
            release.wait(60)
        state["sent"] = [name for name, _ in iterator]

    modules = {
        "vllm": types.ModuleType("vllm"),
        "vllm.distributed": types.ModuleType("vllm.distributed"),
        "vllm.distributed.weight_transfer": types.ModuleType("vllm.distributed.weight_transfer"),
        "vllm.distributed.weight_transfer.nccl_common": types.SimpleNamespace(trainer_init=lambda info: "group"),
        "vllm.distributed.weight_transfer.packed_tensor": types.SimpleNamespace(
            packed_nccl_broadcast_producer=broadcast),
        "vllm.utils": types.ModuleType("vllm.utils"),
        "vllm.utils.network_utils": types.SimpleNamespace(get_ip=lambda: "127.0.0.1"),
    }
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    state["url"] = f"http://127.0.0.1:{server.server_address[1]}"
    yield state
    release.set()
    server.shutdown()
    server.server_close()


def push(state, timeout=1.0):
    """``load_weights`` on its own thread, given 10 s: returns (the error raised or None, whether it returned).
    No per-request timeout (``vllm_server_timeout: 0``): only ``vllm_weight_sync_timeout`` bounds the push."""
    engine = ServerEngine(state["url"], group_port=51216, timeout=0, sender=True, weight_sync_timeout=timeout)
    weights = {"a.weight": torch.ones(2, 2), "b.bias": torch.zeros(3)}
    outcome = []

    def run():
        try:
            engine.load_weights(lambda: iter(weights.items()))
            outcome.append(None)
        except Exception as err:  # noqa: BLE001 - the test reads it
            outcome.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(10)
    return (outcome[0] if outcome else None), bool(outcome)


def test_a_weight_push_sends_every_tensor_between_the_servers_update_routes(weight_server):
    error, returned = push(weight_server)
    assert returned and error is None
    assert weight_server["sent"] == ["a.weight", "b.bias"]
    posts = [r for r in weight_server["routes"] if not r.startswith("/v1") and r != "/get_world_size"]
    assert posts == ["/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
                     "/finish_weight_update", "/reset_prefix_cache"]


def test_a_server_failing_the_update_is_an_error_even_while_the_transfer_is_stuck(weight_server):
    weight_server.update(update="fail", broadcast="stall")
    error, returned = push(weight_server)
    assert returned, "the push hung on the stuck NCCL side instead of reporting the server's failure"
    assert isinstance(error, ConnectionError) and "failed the weight update" in str(error)
    assert "/finish_weight_update" in weight_server["routes"]  # the server is told to leave its update state


@pytest.mark.parametrize("stuck", ["update", "broadcast"])
def test_a_stalled_weight_transfer_ends_after_vllm_weight_sync_timeout(weight_server, stuck):
    weight_server.update({"update": "hang"} if stuck == "update" else {"broadcast": "stall"})
    error, returned = push(weight_server, timeout=0.5)
    assert returned, "the push hung past vllm_weight_sync_timeout"
    assert "vllm_weight_sync_timeout" in str(error), error
