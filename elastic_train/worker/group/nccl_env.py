"""Environment for torch's NCCL process groups, so that a worker outlives a lost peer.

Stdlib only: the supervisor puts these variables into the workers' `runtime_env`, and
`worker/group/generation.py` sets any that are missing before a process's first NCCL group; values the user
set win. In short: the watchdog aborts a failed communicator and keeps the process (CleanUpOnly),
without sleeping a minute first or dumping; docs/nccl_env.md says why each variable, as measured.
"""

from __future__ import annotations

import os
import socket

HOSTID_PER_PROCESS = "ELASTIC_TRAIN_NCCL_HOSTID_PER_PROCESS"
"""Set to "1" to give each worker process its own NCCL_HOSTID: NCCL then lets several ranks share one
GPU (as if each were on a host of its own, over sockets). For tests on a single GPU only."""


def nccl_env(nonblocking_timeout_s: float = 20.0) -> dict[str, str]:
    """The environment variables a worker needs before its first NCCL group (see the module docstring).

    `nonblocking_timeout_s`: how long a non-blocking NCCL call may take; pass the run's
    `ElasticConfig.rendezvous_timeout_s`.
    """
    return {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
        "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "100",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
        "TORCH_NCCL_ENABLE_MONITORING": "0",
        "TORCH_NCCL_PROPAGATE_ERROR": "0",
        "TORCH_NCCL_NONBLOCKING_TIMEOUT": str(max(1, round(nonblocking_timeout_s))),
        "TORCH_DIST_USE_NCCL2": "0",
    }


def apply_nccl_env(nonblocking_timeout_s: float) -> None:
    """Set the variables of `nccl_env` this process lacks; called before the process's first NCCL group."""
    for name, value in nccl_env(nonblocking_timeout_s).items():
        os.environ.setdefault(name, value)
    if os.environ.get(HOSTID_PER_PROCESS) == "1":
        os.environ["NCCL_HOSTID"] = f"{socket.gethostname()}-{os.getpid()}"
