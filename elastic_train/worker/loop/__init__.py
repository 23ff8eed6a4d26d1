"""The loop's session: what the user's loop talks to inside a worker, one session per generation.

Reading order: `session.py` (report, get_checkpoint, get_context; whether the loop goes on in place)
→ `host.py` (what a session gets from its worker) → `resume.py` (where a generation's loop resumes
from) → `loaders.py` (the loop's prepared data loaders and dataset shards) → `context.py`
(`TrainContext`, `StorageContext`) → `step_clock.py` (the loop's step time, sent with reports).
"""
