"""Data planes behind one small interface (`Transport`): `tcp` now; `nccl` and `cuda_ipc` plug in beside it."""

from kvrt.transports._base import Transport
from kvrt.transports.tcp import TcpTransport

__all__ = ["TcpTransport", "Transport"]
