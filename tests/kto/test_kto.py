"""KTO on the tiny model: unpaired data (validation, unpairing as TRL, the mismatched KL sequences), ``KTOModule``
(loss from its log-probs, gradients to the policy only, accumulation), precomputed reference log-probs, and the
console script end to end."""

from __future__ import annotations

import csv
from pathlib import Path

import lightning as L
import pytest

from helpers import console_script
import torch
from datasets import Dataset

from lightalign import DataFormatError, KTOModule, UnpairedPreferenceDataModule
from lightalign.datamodules.unpaired import kl_partners, unpair_rows
from lightalign.modules.kto import sequence_logps
from lightalign.modules.losses.kto import kl_estimate, kto_loss

UNPAIRED = [
    {"prompt": "1+1=", "completion": "2", "label": True},
    {"prompt": "2+2=", "completion": "5", "label": False},
    {"prompt": "3+4=", "completion": "7", "label": True},
    {"prompt": "9-3=", "completion": "5", "label": False},
    {"prompt": "10+10=", "completion": "20", "label": True},
]


def make_data(rows, tokenizer, **kwargs) -> UnpairedPreferenceDataModule:
    kwargs.setdefault("batch_size", 2)
    dm = UnpairedPreferenceDataModule(Dataset.from_list(rows), tokenizer=tokenizer, max_length=32, **kwargs)
    dm.setup("fit")
    return dm


# ------------------------------------------------------------------------------------------------ data
def test_kl_partners_rotate_each_block_like_trl():
    # TRL: within each block of batch_size rows, KL completions = [c_last] + c[:-1]
    assert kl_partners(6, 3) == [2, 0, 1, 5, 3, 4]
    assert kl_partners(5, 2) == [1, 0, 3, 2, 3]  # a last block of one row borrows the row before it, never itself
    assert all(p != i for i, p in enumerate(kl_partners(11, 4)))


def test_paired_rows_are_unpaired_in_trls_order():
    raw = Dataset.from_list([{"prompt": "a", "chosen": "b", "rejected": "c"},
                             {"prompt": "d", "chosen": "e", "rejected": "f"}])
    rows = unpair_rows(raw, implicit=False)
    assert rows["prompt"] == ["a", "d", "a", "d"] and rows["completion"] == ["b", "e", "c", "f"]
    assert rows["label"] == [True, True, False, False]
    implicit = unpair_rows(Dataset.from_list([{"chosen": "x=1", "rejected": "x=2"}]), implicit=True)
    assert implicit["prompt"] == ["x=", "x="] and implicit["completion"] == ["1", "2"]


def test_batches_carry_mismatched_sequences(tokenizer):
    dm = make_data(UNPAIRED, tokenizer, shuffle=False)
    ds = dm.train_dataset
    assert ds["label"] == [r["label"] for r in UNPAIRED]
    batch = next(iter(dm.eval_dataloader(ds)))
    assert batch["labels"].tolist() == [True, False]
    eos = tokenizer.eos_token_id
    for i, partner in enumerate([1, 0]):
        prompt, own, other = ds[i]["prompt_input_ids"], ds[i]["completion_input_ids"], ds[partner]["completion_input_ids"]
        assert own[-1] == eos
        n, m = len(prompt) + len(own), len(prompt) + len(other)
        assert batch["input_ids"][i, :n].tolist() == prompt + own
        assert batch["completion_mask"][i, :n].tolist() == [0] * len(prompt) + [1] * len(own)
        assert batch["kl_input_ids"][i, :m].tolist() == prompt + other  # row i's prompt, its partner's completion
        assert batch["kl_completion_mask"][i, :m].tolist() == [0] * len(prompt) + [1] * len(other)
        assert batch["kl_attention_mask"][i].sum() == m


@pytest.mark.parametrize("row, words", [
    ({"prompt": "5+5=", "completion": "10", "label": None}, ["row 2", "'label'", "null"]),
    ({"prompt": "5+5=", "completion": "10"}, ["row 2", "'label'", "null"]),
    ({"prompt": "5+5=", "completion": "", "label": True}, ["row 2", "'completion'", "empty"]),
])
def test_bad_rows_name_row_and_column(tokenizer, row, words):
    rows = UNPAIRED[:2] + [row]
    with pytest.raises(DataFormatError) as err:
        make_data(rows, tokenizer)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_non_boolean_labels_and_one_sided_data_are_refused(tokenizer):
    strings = [dict(r, label="yes" if r["label"] else "no") for r in UNPAIRED]
    with pytest.raises(DataFormatError, match=r"row 0, column 'label': expected a boolean .* got str 'yes'"):
        make_data(strings, tokenizer)
    floats = [dict(r, label=1.0 if r["label"] else 0.0) for r in UNPAIRED]
    with pytest.raises(DataFormatError, match=r"row 0, column 'label'.*got float 1.0"):
        make_data(floats, tokenizer)
    with pytest.raises(DataFormatError, match="train data has 3 desirable .* and 0 undesirable"):
        make_data([r for r in UNPAIRED if r["label"]], tokenizer)
    one_kind = make_data(UNPAIRED, tokenizer, val_path=Dataset.from_list([r for r in UNPAIRED if r["label"]]))
    assert one_kind.label_counts["validation"] == (3, 0)  # a validation split may hold one kind
    mixed = [dict(r, completion=[{"role": "assistant", "content": r["completion"]}]) for r in UNPAIRED]
    with pytest.raises(DataFormatError, match="row 0, column 'completion': mixes conversations with the strings"):
        make_data(mixed, tokenizer)
    with pytest.raises(DataFormatError, match="needs a 'label' column"):
        make_data([{k: v for k, v in r.items() if k != "label"} for r in UNPAIRED], tokenizer)


