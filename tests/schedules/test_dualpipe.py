"""DualPipe, the bidirectional schedule (DeepSeek-V3 report §3.2.1, Fig. 5, Table 2), against
the report's closed forms and torch.distributed.pipelining's DualPipeV (DualPipe cut in half)."""

import json
from itertools import pairwise

import pytest
from click.testing import CliRunner

from shardwise.cli import cli, main
from shardwise.errors import ShardwiseError
from shardwise.schedules import (
    Action,
    get_schedule,
    make_schedule,
    peak_in_flight,
    simulate,
    stage_timeline,
    validate_schedule,
)
from shardwise.schedules.generators import dualpipe
from tests.schedules.test_generators import _pipelining_order

# t_f, t_b (whole backward), t_w with t_f ≠ t_b and t_w ≠ t_b/2, on the line where the forward
# takes as long as the input gradient (t_f = t_b - t_w), the report's own assumption
ON_LINE = [(2.0, 3.0, 1.0), (1.5, 2.5, 1.0), (3.0, 5.0, 2.0)]
CASES = [(4, 8), (4, 14), (6, 12), (8, 20), (8, 32), (16, 32)]


def report_bubble(p, t_f, t_b, t_w):
    """DeepSeek-V3 report Table 2: `(PP/2 - 1)(F&B + B - 3W)`, PP = p ranks, B the whole
    backward; F&B = t_f + t_b in a simulator where the overlap hides no compute."""
    return (p / 2 - 1) * ((t_f + t_b) + t_b - 3 * t_w)


@pytest.mark.parametrize("times", ON_LINE)
@pytest.mark.parametrize(("p", "m"), CASES)
def test_makespan_and_bubble_equal_the_reports_closed_form(p, m, times):
    t_f, t_b, t_w = times
    timeline = stage_timeline("dualpipe", p, m, t_f=t_f, t_b=t_b, t_w=t_w)
    bubble = report_bubble(p, t_f, t_b, t_w)
    # every rank does m/2 micro-batches of each direction through one whole stage each
    assert timeline.makespan == pytest.approx(m * (t_f + t_b) + bubble)
    assert timeline.bubble_fraction == pytest.approx(bubble / timeline.makespan)
    for rank in range(p):  # each rank idles exactly the bubble
        busy = sum(e.end - e.start for e in timeline.events if e.stage == rank)
        assert timeline.makespan - busy == pytest.approx(bubble)
    info = get_schedule("dualpipe")
    assert float(info.bubble(p, 2, m, t_f, t_b, t_w)) == pytest.approx(bubble)


def test_off_the_line_the_critical_path_departs_from_the_report():
    # input gradient longer than the forward (b = 1.8 > f = 1): a forward shorter than the
    # report charges; forward longer (f = 2 > b = 1.2): (p/2-1)(f-b) more
    p = 8
    long_b = stage_timeline("dualpipe", p, 20, t_f=1.0, t_b=2.5, t_w=0.7)
    assert long_b.makespan - 20 * 3.5 == pytest.approx(report_bubble(p, 1.0, 2.5, 0.7) - 1.0)
    long_f = stage_timeline("dualpipe", p, 20, t_f=2.0, t_b=2.1, t_w=0.9)
    assert long_f.makespan - 20 * 4.1 == pytest.approx(
        report_bubble(p, 2.0, 2.1, 0.9) + (p / 2 - 1) * (2.0 - 1.2))


@pytest.mark.parametrize(("p", "m"), CASES)
def test_in_flight_is_the_reports_pp_plus_one_on_every_rank(p, m):
    schedule = make_schedule("dualpipe", p, m)
    # Table 2: activation per device PP + 1 (chunks of one stage's layers), parameters 2×
    assert peak_in_flight(schedule) == (p + 1,) * p
    assert peak_in_flight(schedule, until="W") == (p + 1,) * p
    info = get_schedule("dualpipe")
    assert [int(info.in_flight(p, m, 2, i)) for i in range(p)] == [p + 1] * p
    timeline = stage_timeline("dualpipe", p, m, t_f=2.0, t_b=3.0, t_w=1.0)
    assert timeline.peak_in_flight == (float(p + 1),) * p  # a chunk is a whole micro-batch


