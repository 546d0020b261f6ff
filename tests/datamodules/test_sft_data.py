"""SFT data: formats, masks, truncation, packing (packed log-probs == unpacked), collators."""

from __future__ import annotations

import pytest
import torch

from lightalign import SFTDataModule
from lightalign.datamodules.collators import PaddingCollator, PaddingFreeCollator, pack_best_fit
from lightalign.datamodules.sft import tokenize_sft_row, truncate


def _setup(path, tiny_dir, **kw):
    dm = SFTDataModule(path, tokenizer=str(tiny_dir), **kw)
    dm.setup("fit")
    return dm


def test_prompt_completion_mask_covers_completion_and_eos(tokenizer):
    ids, mask = tokenize_sft_row({"prompt": "12+7=", "completion": "19"}, tokenizer, "prompt_completion")
    prompt_ids = tokenizer("12+7=")["input_ids"]
    completion_ids = tokenizer("19", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert ids == prompt_ids + completion_ids
    assert mask == [0] * len(prompt_ids) + [1] * len(completion_ids)
    # completion_only_loss=False trains on every token
    _, full = tokenize_sft_row({"prompt": "12+7=", "completion": "19"}, tokenizer, "prompt_completion",
                               completion_only_loss=False)
    assert full == [1] * len(ids)


def test_assistant_only_mask_covers_exactly_assistant_turns(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 plus 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3 plus 3?"},
        {"role": "assistant", "content": "6"},
    ]
    ids, mask = tokenize_sft_row({"messages": messages}, tokenizer, "conversational", assistant_only_loss=True)
    targets = tokenizer.decode([t for t, m in zip(ids, mask) if m])
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    # the masked-in text is each assistant content followed by its end-of-turn token, nothing else
    assert targets == "4<|im_end|>6<|im_end|>"
    assert sum(1 for t, m in zip(ids, mask) if m and t == im_end) == 2
    # without assistant_only_loss every token is a target
    _, all_mask = tokenize_sft_row({"messages": messages}, tokenizer, "conversational")
    assert all(all_mask)


def test_conversational_prompt_completion_masks_prompt(tokenizer):
    row = {"prompt": [{"role": "user", "content": "Uppercase: dog"}], "completion": [{"role": "assistant", "content": "DOG"}]}
    ids, mask = tokenize_sft_row(row, tokenizer, "prompt_completion")
    prompt_text = tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
    n_prompt = len(tokenizer(prompt_text, add_special_tokens=False)["input_ids"])
    assert mask[:n_prompt] == [0] * n_prompt and all(mask[n_prompt:])
    assert tokenizer.decode(ids[n_prompt:]).startswith("DOG<|im_end|>")


def test_language_modeling_appends_eos(tokenizer):
    ids, mask = tokenize_sft_row({"text": "The cat sat."}, tokenizer, "language_modeling")
    assert ids[-1] == tokenizer.eos_token_id and all(mask)


def test_truncation_modes():
    ids = list(range(10))
    assert truncate(ids, 4, "keep_start") == [0, 1, 2, 3]
    assert truncate(ids, 4, "keep_end") == [6, 7, 8, 9]
    assert truncate(ids, None, "keep_end") == ids


def test_truncation_in_datamodule(tiny_dir, write_jsonl, tokenizer):
    path = write_jsonl([{"text": "one two three four five six seven eight nine ten " * 3}] * 2)
    full = tokenize_sft_row({"text": "one two three four five six seven eight nine ten " * 3}, tokenizer, "language_modeling")[0]
    start = _setup(path, tiny_dir, max_length=8, truncation_mode="keep_start")
    end = _setup(path, tiny_dir, max_length=8, truncation_mode="keep_end")
    assert start.train_dataset[0]["input_ids"] == full[:8]
    assert end.train_dataset[0]["input_ids"] == full[-8:]


def test_keep_start_drops_rows_whose_completion_was_cut(tiny_dir, write_jsonl):
    import pytest

    rows = [{"prompt": "x" * 40, "completion": "1"}, {"prompt": "1+1=", "completion": "2"}]
    with pytest.warns(UserWarning, match="1 of 2 train rows have no loss token"):
        dm = _setup(write_jsonl(rows), tiny_dir, max_length=6)
    assert len(dm.train_dataset) == 1


def test_padding_collator_masks():
    batch = PaddingCollator(pad_token_id=0)(
        [{"input_ids": [5, 6, 7], "completion_mask": [0, 1, 1]}, {"input_ids": [8, 9], "completion_mask": [0, 1]}]
    )
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 9, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [-100, 9, -100]]


def test_padding_free_collator_positions_and_boundaries():
    batch = PaddingFreeCollator()(
        [{"input_ids": [5, 6, 7, 8, 9], "completion_mask": [1, 1, 0, 1, 1], "seq_lengths": [2, 3]},
         {"input_ids": [1, 2], "completion_mask": [1, 1]}]
    )
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 1, 2]]
    assert batch["position_ids"].tolist() == [[0, 1, 0, 1, 2, 0, 1]]
    # first token of every sequence is never a target (it would be predicted across the boundary)
    assert batch["labels"].tolist() == [[-100, 6, -100, 8, 9, -100, 2]]
    assert "attention_mask" not in batch


