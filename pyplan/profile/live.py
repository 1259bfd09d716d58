"""Live tensor memory while code runs: every storage that ops allocate, until it dies, and the peak.

`LiveMemory` is a dispatch mode. Each op's outputs are looked at: a storage seen for the first time that is not
one of the op's inputs was allocated by the op, and is counted (its bytes, once, however many views share it)
until a finalizer on the storage reports that it died. Storages that existed before the mode was entered
(parameters, buffers, inputs) are never counted. It works the same on real tensors and on fake or meta ones,
so a model of any size is measured without allocating it.

What happened is kept as an event log, so that peaks can be taken after the fact over any stretch of it and
without the storages the caller names later, e.g. the parameter gradients a backward created (model state,
counted separately):

    with LiveMemory() as mem:
        loss = model(x)
        after_forward = mem.mark()
        loss.backward()
    mem.ignore(p.grad for p in model.parameters() if p.grad is not None)
    mem.peak_bytes, mem.bytes_at(after_forward), mem.peak_bytes_since(after_forward)

What it does not see: memory a kernel uses internally (workspaces), allocations made outside torch's dispatcher,
and frees after the mode exits (the log stops there).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from pyplan._torch import TorchDispatchMode, storage_key, tensor_leaves

__all__ = ["LiveMemory", "MemoryEvent"]


@dataclass(frozen=True)
class MemoryEvent:
    """One change of live memory: allocation `serial` (numbered in order) grew by `delta_bytes` (negative: died).

    `op` names the aten op that allocated or resized the storage ("" when it died).
    """

    serial: int
    delta_bytes: int
    device: str
    op: str = ""


class LiveMemory(TorchDispatchMode):
    """Counts the bytes of live storages allocated while active (see the module docstring).

    `exclude`: tensors whose storages are never counted even if an op hands them out as new (rare: storages that
    exist before the mode are never counted anyway). `device`: count only storages on this device type (e.g.
    "cuda", leaving out the host copies of offloaded activations); default: every device.
    """

    def __init__(self, *, exclude: Iterable[torch.Tensor] = (), device: str | torch.device | None = None) -> None:
        super().__init__()
        self.events: list[MemoryEvent] = []
        self._device = torch.device(device).type if device is not None else None
        self._excluded = {storage_key(t) for t in exclude}
        self._ignored: set[int] = set()
        self._live: dict[int, tuple[int, int]] = {}  # storage key -> (serial, bytes counted so far)
        self._finalizers: list[weakref.finalize] = []
        self._serials = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        outputs = tensor_leaves(out)
        if outputs:
            inputs = {_key(t) for t in tensor_leaves((args, kwargs))}
            for t in outputs:
                self._see(t, inputs, func)
        return out

    def __exit__(self, *exc: Any) -> None:
        for f in self._finalizers:
            f.detach()
        self._finalizers.clear()
        return super().__exit__(*exc)

    def _see(self, t: torch.Tensor, inputs: set[int | None], func: Any) -> None:
        key = _key(t)
        if key is None or key in self._excluded:
            return
        device = t.device.type
        if self._device is not None and device != self._device:
            return
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        if key in self._live:
            serial, counted = self._live[key]
            if nbytes != counted:  # resized in place
                self._live[key] = (serial, nbytes)
                self.events.append(MemoryEvent(serial, nbytes - counted, device, str(func)))
            return
        if key in inputs:
            return  # an input's storage handed back (in-place op, view) that existed before the mode
        serial = self._serials
        self._serials += 1
        self._live[key] = (serial, nbytes)
        self.events.append(MemoryEvent(serial, nbytes, device, str(func)))
        self._finalizers.append(weakref.finalize(storage, self._died, key, serial, device))

    def _died(self, key: int, serial: int, device: str) -> None:
        entry = self._live.get(key)
        if entry is not None and entry[0] == serial:
            del self._live[key]
            self.events.append(MemoryEvent(serial, -entry[1], device))

    def ignore(self, tensors: Iterable[torch.Tensor]) -> None:
        """Leave the storages of `tensors` (live now) out of every figure, from their allocation on."""
        for t in tensors:
            entry = self._live.get(storage_key(t))
            if entry is not None:
                self._ignored.add(entry[0])

    def holds(self, key: int) -> bool:
        """Whether the storage of `storage_key` `key`, allocated while the mode was active, is live now."""
        return key in self._live

    def mark(self) -> int:
        """A position in the event log, for `bytes_at` and `peak_bytes_since`."""
        return len(self.events)

    def bytes_at(self, mark: int) -> int:
        """Bytes live at `mark`."""
        return sum(e.delta_bytes for e in self.events[:mark] if e.serial not in self._ignored)

    def peak_bytes_since(self, mark: int, stop: int | None = None) -> int:
        """The most bytes live at any moment between `mark` and `stop` (default: the end of the log)."""
        cur = peak = self.bytes_at(mark)
        for e in self.events[mark:stop]:
            if e.serial not in self._ignored:
                cur += e.delta_bytes
                peak = max(peak, cur)
        return peak

    def live_at(self, mark: int) -> dict[int, int]:
        """The allocations live at `mark`: serial -> bytes (to find what a figure is made of)."""
        live: dict[int, int] = {}
        for e in self.events[:mark]:
            if e.serial not in self._ignored:
                live[e.serial] = live.get(e.serial, 0) + e.delta_bytes
        return {s: b for s, b in live.items() if b}

    @property
    def current_bytes(self) -> int:
        """Bytes live now (or when the mode exited)."""
        return self.bytes_at(len(self.events))

    @property
    def peak_bytes(self) -> int:
        """The most bytes ever live while the mode was active."""
        return self.peak_bytes_since(0)

    @property
    def allocations(self) -> int:
        """How many storages were counted."""
        return self._serials


def _key(t: torch.Tensor) -> int | None:
    """The storage identity of `t`, or None for tensors without one (sparse, nested, some subclasses)."""
    try:
        return storage_key(t)
    except (RuntimeError, NotImplementedError, TypeError):
        return None
