"""A heartbeat between the ranks of a training run: which ranks stopped answering, whatever the others wait for."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch.distributed as dist

__all__ = ["Heartbeat"]


class Heartbeat:
    """Which ranks stopped answering, whatever the others wait for: a rank stopped (SIGSTOP), killed, or gone.

    Every rank adds 1 to its counter in torchrun's store every `interval` seconds, from a thread of its own; a
    rank whose counter stands still has stopped answering. Rank 0 watches every counter (rank 1 watches rank 0's)
    and ends the run once one has stood still for `timeout` seconds: collectives over the mesh's sub-groups wait
    torch's default 30 minutes, not the timeout given to init_process_group. Ending the run is `on_stop(ranks,
    silent_s)`, called on the lowest rank still answering (it says which ranks stopped), then every rank exits 1.
    Call after init_process_group under torchrun (it reads MASTER_ADDR and MASTER_PORT)."""

    def __init__(self, timeout: float, on_stop: Callable[[Sequence[int], float], None]) -> None:
        self.on_stop = on_stop
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.timeout, self.interval = timeout, min(5.0, timeout / 10)
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=max(timeout, 30.0)),
        )
        self.store = dist.PrefixStore("pyplan-heartbeat", store)
        self.watched: Sequence[int] = range(self.world) if self.rank == 0 else [0] if self.rank == 1 else []
        self.ending = threading.Lock()
        threading.Thread(target=self.beat, name="pyplan-heartbeat", daemon=True).start()

    def counts(self, ranks: Sequence[int]) -> list[int]:
        return [self.store.add(str(r), 0) for r in ranks]

    def beat(self) -> None:
        try:
            seen = self.counts(self.watched)
            since = [time.monotonic()] * len(seen)
            while True:
                self.store.add(str(self.rank), 1)
                now = time.monotonic()
                for i, count in enumerate(self.counts(self.watched)):
                    if count != seen[i]:
                        seen[i], since[i] = count, now
                late = [r for r, t in zip(self.watched, since) if now - t >= self.timeout]
                if late:
                    self.end(late, self.timeout)
                time.sleep(self.interval)
        except Exception:  # the store is gone: torchrun is ending the run
            return

    def stopped(self) -> list[int]:
        """The other ranks whose counters stand still over four beats (asked after a collective failed)."""
        others = [r for r in range(self.world) if r != self.rank]
        before = self.counts(others)
        time.sleep(4 * self.interval)
        return [r for r, a, b in zip(others, before, self.counts(others)) if a == b]

    def end(self, ranks: Sequence[int], silent_s: float) -> None:
        """The lowest rank still answering reports the ranks that stopped; every rank leaves with exit status 1."""
        with self.ending:
            if min(set(range(self.world)) - set(ranks)) == self.rank:
                self.on_stop(ranks, silent_s)
            os._exit(1)
