"""Execution records: one row per check or contract event, append-only, never dropped.

Records live in memory (``path=None``) or in SQLite (WAL mode, one commit per row, so a killed
process loses at most the row being written).
"""
from __future__ import annotations

import dataclasses
import json
import os
import sqlite3
import threading
import time
import uuid
from typing import Any, Iterable, Iterator

from lightning_replay.errors import RecordsError

OUTCOMES = ("match", "rejection", "divergence")
"""``match``: a check or contract held. ``rejection``: state outside the contract was seen and the
contract was withdrawn (the segment is retained until re-probed). ``divergence``: a check found a
replay that differs from the reference."""

COLUMNS = ("seq", "run_id", "step", "rank", "segment", "contract_version", "check", "outcome",
           "detail", "created_at")

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

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


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

    def __init__(self, path: str | os.PathLike | None = None, *, run_id: str | None = None,
                 rank: int = 0) -> None:
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
            conn = sqlite3.connect(path, timeout=30.0, check_same_thread=False,
                                   isolation_level=None)
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

    def append(self, *, step: int, segment: str, contract_version: int, check: str,
               outcome: str, detail: str | dict, rank: int | None = None) -> Record:
        """Append one record and return it (with its sequence number)."""
        if outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {OUTCOMES}, got {outcome!r}")
        if not isinstance(detail, str):
            detail = json.dumps(detail, sort_keys=True, default=str)
        rec = Record(self.run_id, int(step), self.rank if rank is None else int(rank), segment,
                     int(contract_version), check, outcome, detail, time.time())
        with self._lock:
            if self._conn is None:
                rec = dataclasses.replace(rec, seq=len(self._memory) + 1)
                self._memory.append(rec)
                return rec
            try:
                cur = self._conn.execute(
                    'INSERT INTO records (run_id, step, rank, segment, contract_version, "check", '
                    "outcome, detail, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (rec.run_id, rec.step, rec.rank, rec.segment, rec.contract_version,
                     rec.check, rec.outcome, rec.detail, rec.created_at))
            except sqlite3.DatabaseError as exc:
                raise RecordsError(f"cannot append to records database {self.path!r}: {exc}") \
                    from exc
            return dataclasses.replace(rec, seq=int(cur.lastrowid))

    def read(self, *, run_id: str | None = None, outcome: str | None = None,
             segment: str | None = None, since_seq: int = 0) -> list[Record]:
        """Records in append order, optionally filtered."""
        with self._lock:
            if self._conn is None:
                rows: Iterable[Record] = self._memory
            else:
                cur = self._conn.execute(
                    'SELECT seq, run_id, step, rank, segment, contract_version, "check", outcome, '
                    "detail, created_at FROM records WHERE seq > ? ORDER BY seq", (since_seq,))
                rows = [Record(run_id=r[1], step=r[2], rank=r[3], segment=r[4],
                               contract_version=r[5], check=r[6], outcome=r[7], detail=r[8],
                               created_at=r[9], seq=r[0]) for r in cur.fetchall()]
        return [r for r in rows
                if r.seq > since_seq
                and (run_id is None or r.run_id == run_id)
                and (outcome is None or r.outcome == outcome)
                and (segment is None or r.segment == segment)]

    def counts(self, **filters: Any) -> dict[str, int]:
        """Number of records per outcome."""
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
