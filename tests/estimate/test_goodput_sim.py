"""The failure simulation against closed forms it must reproduce where their assumptions hold:
Daly's complete model (one failure class, synchronous or asynchronous checkpoints, restarts
that failures can interrupt), the order statistics of the slowest rank, the spare pool's
waits in a case worked by hand, and each policy's direction and bounds."""

from __future__ import annotations

import json

import numpy as np
import pytest

from shardwise.errors import ShardwiseError
from shardwise.estimate.goodput import daly_interval, wall_per_useful
from shardwise.estimate.goodput_sim import (
    FailureClass,
    Fleet,
    Policy,
    load_failure_model,
    simulate,
    single_class,
    stragglers_factor,
    timeline,
)

DAY = 86400.0


@pytest.mark.parametrize(("kind", "stall", "lag", "restart"), [
    ("sync", 60.0, 0.0, 600.0),     # Llama-3-like: 16,384 GPUs, a failure every ~3 h
    ("sync", 300.0, 0.0, 1800.0),   # long stall and restart: every factor of Daly's distinct
    ("async", 15.0, 240.0, 600.0),  # the durability lag adds e^(L/M)
])
def test_mean_wall_time_equals_dalys_model(kind, stall, lag, restart):
    fleet = single_class(16_384, 50_677.0)
    mtbf = fleet.job_mtbf_s
    policy = Policy(kind, stall_s=stall, lag_s=lag, restart_s=restart)
    tau = float(max(daly_interval(stall, mtbf), lag))
    work = 400 * tau  # whole segments, as Daly's model counts them
    means = [simulate(work, fleet, policy, runs=1000, seed=seed).wall_s.mean()
             for seed in range(3)]
    closed = float(wall_per_useful(tau, stall, mtbf, restart, lag)) * work
    assert np.mean(means) == pytest.approx(closed, rel=0.01)
    # not a degenerate agreement: failures cost real time here (goodput well below 1)
    assert closed / work > 1.05


def test_one_run_without_failures_is_work_plus_stalls():
    fleet = single_class(8, 1e9)  # a failure every 1.25e8 hours: none in a day's work
    out = simulate(3600.0, fleet, Policy("sync", interval_s=600.0, stall_s=30.0), runs=5)
    assert out.wall_s == pytest.approx(np.full(5, 3600.0 + 6 * 30.0))
    assert (out.interruptions == 0).all() and (out.lost_s == 0).all()


def test_component_classes_add_their_rates_and_blast_radius_decides_the_recovery():
    gpu = FailureClass("gpu", 40_000.0, repair_hours=24)
    host = FailureClass("host", 20_000.0, gpus_each=8, repair_hours=12)
    switch = FailureClass("switch", 5_000.0, gpus_each=256, repair_hours=6)
    fleet = Fleet(1024, (gpu, host, switch))
    assert fleet.job_mtbf_s == pytest.approx(3600 / (1024 / 40_000 + 128 / 20_000 + 4 / 5_000))
    work = 30 * DAY
    runs = {kind: simulate(work, fleet, Policy(kind, stall_s=120.0, restart_s=900.0,
                                               memory_restart_s=120.0, peer_gpus=8),
                           runs=400, seed=3)
            for kind in ("sync", "memory")}
    interruptions = runs["sync"].summary["interruptions"]["mean"]
    expected = runs["sync"].wall_s.mean() / fleet.job_mtbf_s  # Poisson: wall / MTBF
    assert interruptions == pytest.approx(expected, rel=0.03)
    # in-memory checkpoints recover GPU and host failures (≤ 8 GPUs) fast, not the switch's
    assert runs["memory"].goodput.mean() > runs["sync"].goodput.mean()
    assert runs["memory"].lost_s.mean() > 0  # switch failures roll back to storage


def test_elastic_continuation_keeps_the_work_and_slows_down():
    fleet = Fleet(1024, (FailureClass("host", 10_000.0, gpus_each=8, repair_hours=2),))
    base = simulate(20 * DAY, fleet, Policy("sync", stall_s=60.0), runs=300, seed=1)
    elastic = simulate(20 * DAY, fleet, Policy("sync", stall_s=60.0, elastic=True,
                                               replica_gpus=64, elastic_restart_s=60.0),
                       runs=300, seed=1)
    assert elastic.lost_s.max() == 0 and base.lost_s.mean() > 0
    assert elastic.goodput.mean() > base.goodput.mean()
    # a degraded hour runs at 15/16 speed: goodput stays below the no-failure bound
    assert elastic.goodput.max() < 1 / (1 + 60.0 / elastic.interval_s)


