"""`estimate.expert.ep_time` per dispatcher and overlap against the collectives written out
by hand from the dispatchers' code (Megatron-Core 0.16.1 token_dispatcher.py: alltoall with
the routing probabilities beside each copy, the counts all-gathered over tp·ep, the
expert-TP all-gather / reduce-scatter; allgather: tokens, probabilities and routing map over
tp·ep; flex: DeepEP's RDMA and NVLink copies; torchtitan 0.3.0: its own shard and count
exchange), the SM-share rule of `paired` written out again here. Every term distinct: top-4
of 16 experts, shared experts, tp = etp = 2 with ep = 4 over 2 nodes, λ ≠ 1, full
recompute's replay, m micro-batches. The collective cost of one call
(`links.group_collective_time`, tested in test_comm.py) is the building block."""

from __future__ import annotations

from dataclasses import replace
from math import comb

import numpy as np
import pytest

from shardwise.arch import ModelSpec
from shardwise.calibration import default_calibration
from shardwise.estimate.expert import (
    COMM_SMS,
    FP8_DISPATCH_BYTES,
    ep_time,
    ep_volumes,
    gpus_reached,
    nodes_reached,
    paired,
)
from shardwise.estimate.kernels import ComputeContext, linear
from shardwise.estimate.links import Links
from shardwise.estimate.links import group_collective_time as coll
from shardwise.estimate.step import estimate_step
from shardwise.hardware import Cluster, get_accelerator
from shardwise.layout import Layout, TrainSpec

MOE = ModelSpec(name="ep-moe", n_layers=4, d_model=256, n_heads=8, n_kv_heads=4, d_ff=512,
                vocab=512, max_seq=2048, n_experts=16, top_k=4, d_ff_expert=96,
                n_shared_experts=2).validate()
H100 = get_accelerator("h100")
SEQ, B, LOAD = 2048, 2, 1.3
T, ET, E, EP_IN_NODE, FULL, N_MOE, M = 2, 2, 4, 2, 1, 3, 8  # ep 4 over 2 nodes


def _setup(**train):
    spec = TrainSpec(seq_len=SEQ, expert_load=LOAD, **train)
    ctx = ComputeContext.of(MOE, H100, spec)
    links = Links.of(Cluster.of(16, H100), default_calibration(H100.calibration_name))
    return ctx, links, spec


def _run(ctx, links, spec, work_f=0.0, work_b=0.0, sp=1, full=FULL, c=1):
    return ep_time(ctx, links, spec, t=T, c=c, b=B, sp=sp, e=E, etp=ET, full=full,
                   n_moe=N_MOE, ep_in_node=EP_IN_NODE, m=M, work_f=work_f, work_b=work_b)


# the SMs the overlapped all-to-all kernels take: 20 of the H800's 132 (DeepSeek-V3 technical
# report §3.2.2), the figure `expert.COMM_SMS` cites
def _paired(comm: float, work: float, sms: float = 132, busy: float = 20) -> float:
    return comm if comm * (sms - busy) / sms >= work else work + comm * busy / sms


def _megatron_alltoall(links, tokens: float, ep_in_node: int = EP_IN_NODE
                       ) -> tuple[float, float]:
    """(forward, backward pass without the count exchange) of one layer, Megatron."""
    h, ab = 256, 2
    rows = tokens * 4 * LOAD
    gather = ET * rows * h * ab
    passes = (coll("all-to-all", rows * (h * ab + ab), E, ep_in_node, links)
              + coll("all-to-all", rows * h * ab, E, ep_in_node, links)
              + coll("all-gather", gather, ET, ET, links)
              + coll("reduce-scatter", gather, ET, ET, links))
    counts = coll("all-gather", 8.0 * 16 * ET * E, ET * E, min(ET * E, 8), links)
    return passes + counts, passes


@pytest.mark.parametrize("sp", [1, 0])
def test_megatron_alltoall_with_expert_tp(sp):
    """Megatron routes each rank's sequence shard under SP (T/t rows), else all T; each
    routed copy carries its probability (the router's dtype); the expert-TP all-gather
    after the dispatch, reduce-scatter before the combine; the counts (8 bytes per expert)
    all-gathered over tp·ep before the forward's dispatch only; the backward replays the
    passes, and full recompute the whole forward again."""
    ctx, links, spec = _setup(impl="megatron-te")
    fwd, bwd = _megatron_alltoall(links, SEQ * B / (T if sp else 1))
    f, b = _run(ctx, links, spec, sp=sp)
    assert f == pytest.approx(N_MOE * fwd, rel=1e-12)
    assert b == pytest.approx(N_MOE * (bwd + FULL * fwd), rel=1e-12)
    f0, b0 = _run(ctx, links, spec, sp=sp, full=0)
    assert (f0, b0) == pytest.approx((N_MOE * fwd, N_MOE * bwd), rel=1e-12)


