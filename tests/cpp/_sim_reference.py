"""A plain discrete-event simulator of pipeline orders: the reference the C++ simulate is tested against."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

__all__ = ["reference_simulate"]


def reference_simulate(
    order: Sequence[Sequence[tuple[int, str, int]]],
    stage_rank: Sequence[int],
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    backward_weight_s: Sequence[float],
    send_forward_s: Sequence[float],
    send_backward_s: Sequence[float],
) -> dict:
    """A clock and a queue of timed messages. Whenever the clock reaches a message (an action ending, a
    tensor arriving), each idle rank starts its next action if everything it needs has arrived:
    F(s, k) needs ("act", s, k); B/I(s, k) need ("saved", s, k) and, but on the last stage, ("grad", s, k);
    W(s, k) needs ("igrad", s, k). Returns the same fields as pyplan._core.simulate."""
    num_stages = len(forward_s)
    num_ranks = len(order)
    duration = {
        "F": lambda s: forward_s[s],
        "B": lambda s: backward_s[s],
        "I": lambda s: backward_s[s] - backward_weight_s[s],
        "W": lambda s: backward_weight_s[s],
    }
    arrived: set[tuple[str, int, int]] = set()
    queue: list[tuple[float, int, tuple]] = []  # (time, tie-breaker, message)
    counter = 0

    def post(time: float, message: tuple) -> None:
        nonlocal counter
        heapq.heappush(queue, (time, counter, message))
        counter += 1

    def ready(stage: int, op: str, mb: int) -> bool:
        if op == "F":
            return stage == 0 or ("act", stage, mb) in arrived
        if op in ("B", "I"):
            grad_ok = stage == num_stages - 1 or ("grad", stage, mb) in arrived
            return ("saved", stage, mb) in arrived and grad_ok
        return ("igrad", stage, mb) in arrived

    def hop(src: int, dst: int, send: float) -> float:
        return 0.0 if stage_rank[src] == stage_rank[dst] else send

    position = [0] * num_ranks
    running = [False] * num_ranks
    busy = [0.0] * num_ranks
    events = []
    clock = 0.0
    post(0.0, ("start",))
    while queue:
        clock, _, message = heapq.heappop(queue)
        if message[0] == "done":
            _, rank, stage, op, mb = message
            running[rank] = False
            if op == "F":
                arrived.add(("saved", stage, mb))
                if stage + 1 < num_stages:
                    post(
                        clock + hop(stage, stage + 1, send_forward_s[stage]), ("arrive", "act", stage + 1, mb)
                    )
            elif op in ("B", "I"):
                arrived.add(("igrad", stage, mb))
                if stage > 0:
                    post(
                        clock + hop(stage, stage - 1, send_backward_s[stage - 1]),
                        ("arrive", "grad", stage - 1, mb),
                    )
        elif message[0] == "arrive":
            arrived.add(message[1:])
        for rank in range(num_ranks):
            if running[rank] or position[rank] == len(order[rank]):
                continue
            stage, op, mb = order[rank][position[rank]]
            if ready(stage, op, mb):
                end = clock + duration[op](stage)
                running[rank] = True
                position[rank] += 1
                busy[rank] += end - clock
                events.append((rank, stage, op, mb, clock, end))
                post(end, ("done", rank, stage, op, mb))
    if any(position[r] < len(order[r]) for r in range(num_ranks)):
        raise RuntimeError("deadlock")

    makespan = max((e[5] for e in events), default=0.0)
    peak = [0] * num_stages
    for stage in range(num_stages):
        mine = [e for e in events if e[1] == stage]
        for f in (e for e in mine if e[2] == "F"):
            started = sum(1 for e in mine if e[2] == "F" and e[5] <= f[5])
            finished = sum(1 for e in mine if e[2] in ("B", "W") and e[5] <= f[5])
            peak[stage] = max(peak[stage], started - finished)
    return {
        "makespan_s": makespan,
        "busy_s": busy,
        "idle_s": [makespan - b for b in busy],
        "peak_in_flight": peak,
        "events": sorted(events, key=lambda e: (e[4], e[0])),
    }
