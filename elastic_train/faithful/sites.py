"""Where a loop reads its place, and whether it holds what it read: the static half of faithfulness.

A *site* is the expression in the loop's source that read its rank, world size or the like (a call of
`get_context().get_world_rank()`, `dist.get_world_size()`, `os.environ["RANK"]`, `len(loader)`,
`DistributedSampler(...)`). The site *holds* its value when the value (or anything made from it)
outlives the statement: assigned to a name or attribute, a `for`'s iterable, a `with ... as`, a
`return` or lambda body, a default argument, or anything not known to drop it. It is *used where read*
when the statement drops it once done: an `if`/`while`/`assert` condition, or an expression statement
(`loss.div_(dist.get_world_size())`). It is *logged* when it is an argument of a call named as logging
is (`print`, `logger.info`, `log_metrics`, `writer.add_scalar`, `bar.set_postfix`), or written out
(`f.write(json.dumps(record))`, `json.dump(record, f)`): it shapes no value the loop computes. Unsure counts as held: a held value the recovery changes makes the loop re-enter, as
Ray Train's would, never go on wrongly.
"""

from __future__ import annotations

import ast
import linecache
import re
from dataclasses import dataclass
from functools import lru_cache


HELD, USED, LOGGED = "held", "used", "logged"
FRAME, STEP = "frame", "step"
_LOGGING = re.compile(r"^(print|pprint|log\w*|\w+_log|info|debug|warn|warning|error|exception|critical|"
                      r"add_scalars?|set_postfix\w*|set_description\w*|write|writelines|dump)$")


@dataclass(frozen=True)
class Site:
    """One read's place in the source: `file:line`, what its statement does with it, and its text."""

    file: str
    line: int
    use: str  # HELD, USED or LOGGED
    text: str  # the statement's first line, stripped
    # HELD in local names of its function alone, each used there where read (sites of USED or LOGGED):
    # FRAME, held only while that function runs (a helper's `rank = ctx.get_world_rank()` then
    # `if rank == 0: save()`); STEP, assigned afresh in each pass of a loop, spent with the step as a
    # USED read is (`world = ctx.get_world_size()` then `if world > 1: ...`); None: held. One whose
    # names are only logged (`record = {"rank": ...}` then `f.write(json.dumps(record))`) is LOGGED.
    spent_with: str | None = None

    @property
    def held(self) -> bool:
        return self.use == HELD

    @property
    def where(self) -> str:
        return f"{short_path(self.file)}:{self.line}"


def use_of(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> str:
    """What the statement around `node` does with `node`'s value: HELD (kept, or a value made from it
    is), USED (dropped once the statement is done) or LOGGED (an argument of a logging call)."""
    child = node
    while True:
        parent = parents.get(child)
        if isinstance(parent, ast.Call) and child is not parent.func and _LOGGING.match(_name(parent.func)):
            return LOGGED
        if isinstance(parent, ast.Call) and _name(parent.func) == "prepare_data_loader" and isinstance(node, ast.Call) \
                and _name(node.func) == "DistributedSampler":
            return USED  # handed to prepare_data_loader, which keeps its shuffle, seed and drop_last, not its world
        if parent is None or isinstance(parent, (ast.Lambda, ast.Return, ast.Yield, ast.YieldFrom,
                                                 ast.arguments, ast.NamedExpr, ast.comprehension)):
            return HELD
        if isinstance(parent, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            return HELD if child is parent.value else USED  # in a target (`buf[rank] = x`): an index
        if isinstance(parent, (ast.For, ast.AsyncFor)):
            return HELD if child is parent.iter else USED
        if isinstance(parent, ast.withitem):
            return HELD if parent.optional_vars is not None else USED
        if isinstance(parent, (ast.If, ast.While, ast.Assert)):
            return USED if child is parent.test else HELD
        if isinstance(parent, ast.Expr):
            return USED
        if isinstance(parent, ast.stmt):
            return HELD
        child = parent


def _name(func: ast.expr) -> str:
    """The name a call is made by: `print`, `info` of `logger.info`."""
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


@dataclass
class Source:
    """A file's syntax tree, its nodes by exact span, and each node's parent."""

    spans: dict[tuple[int, int, int, int], ast.AST]
    parents: dict[ast.AST, ast.AST]
    lines: list[str]


@lru_cache(maxsize=256)
def source_of(file: str) -> Source | None:
    lines = linecache.getlines(file)
    if not lines:
        return None
    try:
        tree = ast.parse("".join(lines))
    except (SyntaxError, ValueError):
        return None
    spans: dict[tuple[int, int, int, int], ast.AST] = {}
    parents: dict[ast.AST, ast.AST] = {}
    for parent in ast.walk(tree):
        for child in ast.iter_child_nodes(parent):
            parents[child] = parent
            if isinstance(child, ast.expr):
                spans.setdefault((child.lineno, child.col_offset, child.end_lineno, child.end_col_offset), child)
    return Source(spans, parents, lines)


def site(file: str, line: int, position: tuple[int | None, int | None, int | None, int | None]) -> Site:
    """The site of the expression at `position` (line, end line, column, end column: a frame's
    instruction position, `co_positions()`) in `file`: held unless its statement is known to drop it."""
    source = source_of(file)
    start, end, column, end_column = position
    node = source.spans.get((start, column, end, end_column)) if source is not None else None  # type: ignore[arg-type]
    text = source.lines[line - 1].strip() if source is not None and 0 < line <= len(source.lines) else ""
    use = HELD if node is None else use_of(node, source.parents)
    spent = spent_with(node, source.parents) if use == HELD else None
    return Site(file, line, LOGGED, text) if spent == LOGGED else Site(file, line, use, text, spent)


def spent_with(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> str | None:
    """When a HELD `node`'s value is spent (Site.spent_with): it must be assigned to local names of
    the function it is read in, each of whose uses there drops it. LOGGED: each use logs it."""
    statement = statement_of(node, parents)
    if not isinstance(statement, ast.Assign) or not all(isinstance(t, ast.Name) for t in statement.targets):
        return None
    function, in_loop = parents.get(statement), False
    while function is not None and not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
        in_loop = in_loop or isinstance(function, (ast.For, ast.AsyncFor, ast.While))
        function = parents.get(function)
    if function is None:
        return None
    names = {t.id for t in statement.targets}  # type: ignore[attr-defined]
    uses = set()
    for inner in ast.walk(function):
        if isinstance(inner, (ast.Global, ast.Nonlocal)) and names & set(inner.names):
            return None
        if isinstance(inner, ast.Name) and inner.id in names and isinstance(inner.ctx, ast.Load):
            uses.add(use_of(inner, parents))
    if HELD in uses:
        return None
    return LOGGED if uses == {LOGGED} else STEP if in_loop else FRAME


def statement_of(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> ast.AST:
    """The statement that holds `node`."""
    while not isinstance(node, ast.stmt) and node in parents:
        node = parents[node]
    return node


def parents_of(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}


def short_path(file: str) -> str:
    """`file` as a message names it: its last two path parts."""
    parts = file.replace("\\", "/").split("/")
    return "/".join(parts[-2:])
