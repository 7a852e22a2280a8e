"""A stream's layers arriving on a link: `StreamLayers`, called by `_Link._handle` for each
stream message, lands each layer for the `ConsumerStream` that `Consumer.open_stream`
(`_open_stream`) opened.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence

import torch
import zmq

from kvrt import _messages as m
from kvrt._checksum import (
    HIDDEN_POSITION,
    stream_start_checksum,
    tensors_checksum,
    tensors_device_checksum,
    tensors_seed,
)
from kvrt._consumer._session import LinkSession, _Reply
from kvrt._devices import translate_torch_error
from kvrt._errors import (
    IntegrityError,
    InvalidInputError,
    KVRTError,
    KVRTTimeoutError,
    ProtocolError,
    RemoteProtocolError,
    StreamAbortedError,
)
from kvrt._item_bytes import TensorsSum
from kvrt._streams import ConsumerStream
from kvrt._tensors import unpack
from kvrt._threads import CheckWorkers, outcome_seen
from kvrt.transports import Receiver


def _check(
    checksum: int | None, tensors: Sequence[torch.Tensor], metas: Sequence[m.TensorMeta], position: int, what: str
) -> None:
    """Raise `IntegrityError` if tensors that landed in host memory do not match the checksum
    their producer computed where it wrote them (`Producer(checksum=True)`): a layer's, at its
    index (`position`), or the hidden states'."""
    if checksum is None or any(tensor.device.type != "cpu" for tensor in tensors):
        return
    if tensors_checksum(tensors, metas, position) != checksum:
        raise IntegrityError(
            f"{what}: its bytes, or the description of its tensors, do not match the checksum its producer "
            "computed where it wrote them (damaged on the way): the stream went back whole"
        )


_check_streams: dict[torch.device, torch.cuda.Stream] = {}
_check_streams_lock = threading.Lock()


def _summing(
    checks: CheckWorkers, tensors: Sequence[torch.Tensor], metas: Sequence[m.TensorMeta], position: int,
    landed: torch.cuda.Event | None,
) -> TensorsSum:  # fmt: skip
    """The checksum of a landed layer (`position`: its index) or hidden states as a producer on
    a GPU computes one (`kvrt._checksum.tensors_device_checksum`), for its stream's end to
    compare. On a GPU: the kernels queued, in one of the link's `checks` workers, on a
    stream of its own after `landed`; what the future gives reads their result (waiting for
    the GPU). On the host: the kernel's reference, computed in the worker."""
    seed = tensors_seed(metas, position)
    if landed is None:

        def on_host() -> Callable[[], int]:
            from kvrt.kernels.checksum import checksum_reference  # Triton: only for GPU producers' streams

            value = tensors_device_checksum([checksum_reference(tensor, seed) for tensor in tensors], seed)
            return lambda: value

        return checks.submit(on_host)

    def on_gpu() -> Callable[[], int]:
        from kvrt.kernels.checksum import queue_checksums_after

        device = tensors[0].device
        with _check_streams_lock:
            stream = _check_streams.get(device)
            if stream is None:
                stream = _check_streams[device] = torch.cuda.Stream(device)
        sums = queue_checksums_after(tensors, seed, stream, landed)  # its reader may drop them meanwhile
        return lambda: tensors_device_checksum(sums(), seed)

    return checks.submit(on_gpu)


def _read_sums(readers: Sequence[Callable[[], int]]) -> list[int]:
    """The values of queued checksums, in order (in a kvrt check worker: it waits for the GPU)."""
    return [read() for read in readers]


def _start_damaged(start: m.StreamStart, payload: Sequence[zmq.Frame]) -> bool:
    """Whether a stream's start fails the checksum of its fields and tokens frame (one that
    carries none is not checked)."""
    if start.checksum is None:
        return False
    if len(payload) != 1:
        return True
    computed = stream_start_checksum(
        start.request_id, start.item_id, start.matched, start.lease, start.layers, start.payload_bytes,
        payload[0].buffer, (start.input_tokens, start.roi),
    )  # fmt: skip
    return computed != start.checksum


