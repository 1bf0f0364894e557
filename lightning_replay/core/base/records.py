"""Execution records: one row per check or contract event, append-only, never dropped.

Records live in memory (``path=None``) or in SQLite (WAL mode, one commit per row, so a killed
process loses at most the row being written).

This module is the one channel for records: the record kinds (:data:`CHECKS`, :data:`EVENTS`),
typed helpers that write them (:meth:`RecordStore.record_check` and its siblings), one query
(:class:`RecordQuery`, :func:`query`) that :meth:`RecordStore.read`, the ``records`` command
and the report all use, and the default place of a run's records
(:func:`default_records_path`, :func:`find_records`).

It is a little over 600 lines once ruff-formatted: the record kinds, the two stores and the one
query they share.

Example:
    >>> store = RecordStore(None, run_id="demo")
    >>> _ = store.record_contract(step=1, segment="blocks.0", version=1, detail={"state": []})
    >>> _ = store.record_check(step=2, segment="blocks.0", contract_version=1, check=GRAD,
    ...                        matched=True, detail={"max_abs_diff": 0.0})
    >>> [(r.check, r.outcome, r.is_check) for r in store.read()]
    [('contract', 'match', False), ('grad', 'match', True)]
    >>> store.counts(kind="check")
    {'match': 1, 'rejection': 0, 'divergence': 0}
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import sqlite3
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from lightning_replay.errors import RecordsError

OUTCOMES = ("match", "rejection", "divergence")
"""``match``: a check or contract held. ``rejection``: state outside the contract was seen and the
contract was withdrawn (the segment is retained until re-probed). ``divergence``: a check found a
replay that differs from the reference."""

# ------------------------------------------------------------------ record kinds ("check" column)
GRAD = "grad"
"""Derivative check: a replay's input and parameter gradients against the retained graph's."""
BYTES = "bytes"
"""Byte-level check: digests of contract state and replayed outputs against forward time."""
PROBE = "probe"
"""A replayed probe's replay (a probe under a memory budget, which keeps no activations) against
its forward, outputs and saved tensors byte for byte: ``match`` or ``divergence``. Not a sampled
check: it runs once per probe, whatever checks were asked for."""
REPLAY = "replay"
"""A steady replay whose recomputation departed from its forward (it saved a different number
or kind of tensors for backward: it took another branch). Outcome ``divergence``; the step's
gradients cannot be computed from it, so the error is raised after the record is written."""
VERSION = "version"
"""Per-step guard: a state tensor outside the contract changed (outcome ``rejection``)."""
CONTRACT = "contract"
"""Event: a segment's contract version came into force (written after each probe)."""
PLAN = "plan"
"""Event: a plan version came into force (``match``) or a re-plan failed (``rejection``)."""

CHECKS = (GRAD, BYTES)
"""Sampled checks of a replay: their ``match`` and ``divergence`` outcomes are what
"checks matched" and "checks diverged" count."""
EVENTS = (CONTRACT, PLAN)
"""Bookkeeping, not checks: their ``match`` means "came into force" and is never counted as a
matched check."""

KINDS = ("check", "event")
"""Values of the ``kind`` filter: ``check`` is every record that is not an event."""

RECORDS_DIR = "replay"
RECORDS_FILE = "records.sqlite"


def default_records_path(root_dir: str | os.PathLike) -> str:
    """Where a ``fit`` run keeps its records: ``<root_dir>/replay/records.sqlite``.

    Example:
        >>> default_records_path("runs/a").replace(os.sep, "/")
        'runs/a/replay/records.sqlite'
    """
    return os.path.join(os.fspath(root_dir), RECORDS_DIR, RECORDS_FILE)


def find_records(run_dir: str | os.PathLike) -> Path:
    """The records database of ``run_dir``: the path itself when it is a file, else a study's
    ``records.sqlite`` or a ``fit`` run's ``replay/records.sqlite``.

    Raises:
        FileNotFoundError: none of these exists.
    """
    p = Path(run_dir)
    for cand in (p, p / RECORDS_FILE, Path(default_records_path(p))):
        if cand.is_file():
            return cand
    raise FileNotFoundError(
        f"no records database at {os.fspath(run_dir)!r}: expected a .sqlite "
        f"file, a study directory with {RECORDS_FILE}, or a fit run "
        f"directory with {RECORDS_DIR}/{RECORDS_FILE}"
    )


