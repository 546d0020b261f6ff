"""LightningModules, one per post-training method, composed from the concept folders beside them: training/ (the
shared ``PolicyModule`` plumbing), losses/, sampling/ (what every method that samples shares: its sampling knobs,
the samplers and their choice, its statistics), rollout/ (the online-RL loop GRPO, RLOO and PPO build on, and its
asynchronous rollouts), reference/ and adaptations/."""

from lightalign._lazy import lazy_attributes

_EXPORTS = {
    **dict.fromkeys(["A2POModule", "a2po_loss"], "lightalign.modules.a2po"),
    "DistillModule": "lightalign.modules.distill",
    **dict.fromkeys(["CPOModule", "CPO_LOSS_TYPES", "cpo_loss"], "lightalign.modules.cpo"),
    **dict.fromkeys(["ORPOModule", "orpo_loss"], "lightalign.modules.orpo"),
    "GOLDModule": "lightalign.modules.gold",
    "uld_loss": "lightalign.modules.losses.uld",
    **dict.fromkeys(["LOSS_TYPES", "DPOModule", "dpo_loss"], "lightalign.modules.dpo"),
    **dict.fromkeys(["generalized_jsd_loss", "on_policy_distillation_advantages", "on_policy_distillation_loss"],
                    "lightalign.modules.losses.distill"),
    **dict.fromkeys(["GRPOModule", "grpo_loss"], "lightalign.modules.grpo"),
    "IterativeSFT": "lightalign.modules.iterative_sft",
    **dict.fromkeys(["KTOModule", "kto_loss"], "lightalign.modules.kto"),
    **dict.fromkeys(["OnlineDPOModule", "ONLINE_DPO_LOSS_TYPES"], "lightalign.modules.online_dpo"),
    "PPOModule": "lightalign.modules.ppo",
    "create_reference_model": "lightalign.modules.reference.model",
    **dict.fromkeys(["RewardModule", "reward_loss"], "lightalign.modules.reward"),
    "RLOOModule": "lightalign.modules.rloo",
    **dict.fromkeys(["TPOModule", "tpo_loss"], "lightalign.modules.tpo"),
    "SDFTModule": "lightalign.modules.sdft",
    "SDPOModule": "lightalign.modules.sdpo",
    "self_distillation_loss": "lightalign.modules.losses.self_distill",
    "CriticFreeModule": "lightalign.modules.rollout.critic_free",
    "OnlineRLModule": "lightalign.modules.rollout.module",
    **dict.fromkeys(["SFTModule", "sft_loss"], "lightalign.modules.sft"),
    "NEFTune": "lightalign.modules.training.neftune",
    "PolicyModule": "lightalign.modules.training.policy",
}
__getattr__, __dir__ = lazy_attributes(__name__, _EXPORTS)

__all__ = [
    "GOLDModule", "uld_loss",
    "A2POModule", "a2po_loss",
    "LOSS_TYPES", "CriticFreeModule", "DistillModule", "DPOModule", "GRPOModule", "IterativeSFT", "KTOModule", "NEFTune",
    "ONLINE_DPO_LOSS_TYPES", "OnlineDPOModule", "OnlineRLModule", "PolicyModule", "PPOModule", "RewardModule", "RLOOModule", "SDFTModule", "SDPOModule", "SFTModule", "create_reference_model",
    "CPOModule", "CPO_LOSS_TYPES", "ORPOModule", "cpo_loss", "orpo_loss",
    "TPOModule", "tpo_loss",
    "dpo_loss", "generalized_jsd_loss", "grpo_loss", "kto_loss", "on_policy_distillation_advantages",
    "on_policy_distillation_loss", "reward_loss", "self_distillation_loss", "sft_loss",
]
