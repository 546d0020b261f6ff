"""use_vllm for distillation and online DPO, up to the GPU boundary (the engines are stand-ins at their ``generate`` /
``load_weights`` boundary, tests/helpers/fake_vllm.py; the real engines run only in tests/sampling/test_vllm.py's
``gpu`` test): each model that samples gets an engine, the trained one's weights pushed at fit start and after every
optimizer step, a seq_kd teacher's once; the completions trained on are the engines'; on-policy distillation takes
the engine's log-probs as the sampler's (as TRL's IW-OPD), with ``iw_opd_gamma``'s weights; the refusals (no CUDA
below, and through the console script in tests/bad_inputs/test_console_refusals.py)."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from helpers.fake_vllm import offset, vllm_module
from lightalign.hub import load_causal_lm


@pytest.fixture(scope="module")
def teacher_dir(tiny_dir, tmp_path_factory):
    """A teacher with weights of its own, in a folder (an engine loads a teacher from its folder)."""
    import shutil

    folder = tmp_path_factory.mktemp("teacher")
    for f in tiny_dir.iterdir():
        shutil.copy(f, folder / f.name)
    torch.manual_seed(1)
    load_causal_lm(str(folder), from_config=True).save_pretrained(folder)
    return folder


def _data(tiny_dir, data_dir, name="arithmetic_sft.jsonl"):
    from lightalign import PromptDataModule

    return PromptDataModule(str(data_dir / name), tokenizer=str(tiny_dir), max_prompt_length=16, batch_size=4)


def _fit(module, data, steps, callbacks=()):
    trainer = L.Trainer(accelerator="cpu", logger=False, log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, max_steps=steps,
                        callbacks=list(callbacks))
    trainer.fit(module, data)
    return trainer


class Record(L.Callback):
    """Per training batch: the rows ``method`` returned (who wrote them: ``module.last_source``), the loss, and the
    trained model's weights before the step."""

    def __init__(self, method: str):
        self.method = method
        self.rows, self.sources, self.losses, self.states = [], [], [], []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.states.append({k: v.detach().clone() for k, v in module.model.state_dict().items()})
        real = getattr(module, self.method)

        def recording(*args):
            rows = real(*args)
            self.rows.append({k: v.detach().clone() if torch.is_tensor(v) else v for k, v in rows.items()})
            return rows

        setattr(module, self.method, recording)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        delattr(module, self.method)
        self.sources.append(getattr(module, "last_source", None))
        self.losses.append(outputs["loss"].detach().clone())


def _kept(rows, i):
    return rows["completion_ids"][i][rows["completion_mask"][i].bool()].tolist()


def _same_weights(pushed, model):
    params = dict(model.named_parameters())
    assert set(pushed) == set(params)
    return all(torch.equal(pushed[name], params[name].detach()) for name in pushed)


def test_distill_samples_the_student_and_a_seq_kd_teacher_on_their_engines(tiny_dir, data_dir, teacher_dir,
                                                                         monkeypatch):
    from lightalign import DistillModule

    engines: list = []
    torch.manual_seed(0)
    module = vllm_module(DistillModule, monkeypatch, engines, str(tiny_dir), from_config=True,
                         teacher_model_name_or_path=str(teacher_dir), lmbda=0.5, seq_kd=True,
                         max_completion_length=5, learning_rate=1e-2)
    record = Record("completions")
    _fit(module, _data(tiny_dir, data_dir), steps=4, callbacks=[record])
    student, teacher = engines
    assert (student.who, teacher.who) == ("student", "teacher")
    # the student's weights at fit start and after each of the 4 optimizer steps; the frozen teacher's once
    assert [step for step, _ in student.loads] == [0, 1, 2, 3, 4]
    assert _same_weights(student.loads[-1][1], module.model)
    assert not _same_weights(student.loads[0][1], module.model)  # it trained
    assert [step for step, _ in teacher.loads] == [0] and _same_weights(teacher.loads[0][1], module.teacher)
    # every batch's completions are those its writer's engine sampled (seed 0 draws both writers)
    assert set(record.sources) == {"student", "teacher"}
    answers = {"student": iter(student.completions), "teacher": iter(teacher.completions)}
    for source, rows in zip(record.sources, record.rows):
        sampled = next(answers[source])
        assert [_kept(rows, i) for i in range(len(sampled))] == sampled, source
    assert next(answers["student"], None) is None and next(answers["teacher"], None) is None
    assert module.sampling.engines == {}  # released at fit end


