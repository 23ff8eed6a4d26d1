"""A state that some ranks hold, given to the others over the generation's process group.

Why: a newcomer needs the kept state (worker/hold/kept_state.py) that the survivors hold, and they wait for it
in DDP's constructor meanwhile. Fetched over Ray, a survivor serialized it (`torch.save`), the object
store copied it and the newcomer deserialized it: 1.45 s for 128 MB on the 2-core test machine. Over
the group it is what DDP's constructor itself does with the parameters: a broadcast. The holding
rank lays every tensor's bytes end to end in one buffer, and the others receive it and copy their
tensors out of it; a small pickled outline of the nest (keys, dtypes, shapes, and whatever is
not a dense tensor on the group's device) goes first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from elastic_train.worker.group.world import generation_group

_ALIGN = 64  # bytes: each tensor's offset in the buffer, so that any dtype can be viewed there
_NESTS = (dict, OrderedDict, list, tuple)  # rebuilt around their tensors; anything else is pickled whole


@dataclass(frozen=True)
class _Slot:
    """Where a tensor is in the broadcast buffer."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def share(state: Any | None) -> Any | None:
    """Every rank of the default group calls this, at the same point of its collectives. Ranks that
    hold `state` pass it, the others None. Returns `state` where it was held, else the lowest holding
    rank's, received; None on every rank if no rank holds it. Raises what a failed collective raises."""
    held: list[bool] = [False] * dist.get_world_size()
    dist.all_gather_object(held, state is not None, group=generation_group())
    if all(held) or not any(held):
        return state
    source, rank = held.index(True), dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    sent: list[tuple[torch.Tensor, _Slot]] = []
    message: list[Any] = [_outline(state, device, sent) if rank == source else None]
    dist.broadcast_object_list(message, src=source, group=generation_group())
    outline, size = message[0]
    buffer = torch.empty(size, dtype=torch.uint8, device=device)
    for tensor, slot in sent:
        buffer[slot.offset : slot.offset + slot.nbytes] = _bytes(tensor)
    if size:
        dist.broadcast(buffer, src=source, group=generation_group())
    return state if state is not None else _fill(outline, buffer)


def _outline(value: Any, device: torch.device, sent: list[tuple[torch.Tensor, _Slot]],
             end: list[int] | None = None) -> Any:
    """`value` with each dense tensor on `device` replaced by its slot (both appended to `sent`), and
    the buffer's size: (outline, size) at the top level."""
    top = end is None
    end = [0] if top else end
    if isinstance(value, torch.Tensor) and _sendable(value, device):
        nbytes = value.numel() * value.element_size()
        out: Any = _Slot(end[0], nbytes, value.dtype, tuple(value.shape))
        sent.append((value, out))
        end[0] += -(-nbytes // _ALIGN) * _ALIGN
    elif type(value) in _NESTS:
        out = _rebuild(value, lambda v: _outline(v, device, sent, end))
    else:
        out = value  # pickled as it is
    return (out, end[0]) if top else out


def _sendable(tensor: torch.Tensor, device: torch.device) -> bool:
    return (type(tensor) is torch.Tensor and tensor.layout is torch.strided and not tensor.is_quantized
            and tensor.device == device)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else flat.new_empty(0, dtype=torch.uint8)


def _rebuild(value: Any, each: Callable[[Any], Any]) -> Any:
    """A dict, list or tuple of `each` of its items; a state dict's `_metadata` (module versions) kept."""
    if isinstance(value, dict):
        out = type(value)((k, each(v)) for k, v in value.items())
        if hasattr(value, "_metadata"):
            out._metadata = value._metadata
        return out
    return type(value)(each(v) for v in value)


def _fill(outline: Any, buffer: torch.Tensor) -> Any:
    """The outline with each slot replaced by its tensor, copied out of the received buffer: a tensor
    of its own storage, as in any state dict (views of one storage as several dtypes could not be
    saved with `torch.save`)."""
    if isinstance(outline, _Slot):
        if not outline.nbytes:
            return torch.empty(outline.shape, dtype=outline.dtype, device=buffer.device)
        data = buffer[outline.offset : outline.offset + outline.nbytes]
        return data.view(outline.dtype).view(outline.shape).clone()
    if type(outline) in _NESTS:
        return _rebuild(outline, lambda v: _fill(v, buffer))
    return outline
