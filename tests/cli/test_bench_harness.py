"""Pure helpers of the benchmark suite (bench/harness.py, bench/data.py): the FLOP count behind MFU, the sequence
lengths it is computed on, and the length shapes of the generated data. No benchmark is run here."""

import argparse
import importlib.util
import json
import random
import re
import statistics
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load(name):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


harness, data = load("harness"), load("data")


def test_train_flops_is_6N_per_token_plus_the_attention_term():
    # 2 sequences of 3 and 5 tokens, N=1000 params, 2 layers of width 4:
    # 6*1000*(3+5) + 12*2*4*(9+25) = 48000 + 3264
    assert harness.train_flops(1000, 2, 4, [3, 5]) == 48000 + 3264
    assert harness.forward_flops(1000, 2, 4, [3, 5]) == pytest.approx((48000 + 3264) / 3)
    # attention grows with the square of the length: one sequence of 8 costs more than two of 4
    assert harness.train_flops(1000, 2, 4, [8]) > harness.train_flops(1000, 2, 4, [4, 4])


def test_mfu_is_a_ratio_and_none_without_a_figure():
    assert harness.mfu(25e9, 100e9) == 0.25
    assert harness.mfu(None, 100e9) is None and harness.mfu(1e9, None) is None


def test_sequence_lengths_of_padded_and_padding_free_batches():
    padded = {"input_ids": torch.zeros(3, 5), "attention_mask": torch.tensor(
        [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])}
    assert harness.sequence_lengths(padded) == [3, 5, 1]
    flat = {"input_ids": torch.zeros(1, 9), "position_ids": torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])}
    assert harness.sequence_lengths(flat) == [3, 2, 4]


def test_alternate_and_median_of():
    assert harness.alternate(["a", "b"], 0) == ["a", "b"] and harness.alternate(["a", "b"], 1) == ["b", "a"]
    runs = [{"fw": "a", "x": 1.0}, {"fw": "a", "x": 3.0}, {"fw": "a", "x": 2.0}, {"fw": "b", "x": 9.0}]
    assert harness.median_of(runs, "x", fw="a") == 2.0 and harness.median_of(runs, "x", fw="c") is None


def test_length_shapes_have_the_same_mean_and_differ_in_spread():
    uniform = data.draw_lengths("uniform", 40, 4000, random.Random(0))
    tail = data.draw_lengths("longtail", 40, 4000, random.Random(0))
    assert set(uniform) == {40}
    assert statistics.mean(tail) == pytest.approx(40, rel=0.1)
    assert statistics.median(tail) < 35 and max(tail) == 160 and min(tail) >= 4  # most short, a clipped long tail
    with pytest.raises(ValueError, match="shape"):
        data.draw_lengths("bimodal", 40, 10, random.Random(0))


def test_generated_rows_are_deterministic_and_in_trl_formats(tmp_path):
    path = data.write(tmp_path / "p.jsonl", "preference", "longtail", 5, 20, seed=3)
    again = data.write(tmp_path / "q.jsonl", "preference", "longtail", 5, 20, seed=3)
    assert path.read_text() == again.read_text()
    row = data.rows("preference", "uniform", 1, 20)[0]
    assert set(row) == {"prompt", "chosen", "rejected"}
    assert len(row["prompt"].split()) + len(row["chosen"].split()) == 20
    assert set(data.rows("sft", "uniform", 1, 20)[0]) == {"prompt", "completion"}


@pytest.mark.parametrize("name", ["tiny", "tiny-llama", "small"])
def test_linear_shapes_are_the_models_own_linear_layers(name):
    # the GEMM floor times exactly the products of the model's nn.Linear layers: same shapes, same count
    from transformers import AutoConfig, AutoModelForCausalLM

    config_dir = BENCH.parent / "assets" / "models" / name
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir))
    actual = sorted((m.in_features, m.out_features) for m in model.modules() if isinstance(m, torch.nn.Linear))
    expected = sorted(shape for i, o, count in harness.linear_shapes(config_dir) for shape in [(i, o)] * count)
    assert actual == expected


def test_gemm_floor_times_each_micro_batch(tmp_path):
    config_dir = BENCH.parent / "assets" / "models" / "tiny"
    one = harness.gemm_floor_seconds(config_dir, [16], repeats=1)
    assert one > 0
    assert harness.gemm_floor_seconds(config_dir, []) == 0.0


