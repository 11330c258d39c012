"""A training run under failures, simulated (Monte Carlo, seeded, vectorised over runs).

Failures of each component class (GPU, host, NIC, switch…) arrive as independent Poisson
processes; any of them stops the synchronous job. After a failure the job waits for spares
(if the pool is short), restarts, and resumes from its newest durable checkpoint. Policies:
synchronous, asynchronous (durable `lag` after the stall) or in-memory checkpoints to peers
(storage every k-th), and elastic continuation (drop the failed data-parallel replicas, keep
going at their share less, rejoin after repair). Where Daly's model holds (one class,
synchronous, restart interruptible, spares unlimited) the mean wall time equals
`estimate.goodput.wall_per_useful` (tested). Formulas and sources: docs/concepts/goodput.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

import shardwise.validate as validate
from shardwise.errors import ShardwiseError

HOUR, DAY = 3600.0, 86400.0
POLICIES = ("sync", "async", "memory")
_PENDING = 64  # repairs in flight tracked per run (spares)


@dataclass(frozen=True)
class FailureClass:
    """One kind of component: hours between failures of one (`mtbf_hours`), the GPUs one
    serves (`gpus_each`: 1 for a GPU, 8 for an eight-GPU host, 256 for a leaf switch…), the
    GPUs one failure stops (`blast_gpus`, default `gpus_each`) and hours until it is back."""

    name: str
    mtbf_hours: float
    gpus_each: int = 1
    blast_gpus: int | None = None
    repair_hours: float = 24.0

    def validate(self) -> None:
        """One `ShardwiseError` naming the first bad field."""
        validate.positive(self.mtbf_hours, f"{self.name}.mtbf_hours", high=1e9)
        validate.integer(self.gpus_each, f"{self.name}.gpus_each", low=1, high=10**7)
        if self.blast_gpus is not None:
            validate.integer(self.blast_gpus, f"{self.name}.blast_gpus", low=1, high=10**7)
        validate.positive(self.repair_hours, f"{self.name}.repair_hours", high=1e6)

    @property
    def blast(self) -> int:
        """GPUs one failure stops."""
        return self.blast_gpus or self.gpus_each

    def count(self, gpus: int) -> int:
        """Components of this class a job of `gpus` GPUs uses: `⌈gpus / gpus_each⌉`."""
        return -(-gpus // self.gpus_each)


@dataclass(frozen=True)
class Policy:
    """How the run saves and recovers. `interval_s` between checkpoints (None: Daly's optimum
    for the stall and the job MTBF); `stall_s` the step pause a checkpoint costs; `lag_s` until
    an asynchronous one is durable; `memory`: `storage_every`-th in-memory checkpoint is also
    written to storage, and a failure stopping at most `peer_gpus` GPUs recovers from memory
    (`memory_restart_s`); `elastic`: continue without the failed replicas (of `replica_gpus`)
    after `elastic_restart_s`, rejoining after the repair."""

    kind: str = "sync"
    interval_s: float | None = None
    stall_s: float = 60.0
    lag_s: float = 0.0
    restart_s: float = 600.0
    storage_every: int = 10
    peer_gpus: int = 8
    memory_restart_s: float = 120.0
    elastic: bool = False
    replica_gpus: int = 8
    elastic_restart_s: float = 120.0

    def validate(self) -> None:
        """One `ShardwiseError` naming the first bad field."""
        if self.kind not in POLICIES:
            raise ShardwiseError(f"unknown checkpoint policy {self.kind!r}; valid: "
                                 f"{', '.join(POLICIES)}")
        for name in ("stall_s", "lag_s", "restart_s", "memory_restart_s", "elastic_restart_s"):
            validate.finite(getattr(self, name), name, low=0, high=1e7)
        if self.interval_s is not None:
            validate.positive(self.interval_s, "interval_s", high=1e9)
        for name in ("storage_every", "peer_gpus", "replica_gpus"):
            validate.integer(getattr(self, name), name, low=1, high=10**7)


@dataclass(frozen=True)
class Fleet:
    """The job's GPUs, its failure processes, its spare GPUs (None: always enough) and how long
    a failure takes to notice."""

    gpus: int
    classes: tuple[FailureClass, ...]
    spares: int | None = None
    detect_s: float = 0.0

    def validate(self) -> None:
        """One `ShardwiseError` naming the first bad field."""
        validate.integer(self.gpus, "gpus", low=1, high=10**7)
        if not self.classes:
            raise ShardwiseError("a failure model needs at least one component class")
        for cls in self.classes:
            cls.validate()
        if self.spares is not None:
            validate.integer(self.spares, "spares", low=0, high=10**7)
        validate.finite(self.detect_s, "detect_s", low=0, high=1e7)

    @property
    def rates(self) -> np.ndarray:
        """Failures per second of each class over the job: count / MTBF."""
        return np.array([cls.count(self.gpus) / (cls.mtbf_hours * HOUR)
                         for cls in self.classes])

    @property
    def job_mtbf_s(self) -> float:
        """Seconds between job-stopping failures: 1 / the classes' summed rates."""
        return float(1.0 / self.rates.sum())

    def with_gpus(self, gpus: int) -> Fleet:
        """The same failure processes for a job of `gpus` GPUs."""
        return replace(self, gpus=gpus)


