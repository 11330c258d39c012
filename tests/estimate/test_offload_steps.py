"""Host offload's formulas term by term (estimate/offload.py): the CPU optimizer's rate against
its source (DeepSpeed PR #735: 11.6e9 parameters in 8.2 s with DeepSpeedCPUAdam, 56 s with
torch.optim.Adam), the host CPU shared per superchip, what each offload kind leaves on the GPU,
and the three overlap rules of the exposed step written out by hand with every term distinct
(gradient copy ≠ weight copy ≠ CPU step, several reductions, a partly and a fully hidden
gradient copy)."""

import pytest

from shardwise.errors import ShardwiseError
from shardwise.estimate.offload import cpu_step_time, host_link, offload_state, offload_step
from shardwise.hardware import Accelerator, Link, accelerator_from_dict, get_accelerator
from shardwise.stacks import Offload

BILLION = 11.6e9  # the PR's 11.6B-parameter GPT-2


@pytest.mark.parametrize(("optimizer", "seconds"), [
    ("deepspeed-cpu-adam", 8.2), ("torch-adamw-fused", 8.2), ("torch-adamw", 56.0)])
def test_cpu_step_at_the_published_rate_and_shared_by_the_gpus_of_one_cpu(optimizer, seconds):
    # a GH200's Grace serves one GPU, a GB200's two, an x86 host all GPUs of the node
    assert cpu_step_time(BILLION, optimizer, 8, "c2c-gh200") == pytest.approx(seconds)
    assert cpu_step_time(BILLION, optimizer, 4, "c2c-gb200") == pytest.approx(2 * seconds)
    assert cpu_step_time(BILLION, optimizer, 8, "pcie5") == pytest.approx(8 * seconds)
    assert cpu_step_time(BILLION / 2, optimizer, 3, "pcie4") == pytest.approx(1.5 * seconds)


def test_unknown_cpu_optimizer_is_one_line_with_the_valid_names():
    with pytest.raises(ShardwiseError) as err:
        cpu_step_time(1e9, "sgd", 8, "pcie5")
    assert str(err.value) == ("CPU optimizer 'sgd' unknown; valid: deepspeed-cpu-adam, "
                              "torch-adamw-fused, torch-adamw")


def test_host_link_is_the_accelerators_own_where_it_defines_one():
    assert host_link(get_accelerator("h100")).name == "pcie5"
    assert host_link(get_accelerator("gh200")).name == "c2c-gh200"
    h100 = get_accelerator("h100")
    mine = accelerator_from_dict({
        "name": "my-gpu", "memory_bytes": h100.memory_bytes,
        "hbm_bandwidth": h100.hbm_bandwidth, "peak_bf16": h100.peak_bf16, "intra": "nvlink4",
        "inter": "ndr", "host": "my-host",
        "links": [{"name": "my-host", "bandwidth": 33e9, "latency": 7e-6}]}, "test")
    assert isinstance(mine, Accelerator)
    link = host_link(mine)
    assert isinstance(link, Link)
    assert (link.name, link.bandwidth, link.latency) == ("my-host", 33e9, 7e-6)


def test_offload_state_per_kind():
    # per rank: 2 B weights, 4 B gradients, 12 B optimizer state per parameter, P = 1000
    p = 1000.0
    w, g, o = 2 * p, 4 * p, 12 * p
    assert offload_state("none", 0.0, w, g, o, 12.0) == {
        "weights": w, "grads": g, "optimizer": o, "host": 0.0}
    # a quarter of the optimizer state moves; the host adds the fp32 gradient copy of the
    # parameters whose state moved (4 B each)
    assert offload_state("optimizer", 0.25, w, g, o, 12.0) == pytest.approx({
        "weights": w, "grads": g, "optimizer": 0.75 * o, "host": 0.25 * o + 4 * 0.25 * p})
    assert offload_state("params", 1.0, w, g, o, 12.0) == {
        "weights": 0.0, "grads": 0.0, "optimizer": 0.0, "host": w + g + o}
    # an optimizer without state (0 B per parameter): nothing to move, no division by zero
    for kind in ("none", "optimizer"):
        out = offload_state(kind, 1.0, w, g, 0.0, 0.0)
        assert (out["optimizer"], out["host"]) == (0.0, 0.0)


# --------------------------------------------------------------------- exposed step time
P, GRAD, WEIGHT = 1e9, 2.0, 4.0  # parameters of the rank; bytes per gradient / weight
LAT, BW = 1e-5, 2e9


def _copy(n):
    return LAT + n / BW


D2H, H2D = _copy(P * GRAD), _copy(P * WEIGHT)  # 1.00001 s, 2.00001 s


def _step(kind, cpu_optimizer, overlap, reductions=3, window=0.3, overlapped=True,
          gpus=8, host="pcie5"):
    offload = Offload(kind, (1, 2, 3), cpu_optimizer, overlap, "--flag")
    return offload_step(offload, P, GRAD, WEIGHT, reductions, window, overlapped, _copy, gpus,
                        host)


def test_backward_overlap_hides_each_gradient_copy_behind_the_backward_window():
    """DeepSpeed (ZeRO-2: one gradient copy per micro-batch, 3 here): each copy exposed past
    the backward window, then the CPU step and the weight copy back, in sequence."""
    cpu = P * 1 / (BILLION / 8.2)  # a GH200: one GPU per CPU
    exposed = _step("optimizer", "deepspeed-cpu-adam", "backward", host="c2c-gh200")
    assert exposed == pytest.approx(3 * (D2H - 0.3) + cpu + H2D)
    # a window longer than the copy hides it entirely
    hidden = _step("optimizer", "deepspeed-cpu-adam", "backward", window=5.0, host="c2c-gh200")
    assert hidden == pytest.approx(cpu + H2D)
    # DP traffic not overlapped: nothing hides
    plain = _step("optimizer", "deepspeed-cpu-adam", "backward", overlapped=False,
                  host="c2c-gh200")
    assert plain == pytest.approx(3 * D2H + cpu + H2D)


@pytest.mark.parametrize(("reductions", "gpus", "largest"), [
    (3, 1, "d2h"), (1, 1, "h2d"), (1, 8, "cpu")])
def test_pipelined_overlap_exposes_the_longest_of_the_three(reductions, gpus, largest):
    """Megatron's HybridDeviceOptimizer pipelines the copies and the CPU step over parameter
    groups: max(reductions·D2H, CPU, H2D); each term the largest in turn."""
    cpu = P * gpus / (BILLION / 8.2)  # fused AdamW: 0.707 s per GPU sharing the CPU
    terms = {"d2h": reductions * D2H, "cpu": cpu, "h2d": H2D}
    assert max(terms, key=lambda k: terms[k]) == largest
    exposed = _step("optimizer", "torch-adamw-fused", "pipelined", reductions=reductions, gpus=gpus)
    assert exposed == pytest.approx(terms[largest])


def test_no_overlap_is_the_sum_even_where_traffic_overlaps():
    cpu = P * 8 / (BILLION / 8.2)
    exposed = _step("optimizer", "torch-adamw-fused", "none", window=0.6)
    assert exposed == pytest.approx(3 * D2H + cpu + H2D)


def test_params_offload_costs_the_cpu_step_only():
    """Parameter offload prefetches each layer's parameters beside the compute (their copies
    are costed per layer elsewhere): the step adds the CPU optimizer step alone."""
    cpu = P * 2 / (BILLION / 8.2)  # a GB200: two GPUs per Grace
    for overlap in ("backward", "none"):
        assert _step("params", "torch-adamw-fused", overlap, host="c2c-gb200") == (
            pytest.approx(cpu))
