"""QLoRA: LoRA on a bitsandbytes 4-bit policy (TRL's recipe) trains for SFT (console) and DPO (the base with its
adapters off as the reference), exports an adapter folder that peft loads on the base folder, and what cannot train
is refused before the model loads (``modules/training/lora.py``)."""

from __future__ import annotations

import csv
import math
import shutil
from pathlib import Path

import lightning as L
import pytest
import torch

from helpers import console_script
from lightalign import DPOModule, PreferenceDataModule, SFTModule
from lightalign.datamodules.preference import PreferenceCollator

QLORA = {"quantization_config": {"load_in_4bit": True, "bnb_4bit_compute_dtype": "float32"}}
LORA = {"r": 8, "lora_alpha": 16, "target_modules": "all-linear"}


@pytest.fixture
def tiny_folder(tmp_path, tiny_dir, tiny_model) -> Path:
    """The shipped tiny Qwen2 (attention projections with biases), random weights saved with its tokenizer: 4-bit
    loading quantizes weights read from a folder."""
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("peft")
    folder = tmp_path / "tiny"
    tiny_model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny_dir / name, folder / name)
    assert tiny_model.model.layers[0].self_attn.q_proj.bias is not None  # the case bitsandbytes' bias add hits
    return folder


@pytest.mark.slow
def test_qlora_console_sft_trains_resumes_and_the_adapter_is_all_it_changed(repo, tmp_path, tiny_folder):
    # validation before and between the training steps: bitsandbytes repacked the 4-bit weights into its inference
    # layout at the first eval forward on AVX512-BF16 CPUs, and the next training step then failed (the issue)
    args = ["fit", "--config", "configs/quickstart.yaml", "--model.from_config", "false",
            "--model.model_name_or_path", str(tiny_folder),
            "--model.model_init_kwargs", "{quantization_config: {load_in_4bit: true, bnb_4bit_compute_dtype: float32}}",
            "--model.peft_config", "{r: 8, lora_alpha: 16, target_modules: all-linear}",
            "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1",
            "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"), "--plot.enabled", "false"]
    # two steps, then the run resumed from its checkpoint (the 4-bit base's quantization state in last.ckpt) to four
    for more in (["--trainer.max_steps", "2"], ["--trainer.max_steps", "4", "--ckpt_path", "last"]):
        proc = console_script.run(repo, *args, *more, timeout=600)
        assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    run = tmp_path / "runs" / "quickstart" / "version_0"
    with open(run / "metrics.csv") as f:
        losses = [float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")]
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses)

    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    hf = run / "hf_model"
    assert (hf / "adapter_config.json").exists() and not (hf / "model.safetensors").exists()
    adapter = load_file(hf / "adapter_model.safetensors")
    base = load_file(tiny_folder / "model.safetensors")
    state = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["state_dict"]
    prefix = "model.base_model.model."
    lora = {k.removeprefix("model.").replace(".default.", "."): v for k, v in state.items() if ".lora_" in k}
    assert set(lora) == set(adapter) and all(torch.equal(lora[k], adapter[k]) for k in adapter)
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in adapter.items())  # it trained
    # every float tensor of the base (biases of the 4-bit linears, norms, embeddings) is what the folder holds, so the
    # adapter folder is everything training changed
    compared = []
    for key, value in state.items():
        name = key.removeprefix(prefix).replace(".base_layer.", ".")
        if ".lora_" in key or name not in base or not value.is_floating_point() or value.shape != base[name].shape:
            continue
        assert torch.equal(value, base[name]), f"{name} changed in training: the adapter export does not hold it"
        compared.append(name)
    assert sum(n.endswith("_proj.bias") for n in compared) == 4 * 3  # q, k, v biases of the four layers
    assert len(compared) == 4 * 5 + 2  # and the two norms per layer, the final norm, the (tied) embeddings
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_folder), hf)
    loaded = dict(model.named_parameters())
    key = next(k for k in adapter if k.endswith("lora_B.weight"))
    torch.testing.assert_close(loaded[key.replace(".lora_B.", ".lora_B.default.")], adapter[key], rtol=0, atol=0)


def _quantized_reference_logps(folder, module, batch):
    from lightalign.hub import load_causal_lm
    from lightalign.modules.reference.model import disable_cpu_4bit_repacking, quantization_kwargs

    base = load_causal_lm(str(folder), init_kwargs=quantization_kwargs(QLORA))
    disable_cpu_4bit_repacking(base)
    with torch.no_grad():
        return module._pair_logps(base.eval(), batch)


def test_qlora_dpo_trains_with_the_adapters_off_as_reference(tiny_folder, tiny_dir, data_dir):
    module = DPOModule(str(tiny_folder), model_init_kwargs=QLORA, peft_config={**LORA, "init_lora_weights": False},
                       learning_rate=1e-2, recompute_mlp_activation=False)
    path = str(data_dir / "arithmetic_preference.jsonl")
    data = PreferenceDataModule(path, val_path=path, tokenizer=str(tiny_dir), batch_size=4)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, max_steps=3, val_check_interval=1, limit_val_batches=1)
    trainer.fit(module, data)  # a validation (eval, no_grad) forward before every training step
    assert trainer.global_step == 3 and math.isfinite(float(trainer.callback_metrics["train/loss"]))
    assert module.ref_model is None and module.model.is_loaded_in_4bit
    import bitsandbytes

    linears = [m for m in module.model.modules() if isinstance(m, bitsandbytes.nn.Linear4bit)]
    assert len(linears) == 4 * 7  # every projection quantized, and kept in the trainable layout on any CPU
    assert not any(m.support_avx512bf16_for_cpu or getattr(m.weight.quant_state, "packing_format_for_cpu", False)
                   for m in linears)
    trainable = [n for n, p in module.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    batch = PreferenceCollator(0)([data.train_dataset[i] for i in range(4)])
    ref_c, ref_r = module.reference_logps(batch)
    base_c, base_r = _quantized_reference_logps(tiny_folder, module, batch)
    # the same 4-bit weights and arithmetic: equal up to float32 summation order
    torch.testing.assert_close(ref_c, base_c, atol=1e-4, rtol=0)
    torch.testing.assert_close(ref_r, base_r, atol=1e-4, rtol=0)
    with torch.no_grad():
        pol_c, _ = module._pair_logps(module.model, batch)
    assert (pol_c - base_c).abs().max() > 1e-3  # the adapters are on in the policy


@pytest.mark.parametrize("kwargs, knob", [
    (dict(model_init_kwargs=QLORA), "peft_config"),
    (dict(model_init_kwargs=QLORA, peft_config=LORA, from_config=True), "from_config"),
])
def test_quantized_policy_that_cannot_train_is_refused_before_loading(tiny_folder, monkeypatch, kwargs, knob):
    import lightalign.hub as hub

    monkeypatch.setattr(hub, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(ValueError, match=knob) as err:
        SFTModule(str(tiny_folder), **kwargs).configure_model()
    assert "\n" not in str(err.value)
