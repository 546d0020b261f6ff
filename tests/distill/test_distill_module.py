"""``DistillModule``: the teacher stays frozen and in eval mode, the training loss is the loss function on independent
forwards, the lmbda draw decides who writes the completions (and a resumed run draws the same), a teacher of another
vocabulary is refused before any weights load, exact resume, and the console script."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import lightning as L
import pytest
import torch

from helpers import console_script
from lightalign.hub import load_causal_lm

KNOWN_TOKEN = 77  # what the "greedy" teacher always writes


def _model_folder(tiny_dir: Path, folder: Path, seed: int | None = None, **config) -> Path:
    """A copy of the tiny model's folder with ``config`` changed, with weights (seed) or config-only (None)."""
    folder.mkdir(parents=True, exist_ok=True)
    for f in tiny_dir.iterdir():
        shutil.copy(f, folder / f.name)
    data = json.loads((folder / "config.json").read_text())
    data.update(config)
    (folder / "config.json").write_text(json.dumps(data))
    if seed is not None:
        torch.manual_seed(seed)
        load_causal_lm(str(folder), from_config=True).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def teacher_dir(tiny_dir, tmp_path_factory) -> Path:
    """A teacher with weights whose config keeps dropout on: in train mode its forwards would be random."""
    return _model_folder(tiny_dir, tmp_path_factory.mktemp("teacher"), seed=1, attention_dropout=0.5)


def greedy_teacher(tiny_dir: Path) -> torch.nn.Module:
    """A tiny model whose next token is KNOWN_TOKEN after any prefix (by a wide margin, also when sampled): residual
    dimension 0 is 1 everywhere (no layer writes to it), the final norm keeps only it, the head maps it to the
    token."""
    torch.manual_seed(2)
    model = load_causal_lm(str(tiny_dir), from_config=True)
    from transformers import AutoModelForCausalLM

    config = model.config
    config.tie_word_embeddings = False
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 1.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0].zero_()
            layer.mlp.down_proj.weight[0].zero_()
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[KNOWN_TOKEN, 0] = 1000.0
    return model


def _module(tiny_dir, teacher, **kw):
    from lightalign import DistillModule

    kw.setdefault("max_completion_length", 5)
    kw.setdefault("learning_rate", 1e-3)
    torch.manual_seed(0)
    where = {"teacher_model": teacher} if isinstance(teacher, torch.nn.Module) else {
        "teacher_model_name_or_path": str(teacher)}
    return DistillModule(kw.pop("student", str(tiny_dir)), from_config=True, **where, **kw)


def _data(tiny_dir, data_dir, student=None, **kw):
    from lightalign import PromptDataModule

    kw.setdefault("batch_size", 4)
    return PromptDataModule(str(data_dir / "arithmetic_sft.jsonl"), tokenizer=str(student or tiny_dir),
                            max_prompt_length=16, **kw)


class Record(L.Callback):
    """Per training batch: who wrote the completions, the rows and the loss, the student's weights before the
    step, and whether the teacher was in train mode or had a gradient-requiring parameter."""

    def __init__(self):
        self.sources, self.rows, self.losses, self.students, self.teacher_training = [], [], [], [], []
        self.teacher_trainable = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.students.append({k: v.detach().clone() for k, v in module.model.state_dict().items()})
        real = module.completions

        def recording(b, source):
            rows = real(b, source)
            self.rows.append({k: v.detach().clone() for k, v in rows.items()})
            return rows

        module.completions = recording

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        del module.completions
        self.sources.append(module.last_source)
        self.losses.append(outputs["loss"].detach().clone())
        self.teacher_training.append(module.teacher.training)
        self.teacher_trainable.append(any(p.requires_grad for p in module.teacher.parameters()))


def _fit(module, data, max_steps=2, callbacks=(), **kw):
    kw.setdefault("logger", False)
    kw.setdefault("enable_checkpointing", False)
    trainer = L.Trainer(accelerator="cpu", enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, max_steps=max_steps, limit_val_batches=0,
                        callbacks=list(callbacks), **kw)
    trainer.fit(module, data)
    return trainer


