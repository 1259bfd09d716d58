"""The capture limit of `pyplan plan` and `pyplan inspect`: the model's own code within a time, or one line saying
what did not return.

Capturing a model runs its code: the model file's import, `model()`, `example_inputs(b)` and, under torch.export,
the forward. Code that never returns (a loop, a wait for a lock or a socket) would hang the command; under the limit
each of these steps gets `PYPLAN_CAPTURE_TIMEOUT` seconds (default 600; 0: no limit), after which the command ends
with one line naming the step, and exit status 2.

The clock is SIGALRM (setitimer): its handler raises in the main thread at the next bytecode, and interrupts a
sleep, a wait for a lock or a blocking read; a long call into C code that holds the GIL is interrupted when it
returns. What it raises is a BaseException, so that the model's `except Exception:` does not swallow it, and it is
raised again every second past the limit, in case the model's code catches it anyway.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from types import FrameType
from typing import Any, TypeVar

from pyplan.errors import PlanError
from pyplan.spec import ModelSpec

__all__ = ["CAPTURE_TIMEOUT_ENV", "DEFAULT_CAPTURE_TIMEOUT_S", "CaptureLimit", "capture_timeout_s"]

CAPTURE_TIMEOUT_ENV = "PYPLAN_CAPTURE_TIMEOUT"
DEFAULT_CAPTURE_TIMEOUT_S = 600.0
# The largest limit taken (about 31 years), so that the timer's arithmetic stays in range.
MAX_CAPTURE_TIMEOUT_S = 1e9
# The step `pyplan.search` reports (its `progress`) while it traces and profiles the model.
TRACING_STEP = "tracing and profiling"

T = TypeVar("T")


def capture_timeout_s(environ: Mapping[str, str] = os.environ) -> float | None:
    """The limit `PYPLAN_CAPTURE_TIMEOUT` sets in seconds (unset: the default; 0: None, no limit); one line for a
    value that is not a number of seconds."""
    text = environ.get(CAPTURE_TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_CAPTURE_TIMEOUT_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not 0 <= seconds <= MAX_CAPTURE_TIMEOUT_S:
        raise PlanError(
            f"{CAPTURE_TIMEOUT_ENV} takes the seconds the model's code may take in each capture step, from 0 (no "
            f"limit) to 1e9; got '{text}'"
        )
    return seconds or None


class _Expired(BaseException):
    """Raised in the main thread when a step is past its limit."""


class _TimedOut(PlanError):
    """A step past its limit, in one line (raised through the steps around it as it is)."""


@dataclass
class _Step:
    what: str  # the step in words: "model() of model.py"
    ends: str  # how the message says it did not end: "did not return"
    deadline: float  # time.monotonic()


class CaptureLimit:
    """The capture steps of one command's model (`ref` as given on the command line) within `seconds` each (None: no
    limit). Steps nest (tracing calls example_inputs): the innermost one is named, and none ends later than the one
    around it. Outside the main thread, or where SIGALRM is missing or taken, nothing is limited."""

    def __init__(self, ref: str, seconds: float | None) -> None:
        self.ref = ref
        self.seconds = seconds
        self._steps: list[_Step] = []
        self._before: Any = None
        self._expired: _Step | None = None

    @classmethod
    def from_env(cls, ref: str) -> CaptureLimit:
        """The limit `PYPLAN_CAPTURE_TIMEOUT` sets (`capture_timeout_s`) for the model `ref`."""
        return cls(ref, capture_timeout_s())

    def _usable(self) -> bool:
        return (
            self.seconds is not None
            and hasattr(signal, "setitimer")
            and threading.current_thread() is threading.main_thread()
            and (bool(self._steps) or signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, None))
        )

    @contextlib.contextmanager
    def step(self, what: str, ends: str = "did not finish") -> Iterator[None]:
        """The block as one step: past the limit it ends with PlanError "{what} {ends} within N s, the capture
        limit; ..."."""
        if not self._usable():
            yield
            return
        assert self.seconds is not None
        deadline = time.monotonic() + self.seconds
        if self._steps:
            deadline = min(deadline, self._steps[-1].deadline)
        else:
            self._before = signal.signal(signal.SIGALRM, self._on_alarm)
        self._steps.append(_Step(what, ends, deadline))
        self._arm()
        try:
            yield
        except BaseException as exc:
            expired = self._expired
            if expired is None or isinstance(exc, _TimedOut):
                raise
            raise _TimedOut(self._message(expired)) from (None if isinstance(exc, _Expired) else exc)
        finally:
            self._steps.pop()
            if self._steps:
                self._arm()
            else:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, self._before)
                self._expired = None

    def _arm(self) -> None:
        """The timer set to the innermost step's deadline, then every second past it."""
        left = self._steps[-1].deadline - time.monotonic()
        signal.setitimer(signal.ITIMER_REAL, max(left, 1e-3), 1.0)

    def _on_alarm(self, signum: int, frame: FrameType | None) -> None:
        if self._steps and time.monotonic() >= self._steps[-1].deadline:
            self._expired = self._expired or self._steps[-1]
            raise _Expired

    def _message(self, step: _Step) -> str:
        return (
            f"{step.what} {step.ends} within {self.seconds:g} s, the capture limit; if it needs longer, set "
            f"{CAPTURE_TIMEOUT_ENV}=SECONDS (0: no limit)"
        )

    def _calls(self, fn: Callable[..., T], what: Callable[..., str]) -> Callable[..., T]:
        """`fn`, each call of it a step named by `what(*args)`."""

        def limited(*args: Any, **kwargs: Any) -> T:
            with self.step(what(*args), "did not return"):
                return fn(*args, **kwargs)

        return limited

    def spec(self, spec: ModelSpec) -> ModelSpec:
        """`spec` with each call of its builder and of `example_inputs` a step."""
        name = self._file_name()
        if name:
            builder = spec.name.partition(":")[2] or "model"
            built, owner = f"{builder}() of {name}", f" of {name}"
        else:
            built, owner = f"building {self.ref}", f" of {self.ref}"
        return replace(
            spec,
            build=self._calls(spec.build, lambda: built),
            example_inputs=self._calls(
                spec.example_inputs, lambda *args: f"example_inputs({', '.join(map(str, args))}){owner}"
            ),
        )

    def importing(self) -> contextlib.AbstractContextManager[None]:
        """Importing the model file as a step (a zoo, hf: or timm: reference imports none of the user's code)."""
        name = self._file_name()
        return self.step(f"importing {name}") if name else contextlib.nullcontext()

    def tracing(self) -> contextlib.AbstractContextManager[None]:
        """Tracing the model (torch.export runs its forward) as a step."""
        return self.step(f"tracing {self._file_name() or self.ref} (its forward under torch.export)")

    @contextlib.contextmanager
    def searching(self, say: Callable[[str], None]) -> Iterator[Callable[[str], None]]:
        """Around `pyplan.search`: its `progress` callback, `say` wrapped so that its step "tracing and profiling"
        is a step of the limit, until the next step it reports or the end of the block."""
        tracing = contextlib.ExitStack()

        def told(step: str) -> None:
            tracing.close()
            if step == TRACING_STEP:
                subject = self._file_name() or self.ref
                tracing.enter_context(self.step(f"tracing and profiling {subject} (its forward under torch.export)"))
            say(step)

        with tracing:  # an exception from the search passes through the step still open
            yield told

    def _file_name(self) -> str:
        """The model file's name where `ref` names one (model.py, model.py:builder), else ""."""
        if self.ref.startswith(("zoo:", "hf:", "timm:")):
            return ""
        path = self.ref.partition(":")[0] if self.ref.count(":") == 1 and not os.path.exists(self.ref) else self.ref
        return os.path.basename(path)