def test_best_fit_packing_fills_bins_without_splitting():
    lengths = [7, 5, 4, 3, 3, 2, 1]
    bins = pack_best_fit(lengths, capacity=8)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 8 for b in bins)
    assert len(bins) == 4  # 25 tokens need at least 4 bins of 8


def _per_sequence_logprobs(model, input_ids, labels, **extra):
    logits = model(input_ids=input_ids, use_cache=False, **extra).logits.float()
    logp = torch.log_softmax(logits[:, :-1], -1)
    tgt = labels[:, 1:]
    mask = tgt != -100
    return torch.where(mask, logp.gather(-1, tgt.clamp(min=0).unsqueeze(-1)).squeeze(-1), 0.0), mask


def test_packed_logprobs_equal_unpacked(tiny_model, tokenizer, data_dir):
    rows = [
        {"input_ids": tokenize_sft_row(r, tokenizer, "prompt_completion")[0], "completion_mask": None}
        for r in [{"prompt": "12+7=", "completion": "19"}, {"prompt": "3-1=", "completion": "2"},
                  {"prompt": "45+45=", "completion": "90"}]
    ]
    for attn in ("sdpa", "eager"):
        tiny_model.config._attn_implementation = attn
        packed = PaddingFreeCollator()(rows)
        packed_lp, packed_mask = _per_sequence_logprobs(tiny_model, packed["input_ids"], packed["labels"],
                                                        position_ids=packed["position_ids"])
        padded = PaddingCollator(tokenizer.pad_token_id)(rows)
        pad_lp, pad_mask = _per_sequence_logprobs(tiny_model, padded["input_ids"], padded["labels"],
                                                  attention_mask=padded["attention_mask"])
        flat_packed = packed_lp[packed_mask]
        flat_padded = pad_lp[pad_mask]
        assert flat_packed.shape == flat_padded.shape
        torch.testing.assert_close(flat_packed, flat_padded, atol=1e-5, rtol=0)
        # control: without position ids the packed row attends across boundaries and differs
        cross_lp, _ = _per_sequence_logprobs(tiny_model, packed["input_ids"], packed["labels"])
        assert (cross_lp[packed_mask] - flat_padded).abs().max() > 1e-3


def test_packing_datamodule_batches(tiny_dir, data_dir):
    dm = _setup(str(data_dir / "arithmetic_sft.jsonl"), tiny_dir, max_length=32, packing=True, batch_size=2)
    assert all(sum(r["seq_lengths"]) <= 32 for r in dm.train_dataset.select(range(20)))
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape[0] == 1 and "position_ids" in batch and "attention_mask" not in batch
    n_seqs = int((batch["position_ids"] == 0).sum())
    assert n_seqs > 2  # more than one sequence per bin
    assert batch["num_items_in_batch"].item() == int((batch["labels"][:, 1:] != -100).sum())


def test_formats_and_val_split(tiny_dir, data_dir):
    for name in ("arithmetic_sft.jsonl", "chat_sft.jsonl", "text_lm.jsonl"):
        dm = _setup(str(data_dir / name), tiny_dir, val_split_size=0.1, max_length=128)
        assert len(dm.train_dataset) > 0 and len(dm.val_dataset) > 0
        batch = next(iter(dm.train_dataloader()))
        assert set(batch) >= {"input_ids", "attention_mask", "labels", "num_items_in_batch"}