def test_gradients_reach_only_the_student_and_the_teacher_never_changes(tiny_dir, data_dir, teacher_dir):
    module = _module(tiny_dir, teacher_dir, lmbda=0.5)
    record = Record()
    module.configure_model()
    before = {k: v.clone() for k, v in module.teacher.state_dict().items()}
    student_before = {k: v.clone() for k, v in module.model.state_dict().items()}
    _fit(module, _data(tiny_dir, data_dir), max_steps=3, callbacks=[record])
    assert record.teacher_training == [False] * 3  # eval mode in every step, whatever Lightning's .train() did
    assert record.teacher_trainable == [False] * 3
    assert all(p.grad is None for p in module.teacher.parameters())
    for name, value in module.teacher.state_dict().items():
        torch.testing.assert_close(value, before[name], atol=0, rtol=0, msg=name)
    # the teacher is outside the module tree: never optimised nor checkpointed
    assert not any(k.startswith("teacher") for k in module.state_dict())
    optimised = {id(p) for group in module.trainer.optimizers[0].param_groups for p in group["params"]}
    assert not optimised & {id(p) for p in module.teacher.parameters()}
    assert any(not torch.equal(v, student_before[k]) for k, v in module.model.state_dict().items())


@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantized_teacher_is_a_frozen_quantized_copy_close_to_its_full_precision_weights(tiny_dir, data_dir,
                                                                                            teacher_dir, bits):
    """teacher_model_init_kwargs with a bitsandbytes quantization_config, as the reference models take it: the teacher
    is loaded quantized (smaller than the student), stays frozen in eval mode, and grades the rows as its
    full-precision weights do, up to the quantization error."""
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("accelerate")
    from lightalign.modules.distill import completion_logits

    qc = {"load_in_8bit": True} if bits == 8 else {"load_in_4bit": True, "bnb_4bit_compute_dtype": "float32"}
    module = _module(tiny_dir, teacher_dir, lmbda=0.0, teacher_model_init_kwargs={"quantization_config": qc})
    record = Record()
    _fit(module, _data(tiny_dir, data_dir), max_steps=1, callbacks=[record])
    teacher = module.teacher
    assert getattr(teacher, f"is_loaded_in_{bits}bit")
    teacher_bytes = sum(p.numel() * p.element_size() for p in teacher.parameters())
    assert teacher_bytes < sum(p.numel() * p.element_size() for p in module.model.parameters())
    assert record.teacher_training == [False] and record.teacher_trainable == [False]
    full = load_causal_lm(str(teacher_dir)).eval()
    with torch.no_grad():
        quantized = torch.log_softmax(completion_logits(teacher, record.rows[0]), -1)
        exact = torch.log_softmax(completion_logits(full, record.rows[0]), -1)
        other = torch.log_softmax(completion_logits(load_causal_lm(str(tiny_dir), from_config=True).eval(),
                                                    record.rows[0]), -1)
    mask = record.rows[0]["completion_mask"].bool()
    # mean |log-prob difference| over the vocabulary at the completion positions: measured 0.0037 (8-bit) and 0.049
    # (4-bit); another random init of the model is 0.26 away
    gap, far = (quantized - exact).abs()[mask].mean(), (other - exact).abs()[mask].mean()
    bound = {8: 0.02, 4: 0.1}[bits]
    assert torch.isfinite(quantized[mask]).all() and 0 < gap < bound, gap
    assert far > 2 * bound, far  # the bound tells the teacher's weights from others


