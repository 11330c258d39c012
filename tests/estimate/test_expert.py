"""Expert-parallel communication (`estimate.expert`) against the frameworks' own code:
Megatron-Core 0.16.1's alltoall token dispatcher run rank by rank on CPU with its collectives
recorded (what each rank's tensors hold), and its group-limited router
(`moe_utils.group_limited_topk`) for the nodes and GPUs a token reaches."""

import contextlib
from dataclasses import replace

import numpy as np
import pytest

from shardwise.arch import ModelSpec, get_model
from shardwise.estimate.expert import (
    COMM_SMS,
    SMS,
    ep_time,
    ep_volumes,
    gpus_reached,
    nodes_reached,
    paired,
)
from shardwise.hardware import Cluster
from shardwise.layout import Layout, TrainSpec

torch = pytest.importorskip("torch")
td = pytest.importorskip("megatron.core.transformer.moe.token_dispatcher")

# a small DeepSeekMoE-like model: shared experts, top-2 of 8 experts, 4 groups (node-limited
# to 2), d_ff_expert != d_ff
MOE = ModelSpec(name="moe-test", n_layers=4, d_model=64, n_heads=4, n_kv_heads=2, d_ff=256,
                vocab=512, n_experts=8, top_k=2, d_ff_expert=96, n_shared_experts=1,
                expert_groups=4, topk_groups=2)


class _Group:
    """A process group of `n` ranks seen from `rank` (the dispatcher asks size and rank)."""

    def __init__(self, n: int, rank: int):
        self.n, self.r = n, rank

    def size(self) -> int:
        return self.n

    def rank(self) -> int:
        return self.r


class _Stream:
    def wait_stream(self, other):
        pass

    def record_event(self):
        return self

    def synchronize(self):
        pass