def single_class(gpus: int, mtbf_gpu_hours: float) -> Fleet:
    """Daly's assumption: independent GPU failures, each stopping one GPU."""
    return Fleet(gpus, (FailureClass("gpu", mtbf_gpu_hours),))


@dataclass(frozen=True)
class Outcome:
    """Per-run wall seconds, interruptions and lost (redone) work seconds, and their
    summaries (mean, p10, median, p90) of goodput, days, interruptions and lost hours."""

    wall_s: np.ndarray
    work_s: float
    interruptions: np.ndarray
    lost_s: np.ndarray
    interval_s: float
    summary: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def goodput(self) -> np.ndarray:
        """Useful work over wall time, per run."""
        return self.work_s / self.wall_s


def _quantiles(values: np.ndarray) -> dict[str, float]:
    p10, p50, p90 = np.quantile(values, [0.1, 0.5, 0.9])
    return {"mean": float(values.mean()), "p10": float(p10), "median": float(p50),
            "p90": float(p90)}


def _interval(fleet: Fleet, policy: Policy) -> float:
    if policy.interval_s is not None:
        return policy.interval_s
    from shardwise.estimate.goodput import daly_interval

    return float(max(daly_interval(policy.stall_s, fleet.job_mtbf_s), policy.lag_s, 1.0))


