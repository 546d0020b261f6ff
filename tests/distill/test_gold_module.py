"""GOLDModule (modules/gold.py): a teacher of another vocabulary is refused without ``use_uld_loss`` (naming it) and
taken with it; the combinations ULD cannot run are refused at construction; and the module's ULD loss is the loss of
each sequence run alone through both models, the teacher on its own re-tokenisation of the student's text.

The teacher's tokenizer is the shipped ``tiny-bpe320`` (another byte-level BPE vocabulary than ``tiny``'s); a second
one, a character-level byte tokenizer (259 tokens: the 256 bytes and three special tokens), is built here from the shipped corpus's alphabet
(``char_tokenizer``) so that the wiring holds for a tokenizer that merges nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightalign import DistillModule, GOLDModule
from lightalign.modules.losses.uld import ULDKnobs, uld_loss

ASSETS = Path(__file__).resolve().parents[2] / "assets" / "models"
TINY, OTHER = str(ASSETS / "tiny"), str(ASSETS / "tiny-bpe320")


def test_a_teacher_of_another_vocabulary_is_refused_naming_use_uld_loss_and_taken_with_it():
    """Mutations: GOLDModule without its ``check_vocabularies`` override -> the ULD case is refused; the refusal's
    message without the knob -> the match fails."""
    for method, knobs in ((DistillModule, {}), (GOLDModule, {}), (GOLDModule, {"use_uld_loss": False})):
        with pytest.raises(ValueError, match="differs from the student's.*GOLDModule and use_uld_loss: true"):
            method(TINY, from_config=True, teacher_model_name_or_path=OTHER, **knobs)
    module = GOLDModule(TINY, from_config=True, teacher_model_name_or_path=OTHER, use_uld_loss=True)
    assert module.knobs.uld.use_uld_loss and module.hparams.top_p == 0.95  # GOLD's sampling default


@pytest.mark.parametrize("knobs, named", [
    ({"seq_kd": True}, "seq_kd"), ({"loss_type": "on_policy"}, "loss_type 'on_policy'"),
    ({"padding_free": True}, "padding_free"),
    ({"uld_hybrid_matched_weight": 0.5}, "uld_hybrid_matched_weight"),
    ({"uld_use_hybrid_loss": True, "uld_hybrid_matched_weight": 0.5, "uld_hybrid_unmatched_weight": 0.5,
      "uld_token_merge_strategy": "chain"}, "uld_token_merge_strategy"),
    ({"uld_student_temperature": 0.0}, "uld_student_temperature"),
])
def test_combinations_uld_cannot_run_are_refused_at_construction(knobs, named):
    with pytest.raises(ValueError, match=named):
        GOLDModule(TINY, from_config=True, teacher_model_name_or_path=OTHER, use_uld_loss=True, **knobs)


def test_uld_knobs_without_use_uld_loss_are_refused_not_ignored():
    """TRL ignores them; here they name the switch (mutation: ``ULDKnobs.check`` without the unused-knob check)."""
    with pytest.raises(ValueError, match="uld_teacher_temperature, teacher_tokenizer_name_or_path configure|"
                                         "teacher_tokenizer_name_or_path, uld_teacher_temperature configure"):
        GOLDModule(TINY, from_config=True, teacher_model_name_or_path=TINY, uld_teacher_temperature=2.0,
                   teacher_tokenizer_name_or_path=OTHER)


def char_tokenizer(folder: Path):
    """A character-level byte tokenizer (byte-level pre-tokenisation, no merges): the 256 byte symbols plus the
    shipped special tokens, built with the ``tokenizers`` library and saved to ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {t: i for i, t in enumerate(["<|endoftext|>", "<|im_start|>", "<|im_end|>", *sorted(alphabet)])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                      extra_special_tokens=["<|im_start|>", "<|im_end|>"])
    wrapped.save_pretrained(folder)
    return wrapped


VARIANTS = {  # (the knobs of each case) observed and positional keep both EOS: the windows' last positions are read
    "observed": dict(uld_token_merge_strategy="observed", uld_skip_student_eos=False, uld_skip_teacher_eos=False),
    "bayesian": dict(uld_token_merge_strategy="bayesian"),
    "positional": dict(use_extended_uld=False, uld_skip_student_eos=False, uld_skip_teacher_eos=False),
}


