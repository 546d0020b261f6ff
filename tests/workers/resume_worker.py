"""Run a small SFT/DPO/CPO/ORPO/TPO/GRPO/SDFT/SDPO/A2PO training as a separate process, optionally SIGKILLed at a
step, optionally resumed.

Used by tests/training/test_resume.py:  python tests/workers/resume_worker.py --method sft --out DIR --max-steps 14 --every 4
                                 [--kill-at 10 | --kill-at-validation 8] [--resume] [--devices 2]
                                 [--val-every 4] [--continue-log] [--precision bf16-mixed]
Everything that draws from the torch RNG during training is on: attention dropout 0.1 (the tiny model's config,
copied to DIR/model), NEFTune noise (SFT), sampling and a reward with variance (GRPO, with running reward
normalisation). Writes DIR/init.pt (the policy's weights when training first starts) and DIR/final.pt (weights
and optimizer state at the end, rank 0) and logs to DIR/logs/version_<--log-version>/metrics.csv. With
--continue-log every launch logs to that one folder as a run folder is continued (``runs.continue_metrics_csv`` on
resume, every row flushed at once, so a kill loses none) and GRPO's sample table goes to completions.csv beside it
(``CompletionSamples`` every step). Checkpoints are the CLI's ``RunCheckpoint`` (every --every steps, last.ckpt).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
from pathlib import Path

import lightning as L
import torch
from datasets import Dataset
from lightning.pytorch.loggers import CSVLogger

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "assets" / "models" / "tiny")
DATA = REPO / "examples" / "data"
sys.path.insert(0, str(REPO / "tests"))  # helpers/


class KillAt(L.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            os.killpg(os.getpgid(0), signal.SIGKILL)  # every rank: the launching process leads its own session


class KillAtValidation(L.Callback):
    """SIGKILL as the validation after optimizer step ``step`` starts: after that step's batch end, where Lightning's
    ModelCheckpoint writes its checkpoints, before the validation logs anything."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_validation_start(self, trainer, pl_module):
        if trainer.global_step == self.step and not trainer.sanity_checking:
            os.killpg(os.getpgid(0), signal.SIGKILL)