def test_parquet_and_csv_and_dataset_object(tiny_dir, tmp_path):
    import pandas as pd
    from datasets import Dataset

    rows = [{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(10)]
    pd.DataFrame(rows).to_parquet(tmp_path / "d.parquet")
    pd.DataFrame(rows).to_csv(tmp_path / "d.csv", index=False)
    for source in (str(tmp_path / "d.parquet"), str(tmp_path / "d.csv"), Dataset.from_list(rows)):
        dm = _setup(source, tiny_dir)
        assert len(dm.train_dataset) == 10


def test_user_collator_is_used(tiny_dir, data_dir):
    seen = []

    def collator(rows):
        seen.append(len(rows))
        return PaddingCollator(0)(rows)

    dm = _setup(str(data_dir / "arithmetic_sft.jsonl"), tiny_dir, collator=collator, batch_size=3)
    next(iter(dm.train_dataloader()))
    assert seen == [3]


# ------------------------------------------------------------------------------------------ group_by_length
def test_length_grouped_sampler_sorts_mega_batches_and_covers_every_row():
    from lightalign.datamodules.index_samplers import EpochSampler, LengthGroupedSampler

    lengths = [(i * 37) % 101 + 1 for i in range(64)]
    sampler = LengthGroupedSampler(lengths, batch_size=4, mega_batch_mult=4, seed=1)  # mega-batch: 16 rows
    order = sampler.order()
    assert sorted(order) == list(range(64))
    for start in range(0, 64, 16):
        chunk = [lengths[i] for i in order[start:start + 16]]
        assert chunk == sorted(chunk, reverse=True)
    sampler.set_epoch(1)
    assert sampler.order() != order  # reshuffled each epoch, deterministically
    assert LengthGroupedSampler(lengths, 4, 4, seed=1).order() == order

    def padding(idx):  # padded tokens of batches of 4 in this order
        return sum(4 * max(lengths[i] for i in idx[s:s + 4]) - sum(lengths[i] for i in idx[s:s + 4])
                   for s in range(0, 64, 4))

    assert padding(order) < 0.5 * padding(EpochSampler(64, seed=1).order())
    # 2 ranks: mega-batches of 32 rows, dealt alternately; each rank's 16 of a mega-batch are still sorted
    ranks = [LengthGroupedSampler(lengths, 4, 4, seed=1, num_replicas=2, rank=r).order() for r in (0, 1)]
    assert sorted(ranks[0] + ranks[1]) == list(range(64))
    for share in (ranks[0][:16], ranks[1][16:]):
        assert [lengths[i] for i in share] == sorted((lengths[i] for i in share), reverse=True)


def test_group_by_length_datamodule_resumes_mid_epoch(tiny_dir, data_dir):
    from lightalign import SFTDataModule

    dm = SFTDataModule(str(data_dir / "arithmetic_sft.jsonl"), tokenizer=str(tiny_dir), batch_size=4,
                       group_by_length=True)
    dm.setup("fit")
    full = [b["input_ids"].tolist() for b in dm.train_dataloader()]
    loader = dm.train_dataloader()
    dm._train_sampler.resume(0, 3 * 4)  # as after a checkpoint taken at batch 3
    assert [b["input_ids"].tolist() for b in loader] == full[3:]
    with pytest.raises(ValueError, match="group_by_length"):
        SFTDataModule(str(data_dir / "arithmetic_sft.jsonl"), tokenizer=str(tiny_dir), packing=True,
                      group_by_length=True)


def test_resume_point_reaches_a_loader_built_after_the_restore(tiny_dir, data_dir):
    """DeepSpeed builds a training loader before the checkpoint is restored (to read its batch size) and the fit
    loop builds another after it: the second must still start after the batches already trained on."""
    from lightalign import SFTDataModule

    dm = SFTDataModule(str(data_dir / "arithmetic_sft.jsonl"), tokenizer=str(tiny_dir), batch_size=4)
    dm.setup("fit")
    full = [b["input_ids"].tolist() for b in dm.train_dataloader()]
    dm.train_dataloader()  # built before the restore, never iterated
    dm.load_state_dict({"epoch": 0, "batches_done": 3})
    assert [b["input_ids"].tolist() for b in dm.train_dataloader()] == full[3:]
    # consumed: the next loader of the epoch starts from its first batch
    assert [b["input_ids"].tolist() for b in dm.train_dataloader()] == full


def test_loaders_draw_nothing_from_the_global_rng_and_seed_workers_by_epoch_and_rank(tiny_dir, data_dir, monkeypatch):
    """The training RNG is restored from a checkpoint on resume, so iterating a loader must not draw from it (a
    plain DataLoader draws its workers' base seed there: a resumed run was one draw off). The base seed is a pure
    function of (seed, epoch, rank): a loader built fresh on resume draws what the uninterrupted one drew."""
    from torch.utils.data import dataloader as torch_dataloader

    dm = SFTDataModule(str(data_dir / "arithmetic_sft.jsonl"), tokenizer=str(tiny_dir), batch_size=4)
    dm.setup("fit")
    seeds = []
    original = torch_dataloader._BaseDataLoaderIter.__init__

    def record(self, loader):
        original(self, loader)
        seeds.append(self._base_seed)

    monkeypatch.setattr(torch_dataloader._BaseDataLoaderIter, "__init__", record)
    torch.manual_seed(0)
    state = torch.get_rng_state()
    uninterrupted = dm.train_dataloader()
    for epoch in range(3):
        uninterrupted.sampler.set_epoch(epoch)
        next(iter(uninterrupted))
    next(iter(dm.eval_dataloader(dm.train_dataset)))
    assert torch.equal(torch.get_rng_state(), state)  # not one draw from the training RNG
    resumed = dm.train_dataloader()  # a fresh loader, as after a restore, at epoch 2
    resumed.sampler.set_epoch(2)
    next(iter(resumed))
    assert seeds[3] != seeds[2] != seeds[1] != seeds[0] and seeds[4] == seeds[2]
    from lightalign.datamodules.index_samplers import EpochSampler
    from lightalign.datamodules.step_loader import SeededLoader

    for rank in (0, 1):
        loader = SeededLoader(dm.train_dataset, sampler=EpochSampler(len(dm.train_dataset), num_replicas=2, rank=rank),
                              batch_size=4, collate_fn=dm.collate_fn(), seed=dm.seed)
        loader.sampler.set_epoch(2)
        next(iter(loader))
    assert seeds[5] == seeds[2] and seeds[6] != seeds[2]  # workers of different ranks get different seeds
