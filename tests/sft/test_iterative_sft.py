"""IterativeSFT: one optimisation step per call, from token ids or texts, outside any Lightning loop."""

from __future__ import annotations

import pytest
import torch

from lightalign import IterativeSFT, SFTModule


@pytest.fixture
def driver(tiny_dir):
    def make(**kw):
        torch.manual_seed(0)
        kw.setdefault("learning_rate", 3e-3)
        return IterativeSFT(str(tiny_dir), from_config=True, device="cpu", **kw)

    return make


def test_step_lowers_the_loss_on_repeated_text(driver):
    trainer = driver(optimize_device_cache=True)
    text = ["The cat sat on the mat and 12+7=19."] * 2
    stats = [trainer.step(texts=text) for _ in range(6)]
    losses = [s["loss"] for s in stats]
    assert losses[-1] < losses[0] - 1.0, losses
    assert [s["step"] for s in stats] == list(range(1, 7)) and trainer.global_step == 6
    assert stats[0]["lr"] == pytest.approx(3e-3) and stats[0]["num_tokens"] > 0
    assert trainer.cache_cleanups == 6  # optimize_device_cache ran after every step (a no-op on CPU)


def test_truncation_modes_keep_the_right_end(driver):
    ids = [list(range(10, 20))]
    start = driver(max_length=4, truncation_mode="keep_start").build_batch(input_ids=ids)
    end = driver(max_length=4, truncation_mode="keep_end").build_batch(input_ids=ids)
    assert start["input_ids"].tolist() == [[10, 11, 12, 13]]
    assert end["input_ids"].tolist() == [[16, 17, 18, 19]]
    assert torch.equal(end["labels"], end["input_ids"])  # labels default to the inputs for a causal LM
    with pytest.raises(ValueError, match="truncation_mode"):
        driver(truncation_mode="middle")


def test_ids_masks_labels_and_texts_labels(driver, tokenizer):
    trainer = driver()
    # left-padded tensors: padding dropped, labels with -100 kept as non-targets
    ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    labels = torch.tensor([[-100, -100, -100, 6, 7], [8, 9, 10, 11, 12]])
    batch = trainer.build_batch(input_ids=ids, attention_mask=mask, labels=labels)
    assert batch["input_ids"][0, :3].tolist() == [5, 6, 7] and batch["attention_mask"][0].tolist() == [1, 1, 1, 0, 0]
    assert batch["labels"][0].tolist() == [-100, 6, 7, -100, -100]
    with pytest.raises(ValueError, match="differ from its input_ids"):
        trainer.build_batch(input_ids=[[1, 2, 3]], labels=[[1, 9, 3]])
    # texts + texts_labels: the prompt is context, the label (plus EOS) the only target
    batch = trainer.build_batch(texts=["12+7="], texts_labels=["19"])
    prompt = tokenizer("12+7=")["input_ids"]
    target = tokenizer("19", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert batch["input_ids"][0].tolist() == prompt + target
    assert batch["labels"][0].tolist() == [-100] * len(prompt) + target
    with pytest.raises(ValueError, match="either input_ids"):
        trainer.step(input_ids=[[1, 2]], texts=["a"])
    with pytest.raises(ValueError, match="texts_labels"):
        trainer.step(texts=["a", "b"], texts_labels=["c"])


def test_model_instance_module_kwargs_and_schedule(tiny_model, tokenizer):
    frozen = tiny_model.model.embed_tokens.weight.detach().clone()
    tiny_model.model.embed_tokens.requires_grad_(False)
    trainer = IterativeSFT(tiny_model, tokenizer, optim="lion", learning_rate=1e-3, lr_scheduler_type="linear",
                           total_steps=2, device="cpu")
    assert isinstance(trainer.module, SFTModule) and type(trainer.optimizer).__name__ == "Lion"
    lrs = [trainer.step(texts=["1+1=2"])["lr"] for _ in range(2)]
    assert lrs == pytest.approx([1e-3, 5e-4])
    assert torch.equal(frozen, tiny_model.model.embed_tokens.weight)  # frozen stays out of the optimizer
    assert trainer.generate(["1+1="], max_new_tokens=3, do_sample=False)[0] is not None
    with pytest.raises(ValueError, match="needs total_steps"):
        IterativeSFT(tiny_model, tokenizer, lr_scheduler_type="cosine")
