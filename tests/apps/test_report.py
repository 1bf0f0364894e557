"""``write_report``'s errors: a ReplayError, still a FileNotFoundError for older callers."""

from __future__ import annotations

import pytest

from lightning_replay import cli
from lightning_replay.apps.report import ReportError, write_report
from lightning_replay.errors import ReplayError


def test_nothing_to_report_is_a_replay_error_and_a_file_not_found(tmp_path, capsys):
    with pytest.raises(ReportError, match="holds neither a study") as info:
        write_report(tmp_path)
    assert isinstance(info.value, ReplayError) and isinstance(info.value, FileNotFoundError)
    try:  # the way callers wrote it before the error tree
        write_report(tmp_path)
    except FileNotFoundError as exc:
        assert "holds neither a study" in str(exc)
    assert cli.main(["report", str(tmp_path)]) == 2
    assert "lightning-replay report: error: " in capsys.readouterr().err
    assert not (tmp_path / "report.html").exists()