# ------------------------------------------------------------------------------------------------ module
def kto_module(tiny_dir, **kwargs) -> KTOModule:
    torch.manual_seed(0)
    module = KTOModule(str(tiny_dir), from_config=True, **kwargs)
    module.configure_model()
    # a reference that differs from the policy, so log-ratios (and the KL estimate) are not all zero
    with torch.no_grad():
        for p in module.ref_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return module


def test_step_loss_is_kto_of_its_log_probs_and_only_the_policy_gets_gradients(tiny_dir, tokenizer):
    module = kto_module(tiny_dir, beta=0.5, undesirable_weight=2.0)
    dm = make_data(UNPAIRED, tokenizer, shuffle=False, batch_size=4)
    batch = next(iter(dm.eval_dataloader(dm.train_dataset)))
    loss = module._step(batch, module.train_stats)
    with torch.no_grad():
        policy, ref = sequence_logps(module.model, batch), sequence_logps(module.ref_model, batch)
        kl = kl_estimate(sequence_logps(module.model, batch, "kl_"), sequence_logps(module.ref_model, batch, "kl_"))
    expected, _ = kto_loss(policy, ref, batch["labels"], kl.clamp(min=0), 0.5, 1.0, 2.0)
    assert float(kl) != 0.0
    assert float(loss) == pytest.approx(float(expected), abs=1e-6)
    loss.backward()
    assert all(p.grad is None for p in module.ref_model.parameters())
    assert sum(float(p.grad.abs().sum()) for p in module.model.parameters() if p.grad is not None) > 0
    stats = {k: float(m.compute()) for k, m in module.train_stats.items()}
    assert stats["kl"] == pytest.approx(max(float(kl), 0.0), abs=1e-6)
    desirable = batch["labels"]
    assert stats["rewards_chosen"] == pytest.approx(float(0.5 * (policy - ref)[desirable].mean()), abs=1e-5)
    assert stats["logps_rejected"] == pytest.approx(float(policy[~desirable].mean()), abs=1e-5)


def grads(module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in module.model.parameters() if p.grad is not None])


def test_accumulation_equals_one_batch_without_the_kl_term(tiny_dir, tokenizer):
    """The loss is a mean over rows, so two micro-batches of 2 give the gradient of one batch of 4 exactly when
    no KL term is estimated per micro-batch (apo_zero_unpaired). With ``kto`` each micro-batch estimates its own KL
    (as TRL does), so accumulation is not one big batch; docs/kto.md says so."""
    rows = UNPAIRED[:4]
    small = make_data(rows, tokenizer, shuffle=False, batch_size=2)
    big = make_data(rows, tokenizer, shuffle=False, batch_size=4)
    module = kto_module(tiny_dir, loss_type="apo_zero_unpaired")
    for batch in small.eval_dataloader(small.train_dataset):
        (module._step(batch, module.train_stats) / 2).backward()
    accumulated = grads(module)
    module.model.zero_grad(set_to_none=True)
    module._step(next(iter(big.eval_dataloader(big.train_dataset))), module.train_stats).backward()
    torch.testing.assert_close(accumulated, grads(module), atol=1e-6, rtol=1e-5)


def test_knobs_refused_at_construction_and_batch_size_one_before_model_load(tiny_dir, tokenizer):
    with pytest.raises(ValueError, match="desirable_weight must be > 0"):
        KTOModule(str(tiny_dir), from_config=True, desirable_weight=0)
    with pytest.raises(ValueError, match="undesirable_weight must be > 0"):
        KTOModule(str(tiny_dir), from_config=True, undesirable_weight=-0.5)
    module = KTOModule(str(tiny_dir), from_config=True)
    trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    with pytest.raises(ValueError, match="data.batch_size=1"):
        trainer.fit(module, make_data(UNPAIRED, tokenizer, batch_size=1))
    assert module.model is None  # refused before the policy was built


