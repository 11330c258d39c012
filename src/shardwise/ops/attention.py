"""Attention numerics shared by the emulated ring (`emulate.ring_attention`) and the runtime's
context parallelism (`runtime.context_parallel`): sequence layouts, the block plan under a causal
mask, one block's forward and backward, and the exact merge of partial results.

Partial results merge exactly with the online softmax (Milakov & Gimelshein 2018): each query
row keeps a running max `m`, denominator `ℓ` and unnormalised output `o` as blocks of scores
are absorbed, and at the end `O = o / ℓ`, `lse = m + log ℓ` (the update formulas, and the
merge of normalised `(O_b, lse_b)` pairs, are in the design notes). The fused kernels also run
sliding windows (`window_bias`) and attention sinks (`add_sinks`, `sink_grad`).

Design notes: docs/concepts/runtime.md#ops-attention.
"""

from __future__ import annotations

from dataclasses import dataclass

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
def group_heads(q: torch.Tensor, h_kv: int) -> torch.Tensor:
    """(b, n, h_q, d) -> (b, n, h_kv, g, d): query head h = kv·g + i reads kv head `kv`."""
    b, n, h_q, d = q.shape
    if h_q % h_kv:
        raise ShardwiseError(f"n_kv_heads={h_kv} does not divide n_heads={h_q}")
    return q.reshape(b, n, h_kv, h_q // h_kv, d)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float,
            mask: torch.Tensor | None) -> torch.Tensor:
    """S = scale · Q Kᵀ per head, masked entries -inf: (b, h_kv, g, n, m)."""
    s = torch.einsum("bnkgd,bmkd->bkgnm", group_heads(q, k.shape[2]), k) * scale
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
    dout_g = group_heads(dout, h_kv)  # (b, n, h_kv, g, d)
    dv = torch.einsum("bkgnm,bnkgd->bmkd", p, dout_g)
    dp = torch.einsum("bnkgd,bmkd->bkgnm", dout_g, v)
    ds = p * (dp - _rows(delta, h_kv))
    dq = torch.einsum("bkgnm,bmkd->bnkgd", ds, k).flatten(2, 3) * scale
    dk = torch.einsum("bkgnm,bnkgd->bmkd", ds, group_heads(q, h_kv)) * scale
    return dq, dk, dv


# ------------------------------------------------------------------------ fused kernels
def _heads_first(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(b, n, heads, d) -> (b, heads, n, d) views, SDPA's layout."""
    return tuple(t.transpose(1, 2) for t in ts)


def _causal_mask(n: int, m: int, device: torch.device) -> torch.Tensor:
    """Top-left aligned causal mask (n, m): query i sees keys 0…i."""
    return torch.ones(n, m, dtype=torch.bool, device=device).tril()


def window_bias(n: int, window: int, device: torch.device, dtype: torch.dtype
                ) -> torch.Tensor:
    """Additive mask (n, n) of causal sliding-window attention: query i sees keys j with
    `i - w < j ≤ i` (the last `w` keys, itself included: transformers 5.24
    `masking_utils.sliding_window_overlay`), 0 there and -inf elsewhere."""
    i = torch.arange(n, device=device)
    allowed = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
    return torch.zeros(n, n, dtype=dtype, device=device).masked_fill(~allowed, float("-inf"))


def fused_kernel(q: torch.Tensor) -> bool:
    """Whether `fused_forward`/`fused_backward` run torch's CPU flash kernel for q (on CPU),
    else the reference `block_forward`/`block_backward`."""
    return q.device.type == "cpu"


def fused_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  causal: bool, window: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`block_forward` (over one whole block, causal top-left aligned or unmasked) in a fused
    kernel: q (b, n, h_q, d), k/v (b, m, h_kv, d) -> O (b, n, h_q, d), lse (b, h_q, n).
    `window` > 0 (with `causal`, n = m): each query sees its last `window` keys
    (`window_bias`, passed to the kernel as its additive mask).

    On CPU this is torch's flash kernel, the one `F.scaled_dot_product_attention` dispatches to
    there (`aten._scaled_dot_product_flash_attention_for_cpu`, torch ≥ 2.2): grouped-query
    heads natively, every float dtype including fp64, and the log-sum-exp that backward and the
    ring merge need (fp32 for 16-bit inputs, else the input dtype). Its output follows the
    query's memory layout, so with q a (b, n, h_q, d) tensor the returned O is contiguous in
    (b, n, h_q, d) and the out-projection's (b, n, h_q·d) view shares its storage. Other
    devices run the reference `block_forward` (CUDA's fused kernels would need their own
    accounting of what they keep; not measured here).
    """
    window = window if window < q.shape[1] else 0  # a window ≥ the sequence: causal
    if fused_kernel(q):
        bias = window_bias(q.shape[1], window, q.device, q.dtype) if window else None
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            *_heads_first(q, k, v), 0.0, causal and not window, attn_mask=bias, scale=scale)
        return out.transpose(1, 2), lse  # (b, h_q, n, d) view -> (b, n, h_q, d)
    return block_forward(q, k, v, scale, _mask(q, k, causal, window))


def _mask(q: torch.Tensor, k: torch.Tensor, causal: bool, window: int) -> torch.Tensor | None:
    if window:
        return torch.isfinite(window_bias(q.shape[1], window, q.device, q.dtype))
    return _causal_mask(q.shape[1], k.shape[1], q.device) if causal else None


def fused_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, scale: float, causal: bool,
                   window: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of `fused_forward` from its saved output and log-sum-exp (FlashAttention-2's
    backward, `D = rowsum(dO ∘ O)` computed inside): dq (b, n, h_q, d), dk, dv (b, m, h_kv, d).
    CPU: torch's flash backward kernel; elsewhere `block_backward`."""
    window = window if window < q.shape[1] else 0
    if fused_kernel(q):
        bias = window_bias(q.shape[1], window, q.device, q.dtype) if window else None
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            *_heads_first(dout, q, k, v, out), lse, 0.0, causal and not window,
            attn_mask=bias, scale=scale)
        dq, dk, dv = _heads_first(*grads)
        return dq, dk, dv
    delta = (dout * out).sum(dim=-1).transpose(1, 2)  # (b, n, h_q) -> (b, h_q, n)
    return block_backward(dout, q, k, v, lse, delta, scale, _mask(q, k, causal, window))


