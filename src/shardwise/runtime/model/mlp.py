"""The feed-forward layers: `SwiGLU`, top-k `MoE` with shared experts (and its auxiliary loss's
gradient, `AuxLossAutoScaler`), `configure_moe`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from torch import nn

from shardwise.arch import ModelSpec
from shardwise.ops.moe import MoEParams, RoutingRule, SequenceShards, expert_mlp, moe_layer
from shardwise.ops.swiglu import gated
from shardwise.runtime.model.layers import Projection, TensorMap, identity, separate_linears


def activation(spec: ModelSpec) -> tuple[str, tuple[float, float]]:
    """The gated MLP's activation and gpt-oss's (alpha, limit) (`ops.swiglu.gated`)."""
    given = dict(spec.multipliers)
    return spec.gated_act, (given.get("swiglu_alpha", 1.702), given.get("swiglu_limit", 7.0))


class SwiGLU(nn.Module):
    """`W_down(silu(W_gate x)·W_up x)` (`act`: or GeGLU's gelu_tanh, `ops.swiglu.gated`);
    tensor parallelism splits f and sets `enter`/`leave` (and, with sequence parallelism,
    `project`: gate and up from the entered input)."""

    def __init__(self, d_model: int, d_ff: int, dtype: torch.dtype, act: str = "silu"):
        super().__init__()
        self.act = act
        self.w_gate = nn.Linear(d_model, d_ff, bias=False, dtype=dtype)
        self.w_up = nn.Linear(d_model, d_ff, bias=False, dtype=dtype)
        self.w_down = nn.Linear(d_ff, d_model, bias=False, dtype=dtype)
        self.enter: TensorMap = identity
        self.project: Projection = separate_linears
        self.leave: TensorMap = identity

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.project(self.enter(x), (self.w_gate.weight, self.w_up.weight))
        return self.leave(self.w_down(gated(gate, up, self.act)))


class AuxLossAutoScaler(torch.autograd.Function):
    """Attach an auxiliary loss to an activation: forward returns `y` unchanged, backward
    passes `dy` through and seeds the loss's gradient with `scale` (Megatron-LM's
    `MoEAuxLossAutoScaler`). The layer's loss joins the objective wherever the layer runs —
    on any pipeline stage — without travelling to the last stage."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return y.view_as(y)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        return dy, torch.full((), ctx.scale, dtype=dy.dtype, device=dy.device), None


