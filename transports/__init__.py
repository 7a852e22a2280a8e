"""Data planes behind one small interface, in two halves (`Sender` on the producer, `Receiver`
on the consumer): `tcp` (any host), `cuda_ipc` (GPUs of one host, read by the consumer's copy
engines), `nixl` (NIXL/UCX: RDMA, `cma` or TCP, CPU or GPU memory; the `kvrt[nixl]` extra), and
the paired process-group transports `nccl` (GPU) and `gloo` (CPU, the same machinery for CI)."""

from kvrt.transports._base import HostCopies, Post, Receiver, Sender, Transfer
from kvrt.transports.cuda_ipc import CudaIpcReceiver, CudaIpcSender
from kvrt.transports.nixl import NixlReceiver, NixlSender
from kvrt.transports.paired import PairedReceiver, PairedSender
from kvrt.transports.tcp import TcpReceiver, TcpSender

__all__ = [
    "CudaIpcReceiver",
    "HostCopies",
    "CudaIpcSender",
    "NixlReceiver",
    "NixlSender",
    "PairedReceiver",
    "PairedSender",
    "Post",
    "Receiver",
    "Sender",
    "TcpReceiver",
    "TcpSender",
    "Transfer",
]
