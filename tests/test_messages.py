"""The control messages: one union, validated on decode, with typed refusals."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrt import _messages as m
from kvrt._errors import ErrorCode, ProtocolError, RemoteProtocolError, VersionMismatchError

EXAMPLES: list[m.Message] = [
    m.Hello(version=m.PROTOCOL_VERSION, name="decode-0", capabilities=[m.Capability.TCP]),
    m.Welcome(version=m.PROTOCOL_VERSION, producer_id="p", heartbeat_s=1.0),
    m.Ping(nonce=3),
    m.Pong(nonce=3),
    m.Bye(reason="closing"),
    m.DropSelect(request_id=7, tokens=m.tokens_to_bytes(np.array([1, 2, 3])), timeout_s=None),
    m.DropSelect(request_id=8, tokens=None, timeout_s=0.0),
    m.Cancel(request_id=7),
    m.Deliver(
        request_id=7,
        item_id=1,
        matched=3,
        input_tokens=m.TensorMeta("int64", [3]),
        roi=None,
        key=m.TensorMeta("float16", [2, 3, 4, 8]),
        value=m.TensorMeta("float16", [2, 3, 4, 8]),
        hidden=m.TensorMeta("bfloat16", [3, 16]),
    ),
    m.Deliver(  # a checksum uses all 64 bits
        request_id=8,
        item_id=2,
        matched=1,
        input_tokens=m.TensorMeta("int64", [1]),
        roi=None,
        key=m.TensorMeta("float16", [1, 1, 1, 8]),
        value=m.TensorMeta("float16", [1, 1, 1, 8]),
        hidden=None,
        checksum=2**64 - 1,
    ),
    m.Miss(request_id=7),
    m.Received(item_ids=[1, 2]),
    m.Release(item_id=1),
    m.ErrorReply(request_id=None, code=ErrorCode.PROTOCOL, message="bad"),
]


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda message: type(message).__name__)
def test_every_message_survives_encode_then_decode(message: m.Message) -> None:
    assert m.decode(m.encode(message)) == message


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda message: type(message).__name__)
def test_decoded_messages_are_not_tracked_by_the_cycle_collector(message: m.Message) -> None:
    """Plain data that never refers back to itself: tracking it would only bring the next
    collection nearer."""
    import gc

    decoded = m.decode(m.encode(message))
    assert not gc.is_tracked(decoded)
    if isinstance(decoded, m.Deliver):
        assert not gc.is_tracked(decoded.key)


def test_a_batch_reply_and_its_hits_are_not_tracked_by_the_cycle_collector() -> None:
    import gc

    meta = m.TensorMeta("float16", [2, 3, 4, 8])
    hit = m.Hit(item_id=1, matched=3, input_tokens=m.TensorMeta("int64", [3]), roi=None, key=meta, value=meta,
                hidden=None, offset=0, payload_bytes=400)  # fmt: skip
    decoded = m.decode(m.encode(m.DeliverMany(request_id=3, hits=[hit, None], payload_bytes=400)))
    assert isinstance(decoded, m.DeliverMany) and decoded.hits[0] == hit
    assert not gc.is_tracked(decoded) and not gc.is_tracked(decoded.hits[0]) and not gc.is_tracked(decoded.hits[0].key)


def test_an_unknown_tag_is_a_remote_protocol_error() -> None:
    frame = msgspec.msgpack.encode([m.PROTOCOL_VERSION, {"type": "launch_missiles"}])
    with pytest.raises(RemoteProtocolError, match="launch_missiles"):
        m.decode(frame)


def test_another_protocol_version_is_refused_with_both_versions_named() -> None:
    frame = msgspec.msgpack.encode([m.PROTOCOL_VERSION + 1, {"type": "ping", "nonce": 0}])
    with pytest.raises(VersionMismatchError, match=rf"version {m.PROTOCOL_VERSION + 1}.*speaks {m.PROTOCOL_VERSION}"):
        m.decode(frame)


def test_a_field_of_the_wrong_type_is_refused_naming_the_field() -> None:
    frame = msgspec.msgpack.encode([m.PROTOCOL_VERSION, {"type": "drop_select", "request_id": 1, "tokens": "abc"}])
    with pytest.raises(RemoteProtocolError, match="tokens"):
        m.decode(frame)


def test_tokens_travel_as_little_endian_int64() -> None:
    tokens = np.array([1, -2, 2**62], dtype=np.int64)
    assert m.tokens_to_bytes(tokens) == b"".join(int(t).to_bytes(8, "little", signed=True) for t in tokens)
    assert m.tokens_from_bytes(m.tokens_to_bytes(tokens)).tolist() == tokens.tolist()


def test_a_negative_request_id_is_refused() -> None:
    frame = msgspec.msgpack.encode([m.PROTOCOL_VERSION, {"type": "miss", "request_id": -1}])
    with pytest.raises(RemoteProtocolError, match="request_id"):
        m.decode(frame)


def test_a_control_frame_over_the_limit_is_refused_before_it_is_parsed() -> None:
    with pytest.raises(RemoteProtocolError, match="over the limit"):
        m.decode(b"\x00" * (m.MAX_HEADER_BYTES + 1))


def test_tensor_shapes_are_bounded_in_rank() -> None:
    meta = {"dtype": "float16", "shape": [1] * (m.MAX_TENSOR_DIMS + 1)}
    message = {"type": "deliver", "request_id": 1, "item_id": 1, "matched": 1, "input_tokens": meta,
               "roi": None, "key": meta, "value": meta, "hidden": None}  # fmt: skip
    with pytest.raises(RemoteProtocolError):
        m.decode(msgspec.msgpack.encode([m.PROTOCOL_VERSION, message]))


def test_unknown_fields_are_ignored_so_newer_peers_can_add_fields() -> None:
    frame = msgspec.msgpack.encode([m.PROTOCOL_VERSION, {"type": "ping", "nonce": 5, "added_later": [1, 2]}])
    assert m.decode(frame) == m.Ping(nonce=5)


def test_the_request_id_of_an_invalid_message_can_still_be_read_for_the_reply() -> None:
    frame = msgspec.msgpack.encode([m.PROTOCOL_VERSION, {"type": "drop_select", "request_id": 42, "tokens": "x"}])
    assert m.peek_request_id(frame) == 42
    assert m.peek_request_id(b"\xc1garbage") is None


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_arbitrary_bytes_decode_to_a_message_or_a_protocol_error(frame: bytes) -> None:
    try:
        m.decode(frame)
    except ProtocolError:  # remote, or a version mismatch
        pass


_msgpack_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=16)
    | st.builds(msgspec.msgpack.Ext, st.integers(min_value=-128, max_value=127), st.binary(max_size=17))
)
"""Every msgpack type: nil, bool, ints of every width and sign, floats, str, bin, and ext
(timestamps, code -1, among them)."""

_msgpack_values = st.recursive(
    _msgpack_scalars,
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=8), children, max_size=4)
    | st.dictionaries(st.integers(min_value=-5, max_value=5) | st.binary(max_size=4), children, max_size=3),
    max_leaves=12,
)


def _nested(depth: int, inner: bytes, *, as_map: bool) -> bytes:
    """`inner` wrapped in `depth` one-element arrays (or one-entry maps keyed by 0)."""
    return (b"\x81\x00" if as_map else b"\x91") * depth + inner


def test_a_frame_nested_deeper_than_the_decoder_goes_is_a_remote_protocol_error() -> None:
    # 1003 bytes: a version, then 1000 nested one-element arrays.
    with pytest.raises(RemoteProtocolError, match="nests deeper"):
        m.decode(b"\x92\x01" + b"\x91" * 1000 + b"\xc0")
    assert m.peek_request_id(b"\x92\x01" + b"\x91" * 1000 + b"\xc0") is None


@settings(max_examples=200, deadline=None)
@given(
    depth=st.integers(min_value=1, max_value=20_000),
    as_map=st.booleans(),
    where=st.sampled_from(["envelope", "message", "field", "version"]),
    leaf=_msgpack_scalars,
)
def test_nesting_of_any_depth_anywhere_in_a_frame_decodes_or_is_a_protocol_error(
    depth: int, as_map: bool, where: str, leaf: object
) -> None:
    inner = msgspec.msgpack.encode(leaf)
    nested = _nested(depth, inner, as_map=as_map)
    if where == "envelope":
        frame = nested
    elif where == "version":
        frame = b"\x92" + nested + msgspec.msgpack.encode({"type": "ping"})
    elif where == "message":
        frame = b"\x92\x01" + nested
    else:  # deep inside a field of a message the producer accepts
        frame = b"\x92\x01" + b"\x83\xa4type\xabdrop_select\xaarequest_id\x07\xa6tokens" + nested
    for decode in (m.decode, m.decode_share):
        try:
            decode(frame)
        except ProtocolError:
            pass
    assert m.peek_request_id(frame) in (None, 7)


@settings(max_examples=300, deadline=None)
@given(
    tag=st.sampled_from(["hello", "drop_select", "deliver", "received", "error", "nope"]),
    fields=st.dictionaries(
        st.sampled_from(["request_id", "tokens", "item_id", "matched", "key", "code", "version", "x"]),
        _msgpack_values,
        max_size=6,
    ),
)
def test_structured_garbage_decodes_to_a_message_or_a_protocol_error(tag: str, fields: dict[str, object]) -> None:
    frame = msgspec.msgpack.encode([m.PROTOCOL_VERSION, {"type": tag, **fields}])
    try:
        m.decode(frame)
    except ProtocolError:  # remote, or a version mismatch
        pass


def _share(**changes: object) -> m.IpcShare:
    fields: dict[str, object] = {
        "handle": b"\x01" * 64, "storage_offset": 0, "storage_bytes": 1 << 20, "counter": b"/torch_1_2_3",
        "counter_offset": 7, "start": 256, "marks": [1],
    }  # fmt: skip
    fields.update(changes)
    return m.IpcShare(**fields)  # type: ignore[arg-type]


def test_a_cuda_ipc_share_survives_encode_then_decode() -> None:
    share = _share()
    assert m.decode_share(m.encode_share(share)) == share


def test_a_share_of_registered_memory_has_no_counter_and_may_need_no_wait() -> None:
    share = _share(counter=b"", counter_offset=0, marks=[0, 3])  # 0: written before it was sent
    assert m.decode_share(m.encode_share(share)) == share


@pytest.mark.parametrize(
    "bad",
    [
        {"handle": b"\x01" * (m.MAX_IPC_HANDLE_BYTES + 1)},
        {"start": -1},
        {"counter_offset": 2**33},
        {"marks": [1] * (m.MAX_SEGMENTS + 1)},
        {"marks": [-1]},
        {"marks": [m.MAX_IPC_MARK + 1]},
    ],
    ids=[
        "handle-too-long", "negative-start", "counter-offset-too-large", "too-many-marks", "negative-mark",
        "mark-too-large",
    ],
)
def test_a_cuda_ipc_share_out_of_bounds_is_a_remote_protocol_error(bad: dict[str, object]) -> None:
    frame = msgspec.msgpack.encode(_share(**bad))
    with pytest.raises(RemoteProtocolError, match="cuda_ipc"):
        m.decode_share(frame)


def test_a_frame_that_is_not_a_cuda_ipc_share_is_a_remote_protocol_error() -> None:
    with pytest.raises(RemoteProtocolError, match="invalid cuda_ipc frame"):
        m.decode_share(b"\x93\x01\x02\x03")


def test_a_peers_text_is_repeated_clipped_and_with_what_does_not_print_escaped() -> None:
    assert m.quoted("no such item") == "no such item"
    assert m.quoted("red \x1b[31m\n") == "red \\x1b[31m\\n"
    huge = m.quoted("x" * (8 << 20))
    assert len(huge) < m.MAX_QUOTED_CHARS + 64 and huge.endswith(f"({(8 << 20) - m.MAX_QUOTED_CHARS} more characters)")


@pytest.mark.parametrize("version", [m.PROTOCOL_VERSION, m.PROTOCOL_VERSION + 1], ids=["this-version", "next-version"])
def test_an_error_code_this_release_does_not_know_is_read_as_internal_naming_it(version: int) -> None:
    # A newer peer's code: its call fails now, with the code in the text, not at its timeout.
    unknown = {"type": "error", "request_id": 7, "code": "overheated", "message": "hot"}
    error = m.decode(msgspec.msgpack.encode([version, unknown]))
    assert error == m.ErrorReply(request_id=7, code=ErrorCode.INTERNAL, message="(overheated) hot")
    malformed = msgspec.msgpack.encode([version, {"type": "error", "request_id": 7, "code": "capacity", "message": 5}])
    with pytest.raises(ProtocolError):
        m.decode(malformed)