def test_unpaired_rows_alternate_labels_so_every_batch_holds_both_kinds():
    rows = data.rows("unpaired", "longtail", 6, 20, seed=1)
    assert [r["label"] for r in rows] == [True, False] * 3
    assert all(set(r) == {"prompt", "completion", "label"} and r["completion"].startswith(" ") for r in rows)
    assert [r["prompt"] for r in data.rows("unpaired", "longtail", 6, 20, seed=1)] == [r["prompt"] for r in rows]


def test_kto_parity_refuses_differing_rows_or_batches():
    # bench/kto.py compares final weights only once both sides saw the same token ids in the same batches
    kto = load("kto")
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    assert kto.unpadded(ids, mask) == [[5, 6, 7], [8, 9]]

    def side(kl_completion, batch_rows):
        return {"tokens": [([1], [2], [3]), ([4], [5], kl_completion)], "batches": [(batch_rows, [[1, 3]])]}

    same = side([2], [[1, 2], [4, 5]])
    assert kto.check_same_inputs(same, side([2], [[1, 2], [4, 5]]), "kto") == []
    assert kto.check_same_inputs(same, side([5], [[1, 2], [4, 5]]), "kto") == [
        "row 1: KL completion ids differ: lightalign [2], TRL [5]"]
    assert kto.check_same_inputs(same, side([5], [[1, 2], [4, 5]]), "apo_zero_unpaired") == []  # no KL term there
    assert kto.check_same_inputs(same, side([2], [[4, 5], [1, 2]]), "kto") == [
        "step 1: the batches' sequences differ"]


