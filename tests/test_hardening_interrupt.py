"""Ctrl-C at any moment of `pyplan`, torch still importing included: the line "interrupted" and exit status 130,
never a traceback.

The command runs as pip's console script runs it, from the entry point pyproject.toml names (the installed script
is regenerated only by a reinstall), and sends itself SIGINT as a chosen module begins to import."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# pip's console script (its template), after a hook that sends SIGINT to this process when the module AT (the first
# argument) begins to import, under SIGINT as an interactive shell leaves it.
SCRIPT = """
import os
import signal
import sys

signal.signal(signal.SIGINT, signal.default_int_handler)
AT = sys.argv.pop(1)


def at_import(event, args):
    if event == "import" and args[0] == AT:
        os.kill(os.getpid(), signal.SIGINT)


sys.addaudithook(at_import)
import re
from {module} import {function}
if __name__ == '__main__':
    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])
    sys.exit({function}())
"""

# A model file that imports a module of its own (beside it, empty): SIGINT at that import comes while the command
# runs.
MODEL = """
import chosen_point

import torch
from torch import nn


def model():
    return nn.Linear(8, 8)


def example_inputs(batch_size):
    return (torch.randn(batch_size, 8),)
"""


def _console_script() -> str:
    entry = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["pyplan"]
    module, function = entry.split(":")
    return SCRIPT.format(module=module, function=function)


@pytest.mark.parametrize(
    "at",
    [
        "torch",  # the first import of torch, as `import pyplan` begins it
        "torch.nn",  # deep inside torch's import
        "pyplan.cli.calibrate",  # the command's own modules, torch imported
        "rich.progress",  # the last of the command's imports
        "chosen_point",  # the command running: the model file importing
    ],
)
def test_ctrl_c_at_any_moment_ends_with_one_line_and_130(tmp_path: Path, at: str) -> None:
    (tmp_path / "model.py").write_text(MODEL)
    (tmp_path / "chosen_point.py").write_text("")
    done = subprocess.run(
        [sys.executable, "-c", _console_script(), at, "plan", "model.py", "--gpus", "2", "--gpu", "a100-80g"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        cwd=tmp_path,
    )
    assert (done.returncode, done.stderr, done.stdout) == (130, "interrupted\n", ""), done.stderr[-3000:]
