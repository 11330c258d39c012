"""ZeRO-1/2/3 train like DDP; state per rank and bytes per step follow SPEC §2."""

from __future__ import annotations

import json

import pytest
from tests.cli_helpers import shardwise

from shardwise.demos.data_parallel import zero_rank, zero_rank_all_stages
from shardwise.estimate.comm import dp_step_comm_bytes
from shardwise.runtime.launch import spawn

TOL = 1e-12


def _spec_state(p: int, n: int, stage: int) -> dict[str, float]:
    """SPEC §2 in float64 (w = g = 8 bytes, Adam moments o = 16, no master copy)."""
    w, g, o = 8, 8, 16
    return {0: {"weights": w * p, "grads": g * p, "optimizer": o * p},
            1: {"weights": w * p, "grads": g * p, "optimizer": o * p / n},
            2: {"weights": w * p, "grads": g * p / n, "optimizer": o * p / n},
            3: {"weights": w * p / n, "grads": g * p / n, "optimizer": o * p / n}}[stage]


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 4])
def test_zero_stages_train_like_ddp(n: int) -> None:
    res = spawn(zero_rank_all_stages, n, "float64", 3)
    for rank_results in res:
        for stage, o in enumerate(rank_results):
            assert o["vs_ddp"] <= TOL, f"stage {stage}"
            assert o["vs_full"] <= TOL, f"stage {stage}"
            if n == 2:  # identical summation order (a + b) → bit-identical parameters
                assert o["bit_identical_to_ddp"], f"stage {stage}"
            assert o["state"] == _spec_state(o["n_params"], n, stage), f"stage {stage}"
            expected = dp_step_comm_bytes(o["n_params"], n, stage, grad_bytes=8,
                                          weight_bytes=8)
            assert o["bytes_per_step"] == [expected] * 3, f"stage {stage}"


@pytest.mark.slow
def test_stage3_gathers_each_layer_for_forward_and_backward_with_prefetch() -> None:
    events = spawn(zero_rank, 2, 3, "float64", 1)[0]["events"]
    assert events == [
        ("gather", 0), ("prefetch", 1),                          # forward, unit 0
        ("use-prefetch", 1), ("prefetch", 2),                    # forward, unit 1
        ("use-prefetch", 2),                                     # forward, unit 2
        ("gather", 2), ("prefetch", 1), ("reduce-scatter", 2),   # backward, unit 2
        ("use-prefetch", 1), ("prefetch", 0), ("reduce-scatter", 1),
        ("use-prefetch", 0), ("reduce-scatter", 0),
    ]


def _stage3_frees() -> dict[str, object]:
    import torch
    import torch.distributed as dist
    from torch import nn

    from shardwise.layout import Layout
    from shardwise.runtime.mesh import Mesh
    from shardwise.runtime.zero import ZeroConfig, ZeroDataParallel

    Mesh.from_layout(Layout(dp=dist.get_world_size()))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)).double()
    z = ZeroDataParallel(model, ZeroConfig(stage=3))
    out = z(torch.randn(2, 8, dtype=torch.float64)).sum()
    after_forward = {
        "gathered": [u.gathered is not None for u in z.units],
        "weights": [model[0].weight is None, model[2].weight is None],
        "module_params": len(list(model.parameters())),
        "prefetched": [u.prefetched is not None for u in z.units],
    }
    out.backward()
    after_backward = {"gathered": [u.gathered is not None for u in z.units],
                      "prefetched": [u.prefetched is not None for u in z.units],
                      "shard_grads": [s.grad.numel() for s in z.shards]}
    return {"fwd": after_forward, "bwd": after_backward,
            "shards": [s.numel() for s in z.shards]}