def test_spares_wait_for_the_pool_or_the_repair():
    # one class, blast 8, repair 10 h, 8 spares: a second failure within 10 h of the first
    # finds no spare and waits for the first repair; none ever waits longer than a repair
    fleet = Fleet(512, (FailureClass("host", 64 * 4.0, gpus_each=8, repair_hours=10),),
                  spares=8)
    unlimited = Fleet(512, fleet.classes)
    policy = Policy("sync", stall_s=30.0, restart_s=300.0)
    short = simulate(5 * DAY, fleet, policy, runs=200, seed=2)
    plenty = simulate(5 * DAY, unlimited, policy, runs=200, seed=2)
    assert short.wall_s.mean() > plenty.wall_s.mean()
    # more spares than failures in flight: the same as unlimited
    many = simulate(5 * DAY, Fleet(512, fleet.classes, spares=8 * 64), policy, runs=200, seed=2)
    assert many.wall_s == pytest.approx(plenty.wall_s)


def test_slowest_rank_is_the_order_statistic():
    # two values, 1.0 and 1.5, equally likely: the max of N draws is 1.5 unless all are 1.0
    for n in (1, 2, 7, 64):
        assert stragglers_factor([1.0, 1.5], n) == pytest.approx(1.5 - 0.5 * 0.5 ** n)
    samples = np.random.default_rng(0).lognormal(0, 0.05, 10_000)
    draws = np.random.default_rng(1).choice(samples, (20_000, 16)).max(axis=1).mean()
    assert stragglers_factor(samples, 16) == pytest.approx(draws, rel=2e-3)


def test_a_failure_model_file_is_read_strictly(tmp_path):
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps({"classes": [
        {"name": "gpu", "mtbf_hours": 50_000},
        {"name": "host", "mtbf_hours": 30_000, "gpus_each": 8}],
        "spares": 16, "policy": {"kind": "memory", "storage_every": 5}}))
    fleet, policy = load_failure_model(path, 256)
    assert (fleet.gpus, len(fleet.classes), fleet.spares, policy.kind) == (256, 2, 16, "memory")
    # per hour: 256 GPUs / 50,000 h + 32 hosts / 30,000 h
    assert fleet.job_mtbf_s == pytest.approx(3600 / (256 / 50_000 + 32 / 30_000))
    for bad, fragment in (({"classes": [], "polcy": {}}, "unknown key"),
                          ({"classes": [{"name": "gpu", "mtbf_hours": -1}]}, "mtbf_hours"),
                          ({"classes": [{"name": "gpu", "mtbf_hours": 10}],
                            "policy": {"kind": "tape"}}, "checkpoint policy"),
                          ({"classes": [{"name": "gpu", "mtbf_hours": 10, "blast": 8}]},
                           "blast")):
        path.write_text(json.dumps(bad))
        with pytest.raises(ShardwiseError, match=fragment):
            load_failure_model(path, 8)


@pytest.mark.parametrize("policy", [
    Policy("sync", stall_s=60.0, restart_s=600.0),
    Policy("async", stall_s=10.0, lag_s=120.0, restart_s=600.0),
    Policy("memory", stall_s=10.0, restart_s=600.0, peer_gpus=8),
])
def test_timeline_redraws_the_same_run_that_simulate_counts(policy):
    """One run's events, rebuilt from its failure times, give `simulate`'s totals for that
    run and seed: the redone stretches (last checkpoint → failure, drawn in wall time) sum to
    its lost work, one failure per interruption, the last window ends at its wall time; and
    between failures checkpoints come every interval + stall (hosts stop 8 GPUs, so the
    in-memory policy also rolls back to storage)."""
    fleet = Fleet(16_384, (FailureClass("gpu", 50_677.0),
                           FailureClass("host", 400_000.0, gpus_each=8, blast_gpus=16)))
    work = 3 * DAY
    t = timeline(work, fleet, policy, runs=20, seed=3)
    out = simulate(work, fleet, policy, runs=20, seed=3)
    assert t["wall_s"] == out.wall_s[0] and t["work"][-1][1] == pytest.approx(out.wall_s[0])
    assert len(t["failures"]) == out.interruptions[0] > 10
    rolled_back = sum(f["lost_s"] for f in t["failures"]) - sum(b - a for a, b in t["lost"])
    if policy.kind == "memory":
        assert rolled_back >= 0
    else:
        assert rolled_back == pytest.approx(0, abs=1e-6)
    assert sum(f["lost_s"] for f in t["failures"]) == pytest.approx(out.lost_s[0])
    ends = np.array(t["checkpoints"])
    for begin, end in t["work"][:-1]:
        inside = ends[(ends > begin) & (ends <= end)]
        expected = begin + np.arange(1, inside.size + 1) * (out.interval_s + policy.stall_s)
        assert inside == pytest.approx(expected)
        assert end - (inside[-1] if inside.size else begin) < out.interval_s + policy.stall_s
    starts = {round(a, 6) for a, _ in t["work"]} | {round(c, 6) for c in t["checkpoints"]}
    assert all(round(a, 6) in starts for a, _ in t["lost"])  # redone from a durable point
    assert all(a < b for a, b in t["restarts"])