def _independent_loss(module, rows, student_state):
    """The loss recomputed from scratch: a fresh student with the step's weights and the teacher (eval mode), each
    forwarded on the full [prompt, completion] rows, the logits predicting the completion tokens, the completion
    mask."""
    from lightalign.modules import generalized_jsd_loss, on_policy_distillation_loss

    hp = module.hparams
    student = load_causal_lm(module.model_name_or_path, from_config=True)
    student.load_state_dict(student_state)
    student.eval()
    teacher = module.teacher.eval()
    ids = torch.cat([rows["prompt_ids"], rows["completion_ids"]], 1)
    attention = torch.cat([rows["prompt_mask"], rows["completion_mask"]], 1)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    p, t = rows["prompt_ids"].shape[1], rows["completion_ids"].shape[1]
    mask = rows["completion_mask"].bool()
    with torch.no_grad():
        s_logits = student(input_ids=ids, attention_mask=attention, position_ids=positions).logits[:, p - 1:p + t - 1]
        t_logits = teacher(input_ids=ids, attention_mask=attention, position_ids=positions).logits[:, p - 1:p + t - 1]
    if hp.loss_type == "gkd":
        return generalized_jsd_loss(s_logits, t_logits, mask, beta=hp.beta, temperature=hp.temperature)
    s_logps = torch.log_softmax(s_logits / hp.temperature, -1).gather(-1, rows["completion_ids"][..., None])[..., 0]
    t_logps = torch.log_softmax(t_logits / hp.temperature, -1).gather(-1, rows["completion_ids"][..., None])[..., 0]
    advantages = (t_logps - s_logps) * mask
    size = advantages.abs()  # IW-OPD: 1 + gamma (1 - |A| accumulated before the token / the sequence's |A|)
    weights = 1 + hp.iw_opd_gamma * (1 - (size.cumsum(1) - size) / size.sum(1, keepdim=True).clamp(min=1e-8))
    return on_policy_distillation_loss(s_logps, advantages * weights, mask)


@pytest.mark.parametrize("kw", [dict(lmbda=0.0), dict(lmbda=1.0, beta=0.2, temperature=0.7),
                                dict(loss_type="on_policy"), dict(loss_type="on_policy", iw_opd_gamma=0.5),
                                dict(loss_type="on_policy", temperature=0.7, padding_free=True)],
                         ids=["data", "student", "on_policy", "iw_opd", "on_policy-padding_free"])
def test_training_loss_equals_the_loss_function_on_independent_forwards(tiny_dir, data_dir, teacher_dir, kw):
    module = _module(tiny_dir, teacher_dir, **kw)
    record = Record()
    _fit(module, _data(tiny_dir, data_dir), max_steps=2, callbacks=[record])
    assert record.sources == ["data" if kw.get("lmbda") == 0.0 else "student"] * 2
    for rows, loss, state in zip(record.rows, record.losses, record.students):
        # the completions hold some padding (mask 0) and the prompts are left-padded: the mask matters
        expected = _independent_loss(module, rows, state)
        torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)


def test_padding_free_trains_as_the_padded_rows_do(tiny_dir, data_dir, teacher_dir):
    """padding_free (one packed row, logits only at the completion targets) gives the padded layout's losses and
    student gradients up to float32 rounding, on rows that hold padding (prompts of different lengths, left-padded;
    completions of different lengths). Gradients, not weights: AdamW's first steps move a weight by about the
    learning rate whatever its gradient's size, so rounding-level gradient differences do not stay small there."""

    class Gradients(Record):
        def on_before_optimizer_step(self, trainer, module, optimizer):
            self.grads = getattr(self, "grads", []) + [{n: p.grad.clone() for n, p in module.model.named_parameters()}]

    runs = []
    for padding_free in (False, True):
        module, record = _module(tiny_dir, teacher_dir, lmbda=0.0, padding_free=padding_free), Gradients()
        _fit(module, _data(tiny_dir, data_dir), max_steps=2, callbacks=[record])
        runs.append((torch.stack(record.losses), record.grads))
        assert module.padding_free_note == ("padding_free (asked)" if padding_free else  # the fit-start line's words
                                            "padded rows (padding_free: false)")
    rows = record.rows[0]
    assert not rows["prompt_mask"].all() and not rows["completion_mask"].all()  # the padding is there to skip
    (padded_losses, padded), (packed_losses, packed) = runs
    torch.testing.assert_close(packed_losses, padded_losses, atol=1e-6, rtol=1e-5)
    for step in (0, 1):
        assert any(g.abs().max() > 0 for g in padded[step].values())
        for name, grad in padded[step].items():
            torch.testing.assert_close(packed[step][name], grad, atol=1e-6, rtol=1e-4, msg=f"step {step} {name}")