@pytest.mark.slow
def test_stage3_frees_gathered_weights_outside_compute() -> None:
    for o in spawn(_stage3_frees, 2):
        assert o["fwd"] == {"gathered": [False, False], "weights": [True, True],
                            "module_params": 0, "prefetched": [False, False]}
        assert o["bwd"]["gathered"] == [False, False]
        assert o["bwd"]["prefetched"] == [False, False]
        assert o["shards"] == [36, 18] and o["bwd"]["shard_grads"] == [36, 18]  # 72/2, 36/2


def _stage3_split_backward() -> dict[str, object]:
    """ZB-H1's B and W on a stage-3 model (linears with biases): the plain backward's shard
    gradients are the reference."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from shardwise.layout import Layout
    from shardwise.runtime.mesh import Mesh
    from shardwise.runtime.pipeline import backward_weight, defer_linears, deferring_weight_grads
    from shardwise.runtime.zero import ZeroConfig, ZeroDataParallel

    Mesh.from_layout(Layout(dp=dist.get_world_size()))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)).double()
    z = ZeroDataParallel(model, ZeroConfig(stage=3))
    x = torch.randn(2, 8, dtype=torch.float64)
    (z(x) ** 2).sum().backward()
    want = [s.grad.clone() for s in z.shards]
    z.zero_grad()
    with defer_linears():
        out = (z(x) ** 2).sum()
    with deferring_weight_grads() as later:  # B
        out.backward()
    after_b = {"gathered": [u.gathered is not None for u in z.units],
               "views": [model[0].weight is None, model[2].weight is None],
               "shard_grads": [s.grad is None for s in z.shards],
               "pending": len(later),
               "weights_held": any(isinstance(t, torch.Tensor)
                                   for op, _ in later for t in (op.weight, op.bias))}
    backward_weight(later)  # W
    return {"b": after_b, "error": max(float((s.grad - w).abs().max())
                                       for s, w in zip(z.shards, want)),
            "scatters": [e for e in z.events if e[0] == "reduce-scatter"]}


@pytest.mark.slow
def test_stage3_under_zb_h1_frees_gathered_weights_at_b_and_completes_gradients_at_w() -> None:
    """After B no gathered weights are held (the deferred ops point into the units' open
    gradients) and no shard gradient exists yet; W completes them: equal to the plain
    backward's, each unit reduce-scattered once per backward."""
    for o in spawn(_stage3_split_backward, 2):
        assert o["b"] == {"gathered": [False, False], "views": [True, True],
                          "shard_grads": [True, True], "pending": 2, "weights_held": False}
        assert o["error"] <= 1e-15
        assert o["scatters"] == [("reduce-scatter", 1), ("reduce-scatter", 0)] * 2


def _stage1_overlap() -> dict[str, object]:
    import torch
    import torch.distributed as dist
    from torch import nn

    from shardwise.errors import ShardwiseError
    from shardwise.layout import Layout
    from shardwise.runtime import collectives as C
    from shardwise.runtime.mesh import Mesh
    from shardwise.runtime.zero import ZeroConfig, ZeroDataParallel

    Mesh.from_layout(Layout(dp=dist.get_world_size()))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)).double()
    z = ZeroDataParallel(model, ZeroConfig(stage=1))
    x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with C.counting() as counter:
        with z.no_sync():
            z(x[:2]).sum().backward()
        accumulating = [u.pending is not None for u in z.units]
        z(x[2:]).sum().backward()
        in_backward = counter.bytes(axis="dp", op="reduce-scatter")
        started = [u.pending is not None for u in z.units]
        grads_freed = all(p.grad is None for p in model.parameters())
        try:
            z(x[2:]).sum().backward()
            second = ""
        except ShardwiseError as exc:
            second = str(exc)
        z.step()
        after_step = counter.bytes(axis="dp", op="reduce-scatter")
    return {"accumulating": accumulating, "started": started, "grads_freed": grads_freed,
            "in_backward": in_backward, "after_step": after_step, "second": second}


