"""sdpa_varlen (modules/adaptations/attention.py): per-sequence attention on padding-free rows equals sdpa's block mask."""

from __future__ import annotations

import json

import pytest
import torch

from helpers.tuning import set_tuned
from lightalign.modules.training.device_tuning import tuned
from lightalign.modules.adaptations.attention import VARLEN_SDPA, sequence_sizes, use_varlen_sdpa, worth_splitting


def test_sequence_sizes_follow_position_restarts():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1, 2, 3]])
    assert sequence_sizes(pos) == [3, 2, 1, 4]
    # a sequence may start at any position (transformers' rule: a break wherever the position is not previous + 1)
    assert sequence_sizes(torch.tensor([[5, 6, 7, 2, 3]])) == [3, 2]
    assert sequence_sizes(torch.tensor([[0, 1, 2]])) == [3]
    with pytest.raises(ValueError, match="one packed row"):
        sequence_sizes(torch.tensor([[0, 1], [0, 1]]))


def _packed_row(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 1000, (1, sum(lengths)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    return ids, pos


def test_varlen_equals_block_mask_and_separate_forwards_with_gradients(tiny_model):
    lengths = [7, 1, 12, 5, 9]
    ids, pos = _packed_row(lengths)
    tiny_model.config._attn_implementation = "sdpa"
    tiny_model.train()
    ref = tiny_model(input_ids=ids, position_ids=pos, use_cache=False).logits
    ref.pow(2).mean().backward()
    ref_grads = {n: p.grad.clone() for n, p in tiny_model.named_parameters()}
    tiny_model.zero_grad(set_to_none=True)
    separate = torch.cat([tiny_model(input_ids=ids[:, s:e], use_cache=False).logits.detach()
                          for s, e in zip([0, 7, 8, 20, 25], [7, 8, 20, 25, 34])], dim=1)

    assert use_varlen_sdpa(tiny_model) and tiny_model.config._attn_implementation == VARLEN_SDPA
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counting(q, *a, **kw):
        calls.append((q.shape[-2], kw.get("is_causal"), kw.get("attn_mask")))
        return sdpa(q, *a, **kw)

    torch.nn.functional.scaled_dot_product_attention = counting
    try:
        out = tiny_model(input_ids=ids, position_ids=pos, use_cache=False, sequence_sizes=sequence_sizes(pos)).logits
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa
    # one causal, unmasked call per sequence and layer: no [T, T] attention
    layers = tiny_model.config.num_hidden_layers
    assert sorted(c[0] for c in calls) == sorted(lengths * layers)
    assert all(c[2] is None and c[1] is (c[0] > 1) for c in calls)  # a 1-token sequence needs no causal mask
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.detach(), separate, atol=1e-5, rtol=0)
    out.pow(2).mean().backward()
    for name, param in tiny_model.named_parameters():
        torch.testing.assert_close(param.grad, ref_grads[name], atol=1e-6, rtol=1e-4, msg=name)


def test_varlen_without_boundaries_is_plain_sdpa(tiny_model):
    ids, pos = _packed_row([6, 4])
    padded = torch.tensor([[5, 6, 7, 8, 0, 0], [9, 10, 11, 12, 13, 14]])
    mask = (padded != 0).long()
    tiny_model.config._attn_implementation = "sdpa"
    expected = [tiny_model(input_ids=ids, position_ids=pos).logits,
                tiny_model(input_ids=padded, attention_mask=mask).logits]
    use_varlen_sdpa(tiny_model)
    got = [tiny_model(input_ids=ids, position_ids=pos).logits, tiny_model(input_ids=padded, attention_mask=mask).logits]
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=1e-6, rtol=0)
    # generation (KV cache) runs through the same function
    out = tiny_model.generate(padded[:1, :4], max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 7)


def test_only_sdpa_models_switch_and_the_export_does_not_name_it(tiny_model, tmp_path):
    tiny_model.config._attn_implementation = "eager"
    assert not use_varlen_sdpa(tiny_model)
    assert tiny_model.config._attn_implementation == "eager"
    tiny_model.config._attn_implementation = "sdpa"
    assert use_varlen_sdpa(tiny_model)
    tiny_model.save_pretrained(tmp_path)
    assert VARLEN_SDPA not in (tmp_path / "config.json").read_text()
    assert "attn_implementation" not in json.loads((tmp_path / "config.json").read_text())


