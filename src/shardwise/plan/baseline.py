"""SPEC §7's decision procedure, kept as the baseline the search is compared with."""

from __future__ import annotations

from shardwise.arch import ModelSpec
from shardwise.errors import LayoutError, ShardwiseError
from shardwise.estimate.memory import (
    training_memory_per_gpu,
)
from shardwise.estimate.uncertainty import generation
from shardwise.hardware import Cluster
from shardwise.layout import Layout, TrainSpec
from shardwise.plan.space import DEFAULT_HEADROOM, _divisors


def choose_parallelism(model: ModelSpec, cluster: Cluster, train: TrainSpec, *,
                       headroom: float = DEFAULT_HEADROOM) -> Layout:
    """SPEC §7's decision procedure (the baseline the search must beat):

    1. TP inside the NVLink domain: `t ≤ min(8, gpus_per_node)`, `t | heads`, `t | kv heads`
       (or a multiple of them, replicated);
    2. PP across nodes, `p | layers`, 1F1B;
    3. DP with ZeRO-1 over the remaining ranks (FSDP, ZeRO-3, when ZeRO-1 fits nowhere);
    4. the smallest `t·p` whose largest stage fits GPU memory × headroom with selective
       recompute (sequence parallel when t > 1) and micro-batch 1; ties → larger `t`;
    5. CP only when the sequence forces it (nothing fits at cp = 1: try 2, 4, …), EP only for
       MoE (the most experts per replica group that divides dp·cp).
    """
    budget = cluster.accelerator.memory_bytes * headroom
    gen = generation(cluster.accelerator.calibration_name)
    n = cluster.n_gpus
    tps = [t for t in _divisors(min(8, cluster.gpus_per_node)) if model.n_heads % t == 0
           and (model.n_kv_heads % t == 0 or t % model.n_kv_heads == 0)
           and model.d_ff % t == 0]
    pps = _divisors(model.n_layers)
    tried = []
    c = 1
    while c <= n and (c == 1 or train.seq_len % (2 * c) == 0):
        options = sorted(((t, p) for t in tps for p in pps if n % (t * p * c) == 0),
                         key=lambda tp: (tp[0] * tp[1], -tp[0]))
        for zero in (1, 3):
            for t, p in options:
                dp = n // (t * p * c)
                ep = 1
                if model.is_moe:
                    ep = max(e for e in _divisors(model.n_experts) if (dp * c) % e == 0)
                layout = Layout(dp=dp, tp=t, pp=p, cp=c, ep=ep, zero=zero if dp * c > 1 else 0,
                                sp=t > 1, schedule="1f1b", recompute="selective",
                                micro_batch=1)
                try:
                    layout.validate(model, cluster, train)
                except LayoutError:
                    continue
                peak = max(s.total for s in training_memory_per_gpu(
                    model, layout, train, generation=gen))
                tried.append((peak, layout))
                if peak <= budget:
                    return layout
        c *= 2
    if not tried:
        raise ShardwiseError("no layout satisfies the divisibility rules")
    peak, layout = min(tried, key=lambda x: x[0])
    raise ShardwiseError(
        f"nothing fits: the leanest ({layout.short()}) needs {peak / 2**30:.1f} GiB of "
        f"{budget / 2**30:.1f} GiB"
    )
