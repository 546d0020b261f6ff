"""The precomputed reference log-prob cache: its key covers every weight and every token id."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch
from datasets import Dataset

from helpers import console_script

from lightalign.modules.dpo import TOKENIZED_COLUMNS
from lightalign.modules.reference.model import model_fingerprint, tokenized_fingerprint

WORKER = Path(__file__).resolve().parents[1] / "workers" / "reference_worker.py"


def test_references_differing_in_one_late_weight_get_different_keys(tiny_model):
    other = copy.deepcopy(tiny_model)
    names = list(tiny_model.state_dict())
    # a tensor that is neither the first, the middle nor the last one: a merged LoRA on a late layer's MLP
    late = other.model.layers[-1].mlp.down_proj.weight
    position = names.index(f"model.layers.{len(other.model.layers) - 1}.mlp.down_proj.weight")
    assert position not in (0, len(names) // 2, len(names) - 1)
    assert model_fingerprint(other) == model_fingerprint(tiny_model)
    with torch.no_grad():
        late.view(-1)[-1] += 1e-3
    assert model_fingerprint(other) != model_fingerprint(tiny_model)
    assert model_fingerprint(tiny_model, {"ld_alpha": 0.5}) != model_fingerprint(tiny_model, {"ld_alpha": None})


def _rows(chosen_last: int) -> Dataset:
    return Dataset.from_dict({"prompt_input_ids": [[1, 2, 3], [4, 5]], "chosen_input_ids": [[6, 7], [8, chosen_last]],
                              "rejected_input_ids": [[9], [10, 11]], "index": [0, 1], "split": ["train", "train"]})


def test_tokenized_key_follows_the_token_ids_not_the_dataset_object():
    a, b = _rows(9), _rows(9)
    assert tokenized_fingerprint(a, TOKENIZED_COLUMNS) == tokenized_fingerprint(b, TOKENIZED_COLUMNS)
    assert tokenized_fingerprint(_rows(12), TOKENIZED_COLUMNS) != tokenized_fingerprint(a, TOKENIZED_COLUMNS)
    # the same ids cut differently between prompt and completion are other rows
    moved = Dataset.from_dict({"prompt_input_ids": [[1, 2], [4, 5]], "chosen_input_ids": [[3, 6, 7], [8, 9]],
                               "rejected_input_ids": [[9], [10, 11]], "index": [0, 1], "split": ["train", "train"]})
    assert tokenized_fingerprint(moved, TOKENIZED_COLUMNS) != tokenized_fingerprint(a, TOKENIZED_COLUMNS)
    # rows in another order are other rows (log-probs are stored in row order)
    assert tokenized_fingerprint(a.select([1, 0]), TOKENIZED_COLUMNS) != tokenized_fingerprint(a, TOKENIZED_COLUMNS)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_precompute_pass_is_sharded_across_ranks_and_gathered(tmp_path):
    """9 rows, 2 ranks, batches of 4: rank 0 computes rows 0-3 (one batch), rank 1 rows 4-8 (two); rank 0 runs
    its batch once more so both meet the same number of forwards; both end with all 9 rows, equal to one
    process's 3 forwards over everything."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK",
                                                             "LOCAL_RANK", "NODE_RANK")}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    for devices in (1, 2):
        out = tmp_path / f"d{devices}"
        proc = console_script.run_python(WORKER, "--devices", str(devices), "--out", str(out), env=env, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
    one = json.loads((tmp_path / "d1" / "rank0.json").read_text())
    assert one["forwards"] == 3 and len(one["chosen"]) == 9
    for rank in (0, 1):
        got = json.loads((tmp_path / "d2" / f"rank{rank}.json").read_text())
        assert got["forwards"] == 2, rank  # half the work each (rank 0's second forward is the repeat)
        assert got["chosen"] == pytest.approx(one["chosen"], abs=1e-5)
        assert got["rejected"] == pytest.approx(one["rejected"], abs=1e-5)
