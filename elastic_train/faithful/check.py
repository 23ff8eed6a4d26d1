"""`elastic-train check`: a script's reads of its place, found before it runs.

After a recovery a survivor goes on in place only if its loop holds nothing it read of its old place
(reads.py records those reads as the loop runs; supervisor/policy.py decides). This module finds, in a
script's source without running it, the reads a loop can make (the same ones reads.py records), says
what each statement does with its value (sites.py `use_of`), and how to write a held read so the loop
goes on: a user learns before a run which recoveries will re-enter the loop rather than after one.
Only reads inside a function or lambda count: module-level code runs at import, not in the loop.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from elastic_train.faithful.combines import COMBINING
from elastic_train.faithful.reads import ENV
from elastic_train.faithful.sites import HELD, LOGGED, STEP, USED, parents_of, spent_with, use_of

_METHODS = {"get_world_rank": "rank", "get_world_size": "world_size", "get_local_rank": "local_rank",
            "get_local_world_size": "local_world_size", "get_node_rank": "node_rank"}
_TORCH = {"get_rank": "rank", "get_world_size": "world_size"}  # torch.distributed's: these take a group
_ACCESSORS = {what: name for name, what in _METHODS.items()}  # what -> the get_context() method that reads it
_WORLDS = ("world_size", "local_world_size")
_PREPARE = "prepare_data_loader"


@dataclass(frozen=True)
class Finding:
    """One read of the loop's place: where (1-based line and column), what it reads, what its statement
    does with it (HELD, USED or LOGGED), the line's text, and how to write it so the loop goes on."""

    line: int
    column: int
    what: str
    use: str
    text: str
    advice: str

    @property
    def held(self) -> bool:
        return self.use == HELD


def check_source(source: str, filename: str = "<source>") -> list[Finding]:
    """The reads of its place the loops in `source` can make, in source order (LOGGED ones included).
    Raises SyntaxError (or ValueError) when `source` is not Python."""
    tree = ast.parse(source, filename)
    parents = parents_of(tree)
    lines = source.splitlines()
    imported = _imported(tree)
    scaling = _scaling_loaders(tree)
    found: list[Finding] = []
    for node in ast.walk(tree):
        read = _read(node, imported, scaling)
        if read is None or not _in_function(node, parents):
            continue
        what, kind = read
        use = use_of(node, parents)
        spent = spent_with(node, parents) if use == HELD else None
        if spent == LOGGED:
            use = LOGGED  # assigned to names that are only logged
        elif spent == STEP:
            use = USED  # assigned afresh each pass of a loop and only used: spent with its step
        text = lines[node.lineno - 1].strip() if 0 < node.lineno <= len(lines) else ""
        found.append(Finding(node.lineno, node.col_offset + 1, what, use, text, _advice(node, what, kind, use)))
    found += _combined(tree, parents, lines, scaling)
    return sorted(found, key=lambda f: (f.line, f.column))


def _combined(tree: ast.AST, parents: dict[ast.AST, ast.AST], lines: list[str], loaders: set[str]) -> list[Finding]:
    """The collectives made after a loop over a prepared loader, within the loop or function around it
    (combines.py: per-rank values combined across the steps; the loop re-enters at every recovery)."""
    found = []
    for loop in ast.walk(tree):
        if not isinstance(loop, (ast.For, ast.AsyncFor)) or not any(
                _target_key(n) in loaders for n in ast.walk(loop.iter) if isinstance(n, (ast.Name, ast.Attribute))):
            continue
        scope = parents.get(loop)
        while scope is not None and not isinstance(scope, (ast.For, ast.AsyncFor, ast.While, ast.FunctionDef,
                                                           ast.AsyncFunctionDef)):
            scope = parents.get(scope)
        for node in ast.walk(scope) if scope is not None else ():
            if isinstance(node, ast.Call) and node.lineno > (loop.end_lineno or loop.lineno) \
                    and _called(node.func) in COMBINING:
                found.append(Finding(node.lineno, node.col_offset + 1, "combined", HELD, lines[node.lineno - 1].strip(),
                                     "a collective after the steps combines what each rank kept across them: going on "
                                     "in place would lose a lost rank's share, so the loop re-enters at every recovery "
                                     "in those steps; combine each step's values inside the step loop to go on"))
    return found


