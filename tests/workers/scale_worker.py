"""Train SFT, DPO, GRPO, PPO, distillation (GKD, or GOLD across tokenizers) or online DPO for a few steps under one strategy and dump the weights (used
by tests/strategies/test_scale.py).

python tests/workers/scale_worker.py --strategy ddp --devices 2 --out DIR [--methods sft,dpo,grpo] [--batch-mult 2]
    [--resume-check [STRATEGY ...]] [--fail-at-step N --fail-mode exit|hang --timeout-s S] [--batched-sampling]
Writes DIR/<method>_rank<r>.pt (each rank's own view: replicated strategies) and, from rank 0, DIR/<method>.pt
(the full weights: gathered under sharding), DIR/<method>_init.pt (before training) and DIR/<method>_hf (the HF
export), DIR/<method>_frozen_rank<r>.pt (each rank's frozen reference or teacher after training) and
DIR/<method>_ref.json (where it ended up); with --resume-check, DIR/ckpt_<STRATEGY>/ and DIR/sft_resumed_<STRATEGY>.pt.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import lightning as L
import torch
from datasets import Dataset
from lightning.pytorch.callbacks import ModelCheckpoint

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))  # helpers
TINY = str(REPO / "assets" / "models" / "tiny")
BPE320 = str(REPO / "assets" / "models" / "tiny-bpe320")  # another tokenizer (GOLD's student)
DATA = REPO / "examples" / "data"


def rows(name: str, n: int) -> Dataset:
    return Dataset.from_list([json.loads(line) for line in (DATA / name).read_text().splitlines()[:n]])


def completion_chars(prompts, completions, **columns):
    """A reward that varies inside every group of an untrained model's completions (so advantages are not 0)."""
    return [len(c) / 10 for c in completions]


