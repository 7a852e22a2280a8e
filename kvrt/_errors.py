"""The one error family of kvrt, and the one place foreign errors are translated.

Every error kvrt raises is a `KVRTError`. Subclasses say what happened, not where:

    KVRTError
    ├── InvalidInputError        the caller passed something kvrt cannot use (also a ValueError)
    ├── KVRTTimeoutError         a deadline passed (also a TimeoutError); `phase` says which wait
    ├── PeerLostError            the other side stopped answering or went away (also a ConnectionError)
    │   └── LeaseExpiredError    an item arrived after this side's lease on it ended: given back, not handed over
    ├── IntegrityError           an item's bytes did not match their checksum: given back, not handed over
    ├── ProtocolError            a message broke the protocol; `LocalProtocolError` when this side
    │   ├── LocalProtocolError   sent or was asked to send it, `RemoteProtocolError` when the peer did
    │   └── RemoteProtocolError
    ├── VersionMismatchError     the peers speak different protocol versions (a ProtocolError)
    ├── CapacityError            a bound was reached: too many tokens, too many waiting requests
    ├── AuthError                the peer is not allowed to talk to this endpoint
    ├── ClosedError              the producer or consumer was closed while the call was pending
    ├── NotFoundError            the named item or request does not exist (any more)
    ├── TransportUnavailableError  the transport chosen cannot work between this pair
    └── StreamAbortedError       the prefill behind a stream failed; what arrived of it is void

Errors that cross the wire travel as an `ErrorCode` and a message (`kvrt._messages.ErrorReply`);
`error_from_code` turns them back into the right class on the other side. ZeroMQ errors are
translated once, by errno, in `translate_zmq_error`; torch's, NCCL's and CUDA's once, by type, in
`kvrt._devices.translate_torch_error` (this module imports no torch: the protocol core raises
these too); nothing matches message text.
"""

from __future__ import annotations

import enum
import errno

import zmq


class ErrorCode(enum.StrEnum):
    """What went wrong, as it travels in an `ErrorReply`. Values are never reused."""

    PROTOCOL = "protocol"
    VERSION = "version"
    TOO_LARGE = "too_large"
    INVALID = "invalid"
    CAPACITY = "capacity"
    CLOSED = "closed"
    UNKNOWN_PEER = "unknown_peer"
    AUTH = "auth"
    NOT_FOUND = "not_found"
    PEER_LOST = "peer_lost"
    INTERNAL = "internal"
    INTEGRITY = "integrity"


class KVRTError(Exception):
    """Base of every error kvrt raises. `code` is how the error travels on the wire."""

    code: ErrorCode = ErrorCode.INTERNAL


class InvalidInputError(KVRTError, ValueError):
    """An argument cannot be used: wrong dtype, shape, device or length. Nothing was changed."""

    code = ErrorCode.INVALID


class KVRTTimeoutError(KVRTError, TimeoutError):
    """A wait passed its deadline. `phase` names the wait: "connect", "insert", "transfer", ..."""

    def __init__(self, message: str, *, phase: str) -> None:
        super().__init__(message)
        self.phase = phase


class PeerLostError(KVRTError, ConnectionError):
    """The peer went away or stopped answering heartbeats; calls that needed it failed."""

    code = ErrorCode.PEER_LOST


class LeaseExpiredError(PeerLostError):
    """An item delivered to this consumer came (or was about to be handed over) after the
    consumer's lease on it ended: this process, or the producer, was stalled longer than the
    lease, and the producer may have given the item to another consumer. It was given back, not
    handed over; ask again."""


class IntegrityError(KVRTError):
    """An item's bytes did not match the checksum its producer computed where it wrote them
    (`Producer(checksum=True)`): they were damaged on the way, or read from memory reused too
    early. The caller never saw them; the item went back to its producer whole. Ask again."""

    code = ErrorCode.INTEGRITY


class ProtocolError(KVRTError):
    """A message broke the protocol."""

    code = ErrorCode.PROTOCOL


class LocalProtocolError(ProtocolError):
    """This side produced (or was asked to produce) a message the protocol forbids."""


class RemoteProtocolError(ProtocolError):
    """The peer sent a message the protocol forbids, or answered one of ours with a refusal."""


class VersionMismatchError(ProtocolError):
    """The two sides speak different protocol versions; upgrade one of them."""

    code = ErrorCode.VERSION


class CapacityError(KVRTError):
    """A bound was reached (too many tokens in a request, too many waiting requests, too large)."""

    code = ErrorCode.CAPACITY


class AuthError(KVRTError):
    """The peer is not allowed to talk to this endpoint: check the CURVE keys on both sides."""

    code = ErrorCode.AUTH


class ClosedError(KVRTError):
    """The producer or consumer is closed; the call cannot complete. Open a new one."""

    code = ErrorCode.CLOSED


class NotFoundError(KVRTError):
    """The named item or request does not exist (any more)."""

    code = ErrorCode.NOT_FOUND


class TransportUnavailableError(KVRTError):
    """The transport the producer chose cannot work between this pair (for `cuda_ipc`: not the
    same machine, no peer access between the GPUs, or IPC memory that this process cannot
    open). Where another transport was offered, the consumer falls back to it by itself;
    force one with `transport=` to skip the attempt."""


class StreamAbortedError(KVRTError):
    """The prefill behind a stream failed; what arrived of it is void."""


_CLASS_FOR_CODE: dict[ErrorCode, type[KVRTError]] = {
    ErrorCode.PROTOCOL: RemoteProtocolError,
    ErrorCode.VERSION: VersionMismatchError,
    ErrorCode.TOO_LARGE: CapacityError,
    ErrorCode.INVALID: InvalidInputError,
    ErrorCode.CAPACITY: CapacityError,
    ErrorCode.CLOSED: PeerLostError,
    ErrorCode.UNKNOWN_PEER: PeerLostError,
    ErrorCode.AUTH: AuthError,
    ErrorCode.NOT_FOUND: NotFoundError,
    ErrorCode.PEER_LOST: PeerLostError,
    ErrorCode.INTERNAL: KVRTError,
    ErrorCode.INTEGRITY: IntegrityError,
}


def fresh_copy(error: KVRTError) -> KVRTError:
    """A new exception of the same kind and message, so that each of several failed calls
    raises its own object (one shared exception would chain tracebacks across callers)."""
    clone = type(error).__new__(type(error))
    clone.__dict__.update(error.__dict__)
    clone.args = error.args
    return clone


def error_from_code(code: ErrorCode, message: str) -> KVRTError:
    """The exception to raise for an `ErrorReply` the peer sent.

    A peer that reports itself closed is, from here, a lost peer: the call cannot complete there.
    """
    return _CLASS_FOR_CODE.get(code, KVRTError)(message)


def translate_zmq_error(exc: zmq.ZMQError, *, endpoint: str) -> KVRTError:
    """The one translation of ZeroMQ errors into kvrt's family, by errno."""
    if exc.errno == errno.EHOSTUNREACH:
        return PeerLostError(f"peer at {endpoint} is no longer connected")
    if exc.errno in (zmq.ETERM, zmq.ENOTSOCK):
        return ClosedError(f"the socket for {endpoint} is closed")
    if exc.errno == errno.EADDRINUSE:
        return InvalidInputError(f"address {endpoint} is already in use; pick another port or use :0")
    if exc.errno in (errno.EINVAL, errno.EPROTONOSUPPORT, errno.ENODEV):
        return InvalidInputError(f"cannot use address {endpoint!r}: {exc.strerror}")
    return KVRTError(f"ZeroMQ error on {endpoint}: {exc.strerror} (errno {exc.errno})")
