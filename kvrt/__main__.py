"""The `kvrt` command (also `python -m kvrt`).

Exit codes: 0 success, 1 the operation failed or the endpoint was unreachable (`kvrt attack`:
a goal was missed), 2 bad usage, 3 `kvrt probe` found no match. Benchmarks report; they do
not fail on a missed goal.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import kvrt
from kvrt._bench import BENCHMARKS
from kvrt._cli_ops import add_commands
from kvrt._demo import DemoShape, run_demo
from kvrt._errors import KVRTError


def _demo(args: argparse.Namespace) -> int:
    return run_demo(DemoShape(requests=args.requests, in_flight=args.in_flight))


def _attack(args: argparse.Namespace) -> int:
    from kvrt._attack import main as run_attack

    return run_attack(args)


def _bench(args: argparse.Namespace) -> int:
    from kvrt._bench import run_bench

    return run_bench(args.name, args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvrt",
        description="Move the KV cache of LLM requests from prefill to decode instances.",
    )
    parser.add_argument("--version", action="version", version=f"kvrt {kvrt.__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = commands.add_parser(
        "demo",
        help="a prefill and a decode process exchanging KV on loopback",
        description="Start a prefill and a decode process, move synthetic requests, print a table.",
    )
    demo.add_argument("--requests", type=int, default=300, help="requests to move (default 300)")
    demo.add_argument("--in-flight", type=int, default=8, help="decode requests in flight (default 8)")
    demo.set_defaults(run=_demo)

    bench = commands.add_parser(
        "bench",
        help="benchmarks, each beside its reference measured in the same run",
        description="Run one benchmark; it prints its table and the ratio against its reference.",
    )
    bench.add_argument("name", choices=BENCHMARKS, help="which benchmark")
    bench.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    bench.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    bench.add_argument(
        "--plot", nargs="?", const="docs/bench", metavar="DIR",
        help="also write PNG plots into DIR (default docs/bench; needs matplotlib)",
    )  # fmt: skip
    bench.add_argument("--in-flight", type=int, default=None, help="requests in flight (nccl; default 8)")
    bench.add_argument("--batch", type=int, default=None, help="items per drop_select_many (nccl; default 16)")
    bench.add_argument(
        "--transport", choices=("nccl", "cuda_ipc", "tcp", "nixl"), default=None,
        help="the transport forced: nccl or cuda_ipc (nccl, pull, stream; default nccl), tcp or nixl (requests)",
    )  # fmt: skip
    bench.add_argument(
        "--device", default=None, help="where both sides run (vllm; default cuda:0; cpu: the host's own path)"
    )
    bench.add_argument(
        "--rate-gbit", type=float, default=None, help="the link's rate between the two hosts (hosts; default 4)"
    )
    bench.set_defaults(run=_bench)
    from kvrt._attack import SCENARIOS

    attack = commands.add_parser(
        "attack",
        help="an adversarial suite against a producer on loopback; exit 1 if a goal is missed",
        description=(
            "Attack a producer (wire garbage, connection storms, peers that stop reading, parked lookups, "
            "SIGSTOP and SIGKILL of either side, 50 consumers under backpressure) beside a legitimate consumer; "
            "print per scenario items inserted, delivered, lost and duplicated, the legitimate consumer's p99 "
            "with and without the attack, and the producer's RSS."
        ),
    )
    attack.add_argument("--quick", action="store_true", help="every scenario shortened, for a smoke run")
    attack.add_argument(
        "--only", nargs="+", choices=[scenario.name for scenario in SCENARIOS], metavar="SCENARIO",
        help="run only these scenarios (" + ", ".join(scenario.name for scenario in SCENARIOS) + ")",
    )  # fmt: skip
    attack.add_argument("--json", metavar="PATH", help="also write each scenario's counts and goals as JSON to PATH")
    attack.add_argument(
        "--keep", metavar="DIR",
        help="leave every process's journal (what it inserted and took) and log in DIR/SCENARIO",
    )  # fmt: skip
    attack.set_defaults(run=_attack)
    # Listed for `kvrt --help`; `main` hands its arguments to the router's own parser.
    commands.add_parser("proxy", help="a router for disaggregated vLLM with KvrtConnector (needs kvrt[vllm])")
    add_commands(commands)
    return parser


def _proxy(argv: Sequence[str]) -> int:
    # Imported by name: the router needs aiohttp, which comes with vLLM, not with kvrt.
    import importlib

    router = importlib.import_module("kvrt.integrations.vllm.proxy")
    code: int = router.main(argv)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["proxy"]:
        return _proxy(arguments[1:])
    parser = build_parser()
    args = parser.parse_args(arguments)
    if args.command == "bench" and args.plot is not None:
        # Refused before the benchmark runs, not after minutes of measuring.
        from kvrt._bench._plot import require_pyplot

        try:
            require_pyplot()
        except KVRTError as error:
            parser.error(str(error))
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