def simulate(work_s: float, fleet: Fleet, policy: Policy, *, runs: int = 1000,
             seed: int = 0, trace: list[dict[str, Any]] | None = None) -> Outcome:
    """`runs` independent runs of `work_s` seconds of useful training under `fleet`'s failures
    and `policy`; a run ends when all its work is durable. One loop step per failure, every
    run at once: the window between failures holds whole segments (work `τ`, then the
    checkpoint's stall); the partial one is redone. `trace` (a list) receives the first run's
    state at each of its failures and at its end (`timeline` draws it)."""
    fleet.validate()
    policy.validate()
    validate.positive(work_s, "work", high=1e10)
    validate.integer(runs, "runs", low=1, high=10**6)
    rng = np.random.default_rng(seed)
    mtbf, tau = fleet.job_mtbf_s, _interval(fleet, policy)
    segment = tau + policy.stall_s
    lag = policy.lag_s if policy.kind == "async" else 0.0
    rates = fleet.rates
    blast = np.array([cls.blast for cls in fleet.classes])
    repair = np.array([cls.repair_hours * HOUR for cls in fleet.classes])
    replicas = max(fleet.gpus // policy.replica_gpus, 1)

    wall, done, stored = np.zeros(runs), np.zeros(runs), np.zeros(runs)
    lost, count = np.zeros(runs), np.zeros(runs, dtype=np.int64)
    pause = np.zeros(runs)  # not working yet after the last failure (detect, wait, restart)
    slow_until, slow_rate = np.zeros(runs), np.ones(runs)  # elastic: fewer replicas until
    # spares: repairs under way (return time, GPUs); an unused slot has returned (-inf)
    returns, back = np.full((runs, _PENDING), -np.inf), np.zeros((runs, _PENDING))
    active = np.ones(runs, dtype=bool)
    for _ in range(int(min(100 * (work_s / mtbf + 10), 10**7))):
        idx = np.flatnonzero(active)
        if idx.size == 0:
            break
        gap = rng.exponential(mtbf, idx.size)
        start = wall[idx] + pause[idx]
        window = gap - pause[idx]  # working time before the next failure (< 0: none)
        rate = np.where(slow_until[idx] > start, slow_rate[idx], 1.0)
        degraded = np.clip(slow_until[idx] - start, 0, None)
        # work-equivalent seconds in the window: the degraded part at `rate`, then full speed
        equiv = np.where(window > 0, rate * np.minimum(window, degraded)
                         + np.clip(window - degraded, 0, None), 0.0)
        remaining = work_s - done[idx]
        need = remaining + np.ceil(remaining / tau - 1e-9) * policy.stall_s + lag
        finish = equiv >= need
        at_rate = rate * degraded
        finish_wall = np.where(need <= at_rate, need / np.maximum(rate, 1e-12),
                               degraded + need - at_rate)
        if trace is not None and idx[0] == 0:  # the first run, still going
            trace.append({"t": float(wall[0]), "pause": float(pause[0]),
                          "gap": float(gap[0]), "rate": float(rate[0]),
                          "degraded": float(degraded[0]), "equiv": float(equiv[0]),
                          "need": float(need[0]), "done": float(done[0]),
                          "lost": float(lost[0]), "finish": bool(finish[0])})
        f = idx[finish]
        wall[f] += pause[f] + finish_wall[finish]
        done[f], active[f] = work_s, False
        i, eq, gap = idx[~finish], equiv[~finish], gap[~finish]
        full = np.floor(eq / segment)  # checkpoints taken in the window
        durable = np.clip(np.floor((eq - lag) / segment), 0, full) if lag else full
        progressed = done[i] + durable * tau
        wall[i] += gap
        count[i] += 1
        cls = rng.choice(len(rates), size=i.size, p=rates / rates.sum())
        restart = np.full(i.size, policy.restart_s)
        kept_by: tuple[str, np.ndarray] | None = None  # recovered without storage: how, which
        if policy.elastic:  # the other replicas hold the state: nothing to redo
            dropped = np.ceil(blast[cls] / policy.replica_gpus)
            survive = dropped < replicas
            kept = done[i] + eq * tau / segment
            lost[i] += np.where(survive, 0.0, np.clip(eq - durable * segment, 0, None))
            done[i] = np.where(survive, np.minimum(kept, work_s), progressed)
            slow_rate[i] = np.where(survive, 1 - dropped / replicas, 1.0)
            slow_until[i] = np.where(survive, wall[i] + repair[cls], 0.0)
            restart = np.where(survive, policy.elastic_restart_s, restart)
            pause[i] = fleet.detect_s + restart
            kept_by = ("elastic", survive)
        else:
            lost[i] += np.clip(eq - durable * segment, 0, None)
            if policy.kind == "memory":
                chunk = policy.storage_every * tau
                stored[i] = np.maximum(stored[i], np.floor(progressed / chunk + 1e-9) * chunk)
                from_memory = blast[cls] <= policy.peer_gpus  # a peer's copy survives it
                lost[i] += np.where(from_memory, 0.0, progressed - stored[i])
                done[i] = np.where(from_memory, progressed, stored[i])
                restart = np.where(from_memory, policy.memory_restart_s, restart)
                kept_by = ("memory", from_memory)
            else:
                done[i] = progressed
            wait = (np.zeros(i.size) if fleet.spares is None else
                    _spares_wait(returns, back, i, wall[i], blast[cls], repair[cls],
                                 fleet.spares))
            pause[i] = fleet.detect_s + wait + restart
        if trace is not None and i.size and i[0] == 0:
            trace[-1] |= {"class": fleet.classes[int(cls[0])].name,
                          "recovery": kept_by[0] if kept_by and kept_by[1][0] else "storage", "durable": float(durable[0]),
                          "lost_after": float(lost[0]), "done_after": float(done[0]),
                          "pause_after": float(pause[0])}
    else:
        raise ShardwiseError("the simulation did not finish: the job makes no progress "
                             "between failures (a shorter checkpoint stall or fewer failures)")
    outcome = Outcome(wall, work_s, count, lost, tau)
    summary = {"goodput": _quantiles(outcome.goodput), "days": _quantiles(wall / DAY),
               "interruptions": _quantiles(count.astype(float)),
               "lost_hours": _quantiles(lost / HOUR)}
    return replace(outcome, summary=summary)


def timeline(work_s: float, fleet: Fleet, policy: Policy, *, runs: int = 1, seed: int = 0,
             straggler: float = 1.0) -> dict[str, Any]:
    """The first of `simulate(work_s · straggler, fleet, policy, runs=runs, seed=seed)`'s runs
    as events, in seconds from its start: the windows it trained (`work`), the checkpoints it
    finished, each failure (its class, how it recovered, the work it lost), the restarts and
    the stretches redone (`lost`: from the last durable checkpoint to the failure). `straggler`
    (≥ 1) stretches the work as the slowest rank does: `1 − 1/straggler` of each window waits
    for it. The run's totals (`wall_s`, `interruptions`, `lost_s`) are `simulate`'s."""
    validate.finite(straggler, "straggler", low=1, high=100)
    trace: list[dict[str, Any]] = []
    out = simulate(work_s * straggler, fleet, policy, runs=runs, seed=seed, trace=trace)
    segment = out.interval_s + policy.stall_s
    lag = policy.lag_s if policy.kind == "async" else 0.0
    work, checkpoints, restarts, lost, failures = [], [], [], [], []
    for r in trace:
        begin = r["t"] + r["pause"]
        fast = r["rate"] * r["degraded"]

        def at(e: float, begin: float = begin, r: dict[str, Any] = r, fast: float = fast
               ) -> float:  # wall time `e` work-equivalent seconds into the window
            return begin + (e / r["rate"] if e <= fast else r["degraded"] + e - fast)

        end = at(r["need"]) if r["finish"] else r["t"] + r["gap"]
        if r["pause"] > 0:  # the restart after the previous failure (cut short by this one)
            restarts.append([r["t"], min(begin, end)])
        if end <= begin:
            failures.append(_failure(r, end, 0.0))
            continue
        work.append([begin, end])
        if r["finish"]:
            n = int(np.ceil((work_s * straggler - r["done"]) / out.interval_s - 1e-9))
            checkpoints += [at(k * segment) for k in range(1, n)] + [at(r["need"] - lag)]
            continue
        checkpoints += [at(k * segment) for k in range(1, int(r["equiv"] // segment) + 1)]
        redone = r["lost_after"] - r["lost"]
        if r["recovery"] != "elastic" and r["equiv"] > r["durable"] * segment:
            lost.append([at(r["durable"] * segment), end])
        failures.append(_failure(r, end, redone))
    wall = float(out.wall_s[0])
    return {"work_s": work_s, "straggler_factor": straggler, "interval_s": out.interval_s,
            "stall_s": policy.stall_s, "policy": policy.kind, "elastic": policy.elastic,
            "wall_s": wall, "goodput": work_s / wall, "interruptions": int(out.interruptions[0]),
            "lost_s": float(out.lost_s[0]), "straggler_share": 1 - 1 / straggler,
            "work": work, "checkpoints": checkpoints, "restarts": restarts, "lost": lost,
            "failures": failures}


def _failure(r: dict[str, Any], t: float, redone: float) -> dict[str, Any]:
    return {"t": t, "class": r["class"], "recovery": r["recovery"], "lost_s": redone,
            "restart_s": r["pause_after"]}


def _spares_wait(returns: np.ndarray, back: np.ndarray, runs: np.ndarray, now: np.ndarray,
                 need: np.ndarray, repair: np.ndarray, spares: int) -> np.ndarray:
    """Seconds each run waits for `need` GPUs: spares when enough are free before the failed
    ones are repaired (spares out for repair return at `returns`, `back` GPUs each; the failed
    GPUs then join the pool at `now + repair`), else the repair itself."""
    out = returns[runs] > now[:, None]  # (runs, slots): repairs still under way
    pending = np.where(out, back[runs], 0.0)
    free = spares - pending.sum(axis=1)
    order = np.argsort(returns[runs], axis=1)
    times = np.take_along_axis(returns[runs], order, axis=1)
    enough = free[:, None] + np.cumsum(np.take_along_axis(pending, order, axis=1),
                                       axis=1) >= need[:, None]
    later = np.where(enough.any(axis=1),
                     np.take_along_axis(times, np.argmax(enough, axis=1)[:, None], axis=1)[:, 0],
                     np.inf)
    ready = np.where(free >= need, now, later)
    use = ready < now + repair
    slot = np.argmin(np.where(out, returns[runs], -np.inf), axis=1)  # a finished one first
    returns[runs[use], slot[use]] = (now + repair)[use]
    back[runs[use], slot[use]] = need[use]
    return np.where(use, ready - now, repair)


def stragglers_factor(samples: Any, ranks: float) -> float:
    """Expected slowest of `ranks` independent draws from `samples` (relative step times of one
    rank, 1 = nominal): a synchronous step waits for it. Order statistics of the empirical
    distribution: `E[max] = Σ x_(i)·((i/n)^N − ((i−1)/n)^N)` (`N` may be fractional: the
    samples may already be the slowest of several ranks, `measured_stragglers`)."""
    x = np.sort(np.asarray(samples, dtype=float).ravel())
    if x.size == 0 or not np.isfinite(x).all() or (x <= 0).any():
        raise ShardwiseError("straggler samples must be positive, finite relative step times")
    validate.finite(ranks, "ranks", low=0, low_open=True, high=1e8)
    cdf = np.arange(x.size + 1) / x.size
    with np.errstate(divide="ignore"):
        weights = np.diff(np.exp(ranks * np.log(cdf)))  # P(max is the i-th smallest)
    return float(np.dot(x, weights))


def measured_stragglers(path: str | Path) -> tuple[np.ndarray, int]:
    """Relative step times (÷ their median) from `shardwise train --json` output, the warm-up
    step left out, and the ranks each step waited for: each step already is the slowest of
    those ranks, so `N` ranks draw `stragglers_factor(samples, N / ranks)`."""
    from shardwise.files import read_json

    data = read_json(path, "training run (shardwise train --json)")
    try:
        seconds = np.array([float(r["seconds"]) for r in data["records"]][1:])
        ranks = int(data["ranks"])
    except (KeyError, TypeError, ValueError):
        raise ShardwiseError(f"{path}: not the output of `shardwise train --json` (records with "
                             "seconds, ranks)") from None
    if seconds.size < 2 or not np.isfinite(seconds).all() or (seconds <= 0).any():
        raise ShardwiseError(f"{path}: needs at least 3 timed steps to measure stragglers")
    return seconds / np.median(seconds), ranks


def policy_options(goodput: Any, replica_gpus: int) -> dict[str, Policy]:
    """The checkpoint policies `policies` compares, for one layout's `Goodput` (its copy,
    write and restart seconds), by name."""
    restart = goodput.restart_s
    return {
        "synchronous": Policy("sync", stall_s=goodput.write_s, restart_s=restart),
        "asynchronous": Policy("async", stall_s=goodput.copy_s,
                               lag_s=goodput.write_s - goodput.copy_s, restart_s=restart),
        "in-memory": Policy("memory", stall_s=goodput.copy_s, restart_s=restart,
                            memory_restart_s=restart / 5, storage_every=10, peer_gpus=8),
        "elastic": Policy("sync", stall_s=goodput.write_s, restart_s=restart, elastic=True,
                          replica_gpus=replica_gpus, elastic_restart_s=restart / 5),
    }


def planned_policy(goodput: Any) -> str:
    """The policy a layout's plan prices: asynchronous when its stack saves asynchronously."""
    return "asynchronous" if goodput.async_checkpoint else "synchronous"


def policies(goodput: Any, fleet: Fleet, *, replica_gpus: int, work_s: float,
             runs: int = 200, seed: int = 0, straggler: float = 1.0) -> dict[str, Any]:
    """Each checkpoint policy simulated for one layout (`estimate.goodput.Goodput`: its copy,
    write and restart seconds) under `fleet`: synchronous (stall = the write), asynchronous
    (stall = the device→host copy, durable a write later), in-memory to peers (stall = the
    copy; storage every 10th; a failure of ≤ 8 GPUs reloads from a peer in a fifth of the
    restart) and elastic (replicas of `replica_gpus`). `straggler` (≥ 1) stretches the work:
    the slowest rank sets every synchronous step. The best policy and its gain over the one
    planned (`goodput.async_checkpoint`)."""
    work = work_s * straggler
    options = policy_options(goodput, replica_gpus)
    out = {name: simulate(work, fleet, policy, runs=runs, seed=seed)
           for name, policy in options.items()}
    rows: dict[str, dict[str, Any]] = {name: {**o.summary, "interval_s": o.interval_s,
                   "goodput_vs_ideal": {k: v / straggler
                                        for k, v in o.summary["goodput"].items()}}
            for name, o in out.items()}
    planned = planned_policy(goodput)
    best = max(rows, key=lambda name: rows[name]["goodput"]["mean"])
    gain = rows[best]["goodput"]["mean"] - rows[planned]["goodput"]["mean"]
    return {"runs": runs, "work_s": work, "straggler_factor": straggler, "planned": planned,
            "best": best, "gain": gain, "policies": rows,
            "job_mtbf_hours": fleet.job_mtbf_s / HOUR}


def load_failure_model(path: str | Path, gpus: int) -> tuple[Fleet, Policy]:
    """A failure model from a JSON file: `{"classes": [{"name", "mtbf_hours", "gpus_each",
    "blast_gpus", "repair_hours"}…], "spares", "detect_s", "policy": {Policy's fields}}`, for a
    job of `gpus` GPUs."""
    from shardwise.files import read_json

    data = read_json(path, "failure model")
    if not isinstance(data, dict):
        raise ShardwiseError(f"{path}: a failure model is a JSON object")
    known = {"classes", "spares", "detect_s", "policy"}
    if unknown := set(data) - known:
        raise ShardwiseError(f"{path}: unknown key(s) {', '.join(sorted(unknown))}; valid: "
                             f"{', '.join(sorted(known))}")
    try:
        classes = tuple(FailureClass(**c) for c in data.get("classes", []))
        fleet = Fleet(gpus, classes, data.get("spares"), data.get("detect_s", 0.0))
        policy = Policy(**data.get("policy", {}))
    except TypeError as exc:
        raise ShardwiseError(f"{path}: {exc}") from None
    fleet.validate()
    policy.validate()
    return fleet, policy
