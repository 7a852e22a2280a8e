"""Every control message of kvrt, in one tagged union, with the one encoder and decoder.

A control message travels as the first ZeroMQ frame of a multipart message:
msgpack `[version, message]`, where `message` is a map tagged by its `type` field.
Frames after the first carry tensor bytes (TCP transport) and are described by the
`TensorMeta` entries of the message they follow. `docs/protocol.md` is the reference
for clients in other languages.

Evolution rules (msgspec's schema-evolution rules, kept here so nobody has to look them up):
1. A new field gets a default and goes last in its struct.
2. A tag is never reused, never renamed; a retired message keeps its tag reserved.
3. An incompatible change bumps `PROTOCOL_VERSION`; peers refuse a version they do not speak.
4. Unknown fields are ignored on decode, so an older peer reads a newer peer's messages.
5. `error` keeps its fields in every version, and is read whatever version its envelope
   names: a peer of another protocol version can still tell this side why it was refused.
   An error code this side does not know (a newer peer's) is read as `internal`, its code
   named in the text.
6. Two releases one minor version apart speak one protocol version, so that a fleet can be
   upgraded one side at a time (`tests/test_release_skew.py` holds each change to that).
"""

from __future__ import annotations

import enum
from typing import Annotated, Final

import msgspec
import numpy as np
from msgspec import Meta

from kvrt._errors import ErrorCode, RemoteProtocolError, VersionMismatchError
from kvrt._version import __version__

PROTOCOL_VERSION: Final = 2

RELEASE: Final = __version__
"""This kvrt release, named at hello and in a version refusal."""

MAX_TOKENS: Final = 1 << 20
"""Most tokens a request may name (1M): bounds decode memory for a query."""

MAX_TENSOR_DIMS: Final = 8
MAX_HEADER_BYTES: Final = 16 << 20
"""Largest control frame a peer parses; a larger one gets a typed refusal."""

MAX_PAYLOAD_FRAME_BYTES: Final = 1 << 40
"""Largest frame a consumer receives (1 TiB): libzmq closes a connection that announces a
larger one (a length damaged on the way) instead of waiting for it, and the link reconnects."""

MAX_INBOUND_MESSAGE_BYTES: Final = 64 << 20
"""A producer never receives payloads, so libzmq drops any message larger than this before
allocating it (ZMQ_MAXMSGSIZE), and the connection with it; the peer may reconnect."""

MAX_NAME_CHARS: Final = 256

MAX_ID: Final = 2**63 - 1
"""The largest request id, item id or lease number (msgpack's int64, which every client has)."""
MAX_SECONDS: Final = 1e9
"""The longest time a message names (about 31 years): anything larger is not a real timeout."""
MAX_LISTED: Final = 10_000
"""Most items one `list_items` answers with."""

RequestId = Annotated[int, Meta(ge=0, le=MAX_ID)]
ItemId = Annotated[int, Meta(ge=0, le=MAX_ID)]
Lease = Annotated[int, Meta(ge=0, le=MAX_ID)]
Checksum = Annotated[int, Meta(ge=0)]
"""A 64-bit checksum of a payload's bytes (see `Deliver.checksum`): MessagePack carries no wider integer."""
MAX_LAYERS: Final = 65536
"""Most layers a stream has (`StreamStart.layers`)."""
TOKEN_BYTES: Final = 8
TokenBytes = Annotated[bytes, Meta(max_length=MAX_TOKENS * TOKEN_BYTES)]
"""Token ids as consecutive little-endian int64 (numpy's `<i8`): compact, and cheap for any language."""
Seconds = Annotated[float, Meta(ge=0.0, le=MAX_SECONDS)]
MIN_HEARTBEAT_S: Final = 0.001
"""The shortest heartbeat period: a consumer pings at the period its producer's welcome names."""
HeartbeatSeconds = Annotated[float, Meta(ge=MIN_HEARTBEAT_S, le=MAX_SECONDS)]
Name = Annotated[str, Meta(max_length=MAX_NAME_CHARS)]