class SaveInitial(L.Callback):
    """Rank 0 writes the full weights at the start of training (to check that training moved them)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_start(self, trainer, pl_module) -> None:
        from lightalign.strategies import full_state_dict

        weights = trained_weights(pl_module, full_state_dict(pl_module.model, root=trainer.strategy.model))
        if trainer.is_global_zero:
            torch.save(weights, self.path)


def trained_weights(module, full: dict | None) -> dict:
    """The policy's full weights, and PPO's value head under ``value_head.`` (whole: gathered when sharded, so every
    rank calls this)."""
    weights = dict(full if full is not None else module.model.state_dict())
    if getattr(module, "value_model", None) is not None:  # (replicated strategies only)
        weights.update({f"value_model.{k}": v.detach().clone() for k, v in module.value_model.state_dict().items()})
    head = getattr(module, "value_head", None)
    if head is not None:
        weights.update({f"value_head.summary.{k}": v for k, v in head.whole_tensors().items()})
    return weights


MAX_NEW = 6


def equal_length_prompts(n: int, tokenizers: tuple[str, ...] = (TINY,)) -> Dataset:
    """Prompts of one token length under each of ``tokenizers``: no padding, so a prompt's log-probs do not depend
    on its batch-mates (GOLD: the student's, and the teacher's re-tokenisation)."""
    from transformers import AutoTokenizer

    toks = [AutoTokenizer.from_pretrained(t) for t in tokenizers]
    data = rows("arithmetic_prompts.jsonl", 200)
    return data.filter(lambda r: all(len(tok(r["prompt"])["input_ids"]) == 6 for tok in toks)).select(range(n))


def seeded_grpo_class(base=None):
    """GRPOModule whose sampling depends only on (prompt, step), not on which rank or batch the prompt is in:
    one seeded ``generate`` per prompt, completions right-padded to ``max_completion_length``. With it, 2 ranks x 2
    prompts and 1 process x 4 prompts sample the same completions, so their updates can be compared."""
    import zlib

    from lightalign import GRPOModule

    class SeededGRPO(base or GRPOModule):
        def generate(self, batch, num_generations):
            parts = []
            for i, prompt in enumerate(batch["prompts"]):
                one = {"prompt_input_ids": batch["prompt_input_ids"][i:i + 1],
                       "prompt_attention_mask": batch["prompt_attention_mask"][i:i + 1], "prompts": [prompt],
                       "columns": {k: [v[i]] for k, v in batch["columns"].items()}}
                torch.manual_seed(zlib.crc32(str(prompt).encode()) + 1000 * self.global_step)
                part = super().generate(one, num_generations)
                short = MAX_NEW - part["completion_ids"].shape[1]
                part["completion_ids"] = torch.nn.functional.pad(part["completion_ids"], (0, short),
                                                                 value=self.tokenizer.pad_token_id)
                part["completion_mask"] = torch.nn.functional.pad(part["completion_mask"], (0, short), value=0)
                parts.append(part)
            merged = {k: torch.cat([p[k] for p in parts]) if torch.is_tensor(parts[0][k]) else
                      sum((p[k] for p in parts), []) for k in parts[0] if k != "columns"}
            merged["columns"] = {k: sum((p["columns"][k] for p in parts), []) for k in parts[0]["columns"]}
            return merged

    return SeededGRPO


def pad_to_max_new(part: dict, pad_token_id: int) -> dict:
    """A one-prompt sample's completions right-padded to ``MAX_NEW`` tokens (mask 0): every layout's rows alike."""
    short = MAX_NEW - part["completion_ids"].shape[1]
    part["completion_ids"] = torch.nn.functional.pad(part["completion_ids"], (0, short), value=pad_token_id)
    part["completion_mask"] = torch.nn.functional.pad(part["completion_mask"], (0, short), value=0)
    return part


def seeded_per_prompt(sample, batch: dict, step: int, pad_token_id: int) -> dict:
    """``sample(one_prompt_batch)`` once per prompt of ``batch``, seeded by (prompt, step) as in ``seeded_grpo_class``,
    the parts merged (tensors concatenated, lists joined)."""
    import zlib

    parts = []
    for i, prompt in enumerate(batch["prompts"]):
        one = {"prompt_input_ids": batch["prompt_input_ids"][i:i + 1],
               "prompt_attention_mask": batch["prompt_attention_mask"][i:i + 1], "prompts": [prompt],
               "columns": {k: [v[i]] for k, v in batch["columns"].items()}}
        torch.manual_seed(zlib.crc32(str(prompt).encode()) + 1000 * step)
        parts.append(pad_to_max_new(sample(one), pad_token_id))
    merged = {k: torch.cat([p[k] for p in parts]) if torch.is_tensor(parts[0][k]) else
              sum((p[k] for p in parts), []) for k in parts[0] if k != "columns"}
    if "columns" in parts[0]:
        merged["columns"] = {k: sum((p["columns"][k] for p in parts), []) for k in parts[0]["columns"]}
    return merged


def seeded_distill_class(base=None):
    """DistillModule (or ``base``, a subclass) whose student samples one seeded ``generate`` per prompt
    (``seeded_per_prompt``)."""
    from lightalign import DistillModule

    class SeededDistill(base or DistillModule):
        def sample(self, who, batch):
            return seeded_per_prompt(lambda one: super(SeededDistill, self).sample(who, one), batch, self.global_step,
                                     self.tokenizer.pad_token_id)

    return SeededDistill


def seeded_online_dpo_class():
    """OnlineDPOModule whose pairs are one seeded ``generate`` per prompt (``seeded_per_prompt``)."""
    from lightalign import OnlineDPOModule

    class SeededOnlineDPO(OnlineDPOModule):
        def sample_pairs(self, batch):
            return seeded_per_prompt(super().sample_pairs, batch, self.global_step, self.tokenizer.pad_token_id)

    return SeededOnlineDPO


def write_teacher(out: Path, name: str = "teacher", initializer_range: float | None = None) -> None:
    """The distillation teacher, ``DIR/<name>``: the tiny model with seeded random weights (``initializer_range``:
    the config's, or this). Written by the launching process before it forks the other ranks (``fork_ranks``)."""
    import shutil

    from lightalign.hub import load_causal_lm

    shutil.copytree(TINY, out / name, dirs_exist_ok=True)
    if initializer_range is not None:
        config = json.loads((out / name / "config.json").read_text())
        (out / name / "config.json").write_text(json.dumps(dict(config, initializer_range=initializer_range)))
    torch.manual_seed(7)
    load_causal_lm(str(out / name), from_config=True).save_pretrained(out / name)


def build(method: str, mult: int, seeded: bool = True, out: Path | None = None):
    from lightalign import DPOModule, GRPOModule, PreferenceDataModule, PromptDataModule, SFTDataModule, SFTModule

    # SGD: the update is linear in the gradient, so float noise stays noise (Adam's first steps turn a gradient
    # of 1e-9 into a full-size update of either sign). Momentum gives the optimizer a state that a resumed run
    # must restore (and FSDP v1's sharded checkpoint cannot reload a stateless optimizer: no "state" is written).
    common = dict(from_config=True, optimizer=lambda params: torch.optim.SGD(params, lr=0.5, momentum=0.9),
                  lr_scheduler_type="constant")
    # one process vs two: the default backend is compact alone and generate with several processes, so both name one
    sampled = dict(generation_backend="generate")
    if method == "sft":
        return SFTModule(TINY, **common), SFTDataModule(rows("arithmetic_sft.jsonl", 32), tokenizer=TINY,
                                                        batch_size=4 * mult, max_length=32)
    if method == "dpo":
        return DPOModule(TINY, **common), PreferenceDataModule(rows("arithmetic_preference.jsonl", 32), tokenizer=TINY,
                                                               batch_size=4 * mult)
    if method == "grpo":  # beta > 0: a frozen reference next to the policy
        module = (seeded_grpo_class() if seeded else GRPOModule)(TINY, reward_funcs=[completion_chars], num_generations=4, beta=0.1,
                                     generation_batch_size=8 * mult, max_completion_length=MAX_NEW, **sampled,
                                     **common)
        return module, PromptDataModule(equal_length_prompts(16), tokenizer=TINY)
    if method in ("ppo", "ppo_vm"):  # a reference (kl_coef > 0), the value head, advantages whitened over every
        from lightalign import PPOModule  # rank's tokens; ppo_vm: the head on a separate value model

        separate = {"value_model_name_or_path": TINY} if method == "ppo_vm" else {}
        module = (seeded_grpo_class(PPOModule) if seeded else PPOModule)(TINY, reward_funcs=[completion_chars], num_generations=2, kl_coef=0.1,
                                              generation_batch_size=8 * mult, max_completion_length=MAX_NEW,
                                              num_ppo_epochs=1, **separate, **sampled, **common)
        return module, PromptDataModule(equal_length_prompts(16), tokenizer=TINY)
    if method == "distill":  # a teacher from a folder, placed as the reference is; the student samples every batch
        from lightalign import DistillModule  # (lmbda 1), min_new_tokens: equal token counts on every rank

        module = (seeded_distill_class() if seeded else DistillModule)(
            TINY, teacher_model_name_or_path=str(out / "teacher"), lmbda=1.0, max_completion_length=MAX_NEW,
            generation_kwargs={"min_new_tokens": MAX_NEW}, **sampled, **common)
        return module, PromptDataModule(equal_length_prompts(16), tokenizer=TINY, batch_size=2 * mult)
    if method == "gold":  # distill's case across tokenizers: the student is tiny-bpe320 (320 tokens), the teacher
        from lightalign import GOLDModule  # the seeded tiny model (1024 tokens; peaked: gold_teacher); the ULD loss

        # with its hybrid part (the tokens both vocabularies have) on the teacher's re-tokenisation of the text
        module = (seeded_distill_class(GOLDModule) if seeded else GOLDModule)(
            BPE320, teacher_model_name_or_path=str(out / "gold_teacher"), use_uld_loss=True, uld_use_hybrid_loss=True,
            lmbda=1.0, max_completion_length=MAX_NEW, generation_kwargs={"min_new_tokens": MAX_NEW}, **sampled,
            **common)
        return module, PromptDataModule(equal_length_prompts(16, (BPE320, TINY)), tokenizer=BPE320,
                                        batch_size=2 * mult)
    if method == "online_dpo":  # two samples per prompt ranked by a reward, the policy's frozen copy as reference
        from lightalign import OnlineDPOModule

        module = (seeded_online_dpo_class() if seeded else OnlineDPOModule)(
            TINY, reward_funcs=[completion_chars], beta=0.1, max_completion_length=MAX_NEW, **sampled, **common)
        return module, PromptDataModule(equal_length_prompts(16), tokenizer=TINY, batch_size=2 * mult)
    raise SystemExit(f"unknown method {method}")


class FailRank1(L.Callback):
    """When step ``step`` starts, global rank 1 exits at once (``exit``: no cleanup, like a crashed or killed
    process) or stops taking part while staying alive (``hang``: like a stuck process or an unreachable node)."""

    def __init__(self, step: int, mode: str) -> None:
        self.step, self.mode = step, mode

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == 1 and trainer.global_step == self.step:
            print(f"rank 1: {self.mode} at step {self.step}", file=sys.stderr, flush=True)
            if self.mode == "hang":
                time.sleep(600)  # the test kills it long before
            os._exit(3)


def strategy(name: str, timeout_s: float | None):
    """Test strategies: ``single``, ``zero1/2/3`` and ``cpu_fsdp[_full]`` (CPU subclasses), else a preset name."""
    if name == "single":
        return "auto"
    timeout = {} if timeout_s is None else {"timeout_s": timeout_s}
    if name.startswith("zero"):
        from helpers.cpu_strategies import CPUDeepSpeedStrategy

        from lightalign.strategies import deepspeed_config
        return CPUDeepSpeedStrategy(config=deepspeed_config(int(name[-1])), process_group_backend="gloo", **timeout)
    if name in ("cpu_fsdp", "cpu_fsdp_full"):
        from helpers.cpu_strategies import CPUFSDPStrategy

        return CPUFSDPStrategy(state_dict_type="full" if name.endswith("full") else "sharded", **timeout)
    from lightalign.strategies import make_strategy
    return make_strategy(name, **timeout)


def fit(args, method: str, max_steps: int, ckpt_dir: Path | None = None, ckpt_path: str | None = None,
        strategy_name: str | None = None):
    from lightalign.callbacks import HFExport

    L.seed_everything(1234)
    module, data = build(method, args.batch_mult, seeded=not args.batched_sampling, out=Path(args.out))
    # Lightning's DDP re-seeds at fit start (reset_seed) and one process does not: seed again, so that whatever the
    # constructor drew (PPO's value head) does not shift the policy's from_config weights in one of them only
    L.seed_everything(1234)
    out = Path(args.out)
    callbacks = []
    if ckpt_dir is None and ckpt_path is None:  # the resume check's runs neither export nor record the start
        callbacks += [HFExport(output_dir=str(out / f"{method}_hf")), SaveInitial(out / f"{method}_init.pt")]
    if ckpt_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=1, save_top_k=-1, save_last=True))
    if args.fail_at_step is not None:
        callbacks.append(FailRank1(args.fail_at_step, args.fail_mode))
    trainer = L.Trainer(accelerator=args.accelerator, devices=args.devices, num_nodes=args.num_nodes,
                        strategy=strategy(strategy_name or args.strategy, args.timeout_s),
                        max_steps=max_steps, logger=False, enable_checkpointing=ckpt_dir is not None,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, callbacks=callbacks)
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return trainer, module