def test_timeline_without_failures_checkpoints_every_interval_and_stretches_for_stragglers():
    fleet = single_class(8, 1e9)
    t = timeline(3600.0, fleet, Policy("sync", interval_s=600.0, stall_s=30.0), straggler=1.25)
    # 4,500 s of stretched work: 8 checkpoints (the last after the final 300 s), no failure
    assert t["failures"] == [] and t["lost"] == [] and len(t["checkpoints"]) == 8
    assert t["wall_s"] == pytest.approx(4500 + 8 * 30)
    assert t["goodput"] == pytest.approx(3600 / (4500 + 8 * 30))
    assert t["straggler_share"] == pytest.approx(0.2)


def test_elastic_timeline_redoes_nothing_and_slows_while_replicas_are_out():
    """Elastic continuation: every failure of one GPU leaves 127 of 128 replicas going, so
    nothing is redone; the run's windows and checkpoints end at `simulate`'s wall time, and a
    window that starts while a replica is out checkpoints more slowly than interval + stall."""
    fleet = Fleet(16_384, (FailureClass("gpu", 50_677.0, repair_hours=4.0),))
    policy = Policy("sync", stall_s=60.0, elastic=True, replica_gpus=128)
    t = timeline(2 * DAY, fleet, policy, runs=10, seed=1)
    out = simulate(2 * DAY, fleet, policy, runs=10, seed=1)
    assert t["wall_s"] == out.wall_s[0] and len(t["failures"]) == out.interruptions[0] > 5
    assert t["lost"] == [] and {f["recovery"] for f in t["failures"]} == {"elastic"}
    assert t["checkpoints"][-1] == pytest.approx(out.wall_s[0])
    ends, segment = np.array(t["checkpoints"]), out.interval_s + policy.stall_s
    gaps = np.concatenate([np.diff(ends[(ends > a) & (ends <= b)])
                           for a, b in t["work"][:-1]])  # the last window ends short
    assert gaps.min() == pytest.approx(segment)  # all replicas in
    assert gaps.max() == pytest.approx(segment * 128 / 127)  # one of 128 out: 127/128 speed


def test_policies_run_the_policies_their_contract_names():
    """`policies` against its docstring's contract, each policy built here by hand from the
    layout's copy, write and restart seconds and simulated on its own: synchronous (stall the
    write), asynchronous (stall the copy, lag write − copy), in-memory (storage every 10th, a
    peer reload in a fifth of the restart for ≤ 8 GPUs) and elastic (replicas, a fifth of the
    restart); the slowest rank's factor stretches the work and divides goodput-vs-ideal; the
    job MTBF in hours is the fleet's GPU MTBF over its GPUs."""
    from types import SimpleNamespace

    from shardwise.estimate.goodput_sim import policies

    layout = SimpleNamespace(write_s=90.0, copy_s=15.0, restart_s=600.0, async_checkpoint=True)
    fleet = single_class(4096, 4096 * 6.0)  # a failure every 6 hours
    work, straggler, runs = 5 * DAY, 1.25, 30
    got = policies(layout, fleet, replica_gpus=512, work_s=work, runs=runs, seed=3,
                   straggler=straggler)
    hand = {
        "synchronous": Policy("sync", stall_s=90.0, restart_s=600.0),
        "asynchronous": Policy("async", stall_s=15.0, lag_s=75.0, restart_s=600.0),
        "in-memory": Policy("memory", stall_s=15.0, restart_s=600.0, memory_restart_s=120.0,
                            storage_every=10, peer_gpus=8),
        "elastic": Policy("sync", stall_s=90.0, restart_s=600.0, elastic=True,
                          replica_gpus=512, elastic_restart_s=120.0),
    }
    assert list(got["policies"]) == list(hand)
    for name, policy in hand.items():
        alone = simulate(work * straggler, fleet, policy, runs=runs, seed=3)
        row = got["policies"][name]
        assert row["goodput"] == alone.summary["goodput"] and row["interval_s"] == alone.interval_s
        assert row["goodput_vs_ideal"] == pytest.approx(
            {k: v / straggler for k, v in alone.summary["goodput"].items()})
    means = {name: row["goodput"]["mean"] for name, row in got["policies"].items()}
    best = max(means, key=means.__getitem__)
    assert got["planned"] == "asynchronous" and got["best"] == best
    assert got["gain"] == pytest.approx(means[best] - means["asynchronous"])
    assert got["work_s"] == work * straggler and got["runs"] == runs
    assert got["straggler_factor"] == straggler and got["job_mtbf_hours"] == pytest.approx(6.0)
    assert policies(SimpleNamespace(**(vars(layout) | {"async_checkpoint": False})), fleet,
                    replica_gpus=512, work_s=work, runs=5)["planned"] == "synchronous"


