"""What a worker holds in memory for the run: its own checkpoint parts, its peers' replicas, and the
kept state of a loop that reports no checkpoint. A survivor's holdings are what a new generation
resumes from, without storage.

Reading order: `holdings.py` (what a worker holds, as the supervisor knows it) → `memory.py` (the
parts themselves) → `live_part.py` (a dict checkpoint held by reference) → `replicator.py` (a part
copied into a peer's memory) → `kept_state.py` (`prepare_model(live_state=True)`'s state) →
`sharded_state.py` (the kept state of an FSDP2 model, re-sharded) → `state_transfer.py` (a state some
ranks hold, given to the others over the group) → `allocator.py` (freed memory kept for snapshots).
"""
