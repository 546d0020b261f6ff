"""Distillation with images (``DistillModule`` on a vision-language student and teacher of one processor): both
forwards read each prompt's images (the loss of a left-padded image batch equals the loss on each row processed alone,
the model computing its own mRoPE positions), the rows stay padded, and the shipped config samples with the images
on ``generate`` (student and teacher) through the console script."""

from __future__ import annotations

import csv
import json
import shutil

import lightning as L
import pytest
import torch

pytest.importorskip("PIL")

from helpers import console_script  # noqa: E402

VLM = "assets/models/tiny-qwen2-vl"


def _rows(repo):
    """Prompt-completion rows with images: string contents (placeholders inserted), two images in one row, none."""
    images = repo / "examples/data/vlm_images"
    return [
        {"prompt": [{"role": "user", "content": "What color are most of the shapes?"}],
         "completion": [{"role": "assistant", "content": "green"}], "images": [str(images / "prompts_0001.png")]},
        {"prompt": [{"role": "user", "content": "Which one has more circles?"}],
         "completion": [{"role": "assistant", "content": "the second"}],
         "images": [str(images / "prompts_0002.png"), str(images / "prompts_0003.png")]},
        {"prompt": [{"role": "user", "content": "Say yes."}], "completion": [{"role": "assistant", "content": "yes"}],
         "images": []},
    ]


class Record(L.Callback):
    """The training batch's rows (as the loss read them), its loss and the student's weights before the step."""

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.student = {k: v.detach().clone() for k, v in module.model.state_dict().items()}
        real = module.completions

        def recording(b, source):
            self.rows = real(b, source)
            return self.rows

        module.completions = recording

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        del module.completions
        self.loss = outputs["loss"].detach().clone()


def _alone_logits(model, processor, row, completion):
    """The logits predicting ``completion`` with the prompt row processed alone by the processor (no padding, the
    model's own positions): what each row of the padded batch must give."""
    from lightalign.vision.images import load_image

    images = [load_image(ref, where="test") for ref in row["image_refs"]]
    if images:
        out = dict(processor(text=[row["prompt_text"]], images=[images], return_tensors="pt",
                             add_special_tokens=False))
    else:
        ids = torch.tensor([row["prompt_input_ids"]])
        out = {"input_ids": ids, "mm_token_type_ids": torch.zeros_like(ids)}
    out.pop("attention_mask", None)
    n = out["input_ids"].shape[1]
    out["input_ids"] = torch.cat([out["input_ids"], completion[None]], 1)
    out["mm_token_type_ids"] = torch.cat([out["mm_token_type_ids"], torch.zeros_like(completion)[None]], 1)
    with torch.no_grad():
        return model(**out).logits[0, n - 1:-1]