def built_module(teacher_tokenizer: str, vocab: int, variant: str) -> GOLDModule:
    """A GOLDModule with a built student (``tiny``, seeded) and a built teacher of ``vocab`` tokens (seeded), its
    tokenizers set as setup sets them."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(OTHER)
    config.vocab_size = vocab
    torch.manual_seed(3)
    teacher = AutoModelForCausalLM.from_config(config).eval()
    module = GOLDModule(TINY, from_config=True, teacher_model=teacher, teacher_tokenizer_name_or_path=teacher_tokenizer,
                        use_uld_loss=True, uld_crossentropy_weight=0.3, **VARIANTS[variant])
    torch.manual_seed(4)
    module.configure_model()
    module.model.eval()
    module.tokenizer = AutoTokenizer.from_pretrained(TINY)
    module.teacher_tokenizer = AutoTokenizer.from_pretrained(teacher_tokenizer)
    return module


def alone(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """The logits from the one predicting the completion's first token to the one after its last, of the sequence
    run alone (no padding)."""
    logits = model(input_ids=torch.tensor([prompt + completion])).logits[0]
    return logits[len(prompt) - 1:]


def padded(windows: list[torch.Tensor]) -> torch.Tensor:
    width = max(w.shape[0] for w in windows)
    return torch.stack([torch.cat([w, w.new_zeros(width - w.shape[0], w.shape[1])]) for w in windows])


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("teacher_tokenizer", ["shipped", "char"])
def test_the_modules_uld_loss_is_each_sequence_run_alone_through_both_models(tmp_path, variant, teacher_tokenizer):
    """Padded student rows (prompts of unequal lengths, one completion without EOS) against the loss computed per
    sequence: the student on its own tokens, the teacher on the teacher tokenizer's tokens of the decoded text plus
    its EOS, spans from the pieces (``VARIANTS``: the extended alignment never reads the teacher's EOS, zero bytes
    wide; positional ULD does). Mutations: the student's or the teacher's window without its last position
    (``completion_logits`` without ``through_last``); the teacher's EOS not appended."""
    from lightalign.modules.reference.token_alignment import byte_spans

    if teacher_tokenizer == "char":
        folder, vocab = tmp_path / "char", len(char_tokenizer(tmp_path / "char"))
    else:
        folder, vocab = Path(OTHER), 320
    module = built_module(str(folder), vocab, variant)
    s_tok, t_tok = module.tokenizer, module.teacher_tokenizer
    prompts = [s_tok("12 plus 7?")["input_ids"], s_tok("Add 345, 12.")["input_ids"]]
    completions = [s_tok("12 plus 7 is 19.")["input_ids"] + [s_tok.eos_token_id], s_tok("345+12=357")["input_ids"]]
    from lightalign.modules.gold import left_pad, right_pad

    rows = dict(zip(("prompt_ids", "prompt_mask"), left_pad(prompts, 0, torch.device("cpu"))))
    rows.update(zip(("completion_ids", "completion_mask"), right_pad(completions, 0, torch.device("cpu"))))
    with torch.no_grad():
        loss, divergence = module.distill_loss(rows)
        t_prompts = [t_tok(s_tok.decode(p))["input_ids"] for p in prompts]
        texts = [s_tok.decode(c, skip_special_tokens=False) for c in completions]
        t_completions = [t_tok(t, add_special_tokens=False)["input_ids"] + [t_tok.eos_token_id] for t in texts]
        s_windows = padded([alone(module.model, p, c) for p, c in zip(prompts, completions)])
        t_windows = padded([alone(module.teacher, p, c) for p, c in zip(t_prompts, t_completions)])
    spans_t = [byte_spans(t_tok, c[:-1]) + [(len(t.encode()), len(t.encode()))] for c, t in zip(t_completions, texts)]
    expected, parts = uld_loss(s_windows, t_windows, completions, t_completions,
                               [byte_spans(s_tok, c) for c in completions], spans_t, module.knobs.uld,
                               teacher_unpredicted_first=[False, False])
    assert isinstance(module.knobs.uld, ULDKnobs)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert divergence.item() == pytest.approx(parts["distillation"].item(), rel=1e-5)
    assert t_completions[0] != completions[0]  # the teacher did read other tokens


def test_with_use_vllm_the_students_engine_samples_and_the_mismatch_is_logged(tmp_path, monkeypatch):
    """ULD on completions a (stand-in) vLLM engine of the student sampled: the engine gets the student's weights at
    fit start and after each step, every batch is its samples, and the engine-student log-prob mismatch is logged
    (mutation: the ULD path without the mismatch update -> no finite train/sampling/kl)."""
    import shutil

    import lightning as L

    from helpers.fake_vllm import vllm_module
    from lightalign import PromptDataModule
    from lightalign.hub import load_causal_lm

    teacher = tmp_path / "teacher"
    shutil.copytree(OTHER, teacher)
    torch.manual_seed(1)
    load_causal_lm(str(teacher), from_config=True).save_pretrained(teacher)
    engines: list = []
    torch.manual_seed(0)
    module = vllm_module(GOLDModule, monkeypatch, engines, TINY, from_config=True,
                         teacher_model_name_or_path=str(teacher), use_uld_loss=True, lmbda=1.0,
                         max_completion_length=5, learning_rate=1e-2)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, max_steps=2)
    trainer.fit(module, PromptDataModule(str(Path(TINY).parents[2] / "examples" / "data" / "arithmetic_sft.jsonl"),
                                         tokenizer=TINY, max_prompt_length=16, batch_size=4))
    (student,) = engines
    assert student.who == "student" and [step for step, _ in student.loads] == [0, 1, 2]
    assert len(student.completions) == 2  # one engine call per batch
    kl = trainer.callback_metrics["train/sampling/kl"]
    assert torch.isfinite(kl) and kl.item() > 0  # the stand-in engine's log-probs are shifted from the student's


def test_a_teacher_tokenizer_that_cannot_be_loaded_is_named_by_its_knob(tmp_path):
    """A missing folder, or one without a tokenizer, given as the teacher's tokenizer: one message naming the knob
    and the path (mutation: drop the ``try`` in ``GOLDModule.setup`` -> the loader's own error, no knob)."""
    import lightning as L

    from lightalign import PromptDataModule

    empty = tmp_path / "no-tokenizer"
    empty.mkdir()
    data = PromptDataModule(str(Path(TINY).parents[2] / "examples" / "data" / "arithmetic_sft.jsonl"), tokenizer=TINY,
                            max_prompt_length=16, batch_size=4)
    for path in (tmp_path / "missing", empty):
        module = GOLDModule(TINY, from_config=True, teacher_model_name_or_path=TINY,
                            teacher_tokenizer_name_or_path=str(path), use_uld_loss=True)
        trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, max_steps=1)
        with pytest.raises(ValueError, match=f"from teacher_tokenizer_name_or_path '{path}', which cannot be loaded"):
            trainer.fit(module, data)
