"""The import rule, applied mechanically to Ray Train's own test files and examples.

The rule users apply is one textual change: `ray.train` -> `elastic_train`, in imports and wherever
the code names the module (`ray.train.report(...)`, with `import elastic_train` beside the `import ray`
that made it reachable), and `from ray import train` -> `import elastic_train as train`. Two kinds of module are not the public API and keep their Ray names:
Ray's private modules (a name part with a leading underscore: `ray.train._internal`,
`ray.train._checkpoint`, `ray.train.v2._internal`) and the private names imported from a public one
(`from ray.train.torch.config import _is_backend_nccl`), which the tests that use them reach into (those
tests are left out, left_out.py), and Ray's examples and test utilities (`ray.train.examples`,
`ray.tests`, `ray.train.tests`, `ray.train.v2.tests`), programs of their own that the tests import: they are
taken from Ray's sources as shared modules (`_ray_shared.<name>`), the same in both runs, and ported
with the rest (the import rule applies to them as to any program).
"""

from __future__ import annotations

import re

SHARED_PACKAGE = "_ray_shared"
_SHARED = r"ray\.(?:tests|train\.tests|train\.v2\.tests|train\.examples)"
_PRIVATE = r"(?:\.[A-Za-z]\w*)*\._"  # ray.train followed by a private part, at any depth


def shared_module(module: str) -> str:
    """The shared module a Ray example or test utility is copied to: ray.train.tests.util ->
    _ray_shared.train_tests_util."""
    return f"{SHARED_PACKAGE}.{module.removeprefix('ray.').replace('.', '_')}"


def shared_modules_in(source: str) -> set[str]:
    """The Ray examples and test utilities `source` imports (by their Ray module names)."""
    return set(re.findall(rf"\b({_SHARED}\.[A-Za-z_][\w.]*)", source))


def port(source: str, to_elastic_train: bool) -> str:
    """`source` with the examples and test utilities it imports renamed to their shared copies and,
    with `to_elastic_train`, the import rule applied."""
    ported = re.sub(rf"\b({_SHARED}\.[A-Za-z_][\w.]*)", lambda m: shared_module(m.group(1)), source)
    ported = re.sub(r"\bray\.data\.tests\.conftest\b", "conftest", ported)  # Ray Data's fixtures: fixtures.py
    if not to_elastic_train:
        return ported
    ported = re.sub(r"^(\s*)from ray import train\s*$", r"\1import elastic_train as train", ported, flags=re.M)
    ported = re.sub(rf"\bray\.train\b(?!{_PRIVATE})(?![\w.]*\s+import\s+_)", "elastic_train", ported)
    if re.search(r"\belastic_train\.", ported) and not re.search(r"^import elastic_train\s*$", ported, flags=re.M):
        # `ray.train.report(...)` worked through `import ray`; the module it now names must be imported
        ported = re.sub(r"^import ray\s*$", "import ray\nimport elastic_train", ported, count=1, flags=re.M)
    return ported
