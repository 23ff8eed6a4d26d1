"""Ray Train's `ray.train.torch` names: TorchTrainer, prepare_model, prepare_data_loader, get_device."""

from elastic_train.torch.data import prepare_data_loader
from elastic_train.torch.model import get_device, prepare_model
from elastic_train.trainer import TorchTrainer

__all__ = ["TorchTrainer", "prepare_model", "prepare_data_loader", "get_device"]