def test_distill_loss_with_images_equals_each_row_alone(repo, tmp_path):
    """One GKD step on the data's completions (lmbda 0): the training loss equals the generalised JSD computed from
    the student's and the teacher's logits of each row processed alone with its images. The rows stay padded (the
    CPU default would pack them; not measured exact with images). Mutations: the teacher's forward without the
    images (``distill_loss`` passing the rows without ``prompt_image_entries``) -> the forward refuses placeholders
    without images; the student's forward without them -> refused; the data's completions without the prompts'
    images (``data_completions``) -> refused; the CPU default layout kept for image rows (``resolve_padding_free``
    ignoring the images) -> the note differs. (1-D positions for the mRoPE model move this tiny model's loss by less
    than the tolerance: test_vlm_online measures them on log-probs.)"""
    from lightalign import DistillModule, PromptDataModule
    from lightalign.hub import load_causal_lm
    from lightalign.modules.losses.distill import generalized_jsd_loss

    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _rows(repo)))
    data = PromptDataModule(str(path), tokenizer=str(repo / VLM), batch_size=3, max_prompt_length=512)
    torch.manual_seed(1)
    teacher = load_causal_lm(str(repo / VLM), from_config=True)
    torch.manual_seed(0)
    module = DistillModule(str(repo / VLM), from_config=True, teacher_model=teacher, lmbda=0.0, beta=0.5,
                           temperature=0.9, max_completion_length=5, learning_rate=1e-3)
    record = Record()
    L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[record],
              ).fit(module, data)
    assert module.padding_free_note == "padded rows: the prompts have images (padding_free is not measured exact with them)"
    rows = record.rows
    assert sorted(rows["prompt_image_inputs"].images_per_row) == [0, 1, 2] and not rows["prompt_mask"].all()
    student = load_causal_lm(str(repo / VLM), from_config=True)
    student.load_state_dict(record.student)
    student.eval()
    prepared = [data.train_dataset[i] for i in range(3)]
    s_logits, t_logits = [], []
    for i in range(3):  # the batch's rows (shuffled), each found by its prompt ids
        ids = rows["prompt_ids"][i][rows["prompt_mask"][i].bool()].tolist()
        row = next(r for r in prepared if r["prompt_input_ids"] == ids)
        completion = rows["completion_ids"][i][rows["completion_mask"][i].bool()]
        s_logits.append(_alone_logits(student, data.processor, row, completion))
        t_logits.append(_alone_logits(teacher.eval(), data.processor, row, completion))
    s, t = torch.cat(s_logits)[None], torch.cat(t_logits)[None]
    expected = generalized_jsd_loss(s, t, torch.ones(s.shape[:2], dtype=torch.bool), beta=0.5, temperature=0.9)
    torch.testing.assert_close(record.loss, expected, atol=2e-5, rtol=1e-5)


def test_padding_free_is_refused_with_image_prompts(repo, tmp_path):
    """``padding_free: true`` with image prompts is refused at setup naming the knob and what the probe measured on
    the model (``refuse_image_layout``: Qwen's 1-D positions)."""
    from lightalign import DistillModule, PromptDataModule

    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _rows(repo)[:1]))
    data = PromptDataModule(str(path), tokenizer=str(repo / VLM), batch_size=1, max_prompt_length=512)
    module = DistillModule(str(repo / VLM), from_config=True, teacher_model_name_or_path=str(repo / VLM),
                           lmbda=0.0, padding_free=True)
    trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match=r"model.padding_free .*cannot run exactly with images on "
                                         r"Qwen2VLForConditionalGeneration.*nats.*Set model.padding_free: false"):
        trainer.fit(module, data)


def test_shipped_vlm_distill_config_samples_with_images_through_the_console_script(repo, tmp_path):
    """``configs/vlm_distill_tiny.yaml`` (teacher: a tiny Qwen2-VL with its own weights) trains two steps: the
    student and the teacher (``seq_kd``) sample on ``generate`` with the images, both forwards read them.
    Mutations: ``DistillModule.sample`` without ``prompt_image_entries`` -> the forwards refuse the image
    placeholders without images and the run fails."""
    teacher = tmp_path / "teacher"
    teacher.mkdir()
    for f in (repo / VLM).iterdir():
        shutil.copy(f, teacher / f.name)
    from lightalign.hub import load_causal_lm

    torch.manual_seed(1)
    load_causal_lm(str(teacher), from_config=True).save_pretrained(teacher)
    out = console_script.run(repo, "fit", "--config", str(repo / "configs/vlm_distill_tiny.yaml"),
                             "--trainer.logger.init_args.save_dir", str(tmp_path), "--trainer.max_steps", "2",
                             "--trainer.limit_val_batches", "0", "--model.teacher_model_name_or_path", str(teacher),
                             "--export.enabled", "false", env=console_script.standard_env(), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = list(csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))))
    keys = {k for row in rows for k, v in row.items() if v}
    assert {"train/loss", "train/divergence", "train/student_sampled", "train/teacher_sampled"} <= keys
    text = out.stdout + out.stderr
    assert "student generation generate (the prompts have images" in text, text[-3000:]
    assert "teacher generation generate (the prompts have images" in text
    assert "padded rows: the prompts have images" in text
