"""The engine never leaves torch's profiler running (issue 31, found by the session-15 suite).

On CPU the engine measures a step's real peak with ``torch.profiler`` from a window's start to
the optimizer step, else to the next window's start. A loop with no optimizer step (or whose
last step is measured and then ends) left the profiler on for good: every later op ran under
it, any other profiler refused to start (``test_replan.py`` then ``test_phase_peaks.py``:
"profiler recorded no CPU memory events"), and the interpreter crashed at exit with a
segmentation fault in libtorch's callbacks (exit code 139: ``pytest tests/test_replan.py``
alone, all its tests passing). The referees are the process's: torch's own profiler flag, and
the exit code of a fresh interpreter.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import warnings

import torch
from torch import nn

import lightning_replay as lr

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _profiler_on() -> bool:
    return bool(torch._C._autograd._profiler_enabled())


def _loop_without_optimizer(steps: int) -> tuple[lr.ReplayEngine, nn.Module]:
    # earlier tests' engines dropped without uninstall() (a cycle with their model) are freed,
    # and their meters' profilers stopped, by the collector: not this test's to judge
    gc.collect()
    assert not _profiler_on()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3)])
    engine = lr.install(model, ["0", "1", "2"], budget="min", calibration_steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for s in range(steps):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(s))
            model.zero_grad()
            model(x).sum().backward()
    return engine, model


def test_a_dropped_engine_leaves_no_profiler_running():
    engine, model = _loop_without_optimizer(6)
    measuring = engine._truth is not None  # the last step's measurement is still open
    del engine, model
    gc.collect()  # the engine and its model hold each other: the collector frees them
    assert measuring, "no step was being measured at the end: the case tests nothing"
    assert not _profiler_on(), "torch's profiler still runs after the engine was dropped"


def test_uninstall_leaves_no_profiler_running():
    engine, model = _loop_without_optimizer(6)
    engine.uninstall()
    assert not _profiler_on()


def test_the_interpreter_exits_cleanly_with_a_step_being_measured():
    script = textwrap.dedent(
        """
        import warnings, torch
        from torch import nn
        import lightning_replay as lr
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3)])
        engine = lr.install(model, ["0", "1", "2"], budget="min", calibration_steps=1)
        warnings.simplefilter("ignore")
        for s in range(6):
            model.zero_grad()
            model(torch.randn(8, 16)).sum().backward()
        assert engine._truth is not None  # measuring the last step when the script ends
        print("done")
        """
    )
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and "done" in done.stdout, (done.returncode, done.stderr[-2000:])


def test_a_dropped_engines_hooks_do_not_break_the_next_optimizer_step():
    """The dropped engine's optimizer hooks (global, every optimizer's) find it gone at the next
    optimizer step; removing them from inside that step's loop over its hooks made the hooks
    after them raise "OrderedDict mutated during iteration" (a later engine's, here)."""
    engine, model = _loop_without_optimizer(6)
    del engine, model
    gc.collect()
    torch.manual_seed(1)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3)])
    opt = torch.optim.AdamW(model.parameters())
    engine = lr.install(model, ["0", "1", "2"], budget="min", calibration_steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for s in range(8):
            model(torch.randn(8, 16, generator=torch.Generator().manual_seed(s))).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert engine.plan is not None
    engine.uninstall()
    assert not _profiler_on()