class Capability(enum.StrEnum):
    """Names a peer lists in `capabilities`: data transports it can use, in preference order,
    and operations beyond the base protocol. Unknown names are ignored, not refused."""

    TCP = "tcp"
    NCCL = "nccl"
    GLOO = "gloo"
    CUDA_IPC = "cuda_ipc"
    PROBE = "probe"
    STATS = "stats"
    PROBE_MANY = "probe_many"
    """The producer answers `probe_many` (an older one answers each `probe` alone)."""
    CHECKSUM = "checksum"
    """The producer checksums its items (`Producer(checksum=True)`): a consumer on a GPU
    readies its check (compiles the kernel) as it joins, not inside a request."""
    TCP_FRAMES = "tcp_frames"
    """The consumer takes a TCP payload in several frames (an older one takes each item's
    payload as one): a producer then sends a large payload in frames of a size that the
    consumer's allocator serves from memory it keeps (`kvrt.transports.tcp`)."""


# Messages are plain data decoded from the wire and never refer back to themselves, so the
# cycle collector need not track them (gc=False): a DeliverMany of 16 hits then makes 52
# tracked objects instead of 117, and each tracked allocation brings the next collection
# nearer (a generation-1 pass stopped a consumer's loop for 0.3-1.4 ms on an H200 host).


class TensorMeta(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One tensor inside an item's packed payload: dtype (torch's name without `torch.`),
    shape, and the byte offset where its contiguous bytes start (a multiple of its item size)."""

    dtype: Annotated[str, Meta(max_length=32)]
    shape: Annotated[list[Annotated[int, Meta(ge=0, le=2**62)]], Meta(max_length=MAX_TENSOR_DIMS)]
    offset: Annotated[int, Meta(ge=0, le=2**62)] = 0


class Message(msgspec.Struct, frozen=True, tag_field="type", forbid_unknown_fields=False, gc=False):
    """Base of every control message; the subclass's tag is its `type` on the wire."""


Names = Annotated[list[Name], Meta(max_length=64)]


MAX_RECEIPTS: Final = 4096

ItemIds = Annotated[list[ItemId], Meta(max_length=MAX_RECEIPTS)]
Leases = Annotated[list[Lease], Meta(max_length=MAX_RECEIPTS)]


MAX_HEADS: Final = 1 << 16
"""The most KV heads an item may have, as far as a head range can name them."""
MAX_READERS: Final = 4096
"""The most decode ranks that may take pieces of one item."""


