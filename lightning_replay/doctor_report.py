"""What :func:`lightning_replay.diagnose` reports, and the report as text, JSON and HTML.

:class:`DoctorReport` gathers, per segment, what its replay depends on
(:class:`SegmentDiagnosis`, :class:`StateUse`) and, per compared run, what differs from plain
training (:class:`CheckpointOutcome`, :class:`GradientDiff`, :class:`StateDiff`). The
measurements that fill it are in :mod:`lightning_replay.doctor`.

Example:
    >>> o = CheckpointOutcome("torch.utils.checkpoint", parameters_compared=4)
    >>> o.summary("torch checkpoint")
    'torch checkpoint is exact on this model'
    >>> CheckpointOutcome("x", error="RuntimeError: boom\\nmore").phrase
    'raises RuntimeError: boom'
"""

from __future__ import annotations

import dataclasses
import html
import math
from typing import Any

from lightning_replay.budget import format_bytes

__all__ = [
    "CheckpointOutcome",
    "DoctorReport",
    "GradientDiff",
    "SegmentDiagnosis",
    "StateDiff",
    "StateUse",
]


@dataclasses.dataclass
class StateUse:
    """One piece of state a segment's forward uses.

    Attributes:
        name: qualified name (``"blocks.0.bn.running_mean"``, ``"blocks.0.gen"``).
        kind: ``parameter``, ``buffer``, ``tensor attribute``, ``external tensor``,
            ``generator`` or ``Python attribute``.
        access: ``reads`` or ``writes`` (the segment itself writes it); for generators
            ``draws``, for Python attributes ``changes``.
        changes_in_window: it changes between the segment's forward and its replay, so a replay
            that does not preserve it sees something else.
        preservation: what ``auto`` keeps of it: ``none``, ``whole`` or ``regions`` (generators
            and Python attributes: ``restored``).
        nbytes: its size (tensors).
        shared_with: other names of the same tensor (held by several modules).
        aliased_input: a segment input is a view of it.
    """

    name: str
    kind: str
    access: str
    changes_in_window: bool = False
    preservation: str = "none"
    nbytes: int = 0
    shared_with: list[str] = dataclasses.field(default_factory=list)
    aliased_input: bool = False


@dataclasses.dataclass
class SegmentDiagnosis:
    """What one segment's replay depends on, from the probe (see :class:`ReplayContract`).

    Attributes:
        name: the segment's qualified name.
        state: the state its forward uses (parameters only when they change in the window or
            the segment writes them; ``parameters`` counts the others).
        parameters: parameters read and left alone.
        uses_global_rng: the forward draws from torch's default generator.
        auto_option: the option ``preservation="auto"`` chooses (``recompute``, ``whole`` or
            ``regions``).
        preserved_bytes: bytes ``auto`` keeps from the forward to the replay.
        options: preserved bytes of every option that honours the contract.
        activation_bytes: activation bytes recomputation frees (saved for backward inside the
            segment, not state).
    """

    name: str
    state: list[StateUse]
    parameters: int
    uses_global_rng: bool
    auto_option: str
    preserved_bytes: int
    options: dict[str, int]
    activation_bytes: int

    @property
    def net_freed_bytes(self) -> int:
        """Activation bytes freed minus the bytes ``auto`` preserves instead."""
        return self.activation_bytes - self.preserved_bytes


@dataclasses.dataclass
class GradientDiff:
    """A parameter whose gradient differs from plain training.

    Attributes:
        name: the parameter's qualified name.
        steps: the steps (from 0) at which it differs.
        max_abs: the largest absolute difference of one element, over those steps.
        max_rel: the largest ``||g - g_ref|| / ||g_ref||`` over those steps (``inf`` when the
            reference gradient is zero).
    """

    name: str
    steps: list[int]
    max_abs: float
    max_rel: float


@dataclasses.dataclass
class StateDiff:
    """A buffer, tensor attribute, generator or Python attribute that differs after the steps.

    Attributes:
        name: qualified name.
        kind: ``buffer``, ``tensor attribute``, ``generator`` or ``Python attribute``.
        reference: its value after plain training (short text).
        observed: its value after the compared run (short text).
        max_abs: the largest absolute element difference (tensors; ``nan`` otherwise).
        max_rel: ``||x - x_ref|| / ||x_ref||`` (tensors; ``nan`` otherwise).
    """

    name: str
    kind: str
    reference: str
    observed: str
    max_abs: float = math.nan
    max_rel: float = math.nan


