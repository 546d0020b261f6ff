"""use_vllm up to the GPU boundary: knob validation (a CPU machine is refused with the CPU alternative), the sampling
knobs as vLLM SamplingParams fields, the policy's weights under vLLM's names, and the plumbing of a GRPO fit through
a fake engine that records its calls (weights pushed at fit start and after every optimizer step, the rollout built
from the engine's token ids); the sampler's log-probs from a fake engine, a fake ``vllm`` module (colocated) and a
fake HTTP server (server mode). The real engine runs only in the ``gpu`` tests (skipped without CUDA; docs/vllm.md)."""

from __future__ import annotations

import copy

import pytest
import torch

from helpers.rewards import ranked_reward

from lightalign.modules.sampling.vllm import (check_vllm_knobs, padded_completions, vllm_sampling_params,
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
    (dict(vllm_weight_sync_timeout=0), "vllm_weight_sync_timeout must be > 0 seconds"),
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
    assert vllm_sampling_params(num_generations=2, temperature=1.0, top_p=1.0, top_k=None, min_p=None,
                                repetition_penalty=1.0, max_completion_length=8, eos_token_ids=[2], logprobs=True
                                )["logprobs"] == 0  # the sampled token's log-prob only (no alternatives)


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
    """The vllm sampler's contract (sampling/samplers.py): padded ids and each completion's length; a completion
    without EOS that ends before the longest (the engine's context limit) keeps only its own tokens."""
    from lightalign.modules.sampling.completions import cut_after_eos

    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id
    completions = [[11, 12, eos], [13], [14, eos, 15], [16, 17, 18, 19]]
    ids, logps, lengths = padded_completions(completions, 2, 2, pad)
    assert logps is None
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
                              generator=g).tolist() for _ in prompts for _ in range(params["n"])], None


def test_fit_pushes_weights_after_each_optimizer_step_and_samples_through_the_engine(grpo_module, quiet_trainer,
                                                                                     prompt_data):
    from lightalign.modules.sampling.vllm_engines import VLLMRollouts

    # rewards that differ inside every group by construction: the advantages are non-zero, so the policy moves
    module = grpo_module(max_completion_length=5, temperature=0.9, reward_funcs=[ranked_reward])
    engines = []
    callback = VLLMRollouts(engine_factory=lambda m, t, *_: engines.append(RecordingEngine(m)) or engines[-1])
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


# ------------------------------------------------------------------------------------------------ sampler log-probs
EOS = 2
NAN = float("nan")
# (prompt's first token, generation) -> (the engine's completion, its log-probs); rows keyed so misordering shows
ENGINE_ROWS = {
    (5, 0): ([11, 12, EOS], [-0.5, -1.5, -0.25]),
    (5, 1): ([13], [-2.0]),  # ended without EOS before the longest (the engine's context limit)
    (8, 0): ([14, EOS, 15], [-0.75, -0.125, NAN]),  # cut at its EOS: what follows is 0, NaN included
    (8, 1): ([16, 17, 18, 19], [-1.0, NAN, -3.0, -0.5]),  # a token vLLM could not score: NaN, as TRL keeps it
    (13, 0): ([20, 21], [-0.375, -0.625]),
    (13, 1): ([22, 23, 24, EOS], [-1.25, -0.0625, -4.0, -0.03125]),
}
KEPT = [3, 1, 2, 4, 2, 4]  # each row's tokens through its first EOS


class LogprobEngine:
    """Stands in for an engine at the ``generate`` boundary: known completions and log-probs per prompt."""

    def __init__(self):
        self.params: list[dict] = []

    def generate(self, prompts, params):
        self.params.append(params)
        rows = [ENGINE_ROWS[(prompt[0], g)] for prompt in prompts for g in range(params["n"])]
        return [ids for ids, _ in rows], ([logps for _, logps in rows] if "logprobs" in params else None)