@pytest.mark.slow
def test_stage1_reduce_scatters_during_the_last_backward() -> None:
    """ZeRO-1 as DDP: a backward under no_sync() only accumulates; the next one starts every
    unit's reduce-scatter while it runs (all of the step's reduce-scatter bytes are sent
    before `step()`, none after) and frees the full gradients; a further backward before the
    step is refused in one line."""
    for o in spawn(_stage1_overlap, 2):
        assert o["accumulating"] == [False, False]
        assert o["started"] == [True, True] and o["grads_freed"]
        assert o["in_backward"] > 0 and o["after_step"] == o["in_backward"]
        assert "under no_sync()" in o["second"] and "\n" not in o["second"]


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_check_predicts_zero_padding_and_freed_gradients_exactly(stage: int) -> None:
    """dp = 3 does not divide the tiny model's units (180,800 parameters in 7 units): every
    flat unit is padded to a multiple of 3, and ZeRO-1 holds only its gradient shard after
    the step. The runtime's measured bytes (its allocator's storages, its collectives'
    counters) must equal check's prediction on every row."""
    out = json.loads(shardwise("check", "--zero", str(stage), "--dp", "3", "--global-batch",
                               "3", "--seq", "32", "--steps", "1", "--dtype", "fp64",
                               "--json").stdout)
    rows = {row["what"]: row for row in out["rows"]}
    assert out["ok"], [r for r in out["rows"] if not r["ok"]]
    # an unpadded prediction (180,800 elements) would miss the measured padded shards
    shard = rows["optimizer"]["measured"] / 16
    assert shard > 180_800 / 3 and rows["grads"]["measured"] == 8 * shard


@pytest.mark.slow
def test_check_predicts_hybrid_zero_exactly() -> None:
    """Hybrid ZeRO-2 over groups of 2 of 4 dp ranks: reduce-scatter and all-gather within a
    group, the gradient shard all-reduced across the 2 groups; every row exact."""
    out = json.loads(shardwise("check", "--zero", "2", "--dp", "4", "--zero-group", "2",
                               "--global-batch", "4", "--seq", "32", "--steps", "1",
                               "--dtype", "fp64", "--json").stdout)
    assert out["ok"], [r for r in out["rows"] if not r["ok"]]
    axes = {row["what"].split()[0] for row in out["rows"] if row["item"] == "comm"}
    assert axes == {"zero_shard", "zero_replica"}


