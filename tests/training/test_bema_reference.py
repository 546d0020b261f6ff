"""BEMA as the reference model (``update_ref_model``, ``BEMAReference``): the same reference weights as TRL 1.16's
``BEMACallback(update_ref_model=True)`` after every optimizer step over a fixed weight sequence
(tests/fixtures/trl_bema_parity.pt, written by bench/trl_parity/bema.py), also across a save and restore of the
callback's state mid-sequence; the knob group's checks and the refusals at construction; the shipped DPO config's
BEMA block through the console script."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

from helpers import console_script
from lightalign import DPOModule, GRPOModule, KTOModule, OnlineDPOModule, SFTModule
from lightalign.callbacks.bema_reference import BEMAReference
from lightalign.modules.reference.bema import BEMAKnobs

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "trl_bema_parity.pt"


class Tiny(torch.nn.Module):
    """The bench's stand-in policy: the same parameter names and shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(4, 3)
        self.second = torch.nn.Linear(3, 2)


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@torch.no_grad()
def load(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    for name, param in model.named_parameters():
        param.copy_(weights[name])


def fresh(knobs: dict, init: dict[str, torch.Tensor]):
    """A callback on a stand-in module whose policy and reference start at ``init`` (as a run's: the reference is
    a copy of the initial policy, also in a resumed run, whose policy is then restored)."""
    policy, reference = Tiny(), Tiny()
    load(policy, init)
    load(reference, init)
    module = types.SimpleNamespace(model=policy, ref_model=reference, device=torch.device("cpu"))
    return BEMAReference(BEMAKnobs(update_ref_model=True, **knobs)), module


@pytest.mark.parametrize("restore_at", [None, 7], ids=["uninterrupted", "restored-after-step-7"])
def test_reference_equals_trl_bema_after_every_step(restore_at):
    """Ours, driven as Lightning drives it (two micro-batch ends per optimizer step: accumulation 2), equals TRL's
    reference and averaged weights after each of 14 steps, for every case (update_freq, update_after, lag,
    multiplier, ema_power, bias_power 0 and 8, min_ema_multiplier, ref_model_update_freq/_after). Restored: the
    callback's state after step 7 is saved, a new callback on a fresh reference (the initial policy's copy) and the
    policy at step 7 loads it, and goes on. Float32 elementwise arithmetic in TRL's order: equal up to a fused
    multiply-add (1e-6 relative). Mutations that fail it: the bias correction dropped (average = EMA); bias_power
    used for beta (wrong power); the update schedule counted from step 0 instead of ``update_after``; the reference
    copied every ``update_freq`` steps instead of its own schedule; the restored state not applied (fresh EMA and
    theta_0 at the restored policy)."""
    fixture = torch.load(FIXTURE, weights_only=True)
    init, steps = fixture["init"], fixture["steps"]
    for case in fixture["cases"]:
        callback, module = fresh(case["knobs"], init)
        callback.on_fit_start(None, module)
        for step, weights in enumerate(steps, start=1):
            if step - 1 == restore_at:
                state = callback.state_dict()
                callback, module = fresh(case["knobs"], init)
                load(module.model, steps[restore_at - 1])
                callback.load_state_dict(state)
                callback.on_fit_start(None, module)
            load(module.model, weights)
            trainer = types.SimpleNamespace(global_step=step)
            callback.on_train_batch_end(trainer, module)
            callback.on_train_batch_end(trainer, module)  # the next micro-batch's end, no optimizer step yet
            where = f"{case['knobs']} after step {step}"
            torch.testing.assert_close(flat(module.ref_model), case["reference"][step - 1], rtol=1e-6, atol=1e-7,
                                       msg=lambda m: f"reference {where}: {m}")
            average = torch.cat([callback.weights.average[n].reshape(-1) for n, _ in module.model.named_parameters()])
            torch.testing.assert_close(average, case["average"][step - 1], rtol=1e-6, atol=1e-7,
                                       msg=lambda m: f"average {where}: {m}")


def test_knob_checks():
    for knobs, message in [
        (dict(update_freq=0), "update_freq must be an integer >= 1"),
        (dict(ref_model_update_freq=0), "ref_model_update_freq must be an integer >= 1"),
        (dict(update_after=-1), "update_after must be an integer >= 0"),
        (dict(lag=-2), "lag must be an integer >= 0"),
        (dict(multiplier=0.0), "multiplier must be > 0"),
        (dict(ema_power=-0.5), "ema_power must be >= 0"),
        (dict(min_ema_multiplier=1.5), "min_ema_multiplier must lie in"),
        (dict(device="gpu0"), "device must name a torch device"),
    ]:
        with pytest.raises(ValueError, match=message):
            BEMAKnobs(update_ref_model=True, **knobs)


def test_refusals_at_construction(tiny_model, tiny_dir):
    """Whatever cannot hold a reference of its own that BEMA could rewrite is refused naming update_ref_model (the
    reasons of TR-DPO's ``reference_sync_blocker``), and so is TR-DPO's sync beside it."""
    cases = [
        (lambda: DPOModule(model=tiny_model, update_ref_model=True, sync_ref_model=True), "choose one of them"),
        (lambda: DPOModule(model=tiny_model, update_ref_model=True, precompute_ref_log_probs=True), "stale"),
        (lambda: KTOModule(model=tiny_model, update_ref_model=True, precompute_ref_log_probs=True), "stale"),
        (lambda: DPOModule(model=tiny_model, update_ref_model=True, reference_free=True), "reference_free"),
        (lambda: DPOModule(model=tiny_model, update_ref_model=True, peft_config={"r": 4}), "LoRA"),
        (lambda: DPOModule(str(tiny_dir), from_config=True, update_ref_model=True,
                           ref_model_init_kwargs={"quantization_config": {"load_in_8bit": True}}), "quantized"),
        (lambda: GRPOModule(model=tiny_model, reward_funcs=[len], update_ref_model=True), "beta=0"),
        (lambda: OnlineDPOModule(model=tiny_model, reward_funcs=[len], update_ref_model=True,
                                 peft_config={"r": 4}), "LoRA"),
    ]
    for make, message in cases:
        with pytest.raises(ValueError, match=f"update_ref_model=True .*{message}"):
            make()
    with pytest.raises(TypeError, match="SFTModule has no knob 'update_ref_model'; DPOModule, GRPOModule, KTOModule, "
                                        "OnlineDPOModule, PPOModule and RLOOModule take it"):
        SFTModule(model=tiny_model, update_ref_model=True)
    # a method with its reference in memory takes it (KTO's and online DPO's included)
    for make in (lambda: KTOModule(model=tiny_model, update_ref_model=True),
                 lambda: OnlineDPOModule(model=tiny_model, reward_funcs=[len], update_ref_model=True),
                 lambda: GRPOModule(model=tiny_model, reward_funcs=[len], beta=0.04, update_ref_model=True)):
        assert make().knobs.bema.update_ref_model


@pytest.mark.slow
def test_dpo_tiny_config_with_its_bema_block_uncommented(repo, tmp_path):
    """configs/dpo_tiny.yaml with its commented BEMA block switched on, through the console script, the block's
    frequencies set to 2 for a 4-step run: it trains, the fit-start line says the reference is BEMA's, and the last
    checkpoint holds the BEMA state and a reference rewritten twice (steps 2 and 4), which is no longer the
    initial policy."""
    text = (repo / "configs" / "dpo_tiny.yaml").read_text()
    block = [line for line in text.splitlines() if line.strip().startswith(("# update_ref_model:", "# update_freq:",
                                                                              "# ref_model_update_freq:"))]
    assert len(block) == 3, block
    for line in block:
        text = text.replace(line, line.replace("# ", "", 1))
    config = tmp_path / "dpo_bema.yaml"
    config.write_text(text)
    proc = console_script.run(repo, "fit", "--config", str(config), "--trainer.max_steps", "4",
                              "--model.update_freq", "2", "--model.ref_model_update_freq", "2",
                              "--data.batch_size", "4", "--trainer.limit_val_batches", "0", "--plot.enabled", "false",
                              "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "reference = BEMA of the policy, renewed every 2 steps (average every 2)" in out, out[-4000:]
    checkpoint = torch.load(next((tmp_path / "runs").rglob("last.ckpt")), weights_only=True)
    state = next(v for k, v in checkpoint["callbacks"].items() if k.startswith("BEMAReference"))
    assert (state["last_step"], state["updates"], state["reference_updates"]) == (4, 2, 2), state
    assert not all(torch.equal(state["theta0"][n], state["reference"][n]) for n in state["theta0"])


def _fit_two_steps(module, data) -> BEMAReference:
    import lightning as L

    trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0)
    trainer.fit(module, data)
    return next(c for c in trainer.callbacks if isinstance(c, BEMAReference))


@pytest.mark.parametrize("method", ["kto", "online_dpo"])
def test_methods_beside_dpo_rewrite_their_reference(method, tiny_dir, data_dir):
    """KTO and online DPO (their reference built by their own ``configure_model``) take the BEMA reference: after
    two optimizer steps (average and reference renewed at each) the reference in use is the average, and no longer
    the initial policy. Mutation: KTO without ``uses_reference_model`` -> refused at construction."""
    from lightalign import PromptDataModule, UnpairedPreferenceDataModule
    from lightalign.rewards import digit_fraction_reward

    torch.manual_seed(0)
    bema = dict(from_config=True, learning_rate=1e-2, update_ref_model=True, update_freq=1, ref_model_update_freq=1)
    if method == "kto":
        module = KTOModule(str(tiny_dir), **bema)
        data = UnpairedPreferenceDataModule(str(data_dir / "arithmetic_unpaired.jsonl"), tokenizer=str(tiny_dir),
                                            max_length=32, batch_size=4)
    else:
        module = OnlineDPOModule(str(tiny_dir), reward_funcs=[digit_fraction_reward], max_completion_length=4, **bema)
        data = PromptDataModule(str(data_dir / "arithmetic_prompts.jsonl"), tokenizer=str(tiny_dir),
                                max_prompt_length=16, batch_size=2)
    callback = _fit_two_steps(module, data)
    assert (callback.updates, callback.reference_updates) == (2, 2)
    reference = dict(module.ref_model.named_parameters())
    for name, average in callback.weights.average.items():
        assert torch.equal(reference[name], average), name
    assert not all(torch.equal(reference[n], callback.weights.theta0[n]) for n in callback.weights.names)


def test_schedule_knobs_without_the_switch_and_an_absent_device_are_refused(tiny_model):
    """BEMA's schedule knobs set without ``update_ref_model`` would train a plain reference without a word: refused,
    naming them (mutation: drop the ``changed`` check in ``BEMAKnobs.check`` -> DPOModule constructs). A ``device``
    this machine does not have is refused at construction, not by an assertion at fit start."""
    with pytest.raises(ValueError, match=r"^update_freq, lag set BEMA's schedule, .* add update_ref_model: true"):
        DPOModule(model=tiny_model, update_freq=2, lag=5)
    with pytest.raises(ValueError, match=r"^ema_power sets BEMA's schedule"):
        KTOModule(model=tiny_model, ema_power=0.8)
    BEMAKnobs(update_ref_model=True, lag=3)  # with the switch: taken
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device 'cuda': this machine has no CUDA device"):
            BEMAKnobs(update_ref_model=True, device="cuda")


@pytest.mark.parametrize("key", ["update_ref_model", "sync_ref_model"])
def test_a_resume_that_switches_the_rewritten_reference_is_refused(tiny_model, key):
    """A checkpoint of a run whose reference was rewritten (BEMA, TR-DPO's sync: its state in the checkpoint) resumed
    without the switch would train on against a fixed reference, silently (Lightning only warns that a callback's
    state is unused); the reverse starts a rewritten reference mid-run. ``runs.check_resume`` refuses both, naming
    the knob (mutation: an empty ``REFERENCE_SWITCHES`` -> no error)."""
    import lightning as L

    from lightalign.runs import ResumeError, check_resume

    module = DPOModule(model=tiny_model)
    trainer = L.Trainer(accelerator="cpu", max_steps=10, logger=False, enable_checkpointing=False)
    for saved in (True, False):
        given = DPOModule(model=tiny_model, **{key: True}) if not saved else module
        checkpoint = {"global_step": 2, "hyper_parameters": {key: saved}}
        with pytest.raises(ResumeError, match=f"written with {key}: {str(saved).lower()}, the config has "
                                              f"{str(not saved).lower()}.*--model.{key} {str(saved).lower()}"):
            check_resume(checkpoint, Path("last.ckpt"), trainer, given, None)
    assert check_resume({"global_step": 2, "hyper_parameters": {key: False}}, Path("last.ckpt"), trainer, module,
                        None) == []
