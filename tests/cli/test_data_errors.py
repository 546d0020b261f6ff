"""Bad data files and model folders fail early, naming the file, the line or row, and the column or key (#21).

Rows are numbered from 0 in the order of the user's data (``row 30`` is ``dataset[30]``), also when a validation
carve-out shuffles them into two parts; errors found while reading a file name its line, counted from 1.
The console tests run the venv's ``lightalign`` script in a subprocess and check the exit status and the one-line
error.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helpers import console_script

from lightalign import DataFormatError, ModelNotFoundError, PreferenceDataModule, PromptDataModule, SFTDataModule, SFTModule

GOOD_CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def lightalign(repo: Path, *args: str, status: int = 1, env_drop: tuple[str, ...] = (), **extra_env: str) -> str:
    env = console_script.standard_env(**extra_env)
    for key in env_drop:
        env.pop(key, None)
    proc = console_script.run(repo, *args, env=env, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == status, f"exit {proc.returncode} (expected {status})\n{out[-6000:]}"
    return out


def fit_args(save_dir: Path, *extra: str) -> list[str]:
    return ["fit", "--config", "configs/quickstart.yaml", "--trainer.max_steps", "1", "--trainer.limit_val_batches",
            "0", "--plot.enabled", "false", "--trainer.logger.init_args.save_dir", str(save_dir), *extra]


def one_error_line(out: str) -> str:
    lines = [line for line in out.splitlines() if line.startswith("lightalign: error:")]
    assert len(lines) == 1 and "Traceback" not in out, out[-4000:]
    return lines[0]


def setup_sft(path, tiny_dir, **kw) -> SFTDataModule:
    dm = SFTDataModule(str(path), tokenizer=str(tiny_dir), **kw)
    dm.setup("fit")
    return dm


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


# --------------------------------------------------------------------------------------------- row numbers
def chat_rows(n: int, bad_row: int) -> list[dict]:
    rows = [json.loads(json.dumps(GOOD_CHAT)) for _ in range(n)]
    rows[bad_row]["messages"][1]["content"] = "  "  # of the column's type (a string), so the reader keeps it
    return rows


@pytest.mark.parametrize("val_split_size", [0.0, 0.25, 10])
def test_row_numbers_are_the_users_rows_with_a_validation_carve_out(tiny_dir, write_jsonl, val_split_size):
    """Row 30 (the 31st line) is reported as row 30, line 31, whichever part of the carve-out it lands in."""
    path = write_jsonl(chat_rows(40, 30))
    with pytest.raises(DataFormatError, match=r"data '.*data.jsonl', line 31: row 30, column 'messages', message 1 "
                                              r"\(assistant\): content is empty"):
        setup_sft(path, tiny_dir, val_split_size=val_split_size)


# --------------------------------------------------------------------------------------------- one type per column
def arithmetic(data_dir: Path, n: int = 200) -> list[dict]:
    return [json.loads(line) for line in (data_dir / "arithmetic_sft.jsonl").read_text().splitlines()[:n]]


def as_chat(row: dict) -> dict:
    return {"messages": [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["completion"]}]}


def as_pair(row: dict) -> dict:
    return {"prompt": row["prompt"], "chosen": row["completion"], "rejected": f"{row['completion']}1"}


@pytest.mark.parametrize("shape, column", [
    ("completion", r"column 'completion'"),
    ("chosen", r"column 'chosen'"),
    ("content", r"column 'messages' \(at messages\[\]\.content\)"),
    ("json_array", r"column 'completion'"),
])
@pytest.mark.parametrize("val_split_size", [0.0, 0.5])
def test_a_value_of_another_type_names_the_files_line(tiny_dir, data_dir, tmp_path, shape, column, val_split_size):
    """Row index 29 holds the number 2 among strings that look like numbers ("60"): datasets' reader would turn the
    column into numbers, so a check after loading named a good row (row 0, int 60). The source check sees the rows
    as the file holds them: line 30 (counted from 1), also with a carve-out (checked before any split)."""
    rows = arithmetic(data_dir)
    rows[29]["completion"] = 2
    rows = {"chosen": [as_pair(r) for r in rows], "content": [as_chat(r) for r in rows]}.get(shape, rows)
    path = tmp_path / ("bad.json" if shape == "json_array" else "bad.jsonl")
    path.write_text(json.dumps(rows, indent=0) if shape == "json_array" else "".join(json.dumps(r) + "\n" for r in rows))
    line = 30 if shape != "json_array" else 1 + 4 * 29 + 1  # indent=0: "[", then 4 lines per row
    cls = PreferenceDataModule if shape == "chosen" else SFTDataModule
    with pytest.raises(DataFormatError, match=rf"Data file '{path}', line {line} \(lines counted from 1\): {column} "
                                              r"holds a number 2, but \d+ other (row|value)\(s\) hold a string there "
                                              r"\(the first at line \d+\).*Write it as \"2\" if it is text"):
        cls(str(path), tokenizer=str(tiny_dir), val_split_size=val_split_size).setup("fit")


def test_columns_of_one_type_with_nulls_and_mixed_numbers_load(tiny_dir, tmp_path):
    """null (or a missing key) is no type, ints and floats are one (numbers): such files load as before."""
    rows = [{"prompt": f"{i}+1=", "completion": str(i + 1), "score": 1 if i % 2 else 0.5, "note": None if i % 3 else "x"}
            for i in range(8)]
    rows[3].pop("note")
    path = write_lines(tmp_path / "ok.jsonl", [json.dumps(r) for r in rows])
    assert len(setup_sft(path, tiny_dir).train_dataset) == 8


def test_the_odd_type_out_is_named_even_when_it_comes_first(tmp_path):
    from lightalign.datamodules.sources import check_file

    path = write_lines(tmp_path / "first.jsonl", ['{"text": 5}'] + ['{"text": "a"}'] * 3)
    with pytest.raises(DataFormatError, match=r"line 1 \(lines counted from 1\): column 'text' holds a number 5, but 3 "
                                              r"other row\(s\) hold a string there \(the first at line 2\)"):
        check_file(path, str(path))


# --------------------------------------------------------------------------------------------- files and splits
def test_whitespace_only_file_is_refused(tiny_dir, tmp_path):
    path = write_lines(tmp_path / "blank.jsonl", ["  ", "", "\t"])
    with pytest.raises(DataFormatError, match=rf"Data file '{path}' holds no rows: its 3 line\(s\) are all blank"):
        setup_sft(path, tiny_dir)


def test_folder_files_with_different_columns_are_refused(tiny_dir, tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    write_lines(folder / "a.jsonl", ['{"prompt": "1+1=", "completion": "2"}'])
    write_lines(folder / "b.jsonl", ['{"text": "1+1=2"}'])
    with pytest.raises(DataFormatError, match=r"file 'b.jsonl' has columns \['text'\] but 'a.jsonl' has \['completion', "
                                              r"'prompt'\].*need the same columns"):
        setup_sft(folder, tiny_dir)


@pytest.mark.parametrize("size, held", [(3, 3), (5, 5), (0.9, 3)])
def test_a_carve_out_that_leaves_no_training_row_is_refused(tiny_dir, tmp_path, size, held):
    path = write_lines(tmp_path / "three.jsonl", ['{"text": "a b"}'] * 3)
    with pytest.raises(DataFormatError, match=rf"val_split_size={size:g} asks for {held} validation rows but "
                                              rf"'{path}' has 3 rows, which would leave none to train on"):
        setup_sft(path, tiny_dir, val_split_size=size)


def test_negative_num_workers_is_refused():
    with pytest.raises(ValueError, match=r"num_workers must be >= 0 \(0: load batches in the training process\), got -1"):
        SFTDataModule("x.jsonl", tokenizer="t", num_workers=-1)


def test_carve_out_is_unchanged(tiny_dir, data_dir):
    """The validation rows are the same ones train_test_split picks (seeded), so earlier runs' splits stay."""
    from datasets import load_dataset

    raw = load_dataset("json", data_files=str(data_dir / "arithmetic_sft.jsonl"), split="train")
    expected = raw.train_test_split(test_size=0.1, seed=7, shuffle=True)["test"]["prompt"]
    dm = SFTDataModule(str(data_dir / "arithmetic_sft.jsonl"), tokenizer=str(tiny_dir), val_split_size=0.1, seed=7)
    dm.setup("fit")
    tok = dm.tokenizer
    firsts = [tok.decode(ids).split("=")[0] for ids in dm.val_dataset["input_ids"]]
    assert firsts == [p.split("=")[0] for p in expected]


