"""RankExitLauncher's end of a rank: what interpreter exit would run first still runs."""

from __future__ import annotations

import atexit
import multiprocessing
import threading
import time
from pathlib import Path

from lightning_replay.strategies.launchers import end_rank


def _rank(out: str) -> None:
    out_dir = Path(out)
    atexit.register(lambda: (out_dir / "atexit").write_text("ran"))

    def late_writer() -> None:  # a non-daemon thread still working when the rank is done
        time.sleep(0.3)
        (out_dir / "thread").write_text("joined")

    threading.Thread(target=late_writer).start()
    print("buffered output", end="", flush=False)
    end_rank()


def test_end_rank_joins_threads_runs_atexit_and_exits_zero(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=_rank, args=(str(tmp_path),))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    assert (tmp_path / "thread").read_text() == "joined"
    assert (tmp_path / "atexit").read_text() == "ran"
