"""Ray V2's `ray.train.v2.api.preemption`: `PreemptionInfo`, what `get_preemption_info()` answers."""

from elastic_train.protocol import PreemptionInfo

__all__ = ["PreemptionInfo"]
