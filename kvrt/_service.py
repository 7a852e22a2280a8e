"""What Producer, Consumer and Client share: `start()` / `aclose()`, and `async with` over them."""

from __future__ import annotations

import abc
from types import TracebackType
from typing import Self


class AsyncService(abc.ABC):
    """Started once with `start()` (or `async with`), stopped with `aclose()`, which is idempotent
    and ends every pending call with an error."""

    @abc.abstractmethod
    async def start(self) -> Self: ...

    @abc.abstractmethod
    async def aclose(self) -> None: ...

    async def close(self) -> None:
        """The same as `aclose` (both names are part of the API): end every pending call with an error, stop."""
        await self.aclose()

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()