def test_the_step_routes_megatrons_sequence_shard():
    """`estimate_step` hands SP on to the dispatcher: Megatron under SP with tp = etp = 2,
    ep = 4 on 16 GPUs (the EP group ranks 0, 2, 4, 6: one node), one stage, no recompute:
    each of the m = 64 / (2·8) micro-batches pays its 4 MoE layers' forward and backward
    passes over T/t rows."""
    links = _setup()[1]
    spec = TrainSpec(seq_len=SEQ, expert_load=LOAD, impl="megatron-te", global_batch=64)
    layout = Layout.parse(f"tp={T},ep={E},etp={ET},dp=8,sp=1,micro_batch={B}")
    step = estimate_step(MOE, Cluster.of(16, H100), layout, spec)
    fwd, bwd = _megatron_alltoall(links, SEQ * B / T, ep_in_node=E)
    assert step.ep_comm == pytest.approx(4 * MOE.n_moe_layers * (fwd + bwd), rel=1e-12)


def test_torchtitan_alltoall_shards_over_tp_and_swaps_counts():
    """torchtitan shards the routed experts' input over tp whenever EP is on (SP or not),
    sends no probabilities, keeps the experts whole on each EP rank (no expert-TP
    collectives) and swaps the counts with an all-to-all."""
    ctx, links, spec = _setup(impl="torchtitan")
    h, ab = 256, 2
    rows = SEQ * B / T * 4 * LOAD
    passes = (coll("all-to-all", rows * h * ab, E, EP_IN_NODE, links)
              + coll("all-to-all", rows * h * ab, E, EP_IN_NODE, links))
    fwd = passes + coll("all-to-all", 8.0 * 16, E, EP_IN_NODE, links)
    f, b = _run(ctx, links, spec, sp=0)
    assert f == pytest.approx(N_MOE * fwd, rel=1e-12)
    assert b == pytest.approx(N_MOE * (passes + FULL * fwd), rel=1e-12)


def test_megatron_allgather_dispatcher():
    """`MoEAllGatherTokenDispatcher`: every rank all-gathers over the tp·ep group each
    rank's tokens (h · ab), probabilities (E · ab) and routing map (E bytes), and
    reduce-scatters the tokens back; the backward the same; nothing with one rank."""
    ctx, links, spec = _setup(impl="megatron-te", moe_dispatcher="allgather")
    h, ab, n = 256, 2, ET * E
    tokens = SEQ * B / T
    per_rank = tokens * (h * ab + 16 * (ab + 1))
    fwd = (coll("all-gather", n * per_rank, n, min(n, 8), links)
           + coll("reduce-scatter", n * tokens * h * ab, n, min(n, 8), links))
    f, b = _run(ctx, links, spec)
    assert f == pytest.approx(N_MOE * fwd, rel=1e-12)
    assert b == pytest.approx(N_MOE * (1 + FULL) * fwd, rel=1e-12)
    one = ep_time(ctx, links, spec, t=1, c=1, b=B, sp=1, e=1, etp=1, full=FULL, n_moe=N_MOE,
                  ep_in_node=1, m=M, work_f=0.0, work_b=0.0)
    assert one == (0.0, 0.0)


