"""A tool plugin: one class, named with its options under ``tools`` in a run config
(``tools: {calculator: {class: "examples.plugins.calculator:Calculator", digits: 4}}``;
docs/guides/plugins.md). A workflow calls it as ``tools["calculator"]`` from its ``rollout``.

:class:`Calculator` evaluates an arithmetic expression (numbers, + - * / // % **, parentheses) read with
:mod:`ast`, never ``eval``. As every tool, it answers in text and never raises for a failed call: a bad expression
is an answer the agent sees.
"""
from __future__ import annotations

import ast
import operator

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}


class Calculator:
    """An async tool: ``await calculator("3*(4+5)")`` -> ``"27"``.

    Args:
        digits: significant digits of a result that is not a whole number (1-17).

    Attributes:
        calls: calls so far; ``errors``: failed calls by kind (RaaS reports both on ``metrics``).

    Raises:
        ValueError: ``digits`` out of range.
    """

    def __init__(self, digits: int = 6):
        if not 1 <= digits <= 17:
            raise ValueError(f"tool calculator: digits must be in 1..17, got {digits}")
        self.digits, self.calls, self.errors = digits, 0, {}

    async def __call__(self, expression: str) -> str:
        self.calls += 1
        try:
            value = self._eval(ast.parse(expression.strip(), mode="eval").body)
        except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as e:
            kind = type(e).__name__
            self.errors[kind] = self.errors.get(kind, 0) + 1
            return f"error: {kind}: {e}"
        return str(int(value)) if float(value).is_integer() else f"{value:.{self.digits}g}"

    def _eval(self, node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = self._eval(node.left), self._eval(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent above 64")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            value = self._eval(node.operand)
            return -value if isinstance(node.op, ast.USub) else value
        raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")
