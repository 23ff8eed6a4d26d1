"""Ray Train's `ray.train.collective`: `barrier()` and `broadcast_from_rank_zero()` across the ranks of
the current generation (collectives.py, under Ray's module name)."""

from elastic_train.collective.collectives import barrier, broadcast_from_rank_zero

__all__ = ["broadcast_from_rank_zero", "barrier"]
