"""The process group of a generation, and what lets the loop go on in place when a peer is lost.

Reading order: `generation.py` (one generation's torch.distributed group: join, abort, leave) →
`gloo.py` (the door its ranks wait at before gloo connects them; its connections, shut down to abort) →
`world.py` (the default group the loop holds: it follows the loop from generation to generation, and
a collective that failed on a lost peer is made again over the survivors) → `ddp.py` (the group DDP is
handed, following the world group) → `reduction.py` (DDP's comm hook: a step's gradients reduced whole
across a lost peer) → `process_state.py` (torch's per-process state of the previous world, reset) →
`nccl_env.py` (NCCL settings that keep a survivor alive) → `devices.py` (this worker's devices).
"""
