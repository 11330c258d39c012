"""Gantt charts of a schedule: a terminal grid and an SVG, one row per stage (SPEC §6).

Both take a simulated `Timeline`, or a schedule, which they simulate in `placement` (and
`bidirectional`, DualPipe's two directions, `simulate`) with unit
actions (F, B and W take 1: `t_f = 1`, a whole backward `t_b = 2` split as `t_w = 1`). Labels are
kind and micro-batch, e.g. `F3`, with `.chunk` appended when the schedule has several chunks per
stage (`F3.1`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from xml.sax.saxutils import escape

from shardwise.schedules.actions import Action, Placement
from shardwise.schedules.simulate import Event, Timeline, simulate, split_backwards

Source = Timeline | Mapping[int, Sequence[Action]]

_COLOURS = {"F": "#4c78a8", "B": "#f58518", "W": "#54a24b"}
_ROW, _BOX, _LEFT, _TOP, _CHART_WIDTH = 28, 22, 64, 28, 960


def _timeline(source: Source, placement: Placement, bidirectional: bool = False) -> Timeline:
    if isinstance(source, Timeline):
        return source
    split = any(split_backwards(actions) for actions in source.values())
    # unsplit backwards take t_b: 1 like the others when nothing is split
    return simulate(source, 1.0, 2.0 if split else 1.0, 1.0 if split else None,
                    placement=placement, bidirectional=bidirectional)


def _label(action: Action, chunked: bool) -> str:
    return f"{action.kind}{action.micro_batch}" + (f".{action.chunk}" if chunked else "")


def render_ascii(source: Source, width: int | None = None, slot: float | None = None,
                 placement: Placement = "loop", bidirectional: bool = False) -> str:
    """A grid with one row per stage and one cell per `slot` of time (default: the shortest
    action). An action shows its label in its first cell and `-` in the cells it continues into;
    idle cells show `.`; an action shorter than a slot still gets a cell (later ones shift).
    Rows longer than `width` characters are cut and end in `>`.

        0 | F0 F1 F2 F3 .  .  B0 B1 B2 B3          (GPipe, p=2, m=4)
        1 | .  F0 F1 F2 F3 B0 B1 B2 B3 .
    """
    timeline = _timeline(source, placement, bidirectional)
    durations = [d for d in (event.end - event.start for event in timeline.events) if d > 0]
    slot = slot or min(durations, default=1.0)
    chunked = any(event.action.chunk for event in timeline.events)
    cell = max(len(_label(event.action, chunked)) for event in timeline.events)
    # Actions of a stage run one after another: each gets at least one cell, pushed right
    # when rounding to the slot would make it collide with the one before.
    cursor = [0] * timeline.stages
    spans = []
    for event in sorted(timeline.events, key=lambda e: (e.stage, e.start)):
        first = max(round(event.start / slot), cursor[event.stage])
        stop = max(round(event.end / slot), first + 1)
        cursor[event.stage] = stop
        spans.append((event, first, stop))
    slots = max(stop for _, _, stop in spans)
    if width is not None:  # cells past the cut are never shown: not even allocated
        slots = min(slots, width)
    grid = [["."] * slots for _ in range(timeline.stages)]
    for event, first, stop in spans:
        if first < slots:
            grid[event.stage][first] = _label(event.action, chunked)
        for k in range(first + 1, min(stop, slots)):
            grid[event.stage][k] = "-" * cell
    digits = len(str(timeline.stages - 1))
    rows = [f"{stage:>{digits}} | " + " ".join(text.ljust(cell) for text in row).rstrip()
            for stage, row in enumerate(grid)]
    if width is not None:
        rows = [row if len(row) <= width else row[:width - 1] + ">" for row in rows]
    return "\n".join(rows)


def _tick_step(span: float) -> float:
    """A round step (1, 2 or 5 × 10^k) giving about ten ticks over `span`."""
    raw = span / 10
    power = 10 ** math.floor(math.log10(raw))
    return next(step * power for step in (1, 2, 5, 10) if step * power >= raw)


def render_svg(source: Source, title: str | None = None, placement: Placement = "loop",
               bidirectional: bool = False) -> str:
    """An SVG Gantt chart: stages as rows, one `<rect>` per action coloured by kind (F blue,
    B orange, W green; later chunks paler), labelled when wide enough, over a time axis."""
    timeline = _timeline(source, placement, bidirectional)
    chunks = 1 + max(event.action.chunk for event in timeline.events)
    scale = _CHART_WIDTH / timeline.makespan
    height = _TOP + timeline.stages * _ROW + 36
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_LEFT + _CHART_WIDTH + 16}" '
             f'height="{height}" font-family="sans-serif" font-size="10">']
    if title:
        parts.append(f'<text x="{_LEFT}" y="16" font-size="13">{escape(title)}</text>')
    for stage in range(timeline.stages):
        y = _TOP + stage * _ROW + _BOX / 2 + 4
        parts.append(f'<text x="{_LEFT - 8}" y="{y:.1f}" text-anchor="end">stage {stage}</text>')
    for event in timeline.events:
        parts.extend(_svg_box(event, scale, chunks))
    parts.extend(_svg_axis(timeline.makespan, scale, _TOP + timeline.stages * _ROW))
    parts.append("</svg>")
    return "\n".join(parts)


def _svg_box(event: Event, scale: float, chunks: int) -> list[str]:
    x, w = _LEFT + event.start * scale, (event.end - event.start) * scale
    y = _TOP + event.stage * _ROW
    opacity = 1 - 0.5 * event.action.chunk / (chunks - 1) if chunks > 1 else 1
    label = _label(event.action, chunks > 1)
    box = (f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{_BOX}" '
           f'fill="{_COLOURS[event.action.kind]}" fill-opacity="{opacity:.2f}" stroke="white">'
           f'<title>stage {event.stage}: {event.action} from {event.start:g} to {event.end:g}'
           f'</title></rect>')
    if w < 6 * len(label) + 4:
        return [box]
    return [box, f'<text x="{x + w / 2:.2f}" y="{y + _BOX / 2 + 4:.1f}" text-anchor="middle" '
                 f'fill="white">{label}</text>']


def _svg_axis(makespan: float, scale: float, y: float) -> list[str]:
    parts = [f'<line x1="{_LEFT}" y1="{y}" x2="{_LEFT + makespan * scale:.2f}" y2="{y}" '
             f'stroke="black"/>']
    step = _tick_step(makespan)
    for k in range(int(makespan / step + 1e-9) + 1):
        x = _LEFT + k * step * scale
        parts.append(f'<line x1="{x:.2f}" y1="{y}" x2="{x:.2f}" y2="{y + 4}" stroke="black"/>')
        parts.append(f'<text x="{x:.2f}" y="{y + 16}" text-anchor="middle">{k * step:g}</text>')
    parts.append(f'<text x="{_LEFT + makespan * scale / 2:.2f}" y="{y + 30}" '
                 f'text-anchor="middle">time</text>')
    return parts