COLUMNS = (
    "seq",
    "run_id",
    "step",
    "rank",
    "segment",
    "contract_version",
    "check",
    "outcome",
    "detail",
    "created_at",
)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS records (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id TEXT NOT NULL,
    step INTEGER NOT NULL,
    rank INTEGER NOT NULL,
    segment TEXT NOT NULL,
    contract_version INTEGER NOT NULL,
    "check" TEXT NOT NULL,
    outcome TEXT NOT NULL CHECK (outcome IN ('match', 'rejection', 'divergence')),
    detail TEXT NOT NULL,
    created_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS records_run_step ON records (run_id, step);
"""


@dataclasses.dataclass(frozen=True)
class Record:
    """One execution record (see :data:`OUTCOMES`)."""

    run_id: str
    step: int
    rank: int
    segment: str
    contract_version: int
    check: str
    outcome: str
    detail: str
    created_at: float
    seq: int = 0

    @property
    def is_event(self) -> bool:
        """A contract or plan event (:data:`EVENTS`), not a check."""
        return self.check in EVENTS

    @property
    def is_check(self) -> bool:
        """A check or guard outcome: everything that is not an event."""
        return self.check not in EVENTS

    def to_dict(self) -> dict[str, Any]:
        """The row as stored: ``detail`` a JSON string, ``created_at`` seconds since the epoch."""
        return dataclasses.asdict(self)

    def to_json(self) -> dict[str, Any]:
        """The row for JSON output: ``detail`` parsed (a string when it is not JSON),
        ``created_at`` as ISO 8601 UTC.

        Example:
            >>> j = Record("r", 1, 0, "b0", 1, "grad", "match", '{"a": 1}', 0.0, seq=1).to_json()
            >>> j["detail"], j["created_at"]
            ({'a': 1}, '1970-01-01T00:00:00+00:00')
        """
        d = self.to_dict()
        try:
            d["detail"] = json.loads(self.detail)
        except ValueError:
            pass
        d["created_at"] = datetime.datetime.fromtimestamp(
            self.created_at, datetime.timezone.utc
        ).isoformat(timespec="milliseconds" if self.created_at % 1 else "seconds")
        return d


@dataclasses.dataclass(frozen=True)
class RecordQuery:
    """Which records to read: every field left ``None`` matches everything.

    The one definition of record filtering: :meth:`where` for SQLite, :meth:`matches` for the
    in-memory store, and :func:`query` to run it.

    Args:
        run_id: one run's records.
        outcome: ``match``, ``rejection`` or ``divergence``.
        segment: a segment name (``"*"`` for plan events).
        check: a record kind (:data:`GRAD`, :data:`BYTES`, :data:`VERSION`, :data:`CONTRACT`,
            :data:`PLAN`).
        kind: ``"check"`` (everything but events) or ``"event"`` (:data:`EVENTS`).
        step_from: first step, inclusive.
        step_to: last step, inclusive.
        since_seq: only records appended after this sequence number.
        limit: only the newest ``limit`` matching records (still returned oldest first).
    """

    run_id: str | None = None
    outcome: str | None = None
    segment: str | None = None
    check: str | None = None
    kind: str | None = None
    step_from: int | None = None
    step_to: int | None = None
    since_seq: int = 0
    limit: int | None = None

    def __post_init__(self) -> None:
        if self.outcome is not None and self.outcome not in OUTCOMES:
            raise ValueError(f"RecordQuery(outcome={self.outcome!r}): use one of {list(OUTCOMES)}")
        if self.kind is not None and self.kind not in KINDS:
            raise ValueError(f"RecordQuery(kind={self.kind!r}): use one of {list(KINDS)}")
        if self.limit is not None and (
            isinstance(self.limit, bool) or not isinstance(self.limit, int) or self.limit < 0
        ):
            raise ValueError(
                f"RecordQuery(limit={self.limit!r}) must be an int >= 0 (0 or None: all)"
            )

    def where(self) -> tuple[str, list[Any]]:
        """The SQL condition and its parameters."""
        conds, params = ["seq > ?"], [int(self.since_seq)]
        for col, val in (
            ("run_id", self.run_id),
            ("outcome", self.outcome),
            ("segment", self.segment),
            ('"check"', self.check),
        ):
            if val is not None:
                conds.append(f"{col} = ?")
                params.append(val)
        if self.kind is not None:
            marks = ", ".join("?" for _ in EVENTS)
            conds.append(f'"check" {"IN" if self.kind == "event" else "NOT IN"} ({marks})')
            params.extend(EVENTS)
        if self.step_from is not None:
            conds.append("step >= ?")
            params.append(int(self.step_from))
        if self.step_to is not None:
            conds.append("step <= ?")
            params.append(int(self.step_to))
        return " AND ".join(conds), params

    def matches(self, r: Record) -> bool:
        """Whether ``r`` passes the filters (``limit`` aside)."""
        return (
            r.seq > self.since_seq
            and (self.run_id is None or r.run_id == self.run_id)
            and (self.outcome is None or r.outcome == self.outcome)
            and (self.segment is None or r.segment == self.segment)
            and (self.check is None or r.check == self.check)
            and (self.kind is None or (r.is_event == (self.kind == "event")))
            and (self.step_from is None or r.step >= self.step_from)
            and (self.step_to is None or r.step <= self.step_to)
        )


_SELECT = (
    'SELECT seq, run_id, step, rank, segment, contract_version, "check", outcome, '
    "detail, created_at FROM records"
)


def _row(r: Sequence[Any]) -> Record:
    return Record(
        run_id=r[1],
        step=r[2],
        rank=r[3],
        segment=r[4],
        contract_version=r[5],
        check=r[6],
        outcome=r[7],
        detail=r[8],
        created_at=r[9],
        seq=r[0],
    )


def connect_readonly(path: str | os.PathLike) -> sqlite3.Connection:
    """A read-only connection to a records database.

    Raises:
        RecordsError: the file is not an SQLite database, or holds no ``records`` table.
    """
    what = (
        "pass a records .sqlite file written by lightning_replay, a study directory or a "
        "fit run directory"
    )
    path = os.fspath(path)
    conn = None
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        found = conn.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'records'"
        ).fetchone()
    except sqlite3.DatabaseError as exc:
        if conn is not None:
            conn.close()
        raise RecordsError(f"'{path}' is not a readable records database ({exc}); {what}") from None
    if not found:
        conn.close()
        raise RecordsError(f"'{path}' is an SQLite database without a 'records' table; {what}")
    return conn


def query(
    source: str | os.PathLike | sqlite3.Connection, q: RecordQuery | None = None, **filters: Any
) -> list[Record]:
    """Records of a database (a path, opened read-only, or an open connection), oldest first.

    Args:
        source: the database.
        q: the query; or pass its fields as keywords (``run_id=..., check=GRAD``).

    Raises:
        RecordsError: ``source`` is not a records database.
    """
    q = q if q is not None else RecordQuery(**filters)
    where, params = q.where()
    sql = f"{_SELECT} WHERE {where} ORDER BY seq"
    if q.limit:
        sql = f"SELECT * FROM ({_SELECT} WHERE {where} ORDER BY seq DESC LIMIT ?) ORDER BY seq"
        params = [*params, int(q.limit)]
    if isinstance(source, sqlite3.Connection):
        return [_row(r) for r in source.execute(sql, params).fetchall()]
    conn = connect_readonly(source)
    try:
        return [_row(r) for r in conn.execute(sql, params).fetchall()]
    except sqlite3.DatabaseError as exc:
        raise RecordsError(f"cannot read records from '{os.fspath(source)}': {exc}") from None
    finally:
        conn.close()


def summarize(records: Iterable[Record]) -> list[dict[str, Any]]:
    """Counts per run, kind, check and outcome, in order of first appearance.

    Example:
        >>> recs = [Record("r", s, 0, "b0", 1, "grad", "match", "", 0.0, s) for s in (3, 5)]
        >>> [(r["kind"], r["check"], r["count"], r["last_step"]) for r in summarize(recs)]
        [('check', 'grad', 2, 5)]
    """
    out: dict[tuple[str, str, str], dict[str, Any]] = {}
    for r in records:
        key = (r.run_id, r.check, r.outcome)
        row = out.get(key)
        if row is None:
            out[key] = {
                "run_id": r.run_id,
                "kind": "event" if r.is_event else "check",
                "check": r.check,
                "outcome": r.outcome,
                "count": 1,
                "first_step": r.step,
                "last_step": r.step,
            }
        else:
            row["count"] += 1
            row["first_step"] = min(row["first_step"], r.step)
            row["last_step"] = max(row["last_step"], r.step)
    return list(out.values())


def runs(records: Iterable[Record]) -> list[dict[str, Any]]:
    """The runs in ``records``, oldest first: run id, record count, steps and start time."""
    out: dict[str, dict[str, Any]] = {}
    for r in records:
        row = out.setdefault(
            r.run_id,
            {
                "run_id": r.run_id,
                "records": 0,
                "first_step": r.step,
                "last_step": r.step,
                "started": r.created_at,
            },
        )
        row["records"] += 1
        row["first_step"] = min(row["first_step"], r.step)
        row["last_step"] = max(row["last_step"], r.step)
    return list(out.values())


class RecordStore:
    """Append-only store of :class:`Record` rows.

    Args:
        path: ``None`` keeps records in memory; a file path keeps them in SQLite. An existing
            database is appended to.
        run_id: identifies this run's rows; a fresh id is made when omitted.
        rank: process rank written on every row.

    Example:
        >>> store = RecordStore(None, run_id="demo")
        >>> _ = store.append(step=1, segment="blocks.0", contract_version=1, check="contract",
        ...                  outcome="match", detail="v1")
        >>> [r.outcome for r in store.read()]
        ['match']
    """

    def __init__(
        self, path: str | os.PathLike | None = None, *, run_id: str | None = None, rank: int = 0
    ) -> None:
        self.path = None if path is None else os.fspath(path)
        self.run_id = run_id or uuid.uuid4().hex[:12]
        self.rank = int(rank)
        self._lock = threading.Lock()
        self._memory: list[Record] = []
        self._conn: sqlite3.Connection | None = None
        if self.path is not None:
            self._conn = self._open(self.path)

    @staticmethod
    def _open(path: str) -> sqlite3.Connection:
        parent = os.path.dirname(os.path.abspath(path))
        try:
            os.makedirs(parent, exist_ok=True)
            conn = sqlite3.connect(
                path, timeout=30.0, check_same_thread=False, isolation_level=None
            )
            # Several ranks opening a new file at once: switching to WAL needs a moment alone
            # and sqlite's busy timeout does not cover it, so retry briefly.
            for attempt in range(100):
                try:
                    conn.execute("PRAGMA journal_mode=WAL")
                    break
                except sqlite3.OperationalError as exc:
                    if "locked" not in str(exc) or attempt == 99:
                        raise
                    time.sleep(0.05)
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.executescript(_SCHEMA)
            cols = [row[1] for row in conn.execute("PRAGMA table_info(records)")]
        except (sqlite3.DatabaseError, OSError) as exc:
            raise RecordsError(
                f"records path {path!r} cannot be used as a records database ({exc}). "
                "Pass a writable path to a new file or to an existing lightning_replay records "
                "database, or records=None to keep records in memory."
            ) from exc
        if tuple(cols) != COLUMNS:
            raise RecordsError(
                f"records path {path!r} holds a 'records' table with columns {cols}, not "
                f"{list(COLUMNS)}. Point records at another file."
            )
        return conn

    def append(
        self,
        *,
        step: int,
        segment: str,
        contract_version: int,
        check: str,
        outcome: str,
        detail: str | dict,
        rank: int | None = None,
    ) -> Record:
        """Append one record and return it (with its sequence number)."""
        if outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {OUTCOMES}, got {outcome!r}")
        if not isinstance(detail, str):
            detail = json.dumps(detail, sort_keys=True, default=str)
        rec = Record(
            self.run_id,
            int(step),
            self.rank if rank is None else int(rank),
            segment,
            int(contract_version),
            check,
            outcome,
            detail,
            time.time(),
        )
        with self._lock:
            if self._conn is None:
                rec = dataclasses.replace(rec, seq=len(self._memory) + 1)
                self._memory.append(rec)
                return rec
            try:
                cur = self._conn.execute(
                    'INSERT INTO records (run_id, step, rank, segment, contract_version, "check", '
                    "outcome, detail, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        rec.run_id,
                        rec.step,
                        rec.rank,
                        rec.segment,
                        rec.contract_version,
                        rec.check,
                        rec.outcome,
                        rec.detail,
                        rec.created_at,
                    ),
                )
            except sqlite3.DatabaseError as exc:
                raise RecordsError(
                    f"cannot append to records database {self.path!r}: {exc}"
                ) from exc
            return dataclasses.replace(rec, seq=int(cur.lastrowid))

    # -------------------------------------------------------------- typed writers
    def record_check(
        self,
        *,
        step: int,
        segment: str,
        contract_version: int,
        check: str,
        matched: bool,
        detail: str | dict,
    ) -> Record:
        """A sampled check's outcome (``check`` in :data:`CHECKS`): match or divergence."""
        if check not in CHECKS:
            raise ValueError(f"record_check(check={check!r}): use one of {list(CHECKS)}")
        return self.append(
            step=step,
            segment=segment,
            contract_version=contract_version,
            check=check,
            outcome="match" if matched else "divergence",
            detail=detail,
        )

    def record_rejection(
        self,
        *,
        step: int,
        segment: str,
        contract_version: int,
        detail: str | dict,
        check: str = VERSION,
    ) -> Record:
        """State outside a segment's contract was seen (by default by the version guard)."""
        return self.append(
            step=step,
            segment=segment,
            contract_version=contract_version,
            check=check,
            outcome="rejection",
            detail=detail,
        )

    def record_contract(
        self, *, step: int, segment: str, version: int, detail: str | dict
    ) -> Record:
        """A segment's contract ``version`` came into force."""
        return self.append(
            step=step,
            segment=segment,
            contract_version=version,
            check=CONTRACT,
            outcome="match",
            detail=detail,
        )

    def record_plan(
        self, *, step: int, plan_version: int, detail: str | dict, failed: bool = False
    ) -> Record:
        """Plan ``plan_version`` came into force, or (``failed``) a re-plan was refused and
        that version stays."""
        return self.append(
            step=step,
            segment="*",
            contract_version=plan_version,
            check=PLAN,
            outcome="rejection" if failed else "match",
            detail=detail,
        )

    # -------------------------------------------------------------- reading
    def read(self, q: RecordQuery | None = None, **filters: Any) -> list[Record]:
        """Records in append order, filtered by a :class:`RecordQuery` or its fields as
        keywords (``run_id=``, ``outcome=``, ``segment=``, ``check=``, ``kind=``,
        ``since_seq=``, ...)."""
        q = q if q is not None else RecordQuery(**filters)
        with self._lock:
            if self._conn is not None:
                try:
                    return query(self._conn, q)
                except sqlite3.DatabaseError as exc:
                    raise RecordsError(
                        f"cannot read records database {self.path!r}: {exc}"
                    ) from exc
            rows = [r for r in self._memory if q.matches(r)]
        return rows[-q.limit :] if q.limit else rows

    def counts(self, **filters: Any) -> dict[str, int]:
        """Number of records per outcome (``kind="check"`` leaves contract and plan events
        out)."""
        out = dict.fromkeys(OUTCOMES, 0)
        for r in self.read(**filters):
            out[r.outcome] += 1
        return out

    def __iter__(self) -> Iterator[Record]:
        return iter(self.read())

    def __len__(self) -> int:
        return len(self.read())

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
