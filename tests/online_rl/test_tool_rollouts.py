"""Tool-calling rollouts (modules/agent/): the exact ids the loss sees, masks over tool results, log-probs at rollout
equal to the trainer's, environments' lifecycle and reward, refusals.

The policy is the tiny model with random weights (``assets/models/tiny`` built from its config), which never writes a
well-formed call by itself: a test that needs a call scripts it (``helpers.scripted_turns.ScriptedTurns``), so what it
checks does not depend on a draw or on how well a fit converged. The scripted call is ``call_turn_ids``: ids that are
not the tokenizer's canonical tokenisation of their text, so a rollout that decoded a turn and tokenised it again
would hold other ids than the sampled ones.
"""

from __future__ import annotations

import json

import pytest
import torch

from helpers.scripted_turns import ScriptedTurns
from helpers.tool_policy import QUESTION, calculate, call_turn_ids

TOOL_RESULT = [{"role": "tool", "name": "calculate", "content": "6"}]


@pytest.fixture
def tool_prompts(tmp_path, tiny_dir):
    from lightalign import PromptDataModule

    def make(rows=8, **kw):
        path = tmp_path / "tool_prompts.jsonl"
        path.write_text("".join(json.dumps({"prompt": QUESTION, "answer": "6"}) + "\n" for _ in range(rows)))
        kw.setdefault("max_prompt_length", 256)
        kw.setdefault("tokenizer", str(tiny_dir))
        return PromptDataModule(str(path), **kw)

    return make


def eos_ids(tokenizer):
    return [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id]


def answer_turn_ids(tokenizer) -> list[int]:
    """The assistant turn that answers ``6`` after the tool's result, ending with ``<|im_end|>``."""
    return tokenizer.encode("6", add_special_tokens=False) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]


def test_the_loss_sees_the_sampled_ids_and_the_tool_ran_with_the_policys_arguments(tiny_dir, tokenizer, tool_prompts,
                                                                                   quiet_trainer, monkeypatch):
    """Every trajectory's turns are scripted (the call, then the answer): the tool ran once per trajectory with the
    call's arguments, the answer turn was asked on exactly the prompt, the call's ids and the tool result's ids, and
    the loss's ids are the turns' ids as returned, with the tool result between them, untrained."""
    from lightalign import GRPOModule
    from lightalign.modules.agent.turns import tool_result_ids
    from lightalign.rewards import accuracy_reward

    calls = []

    def calculate_spy(expression: str) -> str:
        """Evaluate integer arithmetic.

        Args:
            expression: e.g. 12*34
        """
        calls.append(expression)
        return calculate(expression)

    calculate_spy.__name__ = "calculate"
    call, answer = call_turn_ids(tokenizer), answer_turn_ids(tokenizer)
    script = ScriptedTurns([call, answer]).install(monkeypatch.setattr)
    module = GRPOModule(str(tiny_dir), from_config=True, tools=[calculate_spy], reward_funcs=[accuracy_reward],
                        num_generations=4, max_completion_length=96, learning_rate=0.0, generation_backend="generate")
    quiet_trainer(max_steps=1).fit(module, tool_prompts())

    assert calls == ["2*3"] * 4  # every trajectory called the tool once, with the arguments of its call turn
    first, second = script.records  # the call turn (the group's 4 trajectories on their prompt), then the answer turn
    assert first.scripted and second.scripted and first.ids == [call] * 4 and second.ids == [answer] * 4
    result = tool_result_ids(tokenizer, TOOL_RESULT, eos_ids(tokenizer))
    assert "6" in tokenizer.decode(result) and "tool" in tokenizer.decode(result)
    (prompt,) = first.contexts
    assert second.contexts == [prompt + call + result] * 4  # the next turn continues the ids, not their text
    (mb,) = module.rollout_buffer.chunks
    for r in range(4):
        ids = mb["completion_ids"][r]
        extent = mb["completion_attention_mask"][r].bool()
        trained = mb["completion_mask"][r].bool()
        # the loss's ids are exactly the returned ones, turn after turn; the tool result sits between them, untrained
        assert ids[trained].tolist() == call + answer
        assert ids[extent & ~trained].tolist() == result
        assert ids[extent].tolist() == call + result + answer
    assert module.last_samples[0]["reward"] == 1.0 and "[tool calculate] 6" in module.last_samples[0]["completion"]


@pytest.mark.parametrize("backend, temperature", [("generate", 1.0), ("generate", 0.3), ("compact", 1.0),
                                                  ("compact", 0.3), ("continuous", 1.0), ("static", 1.0)])
