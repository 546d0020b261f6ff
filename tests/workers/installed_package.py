"""Run by tests/packaging/test_installed_wheel.py with the python of a fresh venv that holds lightalign installed from
its wheel (no editable install), in a working directory outside the repository: what a user who ran
``pip install lightalign-*.whl`` can do.

    python installed_package.py WORK_DIR REPO_DIR

1. ``import lightalign`` is the installed copy (under site-packages, not REPO_DIR), and every module of the installed
   package imports (a package folder left out of the wheel, or a module importing one, fails here by name).
2. Every public class of ``lightalign``'s ``__all__`` resolves, and each method trains two optimizer steps through the
   Python API on a tiny Qwen2 model this script builds (2 layers, hidden 32) from the shipped tokenizer, on the
   shipped example data read from the installed package: SFT, DPO, CPO, ORPO, TPO, KTO, reward, GRPO, RLOO, PPO,
   A2PO, SDFT, SDPO, online DPO, distillation, GOLD, iterative SFT; ``lightalign.Trainer`` writes its run folder; an untrained module exports.
3. The console script: ``lightalign examples DIR`` (the installed script, a process of its own); then, each in a
   child forked from this process once it imported the installed package (``fork_cli``: the script's ``main`` and
   ``sys.argv``, its exit status; no second import of torch, Lightning and transformers per run), ``lightalign fit
   --help`` and from DIR the shipped offline configs: one per data module and every config that reads another's
   export (``TRAINED``) two steps each, exiting 0; every other ``*_tiny``/``*_quickstart`` config parsed by the
   installed CLI (``--print_config``: its classes and knobs resolve in the installed package) with every file it
   names present in DIR. Each of those trains through the console script in the repository's own tests; here what
   can go wrong is only what the wheel ships. The console checks run before the methods train, so the children
   start from a process that has imported and trained nothing.

Prints one ``ok: ...`` line per check; any failure raises (exit status 1 with the traceback).
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import subprocess
import sys
import traceback
from pathlib import Path


def check_installed_copy(repo: Path) -> Path:
    import lightalign

    where = Path(lightalign.__file__).resolve().parent
    assert "site-packages" in where.parts, f"lightalign imported from {where}, not an installed package"
    assert repo.resolve() not in where.parents and where != repo.resolve(), f"{where} is the repository"
    names = [m.name for m in pkgutil.walk_packages([str(where)], prefix="lightalign.")]
    for name in names:
        importlib.import_module(name)
    print(f"ok: {len(names)} modules of the installed package import ({where})")
    return where


def check_public_names() -> None:
    import lightalign
    import lightalign.callbacks
    import lightalign.datamodules
    import lightalign.modules
    import lightalign.rewards

    for package in (lightalign, lightalign.modules, lightalign.datamodules, lightalign.callbacks, lightalign.rewards):
        for name in package.__all__:
            getattr(package, name)
    print(f"ok: every name of lightalign.__all__ ({len(lightalign.__all__)}) and of its subpackages' __all__ resolves")


def build_tiny_model(package: Path, out: Path) -> Path:
    """A 2-layer Qwen2 (hidden 32) with the shipped tokenizer, saved with random weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    shipped = package / "assets" / "models" / "tiny"
    config = AutoConfig.from_pretrained(shipped)
    config.update({"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "layer_types": ["full_attention"] * 2})
    if hasattr(config, "head_dim"):
        config.head_dim = 8
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(shipped).save_pretrained(out)
    return out


def fit_two_steps(module, data) -> None:
    import lightning as L

    trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0)
    trainer.fit(module, data)
    assert trainer.global_step == 2, f"{type(module).__name__}: {trainer.global_step} steps, not 2"
    print(f"ok: {type(module).__name__} trained 2 steps from the installed package", flush=True)


def check_methods(package: Path, model: Path, work: Path) -> None:
    import lightalign as la
    from lightalign.rewards import digit_fraction_reward

    data = package / "examples" / "data"
    m, short = str(model), dict(max_completion_length=4, learning_rate=1e-3)
    prompts = dict(path=str(data / "arithmetic_prompts.jsonl"), tokenizer=m, max_prompt_length=16)
    fit_two_steps(la.SFTModule(m, learning_rate=1e-3),
                  la.SFTDataModule(str(data / "arithmetic_sft.jsonl"), tokenizer=m, max_length=32, batch_size=4))
    preference = dict(path=str(data / "arithmetic_preference.jsonl"), tokenizer=m, max_length=32, batch_size=4)
    fit_two_steps(la.DPOModule(m, learning_rate=1e-3), la.PreferenceDataModule(**preference))
    for method in (la.CPOModule, la.ORPOModule):
        fit_two_steps(method(m, learning_rate=1e-3), la.PreferenceDataModule(**preference))
    fit_two_steps(la.RewardModule(m, learning_rate=1e-3), la.PreferenceDataModule(**preference, prompt_sharing=False))
    fit_two_steps(la.TPOModule(m, learning_rate=1e-3),
                  la.TriplePreferenceDataModule(**dict(preference, path=str(data / "arithmetic_tpo.jsonl"))))
    fit_two_steps(la.KTOModule(m, learning_rate=1e-3),
                  la.UnpairedPreferenceDataModule(str(data / "arithmetic_unpaired.jsonl"), tokenizer=m, max_length=32,
                                                  batch_size=4))
    online = dict(reward_funcs=[digit_fraction_reward], generation_batch_size=8, **short)
    fit_two_steps(la.GRPOModule(m, num_generations=4, **online), la.PromptDataModule(**prompts))
    fit_two_steps(la.RLOOModule(m, num_generations=4, **online), la.PromptDataModule(**prompts))
    fit_two_steps(la.PPOModule(m, num_generations=1, **online), la.PromptDataModule(**prompts))
    # A2PO estimates V* of every training prompt before training: 16 prompts (whose reference samples, on this
    # random model, almost all score 0: kept)
    first16 = __import__("datasets").load_dataset("json", data_files=prompts["path"], split="train[:16]")
    fit_two_steps(la.A2POModule(m, num_value_samples=2, filter_all_incorrect=False,
                                value_cache_dir=str(work / "a2po_values"), **online),
                  la.PromptDataModule(first16, tokenizer=m, max_prompt_length=16))
    fit_two_steps(la.OnlineDPOModule(m, reward_funcs=[digit_fraction_reward], **short),
                  la.PromptDataModule(**prompts, batch_size=4))
    fit_two_steps(la.DistillModule(m, teacher_model_name_or_path=m, lmbda=0.5, **short),
                  la.PromptDataModule(str(data / "arithmetic_sft.jsonl"), tokenizer=m, max_prompt_length=16,
                                      batch_size=4))
    other = str(package / "assets" / "models" / "tiny-bpe320")  # another tokenizer: the cross-tokenizer student
    fit_two_steps(la.GOLDModule(other, from_config=True, teacher_model_name_or_path=m, use_uld_loss=True, lmbda=0.5,
                                **short),
                  la.PromptDataModule(str(data / "arithmetic_sft.jsonl"), tokenizer=other, max_prompt_length=16,
                                      batch_size=4))
    fit_two_steps(la.SDFTModule(m, num_generations=2, generation_batch_size=4, **short),
                  la.PromptDataModule(str(data / "arithmetic_privileged.jsonl"), tokenizer=m, max_prompt_length=16))
    fit_two_steps(la.SDPOModule(m, num_generations=4, success_reward_threshold=0.0, **online), la.PromptDataModule(**prompts))
    iterative = la.IterativeSFT(m, learning_rate=1e-3, max_length=32, device="cpu")
    for _ in range(2):
        iterative.step(texts=["1+1=", "2+2="], texts_labels=["2", "4"])
    print("ok: IterativeSFT took 2 steps from the installed package")
    trainer = la.Trainer(accelerator="cpu", max_steps=2, name="wheel-sft", enable_progress_bar=False)
    trainer.fit(la.SFTModule(m, learning_rate=1e-3),
                la.SFTDataModule(str(data / "arithmetic_sft.jsonl"), tokenizer=m, max_length=32, batch_size=4))
    run = Path(trainer.run_dir)
    assert (run / "metrics.csv").is_file() and (run / "hf_model" / "config.json").is_file(), sorted(run.iterdir())
    print(f"ok: lightalign.Trainer wrote the run folder ({run}: metrics.csv, hf_model/)", flush=True)
    la.SFTModule(m).export_hf(work / "export", tokenizer=str(model))
    assert (work / "export" / "config.json").is_file()
    print("ok: export_hf wrote a Hugging Face folder")


# The configs trained two steps from the installed package: the teachers, then one per data module (SFT: the
# quickstart; pairs, triples, unpaired rows, prompts) and every config that reads a teacher's export (distillation,
# GOLD's other tokenizer, the tool policy).
TRAINED = (("quickstart.yaml", "tools_sft.yaml", "vlm_quickstart_sft.yaml"),
           ("dpo_tiny.yaml", "tpo_tiny.yaml", "kto_tiny.yaml", "grpo_quickstart.yaml", "distill_quickstart.yaml",
            "gold_quickstart.yaml", "tools_grpo.yaml", "vlm_quickstart_grpo.yaml", "vlm_distill_tiny.yaml"))
# What a config's value names when it is a shipped file or folder (relative to the folder `lightalign examples` fills)
SHIPPED_PREFIXES = ("assets/", "examples/", "configs/", "runs/")


def check_configs_parse(examples: Path, configs: list[str]) -> None:
    """Each config through the installed CLI's ``--print_config`` in one process (the classes and knob names it gives
    resolve in the installed package), and every shipped path among its values (``assets/...``, ``examples/...``, a
    teacher's ``runs/...`` export) present under ``examples``."""
    import contextlib
    import io

    import yaml

    from lightalign.cli import main as cli_main

    def strings(node):
        if isinstance(node, dict):
            for value in node.values():
                yield from strings(value)
        elif isinstance(node, list):
            for value in node:
                yield from strings(value)
        elif isinstance(node, str):
            yield node

    here = os.getcwd()
    os.chdir(examples)
    try:
        for config in configs:
            out = io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
                try:
                    status = cli_main(["fit", "--config", f"configs/{config}", "--print_config"])
                except SystemExit as stop:
                    status = stop.code
            assert status in (0, None), f"lightalign fit --config configs/{config} --print_config exited {status}"
            parsed = yaml.safe_load(out.getvalue())
            missing = [s for s in strings(parsed) if s.startswith(SHIPPED_PREFIXES) and not Path(s).exists()]
            assert not missing, f"configs/{config} names files `lightalign examples` did not copy: {missing}"
    finally:
        os.chdir(here)


def fork_cli(args: list[str], cwd: Path, log: Path) -> int:
    """``lightalign *args`` run in a child forked from this process, which imported the installed package and its
    libraries once (``check_installed_copy``) and has trained nothing yet: the child does what the console script
    does (``sys.argv`` the script's, ``lightalign.cli.main``'s status as its exit status), its output in ``log``.
    Returns the child's pid (``run_forked`` waits for it): forked, a config's run costs its fit, not another import of torch,
    Lightning and transformers."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    status = 1
    try:
        out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.chdir(cwd)
        sys.argv = [str(Path(sys.executable).with_name("lightalign")), *args]
        from lightalign.cli import main as cli_main

        try:
            status = cli_main()
        except SystemExit as stop:  # --help, and LightningCLI's own exits
            status = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def run_forked(runs: list[tuple[list[str], Path]], logs: Path, at_once: int = 2) -> list[tuple[str, float]]:
    """Each ``(args, cwd)`` of ``runs`` through ``fork_cli``, ``at_once`` children at a time (one torch thread each);
    any non-zero exit raises with the end of that child's output. Returns each run's output and CPU seconds, in
    order."""
    logs.mkdir(parents=True, exist_ok=True)
    todo, running, done = list(enumerate(runs)), {}, {}
    while todo or running:
        while todo and len(running) < at_once:
            i, (args, cwd) = todo.pop(0)
            running[fork_cli(args, cwd, logs / f"{i}.log")] = i
        pid, status, usage = os.wait4(-1, 0)
        i = running.pop(pid)
        out = (logs / f"{i}.log").read_text()
        code = os.waitstatus_to_exitcode(status)
        assert code == 0, f"lightalign {' '.join(runs[i][0])} exited {code}:\n{out[-4000:]}"
        done[i] = out, usage.ru_utime + usage.ru_stime
    return [done[i] for i in range(len(runs))]


def check_console(work: Path) -> None:
    """The console script itself once (``lightalign examples DIR``, a process of its own); then ``fit --help`` and
    the shipped configs (``TRAINED``: two steps each, in two waves, teachers first) through ``fork_cli``, and the
    other configs parsed (``check_configs_parse``)."""
    script = Path(sys.executable).with_name("lightalign")
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    examples = work / "lightalign-examples"
    done = subprocess.run([str(script), "examples", str(examples)], cwd=work, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0 and "configs/quickstart.yaml" in done.stdout + done.stderr, done.stderr[-4000:]
    print("ok: lightalign examples (the installed console script)")
    import gc

    gc.collect()
    gc.freeze()  # what this process imported stays shared with the children: their collector does not copy it
    ((help_text, _),) = run_forked([(["fit", "--help"], work)], work / "logs" / "help")
    assert "--model.help" in help_text
    print("ok: lightalign fit --help")
    two = ["--trainer.max_steps", "2", "--trainer.limit_val_batches", "0", "--plot.enabled", "false"]
    shipped = sorted(p.name for p in (examples / "configs").glob("*.yaml")
                     if p.stem.endswith(("_tiny", "_quickstart")) or p.stem.startswith(("tools_", "vlm_quickstart_")))
    assert set(TRAINED[0] + TRAINED[1]) <= {*shipped, "quickstart.yaml"}, "a config of TRAINED is not shipped"
    for wave, configs in enumerate(TRAINED):  # the teachers, then the configs that read their exports
        runs = run_forked([(["fit", "--config", f"configs/{config}", *two], examples) for config in configs],
                          work / "logs" / f"wave{wave}")
        for config, (_, cpu) in zip(configs, runs):
            print(f"ok: lightalign fit --config configs/{config} (2 steps, from `lightalign examples`; {cpu:.1f} s "
                  "of CPU)")
    parsed = [c for c in shipped if c not in TRAINED[0] + TRAINED[1]]
    check_configs_parse(examples, parsed)
    print(f"ok: {len(parsed)} more shipped configs parse in the installed CLI and name only shipped files: "
          + ", ".join(parsed))
    assert (examples / "runs" / "quickstart" / "version_0" / "hf_model" / "config.json").is_file()


def main(work: Path, repo: Path) -> None:
    work.mkdir(parents=True, exist_ok=True)
    package = check_installed_copy(repo)
    check_public_names()
    check_console(work)  # first: its children are forked from a process that has imported, not yet trained
    model = build_tiny_model(package, work / "tiny")
    check_methods(package, model, work)
    print("ok: all")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