def _vllm_rollout(tokenizer, engine, return_logprobs):
    from types import SimpleNamespace

    from lightalign.modules.sampling.completions import sample_completions
    from lightalign.modules.sampling.vllm_engines import VLLMSampler

    model = torch.nn.Linear(1, 1)  # the engine samples; the rollout reads only the generation config's EOS
    model.generation_config = SimpleNamespace(eos_token_id=EOS)
    prompts = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12], [0, 0, 0, 13, 14]])  # left-padded
    batch = {"prompt_input_ids": prompts, "prompt_attention_mask": (prompts != 0).long(), "prompts": ["a", "b", "c"],
             "columns": {}}
    torch.manual_seed(0)
    return sample_completions(model, tokenizer, batch, 2, backend=VLLMSampler(engine), return_logprobs=return_logprobs,
                              max_new_tokens=4, temperature=0.7, top_p=0.9)


def test_vllm_sampler_returns_the_engines_logprobs_under_the_completion_mask(tokenizer):
    """``sampling_logps`` are the engine's log-probs, row by row (3 prompts x 2 generations, prompt-major), through
    each completion's first EOS; 0 after it (also where the engine had NaN there); NaN kept under the mask."""
    engine = LogprobEngine()
    out = _vllm_rollout(tokenizer, engine, return_logprobs=True)
    assert engine.params[0]["logprobs"] == 0
    assert out["completion_mask"].sum(-1).tolist() == KEPT
    logps = out["sampling_logps"]
    assert logps.shape == out["completion_ids"].shape == (6, 4)
    for row, (key, kept) in enumerate(zip(ENGINE_ROWS, KEPT)):
        ids, expected = ENGINE_ROWS[key]
        assert out["completion_ids"][row, :kept].tolist() == ids[:kept], key
        torch.testing.assert_close(logps[row, :kept], torch.tensor(expected[:kept]), equal_nan=True, msg=str(key))
        assert (logps[row, kept:] == 0).all(), key
    plain = LogprobEngine()
    assert "sampling_logps" not in _vllm_rollout(tokenizer, plain, return_logprobs=False)
    assert "logprobs" not in plain.params[0]


def test_engine_logprobs_padded_with_zeros_and_aligned_with_the_completions():
    samples = padded_completions([[11, 12], [13]], 1, 2, 0, logps=[[-0.5, -1.0], [NAN]])
    torch.testing.assert_close(samples.logps, torch.tensor([[-0.5, -1.0], [NAN, 0.0]]), equal_nan=True)
    with pytest.raises(ValueError, match="log-probs do not align"):
        padded_completions([[11, 12], [13]], 1, 2, 0, logps=[[-0.5, -1.0], [-0.5, -1.0]])


def _fake_vllm(built, sampled_with):
    """A ``vllm`` module whose ``LLM`` records its kwargs and answers ``RequestOutput``-shaped objects: each
    position's log-probs hold the sampled token between a likelier and a less likely alternative."""
    import types

    FakeLogprob = lambda logprob, rank: types.SimpleNamespace(logprob=logprob, rank=rank)  # noqa: E731 (Logprob)

    def expected(prompt, g, i):
        return NAN if (g, i) == (1, 1) else -1.0 - i - 0.5 * g - prompt / 64

    class LLM:
        def __init__(self, **kwargs):
            built.update(kwargs)

        def generate(self, requests, sampling_params, use_tqdm):
            params = sampling_params.kwargs
            sampled_with.append(params)
            outputs = []
            for request in requests:
                p = request["prompt_token_ids"][0]
                samples = []
                for g in range(params["n"]):
                    ids = [p + 1 + g, p + 2 + g, p + 3 + g]
                    logprobs = [{900: FakeLogprob(-0.01, 1), token: FakeLogprob(expected(p, g, i), 2),
                                 901: FakeLogprob(-9.0, 3)} for i, token in enumerate(ids)]
                    samples.append(types.SimpleNamespace(token_ids=ids, logprobs=logprobs if "logprobs" in params
                                                         else None))
                outputs.append(types.SimpleNamespace(outputs=samples))
            return outputs

    class SamplingParams:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

    module = types.ModuleType("vllm")
    module.LLM, module.SamplingParams = LLM, SamplingParams
    return module, expected


