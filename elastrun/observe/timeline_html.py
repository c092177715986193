"""``elastrun timeline --html``: the timeline as one self-contained page (inline SVG, no scripts from a CDN).

Runs in: the CLI (``elastrun timeline --html``).

What the page adds to the PNG: hovering a bar, a mark or a worker slot's span shows its exact
times, ranks, outcome or cause in a tooltip (a few lines of inline script; each element also
carries an SVG ``<title>``), and each failure's traceback tail is on the page (the PNG has room for
its first line only).  It lists every fault with what it cost (goodput, docs/observe.md) and every
event mark in tables.  Everything is in the one file, so it can be attached to a ticket or opened
on a machine without network access.
"""

from __future__ import annotations

import dataclasses
import html
import json
from pathlib import Path

from elastrun.observe.goodput import CAUSE_LABELS
from elastrun.observe.timeline import MARK_STYLES, OUTCOME_COLOURS, OUTCOME_LABELS, Timeline
from elastrun.observe.timeline_goodput import CAUSE_COLOURS, cost_text, legend_causes, span_tip

_W, _LEFT, _RIGHT, _LANE, _TOP, _WORLD_H = 1200, 190, 20, 44, 30, 130
#: Height of one worker slot's strip under its node's bars, and the most a lane gives all its strips.
_STRIP, _STRIPS_MAX = 10, 42
_TIP_SCRIPT = """
(function () {
  var tip = document.getElementById("tip");
  function show(ev) {
    var el = ev.target.closest("[data-tip]");
    if (!el) { tip.style.display = "none"; return; }
    tip.textContent = el.getAttribute("data-tip");
    tip.style.display = "block";
    var x = ev.pageX + 14, y = ev.pageY + 14;
    if (x + tip.offsetWidth > window.scrollX + window.innerWidth - 8) { x = ev.pageX - tip.offsetWidth - 14; }
    tip.style.left = x + "px";
    tip.style.top = y + "px";
  }
  document.getElementById("timeline").addEventListener("mousemove", show);
  document.getElementById("timeline").addEventListener("mouseleave", function () { tip.style.display = "none"; });
})();
"""
_SHAPES = {"X": "✖", "v": "▼", "D": "◆", "^": "▲", "s": "■", "P": "✚"}


def model_json(model: Timeline) -> str:
    """The model as JSON (``elastrun timeline --json``): the plotted data, for other tools."""
    return json.dumps(dataclasses.asdict(model), indent=1)


def _x(t: float, span: float) -> float:
    return _LEFT + (_W - _LEFT - _RIGHT) * t / span


