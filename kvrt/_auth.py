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
pyzmq runs); a client without an allowed key, without keys, or that does not know the
producer's key, never completes the handshake, so it cannot issue any operation, and it
gets `AuthError`.

Access fails closed: a producer admits exactly the keys it was given. No list means no
client gets in, unless `allow_any_client=True` (or KVRT_CURVE_ALLOW_ANY_CLIENT=1) says that
any client that knows the producer's public key may (encryption without authentication).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
import zmq.auth.thread

from kvrt._errors import AuthError, InvalidInputError

log = logging.getLogger("kvrt.auth")


def _key(value: bytes | str, what: str) -> bytes:
    key = value.encode() if isinstance(value, str) else value
    if len(key) != 40:
        raise InvalidInputError(f"{what} must be a 40-character Z85 CURVE key, got {len(key)} characters")
    return key


@dataclass(frozen=True, slots=True)
class CurveKeys:
    """One side's CURVE keys: its own pair, and the producer's public key (clients) or the
    public keys allowed in (producers: exactly those; `allow_any_client` admits any client
    that knows the producer's public key instead)."""

    public_key: bytes
    secret_key: bytes
    server_key: bytes | None = None
    allowed_clients: frozenset[bytes] = frozenset()
    allow_any_client: bool = False

    @classmethod
    def server(
        cls, secret_file: str | os.PathLike[str], *, allowed_clients_dir: str | os.PathLike[str] | None = None,
        allow_any_client: bool = False,
    ) -> CurveKeys:  # fmt: skip
        """A producer's keys from its certificate file, and the clients' public certificates
        in `allowed_clients_dir` (every `*.key` file there). Without a directory no client is
        admitted, unless `allow_any_client` is True."""
        public, secret = _load(secret_file)
        allowed: frozenset[bytes] = frozenset()
        if allowed_clients_dir is not None:
            directory = Path(allowed_clients_dir)
            if not directory.is_dir():
                raise InvalidInputError(f"allowed_clients_dir {directory} is not a directory")
            allowed = frozenset(_load_public(path) for path in directory.glob("*.key"))
        return cls(public, secret, allowed_clients=allowed, allow_any_client=allow_any_client)

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
        allowed = os.environ.get("KVRT_CURVE_ALLOWED_KEYS", "")
        allow_any = os.environ.get("KVRT_CURVE_ALLOW_ANY_CLIENT", "")
        if allow_any not in ("", "0", "1"):
            raise InvalidInputError(f"KVRT_CURVE_ALLOW_ANY_CLIENT must be 0 or 1, got {allow_any!r}")
        return cls(
            _key(public, "KVRT_CURVE_PUBLIC_KEY"),
            _key(secret, "KVRT_CURVE_SECRET_KEY"),
            server_key=None if not server else _key(server, "KVRT_CURVE_SERVER_KEY"),
            allowed_clients=frozenset(_key(k.strip(), "an allowed key") for k in allowed.split(",") if k.strip()),
            allow_any_client=allow_any == "1",
        )

    def __post_init__(self) -> None:
        _key(self.public_key, "public_key")
        _key(self.secret_key, "secret_key")
        if self.server_key is not None:
            _key(self.server_key, "server_key")
        if not isinstance(self.allowed_clients, frozenset):
            raise InvalidInputError("allowed_clients must be a frozenset of public keys")
        for key in self.allowed_clients:
            _key(key, "an allowed key")


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
    if keys.allow_any_client:
        authenticator.configure_curve(domain="*", location=zmq.auth.CURVE_ALLOW_ANY)
    else:
        if not keys.allowed_clients:
            log.warning("CURVE is on with no allowed client keys: no consumer or client can connect "
                        "(give allowed_clients_dir, or allow_any_client=True)")  # fmt: skip
        authenticator.configure_curve_callback(domain="*", credentials_provider=_AllowedKeys(keys.allowed_clients))
    socket.curve_secretkey = keys.secret_key
    socket.curve_publickey = keys.public_key
    socket.curve_server = True
    return authenticator


def secure_client(socket: zmq.Socket[bytes], keys: CurveKeys) -> None:
    """Make `socket` (before connect) a CURVE client."""
    if keys.server_key is None:
        raise InvalidInputError("a consumer or client needs the producer's public key (server_key)")
    socket.curve_secretkey = keys.secret_key
    socket.curve_publickey = keys.public_key
    socket.curve_serverkey = keys.server_key


def handshake_failure(event: int, endpoint: str) -> AuthError:
    """The AuthError for a monitor's handshake-failure `event` (this side has no keys, or the
    wrong ones, or the producer does not allow this side's key)."""
    try:
        name = zmq.Event(event).name
    except ValueError:
        name = str(event)
    return AuthError(
        f"the CURVE handshake with {endpoint} failed ({name}): if the producer uses CURVE, give this side its keys "
        "(curve=CurveKeys.client(...)) with the producer's public key, and have the producer allow this side's key"
    )