def test_colocated_engine_is_built_for_processed_logprobs_and_reads_the_sampled_tokens(monkeypatch):
    import sys

    from lightalign.modules.sampling.vllm_engines import ColocatedEngine

    built, sampled_with = {}, []
    module, expected = _fake_vllm(built, sampled_with)
    monkeypatch.setitem(sys.modules, "vllm", module)
    engine = ColocatedEngine("tiny", gpu_memory_utilization=0.3, max_model_length=None, enable_sleep_mode=False,
                             model_impl="vllm", seed=0)
    assert built["logprobs_mode"] == "processed_logprobs"  # after temperature and the sampling filters
    params = vllm_sampling_params(num_generations=2, temperature=0.7, top_p=0.9, top_k=None, min_p=None,
                                  repetition_penalty=1.0, max_completion_length=3, eos_token_ids=[EOS], logprobs=True)
    ids, logps = engine.generate([[5, 6], [40, 41]], params)
    assert sampled_with[-1]["logprobs"] == 0
    assert ids == [[6, 7, 8], [7, 8, 9], [41, 42, 43], [42, 43, 44]]
    want = [[expected(p, g, i) for i in range(3)] for p in (5, 40) for g in range(2)]
    torch.testing.assert_close(torch.tensor(logps), torch.tensor(want), equal_nan=True)
    ids_only, none = engine.generate([[5, 6]], {k: v for k, v in params.items() if k != "logprobs"})
    assert none is None and ids_only == ids[:2] and "logprobs" not in sampled_with[-1]


