"""OR-Tools CP-SAT models for graphs that are not chains: pipeline stages of a DAG, Checkmate rematerialization."""

from __future__ import annotations

import contextlib
import itertools
import math
import signal
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ortools.sat.python import cp_model

from pyplan import _core
from pyplan.errors import InfeasibleError, PlanError
from pyplan.graph.layergraph import LayerGraph
from pyplan.graph.linearize import cut_points
from pyplan.solve.remat import RematChain
from pyplan.units import fmt_bytes

__all__ = [
    "DagReplay",
    "RematDag",
    "RematSchedule",
    "StageAssignment",
    "StageDag",
    "assign_stages",
    "chain_ops",
    "evaluate_stages",
    "periodic_schedule",
    "remat_schedule",
    "replay_dag",
    "stage_dag_from_layergraph",
]

# CP-SAT works on integers. Seconds are scaled by a power of two (exact for integer-valued times) that maps an upper
# bound of the times in play to about this many units: far below 2^63, and each term's rounding (half a unit) is
# some 1e-14 of that bound, so the integer optimum is the true one unless two assignments differ by less. Bytes are
# rounded up (limits down) to whole bytes and divided by their gcd.
_TIME_UNITS = 2.0**45

_STATUS = {cp_model.OPTIMAL: "optimal", cp_model.FEASIBLE: "feasible"}

# Linear expressions over CP-SAT variables, or plain integers where a quantity is known to be constant.
_Expr = Any
# A sum of 0/1 variables and integers, kept as its terms so that a warm start can be evaluated in Python.
_Sum = tuple[Any, ...]


def _time_scale(upper_s: float) -> float:
    """The power of two that maps [0, upper_s] onto integers up to about _TIME_UNITS."""
    return 2.0 ** math.floor(math.log2(_TIME_UNITS / upper_s)) if upper_s > 0 else 1.0


def _is_one(terms: _Sum) -> bool:
    """The sum is the constant 1."""
    return len(terms) == 1 and isinstance(terms[0], int) and terms[0] == 1


def _byte_unit(sizes: Sequence[int]) -> int:
    """The gcd of the (integer) sizes: every memory constraint is divided by it."""
    g = 0
    for s in sizes:
        g = math.gcd(g, abs(s))
    return g or 1


def _solver(time_limit_s: float, num_workers: int) -> cp_model.CpSolver:
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = num_workers
    # CP-SAT's own Ctrl-C handler would end the search as if its time had run out (the caller then goes on with
    # the plan found so far) and leave SIGINT at its default action afterwards; _solve handles Ctrl-C instead.
    solver.parameters.catch_sigint_signal = False
    return solver


def _solve(solver: cp_model.CpSolver, model: cp_model.CpModel) -> Any:
    """`solver.solve(model)`, stopped by Ctrl-C like any Python code: KeyboardInterrupt.

    The search runs in a thread (CP-SAT releases the GIL) while this one waits, so the interpreter's SIGINT
    handler runs at once; on KeyboardInterrupt, or any exception raised while waiting, the search is stopped and
    waited for before the exception goes on (a search left running aborts the interpreter at exit), however many
    times Ctrl-C is pressed meanwhile. SIGINT's handler is put back as it was before the solve."""
    outcome: list[Any] = []
    # Set when the search has returned. Thread.join cannot tell: on Python 3.11 a join interrupted by Ctrl-C marks
    # the thread stopped while it still runs (the bpo-45274 fix).
    finished = threading.Event()

    def run() -> None:
        try:
            outcome.append(solver.solve(model))
        except BaseException as exc:
            outcome.append(exc)
        finally:
            finished.set()

    previous = signal.getsignal(signal.SIGINT)
    threading.Thread(target=run, name="cp-sat", daemon=True).start()
    try:
        finished.wait()
    except BaseException:
        # stop_search does nothing until the search has begun: ask until it ends, through further Ctrl-Cs.
        while not finished.is_set():
            solver.stop_search()
            with contextlib.suppress(KeyboardInterrupt):
                finished.wait(0.05)
        raise
    finally:
        if previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, previous)
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]


# ---------------------------------------------------------------------------------------------------------------
# A. Stage assignment of a DAG
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StageDag:
    """A DAG to split into pipeline stages: nodes in topological order, figures per micro-batch.

    time_s[v]       forward + backward seconds of node v;
    state_bytes[v]  weights, gradients and optimizer state, paid once by its stage;
    act_bytes[v]    activations kept for backward, paid per micro-batch in flight;
    out_bytes[v]    node v's output: what a stage boundary sends when the output is read beyond it. The bytes sit
                    on the producer, so every edge out of v carries them and a value read by several nodes of a
                    later stage crosses each boundary once (LayerGraph.edges() gives each edge its producer's
                    bytes, the same convention);
    edges           (producer, consumer) pairs with producer < consumer;
    input_bytes[k]  graph input k (a placeholder): stage 0 keeps all of them per micro-batch (the chain's cut 0)
                    and each also crosses every boundary before its last reader;
    input_edges     (input k, consumer) pairs;
    output_nodes    nodes whose value the model returns: the last stage returns it, so it crosses every boundary
                    after its producer;
    unsendable      nodes whose output is not one tensor (no boundary may separate them from their readers);
    names           node names for messages (default "node v").
    """

    time_s: tuple[float, ...]
    state_bytes: tuple[float, ...]
    act_bytes: tuple[float, ...]
    out_bytes: tuple[float, ...]
    edges: tuple[tuple[int, int], ...]
    input_bytes: tuple[float, ...] = ()
    input_edges: tuple[tuple[int, int], ...] = ()
    output_nodes: tuple[int, ...] = ()
    unsendable: tuple[int, ...] = ()
    names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.time_s)
        for name in ("state_bytes", "act_bytes", "out_bytes"):
            if len(getattr(self, name)) != n:
                raise PlanError(f"{name} has {len(getattr(self, name))} entries, the DAG has {n} nodes")
        if self.names and len(self.names) != n:
            raise PlanError(f"names has {len(self.names)} entries, the DAG has {n} nodes")
        for name in ("time_s", "state_bytes", "act_bytes", "out_bytes", "input_bytes"):
            for i, x in enumerate(getattr(self, name)):
                if not (math.isfinite(x) and x >= 0):
                    raise PlanError(f"{name}[{i}] must be a finite number >= 0, got {x}")
        for u, v in self.edges:
            if not 0 <= u < v < n:
                raise PlanError(f"edge ({u}, {v}) must join two of the {n} nodes in topological order (u < v)")
        for k, v in self.input_edges:
            if not (0 <= k < len(self.input_bytes) and 0 <= v < n):
                raise PlanError(f"input edge ({k}, {v}) names an input or a node that does not exist")
        for v in (*self.output_nodes, *self.unsendable):
            if not 0 <= v < n:
                raise PlanError(f"node {v} does not exist (the DAG has {n} nodes)")

    def __len__(self) -> int:
        return len(self.time_s)

    def name(self, v: int) -> str:
        return self.names[v] if self.names else f"node {v}"

    @staticmethod
    def from_chain(
        fwd_time_s: Sequence[float],
        bwd_time_s: Sequence[float],
        act_bytes: Sequence[float],
        state_bytes: Sequence[float],
        cut_bytes: Sequence[float],
    ) -> StageDag:
        """A chain as a path: block i sends cut_bytes[i + 1] to block i + 1; cut 0 is the graph input.

        Every partition of the chain then costs exactly what `pyplan.solve.partition` says it costs.
        """
        n = len(fwd_time_s)
        return StageDag(
            time_s=tuple(f + b for f, b in zip(fwd_time_s, bwd_time_s)),
            state_bytes=tuple(state_bytes),
            act_bytes=tuple(act_bytes),
            out_bytes=tuple(cut_bytes[1:]),
            edges=tuple((i, i + 1) for i in range(n - 1)),
            input_bytes=(cut_bytes[0],),
            input_edges=((0, 0),),
        )


@dataclass(frozen=True)
class StageAssignment:
    """A stage for every node of a StageDag, with the figures of partition.h per stage."""

    stage_of_node: tuple[int, ...]
    stage_time_s: tuple[float, ...]  # compute + the sends of both boundaries
    stage_state_bytes: tuple[float, ...]
    stage_act_bytes: tuple[float, ...]  # in flight × (activations + what crosses the input boundary)
    stage_in_flight: tuple[int, ...]
    boundary_bytes: tuple[float, ...]  # [p − 1] what crosses the boundary after stage s
    pipeline_time_s: float  # Σ t_s + (m − 1)·max t_s
    bottleneck_s: float
    status: str  # "optimal", or "feasible": the best found within the time limit
    solve_time_s: float
    warm_start: str  # what hinted the solver ("dp": the chain DP over the node order), "" when nothing did

    def stage_nodes(self, stage: int) -> list[int]:
        return [v for v, s in enumerate(self.stage_of_node) if s == stage]