def test_sft_module_runs_packed_batches_per_sequence(tiny_dir):
    from lightalign import SFTModule
    from lightalign.datamodules.collators import PaddingFreeCollator

    torch.manual_seed(0)
    module = SFTModule(str(tiny_dir), from_config=True)
    module.configure_model()
    assert module.model.config._attn_implementation == VARLEN_SDPA
    rows = [{"input_ids": list(range(5, 5 + n)), "completion_mask": [0, 0] + [1] * (n - 2)} for n in (6, 9, 4)]
    batch = PaddingFreeCollator()(rows)
    seen = []
    original = module.model.model.forward

    def spy(*a, **kw):
        seen.append(kw.get("sequence_sizes"))
        return original(*a, **kw)

    module.model.model.forward = spy
    packed = module._logits(batch)
    assert seen[0] == [6, 9, 4] and batch["sequence_sizes"] == [6, 9, 4]  # host integers from the collator
    module.model.model.forward = original
    module.model.config._attn_implementation = "sdpa"
    torch.testing.assert_close(packed, module._logits(batch), atol=1e-5, rtol=0)


def test_splitting_pays_only_when_each_call_saves_enough_scores(monkeypatch):
    # one row of 8 short chat pairs (~26 tokens each, the shipped data): ~5k scores saved per call -> one call
    short = [[26 * i for i in range(9)]]
    assert not worth_splitting(short, 212, "cpu")
    # long-tailed pairs: 3 segments of ~166 tokens in a 508-token row -> ~56k saved per call -> split
    long = [[0, 170, 330, 508]]
    assert worth_splitting(long, 508, "cpu")
    # the rule is the saved scores per call against the threshold, padding columns included in the full call
    assert tuned("min_saved_scores_per_call", "cpu") == 32768
    assert not worth_splitting([[0, 4, 8]], 8, "cpu")
    set_tuned(monkeypatch, "min_saved_scores_per_call", 16)
    assert worth_splitting([[0, 4, 8]], 8, "cpu")  # 64 - 32 saved by 2 calls: >= 16 each
    assert not worth_splitting([[0, 200]], 200, "cpu")  # one segment filling its row saves nothing
    assert worth_splitting([[0, 200]], 400, "cpu")  # ...but skipping a long padding tail does
    assert not worth_splitting([], 16, "cpu")


@pytest.mark.parametrize("device", ["cuda", "cuda:1", "mps", torch.device("meta")])
def test_segments_are_split_only_on_the_device_type_the_threshold_was_measured_on(device):
    """The threshold was measured on CPU: on any other device type a shared-prefix row keeps its one masked call,
    however much splitting would save. Mutation: worth_splitting reading the CPU value everywhere -> fails."""
    assert worth_splitting([[0, 170, 330, 508]], 508, "cpu")
    assert not worth_splitting([[0, 170, 330, 508]], 508, device)


