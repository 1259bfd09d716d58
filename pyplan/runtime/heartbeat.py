"""A heartbeat between the ranks of a training run: which ranks stopped answering, whatever the others wait for; and
a limit on the waits a heartbeat cannot see (a rank blocked in its own data loading still answers)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta

import torch.distributed as dist

__all__ = ["Heartbeat", "WaitLimit"]

# The store key a rank sets when it ends the run for a wait past the limit (`WaitLimit`): the ranks that then see it
# gone leave without a word, since that rank said why.
_ENDED = "run-ended"


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
        """The lowest rank still answering reports the ranks that stopped, unless a rank ended the run for a wait
        past its limit and said so (`WaitLimit`); every rank leaves with exit status 1."""
        with self.ending:
            if min(set(range(self.world)) - set(ranks)) == self.rank and not self.ended_by_another():
                self.on_stop(ranks, silent_s)
            os._exit(1)

    def ended_by_another(self) -> bool:
        """Whether a rank ended the run for a wait past its limit (`claim_end`)."""
        try:
            return self.store.add(_ENDED, 0) > 0
        except Exception:  # the store is gone: torchrun is ending the run
            return False

    def claim_end(self) -> bool:
        """Mark the run as ended by this rank for a wait past its limit: True on the first rank to mark it, which
        says why; the others leave without a word."""
        try:
            return self.store.add(_ENDED, 1) == 1
        except Exception:  # the store is gone: say it, rather than leave the run unexplained
            return True


class WaitLimit:
    """A limit on the waits of a rank that the heartbeat cannot see: blocked in its own code (--data's iterator that
    never gives the next batch), a rank still beats, and the ranks waiting for it in a collective would wait without
    end. `waiting(what)` marks such a wait; a thread of its own ends the run once one has lasted `timeout` seconds:
    `on_expired(what, timeout)` on the first rank whose wait ran out (with `heartbeat`, told apart through its store;
    the others follow without a word), then the rank exits with status 2. A wait inside C code that holds the GIL is
    seen when that code returns."""

    def __init__(
        self, timeout: float, on_expired: Callable[[str, float], None], heartbeat: Heartbeat | None = None
    ) -> None:
        self.timeout, self.on_expired, self.heartbeat = timeout, on_expired, heartbeat
        self.interval = min(1.0, timeout / 10)
        self._wait: tuple[str, float] | None = None  # what is waited for, since when (time.monotonic())
        threading.Thread(target=self._watch, name="pyplan-wait-limit", daemon=True).start()

    @contextlib.contextmanager
    def waiting(self, what: str) -> Iterator[None]:
        """The block as one wait for `what` ("--data d.py:batches gave no batch for step 3")."""
        self._wait = (what, time.monotonic())
        try:
            yield
        finally:
            self._wait = None

    def _watch(self) -> None:
        while True:
            time.sleep(self.interval)
            wait = self._wait  # read once: the main thread replaces it whole
            if wait is not None and time.monotonic() - wait[1] >= self.timeout:
                self._end(wait[0])

    def _end(self, what: str) -> None:
        if self.heartbeat is None or self.heartbeat.claim_end():
            self.on_expired(what, self.timeout)
        else:
            time.sleep(2.0)  # the rank that says why leaves first (torchrun stops the others at the first failure)
        os._exit(2)