def test_preference_mixed_rows_name_the_line(tiny_dir, write_jsonl):
    """A conversation among strings: refused while reading the file (one type per column), naming its line."""
    rows = [{"prompt": f"Is {i} even?", "chosen": " yes", "rejected": " no"} for i in range(40)]
    rows[30]["chosen"] = [{"role": "assistant", "content": "yes"}]
    with pytest.raises(DataFormatError, match=r"line 31 \(lines counted from 1\): column 'chosen' holds a list "
                                              r".*but 39 other row\(s\) hold a string"):
        PreferenceDataModule(write_jsonl(rows), tokenizer=str(tiny_dir), val_split_size=0.25).setup("fit")


def test_preference_tokenization_errors_name_the_row(tiny_dir, write_jsonl):
    """An implicit-prompt row without a shared prefix is found while tokenizing; still named by its file row."""
    rows = [{"chosen": f"{i}+1={i + 1}", "rejected": f"{i}+1=0"} for i in range(40)]
    rows[30] = {"chosen": "abc", "rejected": "xyz"}
    with pytest.raises(DataFormatError, match=r"row 30: 'chosen' and 'rejected' share no prefix"):
        PreferenceDataModule(write_jsonl(rows), tokenizer=str(tiny_dir), val_split_size=0.25).setup("fit")