@pytest.mark.parametrize(("p", "m"), CASES)
def test_two_directions_fed_from_both_ends(p, m):
    schedule = dualpipe(p, m)
    validate_schedule(schedule, p, m, 2, "v", bidirectional=True)
    assert schedule[0][0] == Action("F", 0, 0) and schedule[p - 1][0] == Action("F", 0, 1)
    for rank in range(p):
        mirror = [Action(a.kind, a.micro_batch, 1 - a.chunk) for a in schedule[p - 1 - rank]]
        assert schedule[rank] == mirror
        forwards = [a for a in schedule[rank] if a.kind == "F"]
        assert len(forwards) == m and {a.micro_batch for a in forwards} == set(range(m // 2))
        assert all(a.kind == "F" and b.kind == "B" for a, b in pairwise(schedule[rank])
                   if a.with_next)


def test_simulated_as_one_pipeline_it_deadlocks():
    # the V's dependencies (chunk 1 continuing chunk 0's micro-batch) cannot run it
    with pytest.raises(ShardwiseError, match="deadlocks"):
        simulate(dualpipe(4, 8), 1.0, 2.0, 1.0, placement="v")


def test_a_backward_before_its_forward_is_refused():
    schedule = dualpipe(4, 8)
    actions = schedule[2]
    first_b = next(k for k, a in enumerate(actions) if a.kind == "B")
    actions.insert(0, actions.pop(first_b))
    with pytest.raises(ShardwiseError, match="comes before"):
        validate_schedule(schedule, 4, 8, 2, "v", bidirectional=True)


@pytest.mark.parametrize(("p", "m"), [(3, 12), (4, 6), (4, 9)])
def test_refuses_odd_ranks_odd_or_too_few_micro_batches(p, m):
    with pytest.raises(ShardwiseError, match="even pp and an even number of micro-batches"):
        make_schedule("dualpipe", p, m)
    assert "even pp" in get_schedule("dualpipe").microbatch_problem(p, m)


def _dualpipev_order(p, m):
    """torch.distributed.pipelining 2.13's `ScheduleDualPipeV` order on every rank."""
    return _pipelining_order("DualPipeV", p, m)


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (4, 10), (8, 20), (8, 22)])
def test_cut_in_half_it_is_pipelinings_dualpipev(p, m):
    # Sea AI Lab's cut-in-half: the first p/2 ranks of DualPipe(p, m) run DualPipeV(p/2, m/2)
    ours, theirs = dualpipe(p, m), _dualpipev_order(p // 2, m // 2)
    for rank in range(p // 2):
        assert ours[rank] == theirs[rank]
        assert [a.with_next for a in ours[rank]] == [a.with_next for a in theirs[rank]]


def test_cli_draws_and_simulates_it(tmp_path, capsys):
    svg = tmp_path / "dualpipe.svg"
    result = CliRunner().invoke(cli, ["schedule", "--schedule", "dualpipe", "-p", "8", "-m",
                                      "20", "--tf", "2", "--tb", "3", "--tw", "1", "--json",
                                      "--svg", str(svg)])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    bubble = report_bubble(8, 2.0, 3.0, 1.0)
    assert out["makespan"] == pytest.approx(20 * 5.0 + bubble)
    assert out["bubble_closed_form"] == pytest.approx(out["bubble_fraction"])
    assert out["peak_in_flight"] == [9.0] * 8
    assert svg.read_text().count("<rect") >= 8 * 20 * 2
    with pytest.raises(SystemExit) as exit_:  # the console entry point: one line, exit 2
        main(["schedule", "--schedule", "dualpipe", "-p", "3", "-m", "12"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "even pp" in err and len(err.strip().splitlines()) == 1


# ------------------------------------------------------------------ memory: two stages per rank
def _stage_memory(schedule, stage, p=4, m=8):
    from shardwise.arch import get_model
    from shardwise.estimate.memory import stage_memory
    from shardwise.layout import Layout, TrainSpec

    model = get_model("deepseek-v2-lite")  # MLA (d_k ≠ d_v), shared experts, a dense layer 0
    train = TrainSpec(seq_len=4096, global_batch=64, impl="torchtitan")
    layout = Layout(pp=p, tp=2, ep=2, dp=4, schedule=schedule,
                    chunks=get_schedule(schedule).default_chunks)
    codes = layout.codes() | {"m": m, "partition": ()}
    return {k: float(v) for k, v in stage_memory(model, train, **codes, stage=stage).items()}


@pytest.mark.parametrize("stage", range(4))
def test_each_rank_holds_two_stages_parameters(stage):
    # rank i holds stage i of one direction and stage p-1-i of the other: 1F1B's two stages,
    # embedding and head included at both ends (DeepSeek-V3 report Table 2: parameters 2×)
    dual, mine, mirror = (_stage_memory("dualpipe", stage), _stage_memory("1f1b", stage),
                          _stage_memory("1f1b", 3 - stage))
    for part in ("weights", "grads", "optimizer"):
        assert dual[part] == pytest.approx(mine[part] + mirror[part], rel=1e-12)
    assert dual["logits"] == pytest.approx(max(mine["logits"], mirror["logits"]))


@pytest.mark.parametrize("stage", [1, 2])
def test_activations_are_pp_plus_one_chunks_of_both_stages(stage):
    # 1F1B holds p-i micro-batches of stage i's layers; DualPipe p+1 chunks, half of each kind
    p = 4
    dual, mine, mirror = (_stage_memory("dualpipe", stage), _stage_memory("1f1b", stage),
                          _stage_memory("1f1b", p - 1 - stage))
    per_mine, per_mirror = mine["activations"] / (p - stage), mirror["activations"] / (stage + 1)
    assert dual["activations"] == pytest.approx((p + 1) * (per_mine + per_mirror) / 2)
    assert dual["in_flight"] == p + 1


# ------------------------------------------------------------------ stacks
def test_no_stack_runs_it_and_the_planner_says_why(capsys):
    from shardwise.schedules.registry import SEARCHED_SCHEDULES
    from shardwise.stacks import STACKS

    assert "dualpipe" not in SEARCHED_SCHEDULES
    assert not any("dualpipe" in stack.schedules() for stack in STACKS.values())
    torch_schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    with pytest.raises(ValueError):  # torch.distributed.pipelining 2.13 has DualPipeV only
        torch_schedules.get_schedule_class("DualPipe")
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "llama3-8b", "--gpus", "64", "--seq", "4096", "--global-batch", "512",
              "--layout", "pp=4,tp=2,schedule=dualpipe,chunks=2"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "not run by any stack" in err
    assert len(err.strip().splitlines()) == 1


def test_pipeline_demo_refuses_it_before_starting_processes():
    from shardwise.demos.pipeline import run_pipeline_demo

    with pytest.raises(ShardwiseError, match="pipeline demo cannot run dualpipe: .*one direction"):
        run_pipeline_demo(ranks=4, schedule="dualpipe")