def test_padding_free_is_refused_at_fit_start_on_a_teacher_that_cannot_run_it(tiny_dir, data_dir, teacher_dir,
                                                                            monkeypatch):
    """The teacher's layout is checked at fit start like the student's: a teacher the probe measures inexact in the
    packed layout (what it says of an ALiBi model; here the verdict is replaced for the teacher only) refuses the
    run before any batch, naming the knob and the alternative."""
    from lightalign.modules.adaptations import support
    from lightalign.modules.adaptations.probe import Verdict

    teacher = load_causal_lm(str(teacher_dir)).eval()
    module = _module(tiny_dir, teacher, lmbda=0.0, padding_free=True)
    module.distill_loss = lambda *a, **kw: pytest.fail("trained before refusing")
    real = support.measured
    monkeypatch.setattr(support, "measured", lambda model, layout, *a, **kw: Verdict(layout, False, 0.7)
                        if layout == "grpo_packed" and model is teacher else real(model, layout, *a, **kw))
    with pytest.raises(ValueError, match=r"^model\.padding_free \(GRPOModule / RLOOModule / DistillModule\) cannot "
                                         r"run exactly on .*7\.0e-01 nats.*model\.padding_free: false"):
        _fit(module, _data(tiny_dir, data_dir), max_steps=1)


def test_padding_free_unset_is_the_cpu_default_and_steps_back_on_an_inexact_teacher(tiny_dir, data_dir, teacher_dir,
                                                                                    monkeypatch, caplog):
    """padding_free unset: on the CPU the rows are packed (the measured default), said at fit start; a teacher the
    probe measures inexact in the packed layout makes the run train on padded rows instead of refusing, the line
    naming the teacher and the difference. Elsewhere (the table's neutral value) padded, with no probe. Mutations:
    the teacher not probed -> the second run packs, fails; the default read as false -> the first run pads, fails."""
    from lightalign.modules.adaptations import support
    from lightalign.modules.adaptations.probe import Verdict
    from lightalign.modules.distill import default_padding_free

    teacher = load_causal_lm(str(teacher_dir)).eval()
    module = _module(tiny_dir, teacher, lmbda=0.0)
    _fit(module, _data(tiny_dir, data_dir), max_steps=1, callbacks=[Record()])
    assert module.padding_free_on and module.batch_layout()[0] == "grpo_packed"
    assert module.padding_free_note == "padding_free (the CPU default)"

    real = support.measured
    monkeypatch.setattr(support, "measured", lambda model, layout, *a, **kw: Verdict(layout, False, 0.7)
                        if layout == "grpo_packed" and model is teacher else real(model, layout, *a, **kw))
    module = _module(tiny_dir, teacher, lmbda=0.0)
    _fit(module, _data(tiny_dir, data_dir), max_steps=1, callbacks=[Record()])
    assert not module.padding_free_on and module.batch_layout()[0] == "grpo_padded"
    assert re.match(r"padded rows: the default padding_free is not exact on the teacher: .*7\.0e-01 nats",
                    module.padding_free_note), module.padding_free_note

    probed = []
    monkeypatch.setattr(support, "measured", lambda *a, **kw: probed.append(a) or pytest.fail("probed"))
    assert default_padding_free(module.model, teacher, torch.device("meta"), 64) == (False, None) and not probed