@dataclasses.dataclass
class CheckpointOutcome:
    """One run compared with plain training over the same steps from the same start.

    Attributes:
        method: what ran (``"torch.utils.checkpoint"``, the model's own checkpointing, or
            ``"lightning_replay"``).
        gradients: parameters whose gradient differs at some step, bit for bit.
        state: non-parameter state that differs after the last step.
        parameters_compared: how many parameter gradients were compared per step.
        error: ``"ExceptionType: message"`` when the run raised; nothing is compared then.
    """

    method: str
    gradients: list[GradientDiff] = dataclasses.field(default_factory=list)
    state: list[StateDiff] = dataclasses.field(default_factory=list)
    parameters_compared: int = 0
    error: str | None = None

    @property
    def exact(self) -> bool:
        """Ran, and every gradient and every piece of state is bit-identical to plain training."""
        return self.error is None and not self.gradients and not self.state

    def summary(self, subject: str) -> str:
        """One line: ``"<subject> is exact on this model"``, ``"... silently differs in N
        gradients and M buffers"`` or ``"... raises <error>"``."""
        return f"{subject} {self.phrase}"

    @property
    def phrase(self) -> str:
        """The verdict without its subject: ``"is exact on this model"``, ..."""
        if self.error is not None:
            return f"raises {first_line(self.error)}"
        if self.exact:
            return "is exact on this model"
        n, m = len(self.gradients), len(self.state)
        return f"silently differs in {n} {plural(n, 'gradient')} and {m} {plural(m, 'buffer')}"


