"""A closed-form pipeline time that never undercuts the simulated makespan (GPipe and 1F1B, one stage per rank).

GPipe runs every forward, then every backward, so each phase is a pipeline of its own and the makespan is
exactly `ΣF + Σsend_f + (m−1)·max F + ΣB + Σsend_b + (m−1)·max B` (tested against the simulator). 1F1B never
takes longer than that without sends; with sends, its steady state waits for a round trip per micro-batch, and
adding `(m−1)·max_s (send_f + send_b)` bounds it (tested on thousands of random stage and send times: the
simulated makespan never exceeded the bound; it is an upper bound found and checked empirically, not proved).
For equal stages and no sends both equal Huang et al.'s eq. 1, Σ t_s + (m−1)·max t_s.
"""

from __future__ import annotations

from collections.abc import Sequence

from pyplan.errors import PlanError

__all__ = ["closed_form_makespan_s"]


def closed_form_makespan_s(
    schedule: str,
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    *,
    num_microbatches: int,
    send_forward_s: Sequence[float] = (),
    send_backward_s: Sequence[float] = (),
) -> float:
    """Makespan of GPipe (exact) or an upper bound of 1F1B's, per boundary sends optional."""
    p, m = len(forward_s), num_microbatches
    if p == 0 or len(backward_s) != p or m < 1:
        raise PlanError(f"need forward and backward times of the same p >= 1 stages and m >= 1, got {p}, {m}")
    sf = list(send_forward_s) or [0.0] * (p - 1)
    sb = list(send_backward_s) or [0.0] * (p - 1)
    if len(sf) != p - 1 or len(sb) != p - 1:
        raise PlanError(f"{p} stages have {p - 1} boundaries; got {len(sf)} and {len(sb)} send times")
    phases = sum(forward_s) + sum(sf) + (m - 1) * max(forward_s) + sum(backward_s) + sum(sb) + (m - 1) * max(backward_s)
    if schedule == "GPipe":
        return phases
    if schedule == "1F1B":
        round_trip = max((a + b for a, b in zip(sf, sb)), default=0.0)
        return phases + (m - 1) * round_trip
    raise PlanError(f"the closed form covers GPipe and 1F1B, not '{schedule}'; simulate it instead")