@pytest.fixture
def vllm_server():
    """A ``vllm serve`` stand-in on localhost answering the routes ``ServerEngine`` reads, as vLLM does:
    ``/v1/models``, the dev route ``/server_info`` (its logprobs mode; 404 without dev mode) and ``/v1/completions``
    (choices carry ``index``; they are sent out of order; ``logprobs`` holds ``tokens`` / ``token_logprobs``)."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    state = {"mode": "processed_logprobs", "dev": True, "requests": []}

    def logprob(prompt, g, i):
        return None if (g, i) == (0, 1) else -0.5 - i - g / 4 - prompt / 64

    class Handler(BaseHTTPRequestHandler):
        log_message = lambda self, *args: None  # noqa: E731

        def reply(self, body, status=200):
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/v1/models":
                return self.reply({"data": [{"id": "tiny"}]})
            if self.path == "/server_info?config_format=json" and state["dev"]:
                return self.reply({"vllm_config": {"model_config": {"logprobs_mode": state["mode"]}}})
            self.reply({"detail": "Not Found"}, 404)

        def do_POST(self):
            payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            state["requests"].append((self.path, payload))
            choices = []
            for k, prompt in enumerate(payload["prompt"]):
                for g in range(payload["n"]):
                    ids = [prompt[-1] + 1 + g, prompt[-1] + 2 + g]
                    choice = {"index": k * payload["n"] + g, "token_ids": ids, "logprobs": None}
                    if payload.get("logprobs") is not None:
                        as_ids = payload.get("return_tokens_as_token_ids")
                        choice["logprobs"] = {"tokens": [f"token_id:{t}" if as_ids else f"<{t}>" for t in ids],
                                              "token_logprobs": [logprob(prompt[-1], g, i) for i in range(2)],
                                              "top_logprobs": [None, None], "text_offset": [0, 0]}
                    choices.append(choice)
            self.reply({"choices": choices[::-1]})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    state["url"], state["logprob"] = f"http://127.0.0.1:{server.server_address[1]}", logprob
    yield state
    server.shutdown()
    server.server_close()


def test_server_engine_asks_for_logprobs_and_reads_them_back(vllm_server):
    from lightalign.modules.sampling.vllm_engines import ServerEngine

    engine = ServerEngine(vllm_server["url"], group_port=51216, timeout=10, sender=True)
    params = vllm_sampling_params(num_generations=2, temperature=0.7, top_p=1.0, top_k=None, min_p=None,
                                  repetition_penalty=1.0, max_completion_length=2, eos_token_ids=[EOS], logprobs=True)
    ids, logps = engine.generate([[5, 6], [40]], params)
    path, payload = vllm_server["requests"][-1]
    assert path == "/v1/completions" and payload["logprobs"] == 0 and payload["return_tokens_as_token_ids"]
    assert ids == [[7, 8], [8, 9], [41, 42], [42, 43]]  # prompt-major, whatever order the choices came in
    lp = vllm_server["logprob"]
    want = [[NAN if lp(p, g, i) is None else lp(p, g, i) for i in range(2)] for p in (6, 40) for g in range(2)]
    torch.testing.assert_close(torch.tensor(logps), torch.tensor(want), equal_nan=True)


def test_server_without_processed_logprobs_is_refused_only_when_logprobs_are_asked(vllm_server):
    from lightalign.modules.sampling.vllm_engines import ServerEngine

    vllm_server["mode"] = "raw_logprobs"
    engine = ServerEngine(vllm_server["url"], group_port=51216, timeout=10, sender=True)
    params = vllm_sampling_params(num_generations=2, temperature=0.7, top_p=1.0, top_k=None, min_p=None,
                                  repetition_penalty=1.0, max_completion_length=2, eos_token_ids=[EOS])
    ids, logps = engine.generate([[5, 6]], params)  # no log-probs asked: the mode does not matter
    assert ids == [[7, 8], [8, 9]] and logps is None and "logprobs" not in vllm_server["requests"][-1][1]
    sent = len(vllm_server["requests"])
    with pytest.raises(ValueError, match=r"--logprobs-mode raw_logprobs.*`--logprobs-mode processed_logprobs`"):
        engine.generate([[5, 6]], {**params, "logprobs": 0})
    assert len(vllm_server["requests"]) == sent  # refused before sampling
    vllm_server["dev"] = False  # /server_info is a dev route
    with pytest.raises(ConnectionError, match="VLLM_SERVER_DEV_MODE=1 and --logprobs-mode processed_logprobs"):
        ServerEngine(vllm_server["url"], group_port=51216, timeout=10, sender=True).generate(
            [[5, 6]], {**params, "logprobs": 0})


@pytest.mark.gpu
def test_colocated_engine_samples_and_takes_pushed_weights(tiny_dir, tmp_path):
    """Real vLLM on a GPU: the tiny model saved, served colocated, a greedy completion changes after the weights
    pushed are perturbed."""
    pytest.importorskip("vllm")
    from lightalign.hub import load_causal_lm, load_tokenizer
    from lightalign.modules.sampling.vllm_engines import ColocatedEngine

    torch.manual_seed(0)
    model = load_causal_lm(str(tiny_dir), from_config=True)
    model.save_pretrained(tmp_path)
    load_tokenizer(str(tiny_dir)).save_pretrained(tmp_path)
    engine = ColocatedEngine(str(tmp_path), gpu_memory_utilization=0.2, max_model_length=128,
                             enable_sleep_mode=False, model_impl="vllm", seed=0)
    params = vllm_sampling_params(num_generations=2, temperature=1.0, top_p=1.0, top_k=1, min_p=None,
                                  repetition_penalty=1.0, max_completion_length=8, eos_token_ids=[2])
    first, logps = engine.generate([[5, 6, 7]], {**params, "logprobs": 0})
    assert len(first) == 2 and first[0] == first[1]
    # processed log-probs: after top_k=1 the sampled token had probability 1 (raw log-probs would be below 0)
    assert [len(row) for row in logps] == [len(ids) for ids in first]
    assert all(abs(value) < 1e-4 for row in logps for value in row)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    engine.load_weights(lambda: vllm_weights(model))
    assert engine.generate([[5, 6, 7]], params) != (first, None)


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
