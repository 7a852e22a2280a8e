"""Data planes behind one small interface (`Transport`): `tcp` (any host), `cuda_ipc` (GPUs of
one host, read by the consumer's copy engines), and the paired process-group transports
`nccl` (GPU) and `gloo` (CPU, the same machinery for CI)."""

from kvrt.transports._base import Transport
from kvrt.transports.cuda_ipc import CudaIpcTransport
from kvrt.transports.paired import PairedTransport
from kvrt.transports.tcp import TcpTransport

__all__ = ["CudaIpcTransport", "PairedTransport", "TcpTransport", "Transport"]