class DyingCheckpointIO:
    """Wraps AtomicCheckpointIO: at the save of step ``die_at``, write half the bytes, then SIGKILL."""

    @staticmethod
    def make(die_at: int):
        import io

        from lightalign.strategies import AtomicCheckpointIO

        class Dying(AtomicCheckpointIO):
            def save_checkpoint(self, checkpoint, path, storage_options=None):
                if checkpoint["global_step"] == die_at:
                    buffer = io.BytesIO()
                    torch.save(checkpoint, buffer)
                    data = buffer.getvalue()

                    def half_then_die(obj, f):
                        f.write(data[: len(data) // 2])
                        f.flush()
                        os.kill(os.getpid(), signal.SIGKILL)

                    torch.save = half_then_die
                super().save_checkpoint(checkpoint, path, storage_options)

        return Dying()


class SaveInit(L.Callback):
    """The policy's weights when training first starts (so a test can check that they moved)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_start(self, trainer, pl_module):
        if trainer.is_global_zero and not self.path.exists():
            torch.save({k: v.clone() for k, v in pl_module.model.state_dict().items()}, self.path)


def varied_reward(prompts, completions, completion_ids, **kwargs):
    """A reward with variance inside every group (the digit reward of an untrained model is 0 almost always)."""
    return [float(sum(ids) % 7) for ids in completion_ids]


def tiny_with_dropout(out: Path, source: str = TINY) -> str:
    """The tiny model's folder (or ``source``) with attention dropout 0.1 (its config has none)."""
    folder = out / "model"
    if not folder.exists():
        shutil.copytree(source, folder)
        config = json.loads((folder / "config.json").read_text())
        config["attention_dropout"] = 0.1
        (folder / "config.json").write_text(json.dumps(config, indent=2))
    return str(folder)


def rows(name: str, n: int) -> Dataset:
    lines = (DATA / name).read_text().splitlines()[:n]
    return Dataset.from_list([json.loads(line) for line in lines])


def build(method: str, model: str, devices: int, prompts_per_rank: int = 4, validate: bool = False,
          out: Path | None = None):
    from lightalign import DPOModule, GRPOModule, PreferenceDataModule, PromptDataModule, SFTDataModule, SFTModule
    from lightalign import TPOModule, TriplePreferenceDataModule

    common = dict(from_config=True, learning_rate=3e-3, lr_scheduler_type="cosine", warmup_steps=2)
    if method == "sft":
        return (SFTModule(model, neftune_noise_alpha=5.0, **common),
                SFTDataModule(rows("arithmetic_sft.jsonl", 44), tokenizer=TINY, batch_size=4, max_length=32), 2)
    if method == "dpo":
        # dropout kept on (DPO's default turns it off); TR-DPO reference syncs every 2 steps, so a resume restores a
        # reference that is no longer the initial policy
        return (DPOModule(model, disable_dropout=False, sync_ref_model=True, ref_model_mixup_alpha=0.5,
                          ref_model_sync_steps=2, **common),
                PreferenceDataModule(rows("arithmetic_preference.jsonl", 44), tokenizer=TINY, batch_size=4), 2)
    if method in ("cpo", "orpo"):
        # no reference; dropout kept on (their default turns it off), so a resume restores every rank's RNG;
        # 12 pairs per rank in batches of 4: 3 steps per epoch
        from lightalign import CPOModule, ORPOModule

        module = (CPOModule(model, loss_type="simpo", disable_dropout=False, **common) if method == "cpo"
                  else ORPOModule(model, disable_dropout=False, **common))
        return module, PreferenceDataModule(rows("arithmetic_preference.jsonl", 12 * devices), tokenizer=TINY,
                                            batch_size=4), 1
    if method == "tpo":
        # dropout kept on (TPO's default turns it off); each rank its own triples, 2 per micro-batch
        return (TPOModule(model, disable_dropout=False, loss_type="tpo-l", **common),
                TriplePreferenceDataModule(rows("arithmetic_tpo.jsonl", 8 * devices), tokenizer=TINY, batch_size=2), 1)
    if method == "dpo_bema":
        # the reference is TRL's BEMA of the policy: theta_0 taken after step 1, the average renewed at steps 3 and
        # 5, copied into the reference every step; 12 rows per rank in pairs, 3 steps per epoch
        return (DPOModule(model, disable_dropout=False, update_ref_model=True, update_after=1, update_freq=2,
                          ref_model_update_freq=1, **common),
                PreferenceDataModule(rows("arithmetic_preference.jsonl", 12 * devices), tokenizer=TINY,
                                     batch_size=2), 2)
    if method == "grpo":
        # a rollout (2 prompts x 4 completions) serves 4 steps (2 micro-batches x 2 iterations); 4 prompts per
        # rank (--prompts-per-rank): 2 rollouts, 8 steps per epoch. The adaptive entropy coefficient rises every step (entropy < target):
        # its controller state must resume too
        module = GRPOModule(model, reward_funcs=[varied_reward], num_generations=4, generation_batch_size=8,
                            steps_per_generation=2, num_iterations=2, max_completion_length=6,
                            normalize_rewards=True, scale_rewards="none", use_adaptive_entropy=True,
                            entropy_coef=0.01, entropy_coef_delta=0.01, entropy_target=100.0, **common)
        val = dict(val_path=rows("arithmetic_prompts.jsonl", 2), batch_size=2) if validate else {}
        return module, PromptDataModule(rows("arithmetic_prompts.jsonl", prompts_per_rank * devices), tokenizer=TINY,
                                        **val), 1
    if method == "grpo_bema":
        # the GRPO case's knobs with a KL term (beta 0.04: a reference is built) whose reference is TRL's BEMA of
        # the policy: theta_0 after step 1, the average renewed every 2 steps, copied into the reference every step
        module = GRPOModule(model, reward_funcs=[varied_reward], num_generations=4, generation_batch_size=8,
                            steps_per_generation=2, num_iterations=2, max_completion_length=6, beta=0.04,
                            update_ref_model=True, update_after=1, update_freq=2, ref_model_update_freq=1,
                            normalize_rewards=True, scale_rewards="none", **common)
        return module, PromptDataModule(rows("arithmetic_prompts.jsonl", prompts_per_rank * devices), tokenizer=TINY), 1
    if method == "grpo_async":
        # the GRPO case's knobs, sampled one rollout ahead (a rollout trains 4 optimizer steps: max_staleness 4) by
        # a sampling process per rank: a checkpoint inside a rollout holds the next one, sampled or in flight
        module = GRPOModule(model, reward_funcs=[varied_reward], num_generations=4, generation_batch_size=8,
                            steps_per_generation=2, num_iterations=2, max_completion_length=6, max_staleness=4,
                            normalize_rewards=True, scale_rewards="none", use_adaptive_entropy=True,
                            entropy_coef=0.01, entropy_coef_delta=0.01, entropy_target=100.0, **common)
        return module, PromptDataModule(rows("arithmetic_prompts.jsonl", prompts_per_rank * devices), tokenizer=TINY), 1
    if method == "grpo_tools":
        # the GRPO case's knobs, with tools, on the tiny model: every trajectory's first turn is the scripted tool
        # call (tests/helpers/scripted_turns.py: given ids, not a draw), every later turn is sampled after the tool's
        # result at temperature 1, drawing from the RNG: multi-turn rollouts by construction
        from transformers import AutoTokenizer

        from helpers.scripted_turns import ScriptedTurns
        from helpers.tool_policy import QUESTION, calculate, call_turn_ids

        ScriptedTurns([call_turn_ids(AutoTokenizer.from_pretrained(model))]).install(setattr)
        module = GRPOModule(model, tools=[calculate], reward_funcs=[varied_reward], num_generations=4,
                            generation_batch_size=8, steps_per_generation=2, num_iterations=2,
                            max_completion_length=160, normalize_rewards=True, scale_rewards="none",
                            use_adaptive_entropy=True, entropy_coef=0.01, entropy_coef_delta=0.01,
                            entropy_target=100.0, **common)
        prompts = Dataset.from_list([{"prompt": QUESTION, "answer": "6"}] * (prompts_per_rank * devices))
        return module, PromptDataModule(prompts, tokenizer=model, max_prompt_length=256), 1
    if method == "sdft":
        # 2 prompts x 2 completions per step, 8 prompts: 4 steps per epoch; dropout kept on; an EMA teacher (rate
        # 0.5 every step) that a resume must restore
        from lightalign import SDFTModule

        module = SDFTModule(model, num_generations=2, generation_batch_size=4, max_completion_length=6,
                            disable_dropout=False, teacher_model_kind="ema", teacher_update_rate=0.5, **common)
        return module, PromptDataModule(rows("arithmetic_privileged.jsonl", 8 * devices), tokenizer=TINY), 1
    if method == "sdpo":
        # the GRPO case's rollout schedule, its prompts shared by the ranks: a rollout of 2 prompts x 4 in all (each
        # of D ranks 2/D of them, --prompts-per-rank prompts per epoch) serves 4 steps (sampling log-probs, so the
        # clipped importance weight acts); a reward with successes in most groups (>= 3 of 0..6), half policy
        # gradient, half top-k self-distillation towards an EMA teacher (rate 0.5) that a resume must restore
        from lightalign import SDPOModule

        module = SDPOModule(model, reward_funcs=[varied_reward], num_generations=4, generation_batch_size=8 // devices,
                            steps_per_generation=2, num_iterations=2, max_completion_length=6, disable_dropout=False,
                            success_reward_threshold=3.0, distillation_weight=0.5, distillation_mode="topk_logits",
                            distillation_topk=8, distillation_alpha=0.5, teacher_update_rate=0.5, **common)
        return module, PromptDataModule(rows("arithmetic_prompts.jsonl", prompts_per_rank * devices), tokenizer=TINY), 1
    if method == "a2po":
        # A*-PO: V* of every prompt from 2 reference samples each (chunks of 2 prompts, sharded over the ranks, cached
        # in DIR/values), then a rollout (2 prompts x 1 completion) serves 4 steps (2 micro-batches x 2 iterations);
        # 4 prompts per rank: 2 rollouts, 8 steps per epoch
        from lightalign import A2POModule

        module = A2POModule(model, reward_funcs=[varied_reward], generation_batch_size=2,
                            steps_per_generation=2, num_iterations=2, num_value_samples=2, max_completion_length=6,
                            beta2=0.1, filter_all_incorrect=False, value_cache_dir=str(out / "values"), **common)
        return module, PromptDataModule(rows("arithmetic_prompts.jsonl", prompts_per_rank * devices), tokenizer=TINY), 1
    raise SystemExit(f"unknown method {method}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--method", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--every", type=int, required=True)
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--kill-at-validation", type=int, help="SIGKILL as the validation after this step starts")
    parser.add_argument("--val-every", type=int, help="validate every N training batches (GRPO: 2 prompts, 1 batch)")
    parser.add_argument("--continue-log", action="store_true", help="one metrics.csv, continued on resume")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--die-during-save", type=int)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--log-version", type=int, default=0, help="CSVLogger version (one per process run)")
    parser.add_argument("--model", default=TINY, help="the model folder to start from (copied, with dropout)")
    parser.add_argument("--prompts-per-rank", type=int, default=4, help="GRPO: prompts per rank and epoch")
    parser.add_argument("--precision", default="32-true", help="the Trainer's precision (e.g. bf16-mixed)")
    args = parser.parse_args()
    if "LOCAL_RANK" not in os.environ and os.getpgid(0) != os.getpid():
        # the launching process (not a rank started by others), forked from the tests' console server or started
        # in the caller's group: a session of its own, so that KillAt's killpg takes every rank and sampling
        # process it starts, and nothing else
        os.setsid()
    from helpers.fork_ranks import fork_ranks
    from lightalign.callbacks import CompletionSamples, RunCheckpoint
    from lightalign.runs import continue_metrics_csv

    out = Path(args.out)
    model = tiny_with_dropout(out, args.model)  # written once, before the other ranks start
    fork_ranks(args.devices)  # the other ranks forked from this process (tests/helpers/fork_ranks.py)
    torch.set_num_threads(1)
    L.seed_everything(1234)
    module, data, accumulate = build(args.method, model, args.devices, args.prompts_per_rank, bool(args.val_every),
                                     out)
    callbacks = [SaveInit(out / "init.pt"),
                 RunCheckpoint(dirpath=out / "ckpt", every_n_train_steps=args.every, save_last=True, save_top_k=-1)]
    if args.kill_at:
        callbacks.insert(0, KillAt(args.kill_at))
    if args.kill_at_validation:
        callbacks.insert(0, KillAtValidation(args.kill_at_validation))
    logger = CSVLogger(out, name="logs", version=args.log_version,
                       **({"flush_logs_every_n_steps": 1} if args.continue_log else {}))
    if args.continue_log:
        callbacks.append(CompletionSamples(every_n_steps=1))
        if args.resume and int(os.environ.get("LOCAL_RANK", "0")) == 0:  # as run_fit.prepare_resume does for a run
            continue_metrics_csv(logger, torch.load(out / "ckpt" / "last.ckpt", weights_only=True)["global_step"])
    validation = dict(val_check_interval=args.val_every, limit_val_batches=1) if args.val_every else {}
    plugins = [DyingCheckpointIO.make(args.die_during_save)] if args.die_during_save else None
    ddp = {"strategy": "ddp", "devices": args.devices} if args.devices > 1 else {}
    trainer = L.Trainer(accelerator="cpu", precision=args.precision, max_steps=args.max_steps, accumulate_grad_batches=accumulate, plugins=plugins, **ddp,
                        callbacks=callbacks, logger=logger, log_every_n_steps=1, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, **validation)
    trainer.fit(module, data, ckpt_path="last" if args.resume else None)
    if trainer.is_global_zero:
        reference = getattr(module, "ref_model", None)
        torch.save({"model": module.model.state_dict(), "optimizer": trainer.optimizers[0].state_dict(),
                    "reference": reference.state_dict() if reference is not None else None,
                    "bema": next((c.state_dict() for c in trainer.callbacks if type(c).__name__ == "BEMAReference"),
                                 None), "precision": trainer.precision}, out / "final.pt")
    print("DONE", trainer.global_step, file=sys.stderr)


if __name__ == "__main__":
    main()