class HeadRange(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """KV heads [first, end) of an item (a piece of it): what one decode rank of another TP
    size holds."""

    first: Annotated[int, Meta(ge=0, le=MAX_HEADS)]
    end: Annotated[int, Meta(ge=1, le=MAX_HEADS)]


Readers = Annotated[int, Meta(ge=1, le=MAX_READERS)]


class Hello(Message, frozen=True, tag="hello"):
    """Consumer → producer, first message on a connection (and again after a reconnect).
    `capabilities` lists the transports the consumer can receive on, preferred first, then
    what it takes beyond the base protocol (`Capability.TCP_FRAMES`)."""

    version: int
    name: Name = ""
    capabilities: Names = []
    host: Name = ""
    """Which machine (its boot id): `cuda_ipc` is chosen only when the producer's is the same."""
    received: ItemIds = []
    received_leases: Leases = []
    """A hello that starts a new session repeats the receipts the consumer sent in the session
    it ends (the last `MAX_RECEIPTS`), as `received`: one the producer never read (its
    connection broke, a stall) counts before the old session's items go back."""
    release: Name = ""
    """The consumer's kvrt release (`kvrt.__version__`), which a refusal names."""


MAX_RENDEZVOUS_CHARS: Final = 4096
"""A rendezvous value: a store's address, or a `cuda_ipc` probe share in hex."""


class Welcome(Message, frozen=True, tag="welcome"):
    """Producer → consumer, the answer to Hello: who the producer is, how often to ping, and
    the transport chosen for this consumer with what it needs to join it (`rendezvous`)."""

    version: int
    producer_id: Name
    heartbeat_s: HeartbeatSeconds
    transport: Name = "tcp"
    capabilities: Names = []
    rendezvous: Annotated[dict[Name, Annotated[str, Meta(max_length=MAX_RENDEZVOUS_CHARS)]], Meta(max_length=16)] = {}
    lease_s: Seconds = 0.0
    """How long the producer holds what it delivered to this consumer after the last message
    it had from it. The consumer hands a delivered item to its caller only while less than
    this has passed since it sent its last request that the producer answered."""
    heads: HeadRange | None = None
    """Which KV heads of the model this producer's items hold (a prefill TP rank's share), if
    it was told: a consumer of several producers asks each for its part of a head range."""
    release: Name = ""
    """The producer's kvrt release (`kvrt.__version__`)."""


class Ping(Message, frozen=True, tag="ping"):
    """Consumer → producer, at least every `heartbeat_s`; the producer answers Pong."""

    nonce: int = 0


class Pong(Message, frozen=True, tag="pong"):
    """Producer → consumer: the answer to a Ping with its nonce. One with `UNASKED_NONCE`, which
    no Ping carries, answers nothing: a producer sends it to learn whether a silent consumer's
    connection is still up (ZeroMQ refuses to route it once it closed), and consumers ignore it."""

    nonce: int = 0


UNASKED_NONCE: Final = 0
"""The nonce of a Pong no Ping asked for (consumers number their pings from 1)."""


class Bye(Message, frozen=True, tag="bye"):
    """Either side, when it closes: the peer fails or returns what it held for us at once."""

    reason: Name = ""


class DropSelect(Message, frozen=True, tag="drop_select"):
    """Consumer → producer: take the best item matching `tokens` (already roi-masked, as
    little-endian int64 bytes; a length that is not a multiple of 8 is refused).

    `tokens` None takes the oldest item. `timeout_s` 0 answers at once; None waits until
    a match is inserted, the consumer cancels, or either side closes. The answer is
    `Deliver`, `Miss` or `ErrorReply` with the same `request_id`.
    """

    request_id: RequestId
    tokens: TokenBytes | None
    timeout_s: Seconds | None = 0.0
    stream: bool = False
    """True: the consumer takes the item layer by layer (`stream_start`, `stream_layer`...,
    `stream_end`), and may take a request whose prefill is still running."""
    heads: HeadRange | None = None
    """A piece of the item: only these of its KV heads (in the producer's numbering, from 0)
    travel. The item stays for the other pieces until `readers` pieces were confirmed; one
    consumer takes at most one piece of an item. An item whose value is empty (MLA: one
    latent per token, the same on every rank) travels whole as every piece."""
    readers: Readers = 1
    """With `heads`: how many consumers take a piece of the item (the decode ranks that read
    this producer). Every request for pieces of one item names the same number."""
    hidden: bool = True
    """With `heads`: whether the piece carries the item's hidden states (one rank of several
    needs them)."""
    whole: bool = False
    """With `stream`: a finished item (not a prefill still streaming) may come as a plain
    `deliver`, in one transfer, instead of layer by layer (the consumer hands its layers out
    itself). A producer that does not know the field streams it: the consumer reads either."""


class Cancel(Message, frozen=True, tag="cancel"):
    """Consumer → producer: forget a waiting request. A Deliver already sent is Released."""

    request_id: RequestId


MAX_SEGMENTS: Final = 4096

Segment = tuple[Annotated[int, Meta(ge=0, le=2**62)], Annotated[int, Meta(ge=1, le=2**62)]]
"""(offset, nbytes) of one byte range of a payload."""


class Deliver(Message, frozen=True, tag="deliver"):
    """Producer → consumer: the item for `request_id`. Its tensors travel packed in one
    payload of `payload_bytes` (TCP: the one frame after this header), each at its meta's
    offset. The consumer answers `Received` once it holds the tensors (the producer frees
    the item then), or `Release` to hand it back."""

    request_id: RequestId
    item_id: ItemId
    matched: Annotated[int, Meta(ge=0)]
    input_tokens: TensorMeta
    roi: TensorMeta | None
    key: TensorMeta
    value: TensorMeta
    hidden: TensorMeta | None
    payload_bytes: Annotated[int, Meta(ge=0, le=2**62)] = 0
    segments: Annotated[list[Segment], Meta(max_length=MAX_SEGMENTS)] = []
    """Out-of-band transports (NCCL, gloo) move the payload as these (offset, nbytes) byte
    ranges, one transfer each, in this order; together they tile the payload. Empty: one
    transfer of the whole payload. A published prefill travels in chunks of whole layers,
    each sent as soon as it is gathered, so the consumer can start on the first chunks
    while the last ones are still gathered or on the wire."""
    lease: Lease = 0
    """This delivery's number: the consumer's `Received` (or `Release`) names it, and the
    producer refuses one whose delivery is no longer the item's current one."""
    checksum: Checksum | None = None
    """XXH3-64 of the payload's bytes as the producer wrote them (`Producer(checksum=True)`):
    the consumer checks the bytes that landed against it before anyone sees them. None: not
    checked (a consumer that predates the field ignores it)."""
    device_checksum: Checksum | None = None
    """For an item a producer on a GPU wrote (`Producer(checksum=True)`), in place of
    `checksum`: the sum checksum of `kvrt.kernels.checksum` of the payload's bytes, computed
    there on the GPU, seeded with the XXH3-64 of the tensors' descriptions (as `checksum`)."""
    delivery_checksum: Checksum | None = None
    """With `checksum` or `device_checksum`: the checksum of this delivery's own fields
    (`kvrt._checksum.delivery_checksum`: `request_id`, `item_id`, `matched`, `lease`)."""


MAX_BATCH: Final = 256
"""Most lookups one `drop_select_many` carries."""

BATCH_ALIGNMENT: Final = 256
"""Where each hit of a `deliver_many` starts in its payload: a multiple of this many bytes."""


class DropSelectMany(Message, frozen=True, tag="drop_select_many"):
    """Consumer → producer: several `drop_select`s answered at once (timeout 0), all in one
    `DeliverMany`: a serving engine takes the KV of a whole scheduler step in one request,
    and the hits travel as one transfer. Each query as `DropSelect.tokens`; None takes the
    oldest item. Items are taken in query order, each at most once."""

    request_id: RequestId
    queries: Annotated[list[TokenBytes | None], Meta(min_length=1, max_length=MAX_BATCH)]
    heads: HeadRange | None = None
    """As `DropSelect.heads`, for every query."""
    readers: Readers = 1
    hidden: bool = True


class Hit(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One query's item in a `DeliverMany`: as `Deliver`'s fields, its packed tensors at
    `offset` of the batch's payload (their metas' offsets count from there)."""

    item_id: ItemId
    matched: Annotated[int, Meta(ge=0)]
    input_tokens: TensorMeta
    roi: TensorMeta | None
    key: TensorMeta
    value: TensorMeta
    hidden: TensorMeta | None
    offset: Annotated[int, Meta(ge=0, le=2**62)]
    payload_bytes: Annotated[int, Meta(ge=0, le=2**62)]
    lease: Lease = 0
    """As `Deliver.lease`."""
    checksum: Checksum | None = None
    """As `Deliver.checksum`."""
    device_checksum: Checksum | None = None
    """As `Deliver.device_checksum`."""
    delivery_checksum: Checksum | None = None
    """As `Deliver.delivery_checksum`, with the batch's `request_id`."""


class DeliverMany(Message, frozen=True, tag="deliver_many"):
    """Producer → consumer: the answer to a `drop_select_many`, one entry per query (None: a
    miss). The hits' payloads travel together: over TCP one frame per hit after this header,
    in order; out of band as one payload of `payload_bytes`, each hit at its `offset` (a
    multiple of `BATCH_ALIGNMENT`), in a few transfers (`segments`). The consumer answers `Received`
    for the hits it keeps and `Release` for the others, as for `deliver`."""

    request_id: RequestId
    hits: Annotated[list[Hit | None], Meta(max_length=MAX_BATCH)]
    payload_bytes: Annotated[int, Meta(ge=0, le=2**62)] = 0
    segments: Annotated[list[Segment], Meta(max_length=MAX_BATCH)] = []
    """Out of band: the payload moves as these (offset, nbytes) ranges, one transfer each, in
    this order; each hit lies inside one of them (small hits share one, a large hit has its
    own). Empty: one transfer of the whole payload."""


SPLIT_PAYLOAD_BYTES: Final = 1 << 20
"""Over TCP, a `deliver` or `deliver_many` whose payload is at least this large travels as two
messages: its header alone, then a `payload` message with the frames. The consumer knows the
answer as soon as the header comes (the caller's reply deadline stops there) while the bytes
are still on the wire; a smaller payload rides with its header, in one message."""


class Payload(Message, frozen=True, tag="payload"):
    """Producer → consumer, over TCP: the frames of the `deliver` or `deliver_many` for
    `request_id`, which came without them (see `SPLIT_PAYLOAD_BYTES`): one frame per item,
    as they would have followed the header."""

    request_id: RequestId


class Miss(Message, frozen=True, tag="miss"):
    """Producer → consumer: no item matched before the request's timeout."""

    request_id: RequestId


class Received(Message, frozen=True, tag="received"):
    """Consumer → producer: these items' tensors arrived and were handed over; the producer may
    free them. `leases`, when given, names each one's delivery (`Deliver.lease`), in order: a
    receipt for a delivery whose lease ended is refused (`not_found`)."""

    item_ids: ItemIds
    leases: Leases = []


class Release(Message, frozen=True, tag="release"):
    """Consumer → producer: the item was not taken (its request was cancelled); buffer it again.
    `lease` as in `Received` (0: the item's current delivery)."""

    item_id: ItemId
    lease: Lease = 0


class ErrorReply(Message, frozen=True, tag="error"):
    """Either way: `request_id` failed (None: the message had no readable request id)."""

    request_id: RequestId | None
    code: ErrorCode
    message: str


class Health(Message, frozen=True, tag="health"):
    """Client → producer: is it serving? Answered with `health_reply`."""

    request_id: RequestId


class HealthReply(Message, frozen=True, tag="health_reply"):
    request_id: RequestId
    producer_id: Name
    uptime_s: Seconds
    transports: Names = []


class Stats(Message, frozen=True, tag="stats"):
    """Client → producer: counters and gauges. Answered with `stats_reply`."""

    request_id: RequestId


class StatsReply(Message, frozen=True, tag="stats_reply"):
    request_id: RequestId
    items: int
    buffer_bytes: int
    buffer_limit_bytes: int
    in_flight: int
    waiting_requests: int
    peers: int
    totals: dict[Name, int] = {}
    """Counters since start: inserted_items, delivered_items, delivered_bytes, misses, ..."""


class Probe(Message, frozen=True, tag="probe"):
    """Client → producer: what a drop_select with these (masked) tokens would take, without
    taking it. `tokens` as in drop_select. Answered with `probe_reply`."""

    request_id: RequestId
    tokens: TokenBytes | None


class ProbeReply(Message, frozen=True, tag="probe_reply"):
    """`matched` 0 and `item_id` nil: nothing would match."""

    request_id: RequestId
    matched: Annotated[int, Meta(ge=0)]
    item_id: ItemId | None = None


class ProbeMany(Message, frozen=True, tag="probe_many"):
    """Client → producer: a `probe` for each query, answered at once in one `probe_many_reply`
    (a scheduler step's lookups in one message). Each query as `Probe.tokens`."""

    request_id: RequestId
    queries: Annotated[list[TokenBytes | None], Meta(min_length=1, max_length=MAX_BATCH)]


class Probed(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One query's answer in a `probe_many_reply`, as `ProbeReply`'s fields."""

    matched: Annotated[int, Meta(ge=0)]
    item_id: ItemId | None = None


class ProbeManyReply(Message, frozen=True, tag="probe_many_reply"):
    """The answers to a `probe_many`, in query order."""

    request_id: RequestId
    answers: Annotated[list[Probed], Meta(max_length=MAX_BATCH)]


class ListItems(Message, frozen=True, tag="list_items"):
    """Client → producer: the oldest buffered items, at most `limit`. Answered with `item_list`."""

    request_id: RequestId
    limit: Annotated[int, Meta(ge=0, le=MAX_LISTED)] = 100


class ItemSummary(msgspec.Struct, frozen=True):
    """One buffered item: id, masked token count, bytes, seconds buffered."""

    item_id: ItemId
    tokens: int
    nbytes: int
    age_s: float


class ItemList(Message, frozen=True, tag="item_list"):
    request_id: RequestId
    items: list[ItemSummary]
    total: int


class Evict(Message, frozen=True, tag="evict"):
    """Client → producer: drop a buffered item. Answered with `evicted`, or `error` not_found."""

    request_id: RequestId
    item_id: ItemId


class Evicted(Message, frozen=True, tag="evicted"):
    request_id: RequestId
    item_id: ItemId
    nbytes: int


class StreamStart(Message, frozen=True, tag="stream_start"):
    """Producer → consumer: the item for a streaming `request_id`: its tokens (one payload
    frame follows, as in `deliver`) and how many layers will follow as `stream_layer`."""

    request_id: RequestId
    item_id: ItemId
    matched: Annotated[int, Meta(ge=0)]
    input_tokens: TensorMeta
    roi: TensorMeta | None
    layers: Annotated[int, Meta(ge=0, le=MAX_LAYERS)]
    payload_bytes: Annotated[int, Meta(ge=0, le=2**62)] = 0
    lease: Lease = 0
    """As `Deliver.lease`: the stream's end is confirmed under it."""
    checksum: Checksum | None = None
    """Of this message's own fields (ids, match, lease, layers, frame length) and its tokens
    frame with their metas (`Producer(checksum=True)`; `kvrt._checksum.stream_start_checksum`):
    a consumer that finds a mismatch opens nothing and starts a new session, as for
    `Deliver.delivery_checksum`."""


class StreamLayer(Message, frozen=True, tag="stream_layer"):
    """Producer → consumer: one layer of a stream, in order; two frames follow (key, value),
    each [tokens, heads, head_dim] as its meta says (offsets 0)."""

    item_id: ItemId
    layer: Annotated[int, Meta(ge=0, le=65535)]
    key: TensorMeta
    value: TensorMeta
    checksum: Checksum | None = None
    """Of the layer's key and value frames and their metas, as the prefill wrote them
    (`Producer(checksum=True)`): checked where they land, as `Deliver.checksum`."""


class StreamEnd(Message, frozen=True, tag="stream_end"):
    """Producer → consumer: the stream is complete; a frame with `hidden` follows if it has one.
    The consumer confirms with `received` (the item id) as for a delivered item."""

    item_id: ItemId
    hidden: TensorMeta | None = None
    checksum: Checksum | None = None
    """Of the hidden states' frame and its meta, if it has one."""
    layer_checksums: Annotated[list[Checksum], Meta(max_length=MAX_LAYERS)] | None = None
    """From a producer on a GPU (`Producer(checksum=True)`), whose layers travel before they
    are written and so carry no `StreamLayer.checksum`: per layer, in order, the checksum of
    its key and value as the prefill wrote them (`kvrt._checksum.tensors_device_checksum`).
    The consumer checks each layer where it landed and the stream ends only if all match:
    else it fails with `IntegrityError` and its item goes back whole."""
    device_checksum: Checksum | None = None
    """From a producer on a GPU: the hidden states' checksum as `layer_checksums` computes one
    (at `kvrt._checksum.HIDDEN_POSITION`), in place of `checksum`."""


class StreamAbort(Message, frozen=True, tag="stream_abort"):
    """Producer → consumer: the prefill behind this stream failed; what arrived is void."""

    item_id: ItemId
    reason: str = ""


AnyMessage = (
    Hello | Welcome | Ping | Pong | Bye | DropSelect | Cancel | Deliver | Miss | Received | Release | ErrorReply
    | Health | HealthReply | Stats | StatsReply | Probe | ProbeReply | ListItems | ItemList | Evict | Evicted
    | StreamStart | StreamLayer | StreamEnd | StreamAbort | DropSelectMany | DeliverMany | Payload | ProbeMany
    | ProbeManyReply
)  # fmt: skip


MAX_IPC_HANDLE_BYTES: Final = 1024
"""A CUDA IPC memory handle (64 bytes; torch's handles of expandable segments are longer)."""


MAX_IPC_MARK: Final = (1 << 62) - 1
"""The last number a `cuda_ipc` pair marks a range with (a consumer giving up writes more)."""


class IpcShare(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """The frame a `cuda_ipc` transfer carries instead of the bytes: where the consumer's copy
    engines read them in the producer's GPU memory, and for each (offset, nbytes) range it
    reads, the mark (a number of the pair's, in order) that the producer's stream writes to
    the pair's word once the range holds its bytes.

    `handle` .. `counter_offset` are torch's share of the storage (`_share_cuda_`): the
    allocation's IPC handle, the storage's place and size in it, and the reference counter
    (a shared-memory file and slot) the consumer decrements once it is done reading, which is
    what lets the producer's allocator reuse the memory; no counter (empty): the storage is a
    slab of the producer's registered memory, which the consumer opens once and keeps open
    (the protocol, not a counter, says how long each item in it stays). `start` is where the
    payload begins in the storage. A mark of 0: the range was written before it was sent."""

    handle: Annotated[bytes, Meta(max_length=MAX_IPC_HANDLE_BYTES)]
    storage_offset: Annotated[int, Meta(ge=0, le=2**62)]
    storage_bytes: Annotated[int, Meta(ge=0, le=2**62)]
    counter: Annotated[bytes, Meta(max_length=MAX_NAME_CHARS)]
    counter_offset: Annotated[int, Meta(ge=0, le=2**32)]
    start: Annotated[int, Meta(ge=0, le=2**62)]
    marks: Annotated[list[Annotated[int, Meta(ge=0, le=MAX_IPC_MARK)]], Meta(max_length=MAX_SEGMENTS)]


_UNREADABLE: Final = (msgspec.DecodeError, RecursionError, ValueError, OverflowError, MemoryError)
"""What decoding a peer's bytes may raise: msgspec's own errors, and the interpreter's when a
frame nests deeper than the recursion limit (a 1 KB frame can) or asks for more memory than
there is. Each is the peer's fault and fails that frame alone."""


def _reason(exc: BaseException) -> str:
    if isinstance(exc, RecursionError):
        return "it nests deeper than this side decodes"
    if isinstance(exc, MemoryError):
        return "it asks for more memory than this side has"
    return str(exc)


_share_decoder: Final = msgspec.msgpack.Decoder(IpcShare)


def encode_share(share: IpcShare) -> bytes:
    return _encoder.encode(share)


def decode_share(frame: bytes | memoryview) -> IpcShare:
    """A `cuda_ipc` frame, validated; `RemoteProtocolError` if it is not one."""
    if len(frame) > MAX_HEADER_BYTES:
        raise RemoteProtocolError(f"cuda_ipc frame of {len(frame)} bytes is over the limit of {MAX_HEADER_BYTES}")
    try:
        return _share_decoder.decode(frame)
    except _UNREADABLE as exc:
        raise RemoteProtocolError(f"invalid cuda_ipc frame: {_reason(exc)}") from None


class _Envelope(msgspec.Struct, array_like=True):
    version: int
    message: msgspec.Raw


_encoder: Final = msgspec.msgpack.Encoder()
_envelope_decoder: Final = msgspec.msgpack.Decoder(_Envelope)
_message_decoder: Final = msgspec.msgpack.Decoder(AnyMessage)


def encode(message: Message) -> bytes:
    """The first frame for `message`."""
    return _encoder.encode((PROTOCOL_VERSION, message))


def tokens_to_bytes(tokens: np.ndarray) -> bytes:
    """The wire form of a token sequence."""
    return np.ascontiguousarray(tokens, dtype="<i8").tobytes()


def tokens_from_bytes(data: bytes) -> np.ndarray:
    """Token ids from their wire form; refuses a length that is not whole tokens."""
    if len(data) % TOKEN_BYTES:
        raise RemoteProtocolError(f"tokens: {len(data)} bytes is not a whole number of int64 tokens")
    return np.frombuffer(data, dtype="<i8")


def decode(frame: bytes | memoryview) -> AnyMessage:
    """The message in a first frame, validated.

    Raises `RemoteProtocolError` for a frame that is too large, not msgpack, an unknown
    tag, or a field of the wrong type or size (the message says which field), and
    `VersionMismatchError` for a version this side does not speak.
    """
    if len(frame) > MAX_HEADER_BYTES:
        raise RemoteProtocolError(f"control frame of {len(frame)} bytes is over the limit of {MAX_HEADER_BYTES}")
    try:
        envelope = _envelope_decoder.decode(frame)
    except _UNREADABLE as exc:
        raise RemoteProtocolError(f"unreadable control frame: {_reason(exc)}") from None
    if envelope.version != PROTOCOL_VERSION:
        refusal = _refusal_of_any_version(envelope.message)
        if refusal is not None:
            return refusal
        raise VersionMismatchError(version_mismatch(envelope.version, _peek_release(envelope.message)))
    try:
        return _message_decoder.decode(envelope.message)
    except _UNREADABLE as exc:
        refusal = _error_of_a_newer_release(envelope.message)
        if refusal is not None:
            return refusal
        raise RemoteProtocolError(f"invalid control message: {_reason(exc)}") from None


MAX_QUOTED_CHARS: Final = 1024
"""The most of a peer's text (an error's message) that this side puts in its own errors and logs."""


def quoted(text: str) -> str:
    """A peer's text as this side repeats it: at most `MAX_QUOTED_CHARS` characters, those that
    do not print (control characters, terminal escapes) escaped."""
    clipped = text[:MAX_QUOTED_CHARS]
    if not clipped.isprintable():
        clipped = "".join(char if char.isprintable() else ascii(char)[1:-1] for char in clipped)
    if len(text) > MAX_QUOTED_CHARS:
        clipped += f"... ({len(text) - MAX_QUOTED_CHARS} more characters)"
    return clipped


def version_mismatch(peer_version: int, peer_release: str) -> str:
    """Why two peers cannot talk: both releases and both protocol versions."""
    peer = f"kvrt {quoted(peer_release)}" if peer_release else "a kvrt release that does not say which"
    return (
        f"the peer ({peer}) speaks control protocol version {peer_version}; this side (kvrt {RELEASE}) "
        f"speaks {PROTOCOL_VERSION}: releases that changed the protocol incompatibly cannot work together, "
        "upgrade the older side (docs/protocol.md, Versions)"
    )


def _refusal_of_any_version(message: msgspec.Raw) -> ErrorReply | None:
    """The `error` in an envelope of another version (its fields never change), else None."""
    try:
        refusal = _message_decoder.decode(message)
    except (*_UNREADABLE, TypeError):
        return _error_of_a_newer_release(message)
    return refusal if isinstance(refusal, ErrorReply) else None


def _error_of_a_newer_release(message: msgspec.Raw) -> ErrorReply | None:
    """An `error` whose code this release does not know (a newer peer's), read as `internal`
    with that code in its text, so that its call fails now rather than at its timeout; None
    for anything else."""
    try:
        fields = msgspec.msgpack.decode(message, type=dict[str, object])
    except (*_UNREADABLE, TypeError):
        return None
    code, text, request_id = fields.get("code"), fields.get("message"), fields.get("request_id")
    if fields.get("type") != "error" or not isinstance(code, str) or not isinstance(text, str):
        return None
    if code in ErrorCode.__members__.values():
        return None  # a known code: the error is malformed otherwise
    if not (request_id is None or (isinstance(request_id, int) and 0 <= request_id < 2**63)):
        return None
    return ErrorReply(request_id=request_id, code=ErrorCode.INTERNAL, message=f"({quoted(code)}) {text}")


def _peek_release(message: msgspec.Raw) -> str:
    """The `release` a message of another version names, if it names one (a hello)."""
    try:
        fields = msgspec.msgpack.decode(message, type=dict[str, object])
    except (*_UNREADABLE, TypeError):
        return ""
    release = fields.get("release")
    return release[:MAX_NAME_CHARS] if isinstance(release, str) else ""


def peek_request_id(frame: bytes | memoryview) -> int | None:
    """The request id of a frame that failed to decode, if one can be read, for the error reply."""
    try:
        envelope = _envelope_decoder.decode(frame)
        fields = msgspec.msgpack.decode(envelope.message, type=dict[str, object])
    except (*_UNREADABLE, TypeError):
        return None
    request_id = fields.get("request_id")
    if isinstance(request_id, int) and 0 <= request_id < 2**63:
        return request_id
    return None