def _idle_experts(stages: tuple[int, ...]) -> list[dict[str, object]]:
    """4 ranks, ep=2 (edp groups of 2), E=4 experts, top-1. The ep group holding ranks 0-1
    routes every token to experts 0-1, so the other rank of that group gets no rows, while its
    edp peer in the other ep group does. ZeRO-2/3 shard the experts over edp: one Adam step
    from each stage, returned with the single-device reference's (moe_layer on all tokens)."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from shardwise.layout import Layout
    from shardwise.ops.moe import MoEParams, moe_layer
    from shardwise.runtime.expert_parallel import ExpertParallelMoE
    from shardwise.runtime.mesh import Mesh
    from shardwise.runtime.zero import UnitSpec, ZeroConfig, ZeroDataParallel

    mesh = Mesh.from_layout(Layout(dp=4, ep=2))
    ep, edp = mesh.axis("ep"), mesh.axis("edp")
    h, f, n_exp, tokens = 8, 6, 4, 6
    gen = torch.Generator().manual_seed(0)
    router = torch.zeros(h, n_exp, dtype=torch.float64)
    router[:n_exp] = 10 * torch.eye(n_exp, dtype=torch.float64)  # logits = 10·x[:, :4]
    full = MoEParams(router, *(torch.randn(n_exp, *shape, generator=gen, dtype=torch.float64)
                               for shape in ((h, f), (h, f), (f, h))))
    xs = torch.randn(4, tokens, h, generator=gen, dtype=torch.float64)
    xs[list(mesh.shape.group_of("ep", 0)), :, 2:4] = -5.0  # rank 0's ep group: never 2, 3
    coef = torch.randn(4, tokens, h, generator=gen, dtype=torch.float64)

    def reference(step_lr: float) -> dict[str, torch.Tensor]:
        params = [nn.Parameter(t.clone()) for t in (full.router, full.w_gate, full.w_up,
                                                    full.w_down)]
        y = moe_layer(xs.reshape(-1, h), MoEParams(*params), 1).out.reshape(4, tokens, h)
        ((y * coef).sum() / 4).backward()  # the mean over ranks of each rank's objective
        torch.optim.Adam(params, lr=step_lr, foreach=False).step()
        return dict(zip(("router", "w_gate", "w_up", "w_down"), (p.detach() for p in params)))

    want = reference(1e-2)
    me, out = dist.get_rank(), []
    for stage in stages:
        layer = ExpertParallelMoE.from_full(full, 1, ep)
        zdp = ZeroDataParallel(layer, ZeroConfig(stage=stage, lr=1e-2), "dp", units=[
            UnitSpec(layer, select=lambda n: n == "router"),
            UnitSpec(layer, edp, lambda n: n != "router", divide=ep.size)])
        y, _ = zdp(xs[me])
        (y * coef[me]).sum().backward()
        zdp.step()
        got = zdp.full_parameters()
        local = slice(ep.rank * n_exp // 2, (ep.rank + 1) * n_exp // 2)
        error = max(float((got[n] - (want[n] if n == "router" else want[n][local])).abs().max())
                    for n in want)
        out.append({"stage": stage, "rows": int(layer.last_stats.local_expert_rows.sum()),
                    "error": error})
    return out


@pytest.mark.slow
def test_zero_2_and_3_with_idle_experts_train_like_one_device() -> None:
    """An expert no token reaches on one rank but not on its edp peer: every rank still
    reduce-scatters the expert gradients (a missing gradient counts as zeros), no hang, and
    the step equals one device's."""
    results = spawn(_idle_experts, 4, (2, 3), timeout_s=120)
    assert any(o["rows"] == 0 for rank in results for o in rank)  # the idle case happened
    assert any(o["rows"] > 0 for rank in results for o in rank)
    for rank in results:
        for o in rank:
            assert o["error"] <= 1e-12, o


@pytest.mark.slow
def test_check_is_exact_for_zero_with_experts_kv_replicas_and_zb_h1(tmp_path) -> None:
    """check's prediction equals the runtime's measurement on every row for: hybrid ZeRO-3
    with ep=2 (experts over edp_shard / edp_replica), ZeRO-2 with one kv head replicated over
    tp=2 (the shards' K/V elements all-reduced over tp), ZeRO-2 under ZB-H1, and ZeRO-3 under
    ZB-H1 with full recompute (one backward gather and one reduce-scatter per unit and
    micro-batch, as without either)."""
    mqa = tmp_path / "config.json"  # tiny's shape with a single kv head
    mqa.write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
        "vocab_size": 256, "max_position_embeddings": 64, "rms_norm_eps": 1e-5}))
    common = ["--seq", "32", "--steps", "1", "--dtype", "fp64", "--json"]
    for args in (["--model", "tiny-moe", "--dp", "4", "--ep", "2", "--zero", "3",
                  "--zero-group", "2", "--global-batch", "4"],
                 ["--model", str(mqa), "--dp", "2", "--tp", "2", "--zero", "2",
                  "--global-batch", "4"],
                 ["--dp", "2", "--pp", "2", "--zero", "2", "--schedule", "zb-h1",
                  "--global-batch", "8"],
                 ["--dp", "2", "--pp", "2", "--zero", "3", "--schedule", "zb-h1",
                  "--recompute", "full", "--global-batch", "8"]):
        out = json.loads(shardwise("check", *args, *common).stdout)
        assert out["ok"], (args, [r for r in out["rows"] if not r["ok"]])
        what = {row["what"] for row in out["rows"] if row["item"] == "comm"}
        if "--ep" in args:
            assert {"edp_replica all-reduce", "zero_replica all-reduce"} <= what