def test_precomputed_reference_equals_the_live_reference(tiny_dir, tokenizer, tmp_path):
    torch.manual_seed(0)
    module = KTOModule(str(tiny_dir), from_config=True, precompute_ref_log_probs=True,
                       ref_log_probs_cache_dir=str(tmp_path / "cache"), learning_rate=1e-2)
    dm = make_data(UNPAIRED, tokenizer, shuffle=False)
    torch.manual_seed(0)
    initial = KTOModule(str(tiny_dir), from_config=True)
    initial.configure_model()  # same seed: the untrained policy, i.e. the reference
    trainer = L.Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        limit_val_batches=0)
    torch.manual_seed(0)  # the policy is built inside fit: the same weights as `initial`
    trainer.fit(module, dm)
    assert module.ref_model is None and list((tmp_path / "cache").glob("*.pt"))
    logps, kl_logps = dm.reference_logps["train"]
    batch = next(iter(dm.eval_dataloader(dm.train_dataset)))
    with torch.no_grad():
        live, live_kl = sequence_logps(initial.ref_model, batch), sequence_logps(initial.ref_model, batch, "kl_")
    torch.testing.assert_close(logps[:2], live, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kl_logps[:2], live_kl, atol=1e-5, rtol=1e-5)
    assert batch["ref_logps"].tolist() == pytest.approx(live.tolist(), abs=1e-5)


