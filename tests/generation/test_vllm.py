"""use_vllm up to the GPU boundary: knob validation (a CPU machine is refused with the CPU alternative), the sampling
knobs as vLLM SamplingParams fields, the policy's weights under vLLM's names, and the plumbing of a GRPO fit through
a fake engine that records its calls (weights pushed at fit start and after every optimizer step, the rollout built
from the engine's token ids). The real engine runs only in the ``gpu`` tests (skipped without CUDA; docs/vllm.md)."""

from __future__ import annotations

import copy

import pytest
import torch

from lightalign.modules.generation.vllm import (check_vllm_knobs, padded_completions, vllm_sampling_params,
                                                vllm_weight_name, vllm_weights)


def test_use_vllm_refused_on_cpu_naming_the_knob_and_the_alternative(grpo_module):
    with pytest.raises(ValueError, match="use_vllm: true needs a CUDA GPU.*use_vllm: false.*transformers"):
        check_vllm_knobs(use_vllm=True, cuda_available=False)
    if not torch.cuda.is_available():  # at construction, before any model is loaded
        with pytest.raises(ValueError, match="use_vllm: true needs a CUDA GPU"):
            grpo_module(use_vllm=True)


@pytest.mark.parametrize("knobs, message", [
    (dict(vllm_mode="remote"), "vllm_mode='remote' is unknown"),
    (dict(vllm_model_impl="jax"), "vllm_model_impl='jax' is unknown"),
    (dict(vllm_gpu_memory_utilization=1.5), r"vllm_gpu_memory_utilization must be in \(0, 1\]"),
    (dict(vllm_tensor_parallel_size=0), "vllm_tensor_parallel_size must be >= 1"),
    (dict(vllm_server_port=70000), "vllm_server_port must be a TCP port"),
    (dict(use_vllm=True, vllm_tensor_parallel_size=2), "vllm_mode: server"),
    (dict(use_vllm=True, cache_implementation="static"), "cache_implementation='static' is a transformers"),
    (dict(use_vllm=True, generation_kwargs={"no_repeat_ngram_size": 3}), r"\['no_repeat_ngram_size'\] have no vLLM"),
])
def test_vllm_knobs_checked(knobs, message):
    with pytest.raises(ValueError, match=message):
        check_vllm_knobs(cuda_available=True, **knobs)


def test_vllm_missing_is_named_with_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(ImportError, match=r"lightalign\[vllm\]"):
        check_vllm_knobs(use_vllm=True, cuda_available=True)


def test_sampling_params_map_our_knobs():
    params = vllm_sampling_params(num_generations=8, temperature=0.7, top_p=0.9, top_k=None, min_p=None,
                                  repetition_penalty=1.1, max_completion_length=256, eos_token_ids=[2, 0, 2],
                                  generation_kwargs={"min_new_tokens": 4}, seed=123)
    assert params == {"n": 8, "temperature": 0.7, "top_p": 0.9, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.1,
                      "max_tokens": 256, "stop_token_ids": [0, 2], "ignore_eos": False, "skip_special_tokens": False,
                      "detokenize": False, "min_tokens": 4, "seed": 123}
    assert vllm_sampling_params(num_generations=2, temperature=1.0, top_p=1.0, top_k=50, min_p=0.05,
                                repetition_penalty=1.0, max_completion_length=8, eos_token_ids=[2]
                                )["top_k"] == 50