def _on_policy_loss(module, rows, state, gamma):
    """The on-policy loss by hand on independent forwards: advantages are the teacher's minus the ENGINE's log-probs
    of the sampled tokens, weighted by IW-OPD's ``1 + gamma (1 - |A| accumulated before the token / |A| of the
    sequence)``, times the student's log-probs, averaged over the completion tokens."""
    hp = module.hparams
    student = load_causal_lm(module.model_name_or_path, from_config=True)
    student.load_state_dict(state)
    student.eval()
    ids = torch.cat([rows["prompt_ids"], rows["completion_ids"]], 1)
    attention = torch.cat([rows["prompt_mask"], rows["completion_mask"]], 1)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    p, t = rows["prompt_ids"].shape[1], rows["completion_ids"].shape[1]
    mask = rows["completion_mask"].float()
    logps = []
    with torch.no_grad():
        for model in (student, module.teacher.eval()):
            logits = model(input_ids=ids, attention_mask=attention, position_ids=positions).logits[:, p - 1:p + t - 1]
            logps.append(torch.log_softmax(logits / hp.temperature, -1).gather(-1, rows["completion_ids"][..., None])[
                ..., 0])
    own, teacher = logps
    advantage = (teacher - rows["sampling_logps"]) * mask
    size = advantage.abs()
    before = size.cumsum(1) - size
    weight = 1 + gamma * (1 - before / size.sum(1, keepdim=True).clamp(min=1e-8))
    return -(own * advantage * weight * mask).sum() / mask.sum(), own


def test_on_policy_distillation_takes_the_engines_log_probs_as_the_samplers(tiny_dir, data_dir, teacher_dir,
                                                                           monkeypatch):
    from lightalign import DistillModule

    engines: list = []
    torch.manual_seed(0)
    module = vllm_module(DistillModule, monkeypatch, engines, str(tiny_dir), from_config=True,
                         teacher_model_name_or_path=str(teacher_dir), loss_type="on_policy", iw_opd_gamma=0.5,
                         max_completion_length=5, learning_rate=1e-2)
    record = Record("completions")
    trainer = _fit(module, _data(tiny_dir, data_dir), steps=2, callbacks=[record])
    (engine,) = engines
    assert [step for step, _ in engine.loads] == [0, 1, 2]
    for k, (rows, loss, state) in enumerate(zip(record.rows, record.losses, record.states)):
        mask = rows["completion_mask"].bool()
        answer = engine.answers[k]
        for i in range(len(answer)):  # the engine's log-probs, row by row, under the completion mask
            torch.testing.assert_close(rows["sampling_logps"][i][mask[i]], torch.tensor(answer[i]))
        expected, own = _on_policy_loss(module, rows, state, gamma=0.5)
        torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
        # the engine is not the student: its log-probs are the student's shifted by offset(position)
        shift = torch.tensor([offset(t) for t in range(mask.shape[1])]).expand_as(own)
        torch.testing.assert_close((rows["sampling_logps"] - own)[mask], shift[mask], atol=1e-4, rtol=0)
    logged = trainer.callback_metrics
    assert 0.05 < float(logged["train/sampling/sampling_logp_difference/mean"]) < 0.25
    assert float(logged["train/sampling/sampling_logp_difference/max"]) == pytest.approx(0.25, abs=1e-4)


