"""`kvrt stat | probe | list | evict ENDPOINT`: the control endpoint from a shell.

Exit codes scripts can rely on: 0 done (probe: something matches), 1 the endpoint could
not be reached or refused, 2 bad usage, 3 probe: nothing matches.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from collections.abc import Callable
from typing import Any

import msgspec
import torch

from kvrt._auth import CurveKeys, make_keys
from kvrt._client import Client
from kvrt._errors import InvalidInputError, KVRTError
from kvrt._messages import MAX_ID as MAX_ITEM_ID
from kvrt._messages import MAX_LISTED, MAX_SECONDS

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_NO_MATCH = 3


def _plain(value: Any) -> Any:
    return msgspec.to_builtins(value)


def _table(stats: Any, health: Any) -> str:
    rows = [
        ("producer", health.producer_id),
        ("uptime", f"{health.uptime_s:.0f} s"),
        ("transports", ", ".join(health.transports)),
        ("items buffered", f"{stats.items}"),
        ("buffer", f"{stats.buffer_bytes / 2**20:.1f} / {stats.buffer_limit_bytes / 2**20:.0f} MiB"),
        ("in flight", f"{stats.in_flight}"),
        ("waiting requests", f"{stats.waiting_requests}"),
        ("peers", f"{stats.peers}"),
    ] + [(name.replace("_", " "), f"{value:,}") for name, value in stats.totals.items()]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def _client(args: argparse.Namespace) -> Client:
    curve = None
    if args.curve_secret or args.curve_server:
        if not (args.curve_secret and args.curve_server):
            raise InvalidInputError("CURVE needs both --curve-secret and --curve-server")
        curve = CurveKeys.client(args.curve_secret, server_public_file=args.curve_server)
    return Client(args.endpoint, connect_timeout_s=args.timeout, curve=curve)


async def _stat(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        while True:
            stats, health = await client.stats(), await client.health()
            if args.json:
                print(json.dumps({"health": _plain(health), "stats": _plain(stats)}))
                return EXIT_OK
            if sys.stdout.isatty() and not args.once:
                print("\033[2J\033[H", end="")  # clear the screen: a live table
            print(f"kvrt stat {args.endpoint}\n{_table(stats, health)}", flush=True)
            if args.once:
                return EXIT_OK
            await asyncio.sleep(args.interval)  # the refresh period of a display, not a wait on kvrt


async def _probe(args: argparse.Namespace) -> int:
    tokens = torch.tensor([int(token) for token in args.tokens.split(",")], dtype=torch.int64)
    async with _client(args) as client:
        reply = await client.probe(tokens)
    if args.json:
        print(json.dumps(_plain(reply)))
    else:
        found = f"item {reply.item_id}" if reply.item_id is not None else "no item"
        print(f"matched {reply.matched} of {len(tokens)} tokens ({found})")
    return EXIT_OK if reply.matched else EXIT_NO_MATCH


async def _list(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        listing = await client.list_items(args.limit)
    if args.json:
        print(json.dumps(_plain(listing)))
        return EXIT_OK
    print(f"{listing.total} items buffered; the oldest {len(listing.items)}:")
    print(f"{'item':>10} {'tokens':>8} {'bytes':>12} {'age s':>8}")
    for item in listing.items:
        print(f"{item.item_id:>10} {item.tokens:>8} {item.nbytes:>12,} {item.age_s:>8.1f}")
    return EXIT_OK


async def _evict(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        evicted = await client.evict(args.item_id)
    print(json.dumps(_plain(evicted)) if args.json else f"evicted item {evicted.item_id} ({evicted.nbytes:,} bytes)")
    return EXIT_OK


def run(args: argparse.Namespace) -> int:
    command = {"stat": _stat, "probe": _probe, "list": _list, "evict": _evict}[args.command]
    try:
        return asyncio.run(command(args))
    except KVRTError as error:
        print(f"kvrt {args.command}: {error}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return EXIT_OK


def _bounded_int(low: int, high: int, what: str) -> Callable[[str], int]:
    """An argparse type: an integer in [low, high], or a usage error that says so."""

    def parse(text: str) -> int:
        try:
            number = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be an integer, got {text!r}") from None
        if not low <= number <= high:
            raise argparse.ArgumentTypeError(f"{what} must be between {low} and {high}, got {number}")
        return number

    return parse


def _seconds(text: str) -> float:
    """An argparse type: a finite, positive number of seconds."""
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"seconds must be a number, got {text!r}") from None
    if not (math.isfinite(seconds) and 0 < seconds <= MAX_SECONDS):
        raise argparse.ArgumentTypeError(f"seconds must be positive and at most {MAX_SECONDS:g}, got {text}")
    return seconds


def add_commands(commands: Any) -> None:
    """Register the endpoint commands on the `kvrt` parser's subcommands."""

    def endpoint_command(name: str, help_text: str) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = commands.add_parser(name, help=help_text, description=help_text)
        parser.add_argument("endpoint", help="the producer's control endpoint, e.g. tcp://127.0.0.1:5555")
        parser.add_argument(
            "--timeout", type=_seconds, default=5.0, help="seconds to wait for the producer (default 5)"
        )
        parser.add_argument("--json", action="store_true", help="print JSON instead of text")
        parser.add_argument("--curve-secret", metavar="FILE", help="this client's CURVE secret certificate")
        parser.add_argument("--curve-server", metavar="FILE", help="the producer's CURVE public certificate")
        parser.set_defaults(run=run)
        return parser

    stat = endpoint_command("stat", "a live table of what a producer holds and has done (Ctrl-C ends it)")
    stat.add_argument("--once", action="store_true", help="print the table once and exit")
    stat.add_argument("--interval", type=_seconds, default=1.0, help="seconds between refreshes (default 1)")
    probe = endpoint_command("probe", "how many tokens a producer would match, without taking anything")
    probe.add_argument("--tokens", required=True, help="comma-separated token ids, already roi-masked")
    listing = endpoint_command("list", "the oldest items a producer holds")
    listing.add_argument(
        "--limit", type=_bounded_int(0, MAX_LISTED, "--limit"), default=20, help="how many (default 20)"
    )
    evict = endpoint_command("evict", "drop one buffered item")
    evict.add_argument(
        "item_id", type=_bounded_int(0, MAX_ITEM_ID, "item_id"), help="the item's id, as `kvrt list` shows it"
    )
    keys = commands.add_parser(
        "keys", help="make a CURVE key pair in DIRECTORY: NAME.key to share, NAME.key_secret to keep",
        description="Make a ZeroMQ CURVE certificate pair for a producer, consumer or client: DIRECTORY/NAME.key "
        "(the public key, to share) and DIRECTORY/NAME.key_secret (to keep private).",
    )  # fmt: skip
    keys.add_argument("directory", help="where the two files are written (made if missing)")
    keys.add_argument("name", help="the pair's name: the files' names, e.g. producer")
    keys.set_defaults(run=_keys)


def _keys(args: argparse.Namespace) -> int:
    public, secret = make_keys(args.directory, args.name)
    print(f"public: {public}\nsecret: {secret} (keep it private)")
    return EXIT_OK
