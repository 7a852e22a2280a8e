"""The producer (prefill side): a ZeroMQ ROUTER around `ProducerCore`, and `insert`.

One task, owned by the producer, reads control frames, hands them to the core, and sends
what the core answers; it wakes for a frame or for the core's next deadline, nothing else.
`insert` runs in the caller's task: it waits (on an event, never a poll) while the buffer
holds more than `buffer_bytes`, copies the tensors, and gives the item to the core.

The package, one job a module:

- `_parts`: what the parts share, each handed what it uses: the checked arguments, the gate
  (open, room in the buffer), the worker threads, the items' bytes beside the core's records
- `_serve`: the driver of the core: `ServeLoop` (control frames in, replies and deliveries
  out, peers) and `Inserter` (`insert`, buffering an item for the core)
- `_gathers`: a published item's gathers, queued off the loop
- `_publish`: `Publisher`: `register_pools`, `publish`
- `_stream_publisher`: `StreamPublisher`: `open_stream`, a layer at a time
- `_producer`: `Producer`: makes its parts and gives its public calls to them; start, close, stats
"""

from kvrt._errors import KVRTError
from kvrt._metrics import ProducerStats
from kvrt._producer._gathers import _Gathers as _Gathers
from kvrt._producer._parts import DEFAULT_CHUNK_BYTES
from kvrt._producer._producer import Producer
from kvrt._producer._publish import _lookup_key_and as _lookup_key_and
from kvrt._protocol import DEFAULT_HEARTBEAT_S, MAX_HEARTBEAT_S

__all__ = ["KVRTError", "DEFAULT_CHUNK_BYTES", "DEFAULT_HEARTBEAT_S", "MAX_HEARTBEAT_S", "Producer", "ProducerStats"]