def _alltoall_config(ep: int, et: int, sequence_parallel: bool = True, **extra):
    """Megatron-Core's `TransformerConfig` of MOE's alltoall dispatcher at expert-parallel
    `ep` and expert-TP `et` (= TP), bf16."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=2, hidden_size=MOE.d_model, num_attention_heads=4,
                             num_moe_experts=MOE.n_experts, moe_router_topk=MOE.top_k,
                             moe_token_dispatcher_type="alltoall", expert_model_parallel_size=ep,
                             expert_tensor_parallel_size=et, tensor_model_parallel_size=et,
                             sequence_parallel=sequence_parallel, add_bias_linear=False,
                             bf16=True, params_dtype=torch.bfloat16, **extra)


def _dispatch_on_cpu(monkeypatch, gather, all_to_all, stream=None) -> None:
    """Megatron-Core's token dispatcher on CPU, rank by rank: its groups' size and rank from
    `_Group`, its SP gather and all-to-all the test's `gather` and `all_to_all`, its CUDA
    streams `stream` (a `_Stream` by default)."""
    from megatron.core import utils

    stream = stream or _Stream()
    monkeypatch.setattr(utils, "get_pg_size", lambda group=None: group.size())
    monkeypatch.setattr(utils, "get_pg_rank", lambda group=None: group.rank())
    monkeypatch.setattr(td, "gather_from_sequence_parallel_region", gather)
    monkeypatch.setattr(td, "all_to_all", all_to_all)
    monkeypatch.setattr(td.MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream", stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())


def _balanced_routing(tokens: int, n_experts: int, k: int, shift: int) -> "torch.Tensor":
    """[tokens, E] bool: token i to experts (i + shift + j·E/k) mod E, j < k — every expert
    receives tokens·k/E of this rank's tokens, k distinct experts per token."""
    rows = torch.arange(tokens)[:, None] + shift + torch.arange(k)[None, :] * (n_experts // k)
    routing = torch.zeros(tokens, n_experts, dtype=torch.bool)
    routing[torch.arange(tokens)[:, None], rows % n_experts] = True
    return routing


def test_alltoall_dispatcher_bytes_match_megatron(monkeypatch):
    """Megatron-Core 0.16.1's `MoEAlltoAllTokenDispatcher` with ep = 4, expert-TP = 2 (the
    tp_ep group of 8 ranks), top-2 of 8 experts: every rank's all-to-all payload leaving it
    (its `input_splits` to the other ep ranks: rows of h plus the routing probability) and
    its expert-TP all-gather's output (`output_splits_tp`) equal `ep_volumes`."""
    ep, et, h, k, n_exp = 4, 2, MOE.d_model, MOE.top_k, MOE.n_experts
    tokens = 24  # this rank's sequence shard (s·b/(c·t) under SP)
    cfg = _alltoall_config(ep, et)
    routing = {(ep_i, tp_i): _balanced_routing(tokens, n_exp, k, 3 * ep_i + tp_i)
               for ep_i in range(ep) for tp_i in range(et)}
    counts = torch.cat([routing[(e_i, t_i)].sum(0).long()
                        for e_i in range(ep) for t_i in range(et)])  # tp_ep order: ep, then tp
    sent: dict[str, list] = {"a2a": [], "gather": []}

    def gather(x, group=None, output_split_sizes=None, **_):
        if x.dtype == torch.long:  # the token counts per expert over tp_ep
            return counts
        rows = sum(output_split_sizes) if output_split_sizes else x.shape[0] * group.size()
        sent["gather"].append((rows, x.shape[1:]))
        return torch.zeros((rows, *x.shape[1:]), dtype=x.dtype)

    def all_to_all(group, x, output_splits, input_splits):
        sent["a2a"].append((list(map(int, input_splits)), x.shape[1:], x.dtype))
        return torch.zeros((int(sum(output_splits)), *x.shape[1:]), dtype=x.dtype)

    _dispatch_on_cpu(monkeypatch, gather, all_to_all)

    train = TrainSpec(impl="megatron-te")
    expected = ep_volumes(MOE, train, tokens=tokens, e=ep, et=et, ep_in_node=ep, act_bytes=2)
    local = n_exp // ep
    for (ep_i, tp_i), rmap in routing.items():
        sent["a2a"].clear()
        sent["gather"].clear()
        pgs = type("PG", (), {"ep": _Group(ep, ep_i), "expt_tp": _Group(et, tp_i),
                              "tp_ep": _Group(ep * et, ep_i * et + tp_i)})()
        d = td.MoEAlltoAllTokenDispatcher(local, list(range(ep_i * local, (ep_i + 1) * local)),
                                          cfg, pg_collection=pgs)
        x = torch.randn(tokens, h, dtype=torch.bfloat16)
        probs = torch.rand(tokens, n_exp, dtype=torch.bfloat16) * rmap
        hidden, p = d.dispatch_preprocess(x, rmap, probs)
        hidden, p = d.token_dispatch(hidden, p)
        d.dispatch_postprocess(hidden, p)
        (splits, width, dtype), (p_splits, _, p_dtype) = sent["a2a"]
        assert p_splits == splits  # each copy's probability travels with it
        leaving = sum(s for j, s in enumerate(splits) if j != ep_i)
        bytes_out = leaving * (width[0] * dtype.itemsize + p_dtype.itemsize)
        assert bytes_out == pytest.approx(expected["dispatch"] * (ep - 1) / ep)
        assert sum(splits) == pytest.approx(expected["rows"])
        (rows, shape), _ = sent["gather"]  # tokens and probs over expert-TP
        assert rows * shape[0] * 2 == pytest.approx(expected["gather"])


def test_padded_dispatch_exchanges_no_counts_as_megatron_runs_it(monkeypatch):
    """Padded to capacity (`--moe-expert-capacity-factor 1 --moe-pad-expert-input-to-capacity`),
    Megatron-Core 0.16.1's `MoEAlltoAllTokenDispatcher.preprocess` returns before gathering the
    token counts over tp_ep (every rank sends `capacity` rows to every expert): the dispatch
    gathers no counts, sends `capacity·E` = T·k rows, and `ep_time` charges exactly the count
    all-gather less than dropless routing with the same rows."""
    ep, et, h, k, n_exp = 4, 2, MOE.d_model, MOE.top_k, MOE.n_experts
    tokens = 24
    cfg = _alltoall_config(ep, et, moe_expert_capacity_factor=1.0,
                           moe_pad_expert_input_to_capacity=True)
    calls: dict[str, list] = {"counts": [], "a2a": []}

    def gather(x, group=None, output_split_sizes=None, **_):
        if x.dtype == torch.long:
            calls["counts"].append(x.shape)
        rows = sum(output_split_sizes) if output_split_sizes else x.shape[0] * group.size()
        return torch.zeros((rows, *x.shape[1:]), dtype=x.dtype)

    def all_to_all(group, x, output_splits, input_splits):
        calls["a2a"].append(x.shape[0])
        return torch.zeros((x.shape[0], *x.shape[1:]), dtype=x.dtype)

    _dispatch_on_cpu(monkeypatch, gather, all_to_all)
    pgs = type("PG", (), {"ep": _Group(ep, 1), "expt_tp": _Group(et, 0),
                          "tp_ep": _Group(ep * et, et)})()
    local = n_exp // ep
    d = td.MoEAlltoAllTokenDispatcher(local, list(range(local, 2 * local)), cfg,
                                      pg_collection=pgs)
    rmap = _balanced_routing(tokens, n_exp, k, 1)
    probs = torch.rand(tokens, n_exp, dtype=torch.bfloat16) * rmap
    hidden, p = d.dispatch_preprocess(torch.randn(tokens, h, dtype=torch.bfloat16), rmap, probs)
    d.token_dispatch(hidden, p)
    assert calls["counts"] == []
    padded = TrainSpec(impl="megatron-te", moe_capacity=1.0)
    assert calls["a2a"][0] == ep_volumes(MOE, padded, tokens=tokens, e=ep, et=et,
                                         ep_in_node=ep, act_bytes=2)["rows"]

    from shardwise.calibration import default_calibration
    from shardwise.estimate.kernels import ComputeContext
    from shardwise.estimate.links import Links, group_collective_time

    cluster = Cluster.of(16, "h100")
    cal = default_calibration(cluster.accelerator.calibration_name)
    links = Links.of(cluster, cal)
    kw = dict(t=2, c=1, b=1, sp=1, e=ep, etp=et, full=0.0, n_moe=3, ep_in_node=ep, m=4,
              work_f=1.0, work_b=2.0)
    times = {}
    for name, cap in (("dropless", None), ("padded", 1.0)):
        train = TrainSpec(seq_len=1024, global_batch=8, impl="megatron-te", moe_capacity=cap)
        ctx = ComputeContext.of(MOE, cluster.accelerator, train, cal)
        times[name] = ep_time(ctx, links, train, **kw)
    count = group_collective_time("all-gather", 8.0 * n_exp * et * ep, et * ep, 8, links)
    assert times["dropless"][0] - times["padded"][0] == pytest.approx(3 * count, rel=1e-9)
    assert times["dropless"][1] == pytest.approx(times["padded"][1], rel=1e-12)


@pytest.mark.parametrize("n_experts,k,groups,chosen,nodes", [
    (256, 8, 8, 4, 8),   # DeepSeek-V3: a group per node, 4 of 8 nodes
    (256, 8, 8, 4, 4),   # two groups per node
    (160, 6, 8, 3, 4),   # DeepSeek-V2-like: 3 of 8 groups, top-6, 5 experts per GPU
    (64, 6, 4, 2, 8),    # a group spans two nodes
    (64, 8, 1, 1, 8),    # no node limit
])
def test_nodes_and_gpus_reached_match_megatron_router(n_experts, k, groups, chosen, nodes):
    """Distinct nodes (and GPUs, 8 per node) a token's experts lie on under Megatron-Core
    0.16.1's group-limited top-k (`moe_router_num_groups`, `moe_router_group_topk`) with
    random scores, experts laid out in order over the EP group: `nodes_reached`,
    `gpus_reached` within 3 % and 5 % (the chosen groups receive k/M experts on average, not
    each exactly k/M, which the closed form assumes)."""
    from megatron.core.transformer.moe.moe_utils import group_limited_topk

    model = replace(MOE, n_experts=n_experts, top_k=k, expert_groups=groups, topk_groups=chosen)
    torch.manual_seed(0)
    tokens = 20000
    scores = torch.sigmoid(torch.randn(tokens, n_experts))
    if groups > 1:
        _, idx = group_limited_topk(scores, k, tokens, n_experts, groups, chosen)
    else:
        idx = scores.topk(k, dim=-1)[1]
    gpus = nodes * 8
    gpu = idx // (n_experts // gpus)
    node = gpu // 8
    hit_nodes = torch.zeros(tokens, nodes).scatter_(1, node, 1).sum(1).mean().item()
    hit_gpus = torch.zeros(tokens, gpus).scatter_(1, gpu, 1).sum(1).mean().item()
    assert float(nodes_reached(model, nodes)) == pytest.approx(hit_nodes, rel=0.03)
    assert float(gpus_reached(model, nodes, 8)) == pytest.approx(hit_gpus, rel=0.05)


def test_paired_charges_the_communication_sms():
    """Compute beside communication runs on S-σ SMs: hidden communication still costs
    C·σ/S; communication longer than the slowed compute sets the time."""
    s, busy = SMS["hopper"], COMM_SMS
    assert float(paired(1.0, 3.0, s, busy)) == pytest.approx(3.0 + busy / s)
    assert float(paired(3.0, 1.0, s, busy)) == pytest.approx(3.0)
    assert float(paired(np.array([0.5]), 1.0, s, busy)[0]) > 1.0


def _step(train, layout="pp=4,ep=8,zero=1", gpus=64):
    from shardwise.estimate.step import estimate_step
    model = get_model("deepseek-v2-lite")
    lay = Layout.parse(layout)
    lay = replace(lay, dp=gpus // (lay.tp * lay.pp * lay.cp))
    return estimate_step(model, Cluster.of(gpus, "h100"), lay, train)


def test_step_dispatchers_and_overlap_order():
    """On DeepSeek-V2-Lite (shared experts, top-6, ep = 8 over 64 H100): DeepEP (flex) moves
    fewer inter-node bytes than NCCL's all-to-all, FP8 dispatch fewer still, and 1F1B overlap
    (or the shared experts') hides some of it but never all (the SM share); compute does not
    move (one stage: with pp the critical stage is chosen with its EP time, so the dispatcher
    may move it between the busiest stage and the head's)."""
    base = TrainSpec(seq_len=4096, global_batch=256, impl="megatron-te")
    lay = "pp=1,ep=8,zero=1"
    a2a = _step(base, lay)
    flex = _step(replace(base, moe_dispatcher="flex"), lay)
    fp8 = _step(replace(base, moe_dispatcher="flex", moe_dispatch_fp8=True), lay)
    both = _step(replace(base, moe_dispatcher="flex", moe_dispatch_fp8=True, moe_overlap="1f1b"),
                 lay)
    shared = _step(replace(base, moe_overlap="shared"), lay)
    assert a2a.ep_comm > flex.ep_comm > fp8.ep_comm > both.ep_comm > 0
    assert a2a.ep_comm > shared.ep_comm > 0
    assert a2a.compute == flex.compute == both.compute == shared.compute


def test_bad_moe_settings_are_one_line():
    from shardwise.errors import ShardwiseError
    with pytest.raises(ShardwiseError, match="torchtitan runs alltoall, flex"):
        TrainSpec(impl="torchtitan", moe_dispatcher="allgather").validate()
    with pytest.raises(ShardwiseError, match="needs the flex"):
        TrainSpec(impl="megatron-te", moe_dispatch_fp8=True).validate()
    with pytest.raises(ShardwiseError, match="shared needs the alltoall"):
        TrainSpec(impl="megatron-te", moe_dispatcher="flex", moe_overlap="shared").validate()


def test_moe_layers_without_shared_experts_make_no_mlp_tp_pair():
    """Megatron's MoE layer keeps the routed tokens sequence-sharded (the dispatcher gathers
    over expert-TP), so only the shared experts' MLP makes the reduce-scatter/all-gather pair
    under TP + SP: a MoE model without shared experts pays one pair per layer and pass less
    than the same model with one — `m · L · 2 · (RS + AG)` of the (s, b, h) activation."""
    from shardwise.calibration import default_calibration
    from shardwise.estimate.links import Links, group_collective_time
    from shardwise.estimate.step import estimate_step

    with_shared = replace(MOE, n_layers=8, d_model=512, n_heads=8, n_kv_heads=8, d_ff=1024,
                          d_ff_expert=384, expert_groups=1, topk_groups=1, max_seq=1024)
    without = replace(with_shared, n_shared_experts=0)
    cluster = Cluster.of(16, "h100")
    layout = Layout(dp=8, tp=2, ep=4, sp=True)
    train = TrainSpec(seq_len=1024, global_batch=32, impl="megatron-te")
    a = estimate_step(with_shared, cluster, layout, train)
    b = estimate_step(without, cluster, layout, train)
    links = Links.of(cluster, default_calibration(cluster.accelerator.calibration_name))
    act = 1024 * 1 * 512 * 2
    pair = (group_collective_time("reduce-scatter", act, 2, 2, links)
            + group_collective_time("all-gather", act, 2, 2, links))
    assert a.tp_comm - b.tp_comm == pytest.approx(a.microbatches * 8 * 2 * pair, rel=1e-9)


def test_capacity_factor_pads_every_expert():
    """A capacity factor with padding (Megatron `get_capacity`: `ceil(T·k/E · factor)` rows
    per expert, `moe_pad_expert_input_to_capacity`) sends and computes `factor · T · k` rows
    per rank whatever the routing: the same step as balanced routing at expert_load = factor,
    less the dispatcher's host round trip and its count all-gather, which drop-and-pad skips
    (its sizes are static; `test_dispatcher_blocks_the_host_once_per_forward`,
    `test_padded_dispatch_exchanges_no_counts_as_megatron_runs_it`)."""
    from megatron.core.transformer.moe.moe_utils import get_capacity

    tokens, k, n_exp, factor = 4096, MOE.top_k, MOE.n_experts, 1.25
    assert get_capacity(tokens * k, n_exp, factor) * n_exp == pytest.approx(
        factor * tokens * k, rel=1e-3)
    base = TrainSpec(seq_len=4096, global_batch=256, impl="megatron-te")
    padded = _step(replace(base, moe_capacity=factor))
    loaded = _step(replace(base, expert_load=factor))
    assert padded.ep_comm < loaded.ep_comm < 1.02 * padded.ep_comm  # the counts' all-gather
    assert 0 < loaded.compute - padded.compute < 1e-2 * loaded.compute
    assert padded.total > _step(base).total


def test_sm_count_by_part_and_generation():
    """The SM share overlap costs uses the part's own SMs where it has fewer than its
    generation's flagship (H100 whitepaper: SXM5 132, PCIe 114; H20 78), else the generation's
    (B200 148, A100 108, MI300X 304 CUs, MI355X 256)."""
    from shardwise.estimate.expert import sm_count
    from shardwise.hardware import get_accelerator
    counts = {name: sm_count(get_accelerator(name)) for name in
              ("h100-sxm", "h100-pcie", "h800", "h20", "b200", "a100-80gb", "mi300x", "mi355x")}
    assert counts == {"h100-sxm": 132, "h100-pcie": 114, "h800": 132, "h20": 78, "b200": 148,
                      "a100-80gb": 108, "mi300x": 304, "mi355x": 256}
    # a part of no known generation (a user's own accelerator) takes the documented 132
    custom = replace(get_accelerator("h100-sxm"), name="npu-x1")
    assert sm_count(custom) == 132


def test_h20_overlap_costs_its_own_sm_share():
    """1F1B EP overlap on 64 H20: each of the m - 1 paired micro-batches still pays C·σ/S of
    its hidden communication C (the first is unpaired), so ep_comm = C·((m-1)·σ/S + 1); the
    same part counted at Hopper's 132 SMs must give the same C with S = 132 — the H20's 78
    make the hidden share 132/78 times as dear."""
    from shardwise.estimate.step import estimate_step
    from shardwise.hardware import get_accelerator
    model = get_model("deepseek-v2-lite")
    train = TrainSpec(seq_len=4096, global_batch=512, impl="megatron-te", moe_dispatcher="flex",
                      moe_overlap="1f1b")
    lay = Layout.parse("pp=2,ep=8,zero=1")
    lay = replace(lay, dp=32)
    h20 = get_accelerator("h20")
    as_flagship = replace(h20, name="h20-as-h100", calibrated_as=h20.calibration_name)
    own = estimate_step(model, Cluster.of(64, h20), lay, train)
    flagship = estimate_step(model, Cluster.of(64, as_flagship), lay, train)
    assert own.compute == flagship.compute
    m, sigma = own.microbatches, COMM_SMS
    comm = flagship.ep_comm / ((m - 1) * sigma / 132 + 1)
    assert own.ep_comm == pytest.approx(comm * ((m - 1) * sigma / 78 + 1), rel=1e-9)


@pytest.mark.parametrize("ep, et, point, capacity", [(4, 2, "before_ep_alltoall", None),
                                                     (1, 1, "before_permutation_2", None),
                                                     (4, 2, "no_sync", 1.25)])
def test_dispatcher_blocks_the_host_once_per_forward(monkeypatch, ep, et, point, capacity):
    """Megatron-Core 0.16.1's dropless alltoall dispatcher waits once per forward on its
    device→host copy of the routing counts (`d2h_event.synchronize()`: before the EP
    all-to-all with ep·tp > 1, else before sorting rows by local expert without
    `moe_permute_fusion`); `layer_cost` charges an MoE layer's
    forward that one round trip — the host link's latency and one relaunch — and nothing to its
    backward or to a dense layer (both far from host-bound here). Padded to a capacity
    (drop-and-pad) it never waits, and nothing is charged."""
    from shardwise.calibration import default_calibration
    from shardwise.estimate.compute import ComputeContext, layer_cost
    from shardwise.hardware import get_accelerator, get_link

    h, k, n_exp, tokens = MOE.d_model, MOE.top_k, MOE.n_experts, 24
    cfg = _alltoall_config(ep, et, sequence_parallel=et > 1,
                           moe_expert_capacity_factor=capacity,
                           moe_pad_expert_input_to_capacity=capacity is not None)
    waits = []
    stream = _Stream()
    monkeypatch.setattr(stream, "synchronize", lambda: waits.append(1), raising=False)
    counts = torch.cat([_balanced_routing(tokens, n_exp, k, i).sum(0).long()
                        for i in range(ep * et)])
    _dispatch_on_cpu(monkeypatch,
                     lambda x, group=None, output_split_sizes=None, **_: counts
                     if x.dtype == torch.long else torch.cat([x] * group.size()),
                     lambda group, x, out, inp: x if out is None else
                     torch.zeros((int(sum(out)), *x.shape[1:]), dtype=x.dtype),
                     stream=stream)
    local = n_exp // ep
    pgs = type("PG", (), {"ep": _Group(ep, 0), "expt_tp": _Group(et, 0),
                          "tp_ep": _Group(ep * et, 0)})()
    d = td.MoEAlltoAllTokenDispatcher(local, list(range(local)), cfg, pg_collection=pgs)
    rmap = _balanced_routing(tokens, n_exp, k, 0)
    hidden, p = d.dispatch_preprocess(torch.randn(tokens, h, dtype=torch.bfloat16), rmap,
                                      torch.rand(tokens, n_exp, dtype=torch.bfloat16) * rmap)
    d.dispatch_postprocess(*d.token_dispatch(hidden, p))
    assert len(waits) == (0 if capacity else 1)
    assert d.cuda_sync_point == point

    model = get_model("mixtral-8x7b")
    h100 = get_accelerator("h100-sxm")
    train = TrainSpec(seq_len=4096, impl="megatron-te", moe_capacity=capacity)
    cal = default_calibration(h100.calibration_name)

    def cost(acc, overhead: float, moe: bool):
        ctx = ComputeContext.of(model, acc, train, replace(cal, kernel_overhead=overhead))
        return layer_cost(ctx, et, 1, 1, et > 1, 0, moe=moe, ep=ep)

    slow, fast = cost(h100, 5e-5, True), cost(h100, 5e-6, True)
    if capacity:
        assert float(slow.fwd) == float(fast.fwd) and float(slow.bwd) == float(fast.bwd)
        return
    assert float(slow.fwd - fast.fwd) == pytest.approx(4.5e-5, rel=1e-9)
    assert float(slow.bwd) == float(fast.bwd)
    assert float(cost(h100, 5e-5, False).fwd) == float(cost(h100, 5e-6, False).fwd)
    c2c = replace(h100, host="c2c-gh200")
    gap = get_link("pcie5").latency - get_link("c2c-gh200").latency
    assert float(fast.fwd - cost(c2c, 5e-6, True).fwd) == pytest.approx(gap, rel=1e-9)
