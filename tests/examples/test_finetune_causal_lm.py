"""examples/transformers/finetune_causal_lm.py, run with its defaults (fewer steps): its replays
are derivative-checked, not only byte-checked (issue 34)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
EXAMPLE = os.path.join(ROOT, "examples", "transformers", "finetune_causal_lm.py")


def test_defaults_record_a_derivative_check_match(tmp_path):
    # Its default budget (16 MiB) is the whole process's real memory, and the example runs in a
    # process of its own, as a user runs it. In the test process, what earlier tests left
    # alive counts in the base: with 24 MB of other live tensors the lowest plan peaks at
    # 32.03 MiB and the budget is refused; in the full suite, earlier tests' cyclic garbage
    # once did the same (29.56 MiB).
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(ROOT), env.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, EXAMPLE, "--steps", "8", "--root", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    plan = ast.literal_eval(re.search(r"; plan (\{.*\})", out).group(1))
    assert any(o != "retain" for o in plan.values()), out  # the default budget replays
    checks = re.search(r"checks: (\d+) derivative .*?; (all match|.*did not match)(.*)", out)
    assert checks, out
    assert int(checks.group(1)) >= 1 and checks.group(2) == "all match", out
    assert "skipped" not in checks.group(3), out