def _tensor_metas(message: m.StreamLayer | m.StreamEnd | m.StreamAbort) -> tuple[m.TensorMeta, ...]:
    """The tensors that follow a stream message: a layer's key and value, an end's hidden states."""
    match message:
        case m.StreamLayer(key=key_meta, value=value_meta):
            return (key_meta, value_meta)
        case m.StreamEnd(hidden=hidden_meta) if hidden_meta is not None:
            return (hidden_meta,)
    return ()


class StreamLayers:
    """A link's streams: layers received as the producer sends them."""

    def __init__(self, session: LinkSession) -> None:
        self._session = session
        self._ends = EndsDue(session, self._stream_lost)

    def on_stream_start(
        self, future: asyncio.Future[_Reply] | None, start: m.StreamStart, payload: Sequence[zmq.Frame]
    ) -> None:
        if _start_damaged(start, payload):
            # Nothing in it can be named to the producer (a release might name another item):
            # nothing is taken, and the new session has the producer take the stream back.
            error = IntegrityError(
                f"the start of a stream of item {start.item_id} (request {start.request_id}) does not match the "
                "checksum of its ids, match, lease, layers and tokens (damaged on the way): nothing was taken, and "
                "the producer takes it back in a new session"
            )
            self._session.start_afresh(future, error)
            return
        self._session.leases[start.item_id] = start.lease
        try:
            if len(payload) != 1 or payload[0].buffer.nbytes != start.payload_bytes:
                raise RemoteProtocolError("stream_start needs one payload frame of payload_bytes")
            input_tokens, roi = unpack((start.input_tokens, start.roi), payload[0].buffer)
            assert input_tokens is not None
        except ProtocolError as exc:
            self._session.release([start.item_id])
            if future is not None and not future.done():
                future.set_exception(exc)
            return
        if future is None or future.done():
            self._session.release([start.item_id])
            return
        if not self._session.lease_holds():
            self._session.release([start.item_id])
            future.set_exception(self._session.lease_error())
            return
        call = self._session.calls.get(start.request_id)
        writer = None if call is None else call.writer
        if writer is not None and start.layers != writer.placement.pools.layers:
            self._session.release([start.item_id])
            future.set_exception(
                InvalidInputError(f"the stream has {start.layers} layers, the pools {writer.placement.pools.layers}")
            )
            return

        def confirm() -> KVRTError | None:
            self._session.open_streams.pop(start.item_id, None)
            return None if self._session.settle(start.item_id, keep=True) else self._session.lease_error()

        stream = ConsumerStream(input_tokens, roi, start.matched, start.layers, confirm, writer)
        self._session.open_streams[start.item_id] = stream
        future.set_result(_Reply(start, stream=stream))

    def on_streamed(self, message: m.StreamLayer | m.StreamEnd | m.StreamAbort, payload: Sequence[zmq.Frame]) -> None:
        stream = self._session.open_streams.get(message.item_id)
        transport = self._session.receiver
        if stream is not None and not self._session.lease_holds():  # the stream may be another reader's by now
            self._stream_lost(message.item_id, self._session.lease_error())
            stream = None
        if stream is None:  # a stream this side gave back
            if transport is not None:
                _skip(self._session, transport, message, payload)
            return
        try:
            match message:
                case m.StreamLayer(layer=layer, key=key_meta, value=value_meta, checksum=checksum):
                    assert transport is not None  # a stream was opened over it
                    self._receive_layer(
                        stream, message.item_id, transport, layer, key_meta, value_meta, payload, checksum
                    )
                case m.StreamEnd():
                    assert transport is not None
                    self._receive_end(stream, transport, message, payload)
                case m.StreamAbort(reason=reason):
                    self._session.open_streams.pop(message.item_id, None)
                    self._session.leases.pop(message.item_id, None)
                    endpoint = self._session.endpoint
                    stream.fail(StreamAbortedError(f"producer at {endpoint} aborted the stream: {reason}"))
        except (ProtocolError, IntegrityError, IndexError) as exc:
            self._session.open_streams.pop(message.item_id, None)
            error = exc if isinstance(exc, ProtocolError | IntegrityError) else RemoteProtocolError(str(exc))
            _count(self._session, error)
            stream.fail(error)
            if transport is not None:  # its item goes back (or, its bytes on the way, the session: see `refuse_stream`)
                transport.refuse_stream(self._session, message.item_id, error)
            else:
                self._session.release([message.item_id])

    def _receive_layer(
        self, stream: ConsumerStream, item_id: int, transport: Receiver, layer: int,
        key_meta: m.TensorMeta, value_meta: m.TensorMeta, payload: Sequence[zmq.Frame], checksum: int | None,
    ) -> None:  # fmt: skip
        """Post a streamed layer's receive. On a GPU the reader gets it at once, with the event
        of its landing; else once it landed (host frames: here already, handed on now, so
        that the layers and the end reach the reader in their order)."""
        stream.posting(layer)
        arrival = transport.receive_tensors((key_meta, value_meta), payload)
        stream.arriving = arrival.complete
        summed = checksum is None and self._producer_checksums()
        checks = self._session.checks
        if arrival.landed is not None:
            key, value = arrival.tensors
            if summed:  # queued before the reader gets it: what landed, not what it made of it
                stream.sums[layer] = _summing(checks, (key, value), (key_meta, value_meta), layer, arrival.landed)
            self._deliver_layer(stream, item_id, layer, key, value, arrival.landed)
        elif arrival.complete.done():
            key, value = arrival.complete.result()
            _check(checksum, (key, value), (key_meta, value_meta), layer, f"layer {layer} of stream {item_id}")
            if summed:
                stream.sums[layer] = _summing(checks, (key, value), (key_meta, value_meta), layer, None)
            self._deliver_layer(stream, item_id, layer, key, value)
            return

        def landed(arriving: asyncio.Future[list[torch.Tensor]]) -> None:
            error = None if arriving.cancelled() else arriving.exception()
            if error is not None:
                self._stream_lost(item_id, translate_torch_error(error, what=f"receiving layer {layer} of a stream"))
            elif not arriving.cancelled() and arrival.landed is None:
                key, value = arriving.result()
                try:
                    _check(checksum, (key, value), (key_meta, value_meta), layer, f"layer {layer} of stream {item_id}")
                except IntegrityError as failed:
                    self._stream_lost(item_id, failed)
                    return
                if summed:
                    stream.sums[layer] = _summing(checks, (key, value), (key_meta, value_meta), layer, None)
                self._deliver_layer(stream, item_id, layer, key, value)

        self._session.own_arrival(arrival.complete, landed)

    def _deliver_layer(
        self, stream: ConsumerStream, item_id: int, layer: int, key: torch.Tensor, value: torch.Tensor,
        landed: torch.cuda.Event | None = None,
    ) -> None:  # fmt: skip
        """Hand a layer to its reader (GPU: with the event of its landing); a reader of the pools
        gets it once its write there is queued, with the event after the write."""
        writer = stream.writer
        if writer is None:
            stream.deliver_layer(layer, key, value, landed)
            self._ends.watch(stream, item_id)
            return
        stream.writing(layer)
        written = writer.write(layer, key, value, landed)

        def delivered(written: asyncio.Future[torch.cuda.Event | None]) -> None:
            if written.cancelled():
                return  # the link closed; its streams failed already
            error = written.exception()
            if error is not None:
                self._stream_lost(item_id, translate_torch_error(error, what=f"writing layer {layer} into the pools"))
            else:
                stream.deliver_layer(layer, key, value, written.result())
                self._ends.watch(stream, item_id)

        self._session.own_arrival(written, delivered)

    def _receive_end(
        self, stream: ConsumerStream, transport: Receiver, end: m.StreamEnd, payload: Sequence[zmq.Frame]
    ) -> None:
        """A stream's end: it finishes once everything posted for it landed, the hidden
        states last, and (from a producer on a GPU) the checksums of its layers and hidden
        states match what landed."""
        item_id, hidden_meta, checksum = end.item_id, end.hidden, end.checksum
        self._ends.forget(item_id)
        if end.layer_checksums is not None and len(end.layer_checksums) != stream.layers:
            raise RemoteProtocolError(
                f"a stream of {stream.layers} layers ended with {len(end.layer_checksums)} layer checksums"
            )
        hidden_landed: torch.cuda.Event | None = None
        if hidden_meta is not None:
            hidden_arrival = transport.receive_tensors((hidden_meta,), payload)
            stream.arriving, hidden_landed = hidden_arrival.complete, hidden_arrival.landed
        elif payload:
            raise RemoteProtocolError(f"a {transport.name} stream_end carries no frames, {len(payload)} came")
        last = stream.arriving

        def landed(arriving: asyncio.Future[list[torch.Tensor]] | None) -> None:
            if arriving is not None and arriving.cancelled():
                return
            error = None if arriving is None else arriving.exception()
            if error is not None:
                self._stream_lost(item_id, translate_torch_error(error, what=f"receiving the end of stream {item_id}"))
                return
            missing = stream.first_missing_layer()
            if missing is not None:  # never confirmed: the producer would free what this side lacks
                lost = RemoteProtocolError(f"stream {item_id} ended without layer {missing}: it went back whole")
                self._stream_lost(item_id, lost)
                return
            hidden = None if hidden_meta is None or arriving is None else arriving.result()[0]
            if hidden is not None and hidden_meta is not None:
                try:
                    _check(checksum, (hidden,), (hidden_meta,), HIDDEN_POSITION, f"stream {item_id}'s hidden states")
                except IntegrityError as failed:
                    self._stream_lost(item_id, failed)
                    return
            unchecked = bool(stream.sums) and end.layer_checksums is None
            hidden_unchecked = hidden is not None and checksum is None and end.device_checksum is None
            if unchecked or (hidden_unchecked and self._producer_checksums()):
                # The producer checksums, and these bytes carried none: no more trusted than damaged
                # ones (a damaged field name would drop the checksum from the message, unread).
                what = "its layers" if unchecked else "its hidden states"
                self._stream_lost(item_id, IntegrityError(
                    f"stream {item_id}: {what} came without a checksum from a producer that checksums: it went "
                    "back whole"
                ))  # fmt: skip
                return
            expected = {layer: end.layer_checksums[layer] for layer in stream.sums} if end.layer_checksums else {}
            sums = [stream.sums[layer] for layer in expected]
            if hidden is not None and hidden_meta is not None and end.device_checksum is not None:
                expected[HIDDEN_POSITION] = end.device_checksum
                sums.append(_summing(self._session.checks, (hidden,), (hidden_meta,), HIDDEN_POSITION, hidden_landed))
            if not expected:
                stream.finish(hidden)
                return
            # Each queued (or computed, on the host) first, then read: a worker never waits for
            # another worker's job (two could wait so for good).
            queued = asyncio.gather(*(asyncio.wrap_future(summing) for summing in sums))

            def read(queued: asyncio.Future[list[Callable[[], int]]]) -> None:
                if queued.cancelled():
                    return
                error = queued.exception()
                if error is not None:
                    self._stream_lost(item_id, translate_torch_error(error, what=f"checking stream {item_id}"))
                    return
                checks = self._session.checks.executor
                checked = asyncio.get_running_loop().run_in_executor(checks, _read_sums, queued.result())
                self._session.own_arrival(
                    checked, lambda sums: self._end_checked(stream, item_id, expected, sums, hidden)
                )

            self._session.own_arrival(queued, read)

        if last is None:
            landed(last)
        elif hidden_meta is not None:
            self._session.own_arrival(last, landed)
        else:
            # Owned already: it is a layer's. Done or not, the end follows that layer's own
            # callback (scheduled first), so the stream never ends before its last layer.
            last.add_done_callback(landed)

    def _end_checked(
        self, stream: ConsumerStream, item_id: int, expected: dict[int, int], computed: asyncio.Future[list[int]],
        hidden: torch.Tensor | None,
    ) -> None:  # fmt: skip
        """The checksums of what landed of a GPU producer's stream are known: it finishes if
        every one matches what its end carried, else it fails and its item goes back whole."""
        if computed.cancelled() or self._session.open_streams.get(item_id) is not stream:
            return  # the link closed, or the stream failed meanwhile
        error = computed.exception()
        if error is not None:
            self._stream_lost(item_id, translate_torch_error(error, what=f"checking the layers of stream {item_id}"))
            return
        damaged = [
            "its hidden states" if position == HIDDEN_POSITION else f"layer {position}"
            for position, value in zip(expected, computed.result(), strict=True)
            if expected[position] != value
        ]
        if damaged:
            self._stream_lost(item_id, IntegrityError(
                f"stream {item_id}: {', '.join(damaged)} as landed, or the description of its tensors, do not match "
                "the checksum its producer computed on its GPU where it wrote them (damaged on the way): the stream "
                "went back whole"
            ))  # fmt: skip
            return
        stream.finish(hidden)

    def _producer_checksums(self) -> bool:
        return m.Capability.CHECKSUM in self._session.core.producer_capabilities

    def _stream_lost(self, item_id: int, error: KVRTError) -> None:
        """A stream's receive failed: it fails, and its item goes back to the producer."""
        self._ends.forget(item_id)
        stream = self._session.open_streams.pop(item_id, None)
        _count(self._session, error)
        if stream is not None:
            self._session.release([item_id])
            stream.fail(error)