@pytest.mark.parametrize("threshold", [0, None, "unmeasured"])
def test_shared_prefix_segments_attend_on_their_own(tiny_model, monkeypatch, threshold):
    """threshold 0: every segment on its own; the CPU's: these short segments stay in one call; "unmeasured" (a
    device type without a threshold): one call, and the edges are not even read off the device (a sync per batch
    on a GPU). Mutation: shared_prefix_logits reading the edges before asking the table -> "unmeasured" fails."""
    from lightalign.datamodules.shared_prefix import SharedPromptCollator
    from lightalign.modules.training import logprobs
    from lightalign.modules.training.logprobs import segment_bounds, shared_prefix_logits

    if threshold == "unmeasured":
        set_tuned(monkeypatch, "min_saved_scores_per_call", None)  # the CPU now as unmeasured as a GPU
    elif threshold is not None:
        set_tuned(monkeypatch, "min_saved_scores_per_call", threshold)
    rows = [  # (prompt, chosen, rejected), each branch's last token only a target: segments of 8, 6, 8 and 3
        {"prompt_input_ids": [5, 6, 7], "chosen_input_ids": [8, 9, 30], "rejected_input_ids": [10, 11, 12, 31]},
        {"prompt_input_ids": [13], "chosen_input_ids": [14, 15, 16, 17, 32], "rejected_input_ids": [18, 33]},
        {"prompt_input_ids": [19, 20, 21, 22, 23], "chosen_input_ids": [24, 34], "rejected_input_ids": [25, 26, 35]},
        {"prompt_input_ids": [27], "chosen_input_ids": [28, 36], "rejected_input_ids": [29, 37]},
    ]
    batch = SharedPromptCollator(pad_token_id=0, pack_length=16)(rows)
    assert batch["input_ids"].shape == (2, 14)  # 25 tokens in 2 balanced rows: [8 + 6], [8 + 3 + 3 padding]
    assert segment_bounds(batch) == [[0, 8, 14], [0, 8, 11]]
    tiny_model.config._attn_implementation = "sdpa"
    want = shared_prefix_logits(tiny_model, batch)
    use_varlen_sdpa(tiny_model)
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counting(q, *a, **kw):
        calls.append(tuple(q.shape[-2:-1]) + (tuple(kw["attn_mask"].shape[-2:]),))
        return sdpa(q, *a, **kw)

    if threshold == "unmeasured":
        monkeypatch.setattr(logprobs, "segment_bounds", lambda batch: pytest.fail("edges read"))
    torch.nn.functional.scaled_dot_product_attention = counting
    try:
        got = shared_prefix_logits(tiny_model, batch)
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa
    layers = tiny_model.config.num_hidden_layers
    if threshold == 0:  # every segment on its own
        assert sorted(calls) == sorted([(8, (8, 8)), (8, (8, 8)), (6, (6, 6)), (3, (3, 3))] * layers)
    else:  # segments this short save too little per call: one masked call over both rows per layer
        assert calls == [(14, (14, 14))] * layers
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_no_device_reads_inside_the_layers(tiny_model, monkeypatch):
    """The per-sequence path takes host integers: no ``.tolist()`` / ``.item()`` of a tensor in any layer (each is
    a device sync on a GPU)."""
    ids, pos = _packed_row([5, 3, 6])
    use_varlen_sdpa(tiny_model)
    reads = []
    for name in ("tolist", "item"):
        original = getattr(torch.Tensor, name)

        def spy(self, *a, _original=original, _name=name, **kw):
            reads.append(_name)
            return _original(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, spy)
    with torch.no_grad():
        tiny_model(input_ids=ids, position_ids=pos, use_cache=False, sequence_sizes=[5, 3, 6])
    assert reads == []


@pytest.mark.parametrize("device_type, family, split", [("cpu", "qwen2", True), ("cuda", "qwen2", False),
                                                       ("cuda", "opt", True)])
def test_per_sequence_split_is_cpu_tuned_and_kept_on_gpus_only_where_needed(device_type, family, split):
    """sdpa_varlen's per-sequence calls were measured faster on CPU only: on a GPU a packed row runs transformers'
    sdpa as is where the model's own sdpa mask keeps packed sequences apart, as measured on its probe (Qwen2: its
    mask is built from position_ids); OPT's mask ignores position_ids (measured), so it stays split there.
    Mutation: native_packing_exact returning True always -> the OPT case fails."""
    from helpers.conformance_models import build
    from lightalign.modules.adaptations.layouts import split_packed_attention

    model = build(family)
    assert use_varlen_sdpa(model)
    assert split_packed_attention(model, torch.device(device_type)) is split


def test_packed_rows_use_flash_attention_varlen_on_a_gpu_when_installed(monkeypatch):
    """Up to the GPU boundary: the choice (flash-attn installed, CUDA device, half precision, a model whose own
    masks keep packed sequences apart, measured on its probe) and nothing on CPU, in float32, or for OPT."""
    import importlib.util

    from helpers.conformance_models import build
    from lightalign.modules.adaptations.support import packed_gpu_attention

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "flash_attn" else real(name, *a))
    qwen, opt = build("qwen2"), build("opt")
    for model in (qwen, opt):
        use_varlen_sdpa(model)
    assert packed_gpu_attention(qwen, torch.device("cpu")) is None
    assert packed_gpu_attention(qwen, torch.device("cuda")) is None  # float32: flash attention needs half
    qwen.to(torch.bfloat16), opt.to(torch.bfloat16)
    assert packed_gpu_attention(qwen, torch.device("cuda")) == "flash_attention_2"
    assert packed_gpu_attention(opt, torch.device("cuda")) is None  # its own mask lets packed sequences mix
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "flash_attn" else real(name, *a))
    assert packed_gpu_attention(qwen, torch.device("cuda")) is None  # not installed


