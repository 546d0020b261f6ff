"""The compact backend's prepacked linears (modules/sampling/packed_linear.py): the same product as ``F.linear`` up to float32
rounding, on exactly the modules it may replace, restored on exit, never where a call needs a gradient or autocast."""

from __future__ import annotations

import pytest
import torch

import lightalign.modules.sampling.packed_linear as pl
from helpers.conformance_models import build

pytestmark = pytest.mark.skipif(not pl.available(), reason="this torch has no oneDNN")


def noisy(model):
    """Every parameter moved off its initial value (from_config zeroes biases: a dropped bias would go unseen)."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def plain_linears(model):
    return [m for m in model.modules() if type(m) is torch.nn.Linear]


@pytest.fixture
def counted(monkeypatch):
    calls = []
    real = pl.prepacked_linear

    def spy(x, packed, bias):
        calls.append(tuple(x.shape))
        return real(x, packed, bias)

    monkeypatch.setattr(pl, "prepacked_linear", spy)
    return calls


@pytest.mark.parametrize("name", ["llama", "qwen2-sliding", "phi3", "gpt_neox"])
def test_logits_match_and_every_plain_linear_runs_prepacked(name, counted):
    model = noisy(build(name))
    ids = torch.randint(3, 1000, (3, 9))
    with torch.no_grad():
        want = model(ids).logits
        with pl.packed_linears(model) as patched:
            got = model(ids).logits
    linears = plain_linears(model)
    assert patched == len(linears) > 0
    assert len(counted) == len(linears)  # one forward: each plain linear once, on the prepacked weight
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert all("forward" not in vars(m) for m in linears)  # restored: the modules run their own forward again


def test_weights_are_packed_on_entry_so_an_update_between_rollouts_is_seen():
    model = build("llama")
    ids = torch.randint(3, 1000, (2, 5))
    with torch.no_grad():
        with pl.packed_linears(model):  # a first rollout packs the initial weights
            model(ids)
        noisy(model)
        want = model(ids).logits
        with pl.packed_linears(model):
            got = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_forward_hooks_still_run_and_hooked_or_special_linears_are_left_alone(counted):
    model = build("llama")
    head = model.get_output_embeddings()
    head.register_forward_hook(lambda module, inputs, out: out + 100.0)  # e.g. the benchmark's EOS bias
    first = model.model.layers[0].mlp.up_proj
    first.register_forward_pre_hook(lambda module, inputs: inputs)  # a pre-hook may rewrite the weight: not patched

    class Subclass(torch.nn.Linear):
        pass

    layer = model.model.layers[1].mlp
    sub = Subclass(layer.down_proj.in_features, layer.down_proj.out_features, bias=False)
    sub.weight.data.copy_(layer.down_proj.weight.data)
    layer.down_proj = sub
    ids = torch.randint(3, 1000, (2, 5))
    with torch.no_grad():
        want = model(ids).logits
        with pl.packed_linears(model) as patched:
            got = model(ids).logits
            assert "forward" not in vars(first) and "forward" not in vars(sub) and "forward" in vars(head)
    assert patched == len(plain_linears(model)) - 1 == len(counted)
    assert got.min() > 50  # the output hook ran on the prepacked output
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_call_with_gradients_or_under_autocast_runs_the_modules_own_linear(counted):
    model = build("llama")
    ids = torch.randint(3, 1000, (2, 5))
    with pl.packed_linears(model) as patched:
        assert patched > 0
        model(ids).logits.sum().backward()  # grad enabled: F.linear on the live weight
    assert not counted
    assert all(m.weight.grad is not None and m.weight.grad.abs().sum() > 0 for m in plain_linears(model))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        with pl.packed_linears(model) as patched:
            assert patched == 0
            assert model(ids).logits.dtype == torch.bfloat16  # autocast as usual


def test_a_compiled_model_is_left_alone():
    model = build("llama")
    compiled = torch.compile(model, backend="eager")
    with pl.packed_linears(compiled) as patched:
        assert patched == 0
