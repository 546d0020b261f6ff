"""A tiny policy that really calls a tool: the shipped tiny model fitted (a few seconds, cached per session) to
answer ``What is 2*3?`` with a ``calculate`` call, and the tool's result with ``6``.

The call's ids are deliberately *not* the tokenizer's canonical tokenisation of its text (``calculate`` is spelled
one character a token), so a rollout that decoded the sampled turn and tokenised it again would hold other ids
than the sampled ones: the exact-token tests fail under that mutation.
"""

from __future__ import annotations

from pathlib import Path

import torch

QUESTION = [{"role": "user", "content": "What is 2*3?"}]
OTHER = [{"role": "user", "content": "Say hi."}]


def calculate(expression: str) -> str:
    """Evaluate integer arithmetic.

    Args:
        expression: e.g. 12*34
    """
    return str(eval(expression, {"__builtins__": {}}))  # noqa: S307 - test tool on fixed inputs


def call_turn_ids(tokenizer) -> list[int]:
    """The assistant turn that calls the tool, non-canonically tokenised, ending with ``<|im_end|>``."""
    head = tokenizer.encode('<tool_call>{"name": "', add_special_tokens=False)
    name = [tokenizer.convert_tokens_to_ids(c) for c in "calculate"]
    tail = tokenizer.encode('", "arguments": {"expression": "2*3"}}</tool_call>', add_special_tokens=False)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = head + name + tail + [end]
    assert ids != tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False), "must be non-canonical"
    return ids


def fit_tool_policy(tiny_dir: Path, out: Path, steps: int = 300) -> Path:
    """Fit the tiny model on the two turns (call, then answer) and the plain answer to another prompt; save it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lightalign.modules.agent.turns import tool_result_ids

    if (out / "model.safetensors").exists():
        return out
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir) if (tiny_dir / "model.safetensors").exists() else \
        AutoModelForCausalLM.from_config(__import__("transformers").AutoConfig.from_pretrained(tiny_dir))
    eos = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    prompt = tokenizer.apply_chat_template(QUESTION, tools=[calculate], add_generation_prompt=True, tokenize=True,
                                           return_dict=False)
    call = call_turn_ids(tokenizer)
    result = tool_result_ids(tokenizer, [{"role": "tool", "name": "calculate", "content": "6"}], eos)
    answer = tokenizer.encode("6", add_special_tokens=False) + eos
    other = tokenizer.apply_chat_template(OTHER, tools=[calculate], add_generation_prompt=True, tokenize=True,
                                          return_dict=False)
    hi = tokenizer.encode("hi", add_special_tokens=False) + eos
    sequences = [(list(prompt), call + result + answer, [1] * len(call) + [0] * len(result) + [1] * len(answer)),
                 (list(other), hi, [1] * len(hi))]
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    batch = []
    for context, target, weight in sequences:
        ids = torch.tensor([context + target])
        labels = torch.tensor([[-100] * len(context) + [t if w else -100 for t, w in zip(target, weight)]])
        batch.append((ids, labels))
    for step in range(steps):
        loss, learned = 0.0, True
        for ids, labels in batch:
            forward = model(input_ids=ids, labels=labels)
            loss = loss + forward.loss
            scored = labels[0, 1:] != -100  # learned: every target is the greedy token
            learned &= bool((forward.logits[0, :-1].argmax(-1)[scored] == labels[0, 1:][scored]).all())
        if learned and loss.item() < 0.05:
            print(f"tool policy fitted in {step} steps")
            break
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