def _svg(model: Timeline) -> str:
    span = max(model.duration, 1.0)
    layer = model.goodput
    strips = {n: (min(_STRIPS_MAX, _STRIP * model.nproc.get(n, 1)) if layer is not None else 0) for n in model.lanes}
    y_of: dict[str, float] = {}
    y = float(_TOP)
    for n in model.lanes:
        y_of[n] = y
        y += _LANE + strips[n]
    world_top = y + 40
    height = world_top + _WORLD_H + 40
    e = html.escape
    out = [f'<svg id="timeline" xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{height}" '
           'font-family="sans-serif" font-size="12">']
    step = max(1, round(span / 10))
    for i in range(0, int(span) + 1, step):
        x = _x(i, span)
        out.append(f'<line x1="{x:.1f}" y1="{_TOP - 5}" x2="{x:.1f}" y2="{world_top + _WORLD_H}" stroke="#eee"/>')
        out.append(f'<text x="{x:.1f}" y="{world_top + _WORLD_H + 16}" text-anchor="middle" fill="#555">{i}</text>')
    out.append(f'<text x="{(_LEFT + _W) / 2}" y="{height - 6}" text-anchor="middle" fill="#333">'
               "seconds since the job's first event</text>")
    for r in model.rounds:
        x = _x(r.t, span)
        out.append(f'<line x1="{x:.1f}" y1="{_TOP - 12}" x2="{x:.1f}" y2="{world_top + _WORLD_H}" stroke="#bbb" '
                   f'stroke-dasharray="2,3"><title>round {r.round} closed at {r.t:.2f} s: {r.nodes} node(s), '
                   f"world size {r.world_size}</title></line>")
        out.append(f'<text x="{x:.1f}" y="{_TOP - 14}" text-anchor="middle" fill="#666" font-size="10">'
                   f"R{r.round}</text>")
    for n in model.lanes:
        out.append(f'<text x="{_LEFT - 8}" y="{y_of[n] + _LANE / 2 + 4}" text-anchor="end">'
                   f"<title>{e(n)}</title>{e(model.lane_labels[n])}</text>")
    for a in model.attempts:
        x0, x1 = _x(a.start, span), _x(a.end, span)
        y = y_of[a.node] + 9
        tip = (f"{model.lane_labels[a.node]}: generation {a.generation}, round {a.round}, ranks "
               f"{', '.join(map(str, sorted(a.ranks)))}\n{a.start:.2f} s to {a.end:.2f} s "
               f"({a.end - a.start:.2f} s): {OUTCOME_LABELS[a.outcome]}")
        out.append(f'<rect class="attempt" x="{x0:.1f}" y="{y}" width="{max(x1 - x0, 1.5):.1f}" height="{_LANE - 18}" '
                   f'fill="{OUTCOME_COLOURS[a.outcome]}" stroke="#fff" data-tip="{e(tip)}"><title>{e(tip)}</title>'
                   "</rect>")
        if x1 - x0 > 60:
            out.append(f'<text x="{(x0 + x1) / 2:.1f}" y="{y + (_LANE - 18) / 2 + 4}" text-anchor="middle" '
                       f'fill="#fff" font-weight="bold" pointer-events="none">{e(a.label)}</text>')
    for m in model.marks:
        shape, colour, what = MARK_STYLES[m.kind]
        y = y_of[m.node] + (8 if m.kind != "recovered" else _LANE - 2)
        tip = f"{what} at {m.t:.2f} s on {model.lane_labels[m.node]}: {m.label}" + (f"\n{m.detail}" if m.detail else "")
        out.append(f'<text class="mark" x="{_x(m.t, span):.1f}" y="{y}" text-anchor="middle" fill="{colour}" '
                   f'font-size="15" data-tip="{e(tip)}"><title>{e(tip)}</title>{_SHAPES[shape]}</text>')
    if layer is not None:
        for s in layer.spans:
            if s.node not in y_of:
                continue
            h = strips[s.node] / max(1, model.nproc.get(s.node, 1))
            sy = y_of[s.node] + _LANE - 4 + s.slot * h
            x0, x1 = _x(s.start, span), _x(s.end, span)
            tip = span_tip(s, model.lane_labels[s.node], layer.faults)
            out.append(f'<rect class="cause cause-{s.cause}" x="{x0:.1f}" y="{sy:.1f}" width="{max(x1 - x0, 0.6):.1f}" '
                       f'height="{max(h - 1, 1):.1f}" fill="{CAUSE_COLOURS[s.cause]}" data-tip="{e(tip)}">'
                       f"<title>{e(tip)}</title></rect>")
    top = max([w for _, w in model.world_size] + [c for _, c in model.running] + [1]) + 1

    def y_w(v: float) -> float:
        return world_top + _WORLD_H - _WORLD_H * v / top

    def path(steps: list[tuple[float, int]]) -> str:
        pts, prev = [], None
        for t, v in [*steps, (model.duration, steps[-1][1])]:
            if prev is not None:
                pts.append(f"{_x(t, span):.1f},{y_w(prev):.1f}")
            pts.append(f"{_x(t, span):.1f},{y_w(v):.1f}")
            prev = v
        return " ".join(pts)

    out.append(f'<rect x="{_LEFT}" y="{world_top}" width="{_W - _LEFT - _RIGHT}" height="{_WORLD_H}" '
               'fill="none" stroke="#999"/>')
    for v in range(0, top + 1, max(1, top // 4)):
        out.append(f'<text x="{_LEFT - 8}" y="{y_w(v) + 4:.1f}" text-anchor="end" fill="#555">{v}</text>')
    out.append(f'<text x="{_LEFT - 40}" y="{world_top + _WORLD_H / 2}" text-anchor="end">workers</text>')
    if model.running:
        pts = path(model.running)
        base = f"{_x(model.duration, span):.1f},{y_w(0):.1f} {_x(0, span):.1f},{y_w(0):.1f}"
        out.append(f'<polygon points="{pts} {base}" fill="#56B4E9" fill-opacity="0.35"><title>workers running'
                   "</title></polygon>")
    if model.world_size:
        out.append(f'<polyline points="{path(model.world_size)}" fill="none" stroke="#0072B2" stroke-width="2.5">'
                   "<title>WORLD_SIZE of the latest round</title></polyline>")
    out.append("</svg>")
    return "\n".join(out)


def _swatch(colour: str, label: str) -> str:
    return (f'<span style="background:{colour};width:14px;height:14px;display:inline-block;'
            f'border:1px solid #ccc"></span> {html.escape(label)}')


def _legend(model: Timeline) -> str:
    items = [_swatch(c, OUTCOME_LABELS[o]) for o, c in OUTCOME_COLOURS.items()]
    items += [f'<span style="color:{c}">{_SHAPES[s]}</span> {html.escape(label)}'
              for s, c, label in MARK_STYLES.values()]
    items.append('<span style="color:#0072B2">━</span> WORLD_SIZE of the round')
    items.append('<span style="color:#56B4E9">█</span> workers running')
    text = " &nbsp; ".join(items)
    if model.goodput is not None:
        causes = [_swatch(CAUSE_COLOURS[c], CAUSE_LABELS[c]) for c in legend_causes(model.goodput)]
        text += "<br>Worker slots (the strips under each node): " + " &nbsp; ".join(causes)
    return text


def _goodput_html(model: Timeline) -> str:
    """The goodput summary and the table of faults with what each cost."""
    layer = model.goodput
    e = html.escape
    if layer is None:
        return "<p>Goodput: not computed (see <code>elastrun goodput</code>).</p>"
    rows = []
    for f in layer.faults:
        back = "-" if f.back_after is None else f"{f.back_after:.2f}"
        rows.append(f'<tr class="fault"><td>{f.index + 1}</td><td>{f.t:.2f}</td><td>{e(f.kind)}</td>'
                    f"<td>{e(f.label)}</td><td>{f.detected_after:.2f}</td><td>{back}</td>"
                    f"<td>{f.total:.1f}</td><td>{e(cost_text(f))}</td></tr>")
    table = "".join(rows) or '<tr><td colspan="8">no faults</td></tr>'
    return f"""<p class="goodput"><b>{e(layer.summary)}</b></p>
<h3>Faults and what they cost</h3>
<table id="faults"><tr><th>#</th><th>t (s)</th><th>kind</th><th>fault</th><th>detected after (s)</th>
<th>stepping again after (s)</th><th>cost (worker-s)</th><th>by cause (worker-s)</th></tr>
{table}
</table>"""


def render_html(model: Timeline, path: str | Path) -> Path:
    """Write the page to ``path`` and return the path."""
    e = html.escape
    rows = []
    for m in model.marks:
        detail = f"<pre>{e(m.detail)}</pre>" if m.detail else ""
        rows.append(f"<tr><td>{m.t:.2f}</td><td>{e(model.lane_labels[m.node])}</td>"
                    f"<td>{e(MARK_STYLES[m.kind][2])}</td><td>{e(m.label)}{detail}</td></tr>")
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>elastrun job {e(model.run_id)}</title>
<style>
body {{ font-family: sans-serif; margin: 20px; color: #222; }}
table {{ border-collapse: collapse; margin-top: 12px; }}
td, th {{ border-bottom: 1px solid #ddd; padding: 4px 10px; text-align: left; vertical-align: top; }}
pre {{ margin: 4px 0; font-size: 11px; white-space: pre-wrap; max-width: 900px; }}
.legend {{ font-size: 13px; margin: 8px 0; line-height: 1.8; }}
#tip {{ position: absolute; background: #fffff0; border: 1px solid #888; padding: 5px 8px; font-size: 12px;
       white-space: pre-line; pointer-events: none; max-width: 520px; box-shadow: 2px 2px 6px #0003; }}
</style></head><body>
<h2>elastrun job {e(model.run_id)}</h2>
<p>{len(model.lanes)} node(s), {len(model.rounds)} round(s), {len(model.marks_of("failure"))} worker failure(s),
{len(model.marks_of("node_lost"))} node(s) lost, {model.duration:.1f} s.
Hover a bar, a mark or a worker slot's span for details.</p>
{_goodput_html(model)}
<div class="legend">{_legend(model)}</div>
{_svg(model)}
<h3>Events: faults and recoveries</h3>
<table id="marks"><tr><th>t (s)</th><th>node</th><th>what</th><th>details</th></tr>
{"".join(rows) or '<tr><td colspan="4">none</td></tr>'}
</table>
<div id="tip" style="display:none"></div>
<script>{_TIP_SCRIPT}</script>
</body></html>
"""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    return path
