"""Host collector: physical memory, read through psutil at scrape time."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class HostMemory:
    """Host memory in bytes: ``total`` physical, ``available`` to new allocations without
    swapping (psutil's ``virtual_memory().available``)."""

    total: int
    available: int


class HostCollector:
    """Reads host memory. ``virtual_memory``: psutil's function, injectable for tests."""

    name = "host"

    def __init__(self, virtual_memory: Callable = psutil.virtual_memory) -> None:
        self._virtual_memory = virtual_memory

    def collect(self) -> HostMemory:
        vm = self._virtual_memory()
        return HostMemory(total=vm.total, available=vm.available)
