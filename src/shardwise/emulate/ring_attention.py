"""Ring attention in one process: a list of shards plays the context-parallel ranks (SPEC §8).

Ring attention (Liu, Zaharia & Abbeel 2023) splits the sequence over `c` devices. Device `p`
keeps its query block `Q_p`; the key/value blocks travel around the ring, so after `c` steps
every query block has met every key/value block:

    step t = 0..c-1:  device p holds (K, V) of device (p - t) mod c,
                      absorbs it into its running softmax, then passes it to p + 1.

The per-block results merge exactly with the online softmax (Milakov & Gimelshein 2018): each
query row keeps a running max `m`, denominator `ℓ` and unnormalised output `o`; a new block of
scores `S` (with values `V`) is absorbed as

    m' = max(m, rowmax S)
    ℓ' = ℓ·exp(m - m') + Σ_j exp(S_j - m')
    o' = o·exp(m - m') + Σ_j exp(S_j - m')·V_j

and at the end `O = o / ℓ`, `lse = m + log ℓ`. Equivalently (ring-flash-attention's form, what a
flash kernel returns) each block yields a normalised `(O_b, lse_b)` and two partial results
merge as

    lse' = log(exp(lse) + exp(lse_b))          (computed stably around the larger one)
    O'   = exp(lse - lse')·O + exp(lse_b - lse')·O_b.

Backward (FlashAttention-2, Dao 2023) recomputes each block's probabilities from the saved
`lse`, `P = exp(S - lse)`, with `D = rowsum(dO ∘ O)`:

    dV = Pᵀ dO,   dS = P ∘ (dO Vᵀ - D),   dQ = scale · dS K,   dK = scale · dSᵀ Q.

`dQ` accumulates on the query's device; `dK, dV` accumulate in a buffer that travels around the
ring and arrives at the block's owner after `c - 1` hops (see `_ring_backward`).

Causal masking uses global token positions, so the same code serves three sequence layouts:

* ``contiguous``: device p holds positions [p·n, (p+1)·n): blocks from later devices are
  entirely in the future and are skipped, but device c-1 does ~2c-1 times device 0's work;
* ``striped`` (Brandon et al. 2023, Striped Attention): device p holds p, p+c, p+2c, …;
* ``zigzag``: the sequence is cut into 2c chunks and device p holds chunks p and 2c-1-p.

Striped and zigzag balance the causal work (SPEC §8: with 8 devices × 16 tokens contiguous
blocks give per-device pair counts [136, 392, …, 1928], 14.18× max/min; striped 976…1088, 1.11×).

Tensors are laid out as flash-attn does: ``q`` is (b, s, h_q, d), ``k`` and ``v`` are
(b, s, h_kv, d) with ``h_kv`` dividing ``h_q`` (grouped-query attention: query head ``i`` reads
key/value head ``i // (h_q / h_kv)``); ``lse`` is (b, h_q, s).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from shardwise.errors import ShardwiseError

LAYOUTS = ("contiguous", "striped", "zigzag")


# ---------------------------------------------------------------------------------- layouts
def _check_layout(seq_len: int, num_devices: int, layout: str) -> None:
    if layout not in LAYOUTS:
        raise ShardwiseError(f"unknown sequence layout {layout!r}; valid: {', '.join(LAYOUTS)}")
    if num_devices < 1:
        raise ShardwiseError(f"context parallelism needs ≥ 1 device, got {num_devices}")
    chunks = 2 * num_devices if layout == "zigzag" else num_devices
    if seq_len % chunks:
        raise ShardwiseError(
            f"the {layout} layout cuts the sequence into {chunks} equal chunks; "
            f"seq_len={seq_len} is not divisible by {chunks}"
        )


def layout_positions(seq_len: int, num_devices: int, layout: str = "contiguous") -> torch.Tensor:
    """Global token positions each device holds, in its local order: (c, s/c) int64.

    contiguous: row p = [p·n, …, p·n + n-1];  striped: row p = [p, p+c, p+2c, …];
    zigzag: row p = chunk p followed by chunk 2c-1-p (chunks of s/(2c) tokens).
    """
    _check_layout(seq_len, num_devices, layout)
    c, n = num_devices, seq_len // num_devices
    if layout == "contiguous":
        return torch.arange(seq_len).reshape(c, n)
    if layout == "striped":
        return torch.arange(seq_len).reshape(n, c).t().contiguous()  # (n, c) -> (c, n)
    chunks = torch.arange(seq_len).reshape(2 * c, n // 2)  # (2c, s/2c)
    return torch.cat([chunks[:c], chunks.flip(0)[:c]], dim=1)  # row p: chunk p, chunk 2c-1-p


def layout_permutation(seq_len: int, num_devices: int, layout: str = "contiguous") -> torch.Tensor:
    """`perm` (s,) with `x[:, perm]` = the devices' blocks concatenated (device 0 first)."""
    return layout_positions(seq_len, num_devices, layout).reshape(-1)


