"""NIXL's agreement at join and its frame: the producer's rendezvous (its agent's metadata in
pieces, and a probe region of known bytes) and the `NixlRead` frame after each Deliver header.
See `kvrt.transports.nixl`'s docstring."""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Annotated, Final

import msgspec
import torch
import zmq
from msgspec import Meta

from kvrt._errors import InvalidInputError, RemoteProtocolError, TransportUnavailableError

RENDEZVOUS_VERSION: Final = "1"
"""What a rendezvous's `nixl` field says: the layout of the fields below, and of `NixlRead`."""
METADATA_KEY: Final = "agent."
"""Rendezvous keys `agent.0`, `agent.1`, ...: the producer agent's metadata, base64, in pieces
(a rendezvous value holds at most `MAX_RENDEZVOUS_CHARS`)."""
_METADATA_PIECE_CHARS: Final = 4000
MAX_METADATA_PIECES: Final = 12
"""The welcome's rendezvous holds 16 values: these, the version and the probe's two."""
MAX_FRAME_METADATA_BYTES: Final = 64 << 10
"""Most metadata one `NixlRead` may carry (a region's is a few hundred bytes)."""
PROBE_BYTES: Final = 4096


class NixlRead(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """The frame after a Deliver header (one per hit of a DeliverMany): where the item's
    packed bytes lie in the producer's memory, and the metadata of that region when this
    consumer was not sent it before (empty otherwise)."""

    address: Annotated[int, Meta(ge=1, le=2**63 - 1)]
    metadata: Annotated[bytes, Meta(max_length=MAX_FRAME_METADATA_BYTES)] = b""


encode_read = msgspec.msgpack.Encoder().encode
read_decoder = msgspec.msgpack.Decoder(NixlRead)


def probe_pattern() -> torch.Tensor:
    return (torch.arange(PROBE_BYTES, dtype=torch.int64) * 131 % 251).to(torch.uint8)


def metadata_pieces(metadata: bytes) -> dict[str, str]:
    text = base64.b64encode(metadata).decode("ascii")
    count = -(-len(text) // _METADATA_PIECE_CHARS)
    if count > MAX_METADATA_PIECES:
        raise InvalidInputError(f"this NIXL agent's metadata ({len(metadata)} bytes) does not fit a welcome")
    return {
        f"{METADATA_KEY}{index}": text[index * _METADATA_PIECE_CHARS : (index + 1) * _METADATA_PIECE_CHARS]
        for index in range(count)
    }


@dataclass(frozen=True, slots=True)
class Rendezvous:
    metadata: bytes
    probe_address: int
    probe_device: torch.device


def parse_rendezvous(rendezvous: dict[str, str]) -> Rendezvous:
    """The producer's rendezvous, checked: anything malformed is the producer's fault."""
    if rendezvous.get("nixl") != RENDEZVOUS_VERSION:
        raise TransportUnavailableError(
            f"nixl: the producer's rendezvous is version {rendezvous.get('nixl')!r}, this consumer reads "
            f"{RENDEZVOUS_VERSION!r}"
        )
    try:
        pieces = []
        for index in range(MAX_METADATA_PIECES + 1):
            piece = rendezvous.get(f"{METADATA_KEY}{index}")
            if piece is None:
                break
            pieces.append(piece)
        metadata = base64.b64decode("".join(pieces), validate=True)
        probe_address = int(rendezvous["probe"])
        probe_device = torch.device(rendezvous["device"])
    except (KeyError, ValueError, RuntimeError, binascii.Error):
        raise RemoteProtocolError(f"welcome has no usable nixl rendezvous (keys {sorted(rendezvous)})") from None
    if not metadata or len(pieces) > MAX_METADATA_PIECES or not 0 < probe_address < 2**64:
        raise RemoteProtocolError("welcome has no usable nixl rendezvous: no metadata, or a probe out of range")
    if probe_device.type not in ("cpu", "cuda"):
        raise RemoteProtocolError(f"nixl: the producer's memory is on {probe_device}, neither cpu nor cuda")
    return Rendezvous(metadata, probe_address, probe_device)



def decoded_read(frame: zmq.Frame) -> NixlRead:
    try:
        return read_decoder.decode(frame.buffer)
    except msgspec.DecodeError as exc:
        raise RemoteProtocolError(f"a nixl frame that does not decode: {exc}") from None

