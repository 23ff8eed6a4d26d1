"""Ray V2's `ray.train.v2.torch.torchft_config`: `TorchftConfig` imports as in Ray, and building one
says why it is not supported: elastic_train is the fault-tolerance layer itself."""

from elastic_train.unsupported import refused_class

TorchftConfig = refused_class(
    "TorchftConfig",
    "elastic_train recovers a lost rank in place itself, without torchft's replica groups and Lighthouse; use "
    "elastic_train.torch.TorchConfig (and ElasticConfig for how recovery goes). benchmarks/ compares both.",
    module="elastic_train.v2.torch.torchft_config", ray_module="ray.train.v2.torch.torchft_config")

__all__ = ["TorchftConfig"]
