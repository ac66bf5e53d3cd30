"""A parameter's own bytes, whether it is a plain tensor or one rank's shard of a DTensor.

transformers' tensor parallelism (``from_pretrained(tp_plan="auto")``) holds each sharded parameter as a
DTensor: its shape is the whole tensor's, its bytes are this rank's shard (``to_local()``). Its TP forwards
decide their collectives from the parameters themselves: an experts module all-reduces its output only while
its parameters are sharded DTensors (``MoeExpertsParallel`` in transformers/distributed/tensor_parallel.py), and
a vocabulary-split embedding masks the ids of other ranks through DTensor's own rules. So the runtime moves a
shard's bytes only and leaves every parameter the DTensor it was: it re-points the DTensor's local tensor (the
one inner tensor DTensor flattens to, ``DTensor.__tensor_flatten__``) at the arena, the host piece or the slot.
A plain parameter is re-pointed as before.
"""

import torch

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch built without distributed: no parameter is a DTensor
    DTensor = None


def is_shard(param: torch.Tensor) -> bool:
    """Whether ``param`` is a DTensor (a rank's shard, or a replica, of a tensor-parallel parameter)."""
    return DTensor is not None and isinstance(param, DTensor)


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    """The tensor whose bytes this process holds: a DTensor's local shard, else the parameter's data."""
    return param._local_tensor.detach() if is_shard(param) else param.data


def local_bytes(param: torch.Tensor) -> int:
    """Bytes this process holds for ``param``."""
    local = local_tensor(param)
    return local.numel() * local.element_size()


def local_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The shape of the bytes this process holds for ``param``."""
    return tuple(local_tensor(param).shape)


def repoint(param: torch.Tensor, tensor: torch.Tensor) -> None:
    """Make ``param`` read ``tensor`` from now on, keeping the parameter object (its holders, tied or not, see
    the change): a DTensor's local shard is replaced, a plain parameter's data."""
    if is_shard(param):
        if tuple(tensor.shape) != tuple(param._local_tensor.shape) or tensor.dtype != param._local_tensor.dtype:
            raise ValueError(f"a shard of {tuple(param._local_tensor.shape)} {param._local_tensor.dtype} cannot "
                             f"read {tuple(tensor.shape)} {tensor.dtype}")
        param._local_tensor = tensor
    else:
        param.data = tensor
