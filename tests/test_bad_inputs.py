"""The bad-input catalogue: each raises a fitting error type that names the argument, the bad
value and what to do — never an AttributeError/KeyError from deep inside, never a hang."""

from __future__ import annotations

import pytest
import torch

import lightning_replay as lr
from lightning_replay.demos.hazards import HAZARDS
from lightning_replay.planner import InfeasibleBudget, Option, SegmentCost, plan


def test_misspelt_segment_suggestions_are_ordered_by_similarity():
    """The closest names first; equally close ones in the model's order (issue 34)."""
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(4))
    with pytest.raises(lr.SegmentError) as info:
        lr.install(model, ["block.0"])
    assert "Did you mean ['blocks.0', 'blocks.1', 'blocks.2']?" in str(info.value)


def _model():
    return HAZARDS["batch_norm"]().model


def _costs():
    return [
        SegmentCost(f"b{i}", 100, {"retain": Option(100, 0.0), "whole": Option(40, 1.0)})
        for i in range(2)
    ]


CASES = [
    # (id, callable, error type, fragments the message must contain)
    (
        "unknown segment",
        lambda: lr.install(_model(), ["blocks.7"]),
        lr.SegmentError,
        ["'blocks.7'", "Did you mean"],
    ),
    ("empty segments", lambda: lr.install(_model(), []), lr.SegmentError, ["empty"]),
    (
        "nested segments",
        lambda: lr.install(_model(), ["blocks.0", "blocks.0.bn"]),
        lr.SegmentError,
        ["nested", "'blocks.0.bn'"],
    ),
    ("root segment", lambda: lr.install(_model(), [""]), lr.SegmentError, ["root"]),
    (
        "segment not a module",
        lambda: lr.install(_model(), ["head.weight"]),
        lr.SegmentError,
        ["'head.weight'", "Parameter", "not a module"],
    ),
    (
        "glob matches nothing",
        lambda: lr.install(_model(), "encoder.*"),
        lr.SegmentError,
        ["'encoder.*'", "matches no submodule"],
    ),
    (
        "class matches nothing",
        lambda: lr.install(_model(), torch.nn.LSTM),
        lr.SegmentError,
        ["LSTM"],
    ),
    ("segment spec of wrong type", lambda: lr.install(_model(), [3.5]), lr.SegmentError, ["3.5"]),
    (
        "model not a module",
        lambda: lr.install("resnet", ["a"]),
        lr.ReplayConfigError,
        ["model must be a torch.nn.Module"],
    ),
    (
        "unknown preservation",
        lambda: lr.install(_model(), "blocks.*", preservation="fast"),
        lr.ReplayConfigError,
        ["preservation='fast'", "auto"],
    ),
    (
        "preservation for unknown segment",
        lambda: lr.install(_model(), "blocks.*", preservation={"blocks.9": "whole"}),
        lr.ReplayConfigError,
        ["'blocks.9'"],
    ),
    (
        "unknown on_violation",
        lambda: lr.install(_model(), "blocks.*", on_violation="ignore"),
        lr.ReplayConfigError,
        ["on_violation='ignore'", "raise"],
    ),
    (
        "unknown planner",
        lambda: lr.install(_model(), "blocks.*", budget="1GiB", planner="greedy"),
        lr.ReplayConfigError,
        ["planner='greedy'", "joint"],
    ),
    (
        "malformed budget",
        lambda: lr.install(_model(), "blocks.*", budget="lots"),
        lr.ReplayConfigError,
        ["'lots'", "budget"],
    ),
    (
        "zero budget",
        lambda: lr.install(_model(), "blocks.*", budget=0),
        lr.ReplayConfigError,
        ["budget", "0"],
    ),
    (
        "negative budget",
        lambda: lr.install(_model(), "blocks.*", budget=-5),
        lr.ReplayConfigError,
        ["budget", "-5"],
    ),
    (
        "fractional bytes",
        lambda: lr.install(_model(), "blocks.*", budget=1.5),
        lr.ReplayConfigError,
        ["budget=1.5", "whole", "(0, 1]"],
    ),
    (
        "negative base_memory",
        lambda: lr.install(_model(), "blocks.*", base_memory=-1),
        lr.ReplayConfigError,
        ["base_memory=-1"],
    ),
    (
        "zero calibration steps",
        lambda: lr.install(_model(), "blocks.*", calibration_steps=0),
        lr.ReplayConfigError,
        ["calibration_steps=0"],
    ),
    (
        "records not a path",
        lambda: lr.install(_model(), "blocks.*", records=42),
        lr.ReplayConfigError,
        ["records", "int"],
    ),
    (
        "parse_budget unit",
        lambda: lr.parse_budget("12 parsecs"),
        ValueError,
        ["'12 parsecs'", "budget"],
    ),
    ("parse_budget bool", lambda: lr.parse_budget(True), (ValueError, TypeError), ["True"]),
    ("plan below minimum", lambda: plan(_costs(), budget=100), InfeasibleBudget, ["140", "joint"]),
    (
        "plan unknown method",
        lambda: plan(_costs(), budget=1000, method="magic"),
        ValueError,
        ["'magic'"],
    ),
    (
        "plan negative memory",
        lambda: SegmentCost("b", 1, {"retain": Option(-1, 0.0)}),
        ValueError,
        ["-1"],
    ),
    (
        "contract wrong schema",
        lambda: lr.ReplayContract.from_dict({"segment": "s", "schema": 0}),
        lr.ContractSchemaError,
        ["schema 0", "Re-probe"],
    ),
    (
        "contract not a dict",
        lambda: lr.ReplayContract.from_dict(["s"]),
        lr.ContractSchemaError,
        ["list"],
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input(case):
    _, fn, err, fragments = case
    with pytest.raises(err) as info:
        fn()
    msg = str(info.value)
    for f in fragments:
        assert f in msg, f"{f!r} not in {msg!r}"
    assert not isinstance(info.value, (AttributeError, KeyError))


def test_install_twice(tmp_path):
    m = _model()
    lr.install(m, "blocks.*")
    with pytest.raises(lr.ReplayConfigError, match="already has lightning_replay installed"):
        lr.install(m, "blocks.0")


def test_corrupted_records_file(tmp_path):
    bad = tmp_path / "records.sqlite"
    bad.write_bytes(b"\x00garbage" * 512)
    with pytest.raises(lr.RecordsError, match="records.sqlite"):
        lr.install(_model(), "blocks.*", records=str(bad))


def test_unwritable_records_path(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    target = ro / "sub" / "records.sqlite"
    try:
        import os

        if os.geteuid() == 0:  # root writes anywhere: use a path under a file instead
            f = tmp_path / "afile"
            f.write_text("x")
            target = f / "records.sqlite"
        with pytest.raises(lr.RecordsError, match="writable path"):
            lr.install(_model(), "blocks.*", records=str(target))
    finally:
        ro.chmod(0o700)


def test_replan_before_any_step():
    e = lr.install(_model(), "blocks.*")
    with pytest.raises(lr.ReplayConfigError, match="run at least one training step"):
        e.replan(budget="1GiB")


def test_set_options_unknown():
    e = lr.install(_model(), "blocks.*")
    with pytest.raises(lr.ReplayConfigError, match="'blocks.5'"):
        e.set_options({"blocks.5": "whole"})
    with pytest.raises(lr.ReplayConfigError, match="'fastest'"):
        e.set_options({"blocks.0": "fastest"})


# ------------------------------------------------------------------ configs and the CLI
def _cli(argv, capsys):
    from lightning_replay.cli import main

    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse / jsonargparse errors
        rc = exc.code
    return rc, capsys.readouterr().err


def _yaml(tmp_path, text):
    p = tmp_path / "config.yaml"
    p.write_text(text)
    return str(p)


CLI_CASES = [
    # (id, argv builder(tmp_path), fragments stderr must contain)
    (
        "config file missing",
        lambda d: ["fit", "--config", str(d / "nope.yaml")],
        ["nope.yaml", "does not exist"],
    ),
    (
        "config key misspelled",
        lambda d: ["fit", "--config", _yaml(d, "trainer:\n  max_epochz: 1\n")],
        ["max_epochz"],
    ),
    (
        "config runs code",
        lambda d: [
            "fit",
            "--config",
            _yaml(d, "trainer:\n  max_epochs: !!python/object/apply:os.system ['touch PWNED']\n"),
        ],
        ["python/object/apply"],
    ),
    (
        "config bad budget",
        lambda d: [
            "fit",
            "--config",
            _yaml(
                d,
                "trainer:\n  strategy:\n    class_path: lightning_replay.strategies.replay."
                "ReplayStrategy\n    init_args:\n      budget: lots\n",
            ),
        ],
        ["budget='lots'", "GiB"],
    ),
    (
        "config bad check interval",
        lambda d: [
            "fit",
            "--config",
            _yaml(
                d,
                "trainer:\n  callbacks:\n    - class_path: lightning_replay.callbacks.replay."
                "ReplayCallback\n      init_args:\n        check_every_n_steps: 0\n",
            ),
        ],
        ["check_every_n_steps=0"],
    ),
    (
        "records of an empty directory",
        lambda d: ["records", str(d)],
        ["no records database", "records.sqlite"],
    ),
    (
        "records of a foreign database",
        lambda d: ["records", _foreign_db(d)],
        ["foreign.sqlite", "without a 'records' table"],
    ),
    (
        "records of a garbage file",
        lambda d: ["records", _garbage(d), "--summary"],
        ["garbage.sqlite", "not a readable records database"],
    ),
    (
        "report of an empty directory",
        lambda d: ["report", str(d)],
        ["neither a study", "telemetry.jsonl"],
    ),
]


def _foreign_db(d):
    import sqlite3

    p = d / "foreign.sqlite"
    with sqlite3.connect(p) as conn:
        conn.execute("CREATE TABLE t (x)")
    return str(p)


def _garbage(d):
    p = d / "garbage.sqlite"
    p.write_bytes(b"\x07not sqlite at all" * 400)
    return str(p)


@pytest.mark.parametrize("case", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_bad_cli_input(case, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _, argv, fragments = case
    rc, err = _cli(argv(tmp_path), capsys)
    assert rc == 2, err[-2000:]
    for f in fragments:
        assert f in err, f"{f!r} not in {err[-2000:]!r}"
    assert "Traceback" not in err
    assert not (tmp_path / "PWNED").exists()


class _SelfCheckpointed(torch.nn.Module):
    """Checkpoints its own blocks (what HF gradient_checkpointing_enable() and timm
    set_grad_checkpointing() do), around the segments."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(2)
        )
        self.reentrant = reentrant

    def forward(self, x):
        for b in self.blocks:
            x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=self.reentrant)
        return x


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_segments_inside_the_models_own_checkpoint_are_refused_naming_the_fix(reentrant):
    """Non-reentrant: at the forward, before anything is saved; reentrant (its forward runs
    under no_grad, nothing to see): when its recomputation calls the segment in backward."""
    model = _SelfCheckpointed(reentrant)
    engine = lr.install(model, "blocks.*")
    try:
        with pytest.raises(lr.ReplayConfigError) as info:
            model(torch.randn(4, 8, requires_grad=True)).sum().backward()
        msg = str(info.value)
        assert "'blocks.1'" in msg if reentrant else "'blocks.0'" in msg
        assert "gradient_checkpointing_disable()" in msg and "set_grad_checkpointing(False)" in msg
    finally:
        engine.uninstall()


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("how", ["lr.install", "strategy"])
def test_hf_gradient_checkpointing_left_on_is_refused_at_install(how, monkeypatch, tmp_path):
    """Before any step (no traceback from inside autograd), naming the modules that carry the
    flag and the installed transformers' own way to turn it off."""
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = transformers.GPT2Config(
        vocab_size=32, n_positions=8, n_embd=16, n_layer=2, n_head=2, use_cache=False
    )
    model = transformers.GPT2LMHeadModel(config)
    enable = getattr(model, "activation_checkpointing_enable", None)
    (enable or model.gradient_checkpointing_enable)()
    method = "activation_checkpointing_disable" if enable else "gradient_checkpointing_disable"
    if how == "lr.install":
        with pytest.raises(lr.ReplayConfigError) as info:
            lr.install(model, "transformer.h.*")
        assert f"call model.{method}() before installing" in str(info.value)
    else:
        import lightning as L

        class Lit(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = model

            def training_step(self, batch, _):
                return self.net(input_ids=batch[0], labels=batch[0]).loss

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

        ids = torch.randint(0, 32, (4, 8))
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=2)
        steps = []
        trainer = L.Trainer(
            strategy=lr.ReplayStrategy(segments="net.transformer.h.*"),
            accelerator="cpu",
            devices=1,
            max_steps=2,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            default_root_dir=str(tmp_path),
            callbacks=[
                L.pytorch.callbacks.LambdaCallback(on_train_batch_start=lambda *a: steps.append(1))
            ],
        )
        with pytest.raises(lr.ReplayConfigError) as info:
            trainer.fit(Lit(), loader)
        assert steps == []  # refused before the first step
        assert f"call model.net.{method}() before installing" in str(info.value)
    assert "'transformer.h.0'" in str(info.value) or "'net.transformer.h.0'" in str(info.value)