def _read(node: ast.AST, imported: dict[str, str], scaling: set[str]) -> tuple[str, str] | None:
    """(what, kind) when `node` reads the loop's place; kind is "call", "env", "sampler" or "len"."""
    if isinstance(node, ast.Subscript) and _is_environ(node.value):
        key = _constant(node.slice)
        return (ENV[key], "env") if key in ENV else None
    if not isinstance(node, ast.Call):
        return None
    func, name = node.func, _called(node.func)
    if isinstance(func, ast.Name):  # a bare get_rank() counts only as an imported name (not the script's own)
        name = imported.get(func.id, func.id if func.id in ("len", "DistributedSampler", "getenv") else "")
    if name in _METHODS or name in _TORCH:
        if name in _TORCH and _has_group(node):
            return None  # a group's own rank or size: not the loop's place in the world
        return (_METHODS.get(name) or _TORCH[name]), "call"
    if name == "DistributedSampler":
        return "world_size", "sampler"
    environ_get = name == "get" and isinstance(func, ast.Attribute) and _is_environ(func.value)
    if (name == "getenv" or environ_get) and node.args:
        key = _constant(node.args[0])
        return (ENV[key], "env") if key in ENV else None
    if name == "len" and len(node.args) == 1 and _target_key(node.args[0]) in scaling:
        return "epoch_steps", "len"
    return None


def _advice(node: ast.AST, what: str, kind: str, use: str) -> str:
    """How to write the read so that the loop goes on in place after a recovery."""
    words = what.replace("_", " ")
    if use == LOGGED:
        return "logged: shapes nothing the loop computes, ignored"
    if kind == "sampler":
        return ("pass the dataset's DataLoader to prepare_data_loader instead, which keeps the sampler's shuffle "
                "and seed and re-shards on recovery: a DistributedSampler holds its num_replicas and rank, so the "
                "loop re-enters at every recovery that changes the world size")
    if use == USED:
        return f"used where read: re-enters only if the {words} changes in a step that read it before the failure"
    if kind == "len":
        return ("a held count of a prepared loader's steps re-enters the loop at every recovery: going on mid-epoch "
                "changes the epoch's steps (the lost ranks' shares come first in its rest, and the steps scale with "
                "the world); take len() where it is used (`if i == len(loader) - 1:`), where it answers the epoch's "
                "steps as they stand")
    read = ast.unparse(node) if kind == "call" else f"train.get_context().{_ACCESSORS[what]}()"
    if what in _WORLDS:
        return (f"a held {words} re-enters at every recovery that changes the world size (every one that loses a "
                f"worker); compute it where used (e.g. `loss / {read}`), or use "
                "prepare_data_loader(global_batch_size=...) for a batch size that should not change")
    renumbers = "renumbers this rank" if what == "rank" else f"changes this worker's {words}"
    return (f"read `{read}` where it is used (e.g. `if {read} == 0:`): a held {words} re-enters the loop "
            f"whenever a recovery {renumbers}")


def _scaling_loaders(tree: ast.AST) -> set[str]:
    """The names (and attributes, `self.loader`) bound to a prepared loader (`prepare_data_loader(...)`,
    not add_dist_sampler=False): its length is the epoch's steps, which going on in place changes."""
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            pairs = [(t, node.value) for t in node.targets]
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            pairs = [(node.target, node.value)]
        elif isinstance(node, ast.NamedExpr):
            pairs = [(node.target, node.value)]
        else:
            continue
        for target, value in pairs:
            if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts):
                pairs.extend(zip(target.elts, value.elts))
            elif _scales(value) and _target_key(target):
                bound.add(_target_key(target))
    return bound


def _scales(value: ast.expr) -> bool:
    if not isinstance(value, ast.Call) or _called(value.func) != _PREPARE:
        return False
    keywords = {k.arg: k.value for k in value.keywords if k.arg is not None}
    sampler = keywords.get("add_dist_sampler", value.args[1] if len(value.args) > 1 else None)
    return not (sampler is not None and isinstance(sampler, ast.Constant) and sampler.value is False)  # else unsharded


def _imported(tree: ast.AST) -> dict[str, str]:
    """Names bound by `from ... import` to what they import: `from torch.distributed import get_rank as r`."""
    return {alias.asname or alias.name: alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
            for alias in node.names}


def _has_group(call: ast.Call) -> bool:
    """`get_rank(group)` or `get_rank(group=g)`: a group other than the default."""
    given = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "group"), None)
    return given is not None and not (isinstance(given, ast.Constant) and given.value is None)


def _in_function(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return True
    return False


def _called(func: ast.expr) -> str:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def _is_environ(node: ast.expr) -> bool:
    """`os.environ` (or `environ`, imported from os)."""
    return _called(node) == "environ"


def _constant(node: ast.expr) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _target_key(node: ast.expr) -> str:
    """`loader`, `self.loader`: a name or attribute chain a value is bound to ("" for anything else)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _target_key(node.value)
        return f"{inner}.{node.attr}" if inner else ""
    return ""