@pytest.mark.gpu
def test_packed_sft_on_gpu_runs_flash_attention_and_matches_padded(tiny_dir):
    from lightalign import SFTModule
    from lightalign.datamodules.collators import PaddingCollator, PaddingFreeCollator

    module = SFTModule(str(tiny_dir), from_config=True, model_init_kwargs={"dtype": "bfloat16"})
    module.configure_model()
    module.model.cuda()
    from lightalign.modules.adaptations import check_run

    check_run(module.model, None, "padding_free", None, module.adaptations, torch.device("cuda"))
    assert module.model.config._attn_implementation == "flash_attention_2"
    rows = [{"input_ids": list(range(5, 5 + n))} for n in (6, 9, 4)]
    packed = PaddingFreeCollator()(rows)
    padded = PaddingCollator(0)(rows)
    with torch.no_grad():
        a = module._logits({k: v.cuda() if torch.is_tensor(v) else v for k, v in packed.items()})
        b = module._logits({k: v.cuda() for k, v in padded.items()})
    torch.testing.assert_close(a[0, :6].float(), b[0, :6].float(), atol=2e-2, rtol=0)


def _qkv(length: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(2, 4, length, 16, generator=gen) for _ in range(2))  # RoPE'd: float32 under autocast
    v = torch.randn(2, 4, length, 16, generator=gen).to(torch.bfloat16)  # a bf16 projection's output
    return q, k, v


@pytest.mark.parametrize("length", [64, 400])
def test_bf16_autocast_attends_in_float32_up_to_the_tuned_length(monkeypatch, length):
    """Under the CPU's bf16 autocast, rows of at most ``bf16_attention_fp32_max_tokens`` keys (the table's 384)
    attend in float32: exactly transformers' sdpa on the float32 inputs with autocast off (the backward of torch's
    bf16 CPU attention is 2-3x slower there); longer rows exactly autocast's bf16 attention. Without autocast nothing
    changes. Mutations: the length test inverted, or the inputs left to autocast -> the 64-token row is not the
    float32 result; a float mask not upcast -> SDPA refuses the mixed dtypes."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from lightalign.modules.adaptations.attention import _attend

    module = torch.nn.Module()
    module.is_causal = True
    q, k, v = _qkv(length)
    mask = torch.zeros(1, 1, length, length).masked_fill(torch.ones(length, length).triu(1).bool(), -1e30)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _attend(module, q, k, v, None, is_causal=True)[0]
        got_masked = _attend(module, q, k, v, mask.to(torch.bfloat16), is_causal=False)[0]
        bf16 = sdpa_attention_forward(module, q, k, v, None, is_causal=True)[0]
    fp32 = sdpa_attention_forward(module, q, k, v.float(), None, is_causal=True)[0]
    fp32_masked = sdpa_attention_forward(module, q, k, v.float(), mask.to(torch.bfloat16).float(), is_causal=False)[0]
    assert tuned("bf16_attention_fp32_max_tokens", "cpu") == 384
    if length <= 384:
        assert got.dtype == torch.float32 and torch.equal(got, fp32) and torch.equal(got_masked, fp32_masked)
        assert not torch.equal(got.to(bf16.dtype), bf16)  # the two precisions differ: the test can tell them apart
    else:
        assert torch.equal(got, bf16) and got.dtype == torch.bfloat16
    plain = _attend(module, q, k, v.float(), None, is_causal=True)[0]  # no autocast: transformers' sdpa as is
    assert torch.equal(plain, fp32)
    set_tuned(monkeypatch, "bf16_attention_fp32_max_tokens", None)  # untuned: autocast's bf16 at every length
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(_attend(module, q, k, v, None, is_causal=True)[0], bf16)
