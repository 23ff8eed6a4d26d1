"""A worker's checkpoint parts written to storage, in the background, so that `report()` never waits
on storage unless the user asked it to.

Reading order: `storing.py` (a session's reported parts: which are stored, the supervisor's reply, the
wait for a commit) → `worker_store.py` (the worker's parts on their way to storage, and what each
store does around it) → `queue.py` (the thread that stores them, one at a time, newest first).
"""