def test_kto_speed_flops_pair_each_row_with_the_previous_completion_of_its_batch(tmp_path):
    import argparse
    import json

    from transformers import AutoTokenizer

    kto_speed = load("kto_speed")
    model_dir = BENCH.parent / "assets" / "models" / "tiny"
    rows = [{"prompt": "the cat", "completion": " sat on the old mat today", "label": True},
            {"prompt": "a dog", "completion": " ran", "label": False}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = argparse.Namespace(model_dir=str(model_dir), data=str(path), warmup=0, steps=1, batch_size=2,
                              max_length=None, n_params=1000)
    tok = AutoTokenizer.from_pretrained(model_dir)
    n = lambda text: len(tok(text)["input_ids"]) + 1  # noqa: E731  (+ EOS)
    shape = harness.model_shape(model_dir)
    fwd = lambda ls: harness.forward_flops(1000, shape["layers"], shape["hidden"], ls)  # noqa: E731
    lengths = [n(r["prompt"] + r["completion"]) for r in rows]
    kl = [n(rows[0]["prompt"] + rows[1]["completion"]), n(rows[1]["prompt"] + rows[0]["completion"])]
    trained = harness.train_flops(1000, shape["layers"], shape["hidden"], lengths) + fwd(kl)
    assert kto_speed.window_flops(args, online=False) == pytest.approx(trained)
    assert kto_speed.window_flops(args, online=True) == pytest.approx(trained + fwd(lengths) + fwd(kl))


def test_rloo_flops_count_the_reference_and_old_policy_forwards_only_with_a_kl_penalty():
    import argparse

    rloo = load("rloo")
    model_dir = BENCH.parent / "assets" / "models" / "tiny"
    shape = harness.model_shape(model_dir)
    args = argparse.Namespace(model_dir=str(model_dir), n_params=1000, beta=0.0)
    fwd = harness.forward_flops(1000, shape["layers"], shape["hidden"], [10])
    train = harness.train_flops(1000, shape["layers"], shape["hidden"], [10])
    assert rloo.completion_flops(args, 4.0, 6.0) == pytest.approx(fwd + train)  # generation + training
    args.beta = 0.05
    assert rloo.completion_flops(args, 4.0, 6.0) == pytest.approx(3 * fwd + train)


def test_distill_bench_settings_ratios_and_rows(tmp_path):
    # bench/distill.py: every GKD setting for both frameworks by default, interleaved; a typo refused naming the
    # settings; each variant compared with TRL's same setting and with TRL's fastest; the same conversations in
    # lightalign's (prompt / completion messages) and TRL's (messages) format
    distill = load("distill")
    args = distill.build_parser().parse_args(["--precisions", "fp32"])
    distill.check(args)
    settings = ("lmbda0", "lmbda0.5", "lmbda1", "seq_kd")
    assert args.variants == [f"{fw}:{s}@fp32" for s in settings for fw in ("lightalign", "trl")]
    with pytest.raises(SystemExit, match=r"^--variants 'trl:lmbda2': use framework:setting .* "
                                         r"\['lmbda0', 'lmbda0.5', 'lmbda1', 'seq_kd'\]"):
        distill.check(distill.build_parser().parse_args(["--variants", "trl:lmbda2"]))
    for wrong in ("trl:lmbda1+compact", "trl:lmbda0+padding_free", "lightalign:lmbda0+unpadded"):
        with pytest.raises(SystemExit, match=rf"^--variants '{re.escape(wrong)}': a \+<backend> suffix is "
                                             r"lightalign's sampler, .*other \+<option> suffixes .*'padding_free'"):
            distill.check(distill.build_parser().parse_args(["--variants", wrong]))
    distill.check(distill.build_parser().parse_args(["--variants", "lightalign:lmbda1+generate",
                                                     "lightalign:lmbda0+padding_free+compact"]))

    def run(variant, steps):
        return {"variant": variant, "steps_per_sec": steps, "others_cpu_share": 0.0}

    runs = [run("lightalign:lmbda0", 4.0), run("lightalign:lmbda0", 6.0), run("trl:lmbda0", 2.0),
            run("lightalign:lmbda1", 1.0), run("trl:lmbda1", 0.5), run("lightalign:lmbda1+generate", 0.25),
            run("lightalign:lmbda0+padding_free+compact", 3.0)]
    result = distill.summarise({}, runs)
    assert result["trl_fastest"] == "trl:lmbda0"
    row = result["summary"]["lightalign:lmbda0"]
    assert row["steps_per_sec"] == 5.0 and row["vs_trl_same_setting"] == 2.5 and row["vs_trl_fastest"] == 2.5
    row = result["summary"]["lightalign:lmbda1"]
    assert row["vs_trl_same_setting"] == 2.0 and row["vs_trl_fastest"] == 0.5
    assert result["summary"]["lightalign:lmbda1+generate"]["vs_trl_same_setting"] == 0.5  # the suffix is the sampler
    assert result["summary"]["lightalign:lmbda0+padding_free+compact"]["vs_trl_same_setting"] == 1.5  # options

    args = distill.build_parser().parse_args(["--data", "english", "--steps", "2", "--warmup", "1"])
    args.workdir = str(tmp_path)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(BENCH.parent / "assets" / "models" / "tiny")
    rows = distill.write_data(args, tokenizer)
    la = [json.loads(line) for line in open(args.la_data)]
    trl = [json.loads(line) for line in open(args.trl_data)]
    assert len(rows) == len(la) == len(trl) == 256
    assert trl[0]["messages"] == la[0]["prompt"] + la[0]["completion"] == [
        {"role": "user", "content": rows[0]["prompt"]}, {"role": "assistant", "content": rows[0]["completion"]}]
    # completions fit --max-new-tokens rendered (DistillModule cuts longer ones, TRL does not): cut by words
    lengths = [len(tokenizer(r["completion"], add_special_tokens=False)["input_ids"]) + 2 for r in rows]
    assert max(lengths) <= args.max_new_tokens < max(lengths) + 4 and min(lengths) > 2


def test_online_dpo_bench_settings_ratios_and_prompts(tmp_path):
    # bench/online_dpo.py: both settings for both frameworks by default; a typo refused naming the settings; each
    # variant compared with TRL's same setting (a sampler suffix is lightalign's, not a setting); the same prompts for
    # both; `short` samples the demo's 8 tokens, `long` --max-new-tokens
    online = load("online_dpo")
    args = online.build_parser().parse_args(["--precisions", "fp32"])
    online.check(args)
    assert args.variants == [f"{fw}:{s}@fp32" for s in ("short", "long") for fw in ("lightalign", "trl")]
    with pytest.raises(SystemExit, match=r"^--variants 'trl:medium': use framework:setting .* \['short', 'long'\]"):
        online.check(online.build_parser().parse_args(["--variants", "trl:medium"]))
    with pytest.raises(SystemExit, match=r"^--variants 'trl:long\+compact': a \+<backend> suffix is lightalign's"):
        online.check(online.build_parser().parse_args(["--variants", "trl:long+compact"]))
    assert (online.new_tokens(args, "short"), online.new_tokens(args, "long")) == (8, 32)

    def run(variant, steps):
        return {"variant": variant, "steps_per_sec": steps, "others_cpu_share": 0.0}

    runs = [run("lightalign:short", 4.0), run("lightalign:short", 6.0), run("trl:short", 2.0),
            run("lightalign:long", 1.0), run("trl:long", 0.5), run("lightalign:long+generate", 0.25)]
    # model FLOPs of the window: per sequence its sampling forward, the policy's forward + backward, the reference's
    # forward (tiny: 1000 parameters assumed, 2 sequences of 5 and 7 tokens)
    flops_args = argparse.Namespace(model_dir=str(BENCH.parent / "assets" / "models" / "tiny"), n_params=1000)
    shape = harness.model_shape(flops_args.model_dir)
    assert online.window_flops(flops_args, [5, 7]) == pytest.approx(
        5 / 3 * harness.train_flops(1000, shape["layers"], shape["hidden"], [5, 7]))
    summary = online.summarise({}, runs)["summary"]
    assert summary["lightalign:short"]["steps_per_sec"] == 5.0
    assert summary["lightalign:short"]["vs_trl_same_setting"] == 2.5
    assert summary["lightalign:long"]["vs_trl_same_setting"] == 2.0
    assert summary["lightalign:long+generate"]["vs_trl_same_setting"] == 0.5

    args = online.build_parser().parse_args(["--data", "english", "--steps", "2", "--warmup", "1"])
    args.workdir = str(tmp_path)
    prompts = online.write_prompts(args)
    assert len(prompts) == 256 and len(set(prompts)) > 200
    assert [json.loads(line) for line in open(args.prompts)] == [{"prompt": p} for p in prompts]


def test_interleaved_runs_alternate_the_order_and_leave_out_failed_runs(capsys):
    # bench/harness.py's loop of the framework-against-framework benchmarks: the variants' order reversed on odd
    # repeats, each run numbered with its repeat, a failed run (None) left out, each finished one printed
    harness = load("harness")
    args = argparse.Namespace(repeats=2, variants=["lightalign:a", "trl:a", "lightalign:b"])
    calls = []

    def spawn_one(args, variant):
        calls.append(variant)
        return None if (variant, len(calls)) == ("trl:a", 5) else {"variant": variant}

    runs = harness.interleaved_runs(args, spawn_one, lambda res: f"ran {res['variant']}")
    assert calls == ["lightalign:a", "trl:a", "lightalign:b", "lightalign:b", "trl:a", "lightalign:a"]
    assert [(r["variant"], r["repeat"]) for r in runs] == [
        ("lightalign:a", 1), ("trl:a", 1), ("lightalign:b", 1), ("lightalign:b", 2), ("lightalign:a", 2)]
    assert capsys.readouterr().out.splitlines()[3] == "[2/2]           lightalign:b: ran lightalign:b"


def test_variant_names_carry_an_optional_precision():
    # framework:setting[+suffix...][@fp32|@bf16]; no @ reads as fp32; an unknown precision is refused naming both
    assert harness.parse_variant("lightalign:compact+padding_free@bf16") == {
        "framework": "lightalign", "setting": "compact", "suffixes": ["padding_free"], "precision": "bf16"}
    assert harness.parse_variant("trl:generate")["precision"] == "fp32"
    assert harness.split_precision("trl:short") == ("trl:short", None)
    with pytest.raises(SystemExit, match=r"'trl:short@fp16'.*\['fp32', 'bf16'\]"):
        harness.split_precision("trl:short@fp16")
    assert harness.trl_same_setting("lightalign:long+generate@bf16") == "trl:long@bf16"
    assert (harness.lightning_precision("bf16"), harness.lightning_precision("fp32")) == ("bf16-mixed", "32-true")
    assert (harness.trl_bf16("bf16"), harness.trl_bf16("fp32")) == (True, False)


def test_precisions_expand_the_variants_without_one_and_default_to_the_cpus_native_bf16():
    given = ["lightalign:a", "trl:a@bf16", "lightalign:b+x", "lightalign:a@fp32"]
    assert harness.expand_precisions(given, ["fp32", "bf16"]) == [
        "lightalign:a@fp32", "lightalign:a@bf16", "trl:a@bf16", "lightalign:b+x@fp32", "lightalign:b+x@bf16"]
    assert harness.expand_precisions(given, ["bf16"]) == ["lightalign:a@bf16", "trl:a@bf16", "lightalign:b+x@bf16",
                                                          "lightalign:a@fp32"]
    assert harness.default_precisions(frozenset({"avx512f", "amx_bf16"})) == ["fp32", "bf16"]
    assert harness.default_precisions(frozenset({"avx512f", "avx2"})) == ["fp32"]
    # the scripts' check expands too, and drops (with a note) what lightalign refuses by design: sampling ahead
    # (max_staleness > 0) under bf16-mixed
    args = argparse.Namespace(variants=["lightalign:a", "lightalign:a+async1", "trl:a"], precisions=["fp32", "bf16"],
                              warmup=1)
    harness.check_variants(args, ("a",), (), options=("async1",))
    assert args.variants == ["lightalign:a@fp32", "lightalign:a@bf16", "lightalign:a+async1@fp32", "trl:a@fp32",
                             "trl:a@bf16"]


def test_precision_report_efficiency_pairs_and_best_vs_best():
    # efficiency: each run's model FLOP/s over the matmul peak of its own dtype (fp32 10 GFLOP/s, bf16 40);
    # pairs: TRL at the same precision (same setting, and fastest); best vs best: over every precision
    peaks = {"fp32": 10e9, "bf16": 40e9}

    def run(variant, figure, flops, rss, pss):
        return {"variant": variant, "x": figure, "model_flops_per_sec": flops, "peak_rss_mb": rss, "peak_pss_mb": pss}

    runs = [run("lightalign:a@fp32", 3.0, 5e9, 100.0, 90.0), run("lightalign:a@fp32", 5.0, 5e9, 100.0, 90.0),
            run("lightalign:a@bf16", 6.0, 8e9, 120.0, 100.0), run("trl:a@fp32", 2.0, 2e9, 200.0, 150.0),
            run("trl:b@fp32", 10.0, 2e9, 240.0, 200.0), run("trl:a@bf16", 8.0, 4e9, 300.0, 200.0),
            run("trl:b@bf16", 1.0, 4e9, 300.0, 200.0)]
    report = harness.precision_report(runs, "x", peaks)
    rows = {r["variant"]: r for r in report["variants"]}
    assert rows["lightalign:a@fp32"]["x"] == 4.0  # median of the repeats
    assert rows["lightalign:a@fp32"]["efficiency"] == pytest.approx(0.5)  # 5e9 / fp32's 10e9
    assert rows["lightalign:a@bf16"]["efficiency"] == pytest.approx(0.2)  # 8e9 / bf16's 40e9
    pairs = {p["lightalign"]: p for p in report["pairs"]}
    assert (pairs["lightalign:a@fp32"]["trl_same_setting"], pairs["lightalign:a@fp32"]["vs_trl_same_setting"]) == (
        "trl:a@fp32", 2.0)
    assert (pairs["lightalign:a@fp32"]["trl_fastest"], pairs["lightalign:a@fp32"]["vs_trl_fastest"]) == (
        "trl:b@fp32", 0.4)
    assert (pairs["lightalign:a@bf16"]["trl_fastest"], pairs["lightalign:a@bf16"]["vs_trl_fastest"]) == (
        "trl:a@bf16", 0.75)
    # best vs best crosses precisions: lightalign's fastest is bf16, TRL's fp32
    best = report["best_vs_best"]
    assert (best["lightalign"], best["trl"], best["ratio"]) == ("lightalign:a@bf16", "trl:b@fp32", 0.6)
    assert (best["peak_rss_ratio"], best["peak_pss_ratio"]) == (0.5, 0.5)


def test_suite_reads_rows_and_targets_from_the_precision_reports():
    suite = load("suite")
    assert {"online_dpo", "distill"} <= set(suite.BENCHMARKS) and set(suite.SWEEP) == set(suite.BENCHMARKS)
    runs = [{"variant": v, "tokens_per_sec": t, "model_flops_per_sec": t * 1e6, "peak_rss_mb": 1.0,
             "peak_pss_mb": 1.0} for v, t in (("lightalign:padding_free@bf16", 100.0), ("trl:padding_free@bf16", 400.0),
                                              ("lightalign:padding_free@fp32", 300.0), ("trl:padding_free@fp32", 200.0),
                                              ("lightalign:padding@bf16", 500.0), ("trl:padding@bf16", 250.0))]
    report = harness.precision_report(runs, "tokens_per_sec", {"fp32": 1e9, "bf16": 4e9})
    rows = suite.rows_of("sft", report, "small", "longtail")
    assert [(r["variant"], r["unit"], r["figure"]) for r in rows][2:3] == [
        ("lightalign:padding_free@fp32", "tokens/s", 300.0)]
    checks = {t["target"].split(" >=")[0]: t["value"] for t in suite.targets(
        [{"benchmark": "sft", "model": "small", "shape": "longtail", "report": report}])}
    assert checks["sft lightalign best / TRL best"] == 1.25  # 500 over 400 (each side's fastest, both bf16)
    assert checks["sft lightalign padding_free / TRL padding_free"] == 1.5  # the fp32 pair, as the target was set
    assert checks["sft lightalign MFU"] == pytest.approx(0.3)  # 300e6 / the fp32 peak