def test_lmbda_decides_who_writes_the_completions(tiny_dir, data_dir, teacher_dir, tokenizer):
    # lmbda 1: the student samples every batch; 0: none, the data's completions (tokenised + EOS) are used
    record = Record()
    _fit(_module(tiny_dir, teacher_dir, lmbda=1.0), _data(tiny_dir, data_dir), max_steps=3, callbacks=[record])
    assert record.sources == ["student"] * 3
    record = Record()
    data = _data(tiny_dir, data_dir)
    _fit(_module(tiny_dir, teacher_dir, lmbda=0.0), data, max_steps=3, callbacks=[record])
    assert record.sources == ["data"] * 3
    first = record.rows[0]
    answers = {r["prompt"]: r["completion"] for r in map(json.loads, open(data_dir / "arithmetic_sft.jsonl"))}
    prompt = tokenizer.decode(first["prompt_ids"][0][first["prompt_mask"][0].bool()], skip_special_tokens=True)
    ids = first["completion_ids"][0][first["completion_mask"][0].bool()].tolist()
    assert ids == tokenizer(answers[prompt], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    # lmbda 0 with seq_kd: the teacher samples every batch (this one always writes KNOWN_TOKEN)
    record = Record()
    _fit(_module(tiny_dir, greedy_teacher(tiny_dir), lmbda=0.0, seq_kd=True), _data(tiny_dir, data_dir),
         max_steps=2, callbacks=[record])
    assert record.sources == ["teacher"] * 2
    for rows in record.rows:
        assert rows["completion_mask"].all() and (rows["completion_ids"] == KNOWN_TOKEN).all()
    # lmbda 0.5: both, in an order the seed fixes
    record = Record()
    _fit(_module(tiny_dir, teacher_dir, lmbda=0.5), _data(tiny_dir, data_dir), max_steps=8, callbacks=[record])
    assert set(record.sources) == {"student", "data"}


def test_without_completions_a_share_of_data_batches_is_refused_at_fit_start(tiny_dir, data_dir, teacher_dir):
    from lightalign import DataFormatError, PromptDataModule

    data = PromptDataModule(str(data_dir / "arithmetic_prompts.jsonl"), tokenizer=str(tiny_dir), batch_size=4)
    with pytest.raises(DataFormatError, match=r"lmbda is 0.5 and seq_kd is false.*no 'completion' column"):
        _fit(_module(tiny_dir, teacher_dir), data, max_steps=1)
    with pytest.raises(ValueError, match="on_policy.*needs lmbda 1"):
        _module(tiny_dir, teacher_dir, loss_type="on_policy", lmbda=0.5)


def test_lmbda_unset_is_the_loss_types_default_and_saved_resolved(tiny_dir, teacher_dir):
    """lmbda null: 0.5 for gkd, 1 for on_policy, resolved once and saved as the run's lmbda (what the checkpoint's
    hyperparameters and the draws read). Mutation: the group leaves it None -> the saved values are None."""
    gkd, on_policy = _module(tiny_dir, teacher_dir), _module(tiny_dir, teacher_dir, loss_type="on_policy")
    assert (gkd.hparams.lmbda, gkd.knobs.distill_loss.lmbda) == (0.5, 0.5)
    assert (on_policy.hparams.lmbda, on_policy.knobs.distill_loss.lmbda) == (1.0, 1.0)


def test_a_teacher_of_another_vocabulary_is_refused_before_any_weights_load(tiny_dir, tmp_path, monkeypatch):
    import lightalign.hub as hub

    config_only = _model_folder(tiny_dir, tmp_path / "big-vocab", seed=None, vocab_size=2048)

    def no_loading(*args, **kwargs):
        raise AssertionError("weights were loaded before the vocabularies were compared")

    monkeypatch.setattr(hub, "load_model", no_loading)
    with pytest.raises(ValueError, match=r"teacher's vocabulary \(2048 tokens.*student's \(1024 tokens"):
        _module(tiny_dir, config_only)


def test_the_vocabulary_of_a_zero3_partitioned_model_is_its_full_size(tiny_dir):
    """Under DeepSpeed ZeRO-3 a parameter is an empty placeholder carrying its full shape as ``ds_shape``: the built
    student's vocabulary is that, not 0 (a 0 refused every teacher; tests/strategies/test_scale.py runs ZeRO-3)."""
    from lightalign.modules.reference.vocabulary import model_vocab_size

    model = load_causal_lm(str(tiny_dir), from_config=True)
    weight = model.get_output_embeddings().weight
    full = weight.shape
    weight.data = torch.empty(0)
    weight.ds_shape = full
    assert model_vocab_size(model) == full[0] == 1024


def test_killed_and_resumed_equals_uninterrupted(tiny_dir, data_dir, teacher_dir, tmp_path):
    """Dropout on in the student (so the RNG streams matter), half the batches student-sampled: a run resumed from
    its step-2 checkpoint ends bit-identical to the uninterrupted 4-step run, with the same lmbda draws."""
    student = _model_folder(tiny_dir, tmp_path / "student", seed=None, attention_dropout=0.3)

    def fit(max_steps, ckpt_path=None, ckpt_dir=None):
        record = Record()
        callbacks = [record]
        if ckpt_dir is not None:
            callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=1,
                                                                 save_top_k=-1))
        module = _module(tiny_dir, teacher_dir, student=str(student), lmbda=0.5, disable_dropout=False)
        L.seed_everything(3)
        trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                            num_sanity_val_steps=0, max_steps=max_steps, limit_val_batches=0, callbacks=callbacks,
                            enable_checkpointing=ckpt_dir is not None)
        trainer.fit(module, _data(tiny_dir, data_dir, student=student), ckpt_path=ckpt_path)
        return module, record

    full, full_record = fit(4, ckpt_dir=tmp_path / "ckpt")
    assert set(full_record.sources) == {"student", "data"}
    resumed, resumed_record = fit(4, ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=2.ckpt"))
    assert resumed_record.sources == full_record.sources[2:]
    a, b = full.state_dict(), resumed.state_dict()
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=0, rtol=0, msg=name)


