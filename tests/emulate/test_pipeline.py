"""In-process pipeline: micro-batch gradient accumulation against the full-batch gradient."""

import pytest
import torch

from shardwise.emulate.pipeline import gradient_match, mlp_params
from shardwise.errors import ShardwiseError

TOL = 1e-12


def full_batch_reference(num_layers, width, batch, seed):
    """Loss and gradients of the whole MLP on the whole batch, written out here: the same
    parameters and data as `gradient_match` uses (parameters from `seed`, data from seed+1)."""
    params = mlp_params(num_layers, width, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, width, generator=gen, dtype=torch.float64)
    y = torch.randn(batch, width, generator=gen, dtype=torch.float64)
    h = x
    for weight, bias in params:
        h = torch.tanh(h @ weight.T + bias)
    loss = ((h - y) ** 2).sum() / (batch * width)
    flat = [t for pair in params for t in pair]
    return float(loss.detach()), torch.autograd.grad(loss, flat)


CASES = [  # (num_layers, width, batch, num_stages, num_microbatches)
    (4, 8, 8, 2, 4),
    (7, 5, 12, 3, 3),  # uneven stages: [3, 2, 2] layers
    (8, 16, 16, 4, 8),
    (5, 6, 6, 4, 1),  # one micro-batch: no accumulation at all
    (6, 4, 12, 2, 12),  # micro-batches of one row
]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("case", CASES)
def test_accumulated_gradient_equals_full_batch(schedule, case):
    num_layers, width, batch, stages, m = case
    result = gradient_match(num_layers, width, batch, stages, m, schedule=schedule, seed=3)
    loss, grads = full_batch_reference(num_layers, width, batch, seed=3)
    assert result.loss_accumulated == pytest.approx(loss, rel=TOL, abs=TOL)
    assert len(result.grads_accumulated) == 2 * num_layers
    for got, want in zip(result.grads_accumulated, grads):
        assert float((got - want).abs().max()) <= TOL * max(1.0, float(want.abs().max()))
    assert result.matches
    assert sorted(k for stage in result.stages for k in stage) == list(range(num_layers))
    assert len(result.stages) == stages


def test_uneven_partition_is_contiguous_and_balanced():
    result = gradient_match(7, 4, 6, 3, 3)
    assert result.stages == [[0, 1, 2], [3, 4], [5, 6]]


def test_unequal_micro_batches_are_rejected():
    with pytest.raises(ShardwiseError, match="equal micro-batches"):
        gradient_match(4, 4, 10, 2, 4)


def test_more_stages_than_layers_is_rejected():
    with pytest.raises(ShardwiseError, match="at least one layer per stage"):
        gradient_match(2, 4, 4, 3, 2)


def test_a_missing_loss_scale_would_be_caught():
    """The oracle is not vacuous: the sum of micro-batch gradients without the 1/m seed is m
    times the full-batch gradient, which `gradient_match`'s comparison would flag."""
    result = gradient_match(3, 4, 8, 2, 4)
    _, grads = full_batch_reference(3, 4, 8, seed=0)
    scaled = [4 * g for g in result.grads_accumulated]
    assert max(float((a - b).abs().max()) for a, b in zip(scaled, grads)) > 1e-3
