"""Environment for torch's NCCL process groups, so that a worker outlives a lost peer.

Stdlib only: the supervisor imports it to put these variables into the workers' `runtime_env`
(`env_vars`), and `process_group.py` sets any that are missing before the first NCCL group of a
process is made. torch reads every `TORCH_NCCL_*` variable below when a ProcessGroupNCCL is
constructed (`TORCH_NCCL_NONBLOCKING_TIMEOUT` once, on first use), so either place is early enough;
values the user set win.

Why each one (torch 2.11-2.13, legacy ProcessGroupNCCL; /work/shared/gpu/README.md for the H100
measurements):

* When a collective of a group fails (a peer died: NCCL reports `ncclRemoteError`) or times out,
  c10d's watchdog thread broadcasts a dump signal, sleeps `4 x TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC`
  (default 15 s: the "~60 s later" of the measurement), then, unless the error handling mode is
  CleanUpOnly or NoHandling, rethrows: "To avoid data inconsistency, we are taking the entire process
  down" (SIGABRT), even if the group was aborted in the meantime (the error was seen first).
* `TORCH_NCCL_ASYNC_ERROR_HANDLING=2` (CleanUpOnly): the watchdog aborts the communicators of a
  failed or timed-out group and keeps the process. Its per-operation timeout (the group's
  `collective_timeout_s`) is then a safety net that aborts instead of killing. (0, NoHandling, hung
  in the measurement: nothing aborts a comm whose op never ends.)
* `TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC=100`: the watchdog's post-error sleep becomes 0.4 s. While it
  sleeps, destroying the group waits for it: the 123 s `destroy_process_group()` of the measurement.
* `TORCH_NCCL_DUMP_ON_TIMEOUT=0`: no flight-recorder dump on an error, and no dump signal through the
  store that has every other rank's monitor thread dump too (and, with monitoring on, end its process).
* `TORCH_NCCL_ENABLE_MONITORING=0`: the heartbeat monitor thread ends the process when the watchdog
  is stuck, whatever the error handling mode (pytorch/pytorch#155916). Our own deadlines
  (`destroy_timeout_s`) bound the calls that could get stuck.
* `TORCH_NCCL_PROPAGATE_ERROR=0`: no error signal written to the store for the other ranks (the
  default; set so that a cluster-wide setting cannot turn it on).
* `TORCH_NCCL_RETHROW_CUDA_ERRORS` stays on: after a CUDA error the context is unusable and the
  process had better end (Ray then replaces the worker).
* `TORCH_NCCL_NONBLOCKING_TIMEOUT`: the groups use non-blocking communicators (abortable while an
  operation is in flight, as torchft does); torch waits this long for a non-blocking NCCL call
  (communicator init, finalize) before it gives up: 30 minutes by default; a group's rendezvous
  timeout fits.
* `TORCH_DIST_USE_NCCL2=0`: torch 2.15 makes `nccl` mean a new backend ("nccl2", pytorch/pytorch#192281)
  whose watchdog aborted the process on any collective error or timeout (pytorch/pytorch#191948);
  everything above is about the legacy ProcessGroupNCCL, which this keeps. Ignored by torch <= 2.14.
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