def test_unpaired_rows_name_the_row(tiny_dir, write_jsonl):
    from lightalign.datamodules.unpaired import UnpairedPreferenceDataModule

    rows = [{"prompt": f"Is {i} even?", "completion": " yes", "label": True} for i in range(40)]
    rows[30]["label"] = 1.5
    with pytest.raises(DataFormatError, match=r"line 31 \(lines counted from 1\): column 'label' holds a number 1.5, "
                                              r"but 39 other row\(s\) hold a boolean"):
        UnpairedPreferenceDataModule(write_jsonl(rows), tokenizer=str(tiny_dir), val_split_size=0.25).setup("fit")
    rows[30]["label"] = None  # null is no type: found by the row check, named by its row in the user's data
    with pytest.raises(DataFormatError, match=r"row 30, column 'label': expected a boolean .*got no label \(null\)"):
        UnpairedPreferenceDataModule(write_jsonl(rows, "strings.jsonl"), tokenizer=str(tiny_dir),
                                     val_split_size=0.25).setup("fit")
    paired = [{"chosen": f"Is {i} even? yes", "rejected": f"Is {i} even? no"} for i in range(40)]
    paired[30] = {"chosen": "abc", "rejected": "xyz"}  # implicit prompt: found while unpairing
    with pytest.raises(DataFormatError, match=r"row 30: 'chosen' and 'rejected' share no prefix"):
        UnpairedPreferenceDataModule(write_jsonl(paired, "paired.jsonl"), tokenizer=str(tiny_dir),
                                     val_split_size=0.25).setup("fit")


def test_prompt_rows_name_the_row(tiny_dir, write_jsonl):
    rows = [{"prompt": f"{i}+1="} for i in range(40)]
    rows[30]["prompt"] = ""
    with pytest.raises(DataFormatError, match=r"validation data '.*', line 31: row 30, column 'prompt': the text is "
                       r"empty|train data '.*', line 31: row 30, column 'prompt': the text is empty"):
        PromptDataModule(write_jsonl(rows), tokenizer=str(tiny_dir), val_split_size=0.25).setup("fit")


@pytest.mark.parametrize("cls", ["SFTDataModule", "PreferenceDataModule", "PromptDataModule",
                                 "UnpairedPreferenceDataModule"])
def test_the_cli_parser_keeps_a_data_path_as_a_path(tmp_path, cls):
    """jsonargparse reads a file given for a class-typed argument as the value: an empty file became None (then
    "needs `path`") and a CSV path its text. The datamodules type ``path`` so that a path stays a path."""
    import lightning as L
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_subclass_arguments(L.LightningDataModule, "data", required=True, fail_untyped=False)
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "one.csv").write_text("text\nhello\n")
    for name in ("empty.jsonl", "one.csv"):
        path = str(tmp_path / name)
        for arg in ("path", "val_path", "test_path"):
            cfg = parser.parse_args(["--data", f"lightalign.{cls}", f"--data.{arg}", path, "--data.tokenizer", "t"])
            assert cfg.data.init_args[arg] == path


