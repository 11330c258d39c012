"""When nothing fits, `plan` says so in one line with what would help (`explain._no_fit_message`):
the GPUs the training state alone needs when the cluster has fewer (the state in B/param
written here from its parts: bf16 weights and gradients, fp32 master and Adam's two fp32
moments = 16 B/param, Rajbhandari et al. 2020; 8-bit moments: 10), and an 8-bit optimizer
only when the run uses Adam."""

from __future__ import annotations

import math

import pytest

from shardwise.arch import get_model
from shardwise.errors import ShardwiseError
from shardwise.hardware import Cluster
from shardwise.layout import TrainSpec
from shardwise.plan import SearchSpace, plan

MODEL = get_model("llama3-405b")
CLUSTER = Cluster.of(8, "h100")
SPACE = SearchSpace(tp=(8,), pp=(1,), cp=(1,), micro_batch=(1,), zero=(0,), sp=(True,),
                    recompute=("full",), schedules=("1f1b",))


def _message(optimizer: str, headroom: float) -> str:
    train = TrainSpec(seq_len=8192, global_batch=8, optimizer=optimizer)
    with pytest.raises(ShardwiseError) as info:
        plan(MODEL, CLUSTER, train, top=1, space=SPACE, baseline=False, headroom=headroom)
    return str(info.value)


@pytest.mark.parametrize("optimizer, per_param", [("adam", 16), ("adam-8bit", 10)])
@pytest.mark.parametrize("headroom", [0.85, 0.5])
def test_the_training_state_alone_needs_more_gpus(optimizer, per_param, headroom):
    params = MODEL.count_params().total
    assert params == pytest.approx(405e9, rel=0.01)  # Llama 3.1 405B (Meta's model card)
    budget = CLUSTER.accelerator.memory_bytes * headroom
    gpus = math.ceil(params * per_param / budget)
    assert gpus > CLUSTER.n_gpus
    message = _message(optimizer, headroom)
    assert "\n" not in message
    assert message.startswith(f"no layout of llama3-405b fits 8× {CLUSTER.accelerator.name} at "
                              "s=8192: the leanest (")
    assert (f"would help: at least {gpus} GPUs just for the training state "
            f"({params * per_param / 1e9:,.0f} GB with {per_param} B/param); a shorter "
            "sequence or a smaller global batch per replica") in message
    assert message.endswith("; an 8-bit optimizer") == (optimizer == "adam")
    assert f"GiB budget ({headroom:.0%} of {CLUSTER.accelerator.memory_bytes / 2**30:.0f} " \
           "GiB)" in message


def _invalid(space: SearchSpace, global_batch: int) -> str:
    tiny = get_model("tiny-deepseek")  # 4 heads
    train = TrainSpec(seq_len=64, global_batch=global_batch, impl="shardwise")
    with pytest.raises(ShardwiseError) as info:
        plan(tiny, CLUSTER, train, top=1, space=space, baseline=False)
    return str(info.value)


def test_no_valid_layout_names_the_largest_regions_with_their_examples():
    """No layout of the grid is valid: one line naming the (up to) three largest rejected
    regions — a structural one as `Layout.problems`' own sentence, another as its reason
    with its example in parentheses, one without example as its reason alone."""
    from shardwise.layout import Layout

    tiny = get_model("tiny-deepseek")
    one = dict(pp=(1,), cp=(1,), ep=(1,), etp=(0,), micro_batch=(1,), sp=(False,),
               recompute=("none",), schedules=("1f1b",))
    # tp 8 over 4 heads: the structure's first problem, word for word
    problem = Layout(dp=1, tp=8).problems(tiny)[0]
    assert _invalid(SearchSpace(tp=(8,), zero=(0,), **one), 1) == (
        "no valid layout of tiny-deepseek on 8 GPUs with a global batch of 1 sequence: "
        + problem)
    # dp 8 does not split 12 sequences into micro-batches of 1 (12 of 8·1)
    assert _invalid(SearchSpace(tp=(1,), zero=(0,), **one), 12) == (
        "no valid layout of tiny-deepseek on 8 GPUs with a global batch of 12 sequences: "
        "global batch is not a multiple of dp·micro-batch (dp=8 mb=1: 12 sequences)")
    # tp 8: 7 (tp, ZeRO) points of one structure; tp 2 and 4 (dp 4 and 2): 14 points whose
    # dp does not split 5 sequences — the larger region first, its first example (dp 4)
    text = _invalid(SearchSpace(tp=(2, 4, 8), zero=(0, 1, 2, 3), zero_groups=(2,), **one), 5)
    assert text == (
        "no valid layout of tiny-deepseek on 8 GPUs with a global batch of 5 sequences: "
        "global batch is not a multiple of dp·micro-batch (dp=4 mb=1: 5 sequences); "
        + problem)
