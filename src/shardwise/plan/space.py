"""The search space: the values each layout axis may take (SPEC §7)."""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.arch import ModelSpec
from shardwise.errors import ShardwiseError
from shardwise.estimate.compute import RC_CODES
from shardwise.hardware import Cluster
from shardwise.layout import TrainSpec
from shardwise.schedules.registry import SEARCHED_SCHEDULES, get_schedule

DEFAULT_HEADROOM = 0.85  # plan for 85 % of GPU memory


def _divisors(n: int) -> list[int]:
    """The divisors of n ≥ 1, ascending, from its prime factorisation (trials up to √n, not
    n: instant for any n the model caps allow)."""
    divisors, p = [1], 2
    while p * p <= n:
        count = 0
        while n % p == 0:
            n, count = n // p, count + 1
        divisors = [x * p**k for x in divisors for k in range(count + 1)]
        p += 1
    if n > 1:  # one prime factor above √n is left
        divisors += [x * n for x in divisors]
    return sorted(divisors)


@dataclass(frozen=True)
class SearchSpace:
    """The values each axis may take (`None`: the default described in `shardwise.plan`)."""

    tp: tuple[int, ...] | None = None
    pp: tuple[int, ...] | None = None
    cp: tuple[int, ...] | None = None
    ep: tuple[int, ...] | None = None
    micro_batch: tuple[int, ...] | None = None
    zero: tuple[int, ...] = (0, 1, 2, 3)
    zero_groups: tuple[int, ...] | None = None
    sp: tuple[bool, ...] = (False, True)
    recompute: tuple[str, ...] = ("none", "selective", "full")
    schedules: tuple[str, ...] = SEARCHED_SCHEDULES
    chunks: tuple[int, ...] | None = None
    max_cp: int = 32
    max_micro_batch: int = 16

    def resolve(self, model: ModelSpec, cluster: Cluster, train: TrainSpec) -> dict[str, list]:
        """Concrete value lists for this model and cluster."""
        n = cluster.n_gpus
        tp = list(self.tp or _divisors(cluster.gpus_per_node))
        # pp dividing the layers, and uneven pp that divides the GPUs with the balanced default
        # partition (`Layout.stage_partition`: ≥ 1 layer per stage, so 2·pp ≤ L + 2)
        pp = list(self.pp or sorted(
            {d for d in _divisors(model.n_layers) if d <= n}
            | {d for d in _divisors(n) if 2 * d <= model.n_layers + 2}))
        cp = list(self.cp or [c for c in (2**k for k in range(0, 16))
                              if (c <= min(self.max_cp, n) and train.seq_len % (2 * c) == 0)
                              or c == 1])
        ep = list(self.ep or (_divisors(model.n_experts) if model.is_moe else [1]))
        mb = list(self.micro_batch or range(1, self.max_micro_batch + 1))
        chunks = list(self.chunks or [d for d in _divisors(model.n_layers) if d >= 2])
        groups = list(self.zero_groups or [2**k for k in range(1, 20) if 2**k < n])
        sched: list[tuple[int, int]] = []
        for name in self.schedules:
            info = get_schedule(name)
            if info.chunked:
                sched += [(info.code, v) for v in chunks if v >= 2]
            else:
                sched.append((info.code, 1))
        zero: list[tuple[int, int]] = [(z, 0) for z in self.zero]
        zero += [(z, g) for z in self.zero if z >= 1 for g in groups]
        for name in self.recompute:
            if name not in RC_CODES:
                raise ShardwiseError(f"unknown recompute {name!r}; valid: none, selective, full")
        return {"tp": tp, "pp": pp, "cp": cp, "ep": ep, "micro_batch": mb, "schedule": sched,
                "zero": zero, "sp": [int(bool(x)) for x in self.sp],
                "recompute": [RC_CODES[r] for r in self.recompute]}