# --------------------------------------------------------------------------------------------- reading files
@pytest.mark.parametrize("lines, match", [
    (['{"text": "a"}', '{"text": "b"}', '{"text": "c"', '{"text": "d"}'],
     r"bad.jsonl', line 3, column \d+: invalid JSON \(Expecting"),
    (['{"text": "a"}', '', '{"text": "b", "text": "c"}'], r"bad.jsonl', line 3: the key 'text' appears twice"),
    (['{"text": "a"}', '{"messages": [{"role": "user", "content": "a", "content": "b"}]}'],
     r"bad.jsonl', line 2: the key 'content' appears twice"),
    (['{"text": "a"}', '["text", "b"]'], r"bad.jsonl', line 2: expected a JSON object"),
])
def test_bad_json_lines_name_file_and_line(tiny_dir, tmp_path, lines, match):
    with pytest.raises(DataFormatError, match=match):
        setup_sft(write_lines(tmp_path / "bad.jsonl", lines), tiny_dir)


@pytest.mark.parametrize("text, match", [
    ('[\n  {"text": "a"},\n  {"text": "b",\n   "text": "c"}\n]', r"bad.json', line 3: the object starting there repeats the key 'text'"),
    ('[\n  {"text": "a"},\n  {"text": "b"},\n]', r"bad.json', line 3, column 16: invalid JSON \(a comma before '\]'\)"),
    ('[\n  {"text": "a"}\n  {"text": "b"}\n]', r"bad.json', line 3, column 3: invalid JSON \(expected ',' or '\]'\)"),
    ('{"text": "a"}\n{"text": "b", "text": "c"}\n', r"bad.json', line 2: the key 'text' appears twice"),
])
def test_bad_json_documents_name_file_and_line(tiny_dir, tmp_path, text, match):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(DataFormatError, match=match):
        setup_sft(path, tiny_dir)


def test_json_array_and_json_lines_in_a_json_file_load(tiny_dir, tmp_path):
    (tmp_path / "a.json").write_text(json.dumps([{"text": "a b"}, {"text": "c d"}], indent=2))
    (tmp_path / "b.json").write_text('{"text": "a b"}\n\n{"text": "c d"}\n')
    for name in ("a.json", "b.json"):
        assert len(setup_sft(tmp_path / name, tiny_dir).train_dataset) == 2


@pytest.mark.parametrize("name", ["latin.jsonl", "latin.csv", "latin.json"])
def test_latin1_bytes_name_file_offset_and_line(tiny_dir, tmp_path, name):
    path = tmp_path / name
    head = "text\nfine\n" if name.endswith(".csv") else '{"text": "fine"}\n'
    body = "caf\xe9 au lait\n" if name.endswith(".csv") else '{"text": "caf\xe9"}\n'
    path.write_bytes(head.encode() + body.encode("latin-1"))
    offset = len(head.encode()) + body.index("\xe9")
    with pytest.raises(DataFormatError, match=rf"{name}' is not UTF-8: byte b'\\xe9' at byte offset {offset} \(line "
                                              rf"{head.count(chr(10)) + 1}\).*Save the file as UTF-8"):
        setup_sft(path, tiny_dir)


def test_csv_with_a_repeated_column_is_refused(tiny_dir, tmp_path):
    path = write_lines(tmp_path / "dup.csv", ["prompt,completion,prompt", "1+1=,2,x"])
    with pytest.raises(DataFormatError, match=r"dup.csv': the CSV header names the column 'prompt' twice"):
        setup_sft(path, tiny_dir)


