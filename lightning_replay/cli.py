"""``lightning-replay``: train, evaluate, compare, report and query from the command line.

Commands:

* ``fit`` / ``validate`` / ``test`` — LightningCLI (``--config configs/dense_queue_cpu.yaml``,
  any ``--trainer.*``, ``--model.*``, ``--data.*`` override; the model and data default to the
  dense-queue application, and ``class_path`` selects others such as the sparse-write workload).
* ``study`` — the seven-method comparison a config's ``study:`` section describes.
* ``doctor`` — what checkpointing does to a config's model, measured on copies
  (:func:`lightning_replay.diagnose`); writes ``doctor.json`` and ``doctor.html``.
* ``report RUN_DIR`` — an HTML report with plots of a study or a ``fit`` run.
* ``records RUN_DIR`` — query the execution records (SQLite) of a study or a ``fit`` run.

There is no ``predict``: replay only changes training (prediction runs no backward, so nothing
is recomputed), and a trained model's weights and ``state_dict`` keys are plain. Predict with
any ``Trainer``, or ``lightning-replay test`` for the configured test metrics.

It is long (over 600 lines once ruff-formatted) because each subcommand (fit, study, doctor,
report, records) parses and checks its own arguments here.

Examples::

    lightning-replay fit --config configs/dense_queue_cpu.yaml --trainer.max_epochs=2
    lightning-replay study --config configs/dense_queue_cpu.yaml --study.seeds='[0]'
    lightning-replay report runs/dense_queue_study
    lightning-replay records runs/dense_queue_study --outcome divergence --format json
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Sequence

from lightning_replay.errors import RecordsError, ReplayConfigError, ReplayError
from lightning_replay.core.base.records import BYTES, EVENTS, GRAD, PROBE, REPLAY, VERSION

_CHECK_KINDS = (GRAD, BYTES, PROBE, REPLAY, VERSION)  # every kind that is not an event

_LIGHTNING_COMMANDS = ("fit", "validate", "test")


def _cli_class():
    """The LightningCLI subclass (imported lazily: ``--help`` of the light commands is fast)."""
    from jsonargparse import lazy_instance
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.utilities.rank_zero import rank_zero_info

    import lightning_replay  # noqa: F401  registers strategy="replay"
    from lightning_replay.apps.dense_queue import DenseQueueDataModule, DenseQueueModule
    from lightning_replay.apps.study_config import StudySettings, names_subclass
    from lightning_replay.strategies.replay import STRATEGY_NAMES, ReplayStrategy

    class ReplayCLI(LightningCLI):
        """LightningCLI with the dense-queue defaults and the ``study`` section."""

        def add_arguments_to_parser(self, parser: Any) -> None:
            parser.set_defaults(
                {
                    "model": lazy_instance(DenseQueueModule),
                    "data": lazy_instance(DenseQueueDataModule),
                }
            )
            parser.add_class_arguments(StudySettings, "study")

        def before_fit(self) -> None:
            # Create the records database before the launcher starts the other processes:
            # ranks that open a new SQLite file at the same moment race on its WAL switch
            # ("database is locked").
            if os.environ.get("LOCAL_RANK") is not None:
                return
            from lightning_replay.callbacks.replay import ReplayCallback
            from lightning_replay.core.base.records import RecordStore, default_records_path

            for cb in self.trainer.callbacks:
                if isinstance(cb, ReplayCallback):
                    path = cb.records_path or default_records_path(self.trainer.default_root_dir)
                    RecordStore(path).close()

        def before_instantiate_classes(self) -> None:
            if self.subcommand not in ("validate", "test", "predict"):
                return
            # Evaluation has no backward, so nothing to replay: run it on a plain strategy.
            # (ReplayStrategy with one process also fails outside fit today: DDP's setup
            # broadcasts module states over a process group it never made.)
            trainer = self.config[self.subcommand].trainer
            strategy = trainer.strategy
            name = strategy if isinstance(strategy, str) else getattr(strategy, "class_path", "")
            if name in STRATEGY_NAMES or names_subclass(name, ReplayStrategy):
                trainer.strategy = "auto"
                rank_zero_info(
                    f"lightning-replay {self.subcommand}: strategy 'replay' is for "
                    "training; evaluating with strategy='auto'"
                )

        def instantiate_classes(self) -> None:
            try:
                super().instantiate_classes()
            except (ValueError, TypeError) as exc:
                raise ConfigInstantiationError(_concise(str(exc))) from exc

    return ReplayCLI


class ConfigInstantiationError(ReplayConfigError):
    """A config parsed, but building the trainer, model or data from it failed (a
    :class:`ValueError` too, as before the error tree)."""


def _concise(message: str) -> str:
    # jsonargparse appends the whole parsed namespace ("Given value: Namespace(...)", dozens of
    # defaults): keep the lines that say what is wrong.
    keep = [
        ln for ln in message.splitlines() if not ln.strip().startswith(("Given value", "Subtypes:"))
    ]
    return "\n".join(keep).strip()


_HELP = """Train, evaluate, compare, report and query from the command line.

