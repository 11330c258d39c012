"""The search space: the values each layout axis may take (SPEC §7), and the user's
constraints on them (`--fix`, `--max`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import shardwise.validate as validate
from shardwise.arch import ModelSpec
from shardwise.errors import ShardwiseError
from shardwise.estimate.compute import RC_CODES
from shardwise.hardware import Cluster
from shardwise.layout import CP_KINDS, RECOMPUTE, SCHEDULES, Layout, TrainSpec
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
    """The values each axis may take (`None`: the default described in `shardwise.plan`).
    `resolve` keeps only what the run's stack can run (`stacks.Stack`: its axes, ZeRO forms,
    recompute policies and pipeline schedules)."""

    tp: tuple[int, ...] | None = None
    pp: tuple[int, ...] | None = None
    cp: tuple[int, ...] | None = None
    ep: tuple[int, ...] | None = None
    # expert tensor parallel: 0 (= tp, Megatron's default) and 1 (experts unsplit, the
    # DeepSeek-V3 recipes' choice) for MoE models
    etp: tuple[int, ...] | None = None
    cp_kinds: tuple[str, ...] = CP_KINDS  # with cp > 1; the hybrid's all-to-all spans a node
    micro_batch: tuple[int, ...] | None = None
    zero: tuple[int, ...] = (0, 1, 2, 3)
    zero_groups: tuple[int, ...] | None = None
    sp: tuple[bool, ...] = (False, True)
    recompute: tuple[str, ...] | None = None
    schedules: tuple[str, ...] = SEARCHED_SCHEDULES
    chunks: tuple[int, ...] | None = None
    max_cp: int = 32
    max_micro_batch: int = 16
    constraint: Constraint | None = None  # the user's --fix / --max
    # host offloads to compare (`stacks.OFFLOADS`; None: the run's `TrainSpec.offload` only):
    # the search runs once per kind the stack has and keeps the fastest (`plan.search.plan`)
    offload: tuple[str, ...] | None = None

    def resolve(self, model: ModelSpec, cluster: Cluster, train: TrainSpec) -> dict[str, list]:
        """Concrete value lists for this model, cluster and stack."""
        n = cluster.n_gpus
        stack = train.stack
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
        etp = list(self.etp or ([0, 1] if model.is_moe else [0]))
        mb = list(self.micro_batch or range(1, self.max_micro_batch + 1))
        chunks = list(self.chunks or [d for d in _divisors(model.n_layers) if d >= 2])
        tp, pp, cp, ep = ([1] if axis not in stack.axes else values
                          for axis, values in (("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep)))
        if not {"ring", "allgather"} & set(stack.cp_kinds):  # the searched context
            cp = [1]  # parallelism: ring attention, or a stack's all-gather (torchtitan's)
        groups = list(self.zero_groups or [2**k for k in range(1, 20) if 2**k < n])
        sched: list[tuple[int, int]] = []
        for name in (s for s in self.schedules if s in stack.schedules() or s == "1f1b"):
            info = get_schedule(name)
            sched += [(info.code, v) for v in info.chunk_options(chunks)]
        offload = stack.offload_support(train.offload)  # its ZeRO stages only
        stages = [z for z in self.zero if z in stack.zero
                  and (offload is None or z in offload.zero)]
        zero: list[tuple[int, int]] = [(z, 0) for z in stages]
        zero += [(z, g) for z in stages if z >= 1 and z in stack.zero_hybrid for g in groups]
        recompute = self.recompute or stack.recompute
        for name in recompute:
            if name not in RC_CODES:
                raise ShardwiseError(f"unknown recompute {name!r}; valid: {', '.join(RC_CODES)}")
        searched = [r for r in recompute if r in stack.recompute]
        fixed = self.constraint.fixed if self.constraint else ()
        for key, value in fixed:  # a recompute not searched: no grid at all, so say so here
            if key == "recompute" and value not in searched:
                raise ShardwiseError(f"--fix recompute={value}: the {stack.name} search has no "
                                     f"{value} recompute; valid: {', '.join(searched)}")
        for name in self.cp_kinds:
            if name not in CP_KINDS:
                raise ShardwiseError(f"unknown cp kind {name!r}; valid: {', '.join(CP_KINDS)}")
        return {"tp": tp, "pp": pp, "cp": cp, "ep": ep, "etp": etp, "micro_batch": mb,
                "schedule": sched,
                "cp_kind": [CP_KINDS.index(k) for k in self.cp_kinds if k in stack.cp_kinds]
                or [0],
                "zero": zero, "sp": [int(bool(x)) for x in self.sp],
                "recompute": [RC_CODES[r] for r in searched]}

    def constrained(self, axes: dict[str, list]) -> tuple[dict[str, list], dict[str, list]]:
        """(the grid: `axes` with each `--fix` value added where missing, the values the
        constraint allows of it); without a constraint both are `axes`."""
        rule = self.constraint
        if not rule:
            return axes, axes
        fixed = dict(rule.fixed)
        grid = {key: list(values) for key, values in axes.items()}
        for key in ("tp", "pp", "cp", "ep", "etp", "micro_batch"):
            if key in fixed and fixed[key] not in grid[key]:
                grid[key] = sorted([*grid[key], fixed[key]])
        if "schedule" in fixed:
            info = get_schedule(fixed["schedule"])
            pair = (info.code, fixed.get("chunks", info.default_chunks))
            if pair not in grid["schedule"]:
                grid["schedule"].append(pair)
        if "zero" in fixed or "zero_group" in fixed:
            pair = (fixed.get("zero", 1 if fixed.get("zero_group") else 0),
                    fixed.get("zero_group", 0))
            if pair not in grid["zero"]:
                grid["zero"].append(pair)
        names = {code: name for name, code in RC_CODES.items()}
        allowed = {
            **{key: [v for v in grid[key] if rule.allows(key, v)]
               for key in ("tp", "pp", "cp", "ep", "etp", "micro_batch")},
            "schedule": [(code, v) for code, v in grid["schedule"]
                         if rule.allows("schedule", get_schedule(code).name)
                         and rule.allows("chunks", v)],
            "zero": [(z, g) for z, g in grid["zero"]
                     if rule.allows("zero", z) and rule.allows("zero_group", g)],
            "sp": [x for x in grid["sp"] if rule.allows("sp", bool(x))],
            "recompute": [c for c in grid["recompute"] if rule.allows("recompute", names[c])],
        }
        return grid, allowed


# the layout fields the search varies (dp follows from the GPUs the others leave)
SEARCHED_FIELDS = ("dp", "tp", "pp", "cp", "ep", "etp", "micro_batch", "schedule", "chunks",
                   "zero", "zero_group", "sp", "recompute", "partition", "cp_kind")
_COUNTS = ("dp", "tp", "pp", "cp", "ep", "micro_batch", "chunks")  # etp: 0 means tp


@dataclass(frozen=True)
class Constraint:
    """The layouts the user allows: `fixed` fields equal to a value (`--fix tp=8,pp=4`), `most`
    fields at most a value (`--max tp=8`), in the syntax of `Layout.parse`. The search
    enumerates only what satisfies both (`grid._enumerate`) and counts what they exclude."""

    fixed: tuple[tuple[str, Any], ...] = ()
    most: tuple[tuple[str, int], ...] = ()

    @classmethod
    def parse(cls, fix: str | None = None, most: str | None = None) -> Constraint:
        """`Constraint.parse("tp=8,pp=4", "cp=2")`; `ShardwiseError` (one line) on bad text."""
        fixed, limits = _fields("--fix", fix), _fields("--max", most)
        for option, values in (("--fix", fixed), ("--max", limits)):
            for key, value in values.items():
                if key not in SEARCHED_FIELDS:
                    raise ShardwiseError(f"{option} {key}: the search does not vary {key}; "
                                         f"valid: {', '.join(SEARCHED_FIELDS)}")
                _check(option, key, value)
        for key in limits:
            if key in ("schedule", "recompute", "sp", "partition", "cp_kind"):
                raise ShardwiseError(f"--max {key}: --max takes counts ({', '.join(_COUNTS)}, "
                                     f"zero, zero_group); use --fix {key}=…")
        return cls(tuple(fixed.items()), tuple(limits.items()))

    def __bool__(self) -> bool:
        return bool(self.fixed or self.most)

    def allows(self, field: str, value: Any) -> bool:
        """Whether `field = value` satisfies every constraint on that field."""
        return (all(value == want for key, want in self.fixed if key == field)
                and all(value <= cap for key, cap in self.most if key == field))

    def describe(self) -> str:
        """`fix tp=8,pp=4; max cp=2`: how the rejected-regions table names it."""
        def text(items: tuple[tuple[str, Any], ...]) -> str:
            return ",".join(f"{k}={_shown(v)}" for k, v in items)

        return "; ".join(f"{name} {text(items)}" for name, items in
                         (("fix", self.fixed), ("max", self.most)) if items)


def _fields(option: str, text: str | None) -> dict[str, Any]:
    try:
        return Layout.parse_fields(text or "")
    except ShardwiseError as exc:
        raise ShardwiseError(f"{option}: {exc}") from None


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, tuple):
        return ":".join(map(str, value))
    return str(value)


def _check(option: str, key: str, value: Any) -> None:
    name = f"{option} {key}"
    if key in _COUNTS:
        validate.degree(value, name)
    elif key == "zero":
        validate.integer(value, name, low=0, high=3)
    elif key in ("zero_group", "etp"):  # 0: all dp·cp ranks / the tp degree
        validate.integer(value, name, low=0, high=validate.MAX_DEGREE)
    elif key == "schedule" and value not in SCHEDULES:
        raise ShardwiseError(f"{name}={value!r} unknown; valid: {', '.join(SCHEDULES)}")
    elif key == "cp_kind" and value not in CP_KINDS:
        raise ShardwiseError(f"{name}={value!r} unknown; valid: {', '.join(CP_KINDS)}")
    elif key == "recompute" and value not in RECOMPUTE:
        raise ShardwiseError(f"{name}={value!r} unknown; valid: {', '.join(RECOMPUTE)}")
