"""examples/transformers/finetune_causal_lm.py, run with its defaults (fewer steps): its replays
are derivative-checked, not only byte-checked (issue 34)."""

from __future__ import annotations

import gc
import importlib.util
import os

import pytest

pytest.importorskip("transformers")

EXAMPLE = os.path.join(
    os.path.dirname(__file__), "..", "..", "examples", "transformers", "finetune_causal_lm.py"
)


def test_defaults_record_a_derivative_check_match(tmp_path, monkeypatch, capsys):
    # The budget (16 MiB) is the whole process's: in the full suite, cyclic garbage of earlier
    # tests (Trainers and their models, not yet collected) counted in the base once and made
    # it infeasible (the lowest plan at 29.56 MiB). The example runs in a fresh process.
    gc.collect()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    spec = importlib.util.spec_from_file_location("finetune_causal_lm", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    result = example.main(["--steps", "8", "--root", str(tmp_path)])
    assert any(o != "retain" for o in result["plan"].values())  # the default budget replays
    assert result["grad_checks"] >= 1 and result["not_match"] == 0, result
    assert result["grad_checks_skipped"] == 0
    printed = capsys.readouterr().out
    assert f"checks: {result['grad_checks']} derivative" in printed
