"""Read an offline wandb run back: history rows, summary, config, metric definitions.

wandb 0.31 writes each run to ``wandb/offline-run-*/run-*.wandb`` and ships no reader for it.
The file is a LevelDB-log-style stream: a 7-byte header (``:W&B``, magic ``0xBEE1``, version 0),
then 32 KiB blocks; inside a block each chunk has a 7-byte header (crc32 as uint32, length as
uint16, type as uint8: FULL=1, FIRST=2, MIDDLE=3, LAST=4) and a chunk never straddles a block
(a block tail shorter than a header is zero padding). Joined chunks are serialized
``wandb.proto.wandb_internal_pb2.Record`` messages.

Example:
    >>> run = read_run(next(Path(tmp).glob("wandb/offline-run-*/run-*.wandb")))  # doctest: +SKIP
    >>> run.history[-1]["replay/plan_version"]  # doctest: +SKIP
    1
"""

from __future__ import annotations

import dataclasses
import json
import struct
import time
import zlib
from pathlib import Path
from typing import Any, Iterator

from wandb.proto import wandb_internal_pb2 as pb

_BLOCK = 32 * 1024
_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


@dataclasses.dataclass
class OfflineRun:
    """What a run logged: ``history`` rows in order, the final ``summary``, ``config``, and
    ``metrics`` (define_metric records, by name)."""

    history: list[dict[str, Any]]
    summary: dict[str, Any]
    config: dict[str, Any]
    metrics: dict[str, dict[str, Any]]
    files: list[str]

    def column(self, key: str) -> list[Any]:
        """Every logged value of ``key``, in order."""
        return [row[key] for row in self.history if key in row]


def iter_records(path: str | Path) -> Iterator[pb.Record]:
    """Yield every ``Record`` in a ``.wandb`` file, verifying each chunk's crc32."""
    data = Path(path).read_bytes()
    if len(data) < _HEADER or data[:4] != b":W&B":
        raise ValueError(f"{path} is not a wandb run file (header {data[:7]!r})")
    magic, version = struct.unpack("<HB", data[4:7])
    if magic != 0xBEE1 or version != 0:
        raise ValueError(f"{path}: unknown wandb file magic {magic:#x} / version {version}")
    pos = _HEADER
    pending = bytearray()
    while pos + _HEADER <= len(data):
        left_in_block = _BLOCK - (pos % _BLOCK)
        if left_in_block < _HEADER:
            pos += left_in_block  # zero padding at the end of a block
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        if crc == 0 and length == 0 and kind == 0:
            # a zero header: padding, or the end of what the writer flushed
            pos += left_in_block
            continue
        payload = data[pos + _HEADER : pos + _HEADER + length]
        if len(payload) < length:
            break  # truncated tail: the run was still being written
        if zlib.crc32(bytes([kind]) + payload) & 0xFFFFFFFF != crc:
            raise ValueError(f"{path}: bad crc in chunk at byte {pos}")
        pos += _HEADER + length
        if kind == _FULL:
            pending = bytearray(payload)
        elif kind == _FIRST:
            pending = bytearray(payload)
            continue
        elif kind == _MIDDLE:
            pending += payload
            continue
        elif kind == _LAST:
            pending += payload
        else:
            raise ValueError(f"{path}: unknown chunk type {kind} at byte {pos}")
        rec = pb.Record()
        rec.ParseFromString(bytes(pending))
        pending = bytearray()
        yield rec


def _item_key(item: Any) -> str:
    return "/".join(item.nested_key) if item.nested_key else item.key


def _value(item: Any) -> Any:
    return json.loads(item.value_json) if item.value_json else None


def _put(row: dict[str, Any], item: Any) -> None:
    """Set an item; a nested key (a logged media object such as a table) becomes a dict."""
    parts = list(item.nested_key) or [item.key]
    for part in parts[:-1]:
        row = row.setdefault(part, {})
    row[parts[-1]] = _value(item)


def read_run(path: str | Path) -> OfflineRun:
    """Read history, summary, config and metric definitions of one offline run file."""
    history: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    config: dict[str, Any] = {}
    metrics: dict[str, dict[str, Any]] = {}
    files: list[str] = []
    for rec in iter_records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            row: dict[str, Any] = {}
            for i in rec.history.item:
                _put(row, i)
            if rec.history.HasField("step"):
                row.setdefault("_step", rec.history.step.num)
            history.append(row)
        elif kind == "summary":
            for i in rec.summary.update:
                _put(summary, i)
            for i in rec.summary.remove:
                summary.pop(_item_key(i), None)
        elif kind == "config":
            for i in rec.config.update:
                config[_item_key(i)] = _value(i)
        elif kind == "metric":
            m = rec.metric
            name = m.name or m.glob_name
            metrics[name] = {
                "step_metric": m.step_metric,
                "summary": {f.name: True for f, v in m.summary.ListFields() if v},
                "glob": bool(m.glob_name),
            }
        elif kind == "files":
            files.extend(f.path for f in rec.files.files)
    return OfflineRun(history, summary, config, metrics, files)


def find_run_file(root: str | Path, timeout: float = 30.0) -> Path:
    """The one ``run-*.wandb`` file under ``root`` (a ``save_dir``), once it is complete.

    ``wandb.finish()`` can return before wandb's service has flushed the file, so this waits
    (up to ``timeout`` seconds) until the run's ``exit`` record is readable.
    """
    found = sorted(
        p for p in Path(root).glob("**/offline-run-*/run-*.wandb") if "latest-run" not in p.parts
    )
    if len(found) != 1:
        raise FileNotFoundError(f"expected one offline run under {root}, found {found}")
    deadline = time.monotonic() + timeout
    while True:
        try:
            if any(r.WhichOneof("record_type") == "exit" for r in iter_records(found[0])):
                return found[0]
        except ValueError:
            pass  # a chunk still being written
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{found[0]} has no exit record after {timeout} s: call "
                "wandb.finish() before reading the run"
            )
        time.sleep(0.1)
