"""elastic_train's modules import one another without a circle (as Ray Train checks its own,
tests/test_circular_imports.py). Every import counts: at module level, inside a function, and under
`TYPE_CHECKING`; a circle that a deferred import hides is still one layer reaching up into another."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "elastic_train"


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project's modules that `module` imports by name (a package's own `__init__` when the
    name is one of its attributes), also through `importlib.import_module("...")` of a literal name."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            found.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names)
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant)):  # importlib.import_module("elastic_train...")
            found.add(node.args[0].value)
    return {name for name in found if name in modules and name != module}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


@pytest.mark.timeout(30)
def test_no_module_of_elastic_train_imports_itself_through_others():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert graph["elastic_train.trainer"] >= {"elastic_train.config", "elastic_train.driver.launch"}  # it reads
    assert _circles(graph) == []


@pytest.mark.timeout(10)
def test_the_check_finds_a_circle_through_a_deferred_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [["a", "b", "c"]]


@pytest.mark.timeout(10)
def test_config_imports_nothing_of_the_project_but_its_errors():
    modules = _modules()
    config = {name for name in modules if name == "elastic_train.config" or name.startswith("elastic_train.config.")}
    imported = set().union(*(_imports(name, modules[name], modules) for name in config))
    assert imported - config == {"elastic_train.errors"}


@pytest.mark.timeout(120)
def test_the_supervisor_starts_without_importing_torch(tmp_path):
    """The supervisor is handed the loop as bytes (run_spec.py `WorkerSpec.loop`) and creates workers
    from a class of endpoints (worker/actor.py): its process imports neither torch nor the worker's
    machinery, which would add ~1.3 s to the start of every run. Checked in a fresh process, given a
    spec whose loop imports torch (tests/loops.py)."""
    from ray import cloudpickle

    from elastic_train.checkpoint.storage import RunStorage
    from elastic_train.config import CheckpointConfig, ElasticConfig
    from elastic_train.run_spec import LoopSpec, RunInfo, WorkerSpec
    from tests.loops import sample_counting_loop

    spec = WorkerSpec.of(LoopSpec(sample_counting_loop, {}), backend="gloo", elastic=ElasticConfig(),
                         storage=RunStorage(str(tmp_path), "run"), run=RunInfo("run"),
                         checkpointing=CheckpointConfig())
    (tmp_path / "spec.pkl").write_bytes(cloudpickle.dumps(spec))
    code = ("import sys, pickle, elastic_train.supervisor.actor, elastic_train.driver.launch\n"
            f"pickle.loads(open({str(tmp_path / 'spec.pkl')!r}, 'rb').read())\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch' or m == 'elastic_train.worker.member'))")
    imported = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90,
                              cwd=PACKAGE.parent)
    assert imported.returncode == 0, imported.stderr
    assert imported.stdout.strip() == "[]"


# The project's layers, lowest first: a module imports from its own layer and those below, never from
# one above (issue 50). A module is placed by its longest prefix here.
LAYERS = [
    ["errors", "constants", "protocol"],  # what every part says to another
    ["config", "events", "faithful", "checkpoint", "run_spec", "backend", "unsupported"],
    ["run_folder", "worker"],  # a worker runs the loop; it knows nothing of the supervisor or driver
    ["ingest", "supervisor"],
    ["torch", "api", "context", "collective", "result", "progress", "timeline", "callbacks"],  # the loop's API
    ["driver"],
    ["", "trainer", "tune", "lightning", "huggingface", "v2", "cli", "demo"],  # entry points
]
# Inside worker/, by job, lowest first: the group under the loop, what a worker holds under what its
# session does with it; `actor`/`member` run it all. Its other top modules are leaves (no worker import).
WORKER_LAYERS = [
    ["worker.background", "worker.resident", "worker.heartbeat", "worker.preemption", "worker.warmup"],
    ["worker.group"],
    ["worker.hold"],
    ["worker.store", "worker.report", "worker.loop"],
    ["worker.member", "worker.actor", "worker"],
]


def _layer(module: str, layers: list[list[str]]) -> int | None:
    name = module.removeprefix("elastic_train").removeprefix(".")
    matches = [(len(prefix), index) for index, layer in enumerate(layers) for prefix in layer
               if name == prefix or (prefix and name.startswith(prefix + "."))]
    return max(matches)[1] if matches else None


def _upward(layers: list[list[str]]) -> list[str]:
    modules = _modules()
    found = []
    for name, path in sorted(modules.items()):
        for imported in sorted(_imports(name, path, modules)):
            low, high = _layer(name, layers), _layer(imported, layers)
            if low is not None and high is not None and high > low:
                found.append(f"{name} -> {imported}")
    return found


@pytest.mark.timeout(30)
def test_no_module_imports_from_a_layer_above_its_own():
    modules = _modules()
    unplaced = [name for name in modules if _layer(name, LAYERS) is None]
    assert unplaced == [], "place these modules in LAYERS"
    assert _upward(LAYERS) == []
    assert _upward(WORKER_LAYERS) == []


@pytest.mark.timeout(10)
def test_the_layer_check_finds_an_import_from_above():
    """The check is not vacuous: a worker importing the supervisor would be found."""
    assert _layer("elastic_train.worker.member", LAYERS) < _layer("elastic_train.supervisor.roster", LAYERS)
    assert _layer("elastic_train.worker.group.world", WORKER_LAYERS) < _layer("elastic_train.worker.loop.session",
                                                                              WORKER_LAYERS)
    assert _layer("elastic_train.worker.group", WORKER_LAYERS) == 1


MAX_LINES = 400  # past this a module is doing more than one job
MAX_MODULES = 12  # modules at a package's top before it needs sub-packages by job


@pytest.mark.timeout(30)
def test_no_module_is_past_400_lines_and_no_package_is_a_heap():
    """A module past ~400 lines does more than one job; a package with more than ~12 modules and no
    sub-packages hides its structure (the project's rule, checked so that it stays true)."""
    long = {str(path.relative_to(PACKAGE.parent)): n for path in PACKAGE.rglob("*.py")
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}
    heaps = {}
    for package in [PACKAGE, *(p for p in PACKAGE.rglob("*") if (p / "__init__.py").exists())]:
        modules = [p for p in package.glob("*.py") if p.name != "__init__.py"]
        has_subpackages = any((p / "__init__.py").exists() for p in package.iterdir() if p.is_dir())
        if len(modules) > MAX_MODULES and not has_subpackages:
            heaps[str(package.relative_to(PACKAGE.parent))] = len(modules)
    assert heaps == {}
    worker = [p for p in (PACKAGE / "worker").glob("*.py") if p.name != "__init__.py"]
    assert len(worker) <= MAX_MODULES, sorted(p.name for p in worker)
