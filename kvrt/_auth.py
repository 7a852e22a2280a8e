"""ZeroMQ CURVE on the control endpoint: encryption, and only known consumers get in.

Off by default (loopback needs none); one argument turns it on, on each side:

    producer = kvrt.Producer(bind="tcp://0.0.0.0:5555", curve=kvrt.CurveKeys.server(
        "keys/producer.key_secret", allowed_clients_dir="keys/clients"))
    consumer = kvrt.Consumer(connect=..., curve=kvrt.CurveKeys.client(
        "keys/decode-0.key_secret", server_public_file="keys/producer.key"))

Keys are ZeroMQ certificate files (`kvrt keys DIR NAME` makes a pair), or Z85 strings in
the environment (`CurveKeys.from_env()`: KVRT_CURVE_PUBLIC_KEY, KVRT_CURVE_SECRET_KEY,
KVRT_CURVE_SERVER_KEY for clients, KVRT_CURVE_ALLOWED_KEYS, comma-separated, for
producers). The producer checks every client's public key in a ZAP handler (a thread
pyzmq runs); a client without an allowed key, or that does not know the producer's key,
never completes the handshake, so it cannot issue any operation, and it gets `AuthError`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
import zmq.auth.thread

from kvrt._errors import AuthError, InvalidInputError

_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


def _key(value: bytes | str, what: str) -> bytes:
    key = value.encode() if isinstance(value, str) else value
    if len(key) != 40:
        raise InvalidInputError(f"{what} must be a 40-character Z85 CURVE key, got {len(key)} characters")
    return key


@dataclass(frozen=True, slots=True)
class CurveKeys:
    """One side's CURVE keys: its own pair, and the producer's public key (clients) or the
    public keys allowed in (producers; None allows any client that knows the producer's key)."""

    public_key: bytes
    secret_key: bytes
    server_key: bytes | None = None
    allowed_clients: frozenset[bytes] | None = None

    @classmethod
    def server(cls, secret_file: str | os.PathLike[str], *, allowed_clients_dir: str | os.PathLike[str] | None = None
               ) -> CurveKeys:  # fmt: skip
        """A producer's keys from its certificate file, and the clients' public certificates
        in `allowed_clients_dir` (every `*.key` file there)."""
        public, secret = _load(secret_file)
        allowed = None
        if allowed_clients_dir is not None:
            allowed = frozenset(_load_public(path) for path in Path(allowed_clients_dir).glob("*.key"))
        return cls(public, secret, allowed_clients=allowed)

    @classmethod
    def client(cls, secret_file: str | os.PathLike[str], *, server_public_file: str | os.PathLike[str]) -> CurveKeys:
        public, secret = _load(secret_file)
        return cls(public, secret, server_key=_load_public(server_public_file))

    @classmethod
    def from_env(cls) -> CurveKeys | None:
        """Keys from KVRT_CURVE_* variables, or None when they are not set."""
        public, secret = os.environ.get("KVRT_CURVE_PUBLIC_KEY"), os.environ.get("KVRT_CURVE_SECRET_KEY")
        if not public or not secret:
            return None
        server = os.environ.get("KVRT_CURVE_SERVER_KEY")
        allowed = os.environ.get("KVRT_CURVE_ALLOWED_KEYS")
        return cls(
            _key(public, "KVRT_CURVE_PUBLIC_KEY"),
            _key(secret, "KVRT_CURVE_SECRET_KEY"),
            server_key=None if not server else _key(server, "KVRT_CURVE_SERVER_KEY"),
            allowed_clients=None if not allowed else frozenset(_key(k, "an allowed key") for k in allowed.split(",")),
        )

    def __post_init__(self) -> None:
        _key(self.public_key, "public_key")
        _key(self.secret_key, "secret_key")
        if self.server_key is not None:
            _key(self.server_key, "server_key")


def _load_public(path: str | os.PathLike[str]) -> bytes:
    try:
        public, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise InvalidInputError(f"cannot read CURVE certificate {path}: {exc}") from None
    return public


def _load(path: str | os.PathLike[str]) -> tuple[bytes, bytes]:
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise InvalidInputError(f"cannot read CURVE certificate {path}: {exc}") from None
    if secret is None:
        raise InvalidInputError(f"{path} holds a public key only; this side needs its secret certificate")
    return public, secret


def make_keys(directory: str | os.PathLike[str], name: str) -> tuple[Path, Path]:
    """Create `name.key` (public, to give to peers) and `name.key_secret` in `directory`."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(directory, name)
    return Path(public), Path(secret)


class _AllowedKeys:
    def __init__(self, keys: Iterable[bytes]) -> None:
        self._keys = frozenset(keys)

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self._keys


def secure_server(context: zmq.Context[zmq.Socket[bytes]], socket: zmq.Socket[bytes], keys: CurveKeys
                  ) -> zmq.auth.thread.ThreadAuthenticator:  # fmt: skip
    """Make `socket` (before bind) a CURVE server that admits only `keys.allowed_clients`."""
    authenticator = zmq.auth.thread.ThreadAuthenticator(context)
    authenticator.start()
    if keys.allowed_clients is None:
        authenticator.configure_curve(domain="*", location=zmq.auth.CURVE_ALLOW_ANY)
    else:
        authenticator.configure_curve_callback(domain="*", credentials_provider=_AllowedKeys(keys.allowed_clients))
    socket.curve_secretkey = keys.secret_key
    socket.curve_publickey = keys.public_key
    socket.curve_server = True
    return authenticator


def secure_client(socket: zmq.Socket[bytes], keys: CurveKeys) -> zmq.Socket[bytes]:
    """Make `socket` (before connect) a CURVE client; returns a monitor for handshake failures."""
    if keys.server_key is None:
        raise InvalidInputError("a consumer or client needs the producer's public key (server_key)")
    socket.curve_secretkey = keys.secret_key
    socket.curve_publickey = keys.public_key
    socket.curve_serverkey = keys.server_key
    monitor: zmq.Socket[bytes] = socket.get_monitor_socket(_HANDSHAKE_FAILED)
    return monitor


def handshake_refused(monitor: zmq.Socket[bytes], endpoint: str) -> AuthError | None:
    """The AuthError to raise if the monitor saw the CURVE handshake fail (read without waiting)."""
    from zmq.utils.monitor import recv_monitor_message

    try:
        event = recv_monitor_message(monitor, zmq.NOBLOCK)
    except zmq.Again:
        return None
    return AuthError(
        f"the CURVE handshake with {endpoint} failed ({zmq.Event(event['event']).name}): check that this side "
        "has the producer's public key and that the producer allows this side's key"
    )
