"""Worker side: a Ray actor per worker that runs the user's loop, generation after generation.

Reading order: `actor.py` (the Ray actor's endpoints) → `member.py` (what a worker does: park, take an
assignment, join the generation's group, run the loop) → the sub-packages, by job:

- `group/`: the process group, and what lets a loop go on in place when a peer is lost;
- `loop/`: the loop's session: what `report()`, `get_checkpoint()` and `get_context()` talk to;
- `report/`: what one `report()` does, in lockstep with the other ranks;
- `hold/`: what a worker holds in memory for the run: checkpoint parts, replicas, kept state;
- `store/`: a worker's parts written to storage, in the background.

Beside them: `heartbeat.py` (alive, and told when its generation ends), `preemption.py` (notices of a
machine about to be taken), `background.py` (the thread behind storing, replicas and reports sent),
`warmup.py` (PyTorch's first-use costs paid before joining), `resident.py` (the process's memory).
"""
