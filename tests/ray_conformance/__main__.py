"""Run Ray Train's own public-API tests against Ray and against elastic_train, side by side.

    python -m tests.ray_conformance --ray-source ~/src/ray/python/ray [--against both] [--out DIR]

`--ray-source` is the `python/ray` folder of a Ray checkout at the installed version (`git checkout
ray-<version>`): Ray's wheel ships its examples but not its tests, and a copy of them is not kept in
this repository. Each file of `FILES` is ported (port.py: the import rule, nothing else; no test body
is edited) into a scratch folder with the fixtures of fixtures.py, and run with pytest, once as Ray's
and once as ours; the tests of left_out.py are deselected in both runs. Prints, per file, how many
tests passed on each.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import ray

from tests.ray_conformance.left_out import LEFT_OUT, LEFT_OUT_FILES
from tests.ray_conformance.port import SHARED_PACKAGE, port, shared_module, shared_modules_in

ROOT = Path(__file__).resolve().parents[2]
INSTALLED_RAY = Path(ray.__file__).parent
# Paths under python/ray/train: Ray Train V2's test files, then Ray Train's (tests/) that use only the public
# API. Ray's CI runs some of those on V1 (RAY_TRAIN_V2_ENABLED=0); here both systems run them as a user of
# the installed Ray does, on V2.
FILES = tuple(f"v2/tests/test_{name}.py" for name in (
    "torch_trainer", "v2_api", "result", "data_parallel_trainer", "persistence", "lightning_integration",
    "user_callback", "async_checkpointing", "collective", "config", "data_integration", "serialization",
    "torch_backend", "scheduling")) + tuple(f"tests/test_{name}.py" for name in (
        "torch_lightning_train", "torch_checkpoint", "torch_accelerate", "windows"))
TEST_TIMEOUT_S = 300


def prepare(ray_source: Path, folder: Path, to_elastic_train: bool, files: tuple[str, ...] = FILES) -> list[str]:
    """Write the ported test files of `files`, the shared modules they import and the fixtures into
    `folder` (each at its path under python/ray/train); returns the test files written."""
    (folder / SHARED_PACKAGE).mkdir(parents=True)
    (folder / SHARED_PACKAGE / "__init__.py").write_text("")
    shutil.copy(Path(__file__).with_name("fixtures.py"), folder / "conftest.py")
    pending, done, written = [], set(), []
    for name in files:
        source = ray_source / "train" / name
        if source.exists():
            text = source.read_text()
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text(port(text, to_elastic_train))
            pending += shared_modules_in(text)
            written.append(name)
    while pending:  # the test utilities, and those they import in turn
        module = pending.pop()
        if module in done:
            continue
        done.add(module)
        parts = module.split(".")[1:]
        source = ray_source.joinpath(*parts).with_suffix(".py")
        if not source.exists():  # Ray's examples are in its wheel too
            source = INSTALLED_RAY.joinpath(*parts).with_suffix(".py")
        text = source.read_text()
        (folder / SHARED_PACKAGE / f"{shared_module(module).split('.', 1)[1]}.py").write_text(
            port(text, to_elastic_train))
        pending += shared_modules_in(text)
    return written


def run(ray_source: Path, folder: Path, to_elastic_train: bool, only: tuple[str, ...] = FILES
        ) -> dict[str, tuple[int, int]]:
    """pytest over each ported file of `only` in `folder`, one process a file as Ray's CI runs them (a
    file's last test may leave Ray running for the next file's fixture to trip on): {file: (passed, run)}."""
    files = prepare(ray_source, folder, to_elastic_train, only)
    deselected = [arg for node in LEFT_OUT for arg in ("--deselect", node)]
    counts: dict[str, tuple[int, int]] = {name: (0, 0) for name in files}
    for name in files:
        report = folder / f"{name}.xml"
        # The file's own folder too: Ray's workers unpickle the loops it defines by their module's name.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str((folder / name).parent), str(folder), str(ROOT)])}
        subprocess.run([sys.executable, "-m", "pytest", name, "-p", "no:cacheprovider", "-q", "--rootdir", str(folder),
                        f"--timeout={TEST_TIMEOUT_S}", f"--junitxml={report}", *deselected], cwd=folder, env=env)
        for case in ET.parse(report).getroot().iter("testcase"):
            if any(child.tag == "skipped" for child in case):
                continue
            passed, ran = counts[name]
            failed = any(child.tag in ("failure", "error") for child in case)
            counts[name] = (passed + (not failed), ran + 1)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ray-source", type=Path, required=True, help="the python/ray folder of a Ray checkout")
    parser.add_argument("--against", choices=("both", "ray", "elastic_train"), default="both")
    parser.add_argument("--out", type=Path, default=None, help="keep the ported files and reports here")
    parser.add_argument("--files", nargs="+", choices=FILES, default=list(FILES), metavar="FILE",
                        help=f"which of Ray's files to run (default: all of {', '.join(FILES)})")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="ray_conformance_"))
    systems = ("ray", "elastic_train") if args.against == "both" else (args.against,)
    results = {system: run(args.ray_source.expanduser(), out / system, system == "elastic_train", tuple(args.files))
               for system in systems}
    print(f"\n| Ray's file | {' | '.join(systems)} |\n| --- |{' --- |' * len(systems)}")
    for name in args.files:
        cells = [f"{results[s][name][0]}/{results[s][name][1]}" if name in results[s] else "-" for s in systems]
        print(f"| {name} | {' | '.join(cells)} |")
    print(f"\nleft out: {len(LEFT_OUT_FILES)} files and {len(LEFT_OUT)} tests, each with its reason "
          f"(tests/ray_conformance/left_out.py); files and reports in {out}")


if __name__ == "__main__":
    main()
