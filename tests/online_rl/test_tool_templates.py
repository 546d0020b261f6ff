"""The response template that reads a policy's tool calls (modules/agent/response_templates.py): chosen for the chat
template's family without the user writing one, and proven by a round trip at fit start, so tool RL never silently
becomes plain RL.

Each family is trained on a tiny model of that family (``assets/models/tiny`` Qwen/Hermes, ``tiny-llama3``,
``tiny-mistral``; assets/build_tool_families.py), none with a response template in its tokenizer. The call turn and the
answer turn are scripted (``helpers.scripted_turns``): the random policy never writes a call by itself.
"""

from __future__ import annotations

import json

import pytest

from helpers import console_script
from helpers.scripted_turns import ScriptedTurns
from helpers.tool_policy import QUESTION

CALL = {"name": "calculate", "arguments": {"expression": "2*3"}}
# family folder -> (the call turn's text, the answer turn's text, the end-of-turn token), each as that family writes it
FAMILIES = {
    "tiny": ('<tool_call>{"name": "calculate", "arguments": {"expression": "2*3"}}</tool_call>', "6", "<|im_end|>",
             "Qwen/Hermes <tool_call>"),
    "tiny-llama3": ('{"name": "calculate", "parameters": {"expression": "2*3"}}', "6", "<|eot_id|>", "Llama 3.x JSON"),
    "tiny-mistral": ('[TOOL_CALLS] [{"name": "calculate", "arguments": {"expression": "2*3"}}]', " 6", "</s>",
                     "Mistral [TOOL_CALLS]"),
}


def turn_ids(tokenizer, text: str, end: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False) + [tokenizer.convert_tokens_to_ids(end)]


def without_response_template(folder, out):
    """The folder's tokenizer saved to ``out`` with no ``response_template`` (the family must be recognised)."""
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(folder).save_pretrained(out)
    config_file = out / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.pop("response_template", None)
    config_file.write_text(json.dumps(config))
    return out


def prompts_file(tmp_path, rows=4):
    path = tmp_path / "tool_prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": QUESTION, "answer": "6"}) + "\n" for _ in range(rows)))
    return path


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_familys_call_is_read_and_the_tool_runs_without_a_hand_written_template(family, repo, tmp_path,
                                                                                   quiet_trainer, monkeypatch):
    """GRPO with tools on a tiny model of each family, its tokenizer without a response template: the template is
    recognised from the chat template (the fit-start note says which and how), the scripted call is parsed, the tool
    runs with its arguments, and tools/call_frequency is 1."""
    from transformers import AutoTokenizer

    from lightalign import GRPOModule, PromptDataModule
    from lightalign.rewards import accuracy_reward

    folder = repo / "assets" / "models" / family
    plain = without_response_template(folder, tmp_path / "tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(plain)
    call_text, answer_text, end, family_name = FAMILIES[family]
    calls = []

    def calculate(expression: str) -> str:
        """Evaluate integer arithmetic.

        Args:
            expression: e.g. 12*34
        """
        calls.append(expression)
        return str(eval(expression, {"__builtins__": {}}))  # noqa: S307 - fixed test input

    ScriptedTurns([turn_ids(tokenizer, call_text, end), turn_ids(tokenizer, answer_text, end)]).install(
        monkeypatch.setattr)
    module = GRPOModule(str(folder), from_config=True, tools=[calculate], reward_funcs=[accuracy_reward],
                        num_generations=4, max_completion_length=96, learning_rate=0.0, generation_backend="generate")
    trainer = quiet_trainer(max_steps=1)
    trainer.fit(module, PromptDataModule(str(prompts_file(tmp_path)), tokenizer=str(plain), max_prompt_length=512))

    assert module.tool_rollouts.template_note == (
        f"tool calls read by the response_template recognised as {family_name} from the chat template's call syntax "
        "(round trip of a call checked)")
    assert calls == ["2*3"] * 4  # every trajectory's call was parsed and ran with its arguments
    assert float(trainer.callback_metrics["train/tools/call_frequency"]) == 1.0
    assert float(trainer.callback_metrics["train/tools/failure_frequency"]) == 0.0


def test_a_template_of_no_known_family_is_refused_naming_the_knob(tmp_path, tiny_dir, quiet_trainer):
    """A chat template whose call syntax matches no shipped family, with no response template anywhere: refused at fit
    start, naming model.response_template and how to write one, pointing at nothing that is not installed."""
    from lightalign import GRPOModule, PromptDataModule
    from lightalign.rewards import accuracy_reward

    from helpers.tool_policy import calculate

    plain = without_response_template(tiny_dir, tmp_path / "odd")
    template_file = plain / "chat_template.jinja"
    template_file.write_text(template_file.read_text().replace("<tool_call>", "<<CALL>>"))
    module = GRPOModule(str(tiny_dir), from_config=True, tools=[calculate], reward_funcs=[accuracy_reward],
                        num_generations=4, max_completion_length=8)
    data = PromptDataModule(str(prompts_file(tmp_path)), tokenizer=str(plain), max_prompt_length=512)
    with pytest.raises(ValueError, match="writes tool calls in a format lightalign does not recognise") as err:
        quiet_trainer(max_steps=1).fit(module, data)
    message = str(err.value)
    assert "Give model.response_template" in message and "Llama 3.x JSON" in message
    assert "trl" not in message.lower()


MISMATCH_CONFIG = """
seed_everything: 0
trainer: {{accelerator: cpu, devices: 1, max_steps: 1, logger: false, enable_checkpointing: false,
          enable_progress_bar: false, num_sanity_val_steps: 0, default_root_dir: {root}}}
model:
  class_path: lightalign.GRPOModule
  init_args:
    model_name_or_path: assets/models/tiny-llama3
    from_config: true
    environment_factory: examples.agent.calculator.CalculatorEnv
    num_generations: 4
    max_completion_length: 16
    response_template: {template}
data:
  class_path: lightalign.PromptDataModule
  init_args: {{path: {data}, max_prompt_length: 512}}
"""


def test_a_response_template_that_does_not_read_the_chat_templates_calls_is_refused_at_fit_start(repo, tmp_path):
    """The new user's case: the Qwen-style <tool_call> response template given to a Llama-3.1-style model. Before
    any rollout the run stops (status 1); the first line names model.response_template, where it came from, and
    what it read instead of the rendered call."""
    from lightalign.modules.agent.response_templates import HERMES_TOOL_CALL

    config = tmp_path / "mismatch.yaml"
    config.write_text(MISMATCH_CONFIG.format(template=json.dumps(HERMES_TOOL_CALL), data=prompts_file(tmp_path),
                                             root=tmp_path / "runs"))  # the run folder outside the checkout
    proc = console_script.run(repo, "fit", "--config", str(config))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-4000:]
    first = proc.stderr.strip().splitlines()[0] if proc.stderr.strip() else ""
    errors = [line for line in proc.stderr.splitlines() if line.startswith("lightalign: error:")]
    assert errors and errors[0].startswith(
        "lightalign: error: tools: the response_template (given by model.response_template) does not read the tool "
        "calls the chat template of 'assets/models/tiny-llama3' writes"), out[-4000:]
    assert "found no tool call in it" in errors[0] and '"parameters"' in errors[0]
    assert first == errors[0], f"the refusal is not the first line:\n{proc.stderr[:2000]}"
