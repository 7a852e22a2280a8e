"""Arguments that cannot work are refused at construction, with a typed error naming the fix,
not by the first call that needs them."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import kvrt

SIDES: list[tuple[str, Any]] = [
    ("producer", lambda device: kvrt.Producer(device=device)),
    ("consumer", lambda device: kvrt.Consumer(connect="tcp://127.0.0.1:1", device=device)),
]


@pytest.mark.parametrize(("side", "make"), SIDES)
def test_a_cuda_device_this_process_does_not_have_is_refused_at_construction(side: str, make: Any) -> None:
    missing = f"cuda:{torch.cuda.device_count() if torch.cuda.is_available() else 0}"
    with pytest.raises(kvrt.InvalidInputError, match=f"device '{missing}' cannot be used in this process"):
        make(missing)


@pytest.mark.skipif(torch.version.cuda is not None, reason="this torch has CUDA")
@pytest.mark.parametrize(("side", "make"), SIDES)
def test_a_cuda_device_on_a_torch_without_cuda_says_to_install_a_cuda_build(side: str, make: Any) -> None:
    with pytest.raises(kvrt.InvalidInputError, match="built without CUDA; install a CUDA build of torch"):
        make("cuda:0")


@pytest.mark.parametrize(("side", "make"), SIDES)
def test_a_device_kvrt_cannot_move_tensors_on_is_refused(side: str, make: Any) -> None:
    with pytest.raises(kvrt.InvalidInputError, match="'cpu' or 'cuda:N'"):
        make("meta")


@pytest.mark.parametrize(
    "make",
    [
        lambda: kvrt.Producer(bind="127.0.0.1:5555"),
        lambda: kvrt.Consumer(connect="127.0.0.1:5555"),
        lambda: kvrt.Consumer(connect=["tcp://127.0.0.1:5555", "prefill-1:5555"]),
        lambda: kvrt.Client("127.0.0.1:5555"),
    ],
    ids=["producer", "consumer", "one-of-several", "client"],
)
def test_an_endpoint_without_a_scheme_says_to_write_tcp_host_port(make: Any) -> None:
    with pytest.raises(kvrt.InvalidInputError, match="has no scheme: write tcp://HOST:PORT"):
        make()
