"""The SVG Gantt chart read back with an XML parser and measured against the simulated
timeline it draws: each box where its action runs (x from the axis' own tick labels, so the
chart's scale is read from the chart), one row per stage beside its label, colours and
chunk shades, centred labels, and a time axis of round steps covering the makespan."""

from __future__ import annotations

import itertools
import math
import xml.etree.ElementTree as ET

import pytest

from shardwise.schedules.registry import make_schedule
from shardwise.schedules.render import render_svg
from shardwise.schedules.simulate import simulate

NS = "{http://www.w3.org/2000/svg}"
# interleaved 1F1B p=3, m=6, v=2: unequal F/B times so boxes differ; zb-h1: F, B and W kinds
CASES = [("interleaved", 3, 6, 2, 1.0, 2.5, None), ("zb-h1", 4, 8, 1, 1.5, 3.0, 1.25),
         ("zbv", 3, 6, 2, 2.0, 3.0, 1.0), ("interleaved", 2, 4, 3, 1.0, 2.0, None)]


def _chart(name, p, m, v, t_f, t_b, t_w):
    from shardwise.schedules.registry import get_schedule

    info = get_schedule(name)
    timeline = simulate(make_schedule(name, p, m, v), t_f, t_b, t_w, placement=info.placement)
    return timeline, ET.fromstring(render_svg(timeline, title=name))


def _axis(root):
    """Time → x, read from the tick labels (numbers) under the axis."""
    ticks = [(float(t.text), float(t.get("x"))) for t in root.iter(f"{NS}text")
             if t.get("text-anchor") == "middle" and _number(t.text)]
    ticks = sorted(set(ticks))
    (t0, x0), (t1, x1) = ticks[0], ticks[-1]
    return ticks, x0, (x1 - x0) / (t1 - t0)


def _number(text):
    try:
        float(text)
    except (TypeError, ValueError):
        return False
    return True


@pytest.mark.parametrize("case", CASES)
def test_each_box_is_its_event_on_the_time_axis(case):
    timeline, root = _chart(*case)
    ticks, x0, scale = _axis(root)
    assert ticks[0][0] == 0
    rects = root.findall(f"{NS}rect")
    assert len(rects) == len(timeline.events)
    chunks = 1 + max(e.action.chunk for e in timeline.events)
    rows = {}
    for rect, event in zip(rects, timeline.events, strict=True):
        x, w = float(rect.get("x")), float(rect.get("width"))
        assert x == pytest.approx(x0 + event.start * scale, abs=0.01)
        assert w == pytest.approx((event.end - event.start) * scale, abs=0.01)
        assert rect.get("fill") == {"F": "#4c78a8", "B": "#f58518", "W": "#54a24b"}[
            event.action.kind]
        shade = float(rect.get("fill-opacity"))  # chunk 0 full, the last half
        assert shade == pytest.approx(1 - 0.5 * event.action.chunk / (chunks - 1)
                                      if chunks > 1 else 1, abs=0.005)
        title = rect.find(f"{NS}title").text
        assert title == (f"stage {event.stage}: {event.action} from {event.start:g} to "
                         f"{event.end:g}")
        rows.setdefault(event.stage, set()).add((float(rect.get("y")),
                                                 float(rect.get("height"))))
    # one row per stage, top to bottom, each beside its "stage i" label, rows not overlapping
    assert sorted(rows) == list(range(timeline.stages))
    assert all(len(r) == 1 for r in rows.values())
    tops = [next(iter(rows[s])) for s in range(timeline.stages)]
    assert all(a[0] + a[1] <= b[0] for a, b in itertools.pairwise(tops))
    labels = {t.text: float(t.get("y")) for t in root.iter(f"{NS}text")
              if (t.text or "").startswith("stage ")}
    for stage, (y, h) in enumerate(tops):
        assert y < labels[f"stage {stage}"] < y + h
    # the axis line spans the makespan, under the last row
    line = root.findall(f"{NS}line")[0]
    assert float(line.get("y1")) == float(line.get("y2")) >= tops[-1][0] + tops[-1][1]
    assert float(line.get("x1")) == pytest.approx(x0, abs=0.01)
    assert float(line.get("x2")) == pytest.approx(x0 + timeline.makespan * scale, abs=0.01)
    assert float(root.get("width")) > float(line.get("x2"))
    assert float(root.get("height")) > max(y + h for y, h in tops)


