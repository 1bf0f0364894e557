"""Run one test in a new interpreter: for tests whose library leaves process-wide state behind
(``torch.compile``: dynamo's caches and frame hooks), so that later tests in the same process,
above all the gc-off weak-reference lifetime referees, judge only what they run themselves.

After a wrapper compiled with ``aot_eager`` around an installed model
(``test_adversary_recipes3.py::test_compile_of_a_module_holding_the_installed_model``) ran in
the process, dynamo's caches keep its fake tensors (``torch.fx`` nodes' ``meta['val']``) for the
process. They were never the engine's: the uninstall referee watched every tensor without a
storage pointer that was alive before its run, and counted those (20 per step); it now excludes
them (``tests/test_memory_lifetime.py::_Walk``, issue 31), and the three tests pass in-process
before the referee too. The isolation stays: dynamo's state is still no later test's business.
"""

from __future__ import annotations

import os
import subprocess
import sys

_CHILD = "LIGHTNING_REPLAY_TEST_FRESH_PROCESS"


def in_fresh_process(request) -> bool:
    """In the parent: run ``request``'s test alone in a new interpreter, assert it passed, and
    return True (the caller returns). In that child: False (the caller runs its body)."""
    node = request.node.nodeid
    if os.environ.get(_CHILD) == node:
        return False
    env = dict(os.environ, **{_CHILD: node})
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", node],
        cwd=str(request.config.rootpath),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, (
        f"{node} in a fresh process:\n{done.stdout[-6000:]}\n{done.stderr[-3000:]}"
    )
    return True