def test_unsupported_extension_is_a_local_file_not_a_hub_name(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_lines(tmp_path / "train.txt", ["hello"])
    with pytest.raises(DataFormatError, match=r"'train.txt' has an unsupported extension '.txt'; use one of \['.arrow', "
                                              r"'.csv', '.json', '.jsonl', '.parquet'\]"):
        setup_sft("train.txt", tiny_dir)
    with pytest.raises(DataFormatError, match=r"Data file 'data/missing.txt' does not exist"):
        setup_sft("data/missing.txt", tiny_dir)


def test_mixed_folder_is_refused_naming_the_files(tiny_dir, tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    write_lines(folder / "a.jsonl", ['{"text": "a"}'])
    write_lines(folder / "b.csv", ["text", "b"])
    with pytest.raises(DataFormatError, match=r"mixes file formats \(csv: b.csv; json: a.jsonl\)"):
        setup_sft(folder, tiny_dir)
    (folder / "b.csv").unlink()
    write_lines(folder / "c.json", ['{"text": "c"}'])  # .json and .jsonl are one kind: both load
    assert len(setup_sft(folder, tiny_dir).train_dataset) == 2
    for p in folder.iterdir():
        p.unlink()
    write_lines(folder / "notes.txt", ["x"])
    with pytest.raises(DataFormatError, match=r"holds no .*jsonl.* file \(found: \['.txt'\]\)"):
        setup_sft(folder, tiny_dir)


def test_folder_files_are_checked(tiny_dir, tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    write_lines(folder / "a.jsonl", ['{"text": "a"}'])
    write_lines(folder / "b.jsonl", ['{"text": "a", "text": "b"}'])
    with pytest.raises(DataFormatError, match=r"b.jsonl', line 1: the key 'text' appears twice"):
        setup_sft(folder, tiny_dir)


# --------------------------------------------------------------------------------------------- model folders
def tiny_copy(tiny_dir: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(tiny_dir, folder)
    return folder


def test_model_folder_without_weights_fails_at_construction(tiny_dir, tmp_path):
    folder = tiny_copy(tiny_dir, tmp_path)
    with pytest.raises(ModelNotFoundError, match=r"Model folder '.*model' has no weights.*model.safetensors.*"
                                                 r"--model.from_config true"):
        SFTModule(str(folder))
    SFTModule(str(folder), from_config=True)  # random weights from config.json: nothing to check


def test_corrupt_or_truncated_safetensors_is_named(tiny_dir, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = tiny_copy(tiny_dir, tmp_path)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)).save_pretrained(folder)
    weights = folder / "model.safetensors"
    SFTModule(str(folder))  # whole: accepted
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 100])
    with pytest.raises(ModelNotFoundError, match=r"Weight file '.*model.safetensors' is corrupt or truncated: it has "
                                                 r"\d+ bytes but its tensors need \d+"):
        SFTModule(str(folder))
    weights.write_bytes(b"\x00garbage bytes, not a model" * 10)
    with pytest.raises(ModelNotFoundError, match=r"model.safetensors' is corrupt or truncated: its header claims"):
        SFTModule(str(folder))


def test_lora_on_a_from_config_model_exports_the_merged_model(tiny_dir, tmp_path):
    """The random base weights are saved nowhere, so the export is base + LoRA merged (a usable model), with a
    warning, instead of an adapter whose base does not exist."""
    import torch
    from transformers import AutoModelForCausalLM

    pytest.importorskip("peft")
    torch.manual_seed(0)
    module = SFTModule(str(tiny_dir), from_config=True, peft_config={"r": 4, "lora_alpha": 8, "target_modules": "all-linear"})
    module.configure_model()
    with torch.no_grad():  # LoRA's B starts at zero: give the adapter an effect the merge must carry
        for name, param in module.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.2)
    with pytest.warns(UserWarning, match=r"LoRA on a from_config model .*gets the merged model"):
        out = module.export_hf(tmp_path / "hf")
    assert (out / "model.safetensors").is_file() and not (out / "adapter_config.json").exists()
    ids = torch.tensor([[5, 9, 17, 3, 11]])
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, module.model.eval()(ids).logits, atol=1e-4, rtol=1e-4)


def test_pretrained_lora_export_stays_an_adapter(tiny_dir, tmp_path):
    """Only from_config changes the export: LoRA on pretrained weights keeps writing the adapter alone."""
    import warnings

    from transformers import AutoConfig, AutoModelForCausalLM

    pytest.importorskip("peft")
    folder = tiny_copy(tiny_dir, tmp_path)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)).save_pretrained(folder)
    module = SFTModule(str(folder), peft_config={"r": 4, "lora_alpha": 8, "target_modules": "all-linear"})
    module.configure_model()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="LoRA on a from_config")
        out = module.export_hf(tmp_path / "hf")
    assert (out / "adapter_config.json").is_file() and not (out / "model.safetensors").exists()


