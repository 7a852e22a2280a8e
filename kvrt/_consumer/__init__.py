"""The consumer (decode side): one link per producer, and `drop_select`.

A `_Link` is a ZeroMQ DEALER around a `ConsumerCore`. One task per link, owned by the
link, reads frames, feeds the core, resolves the futures of pending calls, pings, and
sends the receipts that let the producer free delivered items. Many calls may be pending
on one link at once; replies are matched to them by request id, in any order.

The package, one job a module:

- `_session`: a link's session: pending calls, leases, handshake, ordered sends
- `_arrivals`: items arriving on a link
- `_stream_layers`: a link's streams: their layers arriving
- `_link`: a link: its calls (a request sent, its answer awaited), and the task that hands
  what comes to its session, its arrivals and its streams' layers
- `_connections`: what the parts of a consumer share: its checked arguments, its links, its scatters
- `_batch`: a step's lookups cut into batch requests
- `_across`: one lookup over several producers, or its pieces from several, not yet confirmed
- `_agreed`: a lookup (or a batch) agreed with the other ranks of a TP group
- `_drop_selects`: `DropSelects`: `drop_select`, `drop_select_many`, composed of the three above
- `_pulls`: `Pulls`: `pull` into paged pools
- `_fetches`: `Fetches`: `fetch`, a step's requests into paged pools in two phases
- `_open_stream`: `StreamOpening`: `open_stream`, its layers landed into tensors or pools
- `_consumer`: `Consumer`: the public calls, given to the parts it holds; start, close
"""

from kvrt._consumer._consumer import Consumer
from kvrt._consumer._fetches import Fetch
from kvrt._consumer._link import _Link as _Link
from kvrt._consumer._session import (
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_REPLY_TIMEOUT_S,
    DEFAULT_TRANSFER_TIMEOUT_S,
    LinkSession,
    OnLanding,
)
from kvrt._metrics import ConsumerCounters

__all__ = [
    "Consumer",
    "ConsumerCounters",
    "DEFAULT_CONNECT_TIMEOUT_S",
    "DEFAULT_REPLY_TIMEOUT_S",
    "DEFAULT_TRANSFER_TIMEOUT_S",
    "Fetch",
    "LinkSession",
    "OnLanding",
]
