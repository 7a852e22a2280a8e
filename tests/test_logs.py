"""Structured logs: JSON lines carrying the request id and the peer."""

from __future__ import annotations

import io
import json
import logging

import msgspec
import zmq
import zmq.asyncio

import kvrt
from kvrt import _messages as m


async def test_a_refusal_is_logged_as_json_with_its_request_id_and_peer(producer: kvrt.Producer) -> None:
    stream = io.StringIO()
    handler = kvrt.log_json(logging.INFO, stream)
    context = zmq.asyncio.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        socket.connect(producer.endpoint)
        await socket.send(msgspec.msgpack.encode([m.PROTOCOL_VERSION, {"type": "evict", "request_id": 77}]))
        await socket.recv()  # the error reply: the log line was written before it was sent
    finally:
        socket.close()
        context.term()
        logging.getLogger("kvrt").removeHandler(handler)
    records = [json.loads(line) for line in stream.getvalue().splitlines()]
    refusal = next(record for record in records if record["message"].startswith("refused"))
    assert refusal["request_id"] == 77 and refusal["code"] in ("protocol", "unknown_peer") and refusal["peer"]
    assert refusal["logger"] == "kvrt.producer" and refusal["level"] == "INFO"
