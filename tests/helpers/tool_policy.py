"""A tiny policy that really calls a tool: the shipped tiny model fitted (a few seconds, once per test session) to
answer ``What is 2*3?`` with a ``calculate`` call, and the tool's result with ``6``; then sharpened so that it follows
that path at any temperature up to 1 (``fit_tool_policy``). The tests that run the ``lightalign`` console script use
it (no Python stand-in can be put into that process); the in-process tool tests script their turns instead
(``helpers.scripted_turns``).

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


MARGIN = 40.0  # nats, at temperature 1: the fitted policy's least margin at a target (see fit_tool_policy)
FIT_MARGIN = 1.0  # nats: the least margin the fit itself must reach before the sharpening multiplies it


def fit_tool_policy(tiny_dir: Path, out: Path, steps: int = 300) -> Path:
    """Fit the tiny model on the two turns (call, then answer) and the plain answer to another prompt, sharpen it,
    check it, save it to ``out`` (kept: a later call returns ``out`` at once).

    The fit stops once every target token is the argmax by at least ``FIT_MARGIN`` nats, and raises if that did not
    happen within ``steps`` (a half-fitted policy would make the tests that use it depend on their draws). Then the
    final norm's weight (``model.model.norm.weight``) is multiplied by ``c = 1.25 * MARGIN / least margin``: the
    logits are ``lm_head(norm(h))`` with no bias and that norm is applied only to the last hidden state, so every
    logit is multiplied by ``c`` — with tied word embeddings too, since scaling the norm leaves the embedding matrix
    (``lm_head``'s weight) alone. The least margin between a target's logit and the best other one, measured again
    after the scaling, must be at least ``MARGIN``; at temperature ``T <= 1`` a token then leaves the fitted path
    with probability below ``(vocab - 1) * exp(-MARGIN / T) < 1e-14`` (vocabulary 1024), so every rollout of the
    fitted prompt calls the tool and answers ``6``."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from lightalign.modules.agent.turns import tool_result_ids

    if (out / "model.safetensors").exists():
        return out
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir) if (tiny_dir / "model.safetensors").exists() else \
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_dir))
    if model.lm_head.bias is not None:
        raise RuntimeError("fit_tool_policy sharpens by scaling model.model.norm.weight, which scales the logits only "
                           "when lm_head has no bias.")
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
    batch = []
    for context, target, weight in sequences:
        ids = torch.tensor([context + target])
        labels = torch.tensor([[-100] * len(context) + [t if w else -100 for t, w in zip(target, weight)]])
        batch.append((ids, labels))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for step in range(steps):
        loss, margins = 0.0, []
        for ids, labels in batch:
            forward = model(input_ids=ids, labels=labels)
            loss = loss + forward.loss
            margins.append(_target_margins(forward.logits.detach(), labels))
        if torch.cat(margins).min() >= FIT_MARGIN:
            break
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        least = _least_margin(model, batch)
        if not least >= FIT_MARGIN:
            raise RuntimeError(f"The tool policy did not fit in {steps} steps: the least margin of a target token over "
                               f"the best other token is {least:.4f} nats (needed: {FIT_MARGIN}); raise steps.")
        model.model.norm.weight.mul_(1.25 * MARGIN / least)
        sharpened = _least_margin(model, batch)
    if not sharpened >= MARGIN:
        raise RuntimeError(f"The sharpened tool policy's least target margin is {sharpened:.2f} nats, below {MARGIN} "
                           f"(before scaling model.model.norm.weight by {1.25 * MARGIN / least:.3f}: {least:.4f}).")
    print(f"tool policy fitted in {step} steps; least target margin {least:.3f} nats, {sharpened:.1f} sharpened")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _target_margins(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """At each scored position, the target's logit minus the best other logit (positive: the target is the argmax)."""
    targets = labels[0, 1:]
    scored = targets != -100
    logits, targets = logits[0, :-1][scored].float(), targets[scored]
    chosen = logits.gather(-1, targets[:, None])[:, 0]
    others = logits.scatter(-1, targets[:, None], float("-inf")).max(-1).values
    return chosen - others


def _least_margin(model, batch) -> float:
    return min(_target_margins(model(input_ids=ids).logits, labels).min().item() for ids, labels in batch)
