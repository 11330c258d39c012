"""Mixture-of-experts numerics shared by the emulated MoE (`emulate.moe`), the runtime model
(`runtime.model`) and expert parallelism (`runtime.expert_parallel`) (SPEC §8).

DeepSeek's routers (`RoutingRule` fields; transformers 5.24 `DeepseekV3TopkRouter`,
`DeepseekV2TopkRouter`): DeepSeek-V3 scores with `p = sigmoid(x W_r)` and chooses by
`p + b` (`bias`, the aux-loss-free balancing term `e_score_correction_bias`: the choice only,
never the gates); both may limit the choice to the `topk_groups` best of `groups` equal groups
of experts (a group's score: V3 the sum of its two best `p + b`, V2 its best `p`); the gates
are `p` of the chosen experts, renormalised or not, times `scale` (routed_scaling_factor).

Design notes: docs/concepts/runtime.md#ops-moe.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from shardwise.errors import ShardwiseError
from shardwise.ops.swiglu import gated


# ------------------------------------------------------------------------------- params
@dataclass
class MoEParams:
    """Router and SwiGLU experts: router (h, E); w_gate, w_up (E, h, f); w_down (E, f, h).
    gpt-oss adds biases, router_bias (E,), b_gate, b_up (E, f), b_down (E, h), and its
    clamped activation (`act`: `ops.swiglu.gated`'s, with `act_params` (alpha, limit))."""

    router: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor
    router_bias: torch.Tensor | None = None
    b_gate: torch.Tensor | None = None
    b_up: torch.Tensor | None = None
    b_down: torch.Tensor | None = None
    act: str = "silu"
    act_params: tuple[float, float] = (1.702, 7.0)

    def expert(self, x: torch.Tensor, i: int) -> torch.Tensor:
        """Expert `i` on rows x (n, h) -> (n, h) (`expert_mlp`)."""
        def row(b: torch.Tensor | None) -> torch.Tensor | None:
            return None if b is None else b[i]

        return expert_mlp(x, self.w_gate[i], self.w_up[i], self.w_down[i],
                          (row(self.b_gate), row(self.b_up), row(self.b_down)), self.act,
                          self.act_params)

    @property
    def num_experts(self) -> int:
        return self.router.shape[1]

    @property
    def hidden(self) -> int:
        return self.router.shape[0]

    @classmethod
    def random(cls, hidden: int, ffn: int, num_experts: int, *, seed: int = 0,
               dtype: torch.dtype = torch.float64, requires_grad: bool = True) -> MoEParams:
        """Deterministic random parameters (std 1/√fan_in)."""
        gen = torch.Generator().manual_seed(seed)

        def rand(*shape: int, fan_in: int) -> torch.Tensor:
            t = torch.randn(*shape, generator=gen, dtype=dtype) / math.sqrt(fan_in)
            return t.requires_grad_(requires_grad)

        return cls(rand(hidden, num_experts, fan_in=hidden),
                   rand(num_experts, hidden, ffn, fan_in=hidden),
                   rand(num_experts, hidden, ffn, fan_in=hidden),
                   rand(num_experts, ffn, hidden, fan_in=ffn))

    def tensors(self) -> list[torch.Tensor]:
        return [self.router, self.w_gate, self.w_up, self.w_down]


# ------------------------------------------------------------------------------ routing
@dataclass
class Routing:
    """Router output for T tokens: probs (T, E), experts and gates (T, k)."""

    probs: torch.Tensor
    experts: torch.Tensor
    gates: torch.Tensor


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, normalize: bool = True) -> Routing:
    """Top-k softmax routing: `p = softmax(x W_r)`, the k largest, gates renormalised over them
    (`normalize`, Mixtral) or the raw probabilities (Switch with k = 1, GShard)."""
    rule = RoutingRule(top_k, normalize)
    probs = rule.probs(x, router)
    return Routing(probs, *rule.choose(probs))


