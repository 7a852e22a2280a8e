"""Structured logs: JSON lines carrying the request id and the peer, written once, in UTC."""

from __future__ import annotations

import datetime
import io
import json
import logging
from collections.abc import Iterator

import msgspec
import pytest
import zmq
import zmq.asyncio

import kvrt
from kvrt import _messages as m


@pytest.fixture(autouse=True)
def kvrt_logger_restored() -> Iterator[None]:
    """What `log_json` changes on the "kvrt" logger is put back after each test."""
    logger = logging.getLogger("kvrt")
    handlers, level, propagate = list(logger.handlers), logger.level, logger.propagate
    yield
    logger.handlers[:] = handlers
    logger.setLevel(level)
    logger.propagate = propagate


async def test_a_refusal_is_logged_as_json_with_its_request_id_and_peer(producer: kvrt.Producer) -> None:
    stream = io.StringIO()
    kvrt.log_json(logging.INFO, stream)
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
    records = [json.loads(line) for line in stream.getvalue().splitlines()]
    refusal = next(record for record in records if record["message"].startswith("refused"))
    assert refusal["request_id"] == 77 and refusal["code"] in ("protocol", "unknown_peer") and refusal["peer"]
    assert refusal["logger"] == "kvrt.producer" and refusal["level"] == "INFO"


def test_log_json_called_twice_writes_each_record_once() -> None:
    first, second = io.StringIO(), io.StringIO()
    kvrt.log_json(logging.INFO, first)
    kvrt.log_json(logging.INFO, second)
    logging.getLogger("kvrt.producer").info("one record")
    assert first.getvalue() == ""
    assert [json.loads(line)["message"] for line in second.getvalue().splitlines()] == ["one record"]


def test_log_json_keeps_kvrt_records_out_of_the_engines_own_handlers() -> None:
    engine = io.StringIO()
    engine_handler = logging.StreamHandler(engine)
    logging.getLogger().addHandler(engine_handler)
    try:
        kvrt.log_json(logging.INFO, io.StringIO())
        logging.getLogger("kvrt.consumer").warning("a kvrt record")
        logging.getLogger("engine").warning("an engine record")
    finally:
        logging.getLogger().removeHandler(engine_handler)
    assert engine.getvalue() == "an engine record\n"


def test_json_log_times_are_utc_iso_8601() -> None:
    stream = io.StringIO()
    kvrt.log_json(logging.INFO, stream)
    before = datetime.datetime.now(datetime.UTC)
    logging.getLogger("kvrt").info("now")
    written = json.loads(stream.getvalue())["time"]
    assert written.endswith("Z")
    moment = datetime.datetime.fromisoformat(written)
    assert moment.utcoffset() == datetime.timedelta(0)
    assert abs((moment - before).total_seconds()) < 5
