"""``ScriptedTurns``: tool rollouts whose first turns are given, not drawn, and whose later turns the real backend
samples.

A test of multi-turn rollouts needs a turn that calls a tool; a policy that writes the call only when its fit went
well and its draw went its way makes the test a statement about that fit and that draw. ``ScriptedTurns(turns)``
replaces ``lightalign.modules.agent.episodes.sample_groups`` (``ToolRollouts._sample_turn`` calls it once per turn):
turn ``k < len(turns)`` of every trajectory of a rollout returns the ids ``turns[k]``, with the log-probs a sampler
reports for them (a plain forward of the model on the context and those ids, at the sampling temperature); every
later turn goes to the real ``sample_groups`` (the run's backend), sampled on exactly the ids the rollout built
after the scripted turns and the tool results. The turn counter restarts with each ``ToolRollouts.sample`` call (one
rollout). ``records`` holds every turn of every rollout: whether it was scripted, the contexts it was asked on
(padding removed) and the ids it returned (cut after the first EOS).

Scripted log-probs are those of the plain sampling distribution: ``top_k``, ``top_p``, ``min_p`` and
``repetition_penalty`` other than off are refused rather than applied approximately.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class TurnRecord:
    """One turn of one rollout: ``contexts`` as asked (one per context; each is sampled ``per_context`` times),
    ``ids`` one row per trajectory, cut after its first EOS."""

    scripted: bool
    contexts: list[list[int]]
    per_context: int
    ids: list[list[int]] = field(default_factory=list)


class ScriptedTurns:
    """Turn ``k`` of every trajectory is ``turns[k]`` (token ids) for ``k < len(turns)``; later turns are sampled.

    ``install(setattr)`` patches the library (``monkeypatch.setattr`` in a test; the builtin ``setattr`` in a worker
    process of its own)."""

    def __init__(self, turns: Sequence[Sequence[int]]) -> None:
        self.turns = [list(t) for t in turns]
        self.rollouts: list[list[TurnRecord]] = []

    @property
    def records(self) -> list[TurnRecord]:
        """The turns of every rollout, in order."""
        return [turn for rollout in self.rollouts for turn in rollout]

    def install(self, set_attribute: Callable[[Any, str, Any], None]) -> "ScriptedTurns":
        import lightalign.modules.agent.episodes as episodes

        real_sample_groups, real_rollout = episodes.sample_groups, episodes.ToolRollouts.sample

        def rollout(tool_rollouts, *args, **kwargs):
            self.rollouts.append([])
            return real_rollout(tool_rollouts, *args, **kwargs)

        def sample_groups(model, prompt_ids, prompt_mask, num_generations, *, backend, eos, pad_token_id,
                          max_new_tokens, return_logprobs=False, **sampling):
            turn = len(self.rollouts[-1])
            record = TurnRecord(turn < len(self.turns), [ids[m.bool()].tolist() for ids, m in
                                                         zip(prompt_ids.cpu(), prompt_mask.cpu())], num_generations)
            self.rollouts[-1].append(record)
            if record.scripted:
                out = self._scripted(model, prompt_ids, prompt_mask, num_generations, self.turns[turn][:max_new_tokens],
                                     return_logprobs, **sampling)
            else:
                out = real_sample_groups(model, prompt_ids, prompt_mask, num_generations, backend=backend, eos=eos,
                                         pad_token_id=pad_token_id, max_new_tokens=max_new_tokens,
                                         return_logprobs=return_logprobs, **sampling)
            for row in out[0].tolist():
                ends = [i for i, t in enumerate(row) if t in eos]
                record.ids.append(row[: ends[0] + 1] if ends else row)
            return out

        set_attribute(episodes.ToolRollouts, "sample", rollout)
        set_attribute(episodes, "sample_groups", sample_groups)
        return self

    @staticmethod
    @torch.no_grad()
    def _scripted(model, prompt_ids, prompt_mask, num_generations, ids, return_logprobs, *, temperature=1.0,
                  top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0, share_prefill=True, continuous_config=None,
                  **other):
        """``ids`` after every context, ``num_generations`` times each, in ``Samples``' format."""
        from lightalign.modules.sampling.samplers import Samples

        if (top_p, top_k or 0, min_p, repetition_penalty) != (1.0, 0, None, 1.0) or other:
            raise ValueError(f"ScriptedTurns reports the plain sampling distribution's log-probs; got top_p={top_p}, "
                             f"top_k={top_k}, min_p={min_p}, repetition_penalty={repetition_penalty}, {other}.")
        rows = prompt_ids.shape[0] * num_generations
        turn = torch.tensor(ids, dtype=torch.long, device=prompt_ids.device).expand(rows, -1)
        if not return_logprobs:
            return Samples(turn.clone())
        # each context with the turn after it; positions counted from the first real token, as generate counts them
        context = torch.cat([prompt_ids, turn[: prompt_ids.shape[0]]], dim=1)
        mask = torch.cat([prompt_mask, torch.ones_like(turn[: prompt_ids.shape[0]])], dim=1)
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=context, attention_mask=mask, position_ids=positions, use_cache=False).logits
        predicting = logits[:, prompt_ids.shape[1] - 1: -1].float() / temperature  # the logits that predict the turn
        logps = predicting.log_softmax(-1).gather(-1, turn[: prompt_ids.shape[0], :, None])[..., 0]
        return Samples(turn.clone(), logps.repeat_interleave(num_generations, dim=0))
