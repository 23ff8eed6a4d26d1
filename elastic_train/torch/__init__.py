"""Ray Train's `ray.train.torch` names: TorchTrainer, TorchConfig, prepare_model, prepare_data_loader,
get_device(s), enable_reproducibility, accelerate/prepare_optimizer/backward (full precision) and the
deprecated TorchCheckpoint; and our save_state/load_state (model and optimizer state through torch.distributed.checkpoint)."""

from elastic_train.torch.config import TorchConfig
from elastic_train.torch.data import prepare_data_loader
from elastic_train.torch.loop_utils import accelerate, backward, enable_reproducibility, prepare_optimizer
from elastic_train.torch.model import keep_state, prepare_model
from elastic_train.unsupported import lazy_getattr, unsupported_getattr
from elastic_train.worker.group.devices import get_device, get_devices

__all__ = [
    "TorchTrainer",
    "TorchConfig",
    "prepare_model",
    "keep_state",
    "prepare_data_loader",
    "get_device",
    "get_devices",
    "enable_reproducibility",
    "accelerate",
    "prepare_optimizer",
    "backward",
    "TorchCheckpoint",
    "save_state",
    "load_state",
]

# Loaded on first use: elastic_train.trainer imports elastic_train.torch.config (importing it here
# would be circular when the trainer is imported first); state.py loads torch.distributed.checkpoint
# (most of a second).
_LAZY = {
    "TorchCheckpoint": "elastic_train.torch.checkpoint",
    "TorchTrainer": "elastic_train.trainer",
    "save_state": "elastic_train.torch.state",
    "load_state": "elastic_train.torch.state",
}


__getattr__ = lazy_getattr(globals(), _LAZY, unsupported_getattr("elastic_train.torch", "ray.train.torch", {}))


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