def test_precompute_ref_batch_size_sets_the_pass_batches(tiny_dir, tokenizer, tmp_path):
    """KTO takes DPO's precompute knobs (``PrecomputeReferenceKnobs``): the pass runs in batches of
    ``precompute_ref_batch_size`` rows (default ``val_batch_size``), and a row's reference log-probs do not depend on
    its batch (the mismatched sequences are columns of the rows, not drawn per batch)."""
    results, sizes = {}, {}
    for batch_size in (None, 5):
        torch.manual_seed(0)
        module = KTOModule(str(tiny_dir), from_config=True, precompute_ref_log_probs=True,
                           precompute_ref_batch_size=batch_size,
                           ref_log_probs_cache_dir=str(tmp_path / f"c{batch_size}"))
        seen = []
        original = module.reference_logps
        module.reference_logps = lambda batch, original=original, seen=seen: (seen.append(len(batch["labels"]))
                                                                             or original(batch))
        dm = make_data(UNPAIRED, tokenizer, shuffle=False, val_batch_size=2)
        torch.manual_seed(0)
        L.Trainer(max_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0).fit(module, dm)
        results[batch_size], sizes[batch_size] = dm.reference_logps["train"], seen
    assert max(sizes[None]) == 2 and max(sizes[5]) == 5
    for a, b in zip(results[None], results[5]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_lora_reference_is_the_base_model_with_adapters_disabled(tiny_dir, tokenizer):
    pytest.importorskip("peft")
    torch.manual_seed(0)
    module = KTOModule(str(tiny_dir), from_config=True,
                       peft_config={"r": 4, "lora_alpha": 8, "target_modules": "all-linear", "init_lora_weights": False})
    module.configure_model()
    assert module.ref_model is None
    dm = make_data(UNPAIRED, tokenizer, shuffle=False, batch_size=4)
    batch = next(iter(dm.eval_dataloader(dm.train_dataset)))
    ref, _ = module.reference_logps(batch)
    with torch.no_grad(), module.model.disable_adapter():
        base = sequence_logps(module.model, batch)
    torch.testing.assert_close(ref, base)
    assert not torch.allclose(ref, sequence_logps(module.model, batch).detach())


# ------------------------------------------------------------------------------------------------ console


def run_cli(repo: Path, *args: str, status: int) -> str:
    proc = console_script.run(repo, *args)
    out = proc.stdout + proc.stderr
    assert proc.returncode == status, f"exit {proc.returncode} (expected {status})\n{out[-6000:]}"
    return out


@pytest.mark.slow
def test_kto_tiny_config_through_the_console_script(repo, tmp_path):
    run_cli(repo, "fit", "--config", "configs/kto_tiny.yaml", "--trainer.max_steps", "4",
            "--trainer.val_check_interval", "4", "--trainer.limit_val_batches", "1", "--plot.enabled", "false",
            "--checkpoint.every_n_train_steps", "4", "--trainer.logger.init_args.save_dir", str(tmp_path), status=0)
    run = tmp_path / "kto_tiny" / "version_0"
    assert (run / "hf_model" / "config.json").is_file()
    with open(run / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    for key in ("train/loss", "train/kl", "train/rewards/chosen", "train/rewards/rejected", "train/rewards/margins",
                "train/logps/chosen", "train/logps/rejected", "val/kl", "val/rewards/margins"):
        assert any(r.get(key) not in (None, "") for r in rows), key


@pytest.mark.slow
def test_bad_labels_fail_through_the_console_script(repo, tmp_path, write_jsonl):
    rows = [dict(r) for r in UNPAIRED]
    rows[3]["label"] = None
    # (no validation carve-out: row numbers are then the file's)
    out = run_cli(repo, "fit", "--config", "configs/kto_tiny.yaml", "--data.path", write_jsonl(rows),
                  "--data.val_split_size", "0", "--trainer.logger.init_args.save_dir", str(tmp_path), status=1)
    assert "row 3, column 'label'" in out and "Traceback" not in out, out[-800:]
    rows = [dict(r, label="yes" if r["label"] else "no") for r in UNPAIRED]
    out = run_cli(repo, "fit", "--config", "configs/kto_tiny.yaml", "--data.path", write_jsonl(rows, "strings.jsonl"),
                  "--data.val_split_size", "0", "--trainer.logger.init_args.save_dir", str(tmp_path), status=1)
    assert "row 0, column 'label': expected a boolean" in out and "Traceback" not in out


def test_kl_term_is_clamped_at_zero_and_zero_without_kl(tiny_dir, monkeypatch):
    import lightalign.modules.kto as kto

    module = KTOModule(str(tiny_dir), from_config=True)
    module.model = torch.nn.Identity()
    batch = {"input_ids": torch.zeros(2, 3, dtype=torch.long)}
    monkeypatch.setattr(kto, "sequence_logps", lambda model, batch, prefix="": torch.tensor([-5.0, -4.0]))
    assert float(module.kl_term(batch, torch.tensor([-4.0, -4.0]))) == 0.0  # mean log-ratio -0.5 -> clamped
    assert float(module.kl_term(batch, torch.tensor([-6.0, -4.0]))) == pytest.approx(0.5)
    apo = KTOModule(str(tiny_dir), from_config=True, loss_type="apo_zero_unpaired")
    apo.model = torch.nn.Identity()
    assert float(apo.kl_term(batch, None)) == 0.0


def test_sequence_logps_sum_the_completion_tokens_only(tiny_model, tokenizer):
    dm = make_data(UNPAIRED, tokenizer, shuffle=False, batch_size=2)
    batch = next(iter(dm.eval_dataloader(dm.train_dataset)))
    with torch.no_grad():
        got = sequence_logps(tiny_model, batch, "kl_")
        for i in range(2):
            ids = batch["kl_input_ids"][i, : int(batch["kl_attention_mask"][i].sum())]
            start = int(batch["kl_completion_mask"][i].argmax())  # first completion token
            logps = torch.log_softmax(tiny_model(input_ids=ids[None]).logits[0].float(), -1)
            expected = sum(float(logps[t - 1, ids[t]]) for t in range(start, len(ids)))
            assert float(got[i]) == pytest.approx(expected, abs=1e-4)


def test_conversational_rows_go_through_the_chat_template(tokenizer):
    chat = [{"prompt": [{"role": "user", "content": f"What is {i} plus 1?"}],
             "completion": [{"role": "assistant", "content": str(i + 1 if i % 2 else i)}], "label": bool(i % 2)}
            for i in range(4)]
    dm = make_data(chat, tokenizer, shuffle=False)
    row = dm.train_dataset[0]
    whole = tokenizer.apply_chat_template(chat[0]["prompt"] + chat[0]["completion"], tokenize=False)
    prompt = tokenizer.apply_chat_template(chat[0]["prompt"], tokenize=False, add_generation_prompt=True)
    assert row["prompt_input_ids"] + row["completion_input_ids"] == tokenizer(whole, add_special_tokens=False)["input_ids"]
    assert row["prompt_input_ids"] == tokenizer(prompt, add_special_tokens=False)["input_ids"]


def test_a_kind_without_rows_is_not_logged(tiny_dir, tokenizer):
    module = kto_module(tiny_dir)
    desirable_only = [r for r in UNPAIRED if r["label"]]
    dm = make_data(UNPAIRED, tokenizer, shuffle=False, val_path=Dataset.from_list(desirable_only), batch_size=3)
    with torch.no_grad():
        module._step(next(iter(dm.eval_dataloader(dm.val_dataset))), module.eval_stats)
    logged = {}
    module.log = lambda name, value, **kwargs: logged.__setitem__(name, value)
    module._log_stats(module.eval_stats, "val")
    assert {"val/loss", "val/kl", "val/rewards/chosen", "val/logps/chosen"} <= set(logged)
    assert not {"val/rewards/rejected", "val/logps/rejected", "val/rewards/margins"} & set(logged)  # not NaN rows
