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
    name is one of its attributes)."""
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
