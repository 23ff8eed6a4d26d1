"""`python -m chaos`: inject faults into a running elastic_train job from outside it.

    python -m chaos run --address auto --run my-run --fault sigkill --target random --every 30 --count 5
    python -m chaos run --address auto --run my-run --fault preempt --notice-s 5 --target rank0 --at 60
    python -m chaos run --address auto --run my-run --fault hang --hang-s 10 --poisson 45 --count 4 --seed 1
    python -m chaos plan --trace ../shared/traces/oobleck-aws-g4dn-events.csv --compress 360 --max-nodes 3
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

import ray

from chaos import schedules
from chaos.faults import FAULTS, ChaosContext
from chaos.harness import ChaosRunner
from chaos.log import FaultLog
from chaos.targets import RunHandle
from chaos.traces import read_trace

FAULT_HELP = {
    "kill-actor": "ray.kill a worker actor",
    "sigkill": "SIGKILL a worker process",
    "hang": "SIGSTOP a worker process, SIGCONT after --hang-s (a freeze or a healed partition)",
    "preempt": "preemption notice (SIGTERM), SIGKILL after --notice-s",
    "lose-node": "lose the target's node (kills its raylet on a real cluster)",
    "add-node": "add a node (simulated clusters only)",
    "kill-supervisor": "kill the run's supervisor actor",
    "storage": "storage outage through a chaos.storage_proxy (library use)",
}
TARGET_HELP = ("random | rank:N | rank0 | ranks:A,B | node:ID | node-of-rank0 | all-but-one "
               "(members are found through the run's supervisor actor, elastic_train:<run>)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m chaos", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="faults:\n" + "\n".join(f"  {k:16} {v}" for k, v in FAULT_HELP.items()),
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for name, text in (("run", "attach to a running job and inject faults"),
                       ("plan", "print the schedule's firings without injecting anything")):
        sub = commands.add_parser(name, help=text, formatter_class=argparse.RawDescriptionHelpFormatter,
                                  epilog="faults:\n" + "\n".join(f"  {k:16} {v}" for k, v in FAULT_HELP.items()))
        if name == "run":
            sub.add_argument("--address", default="auto", help="Ray cluster address (ray.init(address=...))")
            sub.add_argument("--run", required=True, help="the run's name (RunConfig.name)")
            sub.add_argument("--fault", choices=sorted(FAULTS), default="sigkill")
            sub.add_argument("--target", default="random", help=TARGET_HELP)
            sub.add_argument("--hang-s", type=float, default=8.0, help="how long a hang lasts")
            sub.add_argument("--notice-s", type=float, default=5.0, help="preemption notice before the kill")
            sub.add_argument("--log", default=None, help="append every injected fault to this JSON-lines file")
        when = sub.add_mutually_exclusive_group(required=True)
        when.add_argument("--at", help="comma-separated seconds from now")
        when.add_argument("--every", type=float, help="a fault every this many seconds (with --count)")
        when.add_argument("--poisson", type=float, help="Poisson faults with this mean interval (with --count)")
        when.add_argument("--trace", help="replay a spot trace (Oobleck events or Bamboo counts)")
        sub.add_argument("--count", type=int, default=1, help="how many faults for --every / --poisson")
        sub.add_argument("--seed", type=int, default=0, help="seeds --poisson and random targets")
        sub.add_argument("--compress", type=float, default=360.0, help="trace time / replay time")
        sub.add_argument("--max-nodes", type=int, default=None, help="cap on nodes alive in a replayed trace")
    return parser


def firings(args: argparse.Namespace) -> list[schedules.Firing]:
    if args.at:
        return schedules.at([float(t) for t in args.at.split(",")])
    if args.every:
        return schedules.every(args.every, args.count)
    if args.poisson:
        return schedules.poisson(args.poisson, args.count, seed=args.seed)
    return schedules.replay(read_trace(args.trace, compress=args.compress, max_nodes=args.max_nodes))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    plan = firings(args)
    if args.command == "plan":
        for f in plan:
            print(json.dumps(f.__dict__))
        return 0
    ray.init(address=args.address)
    ctx = ChaosContext(RunHandle(args.run), FaultLog(args.log))
    runner = ChaosRunner(ctx, plan, fault=args.fault, target=args.target, seed=args.seed,
                         hang_s=args.hang_s, notice_s=args.notice_s)
    runner.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
