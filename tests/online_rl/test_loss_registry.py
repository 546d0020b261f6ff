"""The registries of variants (``modules/losses/registry.py``): lookups refuse an unknown name listing the
registered ones, GRPOModule's ``loss_type`` choices are exactly the registered policy losses, and a loss registered
from outside is selectable by name."""

from __future__ import annotations

import typing

import pytest
import torch

from lightalign import GRPOModule
from lightalign.modules.losses import advantages  # noqa: F401  (registers the advantage estimators)
from lightalign.modules.losses.grpo import GRPOLossConfig, grpo_loss
from lightalign.modules.losses.registry import (ADVANTAGE_ESTIMATORS, AGGREGATIONS, POLICY_LOSSES, advantage_estimator,
                                                aggregation, policy_loss, register_aggregation, register_policy_loss)


@pytest.mark.parametrize("lookup, registry", [(policy_loss, POLICY_LOSSES), (aggregation, AGGREGATIONS),
                                              (advantage_estimator, ADVANTAGE_ESTIMATORS)])
def test_an_unknown_name_is_refused_listing_the_registered_ones(lookup, registry):
    with pytest.raises(ValueError, match="Unknown .*'nope'") as err:
        lookup("nope")
    assert len(registry.names()) > 1
    for name in registry.names():
        assert repr(name) in str(err.value)


def test_grpo_module_loss_types_are_the_registered_policy_losses():
    module_choices = typing.get_args(typing.get_type_hints(GRPOModule.__init__)["loss_type"])
    config_choices = typing.get_args(GRPOLossConfig.knob_types()["loss_type"])
    assert set(module_choices) == set(config_choices) == set(POLICY_LOSSES.names())
    assert "gmpo" in POLICY_LOSSES.names()
    for entry in POLICY_LOSSES.entries.values():
        assert entry.aggregation in AGGREGATIONS  # every loss names a registered aggregation


def test_advantage_estimators_are_registered():
    assert {"grpo", "gdpo", "rloo", "gae"} <= set(ADVANTAGE_ESTIMATORS.names())


def test_a_name_is_registered_once():
    with pytest.raises(ValueError, match="'dapo' is already registered"):
        register_policy_loss("dapo", aggregation="sequence_mean")(lambda x, config: (x.logp, {}))
    with pytest.raises(ValueError, match="Unknown loss aggregation 'nope'"):
        register_policy_loss("new_loss", aggregation="nope")
    with pytest.raises(ValueError, match="already registered"):
        register_aggregation("token_mean")(lambda loss, mask, **_: loss.sum())


def test_a_loss_registered_from_outside_is_chosen_by_name():
    """A REINFORCE term (``-A logp``) with bnpo's token mean, registered without touching grpo_loss."""
    @register_policy_loss("test_reinforce", aggregation="token_mean")
    def reinforce(x, config):
        return -x.adv * x.logp, {}

    try:
        logp = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], requires_grad=True)
        adv, mask = torch.tensor([1.0, -2.0]), torch.tensor([[1, 1], [1, 0]])
        loss, _ = grpo_loss(logp, None, adv, mask, config=GRPOLossConfig(loss_type="test_reinforce"))
        assert loss.item() == pytest.approx((1.0 + 2.0 - 1.0) / 3)
    finally:
        del POLICY_LOSSES.entries["test_reinforce"]


def test_config_and_knobs_are_not_both_given():
    logp, adv, mask = torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2)
    with pytest.raises(TypeError, match="both config and knobs"):
        grpo_loss(logp, None, adv, mask, config=GRPOLossConfig(), loss_type="grpo")