def test_a_small_chart_by_hand():
    """1F1B, p = 2, m = 2, t_f = 1, t_b = 2, worked by hand: stage 0 runs F0, F1 at 0, 1 and
    B0, B1 when stage 1's end (4, 7); stage 1 F0 1, B0 2, F1 4, B1 5; makespan
    (m + p - 1)(t_f + t_b) = 9. The chart: 960 px of time from x = 64 (scale 960/9), rows
    28 px apart from y = 28, boxes 22 px tall; each label's baseline 4 px under its box's
    middle (y + 11 + 4), centred in the box; each "stage i" right-aligned 8 px left of the
    chart (x = 56) on its row's baseline."""
    timeline, root = _chart("1f1b", 2, 2, 1, 1.0, 2.0, None)
    starts = {(0, "F0"): 0, (0, "F1"): 1, (0, "B0"): 4, (0, "B1"): 7,
              (1, "F0"): 1, (1, "B0"): 2, (1, "F1"): 4, (1, "B1"): 5}
    assert timeline.makespan == 9
    scale = 960 / 9
    boxes = {}
    for rect in root.findall(f"{NS}rect"):
        stage, action = rect.find(f"{NS}title").text.split(" from ")[0].split(": ")
        key = (int(stage.removeprefix("stage ")), action)
        x, y = 64 + starts[key] * scale, 28 + 28 * key[0]
        width = (1 if action[0] == "F" else 2) * scale
        assert (float(rect.get("x")), float(rect.get("y"))) == pytest.approx((x, y), abs=0.005)
        assert (float(rect.get("width")), float(rect.get("height"))) == pytest.approx(
            (width, 22), abs=0.005)
        boxes[key] = (x + width / 2, y + 11 + 4)
    assert sorted(boxes) == sorted(starts)
    labels = sorted((t.text, float(t.get("x")), float(t.get("y")))
                    for t in root.iter(f"{NS}text") if t.get("fill") == "white")
    want = sorted((action, x, y) for (_, action), (x, y) in boxes.items())
    assert [text for text, _, _ in labels] == [action for action, _, _ in want]
    assert [c for _, *xy in labels for c in xy] == pytest.approx(
        [c for _, *xy in want for c in xy], abs=0.005)
    stages = [(t.text, float(t.get("x")), float(t.get("y")), t.get("text-anchor"))
              for t in root.iter(f"{NS}text") if (t.text or "").startswith("stage ")]
    assert stages == [("stage 0", 56, 28 + 15, "end"), ("stage 1", 56, 56 + 15, "end")]


@pytest.mark.parametrize("case", CASES)
def test_labels_sit_centred_in_the_boxes_wide_enough(case):
    timeline, root = _chart(*case)
    chunked = any(e.action.chunk for e in timeline.events)
    rects = root.findall(f"{NS}rect")
    boxes = [(float(r.get("x")), float(r.get("width")), float(r.get("y")),
              float(r.get("height")), e) for r, e in zip(rects, timeline.events, strict=True)]
    texts = [(t.text, float(t.get("x")), float(t.get("y"))) for t in root.iter(f"{NS}text")
             if t.get("fill") == "white"]
    assert texts  # the cases' boxes are wide enough for some labels
    for text, x, y in texts:
        inside = [b for b in boxes if b[0] < x < b[0] + b[1] and b[2] < y < b[2] + b[3]]
        assert len(inside) == 1
        bx, bw, _, _, event = inside[0]
        assert x == pytest.approx(bx + bw / 2, abs=0.01)
        by, bh = inside[0][2], inside[0][3]  # the baseline a font's half-height below centre
        assert by + bh / 2 < y <= by + bh / 2 + 5
        want = f"{event.action.kind}{event.action.micro_batch}" + (
            f".{event.action.chunk}" if chunked else "")
        assert text == want
    # a label is drawn exactly where it fits: 6 px a character and 2 px each side
    labelled = {(bx, by) for bx, _, by, _, _ in (next(b for b in boxes if b[0] < x < b[0] + b[1]
                                                   and b[2] < y < b[2] + b[3])
                                              for _, x, y in texts)}
    for bx, bw, by, _, event in boxes:
        label = f"{event.action.kind}{event.action.micro_batch}" + (
            f".{event.action.chunk}" if chunked else "")
        assert ((bx, by) in labelled) == (bw >= 6 * len(label) + 4)


@pytest.mark.parametrize("makespan", [0.37, 7.0, 13.0, 46.0, 95.0, 1234.0])
def test_ticks_are_round_steps_about_ten_over_the_makespan(makespan):
    """Ticks at 0, s, 2s, … up to the makespan, s one of 1, 2, 5 × 10^k: the smallest such
    step giving at most ten intervals (so between 4 and 10 of them)."""
    from shardwise.schedules.actions import Action
    from shardwise.schedules.simulate import Event, Timeline

    event = Event(0, Action("F", 0), 0.0, makespan)
    timeline = Timeline(1, (event,), makespan, 0.0, (1.0,))
    root = ET.fromstring(render_svg(timeline))
    ticks, x0, scale = _axis(root)
    values = [t for t, _ in ticks]
    step = values[1] - values[0]
    mantissa = step / 10 ** math.floor(math.log10(step) + 1e-9)
    assert min(abs(mantissa - k) for k in (1, 2, 5)) < 1e-6
    assert values == pytest.approx([k * step for k in range(len(values))])
    assert values[-1] <= makespan + 1e-9 < values[-1] + step
    assert step >= makespan / 10 - 1e-12
    smaller = step * {1: 0.5, 2: 0.5, 5: 0.4}[round(mantissa)]  # the next round step down
    assert smaller < makespan / 10  # would give more than ten intervals
    assert [round(x, 2) for _, x in ticks] == pytest.approx(
        [round(x0 + t * scale, 2) for t in values], abs=0.011)
    labels = [t.text for t in root.iter(f"{NS}text") if _number(t.text)]
    assert labels == [f"{v:g}" for v in values]


def test_a_bidirectional_schedule_is_drawn_as_simulated_both_ways():
    """DualPipe handed over as actions (not a timeline): the chart simulates it in its two
    directions (`bidirectional`), box for box the timeline `simulate` gives."""
    schedule = make_schedule("dualpipe", 4, 8)
    timeline = simulate(schedule, 1.0, 2.0, 1.0, placement="v", bidirectional=True)
    root = ET.fromstring(render_svg(schedule, placement="v", bidirectional=True))
    _, x0, scale = _axis(root)
    rects = root.findall(f"{NS}rect")
    assert len(rects) == len(timeline.events)
    for rect, event in zip(rects, timeline.events, strict=True):
        assert float(rect.get("x")) == pytest.approx(x0 + event.start * scale, abs=0.01)
        assert float(rect.get("width")) == pytest.approx((event.end - event.start) * scale,
                                                         abs=0.01)