@dataclass(frozen=True)
class _Pipeline:
    """The pipeline the stages run in (see assign_stages)."""

    num_stages: int
    num_microbatches: int
    mem_limit_bytes: tuple[float, ...]
    in_flight: tuple[int, ...]
    latency_s: float
    bw_bytes_per_s: float

    def send_s(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bw_bytes_per_s


def _readers(dag: StageDag) -> tuple[list[list[int]], list[list[int]]]:
    """The consumers of each node and of each graph input."""
    node_readers: list[list[int]] = [[] for _ in range(len(dag))]
    for u, v in dag.edges:
        node_readers[u].append(v)
    input_readers: list[list[int]] = [[] for _ in dag.input_bytes]
    for k, v in dag.input_edges:
        input_readers[k].append(v)
    return node_readers, input_readers


def _evaluate(
    dag: StageDag, stage_of_node: Sequence[int], pipe: _Pipeline, status: str, solve_time_s: float, warm_start: str
) -> StageAssignment:
    """The figures of an assignment, from the definitions in assign_stages' docstring."""
    p = pipe.num_stages
    node_readers, input_readers = _readers(dag)
    outputs = set(dag.output_nodes)
    crossing = [0.0] * max(p - 1, 0)
    for u, readers in enumerate(node_readers):
        last = p - 1 if u in outputs else max((stage_of_node[r] for r in readers), default=-1)
        for s in range(stage_of_node[u], last):
            crossing[s] += dag.out_bytes[u]
    for k, readers in enumerate(input_readers):
        for s in range(max((stage_of_node[r] for r in readers), default=0)):
            crossing[s] += dag.input_bytes[k]
    times, states, acts = [], [], []
    for s in range(p):
        nodes = [v for v in range(len(dag)) if stage_of_node[v] == s]
        t = sum(dag.time_s[v] for v in nodes)
        t += pipe.send_s(crossing[s]) if s < p - 1 else 0.0
        t += pipe.send_s(crossing[s - 1]) if s > 0 else 0.0
        times.append(t)
        states.append(sum(dag.state_bytes[v] for v in nodes))
        held = sum(dag.act_bytes[v] for v in nodes) + (crossing[s - 1] if s > 0 else sum(dag.input_bytes))
        acts.append(pipe.in_flight[s] * held)
    m = pipe.num_microbatches
    return StageAssignment(
        stage_of_node=tuple(stage_of_node),
        stage_time_s=tuple(times),
        stage_state_bytes=tuple(states),
        stage_act_bytes=tuple(acts),
        stage_in_flight=pipe.in_flight,
        boundary_bytes=tuple(crossing),
        pipeline_time_s=sum(times) + (m - 1) * max(times),
        bottleneck_s=max(times),
        status=status,
        solve_time_s=solve_time_s,
        warm_start=warm_start,
    )


def evaluate_stages(
    dag: StageDag,
    stage_of_node: Sequence[int],
    *,
    num_microbatches: int,
    schedule: str = "1F1B",
    in_flight_per_stage: Sequence[int] = (),
    latency_s: float = 0.0,
    bw_bytes_per_s: float = math.inf,
) -> StageAssignment:
    """The figures of a given assignment (stages 0..p − 1, p = max + 1), by the costs of assign_stages.

    Raises PlanError when the assignment is not monotone along the edges, leaves a stage empty or separates an
    unsendable node from a reader; memory is reported, not checked.
    """
    p = max(stage_of_node, default=-1) + 1
    if len(stage_of_node) != len(dag) or p < 1:
        raise PlanError(f"stage_of_node needs one stage per node ({len(dag)}), got {len(stage_of_node)}")
    for u, v in dag.edges:
        if stage_of_node[u] > stage_of_node[v] or (u in dag.unsendable and stage_of_node[u] != stage_of_node[v]):
            raise PlanError(f"edge ({u}, {v}) goes from stage {stage_of_node[u]} to stage {stage_of_node[v]}")
    for u in set(dag.unsendable) & set(dag.output_nodes):
        if stage_of_node[u] != p - 1:
            raise PlanError(f"node {u} returns a value that is not one tensor, so it must run on the last stage")
    if set(stage_of_node) != set(range(p)):
        raise PlanError(f"stages {sorted(set(range(p)) - set(stage_of_node))} of 0..{p - 1} are empty")
    pipe = _pipeline(p, num_microbatches, [math.inf] * p, schedule, in_flight_per_stage, latency_s, bw_bytes_per_s)
    return _evaluate(dag, stage_of_node, pipe, "given", 0.0, "")


def _pipeline(
    p: int,
    m: int,
    mem_limit_bytes: Sequence[float],
    schedule: str,
    in_flight_per_stage: Sequence[int],
    latency_s: float,
    bw_bytes_per_s: float,
) -> _Pipeline:
    """The checked pipeline options."""
    if m < 1:
        raise PlanError(f"num_microbatches must be >= 1, got {m}")
    if len(mem_limit_bytes) != p:
        raise PlanError(f"mem_limit_bytes must have one entry per stage ({p}), got {len(mem_limit_bytes)}")
    if schedule not in ("GPipe", "1F1B"):
        raise PlanError(f"the in-flight micro-batches are known for 'GPipe' and '1F1B', got '{schedule}'")
    if in_flight_per_stage:
        if len(in_flight_per_stage) != p or not all(1 <= x <= m for x in in_flight_per_stage):
            raise PlanError(f"in_flight_per_stage must have {p} entries in [1, {m}], got {list(in_flight_per_stage)}")
        in_flight = tuple(in_flight_per_stage)
    else:
        in_flight = tuple(m if schedule == "GPipe" else min(m, p - s) for s in range(p))
    if not bw_bytes_per_s > 0 or not latency_s >= 0:
        raise PlanError(f"the link needs bw_bytes_per_s > 0 and latency_s >= 0, got {bw_bytes_per_s}, {latency_s}")
    return _Pipeline(p, m, tuple(mem_limit_bytes), in_flight, latency_s, bw_bytes_per_s)


def _dp_hint(dag: StageDag, pipe: _Pipeline, schedule: str) -> list[int] | None:
    """The chain DP's optimum over the node order, cut only where no unsendable value crosses.

    A split of a topological order into contiguous stages is a monotone assignment, and with each cut's bytes set
    to what crosses it, it costs the same in both models: an upper bound on the DAG's optimum and a warm start.
    """
    n = len(dag)
    node_readers, input_readers = _readers(dag)
    outputs = set(dag.output_nodes)
    last_node = [n if u in outputs else max(rs, default=u) for u, rs in enumerate(node_readers)]
    last_input = [max(rs, default=-1) for rs in input_readers]
    unsendable = set(dag.unsendable)

    def crossing(c: int) -> tuple[float, bool]:
        """The bytes that cross the cut before node c, and whether all of it can be sent."""
        nbytes = sum(b for k, b in enumerate(dag.input_bytes) if last_input[k] >= c)
        sendable = True
        for u in range(c):
            if last_node[u] >= c:
                nbytes += dag.out_bytes[u]
                sendable = sendable and u not in unsendable
        return nbytes, sendable

    cuts = [0, *(c for c in range(1, n) if crossing(c)[1]), n]
    if len(cuts) - 1 < pipe.num_stages:
        return None
    blocks = list(itertools.pairwise(cuts))
    got = _core.partition(
        [sum(dag.time_s[a:b]) for a, b in blocks],
        [0.0] * len(blocks),
        [sum(dag.act_bytes[a:b]) for a, b in blocks],
        [sum(dag.state_bytes[a:b]) for a, b in blocks],
        [sum(dag.input_bytes), *(crossing(c)[0] for c in cuts[1:-1]), 0.0],
        num_stages=pipe.num_stages,
        num_microbatches=pipe.num_microbatches,
        mem_limit_bytes=list(pipe.mem_limit_bytes),
        schedule=schedule,
        latency_s=pipe.latency_s,
        bw_bytes_per_s=pipe.bw_bytes_per_s,
        in_flight_per_stage=list(pipe.in_flight),
    )
    if not got.feasible:
        return None
    stage_of_node = [0] * n
    for s in range(pipe.num_stages):
        for a, b in blocks[got.cuts[s] : got.cuts[s + 1]]:
            stage_of_node[a:b] = [s] * (b - a)
    return stage_of_node


@dataclass
class _StageModel:
    """The variables of the stage model and the integer memory expressions built on them."""

    model: cp_model.CpModel
    before: list[list[Any]]  # [node][s]
    crosses: dict[int, list[Any]]  # [node][s]
    input_crosses: dict[int, list[Any]]  # [input][s]
    mem_units: list[_Expr]  # [stage] memory in units of `unit` bytes
    limit_units: list[int | None]  # [stage] None: unlimited
    unit: int

    def on(self, v: int, s: int) -> _Expr:
        """1 when node v runs on stage s."""
        p = len(self.mem_units)
        upto = self.before[v][s] if s < p - 1 else 1
        return upto - self.before[v][s - 1] if s > 0 else upto

    def stage_of_node(self, value: Any) -> list[int]:
        """Each node's stage under `value` (a solver's value function)."""
        return [sum(1 - value(b) for b in row) for row in self.before]


def _stage_model(dag: StageDag, pipe: _Pipeline) -> _StageModel:
    """Variables and constraints shared by the time model and the least-overflow model."""
    # Data: integer bytes (sizes rounded up, limits down) in units of their gcd.
    n, p = len(dag), pipe.num_stages
    node_readers, input_readers = _readers(dag)
    outputs, unsendable = set(dag.output_nodes), set(dag.unsendable)
    state = [math.ceil(x) for x in dag.state_bytes]
    act = [math.ceil(x) for x in dag.act_bytes]
    out = [math.ceil(x) for x in dag.out_bytes]
    inp = [math.ceil(x) for x in dag.input_bytes]
    unit = _byte_unit([*state, *act, *out, *inp])
    model = cp_model.CpModel()

    # Variables.
    # before[v][s] is 1 when node v runs on stage s or earlier (s < p − 1: every node runs on stage p − 1 or before).
    before = [[model.new_bool_var(f"before[{v},{s}]") for s in range(p - 1)] for v in range(n)]
    # crosses[u][s] is 1 when node u's output crosses the boundary after stage s: made on stage ≤ s, read later.
    crosses = {
        u: [model.new_bool_var(f"crosses[{u},{s}]") for s in range(p - 1)]
        for u in range(n)
        if (node_readers[u] or u in outputs) and (out[u] > 0 or u in unsendable)
    }
    # input_crosses[k][s] is 1 when graph input k is read after stage s, and so crosses that boundary.
    input_crosses = {
        k: [model.new_bool_var(f"input_crosses[{k},{s}]") for s in range(p - 1)]
        for k in range(len(inp))
        if input_readers[k] and inp[k] > 0
    }

    def on(v: int, s: int) -> _Expr:
        """1 when node v runs on stage s."""
        upto = before[v][s] if s < p - 1 else 1
        return upto - before[v][s - 1] if s > 0 else upto

    # Constraints.
    for v in range(n):
        for s in range(p - 2):
            model.add_implication(before[v][s], before[v][s + 1])
    for u, v in dag.edges:  # stage indices never decrease along an edge
        for s in range(p - 1):
            model.add_implication(before[v][s], before[u][s])
    for s in range(p):  # no stage is empty
        model.add(sum(on(v, s) for v in range(n)) >= 1)
    for u, row in crosses.items():
        for s, x in enumerate(row):
            if u in unsendable:
                model.add(x == 0)
            if u in outputs:
                model.add(x == before[u][s])
                continue
            model.add(x <= before[u][s])
            for r in node_readers[u]:
                model.add(x >= before[u][s] - before[r][s])
            model.add(x <= sum(1 - before[r][s] for r in node_readers[u]))
    for k, row in input_crosses.items():
        for s, x in enumerate(row):
            for r in input_readers[k]:
                model.add(x >= 1 - before[r][s])
            model.add(x <= sum(1 - before[r][s] for r in input_readers[k]))

    # Memory of each stage: states + in flight × (activations + what crosses its input boundary).
    mem_units: list[_Expr] = []
    limit_units: list[int | None] = []
    for s in range(p):
        held: _Expr = sum(inp) // unit if s == 0 else 0
        if s > 0:
            held += sum(out[u] // unit * row[s - 1] for u, row in crosses.items())
            held += sum(inp[k] // unit * row[s - 1] for k, row in input_crosses.items())
        held += sum(act[v] // unit * on(v, s) for v in range(n))
        mem_units.append(sum(state[v] // unit * on(v, s) for v in range(n)) + pipe.in_flight[s] * held)
        limit = pipe.mem_limit_bytes[s]
        limit_units.append(None if math.isinf(limit) else math.floor(limit) // unit)
    return _StageModel(model, before, crosses, input_crosses, mem_units, limit_units, unit)


def _hint_stages(sm: _StageModel, dag: StageDag, stage_of_node: Sequence[int], p: int) -> None:
    """Hint every variable of the stage model from an assignment."""
    node_readers, input_readers = _readers(dag)
    outputs = set(dag.output_nodes)
    for v, row in enumerate(sm.before):
        for s, b in enumerate(row):
            sm.model.add_hint(b, stage_of_node[v] <= s)
    for u, row in sm.crosses.items():
        last = p - 1 if u in outputs else max(stage_of_node[r] for r in node_readers[u])
        for s, x in enumerate(row):
            sm.model.add_hint(x, stage_of_node[u] <= s < last)
    for k, row in sm.input_crosses.items():
        last = max(stage_of_node[r] for r in input_readers[k])
        for s, x in enumerate(row):
            sm.model.add_hint(x, s < last)


@dataclass(frozen=True)
class _StageTimes:
    """The seconds of the stage model as integer time units."""

    time_q: list[int]  # [node] forward + backward
    latency_q: int  # one message's latency
    out_q: list[int]  # [node] sending its output
    inp_q: list[int]  # [input] sending it

    @staticmethod
    def of(dag: StageDag, pipe: _Pipeline) -> _StageTimes:
        """The DAG's seconds in time units."""
        # Seconds to integers: the compute and every send at once map to about _TIME_UNITS (fewer units when m is so
        # large that (m − 1)·t_max would come near 2^62).
        p, m = pipe.num_stages, pipe.num_microbatches
        per_byte = 0.0 if math.isinf(pipe.bw_bytes_per_s) else 1.0 / pipe.bw_bytes_per_s
        all_sends = 2 * ((p - 1) * pipe.latency_s + (sum(dag.out_bytes) + sum(dag.input_bytes)) * per_byte)
        scale = _time_scale((sum(dag.time_s) + all_sends) * max(1.0, m / 2.0**16))
        return _StageTimes(
            time_q=[round(t * scale) for t in dag.time_s],
            latency_q=round(pipe.latency_s * scale),
            out_q=[round(b * per_byte * scale) for b in dag.out_bytes],
            inp_q=[round(b * per_byte * scale) for b in dag.input_bytes],
        )


def _minimize_pipeline_time(sm: _StageModel, times: _StageTimes, pipe: _Pipeline) -> None:
    """Add the memory limits, each stage's time below t_max and the objective Σ t_s + (m − 1)·t_max to the stage
    model."""
    model, n, p, m = sm.model, len(times.time_q), pipe.num_stages, pipe.num_microbatches
    # t_max is the largest stage time, in time units.
    t_max = model.new_int_var(0, int(_TIME_UNITS * 4), "t_max")

    # Constraints: memory, and the stage times below t_max.
    for mem, limit in zip(sm.mem_units, sm.limit_units):
        if limit is not None:
            model.add(mem <= limit)
    boundary = [
        times.latency_q
        + sum(times.out_q[u] * row[s] for u, row in sm.crosses.items())
        + sum(times.inp_q[k] * row[s] for k, row in sm.input_crosses.items())
        for s in range(p - 1)
    ]
    stage_time = []
    for s in range(p):
        t = sum(times.time_q[v] * sm.on(v, s) for v in range(n))
        t += boundary[s] if s < p - 1 else 0
        t += boundary[s - 1] if s > 0 else 0
        stage_time.append(t)
        model.add(t <= t_max)

    # Objective.
    model.minimize(sum(stage_time) + (m - 1) * t_max)


def assign_stages(
    dag: StageDag,
    *,
    num_stages: int,
    num_microbatches: int,
    mem_limit_bytes: Sequence[float],
    schedule: str = "1F1B",
    in_flight_per_stage: Sequence[int] = (),
    latency_s: float = 0.0,
    bw_bytes_per_s: float = math.inf,
    time_limit_s: float = 10.0,
    num_workers: int = 2,
    warm_start: bool = True,
) -> StageAssignment:
    """Assign every node of `dag` a pipeline stage, minimizing Σ_s t_s + (m − 1)·max_s t_s under memory limits.

    For graphs whose linearization leaves blocks too coarse to balance: the stages need not be contiguous in any
    one topological order, only monotone along the edges. The costs are partition.h's, generalized:
      stage(u) ≤ stage(v) for every edge (u, v); every stage holds at least one node;
      boundary s (between stages s and s + 1) carries every value made on stage ≤ s and read after s (node
        outputs, graph inputs, returned values), each once however many nodes read it, as torch's pipeline
        splitter forwards a skip tensor stage by stage; send(s) = α + bytes_s/BW, one message per boundary;
      t_s = Σ_{v on s} time_s[v] + send(s) [s < p − 1] + send(s − 1) [s > 0]: a stage pays the forward send of its
        output boundary and the gradient send of its input boundary;
      mem_s = Σ_{v on s} state_bytes[v] + n_s·(Σ_{v on s} act_bytes[v] + in_s) ≤ mem_limit_bytes[s], with in_s what
        crosses boundary s − 1 (in_0: all graph inputs) and n_s the micro-batches in flight (GPipe m,
        1F1B min(m, p − s), or in_flight_per_stage[s]).
    On a path (StageDag.from_chain) this is exactly the chain partition. Any assignment is a contiguous split of
    some topological order (sort the nodes by stage), and costs what partition() says that chain costs.

    The CP-SAT model (the order of OR-Tools' line_balancing_sat sample): booleans before[v][s] = [stage(v) ≤ s],
    monotone in s and along edges; crosses[u][s] = before[u][s] ∧ ¬(every reader of u before s), defined
    exactly; integer stage times (seconds scaled by a power of two) and t_max ≥ t_s; minimize Σ t_s + (m − 1)·t_max.
    The chain DP over the node order warm-starts it (warm_start=False leaves the model on its own). Returns the best
    assignment found within time_limit_s; raises InfeasibleError naming the stage that overflows least when nothing
    fits, PlanError on malformed input.
    """
    # Data.
    n, p, m = len(dag), num_stages, num_microbatches
    if not 1 <= p <= n:
        raise PlanError(f"num_stages must be in [1, {n}] (the DAG has {n} nodes), got {p}")
    pipe = _pipeline(p, m, mem_limit_bytes, schedule, in_flight_per_stage, latency_s, bw_bytes_per_s)
    hint = _dp_hint(dag, pipe, schedule) if warm_start else None
    times = _StageTimes.of(dag, pipe)

    # Model, variables and the shared constraints (see _stage_model).
    sm = _stage_model(dag, pipe)
    model = sm.model
    # Constraints: memory, and the stage times below t_max; objective: the pipeline time.
    _minimize_pipeline_time(sm, times, pipe)
    if hint is not None:
        _hint_stages(sm, dag, hint, p)

    # Solve.
    solver = _solver(time_limit_s, num_workers)
    status = _solve(solver, model)

    # Read the result: the solver's assignment, or the DP's where it is at least as good in floating point (the two
    # can differ only by the rounding of seconds to time units).
    warm = "dp" if hint is not None else ""
    if status in _STATUS:
        got = _evaluate(dag, sm.stage_of_node(solver.value), pipe, _STATUS[status], solver.wall_time, warm)
        if hint is not None:
            dp = _evaluate(dag, hint, pipe, got.status, solver.wall_time, warm)
            got = dp if dp.pipeline_time_s < got.pipeline_time_s else got
        return got
    if status == cp_model.UNKNOWN and hint is not None:
        return _evaluate(dag, hint, pipe, "feasible", solver.wall_time, warm)
    if status == cp_model.UNKNOWN:
        raise PlanError(
            f"no assignment of the {n} nodes to {p} stages found within {time_limit_s} s; raise time_limit_s"
        )
    if status == cp_model.INFEASIBLE:
        raise InfeasibleError(_least_overflow(dag, pipe, time_limit_s, num_workers))
    raise RuntimeError(f"the stage model is invalid ({solver.status_name(status)}): {model.validate()}")


def _least_overflow(dag: StageDag, pipe: _Pipeline, time_limit_s: float, num_workers: int) -> str:
    """Why nothing fits: the assignment whose worst stage overflows least, and that stage."""
    # Model, variables and constraints: the stage model; overflow is the largest need − limit over the stages.
    p = pipe.num_stages
    sm = _stage_model(dag, pipe)
    finite = [(mem, limit) for mem, limit in zip(sm.mem_units, sm.limit_units) if limit is not None]
    sizes = (*dag.state_bytes, *dag.act_bytes, *dag.out_bytes, *dag.input_bytes)
    need = sum(math.ceil(x) // sm.unit for x in sizes) * max(pipe.in_flight)
    bound = need + max((abs(limit) for _, limit in finite), default=0)
    overflow = sm.model.new_int_var(-bound, bound, "overflow")
    for mem, limit in finite:
        sm.model.add(mem - limit <= overflow)
    # Objective.
    sm.model.minimize(overflow)
    # Solve.
    solver = _solver(time_limit_s, num_workers)
    status = _solve(solver, sm.model)
    # Read.
    if status not in _STATUS:
        return (
            f"no assignment of the {len(dag)} nodes to {p} non-empty stages keeps the unsendable values "
            "(outputs that are not one tensor) on their readers' stage"
            if status == cp_model.INFEASIBLE
            else f"no assignment of the {len(dag)} nodes to {p} stages fits in memory"
        )
    got = _evaluate(dag, sm.stage_of_node(solver.value), pipe, "", 0.0, "")
    need = [a + b for a, b in zip(got.stage_state_bytes, got.stage_act_bytes)]
    worst = max(range(p), key=lambda s: need[s] - pipe.mem_limit_bytes[s])
    nodes = got.stage_nodes(worst)
    shown = ", ".join(dag.name(v) for v in nodes[:4]) + (f", … ({len(nodes)} nodes)" if len(nodes) > 4 else "")
    held = got.stage_act_bytes[worst] / got.stage_in_flight[worst]
    return (
        f"no assignment of the {len(dag)} nodes to {p} stages fits in memory; the best overflows by "
        f"{fmt_bytes(need[worst] - pipe.mem_limit_bytes[worst])}: stage {worst} ({shown}) needs "
        f"{fmt_bytes(need[worst])} "
        f"(state {fmt_bytes(got.stage_state_bytes[worst])} + {got.stage_in_flight[worst]} micro-batches in flight x "
        f"{fmt_bytes(held)}), limit {fmt_bytes(pipe.mem_limit_bytes[worst])}"
    )


def stage_dag_from_layergraph(
    graph: LayerGraph,
    *,
    batch_size: int,
    time_s: Mapping[str, float],
    act_bytes: Mapping[str, float] | None = None,
    state_bytes: Mapping[str, float] | None = None,
) -> StageDag:
    """The StageDag of a traced model, at micro-batch `batch_size`, for assign_stages.

    Nodes are the graph's operations in linearize's order (placeholders become graph inputs, static values such as
    parameters and what depends on them alone are recomputed by each stage and left out, the output node marks the
    returned values). Edge bytes are the producer's output bytes at `batch_size`; a node whose value is not one
    tensor is unsendable. Profiling is per block, not per node, so the caller gives the per-node figures as
    mappings from fx node name: `time_s` (forward + backward seconds), `act_bytes` (saved for backward),
    `state_bytes` (parameters, gradients and optimizer state of what the node uses: put a shared parameter on its
    first user, as linearize's blocks do). Nodes missing from a mapping count 0; a name that is not one of the
    DAG's nodes raises PlanError.
    """
    order = cut_points(graph).order
    index = {name: i for i, name in enumerate(order)}
    for label, mapping in (("time_s", time_s), ("act_bytes", act_bytes or {}), ("state_bytes", state_bytes or {})):
        unknown = [k for k in mapping if k not in index]
        if unknown:
            raise PlanError(
                f"{label} names {unknown[0]!r}, which is not an operation of the DAG (placeholders, outputs and "
                "static nodes are not)"
            )
    inputs = [nd.name for nd in graph.placeholders]
    input_index = {name: k for k, name in enumerate(inputs)}
    edges: list[tuple[int, int]] = []
    input_edges: list[tuple[int, int]] = []
    outputs: list[int] = []
    for nd in graph.nodes:
        for i in nd.inputs:
            if nd.name in index and i in index:
                edges.append((index[i], index[nd.name]))
            elif nd.name in index and i in input_index:
                input_edges.append((input_index[i], index[nd.name]))
            elif nd.op == "output" and i in index:
                outputs.append(index[i])
    read = {k for k, _ in input_edges}
    return StageDag(
        time_s=tuple(float(time_s.get(name, 0.0)) for name in order),
        state_bytes=tuple(float((state_bytes or {}).get(name, 0.0)) for name in order),
        act_bytes=tuple(float((act_bytes or {}).get(name, 0.0)) for name in order),
        out_bytes=tuple(float(graph.node(name).bytes(batch_size)) for name in order),
        edges=tuple(sorted(set(edges))),
        input_bytes=tuple(
            float(graph.node(name).bytes(batch_size)) if k in read else 0.0 for k, name in enumerate(inputs)
        ),
        input_edges=tuple(sorted(set(input_edges))),
        output_nodes=tuple(sorted(set(outputs))),
        unsendable=tuple(i for i, name in enumerate(order) if not graph.node(name).is_tensor),
        names=tuple(order),
    )


# ---------------------------------------------------------------------------------------------------------------
# B. Checkmate rematerialization of a DAG of blocks
# ---------------------------------------------------------------------------------------------------------------

# One operation of a DAG schedule: ("F", i, "save"|"nosave"), ("B", i), ("free", i) (drops block i's stored output).
Op = tuple[Any, ...]
# (frame, block) pairs: the forwards a frame schedule runs, or the outputs stored into each frame.
_Pairs = set[tuple[int, int]]


@dataclass(frozen=True)
class RematDag:
    """remat.py's memory model for a DAG of blocks in topological order (one micro-batch, seconds and bytes).

    The fields mean what RematChain's do, except grad_bytes[i], the gradient of block i's output (a chain's
    grad_bytes[i + 1]), and preds[i], the blocks whose outputs block i reads (all before i). Blocks without
    predecessors read the graph input, and blocks nobody reads are outputs whose gradient is given: both are
    resident and not counted, as cut 0 and the gradient of cut L are for a chain. Offloading is not modelled.
    """

    fwd_s: tuple[float, ...]
    bwd_s: tuple[float, ...]
    kept_bytes: tuple[float, ...]
    out_bytes: tuple[float, ...]
    fwd_peak_bytes: tuple[float, ...]
    fwd_nosave_peak_bytes: tuple[float, ...]
    bwd_peak_bytes: tuple[float, ...]
    grad_bytes: tuple[float, ...]
    preds: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        n = len(self.fwd_s)
        for name in (
            "bwd_s", "kept_bytes", "out_bytes", "fwd_peak_bytes", "fwd_nosave_peak_bytes", "bwd_peak_bytes",
            "grad_bytes", "preds",
        ):  # fmt: skip
            if len(getattr(self, name)) != n:
                raise PlanError(f"{name} has {len(getattr(self, name))} entries, the DAG has {n} blocks")
        for i, ps in enumerate(self.preds):
            if any(not 0 <= j < i for j in ps) or len(set(ps)) != len(ps):
                raise PlanError(f"block {i} reads {list(ps)}: predecessors must be distinct blocks before it")
        for name in ("fwd_s", "bwd_s", "kept_bytes", "out_bytes", "fwd_peak_bytes", "fwd_nosave_peak_bytes",
                     "bwd_peak_bytes", "grad_bytes"):  # fmt: skip
            for i, x in enumerate(getattr(self, name)):
                if not (math.isfinite(x) and x >= 0):
                    raise PlanError(f"{name}[{i}] must be a finite number >= 0, got {x}")

    def __len__(self) -> int:
        return len(self.fwd_s)

    @property
    def succs(self) -> tuple[tuple[int, ...], ...]:
        out: list[list[int]] = [[] for _ in range(len(self))]
        for i, ps in enumerate(self.preds):
            for j in ps:
                out[j].append(i)
        return tuple(tuple(s) for s in out)

    @staticmethod
    def from_chain(chain: RematChain) -> RematDag:
        """Block i reads block i − 1; its output gradient is the chain's gradient of cut i + 1."""
        n = len(chain)
        default_savers = tuple(((i, i + 1) if i + 1 < n else (i,),) * len(v) for i, v in enumerate(chain.out_values))
        if chain.out_savers != default_savers or not all(chain.saves):
            raise PlanError(
                "the remat ILP does not model which blocks save a value (out_savers) or blocks that save nothing "
                "(saves); it takes chains whose values each block and the next save"
            )
        if chain.checkpoint_s or any(chain.checkpoint_block_s):
            raise PlanError("the remat ILP does not model the cost of a checkpoint (checkpoint_s, checkpoint_block_s)")
        if any(last != i + 1 for i, values in enumerate(chain.out_values) for _, last in values):
            raise PlanError("the remat ILP does not model values live across several cuts (out_values)")
        return RematDag(
            chain.fwd_s, chain.bwd_s, chain.kept_bytes, chain.out_bytes, chain.fwd_peak_bytes,
            chain.fwd_nosave_peak_bytes, chain.bwd_peak_bytes, tuple(chain.grad_bytes[1:]),
            tuple(((i - 1,) if i else ()) for i in range(n)),
        )  # fmt: skip


@dataclass(frozen=True)
class DagReplay:
    """What a DAG schedule costs in the model of replay_dag."""

    time_s: float  # forward (recomputation included) + backward
    peak_bytes: float
    recompute_s: float


@dataclass
class _Replay:
    """What replay_dag has replayed so far: the live objects and their bytes, the peak, the time, the blocks run."""

    dag: RematDag
    succs: tuple[tuple[int, ...], ...]
    live: dict[tuple[str, int], float] = field(default_factory=dict)
    cur: float = 0.0
    peak: float = 0.0
    time_s: float = 0.0
    recompute_s: float = 0.0
    computed: set[int] = field(default_factory=set)
    done: set[int] = field(default_factory=set)

    def has_output(self, j: int) -> bool:
        """Block j's output is live: stored (X) or held by its saved tensors (A)."""
        return ("X", j) in self.live or ("A", j) in self.live

    def add(self, key: tuple[str, int], size: float) -> None:
        """Make an object live."""
        if key in self.live:
            raise ValueError(f"{key} is computed twice without being freed")
        self.live[key] = size
        self.cur += size

    def drop(self, key: tuple[str, int]) -> None:
        """Free a live object."""
        self.cur -= self.live.pop(key)

    def forward(self, op: Op) -> None:
        """F(i, save|nosave): the forward's peak, then A(i) or X(i)."""
        dag, i = self.dag, op[1]
        missing = [j for j in dag.preds[i] if not self.has_output(j)]
        if missing:
            raise ValueError(f"forward of block {i} without the output of block {missing[0]}")
        if op[2] not in ("save", "nosave"):
            raise ValueError(f"unknown forward mode in {op!r}")
        if i in self.computed:
            self.recompute_s += dag.fwd_s[i]
        self.computed.add(i)
        self.time_s += dag.fwd_s[i]
        if op[2] == "save":
            self.peak = max(self.peak, self.cur + dag.fwd_peak_bytes[i])
            self.add(("A", i), dag.kept_bytes[i])
        else:
            self.peak = max(self.peak, self.cur + dag.fwd_nosave_peak_bytes[i])
            self.add(("X", i), dag.out_bytes[i])

    def backward(self, i: int) -> None:
        """B(i): the backward's peak; frees A(i) and G(i), leaves the predecessors' gradients."""
        dag = self.dag
        if ("A", i) not in self.live:
            raise ValueError(f"backward of block {i} without its saved tensors")
        missing = [j for j in dag.preds[i] if not self.has_output(j)]
        if missing:
            raise ValueError(f"backward of block {i} without the output of block {missing[0]}")
        pending = [s for s in self.succs[i] if s not in self.done]
        if pending:
            raise ValueError(f"backward of block {i} before the backward of its successor {pending[0]}")
        if i in self.done:
            raise ValueError(f"backward of block {i} runs twice")
        self.peak = max(self.peak, self.cur - dag.kept_bytes[i] - dag.grad_bytes[i] + dag.bwd_peak_bytes[i])
        self.time_s += dag.bwd_s[i]
        self.drop(("A", i))
        if self.succs[i]:
            self.drop(("G", i))
        for j in dag.preds[i]:
            if ("G", j) not in self.live:
                self.add(("G", j), dag.grad_bytes[j])
        self.done.add(i)

    def free(self, i: int) -> None:
        """free(i): drops X(i), unless a successor's saved tensors still hold it."""
        if ("X", i) not in self.live:
            raise ValueError(f"free of block {i}'s output, which is not stored")
        holders = [s for s in self.succs[i] if ("A", s) in self.live]
        if holders and ("A", i) not in self.live:
            raise ValueError(
                f"free of block {i}'s output while block {holders[0]}'s saved tensors hold it until its backward"
            )
        self.drop(("X", i))


def replay_dag(dag: RematDag, ops: Sequence[Op]) -> DagReplay:
    """Replay a DAG schedule operation by operation; raise ValueError when an operation lacks what it needs.

    remat.py's replay_ops for a DAG (without offload). Live objects: ("X", i) block i's stored output
    (out_bytes), ("A", i) its kept bytes (which hold its output too), ("G", i) the gradient of its output.
      F(i, save|nosave)  needs every predecessor's output (X or A); peak cur + fwd_peak (save) or
                         cur + fwd_nosave_peak; leaves A(i) (save) or X(i).
      B(i)               needs A(i), its predecessors' outputs and, unless i is an output, the gradient of its
                         output, complete once every successor's backward has run; peak cur − kept − grad[i] +
                         bwd_peak (bwd_peak counts the output gradient, resident for an output block); frees A(i)
                         and G(i) and leaves G(j) for each predecessor j that has none yet (a later contribution
                         is accumulated in place, its transient already in bwd_peak).
      free(i)            drops X(i); not while a successor's A holds it as an input (autograd keeps a saved
                         block's inputs until its backward), unless A(i) holds it too.
    Every block's backward runs once, and nothing may be left live at the end. On a chain (RematDag.from_chain,
    chain_ops) this is replay_ops without offload, except that replay_ops allows that free: it accepts schedules
    that drop a saved block's input and recompute it for the backward, which torch cannot run.
    """
    n = len(dag)
    state = _Replay(dag, dag.succs)
    for op in ops:
        kind, i = op[0], op[1]
        if not 0 <= i < n:
            raise ValueError(f"operation {op!r} names a block outside 0..{n - 1}")
        if kind == "F":
            state.forward(op)
        elif kind == "B":
            state.backward(i)
        elif kind == "free":
            state.free(i)
        else:
            raise ValueError(f"unknown operation {op!r}")
    if len(state.done) != n:
        raise ValueError(f"the schedule never runs the backward of block {min(set(range(n)) - state.done)}")
    if state.live:
        raise ValueError(f"the schedule leaves {sorted(state.live)} live")
    return DagReplay(state.time_s, state.peak, state.recompute_s)


def chain_ops(ops: Sequence[Op]) -> list[Op]:
    """A schedule of a chain's DAG (RematDag.from_chain) in remat.py's operations: block i's output is cut i + 1."""
    return [("free", op[1] + 1) if op[0] == "free" else tuple(op) for op in ops]


@dataclass(frozen=True)
class RematSchedule:
    """A rematerialization schedule of a RematDag and what the ILP says it costs."""

    ops: tuple[Op, ...]  # see replay_dag; chain_ops converts a chain's to remat.py's
    time_s: float  # forward (recomputation included) + backward
    recompute_s: float
    peak_bytes: float  # the ILP's own figure: its memory at the worst operation (sizes rounded up to whole bytes)
    budget_bytes: float
    status: str  # "optimal", or "feasible": the best found within the time limit
    solve_time_s: float
    warm_start: str  # the simple schedule that hinted the solver ("no remat", "periodic(k)", ...), "" if none
    forward_count: tuple[int, ...]  # times each block's forward runs


class _Frames:
    """Checkmate's frames for a DAG of n blocks in topological order.

    Frame t < n computes block t's forward (its target) and may recompute blocks before it; frame n + q ends with
    the backward of block n − 1 − q (reverse topological order) and may recompute the blocks not yet backwarded.
    So frame t touches blocks 0..lim(t), lim(t) = t for t < n and 2n − 1 − t after. Within a frame, forwards run in
    block order (position k computes block k) and the backward comes last (position lim(t) + 1).
    """

    def __init__(self, dag: RematDag) -> None:
        self.n = n = len(dag)
        self.count = 2 * n
        succs = dag.succs
        # live_grad[t]: the gradients live during frame t before its backward: G(j) from the first backward of a
        # successor of j (an earlier frame) to the backward of j.
        self.live_grad: list[list[int]] = []
        for t in range(self.count):
            self.live_grad.append(
                [j for j in range(n) if succs[j] and self.b_frame(max(succs[j])) < t <= self.b_frame(j)]
            )

    def lim(self, t: int) -> int:
        return t if t < self.n else 2 * self.n - 1 - t

    def target(self, t: int) -> int | None:
        """The block whose backward ends frame t (None in the forward frames)."""
        return None if t < self.n else 2 * self.n - 1 - t

    def b_frame(self, i: int) -> int:
        return 2 * self.n - 1 - i


def _frame_ops(dag: RematDag, fr: _Frames, save: _Pairs, nosave: _Pairs, stored: _Pairs) -> list[Op]:
    """The operations of a frame schedule ((frame, block) pairs of the saving and non-saving forwards, and of the
    outputs stored into each frame), each output freed right after its last read unless it is stored on."""
    ops: list[Op] = []
    for t in range(fr.count):
        lim, target = fr.lim(t), fr.target(t)
        runs = [k for k in range(lim + 1) if (t, k) in save or (t, k) in nosave]
        steps = [(k, ("F", k, "save" if (t, k) in save else "nosave")) for k in runs]
        if target is not None:
            steps.append((lim + 1, ("B", target)))
        # last_read[j]: the last position of frame t whose operation reads block j's output.
        last_read = {j: k for k, op in steps for j in dag.preds[op[1]]}
        xlive = [j for j in range(lim + 1) if (t, j) in stored]
        for k, op in [(-1, None), *steps]:
            if op is not None:
                ops.append(op)
                xlive += [k] if (t, k) in nosave else []
            gone = [j for j in xlive if (t + 1, j) not in stored and last_read.get(j, -1) <= k]
            ops += [("free", j) for j in gone]
            xlive = [j for j in xlive if j not in gone]
    return ops


def _least_storage(dag: RematDag, fr: _Frames, save: _Pairs, nosave: _Pairs) -> _Pairs:
    """The outputs a frame schedule must store across frames: X(j) enters frame t when a read of j in frame t or
    later finds neither A(j) nor a fresh X(j) (scanning frames backwards)."""
    stored: _Pairs = set()
    for j in range(fr.n):
        with_a = {t for t in range(fr.count) if any((u, j) in save for u in range(t))}
        for t in range(fr.b_frame(j), j, -1):
            lim, target = fr.lim(t), fr.target(t)
            if j > lim or t in with_a or (t, j) in save or (t, j) in nosave:
                continue
            read = any(j in dag.preds[k] and ((t, k) in save or (t, k) in nosave) for k in range(j + 1, lim + 1))
            read = read or (target is not None and j in dag.preds[target])
            if read or (t + 1, j) in stored:
                stored.add((t, j))
    return stored


def periodic_schedule(dag: RematDag, segments: int) -> list[Op]:
    """checkpoint_sequential over the block order (remat.py's `periodic`): `segments` segments of ceil(n/segments)
    blocks, all but the last run without saving in the first pass (what crosses a segment boundary stays stored)
    and recomputed, saving, just before the backward of the segment's last block; the last segment keeps all.
    One segment is no remat; n segments checkpoint every block but the last."""
    save, nosave = _periodic_frames(dag, segments)
    fr = _Frames(dag)
    return _frame_ops(dag, fr, save, nosave, _least_storage(dag, fr, save, nosave))


def _periodic_frames(dag: RematDag, segments: int) -> tuple[_Pairs, _Pairs]:
    """remat.periodic in frames: (frame, block) pairs of the saving and the non-saving forwards."""
    n = len(dag)
    if not 1 <= segments <= n:
        raise PlanError(f"{segments} segments for {n} blocks")
    fr = _Frames(dag)
    size = -(-n // segments)  # checkpoint_sequential's segment size
    checkpointed = [(a, a + size) for a in range(0, n, size) if a + size < n]
    kept_from = checkpointed[-1][1] if checkpointed else 0
    save = {(t, t) for t in range(kept_from, n)}
    nosave = {(t, t) for t in range(kept_from)}
    for a, b in checkpointed:
        save |= {(fr.b_frame(b - 1), k) for k in range(a, b)}
    return save, nosave


def _simple_schedules(dag: RematDag) -> list[tuple[str, _Pairs, _Pairs]]:
    n = len(dag)
    out = []
    for k in range(1, n + 1):
        name = "no remat" if k == 1 else "checkpoint-all" if k == n else f"periodic({k})"
        save, nosave = _periodic_frames(dag, k)
        if all((s, ns) != (save, nosave) for _, s, ns in out):
            out.append((name, save, nosave))
    return out


@dataclass(frozen=True)
class _FrameSchedule:
    """A schedule in frames: the (frame, block) pairs of its saving and non-saving forwards and of the outputs stored
    into each frame; `name` is the simple schedule it is ("no remat", "periodic(k)", ...), "" for the solver's."""

    save: _Pairs
    nosave: _Pairs
    stored: _Pairs
    name: str = ""


@dataclass(frozen=True)
class _RematSizes:
    """The sizes of the remat model in whole bytes (rounded up), and their gcd, the unit of every memory constraint."""

    out: list[int]
    kept: list[int]
    fpeak: list[int]
    npeak: list[int]
    grad: list[int]
    bpeak: list[int]
    unit: int

    @staticmethod
    def of(dag: RematDag) -> _RematSizes:
        """The sizes of a RematDag."""
        succs = dag.succs
        out = [math.ceil(x) for x in dag.out_bytes]
        kept = [math.ceil(x) for x in dag.kept_bytes]
        fpeak = [math.ceil(x) for x in dag.fwd_peak_bytes]
        npeak = [math.ceil(x) for x in dag.fwd_nosave_peak_bytes]
        grad = [math.ceil(x) for x in dag.grad_bytes]
        # The backward's own term: bwd_peak less the output gradient, which is resident for an output block.
        bpeak = [math.ceil(dag.bwd_peak_bytes[i] - (0.0 if succs[i] else dag.grad_bytes[i])) for i in range(len(dag))]
        unit = _byte_unit([*out, *kept, *fpeak, *npeak, *grad, *bpeak])
        return _RematSizes(out, kept, fpeak, npeak, grad, bpeak, unit)


@dataclass
class _RematModel:
    """The CP-SAT model of remat_schedule as _remat_model builds it: the variables by family (see remat_schedule)
    and the sums defined on them. A quantity that may be constant is a _Sum: a tuple of 0/1 variables and integers,
    summed."""

    dag: RematDag
    fr: _Frames
    succs: tuple[tuple[int, ...], ...]
    size: _RematSizes
    model: cp_model.CpModel
    pairs: list[tuple[int, int]]  # (t, j) for every frame t and block j ≤ lim(t)
    save: dict[tuple[int, int], Any]  # [t, j]
    nosave: dict[tuple[int, int], Any]  # [t, j]
    keep_a: dict[tuple[int, int], Any]  # [t, j] for j < t
    keep_x: dict[tuple[int, int], Any]  # [t, j] for j < t
    derived: list[tuple[Any, str, _Sum, _Sum]] = field(default_factory=list)  # (variable, "or" | "and", a, b)
    read: dict[tuple[int, int, int], _Sum] = field(default_factory=dict)  # [t, k, j]
    live: dict[tuple[int, int, int], _Sum] = field(default_factory=dict)  # [t, k, j]: the live_x variables made
    memory: dict[tuple[int, int], _Expr] = field(default_factory=dict)  # [t, k] in units of size.unit bytes

    def ka(self, t: int, j: int) -> _Sum:
        """A(j) is live as frame t starts (nothing before block j's own frame)."""
        return (self.keep_a[t, j],) if (t, j) in self.keep_a else ()

    def kx(self, t: int, j: int) -> _Sum:
        """X(j) is live as frame t starts (nothing before block j's own frame)."""
        return (self.keep_x[t, j],) if (t, j) in self.keep_x else ()

    def has(self, t: int, j: int) -> _Sum:
        """Block j's output is available in frame t: kept, stored, or computed earlier in the frame."""
        return (*self.ka(t, j), *self.kx(t, j), self.save[t, j], self.nosave[t, j])

    def add_computations(self, persistent: bool) -> None:
        """Add what each frame computes: its target, the inputs every forward and backward finds, A(j) from its
        saving forward to B(j), and (persistent) the stored outputs that backward-phase recomputations pin."""
        model, fr, dag, save, nosave = self.model, self.fr, self.dag, self.save, self.nosave
        ka, kx, has = self.ka, self.kx, self.has
        # Constraints: the computations.
        for t, j in self.pairs:
            model.add(sum(has(t, j)) <= 1)
            if t + 1 < fr.count and j <= fr.lim(t + 1):
                # A(j) persists until B(j) consumes it; X(j) persists only if it was live.
                model.add(sum(ka(t + 1, j)) == sum(ka(t, j)) + save[t, j])
                model.add(sum(kx(t + 1, j)) <= sum(kx(t, j)) + nosave[t, j])
        for t in range(fr.count):
            lim, target = fr.lim(t), fr.target(t)
            if target is None:
                model.add(save[t, t] + nosave[t, t] == 1)  # the frame's forward target runs
            else:
                model.add(sum(ka(t, target)) + save[t, target] == 1)  # A(target) is there for its backward
                for j in dag.preds[target]:  # and so are its inputs
                    model.add(sum(has(t, j)) == 1)
            for k in range(lim + 1):
                for j in dag.preds[k]:  # a forward finds its inputs
                    model.add(save[t, k] + nosave[t, k] <= sum(has(t, j)))
                if (t, k) in self.keep_a:
                    for j in dag.preds[k]:  # a saved block's inputs stay (autograd holds them) until its backward
                        model.add(self.keep_a[t, k] <= sum(ka(t, j)) + sum(kx(t, j)))
        if persistent:  # a backward-phase recomputation that reads a stored output pins it until its own backward
            for t, j in self.keep_x:
                for s in self.succs[j] if t >= fr.n else ():
                    for u in range(t + 1, fr.b_frame(s) + 1):
                        model.add(self.keep_x[t, j] + nosave[t, s] - 1 <= self.keep_x[u, j])

    def add_reads(self) -> None:
        """Add read[t, k, j] (X(j) is still read at position ≥ k of frame t, or stored into frame t + 1), and let an
        output be stored or computed without saving only when it is read afterwards."""
        model, fr, dag, save, nosave = self.model, self.fr, self.dag, self.save, self.nosave
        kx, read = self.kx, self.read
        # Constraints: read[t, k, j] for k in j+1..lim+1, from the frame's end backwards.
        for t, j in self.pairs:
            lim, target = fr.lim(t), fr.target(t)
            later: _Sum = (1,) if target is not None and j in dag.preds[target] else kx(t + 1, j)
            read[t, lim + 1, j] = later
            for k in range(lim, j, -1):
                if j in dag.preds[k]:
                    here: _Sum = (save[t, k], nosave[t, k])
                    if _is_one(later):
                        pass
                    elif not later:
                        later = here
                    else:
                        v = model.new_bool_var(f"read[{t},{k},{j}]")
                        model.add(v >= sum(here))
                        model.add(v >= sum(later))
                        model.add(v <= sum(here) + sum(later))
                        self.derived.append((v, "or", here, later))
                        later = (v,)
                read[t, k, j] = later
            # Stored, or computed without saving, only when read afterwards (a forward frame's target runs anyway).
            model.add(sum(kx(t, j)) + (nosave[t, j] if j != t else 0) <= sum(read[t, j + 1, j]))

    def live_x(self, t: int, k: int, j: int) -> _Sum:
        """X(j) is live during position k of frame t."""
        if k <= j:
            return self.kx(t, j)  # stored ones are read after position j (the constraint of add_reads)
        made: _Sum = (*self.kx(t, j), self.nosave[t, j])
        need = self.read[t, k, j]
        if k == j + 1 or _is_one(need):
            return made
        if not need:
            return ()
        if (t, k, j) not in self.live:
            v = self.model.new_bool_var(f"live_x[{t},{k},{j}]")
            self.model.add(v <= sum(made))
            self.model.add(v <= sum(need))
            self.model.add(v >= sum(made) + sum(need) - 1)
            self.derived.append((v, "and", made, need))
            self.live[t, k, j] = (v,)
        return self.live[t, k, j]

    def add_memory(self, budget: int | None) -> None:
        """Add memory[t, k], the memory at every position of every frame, and keep it within the budget (in units
        of size.unit bytes; None: no limit)."""
        fr, succs, save, nosave, ka, live_x = self.fr, self.succs, self.save, self.nosave, self.ka, self.live_x
        out, kept, fpeak, npeak = self.size.out, self.size.kept, self.size.fpeak, self.size.npeak
        grad, bpeak, unit, memory = self.size.grad, self.size.bpeak, self.size.unit, self.memory
        # Constraints: memory[t, k] in byte units, k ≤ lim(t) block k's forward, lim(t) + 1 the frame's backward.
        for t in range(fr.count):
            lim, target = fr.lim(t), fr.target(t)
            grads = sum(grad[j] for j in fr.live_grad[t]) // unit
            for k in range(lim + 1):
                mem = grads + sum(out[j] // unit * sum(live_x(t, k, j)) for j in range(lim + 1))
                mem += sum(kept[j] // unit * sum(ka(t, j)) for j in range(lim + 1))
                mem += sum(kept[j] // unit * save[t, j] for j in range(k))
                memory[t, k] = mem + fpeak[k] // unit * save[t, k] + npeak[k] // unit * nosave[t, k]
            if target is not None:
                mem = grads - (grad[target] // unit if succs[target] else 0) + bpeak[target] // unit
                mem += sum(out[j] // unit * sum(live_x(t, lim + 1, j)) for j in range(lim + 1))
                mem += sum(kept[j] // unit * (sum(ka(t, j)) + save[t, j]) for j in range(lim + 1) if j != target)
                memory[t, lim + 1] = mem
        if budget is not None:
            for mem in memory.values():
                self.model.add(mem <= budget)

    def add_hint(self, warm: _FrameSchedule) -> None:
        """Hint every variable from a frame schedule: the derived ones (read, live_x) from their definitions."""
        values: dict[int, int] = {}
        for group, chosen in ((self.save, warm.save), (self.nosave, warm.nosave), (self.keep_x, warm.stored)):
            for key, var in group.items():
                values[var.index] = int(key in chosen)
        for (t, j), var in self.keep_a.items():
            values[var.index] = int(any((u, j) in warm.save for u in range(t)))

        def value(terms: _Sum) -> int:
            return sum(x if isinstance(x, int) else values[x.index] for x in terms)

        for var, kind, a, b in self.derived:
            values[var.index] = max(value(a), value(b)) if kind == "or" else min(value(a), value(b))
        for group in (self.save, self.nosave, self.keep_a, self.keep_x):
            for var in group.values():
                self.model.add_hint(var, values[var.index])
        for var, *_ in self.derived:
            self.model.add_hint(var, values[var.index])

    def solution(self, solver: cp_model.CpSolver) -> _FrameSchedule:
        """The frame schedule the solver found."""
        return _FrameSchedule(
            save={key for key, var in self.save.items() if solver.boolean_value(var)},
            nosave={key for key, var in self.nosave.items() if solver.boolean_value(var)},
            stored={key for key, var in self.keep_x.items() if solver.boolean_value(var)},
        )

    def peak_bytes(self, solver: cp_model.CpSolver, got: _FrameSchedule) -> float:
        """The model's memory at the worst operation that the solver's schedule runs."""
        fr = self.fr
        ran = [key for key in self.memory if key in got.save or key in got.nosave or key[1] == fr.lim(key[0]) + 1]
        return float(max(solver.value(self.memory[key]) for key in ran) * self.size.unit)


def _remat_model(dag: RematDag, fr: _Frames, budget_bytes: float, persistent: bool) -> _RematModel:
    """Checkmate's model of remat_schedule: its variables, its constraints (the computations, the reads of each
    output, the memory at every position within the budget) and its objective, the forward time."""
    # Data: bytes rounded up (the budget down) in units of their gcd, seconds scaled by a power of two.
    size = _RematSizes.of(dag)
    budget = None if math.isinf(budget_bytes) else math.floor(budget_bytes) // size.unit
    fwd_q = [round(x * _time_scale(fr.count * sum(dag.fwd_s))) for x in dag.fwd_s]

    # Model.
    model = cp_model.CpModel()
    pairs = [(t, j) for t in range(fr.count) for j in range(fr.lim(t) + 1)]

    # Variables. A quantity that may be constant is a _Sum: a tuple of 0/1 variables and integers, summed.
    # save[t, j] / nosave[t, j]: block j's forward runs in frame t, saving (A(j)) or not (X(j)).
    save = {(t, j): model.new_bool_var(f"save[{t},{j}]") for t, j in pairs}
    nosave = {(t, j): model.new_bool_var(f"nosave[{t},{j}]") for t, j in pairs}
    # keep_a[t, j] / keep_x[t, j]: A(j) / X(j) is live as frame t starts (only after block j's own frame).
    keep_a = {(t, j): model.new_bool_var(f"keep_a[{t},{j}]") for t, j in pairs if j < t}
    keep_x = {(t, j): model.new_bool_var(f"keep_x[{t},{j}]") for t, j in pairs if j < t}
    # read[t, k, j] and live_x[t, k, j] are made with their constraints (add_reads, live_x); `derived` records each
    # one's definition (an OR or an AND of two sums), in order, to complete the warm start.
    rm = _RematModel(dag, fr, dag.succs, size, model, pairs, save, nosave, keep_a, keep_x)

    # Constraints.
    rm.add_computations(persistent)
    rm.add_reads()
    rm.add_memory(budget)

    # Objective: the forward time, recomputation included.
    model.minimize(sum(fwd_q[j] * (save[t, j] + nosave[t, j]) for t, j in pairs))
    return rm


def _read_schedule(
    rm: _RematModel, solver: cp_model.CpSolver, status: Any, warm: _FrameSchedule | None, budget_bytes: float
) -> RematSchedule:
    """The solver's schedule as operations, with the ILP's own time and peak, or the warm start's, replayed, when the
    time ran out before the solver reported a solution."""
    dag, fr, n = rm.dag, rm.fr, len(rm.dag)
    if status == cp_model.UNKNOWN and warm is not None:
        got = warm
        ops = _frame_ops(dag, fr, got.save, got.nosave, got.stored)
        peak = replay_dag(dag, ops).peak_bytes
    else:
        got = rm.solution(solver)
        ops = _frame_ops(dag, fr, got.save, got.nosave, got.stored)
        peak = rm.peak_bytes(solver, got)
    runs = [j for _, j in (*got.save, *got.nosave)]
    count = tuple(runs.count(j) for j in range(n))
    fwd = sum(dag.fwd_s[j] * count[j] for j in range(n))
    return RematSchedule(
        ops=tuple(ops),
        time_s=fwd + sum(dag.bwd_s),
        recompute_s=fwd - sum(dag.fwd_s),
        peak_bytes=peak,
        budget_bytes=budget_bytes,
        status=_STATUS.get(status, "feasible"),
        solve_time_s=solver.wall_time,
        warm_start="" if warm is None else warm.name,
        forward_count=count,
    )


def remat_schedule(
    dag: RematDag,
    *,
    budget_bytes: float,
    time_limit_s: float = 10.0,
    num_workers: int = 2,
    warm_start: bool = True,
    persistent: bool = True,
) -> RematSchedule:
    """The fastest rematerialization schedule of `dag` whose peak fits in `budget_bytes` (Checkmate's ILP).

    Jain et al. 2020, "Checkmate: breaking the memory wall with optimal tensor rematerialization", on the memory
    model of remat.py generalized to a DAG (see replay_dag; offload is not modelled). Checkmate's frames
    (_Frames): frame t < n computes block t's forward, frame n + q ends with the backward of block n − 1 − q; the
    forwards a frame runs go in block order and the backward last. So the order of the targets is fixed (the
    blocks' order, then its reverse); everything else is free. Variables per frame t and block j ≤ lim(t):
      save[t, j], nosave[t, j]   block j's forward runs in frame t, saving (leaves A(j)) or not (leaves X(j));
      keep_a[t, j], keep_x[t, j] A(j) or X(j) is live as frame t starts (Checkmate's S, one per kind of value);
      read[t, k, j]              X(j) is still read at position ≥ k of frame t or stored into frame t + 1 (an OR,
                                 defined exactly);
      live_x[t, k, j]            X(j) is live during position k: made before k (stored, or nosave earlier in the
                                 frame) and read[t, k, j] (an AND, defined exactly). These are Checkmate's eager
                                 frees: every stored output is freed right after its last read.
    Constraints: each frame's target runs; a forward or backward finds its inputs (stored or computed earlier in
    the frame); A(j) lives from its saving forward to B(j), which consumes it, so each block saves exactly once,
    and while it lives the inputs of block j stay too (autograd holds a saved block's inputs); at most one of
    keep_a, keep_x, save, nosave per (t, j), and an output is stored or recomputed without saving only when read
    afterwards (anything else wastes memory or time: every schedule has such a canonical form); the memory at
    every position is at most the budget: stored outputs + kept bytes + the gradients live in that frame (fixed
    by the backward order) + the forward's transient peak, or at the backward cur − kept − grad + bwd_peak as in
    remat.py. Objective: the forward time, recomputation included (the backward is a constant). Bytes are rounded
    up to whole bytes (the budget down), seconds scaled by a power of two. The fastest simple schedule that fits
    (no remat, periodic(k), checkpoint-all) warm-starts it.

    persistent=True (the default) adds the rule of nested checkpointing: a recomputation in the backward phase
    that reads a stored output without saving keeps that output stored until its own backward (a checkpointed
    region holds its inputs until its backward is done). On a chain this is exactly the space of remat.py's tree
    plans (the tests check the optimum against every tree plan). persistent=False searches every schedule of the
    model, which can be faster than any tree plan (the tests show one) but needs an executor that can drop a
    checkpoint and rebuild it from an earlier one.

    Returns the best schedule found within time_limit_s and its operations, which replay_dag replays to the same
    time and peak; raises InfeasibleError when no schedule with this order of targets fits, PlanError when none
    was found in time.
    """
    # Data.
    n = len(dag)
    if n == 0:
        raise PlanError("a remat schedule needs at least one block")
    if not budget_bytes >= 0:
        raise PlanError(f"budget_bytes must be >= 0, got {budget_bytes}")
    fr = _Frames(dag)
    if max(need for need, _ in _op_lower_bounds(dag, fr)) > budget_bytes:
        raise InfeasibleError(_no_fit_message(dag, fr, budget_bytes))
    warm = _best_simple(dag, fr, budget_bytes) if warm_start else None

    # Model, variables, constraints and objective (see _remat_model), and the warm start.
    rm = _remat_model(dag, fr, budget_bytes, persistent)
    if warm is not None:
        rm.add_hint(warm)

    # Solve.
    solver = _solver(time_limit_s, num_workers)
    status = _solve(solver, rm.model)

    # Read the result into operations, with the ILP's own time and peak (or the warm start's, replayed, when the
    # time ran out before the solver reported a solution).
    if status == cp_model.INFEASIBLE:
        raise InfeasibleError(_no_fit_message(dag, fr, budget_bytes))
    if status == cp_model.UNKNOWN and warm is None:
        raise PlanError(f"no schedule of the {n} blocks found within {time_limit_s} s; raise time_limit_s")
    if status not in _STATUS and status != cp_model.UNKNOWN:
        raise RuntimeError(f"the remat model is invalid ({solver.status_name(status)}): {rm.model.validate()}")
    return _read_schedule(rm, solver, status, warm, budget_bytes)


def _best_simple(dag: RematDag, fr: _Frames, budget_bytes: float) -> _FrameSchedule | None:
    """The fastest simple schedule (no remat, periodic(k), checkpoint-all) whose peak fits, for the warm start."""
    best: tuple[float, _FrameSchedule] | None = None
    for name, save, nosave in _simple_schedules(dag):
        simple = _FrameSchedule(save, nosave, _least_storage(dag, fr, save, nosave), name)
        got = replay_dag(dag, _frame_ops(dag, fr, simple.save, simple.nosave, simple.stored))
        if got.peak_bytes <= budget_bytes and (best is None or got.time_s < best[0]):
            best = (got.time_s, simple)
    return None if best is None else best[1]


def _op_lower_bounds(dag: RematDag, fr: _Frames) -> list[tuple[float, str]]:
    """A lower bound on the memory of each block's backward and saving forward, whatever the schedule: the
    operation's own peak, its inputs and (for the backward) the gradients its frame holds."""
    succs = dag.succs
    bounds = []
    for i in range(len(dag)):
        inputs = sum(min(dag.out_bytes[j], dag.kept_bytes[j]) for j in dag.preds[i])
        grads = sum(dag.grad_bytes[j] for j in fr.live_grad[fr.b_frame(i)] if j != i)
        own = dag.bwd_peak_bytes[i] - (0.0 if succs[i] else dag.grad_bytes[i])
        bounds.append((inputs + grads + own, f"block {i}'s backward"))
        bounds.append((inputs + dag.fwd_peak_bytes[i], f"block {i}'s saving forward"))
    return bounds


def _no_fit_message(dag: RematDag, fr: _Frames, budget_bytes: float) -> str:
    need, what = max(_op_lower_bounds(dag, fr), key=lambda bound: bound[0])
    head = f"no rematerialization schedule of the {len(dag)} blocks fits in {fmt_bytes(budget_bytes)}"
    if need > budget_bytes:
        return f"{head}: {what} alone needs at least {fmt_bytes(need)} (its peak, its inputs and the live gradients)"
    return (
        f"{head}: the ILP proves it for this order of the blocks, though no single operation needs more than "
        f"{fmt_bytes(need)} ({what})"
    )
