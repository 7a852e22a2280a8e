"""The control protocol as two state machines without sockets (h11's sans-io design).

`ProducerCore` is the producer's side: control frames and inserts in, messages to send out.
`ConsumerCore` is one consumer's side of one producer link: frames in, events out.
Neither reads a clock, sleeps, touches a socket or imports torch: the caller passes `now` (seconds on a
monotonic clock), asks `next_deadline()` when it should call `expire(now)` again, and moves
the messages. The ZeroMQ drivers (`_producer/`, `_consumer/`) do exactly that, and the
tests wire two cores together in memory. Everything a peer may not send in its state is
answered with an `ErrorReply`.

The package, one job a module:

- `lookup_buffer`: the items' records (no bytes: the driver keeps those), the lookup buffer and its
  prefix index
- `heartbeats`: how long either side waits for a silent peer (the heartbeat, the lease)
- `waiting`: the drop-selects parked until an insert matches them, and their bounds
- `commands`: health, stats, probes, the item list and evict, answered from the buffer
- `timers`: the producer's deadlines (leases, waiting requests' timeouts, items' time to live)
- `outgoing`: what the producer sends, and each delivery's message built from an item
- `lifecycle`: the table of an item's states and the one object that moves items through it
- `sessions`: who is connected, with which transport, and what each may send
- `pieces`, `deliveries`: which lookup gets which item (a piece of it, a stream), and when
- `producer`: `ProducerCore`, which routes every input to the part whose job it is
- `consumer`: `ConsumerCore`, one link's calls, lease and state
"""

from kvrt._protocol.commands import ProducerCounters
from kvrt._protocol.consumer import (
    ConsumerCore,
    ConsumerEvent,
    Failed,
    LinkState,
    Lost,
    PayloadCame,
    Refused,
    Replied,
    Stray,
    Streamed,
    Welcomed,
)
from kvrt._protocol.heartbeats import (
    DEFAULT_HEARTBEAT_S,
    HEARTBEAT_MISSES,
    MAX_HEARTBEAT_S,
    SILENT_HOLD_LEASES,
    _heartbeat,
)
from kvrt._protocol.outgoing import BATCH_SEGMENT_BYTES, Departure, Outgoing, batch_segments
from kvrt._protocol.pieces import Cut
from kvrt._protocol.producer import ProducerCore
from kvrt._protocol.sessions import PeerState
from kvrt._protocol.waiting import PieceAsked

__all__ = [
    "BATCH_SEGMENT_BYTES",
    "DEFAULT_HEARTBEAT_S",
    "HEARTBEAT_MISSES",
    "MAX_HEARTBEAT_S",
    "SILENT_HOLD_LEASES",
    "ConsumerCore",
    "ConsumerEvent",
    "Cut",
    "Departure",
    "Failed",
    "LinkState",
    "Lost",
    "Outgoing",
    "PayloadCame",
    "PeerState",
    "PieceAsked",
    "ProducerCore",
    "ProducerCounters",
    "Refused",
    "Replied",
    "Stray",
    "Streamed",
    "Welcomed",
    "_heartbeat",
    "batch_segments",
]