def add_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention sinks (gpt-oss; transformers 5.24 `GptOssAttention`): one learned logit
    `σ_h` per head joins each row's softmax denominator and attends to nothing,
    `lse' = log(e^lse + e^σ)`, `O' = O·e^(lse - lse')`. out (b, n, h, d), lse (b, h, n),
    sinks (h,) -> (O', lse'). Backward of the kernel from (O', lse') is then exact for Q, K,
    V (P = exp(S - lse') leaves the sink's share out; D = rowsum(dO∘O')), and `sink_grad`
    gives dσ."""
    new_lse = torch.logaddexp(lse, sinks.to(lse.dtype)[None, :, None])  # (b, h, n)
    return out * _per_query(torch.exp(lse - new_lse)).to(out.dtype), new_lse


def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
              sinks: torch.Tensor) -> torch.Tensor:
    """dσ_h = -Σ_rows p_sink·rowsum(dO∘O'), p_sink = e^(σ_h - lse') (the sink's softmax
    share): from `add_sinks`'s outputs; dout, out (b, n, h, d), lse (b, h, n) -> (h,)."""
    delta = (dout * out).sum(dim=-1).transpose(1, 2)  # (b, n, h) -> (b, h, n)
    share = torch.exp(sinks.to(lse.dtype)[None, :, None] - lse)
    return -(share * delta).sum(dim=(0, 2)).to(sinks.dtype)


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
def seq_rows(x: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """Rows `index` of the sequence dimension (dim 1) of x; all of them for None."""
    return x if index is None else x.index_select(1, index)


def _causal_or_full(mask: torch.Tensor | None) -> bool | None:
    """The fused kernel's `is_causal` for a block mask: False for None (every pair), True for
    the top-left causal triangle, None for any other mask (the reference kernel runs). After
    `plan_block`'s trimming every block of the three layouts is one of the first two: positions
    increase along each device's block, so a diagonal block's mask is the triangle, and
    striped's strictly-lower off-diagonal block becomes one once its empty first row and last
    column are trimmed."""
    if mask is None:
        return False
    n, m = mask.shape
    return True if torch.equal(mask, _causal_mask(n, m, mask.device)) else None


def attend_block(out: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, kv: torch.Tensor,
                 plan: BlockPlan | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward ring step in flash-kernel form: attend `q` over the held block
    kv (2, b, m, h_kv, d) as `plan` says (`fused_forward` when its mask is none or causal,
    else `block_forward`) and merge into the partial (out, lse) with `merge_attention`.
    `plan=None` (a future block) returns the inputs unchanged."""
    if plan is None:
        return out, lse
    k, v = seq_rows(kv[0], plan.cols), seq_rows(kv[1], plan.cols)
    q_rows, causal = seq_rows(q, plan.rows), _causal_or_full(plan.mask)
    block_out, block_lse = (block_forward(q_rows, k, v, scale, plan.mask) if causal is None
                            else fused_forward(q_rows, k, v, scale, causal))
    if plan.rows is None:
        return merge_attention(out, lse, block_out, block_lse)
    r = plan.rows
    merged_out, merged_lse = merge_attention(out[:, r], lse[:, :, r], block_out, block_lse)
    out, lse = out.clone(), lse.clone()
    out[:, r], lse[:, :, r] = merged_out, merged_lse
    return out, lse


def block_grads(dout: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor,
                lse: torch.Tensor, plan: BlockPlan | None, scale: float,
                dq: torch.Tensor) -> torch.Tensor:
    """One backward ring step from the final output `out` and `lse` of the query block: add
    this block's dQ into `dq` (in place) and return this device's dK,dV for the held block,
    (2, b, m, h_kv, d) (zeros for a skipped block). `fused_backward` when the block's mask is
    none or causal, else `block_backward` with `D = rowsum(dO ∘ O)` of the selected rows."""
    dkv = torch.zeros_like(kv)
    if plan is None:
        return dkv
    r, cols = plan.rows, plan.cols
    d_rows, q_rows, o_rows = seq_rows(dout, r), seq_rows(q, r), seq_rows(out, r)
    lse_rows = lse if r is None else lse[:, :, r]
    k, v = seq_rows(kv[0], cols), seq_rows(kv[1], cols)
    causal = _causal_or_full(plan.mask)
    if causal is None:
        delta = (d_rows * o_rows).sum(dim=-1).transpose(1, 2)  # (b, n, h_q) -> (b, h_q, n)
        dq_b, dk_b, dv_b = block_backward(d_rows, q_rows, k, v, lse_rows, delta, scale,
                                          plan.mask)
    else:
        dq_b, dk_b, dv_b = fused_backward(d_rows, q_rows, k, v, o_rows, lse_rows, scale, causal)
    if r is None:
        dq += dq_b
    else:
        dq[:, r] += dq_b
    if cols is None:
        dkv[0], dkv[1] = dk_b, dv_b
    else:
        dkv[0][:, cols], dkv[1][:, cols] = dk_b, dv_b
    return dkv