@dataclasses.dataclass
class DoctorReport:
    """The result of :func:`diagnose`. ``verdict`` is one line; ``table()`` is for the terminal,
    ``to_dict()`` for JSON, ``to_html()`` a section for a report page.

    Attributes:
        model: the model's class name.
        steps: training steps each run took.
        segments: the segments diagnosed, in module order.
        segment_origin: where they came from (``segments=...``, the largest block list, the
            model's own checkpointing).
        existing_checkpointing: the checkpointing found inside the model, or ``None``.
        diagnoses: the probe's findings, one per segment that ran.
        torch_checkpoint: torch checkpoint (or the model's own checkpointing) vs plain training.
        replay: ``lightning_replay`` (``preservation="auto"``) vs plain training.
        not_run: segments that never ran in a training step.
        selective_policy: the selective policy the two selective runs used, or ``None``.
        torch_selective: torch's selective checkpoint (same segments, same op list) vs plain
            training, or ``None``.
        replay_selective: ``lightning_replay``'s selective option (``preservation="selective"``)
            vs plain training, or ``None``.
    """

    model: str
    steps: int
    segments: list[str]
    segment_origin: str
    existing_checkpointing: str | None
    diagnoses: list[SegmentDiagnosis]
    torch_checkpoint: CheckpointOutcome
    replay: CheckpointOutcome
    not_run: list[str] = dataclasses.field(default_factory=list)
    selective_policy: str | None = None
    torch_selective: CheckpointOutcome | None = None
    replay_selective: CheckpointOutcome | None = None

    def outcomes(self) -> list[tuple[str, CheckpointOutcome]]:
        """Every compared run with its label, in the order of the methods table."""
        out = [
            (self.torch_checkpoint.method, self.torch_checkpoint),
            ("lightning_replay (preservation='auto')", self.replay),
        ]
        if self.torch_selective is not None:
            out.append((self.torch_selective.method, self.torch_selective))
        if self.replay_selective is not None:
            out.append((self.replay_selective.method, self.replay_selective))
        return out

    def methods_table(self) -> list[str]:
        """One row per compared run: gradients that differ, state that differs, verdict."""
        rows = [("method", "gradients differ", "state differs", "verdict")]
        for label, o in self.outcomes():
            if o.error is not None:
                rows.append((label, "-", "-", f"raises {first_line(o.error, 80)}"))
                continue
            rows.append(
                (
                    label,
                    f"{len(o.gradients)}/{o.parameters_compared}",
                    str(len(o.state)),
                    "exact" if o.exact else "silently differs",
                )
            )
        return _columns(rows)

    @property
    def verdict(self) -> str:
        """``"torch checkpoint is exact on this model"``, ``"torch checkpoint silently differs
        in N gradients and M buffers"`` (buffers: every non-parameter piece of state — buffers,
        tensor attributes, generators, Python attributes) or ``"torch checkpoint raises …"``."""
        return self.torch_checkpoint.summary("torch checkpoint")

    @property
    def activation_bytes(self) -> int:
        return sum(d.activation_bytes for d in self.diagnoses)

    @property
    def preserved_bytes(self) -> int:
        return sum(d.preserved_bytes for d in self.diagnoses)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe (non-finite floats become ``None``)."""
        out = _json_safe(dataclasses.asdict(self))
        out["verdict"] = self.verdict
        out["replay_verdict"] = self.replay.summary("lightning_replay")
        out["torch_checkpoint"]["exact"] = self.torch_checkpoint.exact
        out["replay"]["exact"] = self.replay.exact
        for key in ("torch_selective", "replay_selective"):
            if getattr(self, key) is not None:
                out[key]["exact"] = getattr(self, key).exact
        for d, dd in zip(self.diagnoses, out["diagnoses"]):
            dd["net_freed_bytes"] = d.net_freed_bytes
        return out

    def table(self) -> str:
        """The report as plain text for a terminal."""
        lines = [
            f"lightning-replay doctor: {self.model}, {self.steps} training "
            f"{plural(self.steps, 'step')} per run on copies of the model",
            f"segments: {len(self.segments)} ({self.segment_origin})",
        ]
        if self.existing_checkpointing:
            lines.append(
                f"checkpointing already in the model: {self.existing_checkpointing} — "
                "diagnosed as it stands vs the same model with it turned off"
            )
        lines += [
            "",
            f"verdict: {self.verdict}",
            f"lightning_replay (preservation='auto'): {self.replay.phrase}",
            "",
        ]
        if self.torch_selective is not None or self.replay_selective is not None:
            lines += self.methods_table() + [""]
        rows = [("segment", "auto", "preserved", "activations freed", "state its replay needs")]
        for d in self.diagnoses:
            changing = [s for s in d.state if s.changes_in_window]
            need = ", ".join(f"{s.name} ({s.kind}, {s.preservation})" for s in changing) or "-"
            extra = [s.name for s in d.state if s.kind in ("generator", "Python attribute")]
            if d.uses_global_rng:
                extra.append("global RNG")
            if extra:
                need += "; restores " + ", ".join(extra)
            rows.append(
                (
                    d.name,
                    d.auto_option,
                    format_bytes(d.preserved_bytes),
                    format_bytes(d.activation_bytes),
                    need,
                )
            )
        lines += _columns(rows)
        lines.append(
            f"total: {format_bytes(self.activation_bytes)} of activations freed, "
            f"{format_bytes(self.preserved_bytes)} preserved instead"
        )
        if self.not_run:
            lines.append(f"never ran in a training step (not diagnosed): {', '.join(self.not_run)}")
        lines += ["", "state per segment (reads / writes; * changes between forward and replay):"]
        for d in self.diagnoses:
            lines.append(
                f"  {d.name}: {d.parameters} parameters read"
                + ("" if d.state else ", nothing else")
            )
            for s in d.state:
                mark = "*" if s.changes_in_window else " "
                more = []
                if s.shared_with:
                    more.append("shared with " + ", ".join(s.shared_with))
                if s.aliased_input:
                    more.append("a segment input is a view of it")
                size = f" {format_bytes(s.nbytes)}" if s.nbytes else ""
                lines.append(
                    f"   {mark} {s.name}  {s.kind}, {s.access}{size}"
                    + (f" ({'; '.join(more)})" if more else "")
                )
        method = self.torch_checkpoint.method
        lines += [
            "",
            f"{method} vs plain training ({self.steps} "
            f"{plural(self.steps, 'step')}, identical copies and RNG state):",
        ]
        lines += _outcome_lines(self.torch_checkpoint)
        lines += ["", "lightning_replay vs plain training:"]
        lines += _outcome_lines(self.replay)
        for o in (self.torch_selective, self.replay_selective):
            if o is not None:
                lines += ["", f"{o.method} vs plain training:"]
                lines += _outcome_lines(o)
        return "\n".join(lines)

    def to_html(self) -> str:
        """A self-contained ``<section>`` for an HTML report."""
        e = html.escape
        ok = self.torch_checkpoint.exact
        parts = [
            "<section id='lightning-replay-doctor'>",
            "<h2>lightning-replay doctor</h2>",
            f"<p><b style='color:{'#2a7' if ok else '#c33'}'>{e(self.verdict)}</b><br>"
            f"lightning_replay (preservation='auto'): "
            f"{e(self.replay.phrase)}</p>",
            f"<p>{e(self.model)}, {self.steps} training steps per run on copies; segments "
            f"({e(self.segment_origin)}): {e(', '.join(self.segments))}.</p>",
        ]
        if self.existing_checkpointing:
            parts.append(
                f"<p>Checkpointing already in the model: "
                f"{e(self.existing_checkpointing)} (diagnosed as it stands).</p>"
            )
        parts.append(
            "<table><tr><th>segment</th><th>auto</th><th>preserved</th>"
            "<th>activations freed</th><th>state that changes in the window</th></tr>"
        )
        for d in self.diagnoses:
            changing = (
                ", ".join(
                    f"{s.name} ({s.kind}, {s.preservation})" for s in d.state if s.changes_in_window
                )
                or "-"
            )
            parts.append(
                f"<tr><td>{e(d.name)}</td><td>{e(d.auto_option)}</td>"
                f"<td>{e(format_bytes(d.preserved_bytes))}</td>"
                f"<td>{e(format_bytes(d.activation_bytes))}</td>"
                f"<td>{e(changing)}</td></tr>"
            )
        parts.append("</table>")
        parts.append(
            "<table><tr><th>method</th><th>gradients differ</th><th>state differs</th>"
            "<th>verdict</th></tr>"
        )
        for label, o in self.outcomes():
            cells = (
                ("-", "-", f"raises {first_line(o.error, 80)}")
                if o.error is not None
                else (
                    f"{len(o.gradients)}/{o.parameters_compared}",
                    str(len(o.state)),
                    "exact" if o.exact else "silently differs",
                )
            )
            parts.append(
                f"<tr><td>{e(label)}</td>" + "".join(f"<td>{e(c)}</td>" for c in cells) + "</tr>"
            )
        parts.append("</table>")
        for title, outcome in (
            (f"{self.torch_checkpoint.method} vs plain training", self.torch_checkpoint),
            ("lightning_replay vs plain training", self.replay),
            *(
                (f"{o.method} vs plain training", o)
                for o in (self.torch_selective, self.replay_selective)
                if o is not None
            ),
        ):
            parts.append(
                f"<h3>{e(title)}</h3><pre>" + e("\n".join(_outcome_lines(outcome))) + "</pre>"
            )
        parts.append("</section>")
        return "\n".join(parts)


# ------------------------------------------------------------------------------ text
def _outcome_lines(o: CheckpointOutcome, limit: int = 12) -> list[str]:
    if o.error is not None:
        return [f"  raises {first_line(o.error, 300)}"]
    if o.exact:
        return [
            f"  exact: all {o.parameters_compared} parameter gradients bit-identical at "
            "every step, and every buffer, tensor attribute, generator and Python attribute "
            "identical after the last step"
        ]
    lines = []
    if o.gradients:
        lines.append(f"  {len(o.gradients)} of {o.parameters_compared} parameter gradients differ:")
        for g in o.gradients[:limit]:
            lines.append(
                f"    {g.name}: steps {','.join(map(str, g.steps))}, max rel err "
                f"{_num(g.max_rel)}, max abs diff {_num(g.max_abs)}"
            )
        if len(o.gradients) > limit:
            lines.append(f"    ... and {len(o.gradients) - limit} more")
    if o.state:
        lines.append(
            f"  {len(o.state)} {plural(len(o.state), 'buffer or attribute', 'buffers or attributes')} differ "
            "after the last step:"
        )
        for s in o.state[:limit]:
            err = "" if math.isnan(s.max_rel) else f" (max rel err {_num(s.max_rel)})"
            lines.append(
                f"    {s.name} ({s.kind}): plain {s.reference}, this run {s.observed}{err}"
            )
        if len(o.state) > limit:
            lines.append(f"    ... and {len(o.state) - limit} more")
    return lines


def _columns(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in rows]


def _num(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.3g}"


def plural(n: int, word: str, many: str | None = None) -> str:
    """``word`` or its plural for ``n`` things."""
    return word if n == 1 else (many or word + "s")


def first_line(s: str, limit: int = 160) -> str:
    """The first line of ``s`` (an error message), cut to ``limit`` characters."""
    line = s.strip().splitlines()[0] if s.strip() else s
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj
