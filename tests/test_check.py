"""`elastic-train check` (faithful/check.py): a script's reads of its place, found in its source before
it runs, each with what its statement does with it and how to write it so the loop goes on in place."""

from __future__ import annotations

import ast

import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from elastic_train.cli import app
from elastic_train.faithful.check import Finding, check_source
from elastic_train.faithful.sites import HELD, LOGGED, USED

pytestmark = pytest.mark.timeout(30)

TESTS = Path(__file__).resolve().parent


def _check(body: str, prelude: str = "") -> list[Finding]:
    """The findings of `body` as the body of a loop function (after module-level `prelude`)."""
    source = textwrap.dedent(prelude) + "def train_func(config):\n" + textwrap.indent(textwrap.dedent(body), "    ")
    return check_source(source, "train.py")


def _one(body: str, prelude: str = "") -> tuple[str, str]:
    (finding,) = _check(body, prelude)
    return finding.what, finding.use


@pytest.mark.parametrize("body, what", [
    ("rank = train.get_context().get_world_rank()", "rank"),
    ("world = ctx.get_world_size()", "world_size"),
    ("local = get_context().get_local_rank()", "local_rank"),
    ("per_node = ctx.get_local_world_size()", "local_world_size"),
    ("node = ctx.get_node_rank()", "node_rank"),
    ("rank = dist.get_rank()", "rank"),
    ("world = dist.get_world_size(group=None)", "world_size"),
    ("rank = torch.distributed.get_rank()", "rank"),
    ("rank = int(os.environ['RANK'])", "rank"),
    ("world = int(os.environ.get('WORLD_SIZE', 1))", "world_size"),
    ("local = int(os.getenv('LOCAL_RANK'))", "local_rank"),
    ("per_node = int(os.environ['LOCAL_WORLD_SIZE'])", "local_world_size"),
    ("node = int(os.environ['NODE_RANK'])", "node_rank"),
    ("node = int(os.environ['GROUP_RANK'])", "node_rank"),
    ("sampler = DistributedSampler(dataset, shuffle=True)", "world_size"),
    ("loader = DataLoader(ds, sampler=torch.utils.data.distributed.DistributedSampler(ds))", "world_size"),
])
def test_each_kind_of_read_held(body, what):
    assert _one(body) == (what, HELD)


def test_bare_calls_count_when_imported():
    imports = "from torch.distributed import get_rank, get_world_size as world_of\n"
    assert [(f.what, f.use) for f in _check("rank = get_rank()\nn = world_of()", imports)] == [
        ("rank", HELD), ("world_size", HELD)]
    assert _check("rank = get_rank()") == []  # not imported: someone else's get_rank


def test_a_group_argument_is_not_the_place():
    assert _check("r = dist.get_rank(group=pg)\nn = dist.get_world_size(pg)\nm = dist.get_rank(sub)") == []


def test_other_variables_and_keys_are_not_reads():
    assert _check("seed = int(os.environ['SEED'])\nm = os.getenv('MASTER_ADDR')\nr = os.environ[key]") == []


def test_held_used_and_logged():
    findings = _check("""
        rank = ctx.get_world_rank()
        if ctx.get_world_rank() == 0:
            save()
        loss.div_(dist.get_world_size())
        print(f"rank {ctx.get_world_rank()}")
        logger.info("world %d", ctx.get_world_size())
    """)
    assert [(f.line, f.what, f.use) for f in findings] == [
        (3, "rank", HELD), (4, "rank", USED), (6, "world_size", USED), (7, "rank", LOGGED), (8, "world_size", LOGGED)]
    held, used, _, logged, _ = findings
    assert held.column == 12 and held.text == "rank = ctx.get_world_rank()"
    assert "read `ctx.get_world_rank()` where it is used (e.g. `if ctx.get_world_rank() == 0:`)" in held.advice
    assert "whenever a recovery renumbers this rank" in held.advice
    assert used.advice.startswith("used where read: re-enters only if the rank changes in a step")
    assert logged.advice.startswith("logged")


def test_advice_for_a_held_world_size_and_environment_read():
    world, env = _check("batch = 64 // ctx.get_world_size()\nlocal = int(os.environ['LOCAL_RANK'])")
    assert "every recovery that changes the world size (every one that loses a worker)" in world.advice
    assert "prepare_data_loader(global_batch_size=...)" in world.advice
    assert "`train.get_context().get_local_rank()`" in env.advice  # the context's reader, not the variable


def test_a_distributed_sampler_is_advised_prepare_data_loader():
    (sampler,) = _check("sampler = DistributedSampler(ds)")
    assert "prepare_data_loader" in sampler.advice and "re-shards on recovery" in sampler.advice


def test_len_of_a_prepared_loader_scales_with_the_world():
    findings = _check("""
        loader = prepare_data_loader(DataLoader(ds, batch_size=8))
        self.val = train.torch.prepare_data_loader(DataLoader(ds, batch_size=8))
        total = config["epochs"] * len(loader)
        for i in range(len(self.val)):
            pass
        if step == len(loader) - 1:
            pass
        n = len(ds)
    """)
    assert [(f.line, f.what, f.use) for f in findings] == [(5, "epoch_steps", HELD), (6, "epoch_steps", HELD),
                                                          (8, "epoch_steps", USED)]
    assert "len(loader) - 1" in findings[0].advice


