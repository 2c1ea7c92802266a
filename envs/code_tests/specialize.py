"""A variant's source text from a reference solution: ``specialize(function, **parameters)``.

The reference solutions (``reference_solutions``) are typed functions that read their family's
parameters from module-level names. A variant's source is the function's own source (parsed, then
written back by ``ast.unparse``: comments and layout do not survive) where

- every parameter read is replaced by the variant's value as a literal, and every ``Final`` constant
  by its value;
- every branch that the values decide is folded away: ``if LOWERCASE: ...`` goes with its body when
  LOWERCASE is False, ``a if KEEP_REST else b`` becomes ``b``, ``RESULT == "count"`` becomes
  ``True`` or ``False`` first (only ``==``, ``!=``, ``is``, ``is not`` and ``not`` are decided);
- the annotations are dropped: they are for the type checker, and would name what the sandbox lacks.

The text must stand alone in the sandbox, whose Python may be as old as ``MIN_PYTHON``: a reference
that reads any other module-level name, or that a parser of that version refuses, is an error.
"""

from __future__ import annotations

import ast
import copy
import inspect
import operator
import textwrap
import typing
from collections.abc import Callable
from types import ModuleType
from typing import Any

from envs.sandbox.isolation import MIN_PYTHON

_DECIDED: dict[type[ast.cmpop], Callable[[Any, Any], bool]] = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Is: operator.is_,
    ast.IsNot: operator.is_not,
}


def specialize(function: Callable[..., object], name: str | None = None, **parameters: object) -> str:
    """The source of ``function`` for one variant, defining ``name`` (the function's own by default).

    ``parameters`` give a value to every module-level name that ``function`` reads, ``Final``
    constants aside, and to nothing else. Raises ValueError, naming the function, when they do not,
    and for a value with no literal form.
    """
    module = inspect.getmodule(function)
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    definition = tree.body[0]
    where = f"specialize({function.__qualname__})"
    if module is None or not isinstance(definition, ast.FunctionDef) or definition.decorator_list:
        raise ValueError(f"{where}: only a plain module-level function can be specialized")
    definition = _Unannotate().visit(definition)
    read = {
        node.id
        for node in ast.walk(definition)
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in vars(module)
    }
    constants = _final_names(module)
    if set(parameters) != read - constants:  # the source has to run on its own
        raise ValueError(
            f"{where}: the function reads the module-level names {sorted(read - constants)} "
            f"(Final constants aside), the variant gives {sorted(parameters)}"
        )
    values = {**{n: vars(module)[n] for n in read & constants}, **parameters}
    literals = {n: _literal(value, f"{where}: {n}") for n, value in values.items()}
    definition = _Specializer(literals).visit(definition)
    definition.name = name or definition.name
    for node in ast.walk(definition):
        body = getattr(node, "body", None)
        if isinstance(body, list) and not body:  # a branch folded away was all there was
            body.append(ast.Pass())
    source = ast.unparse(ast.fix_missing_locations(definition)) + "\n"
    ast.parse(source, feature_version=MIN_PYTHON)  # SyntaxError: not the sandbox's oldest Python
    return source


def _final_names(module: ModuleType) -> set[str]:
    hints = inspect.get_annotations(module, eval_str=True)
    return {n for n, hint in hints.items() if hint is typing.Final or typing.get_origin(hint) is typing.Final}


def _literal(value: object, what: str) -> ast.expr:
    """``value`` as an expression that evaluates to an equal value of the same type."""
    try:
        node = ast.parse(repr(value), mode="eval").body
        same = type(ast.literal_eval(node)) is type(value) and ast.literal_eval(node) == value
    except (SyntaxError, ValueError):
        same = False
    if not same:
        raise ValueError(f"{what}={value!r} has no literal form")
    return node


class _Unannotate(ast.NodeTransformer):
    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.FunctionDef:
        node.returns = None
        self.generic_visit(node)
        return node

    def visit_arg(self, node: ast.arg) -> ast.arg:
        node.annotation = None
        return node

    def visit_AnnAssign(self, node: ast.AnnAssign) -> ast.Assign | None:
        if node.value is None:  # a bare declaration
            return None
        return ast.Assign(targets=[node.target], value=node.value)


class _Specializer(ast.NodeTransformer):
    """Writes the literals in and folds what they decide; children first, so decisions propagate up."""

    def __init__(self, literals: dict[str, ast.expr]) -> None:
        self.literals = literals

    def visit_Name(self, node: ast.Name) -> ast.expr:
        if isinstance(node.ctx, ast.Load) and node.id in self.literals:
            return copy.deepcopy(self.literals[node.id])
        return node

    def visit_Compare(self, node: ast.Compare) -> ast.expr:
        self.generic_visit(node)
        left, right = node.left, node.comparators[0]
        decide = _DECIDED.get(type(node.ops[0])) if len(node.ops) == 1 else None
        if decide and isinstance(left, ast.Constant) and isinstance(right, ast.Constant):
            return ast.Constant(decide(left.value, right.value))
        return node

    def visit_UnaryOp(self, node: ast.UnaryOp) -> ast.expr:
        self.generic_visit(node)
        if isinstance(node.op, ast.Not) and isinstance(node.operand, ast.Constant):
            return ast.Constant(not node.operand.value)
        return node

    def visit_IfExp(self, node: ast.IfExp) -> ast.expr:
        self.generic_visit(node)
        if isinstance(node.test, ast.Constant):
            return node.body if node.test.value else node.orelse
        return node

    def visit_If(self, node: ast.If) -> ast.stmt | list[ast.stmt]:
        self.generic_visit(node)
        if isinstance(node.test, ast.Constant):
            return node.body if node.test.value else node.orelse
        return node
