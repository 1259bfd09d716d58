"""Planning never imports torch._dynamo (1.3 s of CPU): torch's functions marked for torch.compile to skip are
called as they are while it plans, and marked again once it is done, so that torch.compile works after it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The `pyplan` command's own entry, in a process that then compiles a function that calls torch's marked functions.
_CHILD = textwrap.dedent(
    """
    import sys
    from _pyplan_start import main
    import pyplan
    import torch
    from pyplan._torch import meta_build

    sys.argv = ["pyplan", "plan", "zoo:gpt-tiny", "--gpus", "2", "--gpu", "a100-80g", "--global-batch", "8",
                "--precision", "bf16-mixed", "--remat", "auto", "--json"]
    assert main() == 0
    print("dynamo after the command:", "torch._dynamo" in sys.modules, file=sys.stderr)
    spec = pyplan.zoo.get("gpt-tiny")
    with meta_build():  # as the command builds a model
        model = spec.build()
    cluster = pyplan.Cluster.from_catalog("a100-80g", 2)
    pyplan.plan(model, spec.example_inputs, cluster, pyplan.Workload(global_batch=8, precision="bf16-mixed"))
    print("dynamo after the library:", "torch._dynamo" in sys.modules, file=sys.stderr)
    from pyplan._torch import _DYNAMO_SKIPS

    found = _DYNAMO_SKIPS.functions
    left = sum(f.__dict__.get("__dynamo_disable") is f for f in found)
    print("found", len(found), "left as themselves", left, file=sys.stderr)
    f = torch.compile(lambda x: torch.nn.functional.dropout(x, 0.5, True).sum() + 1, backend="eager")
    print("compiled", float(f(torch.zeros(4))), file=sys.stderr)
    """
)


def test_planning_does_not_import_dynamo_and_compiling_after_it_works() -> None:
    env = {**os.environ, "PYTHONPATH": ROOT}
    done = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stderr.splitlines()
    assert "dynamo after the command: False" in lines
    assert "dynamo after the library: False" in lines
    found = next(line for line in lines if line.startswith("found ")).split()
    assert int(found[1]) > 100 and found[-1] == "0"  # torch 2.13 marks about 290; none is left unmarked
    assert "compiled 1.0" in lines