def router_probs(x: torch.Tensor, router: torch.Tensor, score: str = "softmax",
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """`softmax(x W_r)` (or `sigmoid`, DeepSeek-V3), (T, h) @ (h, E) -> (T, E), in at least
    fp32: bf16 logits are cast up first, as Hugging Face's Mixtral (`softmax(router_logits,
    dtype=torch.float)`), DeepSeek-V3 and Megatron-LM's routers do; the gates scale the expert
    outputs in their dtype. Autograd keeps x and the scores (both functions save their
    output). `bias` (E,): gpt-oss's router bias, added to the logits."""
    logits = x @ router if bias is None else torch.addmm(bias, x, router)
    if score == "sigmoid":
        return torch.sigmoid(logits.to(torch.promote_types(x.dtype, torch.float32)))
    return torch.softmax(logits, dim=-1, dtype=torch.promote_types(x.dtype, torch.float32))


def _check_top_k(top_k: int, num_experts: int) -> None:
    if not 1 <= top_k <= num_experts:
        raise ShardwiseError(f"top_k={top_k} must be in 1..n_experts={num_experts}")


def expert_capacity(tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Assignments one expert accepts from a group of `tokens`: `⌈cf · T·k / E⌉`."""
    if capacity_factor <= 0:
        raise ShardwiseError(f"capacity_factor must be > 0, got {capacity_factor}")
    return math.ceil(capacity_factor * tokens * top_k / num_experts)


def capacity_keep(experts: torch.Tensor, num_experts: int, capacity: int | None) -> torch.Tensor:
    """Which (token, slot) assignments an expert keeps: the first `capacity` in token order.

    experts (T, k) -> keep (T, k) bool; `capacity=None` keeps everything.
    """
    if capacity is None:
        return torch.ones_like(experts, dtype=torch.bool)
    onehot = F.one_hot(experts.reshape(-1), num_experts)  # (T·k, E), token-major order
    position = (onehot.cumsum(dim=0) - 1)[torch.arange(onehot.shape[0]), experts.reshape(-1)]
    return (position < capacity).reshape(experts.shape)


@dataclass(frozen=True)
class SequenceShards:
    """A routing group whose tokens are spread over `ranks` ranks (a sequence split by
    context parallelism, or by tensor parallelism's sequence parallelism): `total` sums a
    tensor over those ranks (an all-reduce); `scale` multiplies this rank's share of the
    loss (cp: the gradients are averaged over the cp ranks, so each carries cp shares)."""

    ranks: int
    total: Callable[[torch.Tensor], torch.Tensor] | None = None  # None: the local loss
    scale: float = 1.0
    # (this rank's choices (T/ranks, k), capacity factor) -> which of them the group's
    # capacity keeps: one device's drop rule over the whole group, in its token order
    keep: Callable[[torch.Tensor, float], torch.Tensor] | None = None


def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor,
                        shards: SequenceShards | None = None) -> torch.Tensor:
    """Switch's auxiliary loss `E · Σ_i f_i · P_i` for one group of tokens.

    f_i = (assignments to expert i) / (T·k) (counted before dropping, not differentiable),
    P_i = mean over tokens of p_i(x).

    With `shards` (this rank holds T/ranks of the group's T tokens): the group's counts
    C_i = T·k·f_i are summed over the ranks (Megatron-LM sums them over its sequence-sharded
    tp×cp group likewise, `sequence_partition_group`), and this rank returns its share
    `scale · E/(T²·k) · Σ_i C_i · S_i` with S_i = Σ_{its tokens} p_i(x): the shares of the
    ranks add up to the group's loss, and so do their gradients (C_i is a constant).
    """
    num_experts = probs.shape[1]
    counts = torch.bincount(experts.reshape(-1), minlength=num_experts)
    if shards is None or shards.total is None:
        f = counts.to(probs.dtype) / experts.numel()
        return num_experts * (f * probs.mean(dim=0)).sum()
    group = shards.total(counts.to(torch.float64)).to(probs.dtype)  # (E,) exact integers
    tokens, top_k = probs.shape[0] * shards.ranks, experts.shape[1]
    share = num_experts / (tokens * tokens * top_k) * (group * probs.sum(dim=0)).sum()
    return shards.scale * share


def expert_mlp(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
               w_down: torch.Tensor,
               biases: tuple[torch.Tensor | None, ...] = (None, None, None),
               act: str = "silu", act_params: tuple[float, float] = (1.702, 7.0)
               ) -> torch.Tensor:
    """One SwiGLU expert: `(SiLU(x W_g) ⊙ x W_u) W_d`, x (n, h) -> (n, h); saves x, the gate
    and up projections and the down projection's input (SPEC §3). `biases` (b_g, b_u, b_d)
    are added after each projection; `act`: the gated activation (`ops.swiglu.gated`)."""
    b_gate, b_up, b_down = biases
    gate = x @ w_gate if b_gate is None else torch.addmm(b_gate, x, w_gate)
    up = x @ w_up if b_up is None else torch.addmm(b_up, x, w_up)
    hidden = gated(gate, up, act, *act_params)
    return hidden @ w_down if b_down is None else torch.addmm(b_down, hidden, w_down)


# ------------------------------------------------------------------------ single device
@dataclass
class MoEResult:
    """Output (T, h), auxiliary loss, per-expert assignment counts before (`routed`) and after
    (`kept`) the capacity limit, and the number of dropped assignments."""

    out: torch.Tensor
    aux_loss: torch.Tensor
    routed: torch.Tensor
    kept: torch.Tensor

    @property
    def dropped(self) -> int:
        return int((self.routed - self.kept).sum())

    @property
    def imbalance(self) -> float:
        """max / mean of the routed per-expert counts (1.0 = perfectly balanced)."""
        return imbalance(self.routed)


def imbalance(counts: torch.Tensor) -> float:
    """max / mean of per-expert counts; 1.0 is perfect balance."""
    mean = counts.double().mean()
    return float(counts.double().max() / mean) if mean > 0 else 1.0


def moe_layer(x: torch.Tensor, params: MoEParams, top_k: int, *,
              capacity_factor: float | None = None, normalize: bool = True,
              groups: int = 1, shards: SequenceShards | None = None,
              routing: RoutingRule | None = None) -> MoEResult:
    """The single-device MoE layer on x (T, h); `groups` equal slices of the tokens are routed
    and capacity-limited independently (use `groups = e` to match `e` expert-parallel ranks).
    `shards`: x is this rank's part of a group spread over several ranks; the auxiliary
    loss is then this rank's share (`load_balancing_loss`), and the capacity the group's
    (`RoutingRule.for_group`). `routing`: the router's rule (DeepSeek's scores, groups, bias,
    scale; its top_k and normalize replace those given)."""
    tokens, _ = x.shape
    if groups < 1 or tokens % groups:
        raise ShardwiseError(f"groups={groups} must divide the {tokens} tokens")
    rule = replace(routing or RoutingRule(top_k, normalize), num_ranks=1,
                   capacity_factor=capacity_factor)
    outs, losses, routed, kept = [], [], [], []
    for xg in x.chunk(groups):
        probs = rule.probs(xg, params.router, params.router_bias)
        group_rule = rule.for_group(probs, shards)
        choice, plan = group_rule.plan(probs)
        rows = gather_rows(xg, probs, plan, group_rule)  # (N, h), sorted by expert
        outputs = [params.expert(chunk, i)
                   for i, chunk in enumerate(rows.split(plan.per_expert.tolist()))
                   if chunk.shape[0]]
        expert_out = torch.cat(outputs) if outputs else rows
        outs.append(weighted_combine(expert_out, probs, plan, group_rule))
        losses.append(load_balancing_loss(probs, choice.experts, shards))
        routed.append(plan.routed)
        kept.append(plan.per_expert)
    return MoEResult(torch.cat(outs), torch.stack(losses).mean(),
                     torch.stack(routed).sum(0), torch.stack(kept).sum(0))


# ------------------------------------------------------------- dispatch / combine pieces
@dataclass
class DispatchPlan:
    """One rank's kept assignments sorted by expert (stable: token order within an expert).

    token, gate, expert (N,): the token row, its gate and expert for each dispatched row;
    per_expert (E,): kept rows per global expert; send (e,): rows for each destination rank;
    routed (E,): assignments per expert before the capacity limit; slot (N,): which of the
    token's k choices each row is.
    """

    token: torch.Tensor
    gate: torch.Tensor
    expert: torch.Tensor
    per_expert: torch.Tensor
    send: torch.Tensor
    routed: torch.Tensor
    slot: torch.Tensor | None = None


def dispatch_plan(routing: Routing, num_ranks: int, capacity_factor: float | None,
                  keep: torch.Tensor | None = None) -> DispatchPlan:
    """Drop over-capacity assignments and order the rest by destination (expert-major).
    `keep` (T, k): which assignments the capacity keeps, decided elsewhere (a group whose
    tokens several ranks hold, `SequenceShards.keep`)."""
    tokens, top_k = routing.experts.shape
    num_experts = routing.probs.shape[1]
    if num_experts % num_ranks:
        raise ShardwiseError(f"ep={num_ranks} does not divide n_experts={num_experts}")
    if keep is None:
        cap = None if capacity_factor is None else expert_capacity(
            tokens, top_k, num_experts, capacity_factor)
        keep = capacity_keep(routing.experts, num_experts, cap)
    token, slot = keep.nonzero(as_tuple=True)  # token-major order
    expert = routing.experts[token, slot]
    order = torch.sort(expert, stable=True).indices
    token, slot, expert = token[order], slot[order], expert[order]
    per_expert = torch.bincount(expert, minlength=num_experts)
    send = per_expert.reshape(num_ranks, -1).sum(dim=1)  # (e, E/e) -> (e,)
    routed = torch.bincount(routing.experts.reshape(-1), minlength=num_experts)
    return DispatchPlan(token, routing.gates[token, slot], expert, per_expert, send, routed,
                        slot)


@dataclass(frozen=True)
class RoutingRule:
    """How a group of tokens is routed: top-k, renormalised gates or not, over `num_ranks`
    expert-parallel ranks, with an optional capacity factor. `plan` derives everything from the
    router probabilities alone, so backward recomputes it from the saved probabilities."""

    top_k: int
    normalize: bool = True
    num_ranks: int = 1
    capacity_factor: float | None = None
    keep: torch.Tensor | None = None  # (T, k) the capacity's decision, fixed by `for_group`
    score: str = "softmax"  # or "sigmoid" (DeepSeek-V3)
    scale: float = 1.0  # the gates × routed_scaling_factor
    groups: int = 1  # experts in `groups` equal groups, the choice from the best `topk_groups`
    topk_groups: int = 1
    bias: torch.Tensor | None = None  # (E,) added to the scores for the choice only

    def probs(self, x: torch.Tensor, router: torch.Tensor,
              router_bias: torch.Tensor | None = None) -> torch.Tensor:
        """`softmax(x W_r + b_r)` or `sigmoid` (T, E); autograd saves x and the scores only.
        gpt-oss's softmax over its top-k logits is this softmax's top k renormalised
        (`normalize`): e^l_i / Σ_top e^l_j = p_i / Σ_top p_j."""
        _check_top_k(self.top_k, router.shape[1])
        return router_probs(x, router, self.score, router_bias)

    def choose(self, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """probs (T, E) -> the k chosen experts (T, k) and their gates (T, k): the k largest
        `p + bias` within the `topk_groups` best groups; gates `p` of those, renormalised over
        the k when `normalize`, times `scale`."""
        if self.groups == 1 and self.bias is None:  # the k largest scores themselves
            top, chosen = probs.topk(self.top_k, dim=-1)  # (T, k)
        else:
            choice = probs if self.bias is None else probs + self.bias
            if self.groups > 1:
                tokens, experts = choice.shape
                grouped = choice.view(tokens, self.groups, -1)  # (T, E) -> (T, G, E/G)
                group_score = (grouped.topk(2, dim=-1).values.sum(dim=-1)
                               if self.score == "sigmoid" else grouped.amax(dim=-1))  # (T, G)
                best = group_score.topk(self.topk_groups, dim=-1).indices
                allowed = torch.zeros_like(group_score, dtype=torch.bool).scatter(1, best, True)
                allowed = allowed.repeat_interleave(experts // self.groups, dim=1)  # (T, E)
                choice = choice.masked_fill(~allowed, float("-inf"))
            chosen = choice.topk(self.top_k, dim=-1).indices  # (T, k)
            top = probs.gather(1, chosen)
        gates = top / top.sum(dim=-1, keepdim=True) if self.normalize else top
        return chosen, gates if self.scale == 1 else gates * self.scale

    def for_group(self, probs: torch.Tensor, shards: SequenceShards | None) -> RoutingRule:
        """This rule with the capacity's decision fixed when the group's tokens are spread
        over several ranks (`shards.keep` exchanges the choices once, in forward; backward's
        `plan` reuses the (T, k) mask held here)."""
        if shards is None or shards.keep is None or self.capacity_factor is None:
            return self
        with torch.no_grad():
            experts = self.choose(probs.detach())[0]
        return replace(self, keep=shards.keep(experts, self.capacity_factor))

    def plan(self, probs: torch.Tensor) -> tuple[Routing, DispatchPlan]:
        """Top-k choice, gates and dispatch order from probs (T, E); no autograd graph."""
        with torch.no_grad():
            probs = probs.detach()
            routing = Routing(probs, *self.choose(probs))
            return routing, dispatch_plan(routing, self.num_ranks, self.capacity_factor,
                                          self.keep)


class _GatherRows(torch.autograd.Function):
    """x[plan.token] saving only the router probabilities (the order is recomputed)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, probs: torch.Tensor, token: torch.Tensor,
                rule: RoutingRule) -> torch.Tensor:
        ctx.save_for_backward(probs)
        ctx.rule, ctx.rows = rule, x.shape[0]
        return x[token]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (probs,) = ctx.saved_tensors
        token = ctx.rule.plan(probs)[1].token
        grad_x = grad.new_zeros(ctx.rows, *grad.shape[1:]).index_add(0, token, grad)
        return grad_x, None, None, None


class _WeightedCombine(torch.autograd.Function):
    """`y[t] = Σ_rows-of-t gate · expert_out` saving the expert outputs and the router
    probabilities; the gates and the row order are recomputed from them in backward."""

    @staticmethod
    def forward(ctx, expert_out: torch.Tensor, probs: torch.Tensor, plan: DispatchPlan,
                rule: RoutingRule) -> torch.Tensor:
        ctx.save_for_backward(expert_out, probs)
        ctx.rule = rule
        y = expert_out.new_zeros(probs.shape[0], expert_out.shape[1])
        return y.index_add(0, plan.token, plan.gate.to(expert_out.dtype)[:, None] * expert_out)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        expert_out, probs = ctx.saved_tensors
        rule = ctx.rule
        routing, plan = rule.plan(probs)
        dy_rows = dy[plan.token]  # (N, h)
        d_out = plan.gate.to(dy.dtype)[:, None] * dy_rows
        d_gates = torch.zeros_like(routing.gates)  # (T, k), the probabilities' dtype
        d_gates[plan.token, plan.slot] = (dy_rows * expert_out).sum(dim=1).to(d_gates.dtype)
        scaled = d_gates if rule.scale == 1 else rule.scale * d_gates
        if rule.normalize:  # g = r·top / Σ top: d_top = (r·d_g - Σ d_g·g) / Σ top
            total = probs.gather(1, routing.experts).sum(dim=-1, keepdim=True)
            d_top = (scaled - (d_gates * routing.gates).sum(dim=-1, keepdim=True)) / total
        else:  # g = r·top
            d_top = scaled
        d_probs = torch.zeros_like(probs).scatter(1, routing.experts, d_top)
        return d_out, d_probs, None, None


def gather_rows(x: torch.Tensor, probs: torch.Tensor, plan: DispatchPlan,
                rule: RoutingRule) -> torch.Tensor:
    """The dispatched rows x[plan.token] (N, h); `plan = rule.plan(probs)[1]`."""
    return _GatherRows.apply(x, probs, plan.token, rule)


def weighted_combine(expert_out: torch.Tensor, probs: torch.Tensor, plan: DispatchPlan,
                     rule: RoutingRule) -> torch.Tensor:
    """`combine` differentiable in the expert outputs and (through the gates) the router
    probabilities, keeping only those two for backward; `plan = rule.plan(probs)[1]`."""
    return _WeightedCombine.apply(expert_out, probs, plan, rule)


def run_local_experts(received: torch.Tensor, counts: torch.Tensor, w_gate: torch.Tensor,
                      w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """Apply this rank's experts to the rows it received.

    received (N, h) is ordered by source rank, then local expert, then token; counts
    (e, E_local) the rows from each source for each local expert; w_* (E_local, …).
    Returns the expert outputs (N, h) in the same order.
    """
    sources, local = counts.shape
    sizes = counts.reshape(-1).tolist()  # (source, local expert) blocks of rows
    blocks = list(received.split(sizes))
    for j in range(local):
        mine = [s * local + j for s in range(sources)]
        if sum(sizes[b] for b in mine):  # split / cat keep nothing for backward
            y = expert_mlp(torch.cat([blocks[b] for b in mine]), w_gate[j], w_up[j], w_down[j])
            for b, part in zip(mine, y.split([sizes[b] for b in mine])):
                blocks[b] = part
    return torch.cat(blocks)