def test_rollout_logps_equal_the_trainers_over_tool_turns(tiny_model, tokenizer, temperature, backend, monkeypatch):
    """The sampler's log-probs of every sampled token equal the training forward's on the stored rollout (padded and
    padding-free layouts): turns after the first were sampled by ``backend`` on exactly the ids the trainer reads.

    The first turn is the scripted call (its log-probs a plain forward's), so every trajectory has a tool result and
    a turn after it that the backend samples: the budget leaves that turn at least one token. The static backend's
    decode step is compiled with torch.compile's eager backend, as in tests/sampling: the same graph capture and
    static cache, without inductor's code generation (about 40 s on a cold cache).

    Tolerance: both sides compute the same float32 log-softmax of the same model on the same ids; they differ only in
    how the attention and matmul sums are split (a KV cache one token at a time against one pass), rounding of
    relative size ~1e-6 on logits of magnitude < 10, far below ``atol=2e-4``."""
    import lightalign.modules.sampling.static as static
    from lightalign.modules.adaptations.layouts import packed_completion_batch
    from lightalign.modules.training.rollout_forward import grpo_forward
    from lightalign.modules.agent.episodes import ToolRollouts
    from lightalign.modules.agent.turns import tool_result_ids

    monkeypatch.setattr(static, "COMPILE_BACKEND", "eager")
    call = call_turn_ids(tokenizer)
    result = tool_result_ids(tokenizer, TOOL_RESULT, eos_ids(tokenizer))
    budget = 96
    assert len(call) + len(result) < budget  # room for a sampled turn after the tool result
    script = ScriptedTurns([call]).install(monkeypatch.setattr)
    rollouts = ToolRollouts([calculate], None, None, None, None)
    batch = {"prompts": [QUESTION], "columns": {"answer": ["6"]}}
    out = rollouts.sample(tiny_model, tokenizer, batch, 4, backend=backend, return_logprobs=True,
                          sampling=dict(max_new_tokens=budget, temperature=temperature, top_p=1.0, top_k=0, min_p=None,
                                        repetition_penalty=1.0, share_prefill=backend != "static",
                                        continuous_config=None),
                          max_prompt_length=None, chat_template_kwargs=None)
    scripted, sampled = script.records[0], script.records[1]
    assert scripted.scripted and not sampled.scripted and len(sampled.ids) == 4  # the backend sampled the 2nd turn
    assert sampled.contexts == [scripted.contexts[0] + call + result] * 4
    assert out["tool_calls"] >= 4  # every trajectory's first turn called the tool
    tool_mask = out["tool_mask"].bool()
    assert (out["completion_ids"][:, : len(call)] == torch.tensor(call)).all()
    assert (~tool_mask[:, len(call): len(call) + len(result)]).all() and tool_mask[:, len(call) + len(result)].all()
    loss_mask = out["completion_mask"] * out["tool_mask"]
    mb = {"prompt_ids": out["prompt_ids"], "prompt_mask": out["prompt_mask"], "completion_ids": out["completion_ids"],
          "completion_mask": loss_mask, "completion_attention_mask": out["completion_mask"]}
    with torch.no_grad():
        padded = grpo_forward(tiny_model, mb, temperature)[0]
        packed = grpo_forward(tiny_model, {**mb, "packed": packed_completion_batch(mb, out["completion_mask"].sum(-1))},
                              temperature)[0]
    trained = loss_mask.bool()
    torch.testing.assert_close(padded[trained], out["sampling_logps"][trained], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(packed[trained], out["sampling_logps"][trained], atol=2e-4, rtol=1e-4)


def test_tool_call_failures_become_messages_never_errors():
    import time

    from lightalign.modules.agent.tools import run_tool_call

    def slow(seconds: int) -> str:
        """Sleep.

        Args:
            seconds: how long
        """
        time.sleep(seconds)
        return "woke"

    def broken(x: int) -> str:
        """Fail.

        Args:
            x: anything
        """
        raise RuntimeError("boom")

    def exits(x: int) -> str:
        """Exit like argparse on a bad argument.

        Args:
            x: anything
        """
        raise SystemExit(2)

    def structured(x: int) -> dict:
        """Return a mapping.

        Args:
            x: anything
        """
        return {"value": x}

    tools = {"calculate": calculate, "slow": slow, "broken": broken, "exits": exits, "structured": structured}
    fn = lambda name, **args: {"type": "function", "function": {"name": name, "arguments": args}}  # noqa: E731
    assert run_tool_call(fn("calculate", expression="2*3"), tools, 1.0).content == "6"
    unknown = run_tool_call(fn("calc", expression="1"), tools, 1.0)
    assert unknown.failed and "no tool 'calc'" in unknown.content and "calculate" in unknown.content
    wrong = run_tool_call(fn("calculate", expr="1"), tools, 1.0)
    assert wrong.failed and "wrong arguments for calculate" in wrong.content
    raised = run_tool_call(fn("broken", x=1), tools, 1.0)
    assert raised.failed and raised.content == "error: RuntimeError: boom"
    start = time.monotonic()
    late = run_tool_call(fn("slow", seconds=30), tools, 0.2)
    assert late.failed and "did not return within 0.2 s" in late.content and time.monotonic() - start < 5
    for timeout in (None, 1.0):  # on this thread, and on a deadline thread
        exited = run_tool_call(fn("exits", x=1), tools, timeout)
        assert exited.failed and "exits exited (sys.exit(2))" in exited.content
    assert run_tool_call(fn("structured", x=3), tools, 1.0).content == '{"value": 3}'  # JSON, not a Python repr
    nameless = run_tool_call({"type": "function", "function": {"arguments": {}}}, tools, 1.0)
    assert nameless.failed and nameless.name == "unknown"


def test_malformed_call_is_answered_with_the_parse_error(tokenizer):
    from lightalign.modules.agent.turns import parse_turn

    prompt = tokenizer.apply_chat_template(QUESTION, tools=[calculate], add_generation_prompt=True, tokenize=True,
                                           return_dict=False)
    bad = tokenizer.encode('<tool_call>{"name": "calc</tool_call><|im_end|>', add_special_tokens=False)
    message, error = parse_turn(tokenizer, bad, prompt, [])
    assert message == {} and "JSON" in error
    good, error = parse_turn(tokenizer, call_turn_ids(tokenizer), prompt, [])
    assert error is None and good["tool_calls"][0]["function"] == {"name": "calculate",
                                                             "arguments": {"expression": "2*3"}}


class CountingEnv:
    """Counts its lifecycle in class-level lists (one instance per trajectory)."""

    resets: list = []
    closed: list = []

    def reset(self, answer: str, prompt: list, **row) -> None:
        CountingEnv.resets.append((answer, prompt[-1]["content"]))
        self.results = []

    def calculate(self, expression: str) -> str:
        """Evaluate integer arithmetic.

        Args:
            expression: e.g. 12*34
        """
        self.results.append(calculate(expression))
        return self.results[-1]

    def get_reward(self) -> float:
        return 2.0 if self.results == ["6"] else 0.0

    def close(self) -> None:
        CountingEnv.closed.append(self)


def test_environment_per_trajectory_owns_the_reward_and_is_closed(tiny_dir, tokenizer, tool_prompts, quiet_trainer,
                                                                 monkeypatch):
    """One environment per trajectory, reset with the row, closed once; its tool is the one the call names, and its
    reward (2.0 for exactly one result "6") is the trajectory's. The turns are scripted: the call, then the answer."""
    from lightalign import GRPOModule

    ScriptedTurns([call_turn_ids(tokenizer), answer_turn_ids(tokenizer)]).install(monkeypatch.setattr)
    CountingEnv.resets, CountingEnv.closed = [], []
    module = GRPOModule(str(tiny_dir), from_config=True, environment_factory=CountingEnv, num_generations=4,
                        max_completion_length=96, learning_rate=0.0)
    assert CountingEnv.closed and not CountingEnv.resets  # the probe instance, built and closed at construction
    probe_closes = len(CountingEnv.closed)
    quiet_trainer(max_steps=1).fit(module, tool_prompts())
    assert CountingEnv.resets == [("6", "What is 2*3?")] * 4
    assert len(CountingEnv.closed) - probe_closes == 4  # every trajectory's environment, once
    assert module.reward_names == ["CountingEnv"] and module.last_samples[0]["CountingEnv"] == 2.0


def test_environments_are_closed_when_scoring_fails(tiny_dir, tool_prompts, quiet_trainer):
    """Whatever the policy sampled, a reward function that raises leaves no environment open."""
    from lightalign import GRPOModule
    from lightalign.rewards import RewardFunctionError

    def failing(prompts, completions, **kw):
        raise ValueError("judge down")

    CountingEnv.closed = []
    module = GRPOModule(str(tiny_dir), from_config=True, environment_factory=CountingEnv, reward_funcs=[failing],
                        num_generations=4, max_completion_length=96, learning_rate=0.0)
    with pytest.raises(RewardFunctionError, match="failing"):
        quiet_trainer(max_steps=1).fit(module, tool_prompts())
    assert len(CountingEnv.closed) == 1 + 4  # the probe, then the rollout's four despite the error


@pytest.mark.parametrize("method", ["GRPOModule", "RLOOModule"])
def test_budget_ends_a_trajectory_after_its_call(method, tiny_dir, tokenizer, tool_prompts, quiet_trainer,
                                                 monkeypatch):
    """No room for the tool result and a next turn: the trajectory ends with its call (not truncated: it has EOS),
    and no second turn is asked. The call is scripted."""
    import lightalign
    from lightalign.rewards import accuracy_reward

    call = call_turn_ids(tokenizer)
    script = ScriptedTurns([call]).install(monkeypatch.setattr)
    module = getattr(lightalign, method)(str(tiny_dir), from_config=True, tools=[calculate],
                                         reward_funcs=[accuracy_reward], num_generations=4,
                                         max_completion_length=len(call) + 3, learning_rate=0.0)
    quiet_trainer(max_steps=1).fit(module, tool_prompts())
    assert [turn.scripted for turn in script.records] == [True]
    (mb,) = module.rollout_buffer.chunks
    assert mb["completion_mask"].sum(-1).tolist() == [len(call)] * 4
    assert module.last_samples[0]["completion"].endswith('[call {"name": "calculate", "arguments": '
                                                         '{"expression": "2*3"}}]')


def test_refusals_name_the_knob(tiny_dir, tool_prompts, prompt_data, quiet_trainer):
    from lightalign import GRPOModule, PPOModule
    from lightalign.rewards import accuracy_reward

    def undocumented(x):
        return x

    with pytest.raises(ValueError, match="'undocumented' cannot be described"):
        GRPOModule(str(tiny_dir), from_config=True, tools=[undocumented], reward_funcs=[accuracy_reward])
    with pytest.raises(ValueError, match="max_tool_calling_iterations must be >= 1"):
        GRPOModule(str(tiny_dir), from_config=True, tools=[calculate], reward_funcs=[accuracy_reward],
                   max_tool_calling_iterations=0)
    with pytest.raises(ValueError, match="max_tool_calling_iterations is set but there are no tools"):
        GRPOModule(str(tiny_dir), from_config=True, reward_funcs=[accuracy_reward], max_tool_calling_iterations=2)
    with pytest.raises(TypeError, match="PPOModule has no knob 'tools'; GRPOModule and RLOOModule take it"):
        PPOModule(str(tiny_dir), from_config=True, tools=[calculate], reward_funcs=[accuracy_reward])
    with pytest.raises(ValueError, match="needs reward_funcs"):
        GRPOModule(str(tiny_dir), from_config=True, tools=[calculate])
    with pytest.raises(ValueError, match="Two tools are named 'calculate' in the tools knob and the environment's"):
        GRPOModule(str(tiny_dir), from_config=True, tools=[calculate], environment_factory=CountingEnv)
    # string prompts cannot carry the tool list
    module = GRPOModule(str(tiny_dir), from_config=True, tools=[calculate], reward_funcs=[accuracy_reward],
                        num_generations=4, max_completion_length=8)
    with pytest.raises(ValueError, match="tools need conversational prompts"):
        quiet_trainer(max_steps=1).fit(module, prompt_data())
    # a tokenizer whose calls cannot be read back: tests/online_rl/test_tool_templates.py


class FailingResetEnv(CountingEnv):
    def reset(self, answer: str, **row) -> None:
        raise KeyError("sandbox")


def test_an_environment_whose_reset_raises_is_named_with_the_row(tiny_dir, tool_prompts, quiet_trainer):
    from lightalign import GRPOModule
    from lightalign.modules.agent.environments import EnvironmentCallError

    CountingEnv.closed = []
    module = GRPOModule(str(tiny_dir), from_config=True, environment_factory=FailingResetEnv, num_generations=4,
                        max_completion_length=96, learning_rate=0.0)
    with pytest.raises(EnvironmentCallError, match=r"FailingResetEnv.reset raised KeyError on rollout row 0 \(data "
                                                   r"columns \['answer', 'prompt'\]\): 'sandbox'"):
        quiet_trainer(max_steps=1).fit(module, tool_prompts())
    assert len(CountingEnv.closed) == 1 + 4  # the probe, then every environment of the failed rollout


def test_a_prompt_too_long_with_its_tool_list_is_refused_at_fit_start(tiny_dir, tool_prompts, quiet_trainer):
    """The tool list is rendered into every prompt: one that no longer fits data.max_prompt_length is refused before
    any rollout (cutting it would cut the tool list)."""
    from lightalign import GRPOModule
    from lightalign.rewards import accuracy_reward

    module = GRPOModule(str(tiny_dir), from_config=True, tools=[calculate], reward_funcs=[accuracy_reward],
                        num_generations=4, max_completion_length=8)
    module.generate = lambda *a, **k: pytest.fail("refused after sampling started")
    with pytest.raises(ValueError, match=r"training prompt 0 is \d+ tokens with the tool list rendered, more than "
                                         r"data.max_prompt_length \(64\)"):
        quiet_trainer(max_steps=1).fit(module, tool_prompts(max_prompt_length=64))
