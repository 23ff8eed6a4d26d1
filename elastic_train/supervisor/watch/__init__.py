"""What the supervisor sees of a run and tells: its events, metrics, pace and goodput.

Reading order: `supervisor/watch/telemetry.py` (every event stamped once and handed to each observer) → `supervisor/watch/goodput.py`
(where the run's time went) → `supervisor/watch/pace.py` (stragglers and growing memory) → `metrics.py` (the run's
metrics, exported through Ray).
"""
