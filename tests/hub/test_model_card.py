"""The model card: ``model_card_text`` (modules/training/model_card.py) as a pure function, and the ``README.md``
HFExport writes into every exported folder of a short fit (no push involved).

Exercised: the YAML metadata parses with huggingface_hub's ``ModelCard.load`` (base_model, tags, datasets,
library_name); the body names the method, the knobs that differ from the defaults before the others, the data, the
final metrics (equal to the last logged values) and the versions; the title names the hub repository, the run or
the folder; an exported card loads from its folder's absolute path and names the method by its proper name; the knobs
of a feature that is off (``switched_knobs``: the vllm_* knobs without use_vllm) are left out and counted. Not exercised: the Hub's own validation of the
metadata (no network).
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
from huggingface_hub import ModelCard

from lightalign import HFExport, SFTDataModule, SFTModule
from lightalign.modules.training.model_card import card_title, class_defaults, model_card_text


def test_model_card_text_is_parseable_metadata_and_names_method_knobs_data_metrics(tmp_path):
    defaults = class_defaults(SFTModule)
    hparams = {**{k: defaults[k] for k in ("learning_rate", "weight_decay", "warmup_steps")},
               "model_name_or_path": "Qwen/Qwen2.5-0.5B", "learning_rate": 3e-4, "_class_path": "lightalign.SFTModule"}
    text = model_card_text(method="SFTModule", base_model="Qwen/Qwen2.5-0.5B", hparams=hparams, defaults=defaults,
                           metrics={"train/loss": 1.25, "val/loss": 1.5, "train/tokens_per_sec": 5000.0},
                           versions={"lightalign": "0.1.0", "torch": "2.13.0", "transformers": "5.24.0",
                                     "lightning": "2.6.6", "peft": None},
                           step=300, data="trl-lib/Capybara", data_format="conversational", data_module="SFTDataModule",
                           repo_id="me/my-model")
    assert text == model_card_text(method="SFTModule", base_model="Qwen/Qwen2.5-0.5B", hparams=hparams,
                                   defaults=defaults, metrics={"train/loss": 1.25, "val/loss": 1.5,
                                                               "train/tokens_per_sec": 5000.0},
                                   versions={"lightalign": "0.1.0", "torch": "2.13.0", "transformers": "5.24.0",
                                             "lightning": "2.6.6", "peft": None},
                                   step=300, data="trl-lib/Capybara", data_format="conversational",
                                   data_module="SFTDataModule", repo_id="me/my-model")  # pure
    (tmp_path / "README.md").write_text(text)
    card = ModelCard.load(tmp_path / "README.md")
    assert card.data.base_model == "Qwen/Qwen2.5-0.5B" and card.data.library_name == "transformers"
    assert card.data.tags == ["lightalign", "sft"] and card.data.datasets == ["trl-lib/Capybara"]
    body = card.text
    assert "`SFTModule`" in body and 'AutoModelForCausalLM.from_pretrained("me/my-model")' in body
    changed, others = body.split("The other knobs")
    assert "| `learning_rate` | `0.0003` |" in changed and "`weight_decay`" in others and "_class_path" not in body
    assert "| `train/loss` | 1.25 |" in body and "| `val/loss` | 1.5 |" in body and "tokens_per_sec" not in body
    assert "- path or name: `trl-lib/Capybara` (Hugging Face dataset)" in body and "format: conversational" in body
    assert "- transformers: 5.24.0" in body and "peft" not in body.split("## Framework versions")[1]


def test_local_base_model_is_named_in_the_body_not_the_metadata(tmp_path, tiny_dir):
    text = model_card_text(method="DPOModule", base_model=str(tiny_dir), hparams={}, defaults={}, metrics={},
                           versions={}, folder=str(tmp_path))
    (tmp_path / "README.md").write_text(text)
    card = ModelCard.load(tmp_path / "README.md")
    assert card.data.base_model is None and card.data.tags == ["lightalign", "dpo"]  # the Hub wants a model id there
    assert f"`{tiny_dir}`" in card.text and "No metric was logged." in card.text


def test_every_export_folder_of_a_fit_has_a_model_card(tmp_path, tiny_dir, data_dir):
    rows = (data_dir / "arithmetic_sft.jsonl").read_text().splitlines()[:48]
    (tmp_path / "data.jsonl").write_text("\n".join(rows) + "\n")
    trainer = L.Trainer(accelerator="cpu", max_steps=4, logger=False, default_root_dir=str(tmp_path),
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[HFExport(output_dir=str(tmp_path / "hf_model"), every_n_train_steps=2)],
                        limit_val_batches=0)
    trainer.fit(SFTModule(str(tiny_dir), from_config=True, learning_rate=2e-3),
                SFTDataModule(str(tmp_path / "data.jsonl"), tokenizer=str(tiny_dir), max_length=32, batch_size=4))
    final_loss = float(trainer.callback_metrics["train/loss"])
    for folder in ("checkpoint-2", "checkpoint-4", "hf_model"):
        card = ModelCard.load(tmp_path / folder / "README.md")
        assert card.data.tags == ["lightalign", "sft"] and card.data.library_name == "transformers"
        assert "`SFTModule`" in card.text and "| `learning_rate` | `0.002` |" in card.text
        assert "format: prompt-completion" in card.text and "- lightalign: " in card.text
    card = ModelCard.load(tmp_path / "hf_model" / "README.md")
    assert f"| `train/loss` | {final_loss:.4g} |" in card.text and "4 optimizer steps" in card.text


@pytest.mark.parametrize("repo_id, run_name, folder, title", [
    ("me/my-model", "quickstart/version_0", "/r/hf_model", "me/my-model"),  # pushed: the hub repository
    (None, "quickstart/version_0", "/r/quickstart/version_0/hf_model", "quickstart/version_0"),
    (None, "quickstart/version_0", "/r/quickstart/version_0/checkpoint-4", "quickstart/version_0 (checkpoint-4)"),
    (None, None, "/somewhere/my_model", "my_model"),  # no run folder (Python API, logger=False)
])
def test_the_title_names_the_repository_else_the_run_else_the_folder(repo_id, run_name, folder, title):
    assert card_title(repo_id, run_name, folder) == title


def test_an_exported_card_names_the_method_run_and_folder_and_leaves_out_knobs_of_a_feature_that_is_off(
        tiny_dir, tmp_path):
    """Read from a real module as HFExport reads it (no fit). Mutations: switched_knobs emptied -> the vllm_* knobs
    are listed; the class name upper-cased as the method's name -> fails; the folder as given (relative) -> fails."""
    from lightalign import OnlineDPOModule
    from lightalign.callbacks.hf_export import card_inputs

    module = OnlineDPOModule(str(tiny_dir), from_config=True, reward_funcs=["lightalign.rewards.digit_fraction_reward"],
                             max_completion_length=4, learning_rate=1e-3)
    run = tmp_path / "runs" / "online_dpo_quickstart" / "version_0"
    trainer = SimpleNamespace(callback_metrics={}, datamodule=None, global_step=3)
    inputs = card_inputs(Path(os.path.relpath(run / "hf_model")), trainer, module, run_dir=run)
    text = model_card_text(**inputs)
    body = text.split("\n---\n", 1)[1]
    assert body.lstrip().splitlines()[0] == "# online_dpo_quickstart/version_0"
    assert "Trained with lightalign's Online DPO (`OnlineDPOModule`) from" in body and "ONLINEDPO" not in body
    assert f'folder = "{(run / "hf_model").resolve()}"' in body and "model = AutoModelForCausalLM.from_pretrained(folder)" in body
    assert "vllm_" not in body and "ref_model_sync_steps" not in body and "`top_p`" in body
    # online DPO has no sync; its BEMA reference (update_ref_model) is off
    assert ("Left out (off here): 10 knobs that act only when `update_ref_model` is on; 12 knobs that act only when "
            "`use_vllm` is on.") in body and "ref_model_update_freq" not in body
    # the reward functions (objects, not saved hyperparameters) by import path (mutation: not added -> fails)
    assert "| `reward_funcs` | `['lightalign.rewards.functions.digit_fraction_reward']` |" in body
    on = dict(inputs, hparams={**inputs["hparams"], "use_vllm": True})  # the feature on: its knobs are listed
    assert "| `vllm_mode` | `colocate` |" in model_card_text(**on)
