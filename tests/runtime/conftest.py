"""One torchrun launch per world size for the tests that read one (tests/runtime/_launch.py runs its parts).

A test module names the parts its tests read in `LAUNCH_PARTS`, as (world size, script); a test that takes the
`launches` fixture reads them with `launches.part(world, script)`. The first such call of a world size launches every
part of that size that this session's selected tests read, in one process group: each launch costs 7-10 s of
start-up on 2 cores (TORCH_FACTS.md). pytest's --durations charges a launch to the first test that reads it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

LAUNCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_launch.py")
# The order of the parts within a launch: the short ones first.
ORDER = ("_recv_buffers", "test_zero3_views", "_zero_state", "_expert_parallel", "_tensor_parallel", "_transparency")
PART_TIMEOUT_S = 900


@dataclass(frozen=True)
class Part:
    """What one part of a launch left: rank 0's results (absent if the part did not finish), the error records of
    the ranks that failed, and the end of the launch's stderr."""

    path: Path
    errors: tuple[Path, ...]
    stderr: str

    def results(self) -> list | dict:
        """The part's results; fails the test with the first failed record, or with the launch's stderr when the
        part left neither results nor errors."""
        if self.errors:
            bad = [r for f in self.errors for r in json.loads(f.read_text()) if not r["ok"]]
            pytest.fail(f"a configuration failed: {bad[0] if bad else self.errors[0].read_text()}\n{self.stderr}")
        assert self.path.exists(), self.stderr
        return json.loads(self.path.read_text())


class Launches:
    """The launches of this session, one per world size, each made on first use."""

    def __init__(self, session: pytest.Session, factory: pytest.TempPathFactory) -> None:
        self._factory = factory
        self._parts: dict[tuple[int, str], Part] = {}
        self._wanted: set[tuple[int, str]] = set()
        for item in session.items:
            if "launches" not in getattr(item, "fixturenames", ()):
                continue
            callspec = getattr(item, "callspec", None)
            world = callspec.params.get("world") if callspec is not None else None
            parts = getattr(item.module, "LAUNCH_PARTS", None)
            assert parts is not None, f"{item.nodeid} reads a launch: its module must name LAUNCH_PARTS"
            self._wanted |= {(w, p) for w, p in parts if world in (None, w)}

    def part(self, world: int, script: str) -> Part:
        if (world, script) not in self._parts:
            self._launch(world, sorted({p for w, p in self._wanted if w == world} | {script}, key=ORDER.index))
        return self._parts[(world, script)]

    def _launch(self, world: int, parts: list[str]) -> None:
        """Launch `parts` on `world` ranks; after a part that failed, launch the parts it kept from running."""
        while parts:
            folder = self._factory.mktemp(f"launch{world}")
            done = subprocess.run(
                [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), LAUNCH, str(folder),
                 *parts],
                capture_output=True,
                text=True,
                timeout=PART_TIMEOUT_S * len(parts),
            )  # fmt: skip
            left = []
            for p in parts:
                path = folder / f"{p}.json"
                errors = tuple(sorted(folder.glob(f"{p}.json.rank*.error")))
                if path.exists() or errors:
                    self._parts[(world, p)] = Part(path, errors, done.stderr[-3000:])
                else:
                    left.append(p)
            if len(left) == len(parts):  # no part finished nor failed: the launch itself did
                for p in parts:
                    self._parts[(world, p)] = Part(folder / f"{p}.json", (), done.stderr[-3000:])
                return
            parts = left


@pytest.fixture(scope="session")
def launches(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Launches:
    return Launches(request.session, tmp_path_factory)
