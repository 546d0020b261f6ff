"""Knob groups: each knob has one definition (a field of one ``KnobGroup``), one default, one description and one
validation (the group's ``check``, at construction); a method's constructor and ``--model.help`` come from its
groups (``takes_knobs``)."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil

import pytest

import lightalign
from lightalign.knobs import KnobGroup, knob, method_knobs, takes_knobs
from lightalign.modules.training.policy import PolicyModule

# TRL's same name for different ideas in different methods (never two of them in one method, which takes_knobs
# refuses): how many ideas the name has.
SAME_NAME_OTHER_IDEA: dict[str, int] = {
    "epsilon": 2, "epsilon_high": 2,  # GRPO's clip of each token's ratio; RLOO's clip of each completion's ratio
    # GRPO/RLOO's coefficient of an explicit KL term (``KLKnobs``: >= 0, 0 builds no reference); DPO's, KTO's and online
    # DPO's temperature of the implicit reward (``ImplicitRewardKnobs``: > 0); distillation's point between forward
    # and reverse KL (``DistillLossKnobs``); ORPO's weight of the odds-ratio term, the paper's lambda (``ORPOLossKnobs``);
    # TPO's temperature of its reference-free reward ``beta * log pi`` (``TPOLossConfig``: > 0, TRL's 0.01)
    "beta": 5,
    # each method's own family of losses: GRPO (``GRPOLossConfig``), DPO (``DPOLossConfig``), KTO
    # (``KTOLossConfig``), distillation (``DistillLossKnobs``), online DPO (``OnlineDPOLossKnobs``), CPO
    # (``CPOLossConfig``), TPO (``TPOLossConfig``)
    "loss_type": 7,
    # the assumed label-noise rate of a conservative logistic loss, defined by each loss family with the loss types
    # of its own that read it: DPO's (``DPOLossConfig``), CPO's (``CPOLossConfig``), TPO's sigmoid and tpo-l
    # (``TPOLossConfig``)
    "label_smoothing": 3,
    # online RL's micro-batch layout, off unless asked (``RolloutLayoutKnobs``); distillation's rows, unset = the
    # device's measured default decided at fit start on student and teacher (``DistillLayoutKnobs``)
    "padding_free": 2,
}


def all_groups() -> set[type[KnobGroup]]:
    for info in pkgutil.walk_packages(lightalign.__path__, "lightalign."):
        top = info.name.split(".")[1]
        if top in ("setup", "tests", "bench", "examples", "assets", "docs", "configs", "runs"):
            continue
        try:
            importlib.import_module(info.name)
        except ImportError:  # an optional extra (vllm, deepspeed ...) this environment does not have
            continue
    found, todo = set(), list(KnobGroup.__subclasses__())
    while todo:
        cls = todo.pop()
        if cls.__module__.startswith("lightalign."):
            found.add(cls)
        todo += cls.__subclasses__()
    return found


def method_classes() -> list[type]:
    from lightalign import modules

    return [getattr(modules, name) for name in modules.__all__
            if isinstance(getattr(modules, name), type) and issubclass(getattr(modules, name), PolicyModule)]


def test_each_knob_is_defined_by_one_group():
    """A name defined by two groups is a second definition (a second default, a second description), unless the
    name means another idea in another method (``SAME_NAME_OTHER_IDEA``). Mutation: declare ``learning_rate`` in a
    second group -> this test names both."""
    defined: dict[str, list[str]] = {}
    for group in all_groups():
        for name in group.__dict__.get("__annotations__", {}):  # declared here (a subclass inherits, not redefines)
            if name != "group":
                defined.setdefault(name, []).append(f"{group.__module__}.{group.__qualname__}")
    twice = {name: where for name, where in defined.items() if len(where) > SAME_NAME_OTHER_IDEA.get(name, 1)}
    assert not twice, f"knobs defined more than once: {twice}"


def test_every_knob_has_a_description_and_a_group_name():
    for group in all_groups():
        assert group.group, group
        for field in group.knob_fields():
            assert field.metadata.get("doc"), f"{group.__name__}.{field.name} has no description"


@pytest.mark.parametrize("cls", method_classes(), ids=lambda c: c.__name__)
def test_a_methods_knobs_come_from_its_groups_once(cls):
    """The constructor of every method lists each knob of its groups once, and nothing a group does not define
    (a parameter declared again in a subclass's ``__init__`` would be a second definition)."""
    params = [n for n in inspect.signature(cls).parameters]
    assert len(params) == len(set(params))
    knobs = method_knobs(cls)
    stray = [n for n in params if n not in knobs]
    assert not stray, f"{cls.__name__} takes {stray} outside its knob groups"
    assert set(knobs) == set(params)


def test_two_groups_defining_one_knob_are_refused_when_the_class_is_made():
    @dataclasses.dataclass(frozen=True)
    class A(KnobGroup):
        group = "a"
        lr: float = knob(1.0, "a rate")

    @dataclasses.dataclass(frozen=True)
    class B(KnobGroup):
        group = "b"
        lr: float = knob(2.0, "another rate")

    with pytest.raises(TypeError, match="'lr' is defined by both A and B"):
        @takes_knobs(A, B)
        class Twice:
            pass


def test_the_signature_defaults_descriptions_and_checks_come_from_the_groups():
    @dataclasses.dataclass(frozen=True)
    class Loss(KnobGroup):
        group = "loss"
        beta: float = knob(0.1, "the strength")

        def check(self) -> None:
            if self.beta < 0:
                raise ValueError("beta must be >= 0")

    built = []

    class Base:
        def construct_from_knobs(self, given):
            self.knobs = {g.group: g.from_values(given) for g in type(self).knob_groups}
            built.append(self)

    @takes_knobs(Loss, defaults={"beta": 0.5})
    class Method(Base):
        """A method."""

    signature = inspect.signature(Method)
    assert list(signature.parameters) == ["beta"] and signature.parameters["beta"].default == 0.5
    assert "beta: the strength" in Method.__init__.__doc__ and "beta: the strength" in Method.__doc__
    assert Method().knobs["loss"].beta == 0.5  # the method's default
    assert Method(beta=0.2).knobs["loss"].beta == 0.2
    with pytest.raises(ValueError, match="beta must be >= 0"):
        Method(beta=-1.0)
    with pytest.raises(TypeError):
        Method(gamma=1.0)
    with pytest.raises(TypeError, match="none of its knob groups defines"):
        takes_knobs(Loss, defaults={"gamma": 1})(type("Other", (Base,), {}))


def test_without_drops_a_parent_group_and_refuses_one_the_parent_lacks():
    """``takes_knobs(without=...)``: a method lists only the knobs it takes. Mutations that made this fail: dropping
    nothing (``all_groups`` built from every inherited group); not checking that a ``without`` group is the
    parent's; not refusing a ``defaults`` key of a dropped group; keeping the parent's default of a dropped knob."""

    @dataclasses.dataclass(frozen=True)
    class Tools(KnobGroup):
        group = "tools"
        tools: list | None = knob(None, "the tools")

    @dataclasses.dataclass(frozen=True)
    class Loss(KnobGroup):
        group = "loss"
        beta: float = knob(0.1, "the strength")

    @dataclasses.dataclass(frozen=True)
    class Other(KnobGroup):
        group = "other"
        gamma: float = knob(1.0, "another")

    class Base:
        def construct_from_knobs(self, given):
            self.knobs = {g.group: g.from_values(given) for g in type(self).knob_groups}

    Parent = takes_knobs(Tools, Loss, defaults={"tools": ["t"]})(type("Parent", (Base,), {}))
    Child = takes_knobs(Other, without=(Tools,))(type("Child", (Parent,), {}))
    assert list(inspect.signature(Child).parameters) == ["beta", "gamma"]
    assert Child.knob_groups == (Loss, Other) and "tools" not in Child.knob_defaults
    assert "tools:" not in Child.__init__.__doc__
    assert set(Child().knobs) == {"loss", "other"}
    with pytest.raises(TypeError):
        Child(tools=["t"])
    assert "tools" in inspect.signature(Parent).parameters  # the parent keeps it
    with pytest.raises(TypeError, match=r"without=\['Other'\], which its parent's knob groups do not include"):
        takes_knobs(without=(Other,))(type("Bad", (Parent,), {}))
    with pytest.raises(TypeError, match=r"defaults for \['tools'\], knobs of groups it drops"):
        takes_knobs(without=(Tools,), defaults={"tools": []})(type("Bad", (Parent,), {}))
    with pytest.raises(TypeError, match="both taken and dropped"):
        takes_knobs(Tools, without=(Tools,))(type("Bad", (Parent,), {}))


def test_a2po_and_sdpo_list_only_the_knobs_they_take():
    """A2PO and SDPO drop the tool, sampling-ahead, reference-sync and BEMA groups: their knobs are absent from the
    signature (``--model.help``) and the methods said to take them. Mutation: remove ``without=`` from either
    method and this fails."""
    from lightalign import A2POModule, GRPOModule, SDPOModule
    from lightalign.modules.training.policy import methods_with_knob

    dropped = {"tools", "environment_factory", "max_staleness", "async_sampler_threads", "sync_ref_model",
               "ref_model_mixup_alpha", "update_ref_model", "ema_power"}
    for cls in (A2POModule, SDPOModule):
        assert not dropped & set(inspect.signature(cls).parameters), cls.__name__
    assert dropped <= set(inspect.signature(GRPOModule).parameters)
    for name in dropped:
        assert not {"A2POModule", "SDPOModule"} & set(methods_with_knob(name)), name


def test_a_group_is_checked_at_construction_before_any_model_loads(tiny_dir):
    from lightalign import SFTModule

    with pytest.raises(ValueError, match="lr_scheduler_type='cosinus' is unknown"):
        SFTModule(str(tiny_dir), from_config=True, lr_scheduler_type="cosinus")
    module = SFTModule(str(tiny_dir), from_config=True, learning_rate=1e-3)
    assert module.model is None  # built later, by configure_model
    assert module.knobs.optimization.learning_rate == 1e-3 == module.hparams.learning_rate


def test_a_subclass_s_own_init_arguments_are_saved_as_hyperparameters(tiny_dir):
    from lightalign import SFTModule

    class MySFT(SFTModule):
        def __init__(self, my_weight: float = 0.5, **kwargs):
            super().__init__(**kwargs)
            self.my_weight = my_weight

    module = MySFT(my_weight=0.25, model_name_or_path=str(tiny_dir), from_config=True)
    assert module.hparams.my_weight == 0.25 and module.hparams.from_config is True


def test_an_unknown_knob_is_refused_naming_the_closest_or_the_methods_that_take_it(tiny_dir):
    from lightalign import DPOModule, GRPOModule
    from lightalign.rewards import digit_fraction_reward

    with pytest.raises(TypeError, match=r"DPOModule has no knob 'bta'; did you mean 'beta'\?"):
        DPOModule(str(tiny_dir), from_config=True, bta=0.1)
    with pytest.raises(TypeError, match="GRPOModule has no knob 'num_ppo_epochs'; PPOModule takes it"):
        GRPOModule(str(tiny_dir), from_config=True, reward_funcs=[digit_fraction_reward], num_ppo_epochs=2)
    with pytest.raises(TypeError, match="former name of vllm_importance_sampling_clip_max"):
        GRPOModule(str(tiny_dir), from_config=True, reward_funcs=[digit_fraction_reward],
                   vllm_importance_sampling_cap=2.0)


@pytest.mark.parametrize("given, read", [(True, "group"), (False, "none"), ("batch", "batch")])
def test_trls_boolean_scale_rewards_reads_as_its_string(given, read):
    """TRL's former ``scale_rewards: true/false`` (Dr. GRPO recipes) reads as ``group`` / ``none``."""
    from lightalign.modules.losses.advantages.reward_shaping import RewardShapingKnobs

    assert RewardShapingKnobs(scale_rewards=given).scale_rewards == read