class EndsDue:
    """A link's streams whose every layer came, each with the moment its end is overdue: they
    wait for it as long as a transfer may take (`transfer_timeout_s`), so that an end that
    reaches no stream (its id damaged into another valid one) does not leave its reader waiting
    for ever; then `lost` fails the stream and gives its item back."""

    def __init__(self, session: LinkSession, lost: Callable[[int, KVRTError], None]) -> None:
        self._session = session
        self._lost = lost
        self._due: dict[int, asyncio.TimerHandle] = {}

    def watch(self, stream: ConsumerStream, item_id: int) -> None:
        """Start the stream's wait for its end, once every layer came (once)."""
        bound = self._session.transfer_timeout_s
        if bound is None or item_id in self._due or not stream.every_layer_came():
            return
        self._due[item_id] = asyncio.get_running_loop().call_later(bound, self._overdue, item_id, stream)

    def forget(self, item_id: int) -> None:
        """The stream ended, or failed: no end is awaited."""
        due = self._due.pop(item_id, None)
        if due is not None:
            due.cancel()

    def _overdue(self, item_id: int, stream: ConsumerStream) -> None:
        self._due.pop(item_id, None)
        if self._session.open_streams.get(item_id) is not stream:
            return  # ended, failed or given back meanwhile
        self._lost(
            item_id,
            KVRTTimeoutError(
                f"every layer of a stream from the producer at {self._session.endpoint} came, and its end did not "
                f"within {self._session.transfer_timeout_s} s after them (lost, or misdirected on the way): it went "
                "back to the producer",
                phase="transfer",
            ),
        )


def _skip(
    session: LinkSession, transport: Receiver, message: m.StreamLayer | m.StreamEnd | m.StreamAbort,
    payload: Sequence[zmq.Frame],
) -> None:  # fmt: skip
    """A message of a stream this side gave back: what came with it is dropped, or, its bytes
    still on their way (out of band), received and dropped (`Receiver.skip`), or the next
    receive on the pair would take them."""
    try:
        arriving = transport.skip(_tensor_metas(message), payload)
    except ProtocolError as exc:
        session.start_afresh(None, exc)
        return
    if arriving is not None:
        session.own_arrival(arriving, outcome_seen)


def _count(session: LinkSession, error: BaseException) -> None:
    if isinstance(error, IntegrityError) and session.metrics is not None:
        session.metrics.integrity_failures += 1
