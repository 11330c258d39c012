"""ASCII and SVG Gantt charts."""

import xml.etree.ElementTree as ET

from shardwise.schedules import (
    gpipe,
    make_schedule,
    one_f_one_b,
    render_ascii,
    render_svg,
    simulate,
)

SVG = "{http://www.w3.org/2000/svg}"


def test_ascii_gpipe_p2_m2_by_hand():
    # Stage 1 starts one slot late; stage 0's backwards wait for stage 1's.
    assert render_ascii(gpipe(2, 2)) == "0 | F0 F1 .  .  B0 B1\n1 | .  F0 F1 B0 B1 ."


def test_ascii_1f1b_p4_m8_has_p_rows_and_the_warmup_bubble():
    rows = render_ascii(one_f_one_b(4, 8)).splitlines()
    assert len(rows) == 4
    assert rows[0].startswith("0 | F0 F1 F2 F3 .  .  .  B0 F4 B1")
    assert rows[3].startswith("3 | .  .  .  F0 B0 F1 B1")
    assert all(len(row.split("|")[1].split()) == 22 for row in rows)  # makespan 22 slots


def test_ascii_long_actions_continue_with_dashes():
    assert render_ascii(simulate(gpipe(1, 2), 1.0, 2.0)) == "0 | F0 F1 B0 -- B1 --"


def test_ascii_labels_chunks_and_cuts_to_width():
    rows = render_ascii(make_schedule("interleaved", 2, 2, 2), width=20).splitlines()
    assert rows[0] == "0 | F0.0 F1.0 F0.1 >"
    assert all(len(row) <= 20 for row in rows)


def test_ascii_shows_weight_gradients():
    assert render_ascii(make_schedule("zb-h1", 1, 1)) == "0 | F0 B0 W0"


def test_svg_parses_with_one_rect_per_action():
    schedule = make_schedule("zb-h1", 4, 8)
    root = ET.fromstring(render_svg(schedule, title="ZB-H1 <p=4, m=8> & friends"))
    assert root.tag == f"{SVG}svg"
    rects = root.findall(f"{SVG}rect")
    assert len(rects) == sum(len(actions) for actions in schedule.values()) == 96
    assert {r.get("fill") for r in rects} == {"#4c78a8", "#f58518", "#54a24b"}
    texts = [t.text for t in root.iter(f"{SVG}text")]
    assert "ZB-H1 <p=4, m=8> & friends" in texts
    assert {"stage 0", "stage 3", "W7"} <= set(texts)


def test_svg_boxes_scale_with_time():
    timeline = simulate(gpipe(2, 2), 1.0, 3.0)
    rects = ET.fromstring(render_svg(timeline)).findall(f"{SVG}rect")
    widths = sorted({round(float(r.get("width")), 2) for r in rects})
    assert len(widths) == 2
    assert widths[1] == round(3 * widths[0], 2)