def to_layout(x: torch.Tensor, num_devices: int, layout: str = "contiguous",
              dim: int = 1) -> torch.Tensor:
    """Permute the sequence dimension of `x` into device order (device p's block is slice p)."""
    perm = layout_permutation(x.shape[dim], num_devices, layout).to(x.device)
    return x.index_select(dim, perm)


def from_layout(x: torch.Tensor, num_devices: int, layout: str = "contiguous",
                dim: int = 1) -> torch.Tensor:
    """Inverse of `to_layout`: device order back to natural token order."""
    perm = layout_permutation(x.shape[dim], num_devices, layout).to(x.device)
    return x.index_select(dim, torch.argsort(perm))


def shard_sequence(x: torch.Tensor, num_devices: int, layout: str = "contiguous",
                   dim: int = 1) -> list[torch.Tensor]:
    """The `num_devices` sequence shards of `x` (natural order in, one block per device out)."""
    return list(to_layout(x, num_devices, layout, dim).chunk(num_devices, dim=dim))


def unshard_sequence(blocks: list[torch.Tensor], layout: str = "contiguous",
                     dim: int = 1) -> torch.Tensor:
    """Inverse of `shard_sequence`."""
    return from_layout(torch.cat(blocks, dim=dim), len(blocks), layout, dim)


# ------------------------------------------------------------------------- causal work
def causal_block_work(num_devices: int, block_size: int, layout: str = "contiguous") -> list[int]:
    """Causal (query, key) pairs each device computes: `#{(i, j): i on p, j ≤ i}` per device p.

    The sequence has `num_devices · block_size` tokens. SPEC §8: 8 devices × 16 tokens give
    contiguous [136, 392, 648, 904, 1160, 1416, 1672, 1928] (max/min 14.18×) and striped
    [976, 992, …, 1088] (1.11×); every layout sums to s(s+1)/2.
    """
    if block_size < 1:
        raise ShardwiseError(f"block_size must be ≥ 1, got {block_size}")
    positions = layout_positions(num_devices * block_size, num_devices, layout)  # (c, n)
    # A query at position i sees the i + 1 keys 0..i.
    return [int(row.sum()) + block_size for row in positions]


@dataclass(frozen=True)
class BlockPlan:
    """What one (query block, key/value block) pair computes under the causal mask.

    `rows`/`cols` select the query rows and key columns that have any allowed pair (None: all);
    `mask` (len(rows), len(cols)) bool, True = attend, None when every selected pair is allowed.
    `pairs` counts allowed (query, key) pairs, `computed` the pairs the kernel actually scores.
    """

    rows: torch.Tensor | None
    cols: torch.Tensor | None
    mask: torch.Tensor | None
    pairs: int
    computed: int


def plan_block(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool) -> BlockPlan | None:
    """Plan one block pair from global positions; None when it is entirely in the future.

    Trimming rows and columns with no allowed pair turns zigzag's off-diagonal blocks into half
    blocks without a mask (ring-flash-attention's zigzag trick) and keeps a dense diagonal.
    """
    n, m = q_pos.numel(), k_pos.numel()
    if not causal:
        return BlockPlan(None, None, None, n * m, n * m)
    allowed = k_pos[None, :] <= q_pos[:, None]  # (n, m)
    pairs = int(allowed.sum())
    if pairs == 0:
        return None
    row_any, col_any = allowed.any(dim=1), allowed.any(dim=0)
    rows = None if bool(row_any.all()) else row_any.nonzero().flatten()
    cols = None if bool(col_any.all()) else col_any.nonzero().flatten()
    if rows is not None:
        allowed = allowed[rows]
    if cols is not None:
        allowed = allowed[:, cols]
    computed = allowed.numel()
    return BlockPlan(rows, cols, None if bool(allowed.all()) else allowed, pairs, computed)