commands:
  fit, validate, test   LightningCLI (--config configs/dense_queue_cpu.yaml, any --trainer.*,
                        --model.*, --data.* override; the model and data default to the
                        dense-queue application, and class_path selects others such as the
                        sparse-write workload)
  study                 the seven-method comparison a config's study: section describes
  doctor                what checkpointing does to a config's model, measured on copies;
                        writes doctor.json and doctor.html
  report RUN_DIR        an HTML report with plots of a study or a fit run
  records RUN_DIR       query the execution records (SQLite) of a study or a fit run

There is no predict: replay only changes training (prediction runs no backward, so nothing is
recomputed), and a trained model's weights and state_dict keys are plain. Predict with any
Trainer, or `lightning-replay test` for the configured test metrics.

examples:
  lightning-replay fit --config configs/dense_queue_cpu.yaml --trainer.max_epochs=2
  lightning-replay study --config configs/dense_queue_cpu.yaml --study.seeds='[0]'
  lightning-replay report runs/dense_queue_study
  lightning-replay records runs/dense_queue_study --outcome divergence --format json"""

_LIGHTNING_HELP = """Train (fit), validate or test through LightningCLI. The model and data
default to the dense-queue application (DenseQueueModule, DenseQueueDataModule); a config's
class_path selects others (configs/sparse_write.yaml). Their arguments:
  lightning-replay fit --model.help DenseQueueModule
  lightning-replay fit --data.help DenseQueueDataModule
  lightning-replay fit --trainer.strategy.help ReplayStrategy
