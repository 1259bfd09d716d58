"""Probes that each need a process of their own, run from one: it imports what they share once, then forks a child
per probe, which starts from that untouched state as a new process would, without importing torch again (2-3 s a
process on 2 cores)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

_RUNNER = """
import json, os, sys
{setup}
for env in json.loads(sys.argv[1]):
    pid = os.fork()
    if pid == 0:
        try:
            os.environ.clear()
            os.environ.update(env)
{body}
            print(json.dumps(result), flush=True)
        except BaseException:
            import traceback
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"the probe under {{env}} failed")
"""


def forked_probes(setup: str, body: str, envs: list[dict[str, str]]) -> list[dict]:
    """Run `body` (which sets `result`, a JSON-able value) once per environment in `envs`, each in a child forked
    from one process that ran `setup`; the results in the order of `envs`. A child reads the environment it is given
    through os.environ, so `setup` must not read what differs between them."""
    indented = "\n".join(f"            {line}" for line in body.strip().splitlines())
    script = _RUNNER.format(setup=setup.strip(), body=indented)
    out = subprocess.run(
        [sys.executable, "-c", script, json.dumps(envs)],
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=60 + 60 * len(envs),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) >= len(envs), out.stdout[-3000:]
    return [json.loads(line) for line in lines[-len(envs) :]]
