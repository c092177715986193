"""The goodput layer of ``elastrun timeline``: every worker slot's time coloured by cause, and each fault's cost.

Runs in: the CLI (``elastrun timeline``).

:func:`goodput_layer` turns a :class:`~elastrun.observe.goodput.Goodput` into what the picture
and the HTML page draw: a strip per worker slot under its node's attempt bars, with spans merged
for drawing (a span shorter than a pixel or so joins its neighbour; the totals stay exact), and a
table of faults with what each cost.  :func:`draw_strips` draws the strips with matplotlib.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from elastrun.observe.goodput import CAUSE_LABELS, CAUSES, Goodput
from elastrun.observe.goodput_report import SHORT, summary_line

#: Cause → colour (Okabe-Ito where it has enough; kept apart from the attempt outcomes by the legend).
CAUSE_COLOURS = {
    "good": "#009E73",
    "startup": "#CC79A7",
    "rendezvous": "#56B4E9",
    "detection": "#E69F00",
    "restart": "#0072B2",
    "restore": "#F0E442",
    "redone": "#D55E00",
    "commit": "#8C8C8C",
    "hang": "#7F0000",
    "idle": "#D9D9D9",
    "unknown": "#F2F2F2",
}


@dataclass
class CauseSpan:
    """A drawn interval of one worker slot (seconds since the job's first event)."""

    node: str
    slot: int
    start: float
    end: float
    cause: str
    fault: int | None
    detail: str
    #: Seconds of commit inside a goodput span (its steps' ``commit()`` calls).
    inner: float = 0.0


@dataclass
class FaultCost:
    """One fault as the page lists it (times in seconds since the job's first event)."""

    index: int
    t: float
    kind: str
    node: str
    label: str
    detected_after: float
    back_after: float | None
    total: float
    cost: dict[str, float]


@dataclass
class GoodputLayer:
    """Everything the timeline adds for goodput."""

    ratio: float | None
    wall_ratio: float | None
    basis: str
    summary: str
    good: float
    badput: dict[str, float]
    spans: list[CauseSpan] = field(default_factory=list)
    faults: list[FaultCost] = field(default_factory=list)


def goodput_layer(gp: Goodput, t0: float, min_width: float) -> GoodputLayer:
    """The layer for a timeline whose time 0 is ``t0``; spans under ``min_width`` s join a neighbour."""
    layer = GoodputLayer(gp.ratio, gp.wall_ratio, gp.basis, summary_line(gp), gp.good, dict(gp.badput))
    by_slot: dict[tuple[str, int], list[CauseSpan]] = {}
    for s in sorted(gp.spans, key=lambda s: (s.node, s.slot, s.start)):
        row = by_slot.setdefault((s.node, s.slot), [])
        span = CauseSpan(s.node, s.slot, s.start - t0, s.end - t0, s.cause, s.fault, s.detail, s.inner)
        if row and row[-1].cause == span.cause and row[-1].fault == span.fault and span.start - row[-1].end < 1e-3:
            row[-1].end = span.end
            row[-1].detail = _merged(row[-1].detail, span.detail)
            row[-1].inner += span.inner
        elif row and span.end - span.start < min_width and span.start - row[-1].end < 1e-3:
            row[-1].end = span.end  # too narrow to see: its neighbour takes it (totals are exact elsewhere)
        else:
            row.append(span)
    for row in by_slot.values():
        layer.spans.extend(row)
    for f in gp.faults:
        layer.faults.append(FaultCost(f.index, f.at - t0, f.kind, f.node, f.label, f.detected - f.at,
                                      None if f.back is None else f.back - f.at, f.total, dict(f.cost)))
    return layer


def _merged(first: str, last: str) -> str:
    """The detail of two merged spans: ``step 3`` and ``step 9`` make ``steps 3-9``."""
    if first.startswith("step") and last.startswith("step"):
        low = first.split()[1].split("-")[0].rstrip(",")
        high = last.split()[1].split("-")[-1].rstrip(",")
        return f"steps {low}-{high}"
    return first if first == last else first


def span_tip(span: CauseSpan, lane_label: str, faults: list[FaultCost]) -> str:
    """The hover text of a span: slot, cause, exact times, the fault behind it."""
    fault = next((f for f in faults if f.index == span.fault), None)
    why = f"\ncaused by fault {fault.index + 1}: {fault.label} at {fault.t:.2f} s" if fault else ""
    return (f"{lane_label}, worker slot {span.slot}: {CAUSE_LABELS.get(span.cause, span.cause)}\n"
            f"{span.start:.2f} s to {span.end:.2f} s ({span.end - span.start:.2f} s)"
            + (f"\n{span.detail}" if span.detail else "")
            + (f"\nof which {span.inner:.2f} s in commit()" if span.inner >= 0.005 else "") + why)


def cost_text(f: FaultCost) -> str:
    """A fault's cost by cause, largest first."""
    return ", ".join(f"{SHORT.get(c, c)} {v:.1f} s" for c, v in sorted(f.cost.items(), key=lambda cv: -cv[1])
                     if v >= 0.05) or "none"


def draw_strips(ax: Any, layer: GoodputLayer, y_of: dict[str, float], nproc: dict[str, int], top: float,
                height: float) -> None:
    """Draw each node's slot strips in ``[y - top - height, y - top]`` of its lane (matplotlib axes)."""
    for s in layer.spans:
        if s.node not in y_of:
            continue
        n = max(1, nproc.get(s.node, 1))
        h = height / n
        y = y_of[s.node] - top - (s.slot + 1) * h
        ax.broken_barh([(s.start, max(s.end - s.start, 1e-6))], (y, h * 0.9), facecolors=CAUSE_COLOURS[s.cause],
                       edgecolors="none")


def legend_causes(layer: GoodputLayer) -> list[str]:
    """The causes present in the layer, in the documented order (good first)."""
    present = {s.cause for s in layer.spans}
    return [c for c in ("good", *CAUSES) if c in present]
