"""Multi-turn rollouts with tools: the policy samples a turn, its tool calls run, their results come back as
``tool`` messages, and it samples again, until it answers without a call, ``max_tool_calling_iterations`` is
reached or the completion budget (``max_completion_length``, tool tokens included, as in TRL) is spent.

A trajectory is one row of the rollout: ``completion_ids`` holds every id after the prompt, in order — the ids the
sampler returned for each turn, exactly, and the template's tool-result ids between turns (``turns.tool_result_ids``)
— and ``tool_mask`` marks the sampled ones (1) against the tool-result ones (0): only sampled tokens are trained
and enter the KL. Each turn after the first is sampled on the trajectory's ids so far (no decode, no
re-tokenisation), on the run's sampler, so any backend that samples from token ids serves it.
"""

from __future__ import annotations

import dataclasses

from lightalign.knobs import KnobGroup, knob

import json
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lightalign.modules.agent.environments import EnvironmentFactory, EnvironmentReward
from lightalign.modules.agent.tools import (ToolCall, check_unique_names, resolve_tools, run_tool_call, tool_name,
                                            tool_schema)
from lightalign.datamodules.prompt import left_pad
from lightalign.modules.agent.response_templates import check_round_trip, choose_response_template
from lightalign.modules.agent.turns import check_tool_template, parse_turn, tool_result_ids
from lightalign.modules.sampling.samplers import Sampler, sample_groups
from lightalign.modules.sampling.completions import cut_after_eos, eos_token_ids
from lightalign.rewards.deadline import map_with_deadline

TOOL_STATS = ("tools/call_frequency", "tools/failure_frequency")


@dataclasses.dataclass(frozen=True)
class ToolKnobs(KnobGroup):
    """Multi-turn rollouts: tools the policy may call, or environments that own the tools and the reward."""

    group = "tools"
    tools: list[str | Callable] | None = knob(
        None, "tools the policy may call during a rollout: import paths of plain functions (``mypkg.tools:calc``) or "
              "callables; type hints and a docstring give each its JSON schema, which the chat template renders. "
              "Calls are parsed from the policy's turns in its template's format (the tokenizer's "
              "``response_template``); results come back as ``tool`` messages whose tokens are not trained "
              "(``ToolRollouts``, docs/tools.md).", saved=False)
    environment_factory: str | Callable | None = knob(
        None, "an import path (or callable) building one environment per trajectory: ``reset(**row)`` before it (may "
              "return text appended to the last user message), its public methods are tools, ``get_reward()`` "
              "(optional) scores the trajectory (a reward source named after the class, weight 1), ``close()`` "
              "(optional) once the rollout is scored or the run stops.", saved=False)
    max_tool_calling_iterations: int | None = knob(
        None, "tool-calling rounds per trajectory at most (None: until the policy answers without a call or "
              "``max_completion_length``, which counts tool tokens too, is spent).")
    tool_timeout: float | None = knob(
        60.0, "seconds one tool call may run; a call that takes longer, raises, names an unknown tool or passes wrong "
              "arguments becomes an ``error:`` tool message and counts in ``tools/failure_frequency``.")
    response_template: dict[str, Any] | None = knob(
        None, "how the tokenizer's assistant turns are parsed into ``content`` and ``tool_calls`` (transformers' "
              "response-template dict), for a tokenizer that has none.")

    def check(self) -> None:
        if self.max_tool_calling_iterations is not None and self.max_tool_calling_iterations < 1:
            raise ValueError(f"max_tool_calling_iterations must be >= 1 or null (no limit), got "
                             f"{self.max_tool_calling_iterations}.")
        if self.tool_timeout is not None and not self.tool_timeout > 0:
            raise ValueError(f"tool_timeout must be > 0 seconds or null (no limit), got {self.tool_timeout}.")
        if self.response_template is not None and not isinstance(self.response_template, dict):
            raise ValueError(f"response_template must be a mapping (transformers' response template format), got "
                             f"{type(self.response_template).__name__}.")
        if not self.tools and self.environment_factory is None:
            for knob_name, value in (("max_tool_calling_iterations", self.max_tool_calling_iterations),
                                     ("response_template", self.response_template)):
                if value is not None:
                    raise ValueError(f"{knob_name} is set but there are no tools: give tools or environment_factory.")

