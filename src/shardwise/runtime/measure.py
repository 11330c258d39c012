"""What a run really holds and moves, against the analytic model (SPEC §9).

`check_layout(config, steps)` runs on every rank of a layout: it builds the training state,
runs `steps` real optimizer steps and measures communication (counted and on the wire),
saved activations (`runtime.saved_tensors`), state, peak memory, a checkpoint and the step
time, and predicts each from the analytic side (`estimate.check`), which also holds the rows
(`CheckRow`) and their targets. `run_check` launches the ranks and merges their rows.

Design notes: docs/concepts/runtime.md#runtime-measure.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from shardwise.arch import ModelSpec
from shardwise.estimate.check import (
    REPORTED,
    RUNTIME_IMPL,
    WITHIN_1PC,
    CheckRow,
    Counted,
    activation_note,
    checkpoint_rows,
    comm_rows,
    merge_rows,
    peak_row,
    predicted_comm,
    predicted_saved,
    state_rows,
)
from shardwise.layout import Layout, TrainSpec
from shardwise.runtime import collectives as C
from shardwise.runtime import launch, wire
from shardwise.runtime.calibrate import (
    REFERENCE_STEP,
    one_rank_state,
    step_outside_world,
    time_layout_calls,
)
from shardwise.runtime.data import Batches, load_tokens
from shardwise.runtime.mesh import AxisGroup, Mesh, current_mesh, set_current_mesh
from shardwise.runtime.parallel_transformer import ParallelTransformer
from shardwise.runtime.saved_tensors import (
    LayerCall,
    LayerRecorder,
    _storage,
    saved_bytes_per_layer,
    saved_tensor_bytes,
)
from shardwise.runtime.saving import measure_checkpoint
from shardwise.runtime.train import TrainConfig, build, train_step
from shardwise.units import dtype_bytes

__all__ = ["LayerCall", "LayerRecorder", "check_layout", "run_check", "saved_bytes_per_layer",
           "saved_tensor_bytes", "state_bytes"]


# ------------------------------------------------------------------- state on the rank
def state_bytes(modules: Sequence[nn.Module], optimizer: Any,
                updated: Sequence[torch.Tensor] = ()) -> dict[str, int]:
    """Bytes of persistent training state this rank holds: weights (every parameter of
    `modules` and every tensor the optimizer updates, `updated` — ZeRO's flat shards), their
    gradients (`.grad` and the fp32 `main_grad` of `mixed_precision.accumulate_in_fp32`), the fp32 master copies (mixed precision: `MasterOptimizer.masters`; else 0)
    and the optimizer's state tensors (AdamW's two moments; the scalar step excluded). Each
    storage counted once, whole (a ZeRO flat buffer with its padding)."""
    masters = list(getattr(optimizer, "masters", []))
    params = [p for m in modules for p in m.parameters()]
    params += list(updated) if masters else [p for group in optimizer.param_groups
                                             for p in group["params"]]
    moments = [v for st in optimizer.state.values() for v in st.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0]

    def total(tensors: Sequence[torch.Tensor | None]) -> int:
        sizes = dict(_storage(t) for t in tensors if t is not None)
        return sum(sizes.values())

    grads = [g for p in params for g in (p.grad, getattr(p, "main_grad", None))]
    return {"weights": total(params), "grads": total(grads),
            "master": total(masters), "optimizer": total(moments)}


def _activation_rows(model: ModelSpec, layout: Layout, train: TrainSpec,
                     recorder: LayerRecorder, aux_loss: bool = False) -> list[CheckRow]:
    """Per layer on the rank: the forward call with the largest error against the count
    (`aux_loss`: the MoE layers' load-balancing loss is part of the objective)."""
    rows = []
    for k in sorted({call.layer for call in recorder.calls}):
        calls = [call for call in recorder.calls if call.layer == k]
        predicted, predicted_moe, per_row = predicted_saved(model, layout, train,
                                                             model.is_moe_layer(k))
        if predicted_moe is None:  # full recompute: the whole layer is its input
            parts = [(f"layer {k}", [(predicted, c.saved + (c.moe or 0)) for c in calls])]
        else:  # the MoE count at the routing each call drew (balanced: extra_rows = 0);
            # a dropped assignment also leaves out its expert output row (h values)
            out_row = model.d_model * dtype_bytes(train.dtype)
            parts = [(f"layer {k} attention", [(predicted, c.saved) for c in calls]),
                     (f"layer {k} MoE", [(predicted_moe + c.extra_rows * per_row
                                          - c.dropped * out_row, c.moe or 0)
                                         for c in calls])]
        for what, pairs in parts:
            expected, worst = max(pairs, key=lambda p: abs(p[1] - p[0]) / max(p[0], 1.0))
            row = CheckRow("activations", what, expected, worst,
                           WITHIN_1PC if train.impl == RUNTIME_IMPL else REPORTED)
            why = activation_note(row, layout, train, model)
            if train.impl != RUNTIME_IMPL:
                why = [f"against the {train.impl} profile; the runtime saves the "
                       f"{RUNTIME_IMPL} profile", *why]
            if aux_loss and what.endswith("MoE") and row.error:
                why = [f"the load-balancing loss keeps Switch's f_i for its router-probability "
                       f"gradient: E·bytes = +{model.n_experts * dtype_bytes(train.dtype):,.0f} "
                       "B, not in SPEC §3's count", *why]
            if any(e != pairs[0][0] for e, _ in pairs):
                why = ["the count at the routing each call drew (under ep a rank's experts run "
                       "the rows routed to them: ± rows × expert input, gate, up and "
                       "down-projection input; a capacity drop also − its expert output)",
                       *why]
            rows.append(replace(row, note="; ".join(
                [f"per micro-batch, worst of {len(pairs)} forward calls", *why])))
    if recorder.shared:
        rows.append(CheckRow(
            "activations", "shared by layers", 0.0, max(recorder.shared), REPORTED,
            "per pass: storages several layers keep (full recompute: every checkpoint holds "
            "the same RoPE cos/sin tables, 2·(s/c)·d·bytes); not a per-layer tensor of SPEC §3"))
    return rows


# -------------------------------------------------------------------------- on the ranks
def _state_test(parallel: ParallelTransformer) -> Callable[[torch.Tensor], bool]:
    """Is a saved tensor state rather than an activation? Parameters, buffers, the flat shards
    the optimizer updates, and ZeRO-3's gathered weights of the unit running now."""
    tensors = [*parallel.model.parameters(), *parallel.model.buffers(), *parallel.parameters()]
    static = {_storage(t)[0] for t in tensors}
    units = parallel.zero.units if parallel.zero is not None else []

    def is_state(t: torch.Tensor) -> bool:
        pointer = _storage(t)[0]
        return pointer in static or any(
            u.gathered is not None and _storage(u.gathered)[0] == pointer for u in units)

    return is_state


CALL_ROW = "per call: "  # rows of collective costs re-timed on the layout's own groups
WAITED_ROW = "in collectives: "  # rows of the time the median step spent blocked, per axis
# `calibrate`'s one-rank step, timed beside a layout's steps (`check_layout(reference=True)`)
REFERENCE_ROW = "one-rank reference: tiny, s={}, micro-batch {} (s)".format(*REFERENCE_STEP)
IN_STEP_ROW = "one-rank reference, on every rank at once (s)"  # `calibrate`'s synced steps
# the routing the checked steps drew, as `TrainSpec.expert_load` and `experts_active` take it
EXPERT_LOAD_ROWS = {"expert_load": "routing: the busiest ep rank's expert rows ÷ balanced",
                    "experts_active": "routing: the share of its experts that ran rows"}
# steps timed after the checked ones (their median is the measured step: a step's collectives
# have a long-tailed cost on a shared host, so a median of few steps swings)
TIMED_STEPS = 8
CALLS_PER_BURST = 15  # calls of each collective timed after each of those steps


class _Reference:
    """`calibrate`'s one-rank step (`REFERENCE_STEP`), timed between a layout's timed steps
    twice: on one rank at a time, the ranks taking turns while the others wait at a barrier
    (`REFERENCE_ROW`), then on every rank at once, as `calibrate` times it for
    `synced_host_factor` (`IN_STEP_ROW`: the time outside the loss's and gradient norm's
    all-reduces over the world, where the ranks meet once a step): the host's
    speed at the moment of those steps, alone and with the layout's ranks all busy. A shared
    machine's speed drifts by tens of percent within seconds (the same one-rank step timed in
    processes seconds apart: 43–80 ms here), so a reference timed before or after the layout's
    steps — even right after, in another process — describes another machine; one step each,
    between them, sees the same one. And one core can be slower than the other for a while
    (one process moved between this VM's two cores step by step: medians of 84 and 53 ms side
    by side), hence the turns over the ranks. Every rank trains two one-rank models of its
    own: one talks to no other rank (`Mesh.alone(world=False)`), the other only through
    those two all-reduces (`Mesh.alone()`); each is current only while it runs."""

    def __init__(self, dtype_name: str) -> None:
        self.layout_mesh, self.turns = current_mesh(), 0
        self.mesh = Mesh.alone(world=False)  # current while its state is built or steps
        self.state = one_rank_state(dtype_name, *REFERENCE_STEP, self.mesh)
        train_step(self.state)  # the first step allocates: not timed
        self.in_step_mesh = Mesh.alone()
        self.in_step = one_rank_state(dtype_name, *REFERENCE_STEP, self.in_step_mesh)
        train_step(self.in_step)
        set_current_mesh(self.layout_mesh)
        self.mine: dict[int, float] = {}  # turn -> seconds, this rank's turns
        self.mine_in_step: list[float] = []  # seconds outside its all-reduces, every step

    def step(self) -> None:
        """Every rank calls this after each timed step; rank `turn mod world` times one step
        alone, then every rank one step at once."""
        C.barrier()  # every rank is done with the layout's step
        if self.turns % launch.world_size() == launch.rank():
            set_current_mesh(self.mesh)
            self.mine[self.turns] = train_step(self.state).seconds
        self.turns += 1
        C.barrier()  # the others wait, not run, while it is timed
        set_current_mesh(self.in_step_mesh)
        self.mine_in_step.append(step_outside_world(self.in_step))
        set_current_mesh(self.layout_mesh)

    def seconds(self) -> tuple[list[float], float]:
        """Every turn's time alone, whichever rank took it, and the ranks' mean of their
        median step on every rank at once (every rank calls this)."""
        # [turn 0, …, turn n-1, this rank's share of the mean at once]: one all-reduce
        times = torch.zeros(self.turns + 1, dtype=torch.float64, device=launch.device())
        for turn, seconds in self.mine.items():
            times[turn] = seconds
        times[-1] = statistics.median(self.mine_in_step) / launch.world_size()
        C.all_reduce(times, counter=C.CommCounter())
        return times[:-1].tolist(), float(times[-1])


def check_layout(config: TrainConfig, steps: int = 2, impl: str = RUNTIME_IMPL,
                 reference: bool = False) -> list[CheckRow]:
    """On every rank of `config.layout` (a process group up): `steps` training steps of
    `config` measured against the analytic model; this rank's rows, in bytes per optimizer
    step (comm), per micro-batch (activations), on the rank (state, peak). Activations are
    compared against profile `impl` (`estimate.profiles`): the runtime saves the `shardwise`
    profile (target 1 %); another profile's rows are reported only. `reference`: time the
    one-rank reference step between the timed steps too (`_Reference`, `REFERENCE_ROW`)."""
    device = launch.device()
    gpu = device.type == "cuda"
    if gpu:
        torch.cuda.reset_peak_memory_stats(device)
    state = build(config)
    parallel = state.model
    stage = parallel.axis("pp").rank
    recorder = LayerRecorder(parallel.model, _state_test(parallel), parallel.axis("ep").rank)
    unmeasured = wire.available()
    with (recorder, C.counting() as counter,
          contextlib.nullcontext() if unmeasured else wire.metering() as meter):
        for _ in range(steps):
            train_step(state)
    traffic = None if meter is None else meter.traffic(
        [parallel.axis(name) for name in (*parallel.mesh.axes, "world")])
    # Step time outside the hooks and counters (what training costs), after the checked steps,
    # with the time spent blocked in each axis's collectives (`collectives.clocking`).
    # Between them, the costs the step model is re-timed with (`runtime.step_time`): one burst
    # of each of the layout's collectives on its own groups and `calibrate`'s one-rank step,
    # so that they see the machine as the steps did.
    timed, bursts = [], []
    beside = _Reference(config.dtype) if reference else None
    dispatch = (recorder.dispatch_rows, config.model.d_model) if recorder.dispatch_rows else None
    for _ in range(max(steps, TIMED_STEPS)):
        with C.clocking() as waited:
            seconds = train_step(state).seconds
        timed.append((seconds, dict(waited)))
        bursts.append(time_layout_calls(parallel.axis, CALLS_PER_BURST, dispatch))
        if beside is not None:
            beside.step()
    timed.sort(key=lambda t: t[0])
    (median, waited), fastest = timed[len(timed) // 2], timed[0][0]
    calls = {key: statistics.fmean(b[key] for b in bursts) for key in bursts[0]}
    reference_s, in_step_s = beside.seconds() if beside is not None else ([], 0.0)
    load = _expert_load(recorder.expert_load, parallel.axis("ep")) if config.model.is_moe else {}
    held = state_bytes([parallel.model], state.optimizer, parallel.parameters())
    saved = measure_checkpoint(state)
    peak = float(torch.cuda.max_memory_allocated(device)) if gpu else None
    model, layout, train = config.model, config.layout, config.train_spec()
    terms = predicted_comm(model, layout, train, stage, recorder.routing, steps,
                           config.aux_loss_coef > 0, config.capacity_factor is not None)
    counted = Counted(dict(counter.payload), dict(counter.ncalls), dict(counter.sizes))
    rows = [*comm_rows(terms, counted, steps, layout, traffic, unmeasured or ""),
            *_activation_rows(model, layout, replace(train, impl=impl), recorder,
                              config.aux_loss_coef > 0),
            *state_rows(model, layout, train, stage, held),
            peak_row(model, layout, train, stage, peak)]
    if launch.rank() == 0:  # completed by `runtime.step_time.with_prediction`
        rows += checkpoint_rows(model, layout, train, saved)
        rows += [CheckRow("step time", "step (s)", None, median, REPORTED,
                          f"median of {len(timed)} steps after the checked ones, rank 0"),
                 CheckRow("step time", "fastest step (s)", None, fastest, REPORTED,
                          "the fastest of those steps (other jobs on the machine only add)"),
                 *(CheckRow("step time", f"{WAITED_ROW}{axis} (s)", None, value, REPORTED,
                            "rank 0's wall time blocked in this axis's collectives in the "
                            "median step (collectives.clocking)")
                   for axis, value in sorted(waited.items())),
                 *(CheckRow("step time", f"{CALL_ROW}{key} (s)", None, value, REPORTED,
                            f"one call, timed on this layout's groups between its steps "
                            f"({CALLS_PER_BURST} after each; the mean)" + (
                                f"; a micro-batch's dispatch, {dispatch[0]} rows of "
                                f"{dispatch[1]}" if dispatch and key.startswith("all-to-all")
                                else ""))
                   for key, value in calls.items())]
        if reference_s:
            rows.append(CheckRow("step time", REFERENCE_ROW, None, statistics.median(reference_s),
                                 REPORTED, "as `calibrate` times it, between this layout's "
                                 "timed steps, the ranks taking turns: the median of "
                                 f"{len(reference_s)}"))
            rows.append(CheckRow("step time", IN_STEP_ROW, None, in_step_s, REPORTED,
                                 "after each of those, on every rank at once, the ranks "
                                 "meeting in its loss's and gradient norm's all-reduces, as "
                                 "`calibrate` times it for synced_host_factor: the time "
                                 "outside those calls, each rank's median, the ranks' mean"))
        rows += [CheckRow("step time", EXPERT_LOAD_ROWS[name], 1.0, value, REPORTED,
                          "the checked steps' MoE calls: per call the largest over the ep "
                          "group (its ranks wait for each other at every call), the mean "
                          "over the calls, the largest over the ranks; predicted: balanced "
                          "routing (SPEC §5); the step-time predictions take the measured one")
                 for name, value in load.items()]
    if model.is_moe and layout.tp > 1:
        caveat = "; MoE layers are replicated over tp here (the analytic model splits experts)"
        rows = [replace(r, note=r.note + caveat) if not r.ok else r for r in rows]
    return [replace(r, rank=launch.rank(), stage=stage) for r in rows]


def _expert_load(calls: list[tuple[float, float]], ep: AxisGroup) -> dict[str, float]:
    """{"expert_load": λ, "experts_active": a} (`TrainSpec`) from this rank's MoE calls
    (`LayerRecorder.expert_load`): per call the largest over the ep group, the mean over the
    calls, the largest over the world's ranks (every rank calls this together)."""
    mine = torch.tensor(calls or [(0.0, 0.0)], dtype=torch.float64)  # (calls, 2)
    everyone = torch.empty(ep.size, *mine.shape, dtype=mine.dtype)  # an ep group's ranks
    C.all_gather(everyone, mine, ep, counter=C.CommCounter())  # make the same calls
    load = everyone.amax(dim=0).mean(dim=0)
    C.all_reduce(load, op="max", counter=C.CommCounter())
    return dict(zip(EXPERT_LOAD_ROWS, load.tolist(), strict=True))


def run_check(config: TrainConfig, steps: int = 2, *, timeout_s: float = 600,
              per_rank: bool = False, impl: str = RUNTIME_IMPL, reference: bool = False
              ) -> list[CheckRow]:
    """`check_layout` on `config.layout.world_size` ranks (spawned here with gloo, or the
    torchrun world: `torchrun … -m shardwise check …`); the rows merged over ranks
    (`merge_rows`: per pipeline stage, the rank with the largest error), or every rank's rows
    with `per_rank`. `reference`: with the one-rank step `shardwise calibrate` fits the
    host's per-op cost on, timed between the layout's steps (the `REFERENCE_ROW`)."""
    config.validate()
    Batches(load_tokens(config.data), config.seq_len, config.global_batch)  # enough text?
    results = launch.launch(check_layout, config.layout.world_size, config, steps, impl,
                            reference, timeout_s=timeout_s)
    return [row for rows in results for row in rows] if per_rank else merge_rows(results)
