"""What every benchmark records next to its figures: the machine they were measured on."""

from __future__ import annotations

import os
import platform
from typing import Any

import ray
import torch


def machine_facts() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "ray": ray.__version__}