# --------------------------------------------------------------------------------------------- the hub
def closed_port() -> int:
    import socket

    with socket.socket() as s:  # bound then closed: nobody listens there
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_hub_is_detected_at_once_and_only_the_cache_is_asked(monkeypatch):
    """HF_HUB_OFFLINE unset, the hub's host refuses: hub names load with local_files_only (the cache answers at
    once instead of a minute of retries) and the error says the hub cannot be reached."""
    import transformers

    import lightalign.hub as hub

    monkeypatch.delenv("HF_HUB_OFFLINE")
    for key in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    monkeypatch.setattr(hub, "_HUB_REACHABLE", {})
    seen = []
    real = transformers.AutoTokenizer.from_pretrained

    def spy(name, **kwargs):
        seen.append(kwargs.get("local_files_only"))
        return real(name, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", spy)
    with pytest.raises(ModelNotFoundError, match=r"'some-org/not-cached-xyz' is not a local folder, and the Hugging "
                                                 r"Face hub cannot be reached \(no network\)"):
        hub.load_tokenizer("some-org/not-cached-xyz")
    assert seen == [True]
    monkeypatch.setattr(hub, "_HUB_REACHABLE", {})
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")  # behind a proxy the direct connect says nothing
    assert hub.hub_reachable()


# --------------------------------------------------------------------------------------------- knobs
def test_learning_rate_must_be_positive():
    with pytest.raises(ValueError, match=r"learning_rate must be > 0 \(the peak of the schedule\), got -0.001"):
        SFTModule("m", from_config=True, learning_rate=-1e-3)
    with pytest.warns(UserWarning, match="learning_rate is 0: the optimizer will not change the weights"):
        SFTModule("m", from_config=True, learning_rate=0.0)  # allowed: losses measured on frozen weights


# --------------------------------------------------------------------------------------------- console
@pytest.mark.slow
def test_console_data_errors(repo, tmp_path):
    """Through the console script: a bad row with a validation carve-out, an empty file, invalid JSON."""
    bad = tmp_path / "chat.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in chat_rows(40, 30)))
    line = one_error_line(lightalign(repo, *fit_args(tmp_path, "--data.path", str(bad), "--data.val_path", "null",
                                                     "--data.val_split_size", "0.25")))
    assert "line 31: row 30, column 'messages', message 1 (assistant): content is empty" in line, line
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    line = one_error_line(lightalign(repo, *fit_args(tmp_path, "--data.path", str(empty))))
    assert f"Data file '{empty}' is empty (0 bytes)" in line, line
    broken = write_lines(tmp_path / "broken.jsonl", ['{"text": "a"}', '{"text": '])
    line = one_error_line(lightalign(repo, *fit_args(tmp_path, "--data.path", str(broken))))
    assert f"Data file '{broken}', line 2, column" in line and "invalid JSON" in line, line


@pytest.mark.slow
def test_console_negative_learning_rate_reaches_the_knobs_check(repo, tmp_path):
    line = one_error_line(lightalign(repo, *fit_args(tmp_path, "--model.learning_rate", "-1e-3")))
    assert "learning_rate must be > 0 (the peak of the schedule), got -0.001" in line, line


@pytest.mark.slow
def test_console_model_folder_without_weights_fails_before_tokenizing(repo, tiny_dir, tmp_path):
    folder = tiny_copy(tiny_dir, tmp_path)
    out = lightalign(repo, *fit_args(tmp_path, "--model.model_name_or_path", str(folder), "--model.from_config", "false"))
    line = one_error_line(out)
    assert f"Model folder '{folder}' has no weights" in line and "--model.from_config true" in line, line
    assert "Tokenizing" not in out


@pytest.mark.slow
def test_console_uncached_hub_name_without_network_fails_fast_with_the_offline_message(repo, tmp_path):
    """HF_HUB_OFFLINE unset and the hub unreachable (HF_ENDPOINT at a closed local port): the uncached name is looked
    up in the local cache only, and the message says the hub cannot be reached."""
    port = closed_port()
    out = lightalign(repo, *fit_args(tmp_path, "--model.model_name_or_path", "some-org/not-cached-model-xyz",
                                     "--model.from_config", "false"),
                     env_drop=("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"), HF_ENDPOINT=f"http://127.0.0.1:{port}")
    line = one_error_line(out)
    assert "'some-org/not-cached-model-xyz' is not a local folder, and the Hugging Face hub cannot be reached" in line, line


def bad_data_files(data_dir: Path, folder: Path) -> dict[str, Path]:
    """The issue's repro files: row index 29 (line 30) of the first 200 rows holds the number 2 among strings."""
    rows = arithmetic(data_dir)
    rows[29]["completion"] = 2
    files = {"completion": folder / "bad.jsonl", "chosen": folder / "bad_pref.jsonl", "content": folder / "bad_chat.jsonl"}
    for key, make in (("completion", dict), ("chosen", as_pair), ("content", as_chat)):
        files[key].write_text("".join(json.dumps(make(r)) + "\n" for r in rows))
    return files


# the console cases: (name, arguments after the shipped config, the start of the one error line); {f[...]} are the files
CONSOLE_CASES = [
    ("completion", ("--data.path", "{f[completion]}", "--data.val_path", "null"),
     "Data file '{f[completion]}', line 30 (lines counted from 1): column 'completion' holds a number 2"),
    ("completion with a carve-out", ("--data.path", "{f[completion]}", "--data.val_path", "null",
                                     "--data.val_split_size", "0.5"),
     "Data file '{f[completion]}', line 30 (lines counted from 1): column 'completion' holds a number 2"),
    ("chosen", ("--data.path", "{f[chosen]}"),
     "Data file '{f[chosen]}', line 30 (lines counted from 1): column 'chosen' holds a number 2"),
    ("content", ("--data.path", "{f[content]}", "--data.val_path", "null"),
     "Data file '{f[content]}', line 30 (lines counted from 1): column 'messages' (at messages[].content) holds a number 2"),
    ("carve-out larger than the data", ("--data.val_path", "null", "--data.val_split_size", "100000"),
     "val_split_size=100000 asks for 100000 validation rows but 'examples/data/arithmetic_sft.jsonl' has 3000 rows"),
    ("whitespace-only file", ("--data.path", "{f[blank]}"), "Data file '{f[blank]}' holds no rows: its 3 line(s) are all blank"),
    ("folder with different columns", ("--data.path", "{f[folder]}", "--data.val_path", "null"),
     "Data folder '{f[folder]}': file 'b.jsonl' has columns ['text'] but 'a.jsonl' has ['completion', 'prompt']"),
    ("negative num_workers", ("--data.num_workers", "-1"),
     "num_workers must be >= 0 (0: load batches in the training process), got -1."),
]


@pytest.mark.slow
@pytest.mark.parametrize("name, extra, expected", CONSOLE_CASES, ids=[c[0] for c in CONSOLE_CASES])
def test_console_data_refusals_are_one_line(repo, data_dir, tmp_path, name, extra, expected):
    """Each refuses before the model loads, in one line naming the file and its line (exit 1, no traceback)."""
    files = bad_data_files(data_dir, tmp_path)
    files["blank"] = write_lines(tmp_path / "blank.jsonl", ["  ", "", "   "])
    files["folder"] = tmp_path / "folder"
    files["folder"].mkdir()
    write_lines(files["folder"] / "a.jsonl", [json.dumps(r) for r in arithmetic(data_dir, 20)])
    write_lines(files["folder"] / "b.jsonl", [json.dumps({"text": r["prompt"] + r["completion"]})
                                              for r in arithmetic(data_dir, 20)])
    config = "configs/dpo_tiny.yaml" if name == "chosen" else "configs/quickstart.yaml"
    args = [a.format(f=files) for a in extra]
    line = one_error_line(lightalign(repo, "fit", "--config", config, "--trainer.max_steps", "2",
                                     "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"), *args))
    assert line.startswith(f"lightalign: error: {expected.format(f=files)}"), line


@pytest.mark.parametrize("name, text, row, line", [
    ("jsonl", '\n{"text": "a"}\n\n{"text": "b"}\n', 1, 4),
    ("json", '[\n  {"text": "a"},\n\n  {"text":\n   "b"}\n]', 1, 4),
    ("csv", 'text,label\n"a\nb",1\nc,2\n', 1, 4),
    ("jsonl", '{"text": "a"}\n', 3, None),
])
def test_row_line_is_where_the_row_starts_in_the_file(tmp_path, name, text, row, line):
    """The line a missing-column error names (sources.row_line): blank lines, a multi-line array row and a
    multi-line CSV cell counted (mutation: the JSON rows' lines replaced by row + 2 -> the json and jsonl cases
    fail); no such row -> None."""
    from lightalign.datamodules.sources import row_line

    path = tmp_path / f"data.{name}"
    path.write_text(text)
    assert row_line(str(path), row) == line