def length_reward(prompts, completions, **columns):
    return [float(len(c)) for c in completions]


def test_online_dpo_samples_the_pair_on_the_policys_engine(tiny_dir, data_dir, monkeypatch):
    from lightalign import OnlineDPOModule
    from lightalign.modules.sampling.vllm import VLLMConfig

    engines: list = []
    torch.manual_seed(0)
    module = vllm_module(OnlineDPOModule, monkeypatch, engines, str(tiny_dir), from_config=True,
                         reward_funcs=[length_reward], max_completion_length=6, learning_rate=1e-2)
    assert VLLMConfig.of(module).vllm_gpu_memory_utilization == 0.55  # TRL OnlineDPOConfig's default
    record = Record("sample_pairs")
    _fit(module, _data(tiny_dir, data_dir, "arithmetic_prompts.jsonl"), steps=2, callbacks=[record])
    (engine,) = engines
    assert [step for step, _ in engine.loads] == [0, 1, 2] and _same_weights(engine.loads[-1][1], module.model)
    assert len(engine.completions) == 2
    for rows, sampled in zip(record.rows, engine.completions):  # two per prompt, rows grouped by prompt
        assert len(sampled) == 2 * len(rows["prompts"][::2]) == rows["completion_ids"].shape[0]
        assert [_kept(rows, i) for i in range(len(sampled))] == sampled


# ------------------------------------------------------------------------------------------------ refusals
def _distill(tiny_dir, **kw):
    from lightalign import DistillModule

    return DistillModule(str(tiny_dir), from_config=True, **{"teacher_model_name_or_path": str(tiny_dir), **kw})


def _online_dpo(tiny_dir, **kw):
    from lightalign import OnlineDPOModule

    return OnlineDPOModule(str(tiny_dir), from_config=True, reward_funcs=[length_reward], **kw)


@pytest.mark.parametrize("build, knobs, message", [
    (_distill, dict(use_vllm=True), r"^use_vllm: true needs a CUDA GPU \(vLLM generates on GPUs\) and this machine "
                                    r"has none\. On CPU leave use_vllm: false"),
    (_online_dpo, dict(use_vllm=True), r"^use_vllm: true needs a CUDA GPU \(vLLM generates on GPUs\)"),
    (_distill, dict(use_vllm=True, seq_kd=True, vllm_mode="server"),
     r"^seq_kd with use_vllm samples the teacher's completions on a vLLM engine of its own, which lightalign builds "
     r"colocated only"),
    (_distill, dict(use_vllm=True, seq_kd=True, teacher_model_init_kwargs={"quantization_config": {"load_in_8bit": 1}}),
     r"^seq_kd with use_vllm loads the teacher into a vLLM engine from teacher_model_name_or_path in full precision"),
    (_distill, dict(iw_opd_gamma=0.5), r"^iw_opd_gamma=0\.5 weights the per-token advantages of loss_type 'on_policy'; "
                                       r"loss_type 'gkd' has none"),
    (_distill, dict(loss_type="on_policy", iw_opd_gamma=-1.0), r"^iw_opd_gamma must be a finite number >= 0"),
], ids=["distill-no-cuda", "online-dpo-no-cuda", "seq-kd-server", "seq-kd-quantized", "gamma-gkd", "gamma-negative"])
def test_vllm_and_iw_opd_refusals_before_the_model_loads(tiny_dir, monkeypatch, build, knobs, message):
    if torch.cuda.is_available() and knobs == {"use_vllm": True}:
        pytest.skip("a GPU is visible here")
    from lightalign.modules.training import model_building as policy

    monkeypatch.setattr(policy, "load_causal_lm", lambda *a, **k: pytest.fail("the model loaded before the refusal"))
    with pytest.raises(ValueError, match=message):
        build(tiny_dir, **knobs)