class ToolRollouts:
    """The tool-calling rollout of a method: its tools, its environments, its turn limit.

    Args:
        tools: plain tool functions or their import paths.
        environment_factory: an environment class/function or its import path (``EnvironmentFactory``).
        max_tool_calling_iterations: tool-calling rounds per trajectory at most (None: until the budget ends).
        tool_timeout: seconds one tool call may take before it becomes an error message (None: no limit).
        response_template: a ``response_template`` to set on the tokenizer (how its turns are parsed).
    """

    def __init__(self, tools: Sequence[str | Callable] | None, environment_factory: str | Callable | None,
                 max_tool_calling_iterations: int | None, tool_timeout: float | None,
                 response_template: dict[str, Any] | None) -> None:
        self.tools = resolve_tools(tools)
        self.environments = None if environment_factory is None else EnvironmentFactory(environment_factory)
        if self.environments is not None:
            check_unique_names([*map(tool_name, self.tools), *self.environments.tool_names],
                               "the tools knob and the environment's methods")
        self.schemas = [tool_schema(t) for t in self.tools] + (self.environments.schemas if self.environments else [])
        self.max_iterations = max_tool_calling_iterations
        self.tool_timeout = tool_timeout
        self.response_template = response_template
        self.template_note: str | None = None  # set at fit start by check_setup

    @staticmethod
    def build(tools: Any, environment_factory: Any, max_tool_calling_iterations: int | None,
              tool_timeout: float | None, response_template: dict[str, Any] | None) -> "ToolRollouts | None":
        """The component when tools or an environment are given, else None (single-turn rollouts)."""
        if not tools and environment_factory is None:
            return None
        return ToolRollouts(tools, environment_factory, max_tool_calling_iterations, tool_timeout, response_template)

    def reward_sources(self, timeout: float | None) -> list[Callable]:
        """The environment's reward, when it owns one (a reward function beside ``reward_funcs``)."""
        if self.environments is None or not self.environments.owns_reward:
            return []
        return [EnvironmentReward(self.environments.class_name, timeout)]

    def check_setup(self, tokenizer: Any, datamodule: Any) -> None:
        """At fit start, before any rollout: the tokenizer can render and parse tool turns, prompts are
        conversations. The response template is chosen and proven to read the chat template's calls
        (``choose_response_template``); ``template_note`` says which and how, for the fit-start line."""
        check_tool_template(tokenizer, "tools")
        template, how = choose_response_template(tokenizer, self.response_template)
        check_round_trip(tokenizer, template, how, getattr(datamodule, "chat_template_kwargs", None))
        tokenizer.response_template = template
        self.template_note = f"tool calls read by the response_template {how} (round trip of a call checked)"
        data = getattr(datamodule, "train_dataset", None)
        if data is None or not len(data):
            return
        if not isinstance(data[0]["prompt"], list):
            raise ValueError("tools need conversational prompts (a list of messages per row), so the chat template "
                             "can render the tool list; the training prompts are strings.")
        limit = getattr(datamodule, "max_prompt_length", None)
        if limit is not None and "prompt_input_ids" in data.column_names:  # the tool list adds the same to each row
            lengths = [len(ids) for ids in data["prompt_input_ids"]]
            longest = max(range(len(lengths)), key=lengths.__getitem__)
            self._render(tokenizer, data[longest]["prompt"], getattr(datamodule, "chat_template_kwargs", None), limit,
                         longest, "training prompt")

    # ------------------------------------------------------------------------------------------- one rollout
    @torch.no_grad()
    def sample(self, model: torch.nn.Module, tokenizer: Any, batch: dict[str, Any], num_generations: int, *,
               backend: str | Sampler, sampling: dict[str, Any], max_prompt_length: int | None,
               chat_template_kwargs: dict[str, Any] | None, return_logprobs: bool = False) -> dict[str, Any]:
        """A rollout of ``num_generations`` trajectories per prompt, in ``sample_completions``' format plus
        ``tool_mask`` ``[rows, T]``, ``tool_calls``/``tool_failures`` (counts) and ``environments`` (the
        rollout's ``EpisodeEnvironments`` or None: the caller closes them once the rollout is scored)."""
        prompts = [p for p in batch["prompts"] for _ in range(num_generations)]
        if not all(isinstance(p, list) for p in prompts):
            raise ValueError("tools need conversational prompts (a list of messages per row); got a string prompt.")
        columns = {k: [v for v in vals for _ in range(num_generations)] for k, vals in batch["columns"].items()}
        rows = [{"prompt": p, **{k: v[i] for k, v in columns.items()}} for i, p in enumerate(prompts)]
        envs = self.environments.build(len(rows)) if self.environments is not None else None
        try:
            return self._sample(model, tokenizer, prompts, columns, rows, envs, num_generations, backend, sampling,
                                max_prompt_length, chat_template_kwargs, return_logprobs)
        except BaseException:
            if envs is not None:
                envs.close()
            raise

    def _sample(self, model, tokenizer, prompts, columns, rows, envs, num_generations, backend, sampling,
                max_prompt_length, chat_template_kwargs, return_logprobs):
        device = next(model.parameters()).device
        eos = eos_token_ids(model, tokenizer)
        pad = tokenizer.pad_token_id
        budget = sampling["max_new_tokens"]
        observations = envs.reset(rows) if envs is not None else [None] * len(rows)
        messages = [_with_observation(p, o) for p, o in zip(prompts, observations)]
        prompt_ids = [self._render(tokenizer, m, chat_template_kwargs, max_prompt_length, i // num_generations)
                      for i, m in enumerate(messages)]
        tools_of = [self.environments.tools_of(env, self.tools) if envs is not None else
                    {tool_name(t): t for t in self.tools} for env in (envs.environments if envs else rows)]
        n = len(rows)
        seq: list[list[int]] = [[] for _ in range(n)]
        sampled: list[list[int]] = [[] for _ in range(n)]  # the tool mask: 1 sampled, 0 tool result
        logps: list[list[float]] = [[] for _ in range(n)]
        conversation: list[list[dict[str, Any]]] = [[] for _ in range(n)]
        ended_with_eos = [False] * n
        calls = failures = 0
        max_positions = getattr(model.config, "max_position_embeddings", None)
        was_training = model.training
        model.eval()
        try:
            active, rounds = list(range(n)), 0
            while active:
                grouped = rounds == 0 and all(o is None for o in observations)  # a group shares its prompt
                turn_ids, turn_logps = self._sample_turn(model, prompt_ids, seq, active, num_generations, grouped,
                                                         backend, sampling, eos, pad, budget, device, return_logprobs)
                parsed = {}
                for k, i in enumerate(active):
                    ids = turn_ids[k][: budget - len(seq[i])]
                    prefix = prompt_ids[i] + seq[i]
                    seq[i] += ids
                    sampled[i] += [1] * len(ids)
                    if return_logprobs:
                        logps[i] += turn_logps[k][: len(ids)]
                    ended_with_eos[i] = bool(ids) and ids[-1] in eos
                    message, error = ({}, None) if not ended_with_eos[i] else parse_turn(tokenizer, ids, prefix,
                                                                                           self.schemas)
                    if message:
                        conversation[i].append({"role": "assistant", "content": message.get("content") or "",
                                                **({"tool_calls": message["tool_calls"]} if message.get("tool_calls")
                                                   else {})})
                    else:  # cut by the budget, or malformed: the text as sampled
                        conversation[i].append({"role": "assistant",
                                                "content": tokenizer.decode(ids, skip_special_tokens=True)})
                    if error is not None:
                        parsed[i] = [ToolCall("unknown", f"error: the tool call could not be parsed: {error}", True)]
                    elif message.get("tool_calls"):
                        parsed[i] = message["tool_calls"]
                rounds += 1
                if self.max_iterations is not None and rounds > self.max_iterations:
                    break
                to_run = [i for i in active if i in parsed]
                results = map_with_deadline(
                    [lambda i=i: [c if isinstance(c, ToolCall) else run_tool_call(c, tools_of[i], self.tool_timeout)
                                  for c in parsed[i]] for i in to_run], None, [f"tools of row {i}" for i in to_run])
                active = []
                for i, done in zip(to_run, results):
                    calls += len(done)
                    failures += sum(c.failed for c in done)
                    tool_messages = [c.message() for c in done]
                    suffix = tool_result_ids(tokenizer, tool_messages, eos, chat_template_kwargs)
                    after = len(seq[i]) + len(suffix)
                    if after >= budget or (max_positions is not None and len(prompt_ids[i]) + after >= max_positions):
                        continue  # no room for the results and a next turn: the trajectory ends after its call
                    conversation[i] += tool_messages
                    seq[i] += suffix
                    sampled[i] += [0] * len(suffix)
                    logps[i] += [0.0] * len(suffix)
                    active.append(i)
        finally:
            model.train(was_training)
        return self._as_rollout(tokenizer, prompt_ids, seq, sampled, logps if return_logprobs else None,
                                ended_with_eos, prompts, conversation, columns, envs, calls, failures, pad, device)

    def _sample_turn(self, model, prompt_ids, seq, active, num_generations, grouped, backend, sampling, eos, pad,
                     budget, device, return_logprobs):
        """One turn of every active trajectory: the sampled ids of each (cut after its first EOS) and their
        sampling log-probs. The first turn samples each prompt's group at once when the group shares its prompt."""
        if grouped:
            contexts, per_context = [prompt_ids[i] for i in active[::num_generations]], num_generations
        else:
            contexts, per_context = [prompt_ids[i] + seq[i] for i in active], 1
        ids, mask = left_pad(contexts, pad, device)
        longest = max(budget - len(seq[i]) for i in active)
        kwargs = {**sampling, "max_new_tokens": longest}
        completion_ids, logps, lengths = sample_groups(model, ids, mask, per_context, backend=backend, eos=eos,
                                                       pad_token_id=pad, return_logprobs=return_logprobs, **kwargs)
        completion_ids, completion_mask, _ = cut_after_eos(completion_ids, eos, pad, lengths)
        counts = completion_mask.sum(-1).tolist()
        turn_ids = [row[:c].tolist() for row, c in zip(completion_ids.cpu(), counts)]
        turn_logps = [row[:c].tolist() for row, c in zip(logps.float().cpu(), counts)] if logps is not None else None
        return turn_ids, turn_logps

    def _render(self, tokenizer: Any, messages: list[dict[str, Any]], chat_template_kwargs: dict[str, Any] | None,
                max_prompt_length: int | None, prompt_row: int, where: str = "prompt of the batch") -> list[int]:
        text = tokenizer.apply_chat_template(messages, tools=self.schemas, tokenize=False, add_generation_prompt=True,
                                             **(chat_template_kwargs or {}))
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if max_prompt_length is not None and len(ids) > max_prompt_length:
            raise ValueError(f"The {where} {prompt_row} is {len(ids)} tokens with the tool list rendered, more "
                             f"than data.max_prompt_length ({max_prompt_length}); cutting it would cut the tool list. "
                             "Raise data.max_prompt_length.")
        return ids

    @staticmethod
    def _as_rollout(tokenizer, prompt_ids, seq, sampled, logps, ended_with_eos, prompts, conversation, columns, envs,
                    calls, failures, pad, device) -> dict[str, Any]:
        n, width = len(seq), max(1, max(len(s) for s in seq))
        completion_ids = torch.full((n, width), pad, dtype=torch.long)
        completion_mask = torch.zeros((n, width), dtype=torch.long)
        tool_mask = torch.zeros((n, width), dtype=torch.long)
        for i, (ids, marks) in enumerate(zip(seq, sampled)):
            completion_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            completion_mask[i, : len(ids)] = 1
            tool_mask[i, : len(ids)] = torch.tensor(marks, dtype=torch.long)
        p_ids, p_mask = left_pad(prompt_ids, pad, device)
        columns = dict(columns)
        columns["completion_ids"] = [list(s) for s in seq]
        if envs is not None:
            columns["environments"] = envs.environments
        rollout = {
            "prompt_ids": p_ids, "prompt_mask": p_mask, "completion_ids": completion_ids.to(device),
            "completion_mask": completion_mask.to(device), "tool_mask": tool_mask.to(device),
            "truncated": torch.tensor([not e for e in ended_with_eos], device=device),
            "prompts": prompts, "completions": conversation, "texts": [_transcript(c) for c in conversation],
            "columns": columns, "environments": envs, "tool_calls": calls, "tool_failures": failures,
        }
        if logps is not None:
            sampling_logps = torch.zeros((n, width))
            for i, row in enumerate(logps):
                sampling_logps[i, : len(row)] = torch.tensor(row)
            rollout["sampling_logps"] = sampling_logps.to(device)
        return rollout


def _with_observation(prompt: list[dict[str, Any]], observation: str | None) -> list[dict[str, Any]]:
    """The prompt with ``reset``'s observation appended to its last user message (TRL's contract)."""
    if observation is None:
        return prompt
    messages = [dict(m) for m in prompt]
    for m in reversed(messages):
        if m.get("role") == "user":
            m["content"] = f"{m['content']}{observation}"
            return messages
    raise ValueError("The environment's reset returned an observation but the prompt has no user message to append "
                     "it to.")


def _transcript(conversation: list[dict[str, Any]]) -> str:
    """The trajectory as the sample table shows it: every turn, tool calls and results included."""
    lines = []
    for m in conversation:
        if m["role"] == "tool":
            lines.append(f"[tool {m['name']}] {m['content']}")
            continue
        calls = [json.dumps(c.get("function", c), default=str) for c in m.get("tool_calls", [])]
        lines.append(" ".join([m["content"], *(f"[call {c}]" for c in calls)]).strip())
    return "\n".join(lines)