# (T, h) tokens -> (output (T, h), the layer's load-balancing loss)
Experts = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class MoE(nn.Module):
    """Top-k routed SwiGLU experts (Shazeer et al. 2017; Mixtral's renormalised gates) plus
    `n_shared_experts` always-on SwiGLU experts (DeepSeekMoE, Dai et al. 2024):

        y = Σ_{s shared} E_s(x) + Σ_{i ∈ topk(softmax(x W_r)), kept} g_i · E_i(x)

    per token. Parameters as `ops.moe.MoEParams`: router (h, E), w_gate, w_up (E, h, f),
    w_down (E, f, h); shared_gate, shared_up (S, h, f), shared_down (S, f, h); gpt-oss's
    router_bias (E,), b_gate, b_up (E, f), b_down (E, h) and clamped SwiGLU (`activation`).

    `capacity_factor` (None: no limit, nothing dropped) caps every expert at
    `⌈cf · T·k / E⌉` assignments from the T tokens of one call — one micro-batch on one rank
    (GShard's group; under expert parallelism the rank's own tokens, before dispatch, as
    Megatron-LM and Switch compute it; with the sequences split over cp or SP ranks, the
    whole micro-batch's, `sequence_shards`); `ops.moe` keeps them in token order. With
    `aux_loss_coef` α > 0 the objective gains `α · L_aux` of every MoE layer (Switch's
    `E · Σ_i f_i P_i` over the call's tokens), scaled by `aux_loss_scale` (1/m over m
    micro-batches, as the cross-entropy is); `aux_loss` keeps the last call's value (this
    rank's share when `sequence_shards` is set).
    `experts` maps tokens (T, h) -> (y, L_aux); expert parallelism swaps it."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype):
        super().__init__()
        h, f, e, s = spec.d_model, spec.expert_d_ff, spec.n_experts, spec.n_shared_experts
        self.top_k = spec.top_k
        self.routing = {"normalize": spec.norm_topk, "score": spec.router_score,
                        "scale": spec.routed_scaling, "groups": spec.expert_groups,
                        "topk_groups": spec.topk_groups}
        # DeepSeek-V3's e_score_correction_bias: fixed here (loaded with a checkpoint; its
        # aux-loss-free update between steps is not run), in at least fp32 as transformers
        self.score_bias: torch.Tensor | None
        self.register_buffer("score_bias", torch.zeros(
            e, dtype=torch.promote_types(dtype, torch.float32))
            if spec.router_score == "sigmoid" else None)
        self.router = nn.Parameter(torch.empty(h, e, dtype=dtype))
        self.w_gate = nn.Parameter(torch.empty(e, h, f, dtype=dtype))
        self.w_up = nn.Parameter(torch.empty(e, h, f, dtype=dtype))
        self.w_down = nn.Parameter(torch.empty(e, f, h, dtype=dtype))
        self.act, self.act_params = activation(spec)
        self.router_bias = (nn.Parameter(torch.zeros(e, dtype=dtype)) if spec.router_bias
                            else None)
        if spec.mlp_bias:
            self.b_gate = nn.Parameter(torch.zeros(e, f, dtype=dtype))
            self.b_up = nn.Parameter(torch.zeros(e, f, dtype=dtype))
            self.b_down = nn.Parameter(torch.zeros(e, h, dtype=dtype))
        if s:
            self.shared_gate = nn.Parameter(torch.empty(s, h, f, dtype=dtype))
            self.shared_up = nn.Parameter(torch.empty(s, h, f, dtype=dtype))
            self.shared_down = nn.Parameter(torch.empty(s, f, h, dtype=dtype))
        self.n_shared = s
        self.capacity_factor: float | None = None
        self.aux_loss_coef = 0.0
        self.aux_loss_scale = 1.0
        self.aux_loss: torch.Tensor | None = None
        self.dropped = 0  # assignments of the last call's tokens dropped at the capacity
        self.expert_rows: torch.Tensor | None = None  # (experts here,) rows each ran, last call
        # the call's tokens are part of sequences split over other ranks (cp, SP): the aux
        # loss is this rank's share of their group's (`ops.moe.load_balancing_loss`)
        self.sequence_shards: SequenceShards | None = None
        self.experts: Experts = self.all_experts

    @property
    def routing_shards(self) -> SequenceShards | None:
        """`sequence_shards` as this layer uses them: the counts summed over the shards only
        when the aux loss joins the objective (otherwise each rank keeps its own, unused,
        value), the choices exchanged only under a capacity factor."""
        s = self.sequence_shards
        if s is None:
            return None
        return replace(s, total=s.total if self.aux_loss_coef else None,
                       keep=s.keep if self.capacity_factor is not None else None)

    def rule(self) -> RoutingRule:
        """The router's rule: top-k, scores, groups, bias and scale (`ops.moe.RoutingRule`)."""
        return RoutingRule(self.top_k, bias=self.score_bias, **self.routing)

    def all_experts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        params = MoEParams(self.router, self.w_gate, self.w_up, self.w_down, self.router_bias,
                           getattr(self, "b_gate", None), getattr(self, "b_up", None),
                           getattr(self, "b_down", None), self.act, self.act_params)
        result = moe_layer(x, params, self.top_k, capacity_factor=self.capacity_factor,
                           shards=self.routing_shards, routing=self.rule())
        self.dropped, self.expert_rows = result.dropped, result.kept
        return result.out, result.aux_loss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])  # (b, s, h) -> (b·s, h)
        y, aux = self.experts(tokens)
        self.aux_loss = aux.detach()
        if self.aux_loss_coef and torch.is_grad_enabled():
            y = AuxLossAutoScaler.apply(y, aux, self.aux_loss_coef * self.aux_loss_scale)
        for i in range(self.n_shared):  # the shared experts see every token
            y = y + expert_mlp(tokens, self.shared_gate[i], self.shared_up[i],
                               self.shared_down[i])
        return y.view(shape)


def configure_moe(model: nn.Module, capacity_factor: float | None = None,
                  aux_loss_coef: float = 0.0) -> None:
    """Set the capacity factor and the auxiliary-loss coefficient of every MoE layer."""
    for module in model.modules():
        if isinstance(module, MoE):
            module.capacity_factor, module.aux_loss_coef = capacity_factor, aux_loss_coef