def test_the_engine_memory_share_defaults_to_the_methods_trl_default(tiny_dir):
    from lightalign import GRPOModule
    from lightalign.modules.sampling.vllm import VLLMConfig

    grpo = GRPOModule(str(tiny_dir), from_config=True, reward_funcs=[length_reward])
    assert VLLMConfig.of(grpo).vllm_gpu_memory_utilization == 0.3  # GRPOConfig's, as before the knob moved
    assert VLLMConfig.of(_distill(tiny_dir)).vllm_gpu_memory_utilization == 0.3  # DistillationConfig's
    assert VLLMConfig.of(_online_dpo(tiny_dir)).vllm_gpu_memory_utilization == 0.55  # OnlineDPOConfig's
    assert VLLMConfig.of(_online_dpo(tiny_dir, vllm_gpu_memory_utilization=0.4)).vllm_gpu_memory_utilization == 0.4


def test_a_token_the_engine_gave_no_log_prob_for_takes_the_students(tiny_dir):
    """vLLM can leave a sampled token's log-prob out (NaN, as TRL keeps it); on-policy distillation's advantage then
    takes the student's own log-prob there, so the loss is the one with that value written in (not NaN)."""
    from lightalign import DistillModule
    from lightalign.modules.training.logprobs import completion_logits, selective_log_softmax

    torch.manual_seed(0)
    teacher = load_causal_lm(str(tiny_dir), from_config=True)
    module = DistillModule(str(tiny_dir), from_config=True, teacher_model=teacher, loss_type="on_policy",
                           iw_opd_gamma=0.5)
    module.configure_model()
    rows = {"prompt_ids": torch.tensor([[5, 6], [7, 8]]), "prompt_mask": torch.ones(2, 2, dtype=torch.long),
            "completion_ids": torch.tensor([[9, 10, 11], [12, 13, 14]]), "completion_mask": torch.ones(2, 3).long()}
    with torch.no_grad():
        own = selective_log_softmax(completion_logits(module.model, rows) / module.hparams.temperature,
                                    rows["completion_ids"])
    engine = own + 0.3
    with_gap = engine.clone()
    with_gap[0, 1] = float("nan")
    filled = engine.clone()
    filled[0, 1] = own[0, 1]
    loss, _ = module.distill_loss({**rows, "sampling_logps": with_gap})
    expected, _ = module.distill_loss({**rows, "sampling_logps": filled})
    assert torch.isfinite(loss) and torch.equal(loss, expected)
    assert not torch.equal(module.distill_loss({**rows, "sampling_logps": engine})[0], expected)  # the value matters


@pytest.mark.gpu
def test_distill_on_real_colocated_engines(tiny_dir, data_dir, teacher_dir, tmp_path):
    """Real vLLM on a GPU (never run on this project's CPU machines): the student and a seq_kd teacher each on a
    colocated engine, four optimizer steps, every batch's completions sampled by one of them."""
    pytest.importorskip("vllm")
    from lightalign import DistillModule
    from lightalign.hub import load_tokenizer

    torch.manual_seed(0)
    load_causal_lm(str(tiny_dir), from_config=True).save_pretrained(tmp_path)  # the student, with weights
    load_tokenizer(str(tiny_dir)).save_pretrained(tmp_path)
    module = DistillModule(str(tmp_path), teacher_model_name_or_path=str(teacher_dir), lmbda=0.5, seq_kd=True,
                           max_completion_length=5, use_vllm=True, vllm_gpu_memory_utilization=0.2,
                           vllm_max_model_length=128)
    record = Record("completions")
    trainer = L.Trainer(accelerator="gpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, num_sanity_val_steps=0, limit_val_batches=0, max_steps=4,
                        callbacks=[record])
    trainer.fit(module, _data(tiny_dir, data_dir))
    assert len(record.rows) == 4 and set(record.sources) <= {"student", "teacher"}
    assert all(rows["completion_mask"].sum() > 0 for rows in record.rows)
