"""Stand-ins for the three vLLM imports of vLLM's `SimpleBuffer`, and the pipe it runs on.

`GlooPipe` moves tensors between the two ranks of a gloo process group the way vLLM's
PyNccl pipe does (metadata first, then the tensor; None as a flag), with a fixed-size
int64 header instead of a pickled dict, which only makes the reference faster.
"""

from __future__ import annotations

import abc
import logging
from typing import Final

import torch
import torch.distributed as dist

_MAX_DIMS: Final = 8
_HEADER_LENGTH: Final = 3 + _MAX_DIMS  # is_none, dtype code, ndim, shape
_DTYPES: Final = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int64, torch.int32, torch.uint8)
_DTYPE_CODE: Final = {dtype: code for code, dtype in enumerate(_DTYPES)}


def init_logger(name: str) -> logging.Logger:
    return logging.getLogger(name)


class KVLookupBufferBase:
    """`SimpleBuffer`'s base class in vLLM; it adds nothing the benchmark needs."""


class KVPipeBase(abc.ABC):
    @abc.abstractmethod
    def send_tensor(self, tensor: torch.Tensor | None) -> None: ...

    @abc.abstractmethod
    def recv_tensor(self) -> torch.Tensor | None: ...


class GlooPipe(KVPipeBase):
    """Tensors to and from `peer` over the default (gloo) process group, on message tag `tag`."""

    def __init__(self, peer: int, tag: int) -> None:
        self.peer = peer
        self.tag = tag

    def send_tensor(self, tensor: torch.Tensor | None) -> None:
        header = torch.zeros(_HEADER_LENGTH, dtype=torch.int64)
        if tensor is None:
            header[0] = 1
        else:
            header[1] = _DTYPE_CODE[tensor.dtype]
            header[2] = tensor.dim()
            header[3 : 3 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        dist.send(header, self.peer, tag=self.tag)
        if tensor is not None and tensor.numel():
            dist.send(tensor.contiguous(), self.peer, tag=self.tag)

    def recv_tensor(self) -> torch.Tensor | None:
        header = torch.empty(_HEADER_LENGTH, dtype=torch.int64)
        dist.recv(header, self.peer, tag=self.tag)
        if header[0]:
            return None
        ndim = int(header[2])
        tensor = torch.empty(header[3 : 3 + ndim].tolist(), dtype=_DTYPES[int(header[1])])
        if tensor.numel():
            dist.recv(tensor, self.peer, tag=self.tag)
        return tensor