Example:
  lightning-replay fit --config configs/dense_queue_cpu.yaml --trainer.max_epochs=2"""


def _raw_formatter() -> type:
    """jsonargparse's help formatter, keeping the description's line breaks."""
    from jsonargparse import DefaultHelpFormatter

    class RawDescription(DefaultHelpFormatter, argparse.RawDescriptionHelpFormatter):
        pass

    return RawDescription


def run_lightning(argv: Sequence[str]) -> int:
    """``fit``/``validate``/``test`` through LightningCLI."""
    import lightning as L

    cli_cls = _cli_class()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*LightningCLI's args parameter.*")
        try:
            cli_cls(
                L.LightningModule,
                L.LightningDataModule,
                subclass_mode_model=True,
                subclass_mode_data=True,
                args=list(argv),
                save_config_kwargs={"overwrite": True},
                parser_kwargs={
                    "prog": "lightning-replay",
                    "description": _LIGHTNING_HELP,
                    "formatter_class": _raw_formatter(),
                    **{
                        c: {"description": _LIGHTNING_HELP, "formatter_class": _raw_formatter()}
                        for c in _LIGHTNING_COMMANDS
                    },
                },
            )
        except ConfigInstantiationError as exc:
            print(
                f"lightning-replay {argv[0]}: error: the config parsed, but building the "
                f"trainer, model or data from it failed:\n{exc}",
                file=sys.stderr,
            )
            return 2
    return 0


def parse_study_args(argv: Sequence[str]) -> dict[str, Any]:
    """A study config from ``--config`` files and dotted overrides, as a plain dict."""
    import lightning as L
    import yaml

    cli_cls = _cli_class()

    class StudyArgs(cli_cls):  # parse only: the study instantiates one trainer per run
        def instantiate_classes(self) -> None:
            pass

        def _set_seed(self) -> None:
            pass

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*LightningCLI's args parameter.*")
        cli = StudyArgs(
            L.LightningModule,
            L.LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            args=list(argv),
            run=False,
            parser_kwargs={
                "prog": "lightning-replay study",
                "description": _STUDY_HELP,
                "formatter_class": _raw_formatter(),
            },
        )
    cfg = yaml.safe_load(cli.parser.dump(cli.config, skip_check=True))
    return {k: cfg[k] for k in ("seed_everything", "trainer", "model", "data", "study") if k in cfg}


_STUDY_HELP = """Run the seven-method comparison (none, torch_checkpoint, torch_sac, whole,
regions, eager_whole, joint) described by a config: the trainer/model/data sections as for
`fit`, and the study section (--study.methods, --study.seeds, --study.budget_fraction,
--study.output_dir, ...). Writes results.md/.csv/.json, report.html, records.sqlite and wandb
runs under study.output_dir. Example:
  lightning-replay study --config configs/dense_queue_cpu.yaml --study.seeds='[0, 1, 2]'"""


def run_study_command(argv: Sequence[str]) -> int:
    from lightning_replay.apps.study import format_markdown, run_study

    cfg = parse_study_args(argv)
    result = run_study(cfg, progress=True)
    print(format_markdown(result))
    for key, path in result.paths.items():
        print(f"{key:>12}: {path}")
    return 0 if result.identical else 1


# ------------------------------------------------------------------------------ doctor
_DOCTOR_HELP = """Diagnose what activation checkpointing does to the configured model before
training it: a few training steps on copies of the model, with and without torch.utils.checkpoint
(or the model's own checkpointing) on the segments, compared bit for bit, and what
strategy='replay' would preserve instead. The trainer/model/data sections are those of `fit`
(segments: the strategy's segments=, else the module's configure_replay_segments(), else its
largest block list). Prints the table; writes doctor.json and doctor.html into
trainer.default_root_dir. --selective POLICY (default matmul; none: left out) adds torch's
selective checkpoint and replay's selective option under that policy to the table. Example:
  lightning-replay doctor --config configs/dense_queue_cpu.yaml --steps 2 --selective matmul"""


def parse_doctor_args(argv: Sequence[str]) -> Any:
    """The trainer, model and data of a ``fit`` config, instantiated, plus ``--steps`` and
    ``--selective``."""
    import lightning as L

    from lightning_replay.core.mechanisms.selective import POLICIES

    cli_cls = _cli_class()

    class DoctorCLI(cli_cls):
        def add_arguments_to_parser(self, parser: Any) -> None:
            super().add_arguments_to_parser(parser)
            parser.add_argument(
                "--steps", type=int, default=2, help="training steps per compared run (default 2)"
            )
            parser.add_argument(
                "--selective",
                type=str,
                default="matmul",
                choices=[*POLICIES, "none"],
                help="selective policy compared in the methods table: torch's selective "
                "checkpoint and replay's selective option (default matmul; none: left out)",
            )

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*LightningCLI's args parameter.*")
        return DoctorCLI(
            L.LightningModule,
            L.LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            args=list(argv),
            run=False,
            save_config_callback=None,
            parser_kwargs={
                "prog": "lightning-replay doctor",
                "description": _DOCTOR_HELP,
                "formatter_class": _raw_formatter(),
            },
        )


def run_doctor_command(argv: Sequence[str]) -> int:
    """``lightning-replay doctor --config CONFIG.yaml``: :func:`lightning_replay.diagnose` on
    the configured LightningModule and the first batches of its training data."""
    import logging

    import lightning as L
    from lightning.fabric.utilities.apply_func import move_data_to_device

    from lightning_replay.tools.doctor import diagnose

    try:
        cli = parse_doctor_args(argv)
    except ConfigInstantiationError as exc:
        print(
            f"lightning-replay doctor: error: the config parsed, but building the trainer, "
            f"model or data from it failed:\n{exc}",
            file=sys.stderr,
        )
        return 2
    module, trainer, steps = cli.model, cli.trainer, cli.config["steps"]
    selective = None if cli.config["selective"] == "none" else cli.config["selective"]
    if not module.automatic_optimization:
        print(
            f"lightning-replay doctor: error: {type(module).__name__} uses manual "
            "optimization (automatic_optimization=False); doctor calls training_step and "
            "backward itself. Call lightning_replay.diagnose(model, batch_fn, loss_fn) "
            "with a loss_fn that runs your step's forward.",
            file=sys.stderr,
        )
        return 2
    device = trainer.strategy.root_device
    module.configure_model()
    module.to(device)
    source = cli.datamodule if cli.datamodule is not None else module
    batches = []
    try:
        if cli.datamodule is not None:
            cli.datamodule.prepare_data()
            cli.datamodule.setup("fit")
        for batch in source.train_dataloader():
            batches.append(move_data_to_device(batch, device))
            if len(batches) == steps:
                break
    except (OSError, ValueError, RuntimeError) as exc:
        print(
            f"lightning-replay doctor: error: loading the training data from "
            f"{type(source).__name__}.train_dataloader() failed: {type(exc).__name__}: "
            f"{exc}",
            file=sys.stderr,
        )
        return 2
    if len(batches) < steps:
        print(
            f"lightning-replay doctor: error: the training data has {len(batches)} batches; "
            f"--steps {steps} needs {steps}",
            file=sys.stderr,
        )
        return 2
    # training_step may use self.trainer (world size, epoch) and self.log: a barebones trainer
    # answers those (and ignores logging) on each copy diagnose trains.
    lightning_log = logging.getLogger("lightning.pytorch")
    level = lightning_log.level
    lightning_log.setLevel(logging.WARNING)  # the barebones banner is not the user's concern
    try:
        bare = L.Trainer(barebones=True, accelerator=device.type, devices=1)
    finally:
        lightning_log.setLevel(level)

    def loss_fn(model: Any, batch: Any) -> Any:
        if model._trainer is None:
            model.trainer = bare
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*self.log.*barebones.*")
            out = model.training_step(batch, 0)
        return out["loss"] if isinstance(out, dict) else out

    spec = getattr(trainer.strategy, "segments_spec", None)
    if spec is None and callable(getattr(module, "configure_replay_segments", None)):
        spec = module.configure_replay_segments()
    try:
        report = diagnose(
            module, batches.__getitem__, loss_fn, segments=spec, steps=steps, selective=selective
        )
    except (ReplayError, ValueError) as exc:
        print(f"lightning-replay doctor: error: {exc}", file=sys.stderr)
        return 2
    print(report.table())
    out = Path(trainer.default_root_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "doctor.json").write_text(json.dumps(report.to_dict(), indent=1))
    (out / "doctor.html").write_text(
        "<!doctype html><html><head><meta charset='utf-8'><title>lightning-replay doctor"
        "</title></head><body>\n" + report.to_html() + "\n</body></html>\n"
    )
    print(f"\n{'json':>6}: {out / 'doctor.json'}\n{'html':>6}: {out / 'doctor.html'}")
    return 0


# ------------------------------------------------------------------------------ records
def _run_labels(run_dir: str) -> dict[str, str]:
    """run id -> "method seed k" for a study directory."""
    path = Path(run_dir) / "results.json"
    if not path.is_file():
        return {}
    rows = json.loads(path.read_text()).get("rows", [])
    return {r["run_id"]: f"{r['method']} seed {r['seed']}" for r in rows if r.get("run_id")}


def _skipped_checks(run_dir: str) -> dict[str, int]:
    """Derivative checks skipped under the budget, per run id: a study's results, or a fit
    run's last ReplayCallback telemetry row (they are counted, not recorded)."""
    root = Path(run_dir)
    if (root / "results.json").is_file():
        rows = json.loads((root / "results.json").read_text()).get("rows", [])
        return {
            r["run_id"]: r["checks_skipped"]
            for r in rows
            if r.get("run_id") and r.get("checks_skipped")
        }
    from lightning_replay.apps.telemetry import read_telemetry
    from lightning_replay.core.base.records import RECORDS_DIR

    out: dict[str, int] = {}
    for t in read_telemetry(root / RECORDS_DIR):
        if t.get("run_id") and t.get("checks_skipped"):
            out[t["run_id"]] = t["checks_skipped"]
    return out


def _print_rows(rows: list[dict[str, Any]], fmt: str, width: int = 60) -> None:
    if fmt == "json":
        print(json.dumps(rows, indent=1))
        return
    if not rows:
        print("(no records)")
        return
    cols = list(rows[0])
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)
        print(buf.getvalue(), end="")
        return
    cells = [
        [
            str(r[c])
            if c != "detail" or len(str(r[c])) <= width
            else str(r[c])[: width - 3] + "..."
            for c in cols
        ]
        for r in rows
    ]
    widths = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for x in cells:
        print("  ".join(v.ljust(w) for v, w in zip(x, widths)))


