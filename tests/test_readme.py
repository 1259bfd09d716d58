"""Every example in README.md runs: its ```sh commands, with the files its ```python and ```toml blocks define.

The Quick start block is left to `.ci/run`, which runs it from a clean clone. A command that cannot run here ends
with a marker comment and is skipped: `# needs a GPU`, `# benchmark: ...` (scripts under benchmarks/ take minutes),
`# installs: ...` (pip) and `# needs the sanitizer build ...`; the test checks that exactly those are skipped, and
that they are few. A ```python or ```toml block starts with `# FILE`, the name it is written to before any command
runs. The commands run in a temporary directory holding a copy of examples/, with pyplan's cache there too: the
tour's block first, then the other blocks in two shells at once (a block may use what the tour and its own earlier
lines wrote, nothing else), so that the file takes about a minute on 2 cores.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

# Trailing comments that mark a command the test does not run, and what each kind is.
SKIP_MARKERS = {
    "# needs a GPU": "gpu",
    "# benchmark:": "benchmark",
    "# installs:": "pip",
    "# needs the sanitizer build": "sanitizer",
}
MIN_EXECUTED = 15
LANE_TIMEOUT_S = 300

_FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
_FILE_LINE = re.compile(r"^# ([\w.-]+\.(?:py|toml|json))$")
# A file of the repository the README names (not one under ~/.cache/pyplan/), and a Python name under pyplan.
_REPO_PATH = re.compile(r"(?<![\w./~$-])(?:pyplan|tests|cpp|benchmarks|examples|bindings)/[\w./-]*[\w/]")
_PYTHON_NAME = re.compile(r"(?<![\w./~$-])pyplan(?:\.[A-Za-z_]\w*)+")


@dataclass
class Block:
    language: str
    heading: str
    lines: list[str]


def readme_blocks(text: str) -> list[Block]:
    """The fenced blocks of a markdown text, in order, each under the heading it follows."""
    blocks: list[Block] = []
    heading = ""
    current: Block | None = None
    indent = 0
    for line in text.splitlines():
        fence = _FENCE.match(line)
        if current is None:
            if fence:
                indent = len(fence.group(1))
                current = Block(fence.group(2), heading, [])
            elif line.startswith("#"):
                heading = line.lstrip("#").strip()
        elif fence and not fence.group(2):
            blocks.append(current)
            current = None
        else:
            current.lines.append(line[indent:] if line[:indent].isspace() else line)
    assert current is None, f"README.md: a ```{current.language} block under '{current.heading}' is never closed"
    return blocks


def commands(block: Block) -> list[str]:
    """The commands of a shell block: continuation lines joined, blank and comment lines left out."""
    out: list[str] = []
    pending = ""
    for line in block.lines:
        text = line.strip()
        if not pending and (not text or text.startswith("#")):
            continue
        if text.endswith("\\"):
            pending += text[:-1].rstrip() + " "
            continue
        out.append(pending + text)
        pending = ""
    assert not pending, f"README.md: a command under '{block.heading}' ends with a continuation: {pending}"
    return out


def skip_kind(command: str) -> str | None:
    kinds = [kind for marker, kind in SKIP_MARKERS.items() if marker in command]
    assert len(kinds) <= 1, f"README.md: more than one skip marker on: {command}"
    return kinds[0] if kinds else None


def _shell_script(directory: Path, commands: list[str]) -> str:
    """A bash script that runs `commands` in order, echoing each, and stops at the first that fails."""
    lines = [
        "set -u",
        f"cd {shlex.quote(str(directory))}",
        'run() { printf "+ %s\\n" "$1"; eval "$1" || { printf "README command failed (exit %d): %s\\n" "$?" "$1"; '
        "exit 1; }; }",
    ]
    lines += [f"run {shlex.quote(c)}" for c in commands]
    return "\n".join(lines) + "\n"


def _start(directory: Path, name: str, commands: list[str], env: dict[str, str]) -> tuple[subprocess.Popen, Path]:
    script = directory / f"{name}.sh"
    script.write_text(_shell_script(directory, commands))
    log = directory / f"{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            ["bash", str(script)], stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
            start_new_session=True,
        )  # fmt: skip
    return proc, log


def _finish(started: list[tuple[subprocess.Popen, Path]]) -> list[str]:
    """Wait for the shells, all of them even when one fails; fail naming the command that failed, with the end of its
    shell's output."""
    for proc, _ in started:
        try:
            proc.wait(timeout=LANE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    outputs = [log.read_text(errors="replace") for _, log in started]
    for (proc, _), output in zip(started, outputs):
        if proc.returncode != 0:
            commands_begun = [line for line in output.splitlines() if line.startswith("+ ")]
            last = commands_begun[-1][2:] if commands_begun else "(none begun)"
            reason = "timed out" if proc.returncode == -signal.SIGKILL else f"exit {proc.returncode}"
            tail = output[-4000:]
            pytest.fail(f"README command failed ({reason}): {last}\n--- the output's last 4,000 characters ---\n{tail}")
    return outputs


def test_readme_blocks_are_well_formed() -> None:
    blocks = readme_blocks(README.read_text())
    quick = [b for b in blocks if b.heading == "Quick start"]
    assert [b.language for b in quick] == ["sh"], "README.md: the Quick start section holds one ```sh block"
    for b in blocks:
        assert b.language in ("sh", "python", "toml", "text"), f"README.md: a ```{b.language} block: use sh or text"
        if b.language in ("python", "toml"):
            assert b.lines and _FILE_LINE.match(b.lines[0]), (
                f"README.md: a ```{b.language} block under '{b.heading}' must start with '# FILE'"
            )


def test_readme_names_what_exists() -> None:
    """Every file of the repository and every pyplan module, function or class the README names exists."""
    text = README.read_text()
    missing = sorted({p for p in _REPO_PATH.findall(text) if not (ROOT / p).exists()})
    assert not missing, f"README.md names files that do not exist: {missing}"
    unknown = []
    for name in sorted(set(_PYTHON_NAME.findall(text))):
        parts = name.split(".")
        obj = importlib.import_module(parts[0])
        for i, part in enumerate(parts[1:], start=2):
            try:
                obj = getattr(obj, part) if hasattr(obj, part) else importlib.import_module(".".join(parts[:i]))
            except ImportError:
                unknown.append(name)
                break
    assert not unknown, f"README.md names what pyplan does not have: {unknown}"


@pytest.mark.distributed
def test_readme_examples_run(tmp_path: Path) -> None:
    blocks = readme_blocks(README.read_text())
    files = [b for b in blocks if b.language in ("python", "toml")]
    shell = [b for b in blocks if b.language == "sh" and b.heading != "Quick start"]

    runs: list[list[str]] = []
    skipped: dict[str, list[str]] = {kind: [] for kind in SKIP_MARKERS.values()}
    for block in shell:
        mine = []
        for c in commands(block):
            kind = skip_kind(c)
            if kind is None:
                mine.append(c)
            else:
                skipped[kind].append(c)
        if mine:
            runs.append(mine)
    executed = sum(len(r) for r in runs)

    # Only commands that cannot run here are skipped, and they are few.
    for c in skipped["benchmark"]:
        script = re.match(r"python3? (benchmarks/\w+\.py)\b", c)
        assert script and (ROOT / script.group(1)).is_file(), f"a benchmark line that runs no benchmark: {c}"
    for c in skipped["pip"]:
        assert re.match(r"(python3 -m )?pip install ", c), f"an installs line that installs nothing: {c}"
    assert len(skipped["gpu"]) <= 3, skipped["gpu"]
    assert len(skipped["sanitizer"]) <= 1, skipped["sanitizer"]
    for r in runs:
        for c in r:
            assert not re.match(r"python3? benchmarks/", c), f"a benchmark without '# benchmark:': {c}"
            assert "pip install" not in c, f"a pip line without '# installs:': {c}"
    assert executed >= MIN_EXECUTED, f"only {executed} README commands would run"

    for b in files:
        name = _FILE_LINE.match(b.lines[0]).group(1)
        assert not (tmp_path / name).exists(), f"README.md: two blocks write {name}"
        (tmp_path / name).write_text("\n".join(b.lines) + "\n")
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYPLAN_CACHE_DIR": str(tmp_path / "cache"),
        "MPLCONFIGDIR": str(tmp_path / "matplotlib"),
        "HF_HOME": str(tmp_path / "huggingface"),
        "HF_HUB_OFFLINE": "1",
    }

    # The tour first; then the other blocks in two shells, each block whole in one, the shells about even.
    tour, rest = runs[0], runs[1:]
    outputs = _finish([_start(tmp_path, "tour", tour, env)])
    lanes: list[list[str]] = [[], []]
    for r in rest:
        min(lanes, key=len).extend(r)
    outputs += _finish([_start(tmp_path, f"lane{i}", lane, env) for i, lane in enumerate(lanes) if lane])

    output = "\n".join(outputs)
    assert sum(line.startswith("+ ") for line in output.splitlines()) == executed
    # What the README says the tour and the examples write.
    assert "step 1 loss" in outputs[0] and "median step" in outputs[0], outputs[0][-2000:]
    for name in ("plan.json", "train.py", "schedule.svg", "report.html", "results.csv", "torchtitan.sh"):
        assert (tmp_path / name).is_file(), f"no {name} after the README's commands"
    assert "plan" in json.loads((tmp_path / "weighted.json").read_text())
