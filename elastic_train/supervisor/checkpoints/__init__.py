"""The run's reported checkpoints, on the supervisor: recorded, chosen for storage, committed, and
shown to the driver's callbacks once settled.

Reading order: `supervisor/checkpoints/ledger.py` (what each rank reported, who holds it in memory, where a generation
resumes from) → `supervisor/checkpoints/cadence.py` (which reported checkpoints are stored) → `supervisor/checkpoints/commits.py` (stored parts
become a committed checkpoint: its manifest written; retention) → `supervisor/checkpoints/feed.py` (each report, in order,
for the driver's callbacks once its checkpoint settled).
"""
