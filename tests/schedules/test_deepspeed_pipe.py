"""DeepSpeed's PipelineEngine against its own code (deepspeed 0.19.8 runtime/pipe): the
instruction streams TrainSchedule generates, replayed with blocking sends, against the schedule
registry's 1F1B and `stacks.pipe_engine`'s transfer count, gathers and buffers."""

import inspect

import pytest

from shardwise.schedules import get_schedule, make_schedule
from shardwise.stacks.pipe_engine import DEEPSPEED_PIPE, PIPE_ENGINES

schedule = pytest.importorskip("deepspeed.runtime.pipe.schedule")

CASES = [(p, m) for p in (2, 3, 4, 5, 7) for m in (1, 2, 3, 5, 8, 11)]
_PEER = {"SendActivation": (1, "RecvActivation"), "RecvActivation": (-1, "SendActivation"),
         "SendGrad": (-1, "RecvGrad"), "RecvGrad": (1, "SendGrad")}


def streams(p, m):
    """Each stage's commands from DeepSpeed's TrainSchedule as (name, micro-batch) — the
    micro-batch its step slot maps to (`_step_to_micro_batch`, DeepSpeed's own)."""
    out = []
    for stage in range(p):
        train = schedule.TrainSchedule(micro_batches=m, stages=p, stage_id=stage)
        out.append([(type(cmd).__name__, train._step_to_micro_batch(k)[0])
                    for k, step in enumerate(train.steps()) for cmd in step])
    return out


def replay(p, m, t_f, t_b, x):
    """Makespan of DeepSpeed's streams executed in order, compute taking `t_f` / `t_b` and
    each send meeting its receive (both blocking, `p2p.send` → `dist.send`) for `x`."""
    cmds, pos, clock = streams(p, m), [0] * p, [0.0] * p
    while any(pos[s] < len(cmds[s]) for s in range(p)):
        moved = False
        for s in range(p):
            while pos[s] < len(cmds[s]):
                name, _ = cmds[s][pos[s]]
                if name in _PEER:
                    step, want = _PEER[name]
                    peer = s + step
                    if pos[peer] >= len(cmds[peer]) or cmds[peer][pos[peer]][0] != want:
                        break
                    clock[s] = clock[peer] = max(clock[s], clock[peer]) + x
                    pos[peer] += 1
                else:
                    clock[s] += {"ForwardPass": t_f, "BackwardPass": t_b}.get(name, 0.0)
                pos[s] += 1
                moved = True
        assert moved, "the streams deadlock"
    return max(clock)


@pytest.mark.parametrize(("p", "m"), CASES)
def test_train_schedule_runs_the_registry_1f1b_order_on_every_stage(p, m):
    ours = make_schedule(DEEPSPEED_PIPE.schedule, p, m)
    for stage, cmds in enumerate(streams(p, m)):
        theirs = [("F" if name == "ForwardPass" else "B", mb) for name, mb in cmds
                  if name in ("ForwardPass", "BackwardPass")]
        assert theirs == [(a.kind, a.micro_batch) for a in ours[stage]]


@pytest.mark.parametrize(("p", "m"), CASES)
def test_peak_in_flight_and_pipe_buffers_are_deepspeeds(p, m):
    info = get_schedule(DEEPSPEED_PIPE.schedule)
    for stage, cmds in enumerate(streams(p, m)):
        held = peak = 0
        for name, _ in cmds:
            held += {"ForwardPass": 1, "BackwardPass": -1}.get(name, 0)
            peak = max(peak, held)
        assert peak == info.in_flight(p, m, 1, stage)
        train = schedule.TrainSchedule(micro_batches=m, stages=p, stage_id=stage)
        assert DEEPSPEED_PIPE.buffers(p, m, stage) == train.num_pipe_buffers()
    # the last stage keeps two buffers for one micro-batch in flight (m ≥ 2)
    assert DEEPSPEED_PIPE.buffers(p, m, p - 1) == min(2, m) + (m == 1)


