"""DeepSpeed's pipeline engine's extra seconds (estimate/pipe_engine.py) written out by hand
from deepspeed 0.19.8's runtime/pipe as docs/concepts/stacks.md derives them: serial blocking
transfers (`4m + 2p - 8` on the critical path for p > 2 and m > 1, `2m` on two stages,
`2(p-1)` for one micro-batch) beyond the batched `2(m + p - 1)`, a meta send per transfer
with TP (`_exec_send_activations`: 2 sends), 3 TP all-gathers of the boundary tensor per slot
on a middle stage (2 on the first, 1 on the last: `PartitionedTensor.full()`), the tied
embedding's gradient all-reduce over its 2 stages, BF16_Optimizer's all-reduce where ZeRO-1
reduce-scatters fp32 gradients and its weight all-gather at ZeRO-0, and GPT-NeoX's (1, 1, s, s)
attention mask sent with each activation. The links differ inside and across nodes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from shardwise.estimate.links import Links
from shardwise.estimate.pipe_engine import pipe_engine_time
from shardwise.layout import TrainSpec
from shardwise.schedules.registry import SCHEDULE_CODES
from shardwise.stacks import STACKS
from tests.estimate.closed_forms import A_IN, A_OUT, B_IN, B_OUT, coll

LINKS = Links(B_IN, A_IN, B_OUT, A_OUT, 8)
S, H, V, AB = 2048, 1024, 32000, 2.0
P2P = 7e-4
PARAMS = 2.5e8




def _ctx(tied=True):
    model = SimpleNamespace(d_model=H, vocab=V, tie_embeddings=tied)
    return SimpleNamespace(model=model, seq_len=S, act_bytes=AB)


def _run(stack="megatron-deepspeed", *, t=2, p=4, c=2, b=2, m=6, zero=1, sched="1f1b",
         pp_intra=False, tp_in_node=2, replicas=4, dp_in_node=2, tied=True, **train):
    spec = TrainSpec(impl=stack, seq_len=S, **train)
    pp, dp = pipe_engine_time(STACKS[stack], _ctx(tied), LINKS, spec, t=t, p=p, c=c, b=b, m=m,
                              zero=zero, schedule=SCHEDULE_CODES[sched], p2p=P2P,
                              pp_intra=pp_intra, tp_in_node=tp_in_node, params=PARAMS,
                              replicas=replicas, dp_in_node=dp_in_node)
    return float(pp), float(dp)


@pytest.mark.parametrize("p, m, transfers, gathers", [(4, 6, 4 * 6 + 2 * 4 - 8, 3),
                                                      (2, 5, 2 * 5, 2), (4, 1, 2 * 3, 3),
                                                      (3, 4, 4 * 4 + 2 * 3 - 8, 3)])
@pytest.mark.parametrize("pp_intra", [False, True])
def test_deepspeed_pipeline_terms_by_hand(p, m, transfers, gathers, pp_intra):
    """tp 2, c 2, b 2, fp32 gradients (BF16_Optimizer at ZeRO-1), tied embeddings."""
    t, c, b = 2, 2, 2
    lat = A_IN if pp_intra else A_OUT
    slots = m + p - 1
    boundary = S / c * b * H * AB
    gather = coll("all-gather", boundary, t, 2)
    tied = coll("all-reduce", V * H / t * 4, 2, 2 if pp_intra else 1)
    want_pp = ((transfers - 2 * slots) * P2P + (2 - 1) * transfers * lat
               + slots * gathers * gather + tied)
    grads = PARAMS * 4
    want_dp = coll("all-reduce", grads, 4, 2) - coll("reduce-scatter", grads, 4, 2)
    got = _run(p=p, m=m, pp_intra=pp_intra, grad_dtype="fp32")
    assert got == pytest.approx((want_pp, want_dp), rel=1e-12)


def test_zero_stages_and_gradient_dtypes_by_hand():
    """ZeRO-0 with bf16 gradients: BF16_Optimizer all-gathers the updated bf16 weights over
    the dp·cp replicas; ZeRO-1 with bf16 gradients reduce-scatters as ZeRO-1 does (nothing
    extra); ZeRO-2: nothing extra; one replica: nothing."""
    weights = PARAMS * 2
    assert _run(zero=0)[1] == pytest.approx(coll("all-gather", weights, 4, 2), rel=1e-12)
    assert _run(zero=0, replicas=8, dp_in_node=4)[1] == pytest.approx(
        coll("all-gather", weights, 8, 4), rel=1e-12)
    assert _run(zero=1)[1] == 0.0
    # two replicas, one a node: the smallest group that reduces
    grads = PARAMS * 4
    assert _run(zero=1, grad_dtype="fp32", replicas=2, dp_in_node=1)[1] == pytest.approx(
        coll("all-reduce", grads, 2, 1) - coll("reduce-scatter", grads, 2, 1), rel=1e-12)
    assert _run(zero=2, grad_dtype="fp32")[1] == 0.0
    assert _run(zero=1, grad_dtype="fp32", replicas=1, dp_in_node=1)[1] == 0.0
    # the pipeline part does not depend on ZeRO
    assert _run(zero=0)[0] == pytest.approx(_run(zero=2)[0], rel=1e-12)


def test_without_tensor_parallelism_or_tied_weights():
    """tp 1: no meta sends, no gathers; untied embeddings: no tied all-reduce."""
    p, m = 4, 6
    transfers, slots = 4 * m + 2 * p - 8, m + p - 1
    tied = coll("all-reduce", V * H * 2, 2, 1)  # bf16 gradients, tp 1
    assert _run(t=1, tp_in_node=1)[0] == pytest.approx((transfers - 2 * slots) * P2P + tied,
                                                       rel=1e-12)
    assert _run(t=1, tp_in_node=1, tied=False)[0] == pytest.approx(
        (transfers - 2 * slots) * P2P, rel=1e-12)


def test_neox_sends_the_attention_mask_with_each_activation():
    """GPT-NeoX: half the transfers carry the (1, 1, s, s) mask as fp16 beside the activation,
    one more send of `2·s²` bytes at the p2p link's β (from `p2p` and the t-sharded boundary
    tensor's bytes)."""
    t, c, b, p, m = 2, 2, 2, 4, 6
    transfers, slots = 4 * m + 2 * p - 8, m + p - 1
    boundary = S / c * b * H * AB
    per_byte = (P2P - A_OUT) / (boundary / t)
    mask = transfers / 2 * (A_OUT + 2.0 * S ** 2 * per_byte)
    base = ((transfers - 2 * slots) * P2P + transfers * A_OUT
            + slots * 3 * coll("all-gather", boundary, t, 2) + coll("all-reduce", V * H, 2, 1))
    got = _run("gpt-neox", t=t, c=c, b=b, p=p, m=m, zero=0)
    assert got[0] == pytest.approx(base + mask, rel=1e-12)


def test_only_deepspeeds_1f1b_with_a_pipeline_pays():
    assert _run(p=1) == (0.0, 0.0)
    assert _run(sched="gpipe") == (0.0, 0.0)
    assert _run("megatron-te") == (0.0, 0.0)
    assert _run(offload="optimizer", zero=0)[1] == 0.0