def frozen_model(module):
    """The frozen model beside the policy: the reference (DPO, GRPO, PPO, online DPO) or the teacher (distillation)."""
    ref = getattr(module, "ref_model", None)
    return ref if ref is not None else getattr(module, "teacher", None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--methods", default="sft,dpo,grpo")
    parser.add_argument("--batch-mult", type=int, default=1)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--resume-check", nargs="*", metavar="STRATEGY",
                        help="SFT: save at step 1 and resume to --steps under each STRATEGY (default: --strategy); "
                             "writes sft_resumed_<STRATEGY>.pt")
    parser.add_argument("--fail-at-step", type=int, help="global rank 1 fails when this step starts")
    parser.add_argument("--fail-mode", choices=("exit", "hang"), default="exit", help="how rank 1 fails (FailRank1)")
    parser.add_argument("--timeout-s", type=float, help="the strategy's collective timeout")
    parser.add_argument("--batched-sampling", action="store_true",
                        help="GRPO/PPO sample each rollout in one batched call (the module's own generate) instead of "
                             "one seeded call per prompt: for runs not compared with another process count (under "
                             "ZeRO-3 every forward of generation gathers the weights: a quarter of the calls)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from lightalign.strategies import check_multinode_env, full_state_dict

    check_multinode_env(args.num_nodes)  # as the CLI does

    if "LOCAL_RANK" not in os.environ:  # not a rank started by others
        if "distill" in args.methods.split(","):
            write_teacher(out)
        if "gold" in args.methods.split(","):
            # logits of a spread that makes its distributions peaked and input-dependent: the ULD loss's sorted L1
            # against a near-uniform teacher has a gradient (its signs) that does not depend on the teacher at all
            write_teacher(out, "gold_teacher", initializer_range=0.2)
    from helpers.fork_ranks import fork_ranks

    fork_ranks(args.devices, args.num_nodes)  # the other ranks forked from this process (tests/helpers/fork_ranks.py)
    for method in args.methods.split(","):
        trainer, module = fit(args, method, args.steps)
        full = full_state_dict(module.model, root=trainer.strategy.model)
        torch.save({k: v.detach().cpu() for k, v in module.model.state_dict().items()} if full is None else {},
                   out / f"{method}_rank{trainer.global_rank}.pt")
        weights = trained_weights(module, full)
        frozen = frozen_model(module)
        if frozen is not None:  # each rank's frozen reference/teacher after training (replicated: whole on each)
            torch.save({k: v.detach().cpu().clone() for k, v in frozen.state_dict().items()},
                       out / f"{method}_frozen_rank{trainer.global_rank}.pt")
        if trainer.is_global_zero:
            torch.save(weights, out / f"{method}.pt")
            ref = frozen
            if ref is not None:  # where the frozen reference ended up
                info = {"trainable": sum(p.requires_grad for p in ref.parameters()),
                        "in_optimizer": any(p is q for g in trainer.optimizers[0].param_groups for q in g["params"]
                                            for p in ref.parameters()),
                        "numel": sum(p.numel() for p in ref.parameters())}
                (out / f"{method}_ref.json").write_text(json.dumps(info))
    for name in ([args.strategy] if args.resume_check == [] else args.resume_check or []):
        fit(args, "sft", 1, ckpt_dir=out / f"ckpt_{name}", strategy_name=name)
        trainer, module = fit(args, "sft", args.steps, ckpt_path=str(out / f"ckpt_{name}" / "last.ckpt"),
                              strategy_name=name)
        full = full_state_dict(module.model, root=trainer.strategy.model)
        if trainer.is_global_zero:
            torch.save(full if full is not None else module.model.state_dict(), out / f"sft_resumed_{name}.pt")
    print("DONE", file=sys.stderr)


if __name__ == "__main__":
    main()
