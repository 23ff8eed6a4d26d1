"""What a run's folder holds beside its checkpoints, and how it is read: the run record (`record.py`:
`run.json`, `metrics.json`, `trainer.pkl`), the event log (`events.py`: `events.jsonl`) and what a run
ends with (`summary.py`). Below both the driver and the supervisor, which write them, and
`Result.from_path`, which reads them; above only storage and the run's states (supervisor/state.py,
pure)."""
