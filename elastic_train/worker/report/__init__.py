"""What one `report()` does, in lockstep with the other ranks of the generation.

Reading order: `plan.py` (what a report does, decided from plain facts: a pure function) →
`lockstep.py` (the session's side of the barrier) → `barrier.py` (the barrier: one all-reduce over the
generation's group) → `intake.py` (a reported checkpoint taken in) → `part_exchange.py` (a small part to
the buddy inside the report) → `share_copies.py` (when a sharded model's kept state is copied) →
`sender.py` (reports that need no answer, sent in batches).
"""