def test_weight_names():
    assert vllm_weight_name("_orig_mod.model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    peft = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    assert vllm_weight_name(peft, peft=True) == "model.layers.0.self_attn.q_proj.weight"
    assert vllm_weight_name("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight", peft=True) is None
    assert vllm_weight_name("base_model.model.lm_head.modules_to_save.default.weight", peft=True) == "lm_head.weight"
    assert vllm_weight_name("base_model.model.lm_head.original_module.weight", peft=True) is None


def test_lora_weights_pushed_merged_under_the_base_names(tiny_model):
    """Every weight vLLM loads from the checkpoint, once, under its checkpoint name; the LoRA deltas in the values;
    the policy's own weights untouched (bitwise)."""
    from peft import LoraConfig, get_peft_model

    names = {n for n, _ in tiny_model.named_parameters()}
    model = get_peft_model(copy.deepcopy(tiny_model), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p)  # a trained adapter: merging changes the weights
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    pushed = {name: tensor.clone() for name, tensor in vllm_weights(model)}  # each used as it comes
    assert set(pushed) == names
    merged = copy.deepcopy(model).merge_and_unload()
    for name, tensor in merged.named_parameters():
        torch.testing.assert_close(pushed[name], tensor.detach(), msg=name)
    assert not torch.equal(pushed["model.layers.0.self_attn.q_proj.weight"],
                           tiny_model.get_parameter("model.layers.0.self_attn.q_proj.weight"))
    for name, p in model.named_parameters():  # never merged in place
        assert torch.equal(p.detach(), before[name]), name


def test_engine_completions_become_the_rollout_cut_at_eos_or_their_end(tokenizer):
    """The vllm sampler's contract (generation/samplers.py): padded ids and each completion's length; a completion
    without EOS that ends before the longest (the engine's context limit) keeps only its own tokens."""
    from lightalign.modules.generation.sampling import cut_after_eos

    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id
    completions = [[11, 12, eos], [13], [14, eos, 15], [16, 17, 18, 19]]
    ids, lengths = padded_completions(completions, 2, 2, pad)
    out_ids, mask, truncated = cut_after_eos(ids, [eos], pad, lengths)
    assert out_ids.tolist() == [[11, 12, eos, pad], [13, pad, pad, pad], [14, eos, pad, pad], [16, 17, 18, 19]]
    assert mask.sum(-1).tolist() == [3, 1, 2, 4]
    assert truncated.tolist() == [False, True, False, True]
    with pytest.raises(ValueError, match="returned 4 completions for 3 prompts"):
        padded_completions(completions, 3, 2, pad)


class RecordingEngine:
    """Stands in for ColocatedEngine / ServerEngine: records every call, samples with the policy itself."""

    def __init__(self, module):
        self.module = module
        self.loads: list[tuple[int, dict[str, torch.Tensor]]] = []
        self.generate_calls: list[tuple[list[list[int]], dict]] = []

    def load_weights(self, weights, send=True):
        self.loads.append((self.module.global_step, {n: t.clone() for n, t in weights()}))

    def generate(self, prompts, params):
        self.generate_calls.append((prompts, params))
        g = torch.Generator().manual_seed(params["seed"])
        return [torch.randint(3, 200, (int(torch.randint(1, params["max_tokens"] + 1, (), generator=g)),),
                              generator=g).tolist() for _ in prompts for _ in range(params["n"])]


def test_fit_pushes_weights_after_each_optimizer_step_and_samples_through_the_engine(grpo_module, quiet_trainer,
                                                                                     prompt_data):
    from lightalign.modules.generation.vllm_engines import VLLMRollouts

    module = grpo_module(max_completion_length=5, temperature=0.9)
    engines = []
    callback = VLLMRollouts(engine_factory=lambda m, t: engines.append(RecordingEngine(m)) or engines[-1])
    trainer = quiet_trainer(max_steps=3, callbacks=[callback])
    trainer.fit(module, prompt_data())
    engine = engines[0]
    # at fit start (step 0), then after each of the 3 optimizer steps
    assert [step for step, _ in engine.loads] == [0, 1, 2, 3]
    final = {n: p.detach() for n, p in module.model.named_parameters()}
    assert set(engine.loads[-1][1]) == set(final)
    for name, tensor in engine.loads[-1][1].items():
        assert torch.equal(tensor, final[name]), name
    assert any(not torch.equal(engine.loads[0][1][n], t) for n, t in engine.loads[-1][1].items())  # it trained
    # one rollout per optimizer step, sampled by the engine with our knobs
    assert len(engine.generate_calls) == 3
    prompts, params = engine.generate_calls[0]
    assert params["n"] == 4 and params["max_tokens"] == 5 and params["temperature"] == 0.9
    assert all(0 not in ids[:1] for ids in prompts)  # real prompt tokens, no left padding
    assert module.external_sampler is None  # released at fit end


@pytest.mark.gpu
def test_colocated_engine_samples_and_takes_pushed_weights(tiny_dir, tmp_path):
    """Real vLLM on a GPU: the tiny model saved, served colocated, a greedy completion changes after the weights
    pushed are perturbed."""
    pytest.importorskip("vllm")
    from lightalign.hub import load_causal_lm, load_tokenizer
    from lightalign.modules.generation.vllm_engines import ColocatedEngine

    torch.manual_seed(0)
    model = load_causal_lm(str(tiny_dir), from_config=True)
    model.save_pretrained(tmp_path)
    load_tokenizer(str(tiny_dir)).save_pretrained(tmp_path)
    engine = ColocatedEngine(str(tmp_path), gpu_memory_utilization=0.2, max_model_length=128,
                             enable_sleep_mode=False, model_impl="vllm", seed=0)
    params = vllm_sampling_params(num_generations=2, temperature=1.0, top_p=1.0, top_k=1, min_p=None,
                                  repetition_penalty=1.0, max_completion_length=8, eos_token_ids=[2])
    first = engine.generate([[5, 6, 7]], params)
    assert len(first) == 2 and first[0] == first[1]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    engine.load_weights(lambda: vllm_weights(model))
    assert engine.generate([[5, 6, 7]], params) != first


@pytest.mark.slow
def test_shipped_vllm_config_is_refused_on_cpu_by_the_console_script(repo):
    """configs/grpo_vllm.yaml parses (every knob a GRPOModule argument) and, without CUDA, stops at the module's
    construction with one message naming the knob and the CPU alternative."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the config is not refused")
    from helpers.console_script import expect as lightalign

    out = lightalign(repo, "fit", "--config", "configs/grpo_vllm.yaml", status=1)
    assert "lightalign: error: use_vllm: true needs a CUDA GPU" in out and "use_vllm: false" in out
    assert "Traceback" not in out
