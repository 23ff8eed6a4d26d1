"""Preemption on the supervisor: workers under a notice, the hand-over of what only they hold, and
what `get_preemption_info()` answers.

Reading order: `workers.py` (the workers under a notice: hand-over, Ray's drains) → `supervisor/preemption/notices.py` (what
the loop is told, and the preemption budget).
"""
