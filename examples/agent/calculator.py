"""The tool-calling demo's tool and environment (docs/tools.md): a calculator the policy calls, and an environment
that owns the reward.

    lightalign fit --config configs/tools_sft.yaml      # 1. teach the tiny model the tool-call format
    lightalign fit --config configs/tools_grpo.yaml     # 2. GRPO with the calculator: the reward rises
"""

from __future__ import annotations

import ast
import operator

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.USub: operator.neg}


def _evaluate(node: ast.AST) -> int:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    raise ValueError("only integers with + - * are allowed")


def calculate(expression: str) -> str:
    """Evaluate integer arithmetic.

    Args:
        expression: e.g. 12*34
    """
    return str(_evaluate(ast.parse(expression, mode="eval")))


class CalculatorEnv:
    """One arithmetic question per trajectory: the policy may call ``calculate``. The environment owns the reward
    (``get_reward``): 1 when a call computed the row's ``answer``, 0.5 for a call that ran but computed something
    else, 0 without a call that ran (none, or only malformed ones)."""

    def __init__(self) -> None:
        self.answer = ""
        self.results: list[str] = []

    def reset(self, answer: str, **row) -> None:
        self.answer, self.results = str(answer), []

    def calculate(self, expression: str) -> str:
        """Evaluate integer arithmetic.

        Args:
            expression: e.g. 12*34
        """
        result = calculate(expression)
        self.results.append(result)
        return result

    def get_reward(self) -> float:
        if self.answer in self.results:
            return 1.0
        return 0.5 if self.results else 0.0