@pytest.mark.parametrize("fp8", [False, True])
def test_flex_dispatcher_rdma_and_nvlink(fp8):
    """DeepEP: one RDMA copy per remote node a token reaches, one NVLink copy per GPU it
    reaches (replicated over the expert-TP ranks), both links at once behind one latency;
    the dispatch FP8 with a 4-byte scale per 128 elements when asked, the combine in bf16."""
    ctx, links, spec = _setup(impl="megatron-te", moe_dispatcher="flex", moe_dispatch_fp8=fp8)
    h, ab = 256, 2
    tokens = SEQ * B / T
    nodes = E / EP_IN_NODE
    assert FP8_DISPATCH_BYTES == 1 + 4 / 128
    remote = nodes_reached(MOE, nodes) * (nodes - 1) / nodes
    local = gpus_reached(MOE, nodes, EP_IN_NODE) * ET * (1 - 1 / (nodes * EP_IN_NODE * ET))
    inter, intra = tokens * LOAD * remote * h, tokens * LOAD * local * h
    vol = ep_volumes(MOE, spec, tokens=tokens, e=E, et=ET, ep_in_node=EP_IN_NODE,
                     act_bytes=ab)
    assert (vol["inter"], vol["intra"]) == pytest.approx((inter, intra), rel=1e-12)
    dispatch = FP8_DISPATCH_BYTES if fp8 else ab
    assert vol["dispatch_bytes"] == dispatch

    def one(per: float) -> float:
        return links.inter_lat + max(inter * per / links.inter_bw, intra * per / links.intra_bw)

    fwd = one(dispatch) + one(ab)
    f, b = _run(ctx, links, spec)
    assert f == pytest.approx(N_MOE * fwd, rel=1e-12)
    assert b == pytest.approx(N_MOE * (1 + FULL) * fwd, rel=1e-12)
    # one node: the NVLink latency, nothing over RDMA
    single = ep_time(ctx, links, spec, t=T, c=1, b=B, sp=1, e=E, etp=ET, full=0, n_moe=1,
                     ep_in_node=E, m=M, work_f=0.0, work_b=0.0)
    vol1 = ep_volumes(MOE, spec, tokens=tokens, e=E, et=ET, ep_in_node=E, act_bytes=ab)
    assert vol1["inter"] == 0.0
    intra1 = vol1["intra"]
    assert single[0] == pytest.approx(2 * links.intra_lat + (dispatch + ab) * intra1
                                      / links.intra_bw, rel=1e-12)


@pytest.mark.parametrize("c", [1, 2])
def test_shared_expert_overlap_hides_behind_the_shared_gemms(c):
    """`--moe-shared-expert-overlap`: each dispatch and combine beside the shared experts'
    forward GEMMs (all T = s/c·b rows of the rank at f_e/t; the backward beside twice
    those), at the SM share its kernels take; full recompute's replay paired again with the
    forward's."""
    ctx, links, spec = _setup(impl="megatron-te", moe_overlap="shared")
    fwd, bwd = _megatron_alltoall(links, SEQ / c * B / T)
    rows, f = SEQ / c * B, 96 / T
    shared = 2 * (linear(ctx, rows, 256, 2 * f).fwd + linear(ctx, rows, f, 256).fwd)
    f_exp, b_exp = _run(ctx, links, spec, c=c)
    assert f_exp == pytest.approx(N_MOE * (_paired(fwd, shared) - shared), rel=1e-12)
    assert b_exp == pytest.approx(N_MOE * (_paired(bwd, 2 * shared) - 2 * shared + FULL * (
        _paired(fwd, shared) - shared)), rel=1e-12)
    busy = replace(spec, comm_sms=32)
    f32, _ = _run(ctx, links, busy, c=c)
    assert f32 == pytest.approx(N_MOE * (_paired(fwd, shared, busy=32) - shared), rel=1e-12)


@pytest.mark.parametrize("work", [1e-6, 1.0])
def test_1f1b_overlap_pairs_all_but_the_first_microbatch(work):
    """Megatron's `--overlap-moe-expert-parallel-comm`: m - 1 micro-batches pair their
    forward and backward communication with another's compute, the first is alone; the mean
    per micro-batch split between the passes in proportion to their communication."""
    ctx, links, spec = _setup(impl="megatron-te", moe_overlap="1f1b")
    fwd, bwd = _megatron_alltoall(links, SEQ * B / T)
    comm_f, comm_b = N_MOE * fwd, N_MOE * (bwd + FULL * fwd)
    both = comm_f + comm_b
    wf, wb = 0.4 * work, 0.6 * work
    pair = _paired(both, wf + wb) - (wf + wb)
    mean = ((M - 1) * pair + both) / M
    f, b = _run(ctx, links, spec, work_f=wf, work_b=wb)
    assert f == pytest.approx(mean * comm_f / both, rel=1e-12)
    assert b == pytest.approx(mean * comm_b / both, rel=1e-12)
    assert np.all(np.asarray(f) > 0)


def _no_hit(total: int, per: int, draws: int) -> float:
    """Chance that `draws` distinct picks from `total` miss a given `per` of them."""
    return comb(total - per, draws) / comb(total, draws)


