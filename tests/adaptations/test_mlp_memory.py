"""recompute_mlp_activation (modules/adaptations/mlp_memory.py): gated SiLU MLPs keep gate(x) and up(x) for the backward pass
and recompute silu(gate(x)); values and gradients are bitwise those of the model's own MLP, and each MLP keeps
exactly one [tokens, intermediate_size] tensor less."""

from __future__ import annotations

import copy

import pytest
import torch

from lightalign.modules.adaptations.mlp_memory import mlp_report, recompute_mlp_activation, silu_mul

MODELS = ["tiny", "tiny-llama"]  # Qwen2 and Llama


def build(repo, name):
    from lightalign.hub import load_causal_lm

    torch.manual_seed(0)
    return load_causal_lm(str(repo / "assets" / "models" / name), from_config=True).train()


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def saved_bytes(model, ids) -> int:
    """Bytes of the distinct tensors autograd keeps for the backward pass of one forward."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, use_cache=False).logits.sum()
    return sum(storages.values())


@pytest.mark.parametrize("name", MODELS)
def test_values_and_gradients_are_bitwise_those_of_the_eager_mlp(repo, name):
    eager = build(repo, name)
    lean = copy.deepcopy(eager)
    assert recompute_mlp_activation(lean) == eager.config.num_hidden_layers
    ids = torch.randint(3, eager.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(1))
    loss_e, grads_e = loss_and_grads(eager, ids)
    loss_l, grads_l = loss_and_grads(lean, ids)
    assert torch.equal(loss_e, loss_l)
    assert grads_e.keys() == grads_l.keys() and len(grads_e) == len(list(eager.parameters()))
    for n in grads_e:
        assert torch.equal(grads_e[n], grads_l[n]), n


@pytest.mark.parametrize("name", MODELS)
def test_each_mlp_keeps_one_intermediate_tensor_less(repo, name):
    eager = build(repo, name)
    lean = copy.deepcopy(eager)
    recompute_mlp_activation(lean)
    batch, seq = 2, 11
    ids = torch.randint(3, eager.config.vocab_size, (batch, seq))
    cfg = eager.config
    per_mlp = batch * seq * cfg.intermediate_size * 4  # one fp32 [tokens, intermediate] tensor
    assert saved_bytes(eager, ids) - saved_bytes(lean, ids) == cfg.num_hidden_layers * per_mlp


def test_silu_mul_matches_autograd_of_the_plain_expression_and_respects_frozen_inputs():
    gen = torch.Generator().manual_seed(0)
    gate, up, grad = (torch.randn(3, 5, generator=gen, dtype=torch.float64) for _ in range(3))
    g1, u1 = gate.clone().requires_grad_(), up.clone().requires_grad_()
    (torch.nn.functional.silu(g1) * u1).backward(grad)
    g2, u2 = gate.clone().requires_grad_(), up.clone().requires_grad_()
    out = silu_mul(g2, u2)
    out.backward(grad)
    assert torch.equal(out, torch.nn.functional.silu(gate) * up)
    assert torch.equal(g1.grad, g2.grad) and torch.equal(u1.grad, u2.grad)
    assert torch.autograd.gradcheck(silu_mul, (gate.clone().requires_grad_(), up.clone().requires_grad_()))
    g3 = gate.clone().requires_grad_()
    silu_mul(g3, up).backward(grad)  # up needs no gradient
    assert torch.equal(g3.grad, g1.grad)


def test_only_gated_silu_mlps_with_the_standard_forward_are_switched(repo):
    model = build(repo, "tiny")
    mlp = model.model.layers[0].mlp
    mlp.act_fn = torch.nn.GELU()  # another activation: left as it is
    other = model.model.layers[1].mlp

    class Custom(type(other)):
        def forward(self, x):  # not the standard expression
            return self.down_proj(self.act_fn(self.gate_proj(x)) + self.up_proj(x))

    other.__class__ = Custom
    n = recompute_mlp_activation(model)
    assert n == model.config.num_hidden_layers - 2
    assert "forward" not in vars(mlp) and "forward" not in vars(other)
    assert recompute_mlp_activation(model) == 0  # already switched: nothing twice
    report = mlp_report(model)
    assert (report.switched, report.total) == (model.config.num_hidden_layers - 2, model.config.num_hidden_layers)
    assert "not SiLU" in report.skipped[type(mlp).__name__] and "computes more" in report.skipped["Custom"]


def test_a_forward_that_does_more_than_the_expression_is_left_alone(repo):
    """Structure, not source text: an MLP whose forward holds the expression plus a dropout after ``down_proj`` (or
    which has another submodule) keeps its own forward, so the extra code is never dropped."""
    model = build(repo, "tiny")
    first, second = model.model.layers[0].mlp, model.model.layers[1].mlp

    class WithDropout(type(first)):
        def forward(self, x):
            return torch.nn.functional.dropout(self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x)),
                                               0.5, self.training)

    class WithModule(type(second)):
        pass

    first.__class__ = WithDropout
    second.__class__ = WithModule
    second.dropout = torch.nn.Dropout(0.5)
    n = recompute_mlp_activation(model)
    assert n == model.config.num_hidden_layers - 2
    assert "forward" not in vars(first) and "forward" not in vars(second)
    assert "other parts" in mlp_report(model).skipped["WithModule"]


def test_the_names_of_the_arguments_do_not_matter(repo):
    model = build(repo, "tiny")
    mlp = model.model.layers[0].mlp

    class Renamed(type(mlp)):
        def forward(self, hidden_states):
            out = self.down_proj(self.act_fn(self.gate_proj(hidden_states)) * self.up_proj(hidden_states))
            return out

    mlp.__class__ = Renamed
    assert recompute_mlp_activation(model) == model.config.num_hidden_layers


def test_policy_knob_switches_mlps_keeps_state_dict_and_lora_gradients(repo, quiet_trainer, tiny_dir):
    from lightalign import SFTModule

    on = SFTModule(str(tiny_dir), from_config=True)
    on.configure_model()
    off = SFTModule(str(tiny_dir), from_config=True, recompute_mlp_activation=False)
    off.configure_model()
    assert on.lean_mlps == on.model.config.num_hidden_layers and off.lean_mlps == 0
    assert list(on.model.state_dict()) == list(off.model.state_dict())
    pytest.importorskip("peft")
    lora = dict(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"])
    ids = torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(2))
    states, grads = {}, {}
    for flag in (True, False):
        module = SFTModule(str(tiny_dir), from_config=True, peft_config=lora, recompute_mlp_activation=flag)
        torch.manual_seed(0)  # same base weights and LoRA init on both sides
        module.configure_model()
        assert module.lean_mlps == (module.model.config.num_hidden_layers if flag else 0)
        states[flag] = module.model.state_dict()
        _, grads[flag] = loss_and_grads(module.model, ids)
    assert all(torch.equal(states[True][k], states[False][k]) for k in states[True])
    assert any("lora_B" in n for n in grads[True]) and grads[True].keys() == grads[False].keys()
    assert all("lora_" in n for n in grads[True])  # the base weights stay frozen
    for n in grads[True]:
        assert torch.equal(grads[True][n], grads[False][n]), n