def test_measured_stragglers_by_hand(tmp_path):
    """A `shardwise train --json` output: the warm-up step left out, the rest ÷ their median
    (1.0, 1.2, 0.9, 1.1 s → median 1.05), the ranks each step waited for; three values by hand
    for the slowest of N draws of three samples; bad files and samples refused in one line."""
    from shardwise.estimate.goodput_sim import measured_stragglers

    path = tmp_path / "run.json"
    path.write_text(json.dumps({"ranks": 4, "records": [{"seconds": s} for s in
                                                        (9.0, 1.0, 1.2, 0.9, 1.1)]}))
    samples, ranks = measured_stragglers(path)
    assert ranks == 4
    assert samples.tolist() == pytest.approx([1.0 / 1.05, 1.2 / 1.05, 0.9 / 1.05, 1.1 / 1.05])
    # three samples 1, 2, 4: P(max = 1) = (1/3)^N, P(max <= 2) = (2/3)^N
    for n in (1, 2, 0.5):
        hand = 1 * (1 / 3) ** n + 2 * ((2 / 3) ** n - (1 / 3) ** n) + 4 * (1 - (2 / 3) ** n)
        assert stragglers_factor([4.0, 1.0, 2.0], n) == pytest.approx(hand, rel=1e-12)
    for bad in ([], [1.0, 0.0], [1.0, float("nan")], [-1.0]):
        with pytest.raises(ShardwiseError, match="positive, finite"):
            stragglers_factor(bad, 2)
    for ranks_bad in (0, -1, 1e9):
        with pytest.raises(ShardwiseError, match="ranks"):
            stragglers_factor([1.0, 2.0], ranks_bad)
    for content, message in (({"records": []}, "not the output"),
                             ({"ranks": 2, "records": [{"seconds": 1.0}] * 2}, "at least 3"),
                             ({"ranks": 2, "records": [{"seconds": s} for s in
                                                       (1.0, 1.0, 0.0)]}, "at least 3")):
        path.write_text(json.dumps(content))
        with pytest.raises(ShardwiseError, match=message):
            measured_stragglers(path)
    path.write_text(json.dumps({"ranks": 2, "records": [{"seconds": 1.0}] * 3}))
    assert measured_stragglers(path)[0].tolist() == [1.0, 1.0]


def test_timeline_edges_async_lag_memory_recovery_and_the_default_runs():
    """Work an exact multiple of the interval checkpoints at each interval, the last at the
    end (6, not 7); an asynchronous policy's last save finishes its lag after the work's end
    is reached, so it is drawn `lag` before it; a GPU failure (blast 1 GPU ≤ a peer group of
    8) under the in-memory policy is recovered from memory; `simulate` draws 1,000 runs by
    default."""
    quiet = single_class(8, 1e9)
    exact = timeline(3600.0, quiet, Policy("sync", interval_s=600.0, stall_s=30.0))
    assert len(exact["checkpoints"]) == 6 and exact["wall_s"] == pytest.approx(3600 + 6 * 30)
    lagged = timeline(3600.0, quiet, Policy("async", interval_s=600.0, stall_s=10.0,
                                            lag_s=120.0))
    assert lagged["checkpoints"][-1] == pytest.approx(lagged["work"][-1][1] - 120.0)
    gpus = Fleet(16_384, (FailureClass("gpu", 50_677.0),))
    memory = timeline(3 * DAY, gpus, Policy("memory", stall_s=10.0, restart_s=600.0,
                                            peer_gpus=8), runs=5, seed=3)
    assert memory["failures"] and {f["recovery"] for f in memory["failures"]} == {"memory"}
    assert simulate(3600.0, quiet, Policy("sync", interval_s=600.0, stall_s=30.0)
                    ).wall_s.shape == (1000,)