@pytest.mark.slow
def test_console_script_fits_the_shipped_config_and_refuses_a_missing_teacher(repo, teacher_dir, tmp_path):
    base = ["fit", "--config", "configs/distill_quickstart.yaml", "--trainer.max_steps", "2",
            "--trainer.limit_val_batches", "1", "--plot.enabled", "false",
            "--trainer.logger.init_args.save_dir", str(tmp_path)]
    out = console_script.run(repo, *base, "--model.teacher_model_name_or_path", str(teacher_dir), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    # the run summary has the method's own line (summary_stats), lower is better (mutations: divergence not declared
    # -> no line; declared "max" -> best above final)
    summary = out.stdout[out.stdout.index("lightalign run summary"):]
    final, best = re.search(r"^  train/divergence +final ([\d.e-]+) +best ([\d.e-]+) \(step \d\)$", summary,
                            re.M).groups()
    assert float(best) <= float(final), summary
    export = next(tmp_path.rglob("hf_model"))
    assert (export / "model.safetensors").is_file() and (export / "config.json").is_file()
    # a relative path of another run's export that is not there yet (the shipped config before `make quickstart`):
    # a path, not a hub name (mutation: only names starting with . / ~ taken as paths -> the hub's validation
    # traceback)
    missing = "runs/no-such-run/version_0/hf_model"
    out = console_script.run(repo, *base, "--model.teacher_model_name_or_path", missing)
    text = out.stdout + out.stderr
    errors = [line for line in text.splitlines() if line.startswith("lightalign: error:")]
    assert out.returncode != 0 and len(errors) == 1, text[-3000:]
    assert errors[0].startswith(f"lightalign: error: teacher_model_name_or_path: Teacher folder '{missing}' does not "
                                "exist"), errors[0]
    assert errors[0].endswith("If it is another run's export (runs/<name>/version_N/hf_model), run that config first.")
    assert "Traceback" not in text
