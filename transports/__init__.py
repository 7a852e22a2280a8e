"""Data planes behind one small interface (`Transport`): `tcp` (any host), and the paired
process-group transports `nccl` (GPU) and `gloo` (CPU, the same machinery for CI)."""

from kvrt.transports._base import Transport
from kvrt.transports.paired import PairedTransport
from kvrt.transports.tcp import TcpTransport

__all__ = ["PairedTransport", "TcpTransport", "Transport"]