def test_len_of_any_prepared_loader_is_the_epochs_steps_but_not_of_an_unsharded_one():
    """Even with a fixed global batch, going on mid-epoch changes an epoch's steps (the lost ranks'
    shares come first in its rest): a held count of them re-enters."""
    findings = _check("""
        loader = prepare_data_loader(DataLoader(ds, batch_size=8), global_batch_size=32)
        plain = prepare_data_loader(DataLoader(ds, batch_size=8), add_dist_sampler=False)
        steps = len(loader) + len(plain)
    """)
    assert [(f.line, f.what, f.use) for f in findings] == [(5, "epoch_steps", HELD)]


def test_reads_outside_a_function_are_not_the_loops():
    """Module-level code (the driver's, or an import's) runs outside the loop."""
    source = "import os\nRANK = int(os.environ['RANK'])\nif __name__ == '__main__':\n    n = ctx.get_world_size()\n"
    assert check_source(source, "train.py") == []
    assert [f.line for f in check_source(source + "f = lambda: ctx.get_world_rank()\n", "train.py")] == [5]


def test_not_python_raises():
    with pytest.raises(SyntaxError):
        check_source("def broken(:\n", "train.py")


def test_the_test_loops():
    guide = check_source((TESTS / "guide_loops.py").read_text(), "guide_loops.py")
    report = next(f for f in guide if f.text == "rank = et.get_context().get_world_rank()")
    assert (report.what, report.use) == ("rank", HELD)
    # the all-reduced loss divided by the world size is held too; log_progress's reads are logged
    assert any(f.what == "world_size" and f.held and "mean_loss /" in f.text for f in guide)
    assert {f.use for f in guide if f.text.startswith("log_progress(")} == {LOGGED}
    assert all(not f.held for f in guide if f.text.startswith(("fault_once(", "if ")))

    loops = check_source((TESTS / "loops.py").read_text(), "loops.py")
    both = [f for f in loops if f.text == "rank, world = ctx.get_world_rank(), ctx.get_world_size()"]
    assert [(f.what, f.use) for f in both] == [("rank", HELD), ("world_size", HELD)]
    assert not any("len(" in f.text for f in loops)  # its loops take no len() of a prepared loader
    assert all(f.use == USED for f in loops if f.text == "if ctx.get_world_rank() == 0:")


def _invoke(*args: str):
    return CliRunner().invoke(app, ["check", *args], env={"COLUMNS": "200"})


def _rows(stdout: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.split("│")[1:-1]] for line in stdout.splitlines() if "│" in line]


def test_the_command(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import os
        from ray import train

        def train_func(config):
            world = train.get_context().get_world_size()
            buf[train.get_context().get_world_rank()] = 1
            print("rank", train.get_context().get_world_rank())
    """))
    shown = _invoke(str(script))
    assert shown.exit_code == 0, shown.output
    rows = [row for row in _rows(shown.stdout) if row[0]]  # a row's first line (advice wraps onto more)
    assert [row[:3] for row in rows] == [["6", "world_size", "held"], ["7", "rank", "used"]]
    assert rows[1][3] == "buf[train.get_context().get_world_rank()] = 1"  # not taken for rich markup
    assert shown.stdout.splitlines()[-1] == "1 read holds its place: the loop re-enters after a recovery that changes it"

    everything = _invoke(str(script), "--all")
    assert [row[:3] for row in _rows(everything.stdout) if row[0]][-1] == ["8", "rank", "logged"]

    script.write_text("def train_func(config):\n    if train.get_context().get_world_rank() == 0:\n        save()\n")
    used = _invoke(str(script))
    assert used.exit_code == 0 and used.stdout.splitlines()[-1] == (
        "nothing held: the loop goes on in place after a recovery")

    guide = _invoke(str(TESTS / "guide_loops.py"))
    assert guide.exit_code == 0 and "reads hold their place" in guide.stdout.splitlines()[-1]

    missing = _invoke(str(tmp_path / "nowhere.py"))
    assert missing.exit_code == 2 and "no such file" in missing.output
    (tmp_path / "notes.txt").write_text("not python: at all\n")
    broken = _invoke(str(tmp_path / "notes.txt"))
    assert broken.exit_code == 2 and "not Python" in broken.output


def test_a_collective_after_the_steps_over_a_prepared_loader_is_listed():
    findings = _check("""
        loader = prepare_data_loader(DataLoader(ds, batch_size=8))
        for epoch in range(3):
            total = 0
            for i, batch in enumerate(loader):
                total += batch.sum()
                dist.all_reduce(loss)
            dist.all_reduce(total)
    """)
    assert [(f.line, f.what) for f in findings] == [(9, "combined")]  # line 1 is the def
    assert "inside the step loop" in findings[0].advice


def test_the_faithful_programs_lines_that_decide():
    """tests/faithful_programs.py: each program that holds what a recovery changes has its deciding
    line listed as held (in its own function, or the helper it calls); those that go on, none."""
    source = (TESTS / "faithful_programs.py").read_text()
    functions = {node.name: (node.lineno, node.end_lineno) for node in ast.walk(ast.parse(source))
                 if isinstance(node, ast.FunctionDef)}
    held = {name for name, (first, last) in functions.items()
            for f in check_source(source, "faithful_programs.py") if f.held and first <= f.line <= last}
    assert held == {"batch_from_world", "rank_read_once", "rank_once_own_data", "torch_and_environment_reads",
                    "own_validation_sampler", "_scheduled", "global_step_checkpoints", "per_rank_epoch_sums",
                    "every_rank_its_own_shard", "metrics_all_reduced_by_hand", "ddp_tutorial"}
    # its world share is assigned afresh each step and only all-reduced: used, as at run time
    share = next(f for f in check_source(source, "faithful_programs.py") if f.text.startswith("share = "))
    assert (share.what, share.use) == ("world_size", USED)