def run_records(args: argparse.Namespace) -> int:
    from lightning_replay.core.base import records as rec

    db = rec.find_records(args.run_dir)
    labels = _run_labels(args.run_dir)
    known = rec.runs(rec.query(db))
    run_id = args.run_id
    if run_id is not None and run_id not in {r["run_id"] for r in known}:
        match = [rid for rid, lab in labels.items() if lab == run_id.replace("-seed", " seed ")]
        if not match:
            listing = "\n".join(
                f"  {r['run_id']}  {labels.get(r['run_id'], '')}  {r['records']} records, "
                f"steps {r['first_step']}-{r['last_step']}"
                for r in known
            )
            print(
                f"lightning-replay records: error: no run {run_id!r} in {db}; its runs "
                f"(oldest first):\n{listing or '  (none)'}",
                file=sys.stderr,
            )
            return 2
        run_id = match[0]
    if args.summary:
        rows = rec.summarize(rec.query(db, run_id=run_id, kind=args.kind))
        if labels:
            for r in rows:
                r["run"] = labels.get(r["run_id"], "")
        _print_rows(rows, args.format, args.detail_width)
        skipped = {
            k: v for k, v in _skipped_checks(args.run_dir).items() if run_id is None or k == run_id
        }
        if skipped and args.format == "table":
            print(
                "derivative checks skipped under the budget (keeping a segment's graph would "
                "have exceeded it; byte checks still ran): "
                + ", ".join(f"{labels.get(k, k)} {v}" for k, v in skipped.items())
            )
        return 0
    found = rec.query(
        db,
        run_id=run_id,
        outcome=args.outcome,
        segment=args.segment,
        check=args.check,
        kind=args.kind,
        step_from=args.step_from,
        step_to=args.step_to,
        limit=args.limit or None,
    )
    if args.format == "table":
        rows = [{k: v for k, v in r.to_dict().items() if k != "created_at"} for r in found]
        rows = [{"seq": r.pop("seq"), **r} for r in rows]
    else:
        rows = [r.to_json() for r in found]
        rows = [{"seq": r.pop("seq"), **r} for r in rows]
        if labels:
            for r in rows:
                r["run"] = labels.get(r["run_id"])
        if args.format == "csv":
            for r in rows:
                if not isinstance(r["detail"], str):
                    r["detail"] = json.dumps(r["detail"], sort_keys=True)
    _print_rows(rows, args.format, args.detail_width)
    return 0