@pytest.mark.parametrize("units", [1, 2, 4, 8, 16])
def test_units_reached_without_a_node_limit(units):
    """Top-k of E experts laid out over N units in order, one group: `N·(1 - C(E - E/N, k) /
    C(E, k))` distinct units (0 missed when a unit holds more than E - k experts)."""
    model = MOE  # 16 experts, top-4, one group
    expected = units * (1 - (_no_hit(16, 16 // units, 4) if 16 - 16 // units >= 4 else 0.0))
    assert float(nodes_reached(model, units)) == pytest.approx(expected, rel=1e-12)
    assert float(gpus_reached(model, max(units // 2, 1), 2 if units > 1 else 1)) == \
        pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("units", [2, 4, 8, 16, 32])
def test_units_reached_under_node_limited_routing(units):
    """8 groups of 4 experts, top-6 from 3 chosen groups (2 distinct experts in each):
    groups no larger than a unit (r = G/N per unit): `N·(1 - C(G - r, M)/C(G, M))`; groups
    spanning q = N/G units: `M·q·(1 - C(E/G - E/N, k/M)/C(E/G, k/M))`."""
    model = MOE.with_(n_experts=32, top_k=6, expert_groups=8, topk_groups=3, name="limited")
    if units <= 8:
        expected = units * (1 - _no_hit(8, 8 // units, 3))
    else:
        q = units / 8
        expected = 3 * q * (1 - _no_hit(4, 32 // units, 2))
    assert float(nodes_reached(model, units)) == pytest.approx(expected, rel=1e-12)
    many = nodes_reached(model, np.array([units, units, 1]))
    assert many.shape == (3,) and float(many[0]) == pytest.approx(expected, rel=1e-12)
    assert float(many[2]) == pytest.approx(1.0, rel=1e-12)  # one unit holds every expert


def test_context_parallel_and_single_rank_groups():
    """Each cp rank routes its s/c share of the micro-batch; an EP and expert-TP group of one
    rank moves nothing (alltoall), two ranks under allgather do; another stack (the shardwise
    runtime) routes the whole micro-batch on each rank."""
    ctx, links, spec = _setup(impl="megatron-te")
    fwd, _ = _megatron_alltoall(links, SEQ / 2 * B / T)
    f, _ = ep_time(ctx, links, spec, t=T, c=2, b=B, sp=1, e=E, etp=ET, full=0, n_moe=N_MOE,
                   ep_in_node=EP_IN_NODE, m=M, work_f=0.0, work_b=0.0)
    assert f == pytest.approx(N_MOE * fwd, rel=1e-12)
    alone = ep_time(ctx, links, spec, t=1, c=1, b=B, sp=1, e=1, etp=1, full=FULL, n_moe=N_MOE,
                    ep_in_node=1, m=M, work_f=0.0, work_b=0.0)
    assert alone == (0.0, 0.0)
    ctx, links, spec = _setup(impl="megatron-te", moe_dispatcher="allgather")
    tokens = SEQ * B
    pair = (coll("all-gather", 2 * tokens * (256 * 2 + 16 * 3), 2, 2, links)
            + coll("reduce-scatter", 2 * tokens * 256 * 2, 2, 2, links))
    f, _ = ep_time(ctx, links, spec, t=1, c=1, b=B, sp=1, e=2, etp=1, full=0, n_moe=1,
                   ep_in_node=2, m=M, work_f=0.0, work_b=0.0)
    assert f == pytest.approx(pair, rel=1e-12)


def test_runtime_stack_routes_the_whole_microbatch():
    ctx, links, spec = _setup(impl="shardwise")
    h, ab = 256, 2
    rows = SEQ * B * 4 * LOAD  # not ÷ t: the runtime does not shard the routed input
    passes = 2 * coll("all-to-all", rows * h * ab, E, EP_IN_NODE, links)
    fwd = passes + coll("all-to-all", 8.0 * 16, E, EP_IN_NODE, links)
    f, _ = _run(ctx, links, spec, full=0)
    assert f == pytest.approx(N_MOE * fwd, rel=1e-12)


def test_paired_slows_the_compute_by_the_sms_left():
    """Work between C·(S-σ)/S and C: the slowed compute outlasts the communication."""
    s, busy = 132, COMM_SMS
    assert float(paired(1.0, 0.95, s, busy)) == pytest.approx(0.95 + busy / s, rel=1e-12)
    assert float(paired(1.0, 0.8, s, busy)) == pytest.approx(1.0, rel=1e-12)


def test_1f1b_overlap_with_one_microbatch_pairs_nothing():
    """One micro-batch has no other to pair with: the 1F1B overlap exposes all of its
    forward and backward communication (the first micro-batch is always alone)."""
    ctx, links, spec = _setup(impl="megatron-te", moe_overlap="1f1b")
    fwd, bwd = _megatron_alltoall(links, SEQ * B / T)
    f, b = ep_time(ctx, links, spec, t=T, c=1, b=B, sp=1, e=E, etp=ET, full=FULL, n_moe=N_MOE,
                   ep_in_node=EP_IN_NODE, m=1, work_f=1.0, work_b=1.0)
    assert f == pytest.approx(N_MOE * fwd, rel=1e-12)
    assert b == pytest.approx(N_MOE * (bwd + FULL * fwd), rel=1e-12)