@pytest.mark.parametrize(("p", "m"), CASES)
@pytest.mark.parametrize(("t_f", "t_b"), [(1.0, 2.0), (1.0, 1.0), (2.0, 3.0)])
def test_blocking_sends_cost_the_closed_form_transfers(p, m, t_f, t_b):
    """Replayed: compute makes 1F1B's `(m+p-1)(t_f+t_b)` and each transfer on the critical
    path adds `x`; their count is `PipeEngine.transfers`, more than the batched
    `2(m+p-1)` once a middle stage has two neighbours and m ≥ 4."""
    base = replay(p, m, t_f, t_b, 0.0)
    assert base == pytest.approx(m * (t_f + t_b) + get_schedule("1f1b").bubble(
        p, 1, m, t_f, t_b, 0.0))
    x = 1e-3
    count = (replay(p, m, t_f, t_b, x) - base) / x
    assert count == pytest.approx(float(DEEPSPEED_PIPE.transfers(p, m)), abs=1e-6)
    batched = 2 * (m + p - 1)
    if p >= 3 and m >= 4:
        assert count > batched


def test_each_slot_sends_and_receives_apart_on_one_link():
    """Every step slot's transfers go to one neighbour, as separate blocking commands (a
    forward slot: SendGrad then RecvActivation to the previous stage; a backward slot:
    RecvGrad then SendActivation to the next), and `p2p.send` refuses async sends."""
    from deepspeed.runtime.pipe import p2p

    for stage in range(4):
        train = schedule.TrainSchedule(micro_batches=6, stages=4, stage_id=stage)
        for step in train.steps():
            names = [type(c).__name__ for c in step if type(c).__name__ in _PEER]
            assert len({_PEER[n][0] for n in names}) <= 1 and len(names) <= 2
    assert "assert async_op == False" in inspect.getsource(p2p.send)
    assert "dist.send(tensor, dest_rank)" in inspect.getsource(p2p.send)


def test_partitioned_tensors_gather_as_counted():
    """With TP the engine sends 1/t of the boundary tensor plus its meta and gathers it back
    with `PartitionedTensor.full()`: once in the forward (not on the first stage), twice in
    the backward (output and gradient; not on the last stage, which returns early)."""
    from deepspeed.runtime.pipe.engine import PipelineEngine

    forward = inspect.getsource(PipelineEngine._exec_forward_pass)
    backward = inspect.getsource(PipelineEngine._exec_backward_pass)
    assert forward.count(".full()") == 1 and "not self.is_first_stage()" in forward
    assert backward.count(".full()") == 2
    assert backward.index("if self.is_last_stage():") < backward.index(".full()")
    first, middle, last = DEEPSPEED_PIPE.gathers
    assert (first, middle, last) == (backward.count(".full()"), forward.count(".full()")
                                     + backward.count(".full()"), forward.count(".full()"))
    sends = inspect.getsource(PipelineEngine._exec_send_grads)
    assert "p2p.send(inputs[0]" in sends and "p2p.send(inputs[1]" in sends
    assert DEEPSPEED_PIPE.sends_per_transfer_tp == 2


def test_engine_reduces_after_the_last_backward():
    """The engine turns DeepSpeed's backward all-reduce off and reduces tied and data-
    parallel gradients in the last slot (the stacks' DP-overlap rule, `tied_grad_reduce`)."""
    from deepspeed.runtime.pipe.engine import PipelineEngine

    assert "self.enable_backward_allreduce = False" in inspect.getsource(PipelineEngine.__init__)
    train = schedule.TrainSchedule(micro_batches=3, stages=2, stage_id=0)
    steps = list(train.steps())
    tail = [type(c).__name__ for c in steps[-1]]
    assert tail[-3:] == ["ReduceTiedGrads", "ReduceGrads", "OptimizerStep"]
    assert all("Reduce" not in type(c).__name__ for step in steps[:-1] for c in step)
    assert all(engine.tied_grad_reduce for engine in PIPE_ENGINES.values())