def run_report(args: argparse.Namespace) -> int:
    from lightning_replay.apps.report import write_report

    path = write_report(args.run_dir, run_id=args.run_id)
    print(f"report: {path}")
    return 0


# ------------------------------------------------------------------------------ main
def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="lightning-replay",
        description=_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    for name, what in (
        ("fit", "train (LightningCLI; `lightning-replay fit --help`)"),
        ("validate", "validate (LightningCLI)"),
        ("test", "test (LightningCLI)"),
    ):
        sub.add_parser(name, help=what, add_help=False)
    sub.add_parser(
        "study",
        help="the seven-method comparison from a config (`lightning-replay study --help`)",
        add_help=False,
    )
    sub.add_parser(
        "doctor",
        help="what checkpointing does to the configured model, measured "
        "(`lightning-replay doctor --help`)",
        add_help=False,
    )
    rp = sub.add_parser(
        "report",
        help="write RUN_DIR/report.html with plots",
        description="Write an HTML report with PNG plots (memory per step "
        "against the budget, step time, plan per segment over "
        "time, record outcomes) for a study's output_dir or a fit "
        "run's default_root_dir.",
    )
    rp.add_argument("run_dir", metavar="RUN_DIR", help="study output_dir or fit run directory")
    rp.add_argument(
        "--run",
        "--run-id",
        dest="run_id",
        default=None,
        help="a fit run directory that several fits appended to: the run id to "
        "show (default: the latest; the report lists the others)",
    )
    qp = sub.add_parser(
        "records",
        help="query execution records",
        description="Query the execution records (one row per check or contract "
        "event; outcome match, rejection or divergence) of a study "
        "(RUN_DIR/records.sqlite), a fit run "
        "(RUN_DIR/replay/records.sqlite) or a .sqlite file.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  lightning-replay records runs/dense_queue_study "
        "--summary\n  lightning-replay records runs/dense_queue_study "
        "--run joint-seed0 --check grad --limit 5",
    )
    qp.add_argument("run_dir", metavar="RUN_DIR", help="study dir, fit run dir or .sqlite file")
    qp.add_argument(
        "--run",
        "--run-id",
        dest="run_id",
        default=None,
        help="a run id, or in a study a run name such as joint-seed0",
    )
    qp.add_argument("--outcome", choices=["match", "rejection", "divergence"], default=None)
    qp.add_argument("--segment", default=None, help='segment name ("*" for plan events)')
    qp.add_argument(
        "--check",
        default=None,
        help=f"record kind: {', '.join(_CHECK_KINDS)} (checks); {', '.join(EVENTS)} (events)",
    )
    qp.add_argument(
        "--kind",
        choices=["check", "event"],
        default=None,
        help="checks only, or contract and plan events only (their outcome "
        "'match' means 'came into force', not a matched check)",
    )
    qp.add_argument("--step-from", type=int, default=None, help="first step (inclusive)")
    qp.add_argument("--step-to", type=int, default=None, help="last step (inclusive)")
    qp.add_argument(
        "--limit", type=int, default=50, help="the newest N matching records (default 50; 0: all)"
    )
    qp.add_argument(
        "--summary",
        action="store_true",
        help="counts per run, kind, check and outcome instead of rows, and "
        "the derivative checks skipped under the budget",
    )
    qp.add_argument("--format", choices=["table", "csv", "json"], default="table")
    qp.add_argument(
        "--detail-width",
        type=int,
        default=60,
        help="table format: truncate the detail column to this width",
    )
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lightning-replay`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _LIGHTNING_COMMANDS:
        return run_lightning(argv)
    if argv and argv[0] == "study":
        return run_study_command(argv[1:])
    if argv and argv[0] == "doctor":
        return run_doctor_command(argv[1:])
    ap = _parser()
    args = ap.parse_args(argv)
    if args.command is None:
        ap.print_help()
        return 2
    try:
        if args.command == "report":
            return run_report(args)
        return run_records(args)
    except (FileNotFoundError, RecordsError, ValueError) as exc:
        print(f"lightning-replay {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `lightning-replay records ... | head`
        sys.stdout = open(os.devnull, "w")
        return 0


if __name__ == "__main__":
    sys.exit(main())
