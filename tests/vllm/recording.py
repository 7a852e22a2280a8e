"""`KvrtConnector` that also writes what it moved, for the end-to-end tests (`tests.vllm.instance
--record DIR`): the producer the pages of each prompt it published, the consumer the pages it
loaded, read out of vLLM's cache after the step, one file per prompt named by its tokens.

With `kill_before_load` (a file holding a process id) the consumer kills that process (the
producer's worker) with SIGKILL before its worker takes the first stream, and removes the file:
the lookup found the KV, the load cannot."""

from __future__ import annotations

import hashlib
import os
import signal
from pathlib import Path
from typing import Any

import torch

from kvrt.integrations.vllm.connector import KvrtConnector, KvrtConnectorMetadata
from kvrt.kernels.paged_kv import gather_reference

WORKER_PID = "worker.pid"
"""The file of a recording folder that holds the worker's process id."""


def record_name(tokens: list[int]) -> str:
    return hashlib.sha256(repr(list(tokens)).encode()).hexdigest()[:16] + ".pt"


class RecordingKvrtConnector(KvrtConnector):
    def _extra(self, key: str) -> Any:
        return (self._kv_transfer_config.kv_connector_extra_config or {}).get(key)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        if self._extra("record"):  # the process that holds the pages (and a producer's kvrt side)
            (Path(self._extra("record")) / WORKER_PID).write_text(str(os.getpid()))

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        victim = self._extra("kill_before_load")
        if victim and Path(victim).exists() and isinstance(meta, KvrtConnectorMetadata) and meta.loads:
            pid = int(Path(victim).read_text())
            os.kill(pid, signal.SIGKILL)
            Path(victim).unlink()  # once
        super().start_load_kv(forward_context, **kwargs)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        super().wait_for_save()
        folder = self._extra("record")
        if not folder or not isinstance(meta, KvrtConnectorMetadata):
            return
        assert self._worker is not None and self._outcome is not None
        pools = self._worker._pools
        assert pools is not None
        moved = [(s.tokens, s.slots) for s in meta.saves]
        moved += [(load.tokens, load.slots) for load in meta.loads if load.request_id not in self._outcome.failed]
        for tokens, slots in moved:
            index = torch.tensor(slots, dtype=torch.int64)
            pages = gather_reference(pools, torch.zeros_like(index), index)
            torch.save({"tokens": tokens, "pages": pages}, Path(folder) / record_name(tokens))