# ------------------------------------------------------------------------- block kernels
def _group(q: torch.Tensor, h_kv: int) -> torch.Tensor:
    """(b, n, h_q, d) -> (b, n, h_kv, g, d): query head h = kv·g + i reads kv head `kv`."""
    b, n, h_q, d = q.shape
    if h_q % h_kv:
        raise ShardwiseError(f"n_kv_heads={h_kv} does not divide n_heads={h_q}")
    return q.reshape(b, n, h_kv, h_q // h_kv, d)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float,
            mask: torch.Tensor | None) -> torch.Tensor:
    """S = scale · Q Kᵀ per head, masked entries -inf: (b, h_kv, g, n, m)."""
    s = torch.einsum("bnkgd,bmkd->bkgnm", _group(q, k.shape[2]), k) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return s


def _rows(t: torch.Tensor, h_kv: int) -> torch.Tensor:
    """Per-row statistic (b, h_q, n) -> (b, h_kv, g, n, 1) to broadcast against scores."""
    b, h_q, n = t.shape
    return t.reshape(b, h_kv, h_q // h_kv, n, 1)


def _flat_rows(t: torch.Tensor) -> torch.Tensor:
    """(b, h_kv, g, n) -> (b, h_q, n)."""
    b, h_kv, g, n = t.shape
    return t.reshape(b, h_kv * g, n)


def _per_query(t: torch.Tensor) -> torch.Tensor:
    """Row statistic (b, h_q, n) -> (b, n, h_q, 1), to scale an output (b, n, h_q, d)."""
    return t.transpose(1, 2).unsqueeze(-1)


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one query block over one key/value block: normalised `O_b` and `lse_b`.

    q (b, n, h_q, d), k/v (b, m, h_kv, d), mask (n, m) bool or None -> O_b (b, n, h_q, d),
    lse_b (b, h_q, n). Rows with no allowed key give O_b = 0 and lse_b = -inf.
    """
    s = _scores(q, k, scale, mask)  # (b, h_kv, g, n, m)
    row_max = s.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    p = torch.exp(s - row_max)
    denom = p.sum(dim=-1, keepdim=True)  # (b, h_kv, g, n, 1)
    out = torch.einsum("bkgnm,bmkd->bnkgd", p / torch.where(denom > 0, denom, 1.0), v)
    lse = (row_max + torch.log(denom)).squeeze(-1)  # log 0 = -inf for empty rows
    return out.flatten(2, 3), _flat_rows(lse)  # (b, n, h_kv, g, d) -> (b, n, h_q, d)


def merge_attention(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
                    block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two normalised partial results with the stable log-sum-exp update.

    lse' = max + log(exp(lse - max) + exp(lse_b - max)),  O' = exp(lse - lse')·O +
    exp(lse_b - lse')·O_b, with max = max(lse, lse_b). -inf entries (nothing seen yet) are safe.
    """
    top = torch.maximum(lse, block_lse)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    new_lse = top + torch.log(torch.exp(lse - top) + torch.exp(block_lse - top))
    safe = torch.where(torch.isfinite(new_lse), new_lse, torch.zeros_like(new_lse))
    new_out = (_per_query(torch.exp(lse - safe)) * out
               + _per_query(torch.exp(block_lse - safe)) * block_out)
    return new_out, new_lse


def block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   lse: torch.Tensor, delta: torch.Tensor, scale: float,
                   mask: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block pair from the saved global `lse` and `D = rowsum(dO ∘ O)`.

    dout, q (b, n, h_q, d); k, v (b, m, h_kv, d); lse, delta (b, h_q, n) ->
    dq (b, n, h_q, d), dk, dv (b, m, h_kv, d) (GQA: summed over the query heads of a group).
    """
    h_kv = k.shape[2]
    p = torch.exp(_scores(q, k, scale, mask) - _rows(lse, h_kv))  # (b, h_kv, g, n, m)
    dout_g = _group(dout, h_kv)  # (b, n, h_kv, g, d)
    dv = torch.einsum("bkgnm,bnkgd->bmkd", p, dout_g)
    dp = torch.einsum("bnkgd,bmkd->bkgnm", dout_g, v)
    ds = p * (dp - _rows(delta, h_kv))
    dq = torch.einsum("bkgnm,bmkd->bnkgd", ds, k).flatten(2, 3) * scale
    dk = torch.einsum("bkgnm,bnkgd->bmkd", ds, _group(q, h_kv)) * scale
    return dq, dk, dv


# ------------------------------------------------------------------- online softmax step
@dataclass
class SoftmaxState:
    """Running online-softmax statistics of a query block: max `m` and denominator `l`
    (b, h_q, n), unnormalised output `o` (b, n, h_q, d)."""

    m: torch.Tensor
    l: torch.Tensor  # the paper's ℓ
    o: torch.Tensor

    @classmethod
    def empty(cls, q: torch.Tensor, head_dim_v: int | None = None) -> SoftmaxState:
        b, n, h_q, d = q.shape
        m = torch.full((b, h_q, n), float("-inf"), dtype=q.dtype, device=q.device)
        o = q.new_zeros(b, n, h_q, head_dim_v or d)
        return cls(m, torch.zeros_like(m), o)

    def finish(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`O = o / ℓ` (b, n, h_q, d) and `lse = m + log ℓ` (b, h_q, n)."""
        return self.o / _per_query(self.l), self.m + torch.log(self.l)


def absorb_block(state: SoftmaxState, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scale: float, mask: torch.Tensor | None = None) -> SoftmaxState:
    """One online-softmax step (Milakov & Gimelshein 2018) over a key/value block:

        m' = max(m, rowmax S),  ℓ' = ℓ·e^(m-m') + Σ e^(S-m'),  o' = o·e^(m-m') + Σ e^(S-m')·V.
    """
    h_kv = k.shape[2]
    s = _scores(q, k, scale, mask)  # (b, h_kv, g, n, m)
    m_new = torch.maximum(state.m, _flat_rows(s.amax(dim=-1)))  # (b, h_q, n)
    m_safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
    alpha = torch.exp(state.m - m_safe)  # 0 where nothing was seen yet
    p = torch.exp(s - _rows(m_safe, h_kv))
    l_new = state.l * alpha + _flat_rows(p.sum(dim=-1))
    o_new = state.o * _per_query(alpha) + torch.einsum("bkgnm,bmkd->bnkgd", p, v).flatten(2, 3)
    return SoftmaxState(m_new, l_new, o_new)


# ------------------------------------------------------------ one device's ring steps
def _sel(x: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """Rows `index` of the sequence dimension (dim 1) of x; all of them for None."""
    return x if index is None else x.index_select(1, index)


def attend_block(out: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, kv: torch.Tensor,
                 plan: BlockPlan | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward ring step in flash-kernel form: attend `q` over the held block
    kv (2, b, m, h_kv, d) as `plan` says and merge into the partial (out, lse) with
    `merge_attention`. `plan=None` (a future block) returns the inputs unchanged."""
    if plan is None:
        return out, lse
    k, v = _sel(kv[0], plan.cols), _sel(kv[1], plan.cols)
    block_out, block_lse = block_forward(_sel(q, plan.rows), k, v, scale, plan.mask)
    if plan.rows is None:
        return merge_attention(out, lse, block_out, block_lse)
    r = plan.rows
    merged_out, merged_lse = merge_attention(out[:, r], lse[:, :, r], block_out, block_lse)
    out, lse = out.clone(), lse.clone()
    out[:, r], lse[:, :, r] = merged_out, merged_lse
    return out, lse


def block_grads(dout: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, lse: torch.Tensor,
                delta: torch.Tensor, plan: BlockPlan | None, scale: float,
                dq: torch.Tensor) -> torch.Tensor:
    """One backward ring step: add this block's dQ into `dq` (in place) and return this
    device's dK,dV for the held block, (2, b, m, h_kv, d) (zeros for a skipped block)."""
    dkv = torch.zeros_like(kv)
    if plan is None:
        return dkv
    r, cols = plan.rows, plan.cols
    dq_b, dk_b, dv_b = block_backward(
        _sel(dout, r), _sel(q, r), _sel(kv[0], cols), _sel(kv[1], cols),
        lse if r is None else lse[:, :, r], delta if r is None else delta[:, :, r],
        scale, plan.mask)
    if r is None:
        dq += dq_b
    else:
        dq[:, r] += dq_b
    if cols is None:
        dkv[0], dkv[1] = dk_b, dv_b
    else:
        dkv[0][:, cols], dkv[1][:, cols] = dk_b, dv_b
    return dkv


# ---------------------------------------------------------------------- the emulated ring
@dataclass
class RingStats:
    """What an emulated ring run did: per device blocks computed/skipped, allowed and scored
    (query, key) pairs, and bytes sent forward and backward (K,V and dK,dV)."""

    blocks_computed: list[int] = field(default_factory=list)
    blocks_skipped: list[int] = field(default_factory=list)
    pairs: list[int] = field(default_factory=list)
    pairs_computed: list[int] = field(default_factory=list)
    bytes_forward: list[int] = field(default_factory=list)
    bytes_backward: list[int] = field(default_factory=list)

    def reset(self, c: int) -> None:
        for name in ("blocks_computed", "blocks_skipped", "pairs", "pairs_computed",
                     "bytes_forward", "bytes_backward"):
            setattr(self, name, [0] * c)


def _rotate(held: list[torch.Tensor], sent: list[int]) -> list[torch.Tensor]:
    """One ring step: device p sends to p+1. Sends are snapshotted before receives land."""
    c = len(held)
    snapshot = list(held)
    for p in range(c):
        sent[p] += snapshot[p].numel() * snapshot[p].element_size()
    return [snapshot[(p - 1) % c] for p in range(c)]


class _EmulatedRing(torch.autograd.Function):
    """Ring attention over stacked shards q (c, b, n, h_q, d), k/v (c, b, n, h_kv, d)."""

    @staticmethod
    def forward(ctx: Any, qs: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor,
                positions: torch.Tensor, causal: bool, scale: float,
                stats: RingStats) -> torch.Tensor:
        c = qs.shape[0]
        held = [torch.stack((ks[p], vs[p])) for p in range(c)]  # each (2, b, n, h_kv, d)
        states = [SoftmaxState.empty(qs[p], vs.shape[-1]) for p in range(c)]
        for t in range(c):
            for p in range(c):
                src = (p - t) % c
                plan = plan_block(positions[p], positions[src], causal)
                if plan is None:
                    stats.blocks_skipped[p] += 1
                    continue
                stats.blocks_computed[p] += 1
                stats.pairs[p] += plan.pairs
                stats.pairs_computed[p] += plan.computed
                k, v = _sel(held[p][0], plan.cols), _sel(held[p][1], plan.cols)
                if plan.rows is None:
                    states[p] = absorb_block(states[p], qs[p], k, v, scale, plan.mask)
                else:  # absorb into the selected rows only
                    r = plan.rows
                    sub = SoftmaxState(states[p].m[:, :, r], states[p].l[:, :, r],
                                       states[p].o[:, r])
                    sub = absorb_block(sub, qs[p][:, r], k, v, scale, plan.mask)
                    states[p].m[:, :, r], states[p].l[:, :, r] = sub.m, sub.l
                    states[p].o[:, r] = sub.o
            if t < c - 1:
                held = _rotate(held, stats.bytes_forward)
        finished = [state.finish() for state in states]
        out = torch.stack([o for o, _ in finished])  # (c, b, n, h_q, d)
        lse = torch.stack([lse for _, lse in finished])  # (c, b, h_q, n)
        ctx.save_for_backward(qs, ks, vs, out, lse, positions)
        ctx.causal, ctx.scale, ctx.stats = causal, scale, stats
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        qs, ks, vs, out, lse, positions = ctx.saved_tensors
        dq, dkv = _ring_backward(dout, qs, ks, vs, out, lse, positions, ctx.causal, ctx.scale,
                                 ctx.stats)
        return dq, dkv[:, 0], dkv[:, 1], None, None, None, None


def _ring_backward(dout: torch.Tensor, qs: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, positions: torch.Tensor, causal: bool,
                   scale: float, stats: RingStats) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward ring. K,V rotate again (c-1 hops); device p first meets the blocks of
    p-1, p-2, …, p+1 and its own block last, so the dK,dV buffer of block j is created on j+1,
    picks up each device's contribution, and reaches its owner j after c-1 hops:

        step t = 0..c-2: receive (K,V) of block p-1-t; add this device's dK,dV to the buffer
                         received from p-1 (which holds block p-1-t); send the buffer to p+1.
        finally:         the buffer received is block p's; add the own-block dK,dV.
    """
    c = qs.shape[0]
    delta = (dout * out).sum(dim=-1).transpose(-1, -2)  # (c, b, n, h_q) -> (c, b, h_q, n)
    dq = torch.zeros_like(qs)

    def grads(p: int, src: int, kv: torch.Tensor) -> torch.Tensor:
        plan = plan_block(positions[p], positions[src], causal)
        return block_grads(dout[p], qs[p], kv, lse[p], delta[p], plan, scale, dq[p])

    held = [torch.stack((ks[p], vs[p])) for p in range(c)]  # (2, b, n, h_kv, d)
    buffers: list[torch.Tensor] | None = None
    for t in range(c - 1):
        held = _rotate(held, stats.bytes_backward)
        mine = [grads(p, (p - 1 - t) % c, held[p]) for p in range(c)]
        if buffers is not None:
            mine = [buffers[p] + mine[p] for p in range(c)]
        buffers = _rotate(mine, stats.bytes_backward)
    own = [grads(p, p, torch.stack((ks[p], vs[p]))) for p in range(c)]
    dkv = torch.stack(own if buffers is None else [buffers[p] + own[p] for p in range(c)])
    return dq, dkv  # dkv (c, 2, b, n, h_kv, d)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_devices: int,
                   causal: bool = False, layout: str = "contiguous", *,
                   scale: float | None = None, stats: RingStats | None = None) -> torch.Tensor:
    """Softmax attention computed as `num_devices` ring-attention devices would (one process).

    q (b, s, h_q, d), k/v (b, s, h_kv, d) in natural token order -> (b, s, h_q, d); equal to
    `softmax(scale·QKᵀ + causal mask)·V` (scale defaults to 1/√d). The sequence is permuted to
    `layout`, cut into one block per device, run around the ring (forward with `absorb_block`,
    backward with the rotating dK,dV buffer), and permuted back. Pass `stats` to see the block
    skipping and the bytes each device sent.
    """
    if q.dim() != 4 or k.dim() != 4 or v.shape[:3] != k.shape[:3]:
        raise ShardwiseError("ring_attention wants q (b, s, h_q, d) and k, v (b, s, h_kv, d)")
    b, s, h_q, d = q.shape
    _group(q, k.shape[2])  # validates h_kv | h_q
    c = num_devices
    positions = layout_positions(s, c, layout)
    stats = stats if stats is not None else RingStats()
    stats.reset(c)

    def blocks(x: torch.Tensor) -> torch.Tensor:
        # (b, s, h, d) -> layout order -> (b, c, n, h, d) -> (c, b, n, h, d)
        x = to_layout(x, c, layout)
        return x.reshape(b, c, s // c, *x.shape[2:]).transpose(0, 1)

    out = _EmulatedRing.apply(blocks(q), blocks(k), blocks(v), positions, causal,
                              scale if scale is not None else 1.0 / math.sqrt(d), stats)
    # (c, b, n, h_q, d) -> (b, c·n, h_q, d) in layout order -> natural order
    return from_layout(out.transpose(0, 1).reshape(b, s, h_q, -1), c, layout)
