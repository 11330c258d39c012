"""`estimate.goodput_sim` against closed forms written here from their sources, in cases
where every term is told apart: several failure classes with different rates, blasts and
restarts; detection time; asynchronous lag; work that is not a whole number of intervals;
spare pools at the threshold (exactly the failure's GPUs, and one short).

Renewal argument used below (Daly 2006's complete model, generalised to a restart `R_i` drawn
with the class of the failure, probability `p_i = λ_i/Λ`, `M = 1/Λ`): a segment of `L = τ+δ`
seconds completes after `(e^{L/M} − 1)` failures on average, each costing the time to the
failure plus the (interruptible) restart phase; the restart phase's mean `X` solves
`X = Σ p_i [M(1 − e^{−R_i/M}) + (1 − e^{−R_i/M}) X]`, so a segment costs on average
`(e^{L/M} − 1)·M / Σ p_i e^{−R_i/M}` (one class: `M e^{R/M}(e^{L/M} − 1)`, Daly's).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from shardwise.errors import ShardwiseError
from shardwise.estimate.goodput_sim import (
    DAY,
    HOUR,
    FailureClass,
    Fleet,
    Policy,
    _spares_wait,
    simulate,
    single_class,
)


def _segments_wall(n: int, segment: float, mtbf: float, restarts: list[float],
                   weights: list[float]) -> float:
    """Mean wall seconds of `n` segments under the renewal argument of the module docstring."""
    p = np.asarray(weights) / np.sum(weights)
    survive_restart = float(np.dot(p, np.exp(-np.asarray(restarts) / mtbf)))
    return n * math.expm1(segment / mtbf) * mtbf / survive_restart


def _young_daly(stall: float, mtbf: float) -> float:
    """Daly (2006) eq. 37: √(2δM)·[1 + ⅓√(δ/2M) + ⅑·δ/2M] − δ for δ < 2M."""
    x = stall / (2 * mtbf)
    return math.sqrt(2 * stall * mtbf) * (1 + math.sqrt(x) / 3 + x / 9) - stall


GPU = FailureClass("gpu", 20_000.0, repair_hours=48.0)
HOST = FailureClass("host", 4_000.0, gpus_each=8, repair_hours=12.0)
SWITCH = FailureClass("switch", 400.0, gpus_each=64, repair_hours=4.0)
FLEET = Fleet(1000, (GPU, HOST, SWITCH), detect_s=90.0)  # 1000 GPUs, 125 hosts, 16 switches


def test_fleet_rates_mtbf_and_counts_by_hand():
    per_hour = [1000 / 20_000, 125 / 4_000, 16 / 400]  # ⌈1000/64⌉ = 16 switches
    np.testing.assert_allclose(FLEET.rates, np.array(per_hour) / 3600, rtol=1e-12)
    assert FLEET.job_mtbf_s == pytest.approx(3600 / sum(per_hour), rel=1e-12)
    assert (GPU.count(1000), HOST.count(1000), SWITCH.count(1000)) == (1000, 125, 16)
    assert HOST.count(1001) == 126 and SWITCH.count(1024) == 16 and SWITCH.count(1025) == 17
    assert (GPU.blast, HOST.blast, SWITCH.blast) == (1, 8, 64)
    assert FailureClass("rack", 1.0, gpus_each=32, blast_gpus=64).blast == 64
    assert FLEET.with_gpus(64).job_mtbf_s == pytest.approx(
        3600 / (64 / 20_000 + 8 / 4_000 + 1 / 400), rel=1e-12)
    assert single_class(512, 1000.0).job_mtbf_s == pytest.approx(1000.0 * 3600 / 512)
    assert (HOUR, DAY) == (3600.0, 86400.0)


@pytest.mark.parametrize(("kind", "lag"), [("sync", 0.0), ("memory", 0.0), ("async", 45.0)])
def test_no_failures_is_work_plus_a_stall_per_started_interval(kind, lag):
    """Work of 10.5 intervals: 11 stalls (the partial interval's too); an asynchronous run
    also waits for its last checkpoint to be durable (the lag), the others do not."""
    fleet = single_class(8, 1e9)
    policy = Policy(kind, interval_s=400.0, stall_s=25.0, lag_s=lag)
    out = simulate(4200.0, fleet, policy, runs=4)
    expected = 4200.0 + 11 * 25.0 + (lag if kind == "async" else 0.0)
    np.testing.assert_allclose(out.wall_s, expected, rtol=1e-12)
    assert out.interval_s == 400.0 and (out.interruptions == 0).all()
    assert out.summary["goodput"]["mean"] == pytest.approx(4200.0 / expected, rel=1e-12)
    assert out.summary["days"]["median"] == pytest.approx(expected / DAY, rel=1e-12)
    assert out.summary["lost_hours"]["p90"] == 0.0


def test_interval_defaults_to_dalys_optimum_or_the_lag():
    fleet = FLEET
    mtbf = fleet.job_mtbf_s
    out = simulate(3600.0, fleet, Policy("sync", stall_s=40.0), runs=2)
    assert out.interval_s == pytest.approx(_young_daly(40.0, mtbf), rel=1e-12)
    # an asynchronous lag longer than Daly's interval: one checkpoint in flight at a time
    long_lag = _young_daly(40.0, mtbf) * 1.5
    out = simulate(3600.0, fleet, Policy("async", stall_s=40.0, lag_s=long_lag), runs=2)
    assert out.interval_s == pytest.approx(long_lag, rel=1e-12)
    # a stall of nothing: Daly's interval is 0, the simulation takes at least a second
    out = simulate(3600.0, fleet, Policy("sync", stall_s=0.0), runs=2)
    assert out.interval_s == 1.0


def test_memory_policy_several_classes_matches_the_renewal_closed_form():
    """In-memory checkpoints stored every interval (storage_every 1, so storage recovery redoes
    no more than memory recovery): GPU and host failures (≤ 8 GPUs) restart from a peer in
    detect + 120 s, a switch failure (64 GPUs) in detect + 4000 s."""
    policy = Policy("memory", interval_s=3000.0, stall_s=50.0, restart_s=4000.0,
                    memory_restart_s=120.0, storage_every=1, peer_gpus=8)
    mtbf, n = FLEET.job_mtbf_s, 200
    work = n * 3000.0
    restarts = [90.0 + 120.0, 90.0 + 120.0, 90.0 + 4000.0]
    closed = _segments_wall(n, 3050.0, mtbf, restarts, list(FLEET.rates))
    out = simulate(work, FLEET, policy, runs=1500, seed=5)
    assert out.wall_s.mean() == pytest.approx(closed, rel=0.01)
    # not degenerate: the classes' restarts matter (all at 210 s, or all at 4090 s, differ)
    fast = _segments_wall(n, 3050.0, mtbf, [210.0], [1.0])
    slow = _segments_wall(n, 3050.0, mtbf, [4090.0], [1.0])
    assert fast < closed * 0.98 and slow > closed * 1.02
    # peer_gpus at a switch's blast (64): every failure recovers from memory
    at = simulate(work, FLEET, Policy("memory", interval_s=3000.0, stall_s=50.0,
                                      restart_s=4000.0, memory_restart_s=120.0,
                                      storage_every=1, peer_gpus=64), runs=1500, seed=5)
    assert at.wall_s.mean() == pytest.approx(fast, rel=0.01)
    # … and one GPU short of a host's blast (7): only GPU failures do
    below = simulate(work, FLEET, Policy("memory", interval_s=3000.0, stall_s=50.0,
                                         restart_s=4000.0, memory_restart_s=120.0,
                                         storage_every=1, peer_gpus=7), runs=1500, seed=5)
    closed7 = _segments_wall(n, 3050.0, mtbf, [210.0, 4090.0, 4090.0], list(FLEET.rates))
    assert below.wall_s.mean() == pytest.approx(closed7, rel=0.01)
    # interruptions: Poisson over the wall time
    assert out.interruptions.mean() == pytest.approx(out.wall_s.mean() / mtbf, rel=0.03)


def test_sync_several_classes_with_detection_is_dalys_model():
    """Synchronous: every class restarts in detect + restart_s; the lost work per failure is
    the segment under way (Daly's model with R = detect + restart and M = 1/Σλ)."""
    policy = Policy("sync", interval_s=2500.0, stall_s=80.0, restart_s=700.0)
    mtbf, n = FLEET.job_mtbf_s, 150
    closed = _segments_wall(n, 2580.0, mtbf, [790.0], [1.0])
    out = simulate(n * 2500.0, FLEET, policy, runs=1500, seed=7)
    assert out.wall_s.mean() == pytest.approx(closed, rel=0.01)
    # lost work per failure: the expected elapsed part of a segment cut by an exponential gap,
    # E[t | t < L] = M − L/(e^{L/M} − 1)
    per_failure = mtbf - 2580.0 / math.expm1(2580.0 / mtbf)
    failures_in_work = n * math.expm1(2580.0 / mtbf)  # failures while a segment runs
    assert out.lost_s.mean() == pytest.approx(per_failure * failures_in_work, rel=0.03)


def test_memory_storage_every_k_rolls_back_to_the_stored_checkpoint():
    """Every failure stops more GPUs than a peer holds (one switch class): recovery is from
    storage, written every 4th interval: one run without failures before the last one shows
    the rollback exactly, on average the redone work grows with k."""
    fleet = Fleet(64, (FailureClass("switch", 2_000.0, gpus_each=64),))
    one = simulate(100 * 1000.0, fleet, Policy("memory", interval_s=1000.0, stall_s=10.0,
                                               storage_every=1, peer_gpus=8), runs=800, seed=2)
    four = simulate(100 * 1000.0, fleet, Policy("memory", interval_s=1000.0, stall_s=10.0,
                                                storage_every=4, peer_gpus=8), runs=800, seed=2)
    # rollback to the last multiple of 4 intervals: on average 1.5 more intervals redone
    extra = (four.lost_s.mean() / four.interruptions.mean()
             - one.lost_s.mean() / one.interruptions.mean())
    assert 1000.0 < extra < 2000.0
    closed = _segments_wall(100, 1010.0, fleet.job_mtbf_s, [600.0], [1.0])
    assert one.wall_s.mean() == pytest.approx(closed, rel=0.015)


# (fleet MTBF-hours, lag, segments, tolerance): a lag under a third of a segment; and one
# nearly a segment long with an MTBF about two segments, where a quarter of the failures land
# in a lag — were the checkpoint in flight counted durable, the wall would be 14 % shorter
# (Daly's model is within 2 % of the simulation there)
@pytest.mark.parametrize(("hours", "lag", "n", "rel"), [(20_000.0, 900.0, 150, 0.01),
                                                        (8_000.0, 2900.0, 60, 0.03)])
def test_async_durability_lag_loses_the_checkpoint_in_flight(hours, lag, n, rel):
    """Asynchronous: a checkpoint becomes durable `L` after its stall; a failure within `L`
    of the last stall rolls back one more segment. Daly's model with `e^{L/M}` on top."""
    fleet = single_class(4096, hours)
    mtbf = fleet.job_mtbf_s
    policy = Policy("async", interval_s=3000.0, stall_s=20.0, lag_s=lag, restart_s=400.0)
    # Daly's complete model with the lag: (M/τ)·e^{(R+L)/M}·(e^{(τ+δ)/M} − 1) per useful second
    closed = (mtbf / 3000.0) * math.exp((400.0 + lag) / mtbf) * math.expm1(
        3020.0 / mtbf) * n * 3000.0
    out = simulate(n * 3000.0, fleet, policy, runs=1500, seed=11)
    assert out.wall_s.mean() == pytest.approx(closed, rel=rel)


def test_elastic_without_slowdown_redoes_nothing():
    """Elastic, repairs instant (no degraded stretch), a host's 8 GPUs of 64-GPU replicas: no
    work is redone and each failure costs detect + the elastic restart (interruptible), so the
    mean wall time is the failure-free time × e^{R/M} (Poisson failures over the work, each
    followed by an expected restart phase of M(e^{R/M} − 1))."""
    fleet = Fleet(1024, (FailureClass("host", 5_000.0, gpus_each=8, repair_hours=1e-9),),
                  detect_s=30.0)
    mtbf = fleet.job_mtbf_s
    policy = Policy("sync", interval_s=3000.0, stall_s=1.0, elastic=True, replica_gpus=64,
                    elastic_restart_s=270.0, restart_s=5000.0)
    work = 100 * 3000.0
    out = simulate(work, fleet, policy, runs=800, seed=4)
    free = work + 100 * 1.0
    assert out.lost_s.max() == 0.0
    assert out.wall_s.mean() == pytest.approx(free * math.exp(300.0 / mtbf), rel=0.01)
    # one replica only: the failure takes the whole job down, a full restart from storage
    whole = simulate(work, Fleet(64, fleet.classes, detect_s=30.0), policy, runs=800, seed=4)
    closed = _segments_wall(100, 3001.0, Fleet(64, fleet.classes).job_mtbf_s, [5030.0], [1.0])
    assert whole.wall_s.mean() == pytest.approx(closed, rel=0.015)
    assert whole.lost_s.mean() > 0


def test_elastic_degraded_speed_by_hand():
    """After each failure a replica of 4 (8 GPUs of 32) is out for the 2 h repair: the next
    window starts after detect + the elastic restart and runs at 3/4 speed for the rest of the
    repair; the work kept is the done work plus the window's work share τ/(τ+δ)."""
    fleet = Fleet(32, (FailureClass("host", 3 * 4.0, gpus_each=8, repair_hours=2.0),),
                  detect_s=20.0)  # a failure every 3 h
    policy = Policy("sync", interval_s=1800.0, stall_s=60.0, elastic=True, replica_gpus=8,
                    elastic_restart_s=100.0)
    trace: list[dict] = []
    simulate(40 * HOUR, fleet, policy, runs=1, seed=3, trace=trace)
    assert len(trace) > 5
    for before, after in itertools.pairwise(trace):
        assert before["pause_after"] == 120.0 and before["recovery"] == "elastic"
        assert after["rate"] == 0.75
        assert after["degraded"] == pytest.approx(max(2 * HOUR - 120.0, 0.0), abs=1e-6)
        kept = before["done"] + before["equiv"] * 1800.0 / 1860.0
        assert before["done_after"] == pytest.approx(min(kept, 40 * HOUR), rel=1e-12)
        window = after["gap"] - after["pause"]
        fast = max(window - after["degraded"], 0.0)
        slow = min(max(window, 0.0), after["degraded"])
        assert after["equiv"] == pytest.approx(0.75 * slow + fast if window > 0 else 0.0,
                                               rel=1e-12, abs=1e-9)
    assert trace[0]["rate"] == 1.0 and trace[0]["degraded"] == 0.0


@pytest.mark.parametrize(("spares", "expected_hours"), [
    (8, [0.0, 9.0, 9.0, 0.0]),    # exactly one failure's GPUs
    (7, [10.0, 10.0, 10.0, 10.0]),  # one short: each waits for its own repair
    (16, [0.0, 0.0, 8.0, 0.0]),  # two failures' worth: the third waits for the first's
])
def test_spares_wait_at_the_threshold(spares, expected_hours):
    """Failures of 8 GPUs at 0, 1, 2 and 12 h, repairs of 10 h, worked by hand: with 8 spares
    the first takes them, the second waits for them to return at 10 h, the third for the
    second failure's GPUs at 11 h, the fourth finds the pool full; with 16 the first two are
    served at once and the third waits for the first's return at 10 h."""
    returns, back = np.full((1, 8), -np.inf), np.zeros((1, 8))
    waits = []
    for now in (0.0, 1.0, 2.0, 12.0):
        w = _spares_wait(returns, back, np.array([0]), np.array([now * HOUR]), np.array([8.0]),
                         np.array([10 * HOUR]), spares)
        waits.append(float(w[0]) / HOUR)
    assert waits == pytest.approx(expected_hours)


def test_spares_in_simulation_at_the_threshold():
    """A pool of exactly one failure's GPUs behaves as unlimited when failures are rarer than
    repairs; one GPU short, every failure waits its whole repair (closed form: restart
    R + repair in Daly's model)."""
    cls = FailureClass("host", 8_000.0, gpus_each=8, repair_hours=0.5)
    policy = Policy("sync", interval_s=2000.0, stall_s=30.0, restart_s=300.0)
    short = simulate(100 * 2000.0, Fleet(256, (cls,), spares=7), policy, runs=1200, seed=9)
    mtbf = Fleet(256, (cls,)).job_mtbf_s
    # waiting for the repair is not interrupted by another failure in the model: it is part
    # of the pause, which a failure during it cuts (a new draw, a new wait)
    closed = _segments_wall(100, 2030.0, mtbf, [300.0 + 1800.0], [1.0])
    assert short.wall_s.mean() == pytest.approx(closed, rel=0.015)
    enough = simulate(100 * 2000.0, Fleet(256, (cls,), spares=8), policy, runs=1200, seed=9)
    plenty = simulate(100 * 2000.0, Fleet(256, (cls,)), policy, runs=1200, seed=9)
    assert enough.wall_s.mean() < short.wall_s.mean()
    assert enough.wall_s.mean() == pytest.approx(plenty.wall_s.mean(), rel=0.01)


@pytest.mark.parametrize(("make", "fragment"), [
    (lambda: FailureClass("gpu", 0.0).validate(), r"^gpu\.mtbf_hours must be"),
    (lambda: FailureClass("gpu", 1.0, gpus_each=0).validate(), r"^gpu\.gpus_each must be"),
    (lambda: FailureClass("gpu", 1.0, blast_gpus=0).validate(), r"^gpu\.blast_gpus must be"),
    (lambda: FailureClass("gpu", 1.0, repair_hours=0.0).validate(),
     r"^gpu\.repair_hours must be"),
    (lambda: FailureClass("gpu", 2e9).validate(), r"^gpu\.mtbf_hours must be"),
    (lambda: Policy("tape").validate(), r"unknown checkpoint policy 'tape'; valid: sync, "
                                        r"async, memory"),
    (lambda: Policy(stall_s=-1.0).validate(), r"^stall_s must be"),
    (lambda: Policy(lag_s=-1.0).validate(), r"^lag_s must be"),
    (lambda: Policy(restart_s=2e7).validate(), r"^restart_s must be"),
    (lambda: Policy(memory_restart_s=-1.0).validate(), r"^memory_restart_s must be"),
    (lambda: Policy(elastic_restart_s=-1.0).validate(), r"^elastic_restart_s must be"),
    (lambda: Policy(interval_s=0.0).validate(), r"^interval_s must be"),
    (lambda: Policy(storage_every=0).validate(), r"^storage_every must be"),
    (lambda: Policy(peer_gpus=0).validate(), r"^peer_gpus must be"),
    (lambda: Policy(replica_gpus=0).validate(), r"^replica_gpus must be"),
    (lambda: Fleet(0, (GPU,)).validate(), r"^gpus must be"),
    (lambda: Fleet(8, ()).validate(), "at least one component class"),
    (lambda: Fleet(8, (FailureClass("nic", -1.0),)).validate(), r"^nic\.mtbf_hours must be"),
    (lambda: Fleet(8, (GPU,), spares=-1).validate(), r"^spares must be"),
    (lambda: Fleet(8, (GPU,), detect_s=-1.0).validate(), r"^detect_s must be"),
    (lambda: Fleet(8, (GPU,), detect_s=2e7).validate(), r"^detect_s must be"),
    (lambda: FailureClass("gpu", 1.0, gpus_each=10**7 + 1).validate(), r"^gpu\.gpus_each"),
    (lambda: FailureClass("gpu", 1.0, blast_gpus=10**7 + 1).validate(), r"^gpu\.blast_gpus"),
    (lambda: Fleet(10**7 + 1, (GPU,)).validate(), r"^gpus must be"),
    (lambda: Fleet(8, (GPU,), spares=10**7 + 1).validate(), r"^spares must be"),
    (lambda: simulate(0.0, FLEET, Policy()), r"^work must be"),
    (lambda: simulate(1.0, FLEET, Policy(), runs=0), r"^runs must be"),
])
def test_each_bad_field_is_named(make, fragment):
    with pytest.raises(ShardwiseError, match=fragment):
        make()


def test_the_edges_of_each_field_are_valid():
    FailureClass("gpu", 1e9, gpus_each=10**7, blast_gpus=10**7, repair_hours=1e6).validate()
    FailureClass("gpu", 1e-6, gpus_each=1, blast_gpus=1, repair_hours=1e-6).validate()
    Policy("async", interval_s=1e9, stall_s=0.0, lag_s=1e7, restart_s=0.0, storage_every=1,
           peer_gpus=1, memory_restart_s=1e7, replica_gpus=10**7, elastic_restart_s=0.0
           ).validate()
    Fleet(10**7, (GPU,), spares=0, detect_s=1e7).validate()
    Fleet(1, (GPU,), spares=10**7, detect_s=0.0).validate()


def test_no_progress_is_one_clear_error():
    """A segment twenty times the job's MTBF: no run finishes (e^-20 per try)."""
    fleet = single_class(60, 1.0)  # a failure every 60 s
    with pytest.raises(ShardwiseError, match="did not finish"):
        simulate(600.0, fleet, Policy("sync", interval_s=600.0, stall_s=600.0), runs=2)


def test_defaults_are_the_documented_policy():
    """docs/concepts/goodput.md: the in-memory policy is Gemini-style, storage every 10th, a
    peer's copy surviving failures of ≤ 8 GPUs, restarting in a fifth of the full restart (as
    the elastic restart does); the full restart is the plan's (`goodput.DEFAULT_RESTART_S`);
    an asynchronous lag, detection and interval are opt-in; a class's blast is its own GPUs."""
    from shardwise.estimate.goodput import DEFAULT_RESTART_S

    p = Policy()
    assert p.kind == "sync" and p.interval_s is None and p.lag_s == 0.0 and not p.elastic
    assert p.restart_s == DEFAULT_RESTART_S
    assert p.memory_restart_s == p.elastic_restart_s == p.restart_s / 5
    assert (p.storage_every, p.peer_gpus, p.replica_gpus) == (10, 8, 8)
    cls = FailureClass("gpu", 1.0)
    assert cls.gpus_each == 1 and cls.blast == 1 and cls.blast_gpus is None
    fleet = Fleet(8, (cls,))
    assert fleet.spares is None and fleet.detect_s == 0.0


def test_timeline_marks_restarts_and_storage_recoveries():
    """A synchronous run's failures recover from storage; every failure but a last one cut
    short is followed by its restart window, however short (here 0.5 s)."""
    from shardwise.estimate.goodput_sim import timeline

    fleet = single_class(4096, 4096 * 3.0)  # a failure every 3 h
    run = timeline(2 * DAY, fleet, Policy("sync", interval_s=1800.0, stall_s=30.0,
                                          restart_s=0.5), seed=1)
    assert run["interruptions"] > 3
    assert {f["recovery"] for f in run["failures"]} == {"storage"}
    assert len(run["restarts"]) == run["interruptions"]
    assert all(b - a == pytest.approx(0.5) for a, b in run["restarts"])
    with pytest.raises(ShardwiseError, match=r"^straggler must be"):
        timeline(3600.0, fleet, Policy(), straggler=0.5)


def test_files_name_what_they_are(tmp_path):
    from shardwise.estimate.goodput_sim import load_failure_model, measured_stragglers

    with pytest.raises(ShardwiseError, match=r"^training run \(shardwise train --json\) "):
        measured_stragglers(tmp_path / "absent.json")
    (tmp_path / "x.json").write_text('{"ranks": 2}')
    with pytest.raises(ShardwiseError, match=r"not the output of `shardwise train --json` "
                                             r"\(records with seconds, ranks\)$"):
        measured_stragglers(tmp_path / "x.json")
    (tmp_path / "f.json").write_text('{"classes": [{"name": "gpu", "mtbf_hours": 1000}], '
                                     '"detect_s": 120, "spares": 3}')
    fleet, policy = load_failure_model(tmp_path / "f.json", 64)
    assert (fleet.detect_s, fleet.spares, fleet.gpus, policy) == (120.0, 3, 64, Policy())
    (tmp_path / "f.json").write_text('[1]')
    with pytest.raises(ShardwiseError, match="a failure model is a JSON object"):
        load_failure_model(tmp_path / "f.json", 64)


def test_the_policies_compared_are_the_documented_ones():
    """`policies` compares, for a layout's copy, write and restart (here 900 s, not the
    default): synchronous (stall = the write), asynchronous (stall = the copy, durable a write
    later), in-memory (stall = the copy, storage every 10th, a failure of ≤ 8 GPUs reloaded
    from a peer in a fifth of the restart) and elastic (replicas of the given GPUs, back in a
    fifth of the restart)."""
    from types import SimpleNamespace

    from shardwise.estimate.goodput_sim import policy_options

    layout = SimpleNamespace(copy_s=3.0, write_s=40.0, restart_s=900.0)
    got = policy_options(layout, replica_gpus=16)
    assert (got["synchronous"].kind, got["synchronous"].stall_s) == ("sync", 40.0)
    assert (got["asynchronous"].stall_s, got["asynchronous"].lag_s) == (3.0, 37.0)
    memory = got["in-memory"]
    assert (memory.kind, memory.stall_s, memory.storage_every, memory.peer_gpus,
            memory.memory_restart_s) == ("memory", 3.0, 10, 8, 180.0)
    elastic = got["elastic"]
    assert (elastic.elastic, elastic.replica_gpus, elastic.elastic_restart_s) == (True, 16, 180.0)
    assert {p.restart_s for p in got.values()} == {900.0}
