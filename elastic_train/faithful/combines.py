"""Collectives a loop makes after its steps: they combine what each rank kept across the steps.

A loop that sums each rank's losses or correct predictions over an epoch and all-reduces the sums at
the epoch's end (`dist.all_reduce(total)` after `for batch in loader:`) computes a whole epoch's
metric on Ray Train, which re-runs the epoch at the new world. Gone on in place, the lost rank's sums
would be missing from it. So where the loop's function, standing inside its step loop, makes such a
collective after that loop, going on in place is not faithful (supervisor/policy.py `unfaithful`,
through a `PlaceRead` of "combined" that no new place keeps). A collective inside the step loop
combines that step's values only, and goes on. Unsure (no source): nothing is claimed.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from functools import lru_cache
from types import CodeType, FrameType

from elastic_train.faithful.sites import short_path, source_of
from elastic_train.protocol import PlaceRead

COMBINING = frozenset({"all_reduce", "reduce", "all_gather", "all_gather_object", "all_gather_into_tensor",
                       "gather", "gather_object", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
                       "all_to_all_single", "all_reduce_coalesced"})


def combined_after_steps(frame: FrameType | None, user: Callable[[str], bool]) -> tuple[PlaceRead, ...]:
    """For each frame of the loop's (`user(file)`) from `frame` up, the collectives its function makes
    after the loop statement it stands in: one `PlaceRead` ("combined", the world size) each."""
    found = []
    while frame is not None:
        code = frame.f_code
        if user(code.co_filename):
            for line, text in _after_loop(code, frame.f_lineno):
                found.append(PlaceRead(f"{short_path(code.co_filename)}:{line}", "combined", -1, True, text))
        frame = frame.f_back
    return tuple(found)


@lru_cache(maxsize=1024)
def _after_loop(code: CodeType, line: int) -> tuple[tuple[int, str], ...]:
    """(line, text) of each collective call of `code`'s function placed after the innermost loop
    statement that holds `line` (its step loop), within the loops around it."""
    source = source_of(code.co_filename)
    if source is None:
        return ()
    function = next((node for node in source.parents.values() if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                     and node.lineno <= code.co_firstlineno <= (node.end_lineno or 0)
                     and _first_line(node) == code.co_firstlineno), None)
    if function is None:
        return ()
    loops = [node for node in ast.walk(function) if isinstance(node, (ast.For, ast.AsyncFor, ast.While))
             and node.lineno <= line <= (node.end_lineno or node.lineno)]
    if not loops:
        return ()
    step_loop = max(loops, key=lambda node: node.lineno)  # the innermost
    outer = [node for node in loops if node is not step_loop]
    scope = max(outer, key=lambda node: node.lineno) if outer else function
    found = []
    for node in ast.walk(scope):
        if isinstance(node, ast.Call) and node.lineno > (step_loop.end_lineno or step_loop.lineno) \
                and _called(node) in COMBINING:
            found.append((node.lineno, source.lines[node.lineno - 1].strip()))
    return tuple(found)


def _first_line(function: ast.AST) -> int:
    """The line a function's code object starts at: its first decorator's, else its `def`'s."""
    decorators = getattr(function, "decorator_list", [])
    return min([d.lineno for d in decorators] + [function.lineno])


def _called(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
