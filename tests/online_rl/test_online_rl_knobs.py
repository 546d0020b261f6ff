"""GRPO, RLOO and PPO are siblings on the online-RL loop: each lists (``--model.help``) and accepts only its own knobs
and the shared ones, and a sibling's knob is one clear error, through the console script and the Python API."""

from __future__ import annotations

import inspect
import re

import pytest

from lightalign import GRPOModule, PPOModule, RLOOModule
from lightalign.knobs import method_knobs
from lightalign.modules.rollout.critic_free import CriticFreeModule
from lightalign.modules.rollout.module import OnlineRLModule


def own_knobs(cls) -> set[str]:
    """The knobs of the groups the class itself declares (``takes_knobs``), or of its own ``__init__``."""
    if "own_knob_groups" in cls.__dict__:
        return {n for group in cls.own_knob_groups for n in group.knob_names()}
    return {n for n, p in inspect.signature(cls.__init__).parameters.items()
            if n not in ("self", "model_name_or_path") and p.kind is not p.VAR_KEYWORD}


def listed(help_text: str) -> set[str]:
    return set(re.findall(r"^\s+--model\.(\w+)", help_text, flags=re.M))


@pytest.mark.slow
def test_help_lists_only_the_methods_own_and_shared_knobs(repo, tmp_path):
    from helpers import console_script

    shared = own_knobs(OnlineRLModule)
    pages = {cls: console_script.expect(repo, "fit", "--model.help", f"lightalign.{cls.__name__}")
             for cls in (GRPOModule, RLOOModule, PPOModule)}
    grpo, rloo, ppo = (listed(pages[c]) for c in (GRPOModule, RLOOModule, PPOModule))
    assert shared <= grpo and shared <= rloo and shared <= ppo
    assert own_knobs(GRPOModule) <= grpo and own_knobs(RLOOModule) <= rloo and own_knobs(PPOModule) <= ppo
    assert not (own_knobs(GRPOModule) - own_knobs(RLOOModule)) & rloo  # no GRPO-only knob on RLOO's page
    assert not (own_knobs(GRPOModule) | own_knobs(CriticFreeModule)) - own_knobs(PPOModule) & ppo
    assert not own_knobs(PPOModule) - shared - {"num_generations", "temperature"} & (grpo | rloo)
    # a GRPO knob given to RLOO is one line naming it, before any model loads
    out = console_script.expect(repo, "fit", "--config", "configs/rloo_quickstart.yaml", "--model.scale_rewards",
                                "batch", "--trainer.logger.init_args.save_dir", str(tmp_path), status=2)
    assert "scale_rewards" in out and "Traceback" not in out


def test_python_api_names_the_knob_a_method_does_not_have(tiny_dir):
    from lightalign.rewards import digit_fraction_reward

    with pytest.raises(TypeError, match="RLOOModule has no knob 'loss_type'"):
        RLOOModule(str(tiny_dir), from_config=True, reward_funcs=[digit_fraction_reward], loss_type="dapo")
    with pytest.raises(TypeError, match="PPOModule has no knob 'num_iterations'.*num_ppo_epochs"):
        PPOModule(str(tiny_dir), from_config=True, reward_funcs=[digit_fraction_reward], num_iterations=2)


def test_methods_share_one_definition_of_each_shared_knob():
    """A shared knob is defined once (a group OnlineRLModule takes); a method states only its own default where TRL's
    differs, never the knob again."""
    restated = {cls: own_knobs(cls) & own_knobs(OnlineRLModule) for cls in (GRPOModule, RLOOModule, PPOModule)}
    assert restated == {GRPOModule: set(), RLOOModule: set(), PPOModule: set()}
    # TRL's other defaults are the method's stated defaults of the shared definitions (takes_knobs(defaults=...))
    assert set(RLOOModule.knob_defaults) == {"num_generations", "beta"}
    assert {"num_generations", "temperature"} <= set(PPOModule.knob_defaults)
    defaults = {cls: inspect.signature(cls.__init__).parameters for cls in (RLOOModule, PPOModule)}
    assert defaults[RLOOModule]["num_generations"].default == 2  # TRL's RLOOConfig
    assert (defaults[PPOModule]["num_generations"].default, defaults[PPOModule]["temperature"].default) == (1, 0.7)


def test_the_importance_sampling_knobs_have_one_definition_and_ppo_does_not_sample_ahead():
    """The correction's knobs are the loop's (every method: vLLM rollouts); sampling ahead is GRPO's and RLOO's."""
    correction = {"vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
                  "vllm_importance_sampling_clip_min", "vllm_importance_sampling_clip_max"}
    ahead = {"max_staleness", "async_sampler_threads"}
    assert correction <= own_knobs(OnlineRLModule)
    for cls in (CriticFreeModule, GRPOModule, RLOOModule, PPOModule):
        assert not correction & own_knobs(cls), cls.__name__
    assert ahead <= own_knobs(CriticFreeModule)
    assert not ahead & (own_knobs(OnlineRLModule) | own_knobs(PPOModule))


@pytest.mark.parametrize("cls", [GRPOModule, RLOOModule, PPOModule])
@pytest.mark.parametrize("funcs", [None, []])
def test_no_reward_function_is_refused_at_construction(tiny_dir, cls, funcs):
    """``reward_funcs: []`` scores nothing, as ``null``: refused when the module is built, naming the knob, not by
    the reward runner at the first rollout (mutation: accept ``[]`` in ``OnlineRLModule.compose`` -> the ``[]``
    cases construct)."""
    with pytest.raises(ValueError, match=f"^{cls.__name__} needs reward_funcs"):
        cls(str(tiny_dir), from_config=True, reward_funcs=funcs)
