"""Decoder-only Transformer architectures: `ModelSpec`, presets, Hugging Face configs,
parameter counts and FLOPs per token (SPEC §1).

Parameter count (biases only with `bias`, or `qkv_bias`/`out_bias`), per layer, with head
width d (h/a unless the config names `head_dim`):

    attention  h·(a·d) (Q) + 2·h·(a_kv·d) (K, V) + (a·d)·h (O)  [+ a·d + 2·a_kv·d, + h biases]
    MLP        3·h·f gated (SwiGLU), 2·h·f otherwise
    norms      2·h
    model      L·per_layer + V·h (embedding) + V·h (head, unless tied) + h (final norm)

MoE layers count all experts in the *total* and `top_k` (+ shared) experts in the *active*
count, plus the router `h·n_experts`; the first `first_dense_layers` layers are dense
(DeepSeekMoE's `first_k_dense_replace`).

Multi-head latent attention (MLA; DeepSeek-V2, arXiv:2405.04434 §2.1) replaces Q, K, V by
low-rank projections through latents of width `r_q` (`q_lora_rank`; 0: a plain
`h·a·d_qk` query projection, as DeepSeek-V2-Lite) and `r_kv` (`kv_lora_rank`), with a decoupled
RoPE key of `d_R` shared by the heads; `d_qk = d_nope + d_R` per query/key head, `d_v` per value
head (`mla_params`):

    down   h·r_q (W_DQ) + h·(r_kv + d_R) (W_DKV and W_KR)                replicated over tp
    up     r_q·a·d_qk (W_UQ, W_QR) + r_kv·a·(d_nope + d_v) (W_UK, W_UV)   split by heads
    out    a·d_v·h (W_O)
    norms  r_q + r_kv (the latents' RMSNorms, counted with the norms)

Multi-token prediction (MTP; DeepSeek-V3, arXiv:2412.19437 §2.2) modules are counted apart
(`ParamCount.mtp`, `mtp_params`): transformers' `DeepseekV3ForCausalLM` builds none, so
`total` and `active` are the main model's, as Hugging Face counts it.

FLOPs: a `(n×k)·(k×m)` matmul costs `2nkm`. A forward pass costs 2 FLOPs per active matmul
parameter per token plus attention per token per layer, `2·s·a·(d_qk + d_v)` (scores at the
query/key width, P·V at the value width: `4·s·a·d` = `4·s·h` for standard attention) when
every query sees every key; causal attention halves it. Training = forward + backward =
3× forward. MLA is counted as its projections run in training (no weight absorption).
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from shardwise.errors import ShardwiseError
from shardwise.files import read_json


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only Transformer, dense or mixture-of-experts."""

    name: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    vocab: int
    gated_mlp: bool = True
    tie_embeddings: bool = False
    norm: str = "rmsnorm"  # "rmsnorm" | "layernorm"
    bias: bool = False
    dropout: bool = False
    learned_positions: int = 0  # rows of a learned position table (GPT-2/3); 0 for RoPE
    max_seq: int = 4096
    # Mixture of experts (n_experts == 0: dense).
    n_experts: int = 0
    top_k: int = 0
    d_ff_expert: int = 0  # 0: same as d_ff
    n_shared_experts: int = 0
    moe_every: int = 1  # every k-th layer is MoE (1: all layers)
    # What Hugging Face configs add (transformers' LlamaConfig / Qwen2Config field names in
    # the comments): RMSNorm ε (rms_norm_eps), RoPE base θ (rope_theta), RoPE scaling as sorted
    # (key, value) pairs, e.g. (("factor", 8.0), ..., ("rope_type", "llama3")) (rope_scaling /
    # rope_parameters), an explicit head width (head_dim; 0: d_model / n_heads), biases on
    # Q, K, V (Qwen2, attention_bias) and on O (Llama's attention_bias).
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] = ()
    d_head: int = 0
    qkv_bias: bool = False
    out_bias: bool = False
    # Multi-head latent attention (kv_lora_rank > 0; DeepseekV3Config's names: q_lora_rank, 0 for
    # a plain q projection; kv_lora_rank; qk_nope_head_dim; qk_rope_head_dim; v_head_dim;
    # rope_interleave: RoPE on interleaved pairs, as DeepSeek's checkpoints lay them out).
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    # DeepSeekMoE (Dai et al. 2024; DeepSeek-V3 §2.1.2): the first layers dense
    # (first_k_dense_replace); the router's scores (`router_score`: "softmax", or "sigmoid"
    # with DeepSeek-V3's per-expert bias `e_score_correction_bias` added for the choice only —
    # a buffer in transformers, not a parameter), top-k gates renormalised (norm_topk_prob) and
    # scaled (routed_scaling_factor), the choice limited to `topk_groups` of `expert_groups`
    # groups of experts (topk_group, n_group).
    first_dense_layers: int = 0
    router_score: str = "softmax"
    norm_topk: bool = True
    routed_scaling: float = 1.0
    expert_groups: int = 1
    topk_groups: int = 1
    # Multi-token prediction modules (num_nextn_predict_layers), counted apart (`mtp_params`).
    mtp_layers: int = 0
    # Sliding-window attention (Mistral's sliding_window): a query sees the last `w` keys;
    # 0: all. Not implemented beyond the window: a sequence longer than it is refused
    # (`seq_problems`), since up to it the window changes nothing.
    sliding_window: int = 0
    # Position and residual variants no framework export reproduces unless named: ALiBi
    # attention biases instead of rotary or learned positions (BLOOM; no parameters), RoPE on
    # the first `rotary_percent` of each head's dimensions (GPT-NeoX's rotary_pct), attention
    # and MLP on the same normalised input, summed (GPT-J / GPT-NeoX use_parallel_residual).
    # None changes a parameter or FLOP count.
    alibi: bool = False
    rotary_percent: float = 1.0
    parallel_residual: bool = False

    def __post_init__(self) -> None:
        self.validate()  # an invalid ModelSpec does not exist (negative layers, "32", …)

    # ----------------------------------------------------------------------------- derived
    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2/V3)."""
        return self.kv_lora_rank > 0

    @property
    def head_dim(self) -> int:
        """Width d of one query/key head: `d_head` when the config names it, else `h / a`;
        MLA: `d_nope + d_R`."""
        if self.is_mla:
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.d_head or self.d_model // self.n_heads

    @property
    def value_head_dim(self) -> int:
        """Width of one value head: `d` (MLA: `d_v`)."""
        return self.v_head_dim if self.is_mla else self.head_dim

    @property
    def rope_dim(self) -> int:
        """Width RoPE rotates per head: `d` (MLA: the decoupled `d_R`; GPT-NeoX: the
        `rotary_percent` share of `d`, as Megatron's `--rotary-percent` truncates it)."""
        return self.qk_rope_head_dim if self.is_mla else int(self.head_dim * self.rotary_percent)

    @property
    def q_dim(self) -> int:
        """Width of Q: `a · d` (= h unless `d_head` says otherwise)."""
        return self.n_heads * self.head_dim

    @property
    def o_dim(self) -> int:
        """Width of the attention output (O's input): `a · d_v` (= `q_dim` but for MLA)."""
        return self.n_heads * self.value_head_dim

    @property
    def kv_dim(self) -> int:
        """Width of K: `a_kv · d`."""
        return self.n_kv_heads * self.head_dim

    @property
    def v_dim(self) -> int:
        """Width of V: `a_kv · d_v` (= `kv_dim` but for MLA)."""
        return self.n_kv_heads * self.value_head_dim

    @property
    def rope_type(self) -> str:
        """"default", or the RoPE scaling's type ("llama3", "yarn", …; the runtime runs llama3)."""
        return str(dict(self.rope_scaling).get("rope_type", "default"))

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def expert_d_ff(self) -> int:
        return self.d_ff_expert or self.d_ff

    @property
    def n_moe_layers(self) -> int:
        """`L//q - F//q`: layers `i ≥ F` with `i % q == q - 1` (`is_moe_layer`)."""
        if not self.is_moe:
            return 0
        return self.n_layers // self.moe_every - self.first_dense_layers // self.moe_every

    def is_moe_layer(self, index: int) -> bool:
        """Every `moe_every`-th layer is MoE, the last of each group, except the first
        `first_dense_layers` (F)."""
        return (self.is_moe and index >= self.first_dense_layers
                and index % self.moe_every == self.moe_every - 1)

    @property
    def n_dense_layers(self) -> int:
        return self.n_layers - self.n_moe_layers

    def validate(self) -> ModelSpec:
        """Every field of the right type and in range (sizes capped, `validate.MAX_*`), and
        the shapes consistent; one `ShardwiseError` listing the problems."""
        import shardwise.validate as v

        problems = []
        caps = {"n_layers": v.MAX_LAYERS, "d_model": v.MAX_WIDTH, "n_heads": v.MAX_WIDTH,
                "n_kv_heads": v.MAX_WIDTH, "d_ff": v.MAX_WIDTH, "vocab": v.MAX_VOCAB}
        zero_ok = {"learned_positions": v.MAX_VOCAB, "n_experts": v.MAX_WIDTH,
                   "top_k": v.MAX_WIDTH, "d_ff_expert": v.MAX_WIDTH,
                   "n_shared_experts": v.MAX_WIDTH, "d_head": v.MAX_WIDTH,
                   "sliding_window": v.MAX_VOCAB, "q_lora_rank": v.MAX_WIDTH,
                   "kv_lora_rank": v.MAX_WIDTH, "qk_nope_head_dim": v.MAX_WIDTH,
                   "qk_rope_head_dim": v.MAX_WIDTH, "v_head_dim": v.MAX_WIDTH,
                   "first_dense_layers": v.MAX_LAYERS, "mtp_layers": v.MAX_LAYERS,
                   "topk_groups": v.MAX_WIDTH}
        checks: list[tuple[str, Callable[..., Any], dict[str, Any]]] = [
            (f, v.integer, {"low": 1, "high": high}) for f, high in caps.items()]
        checks += [(f, v.integer, {"low": 0, "high": high}) for f, high in zero_ok.items()]
        checks += [("max_seq", v.integer, {"low": 1, "high": v.MAX_VOCAB}),
                   ("moe_every", v.integer, {"low": 1, "high": v.MAX_LAYERS}),
                   ("expert_groups", v.integer, {"low": 1, "high": v.MAX_WIDTH}),
                   ("routed_scaling", v.finite, {"low": 0, "low_open": True}),
                   ("norm_eps", v.finite, {"low": 0, "low_open": True}),
                   ("rope_theta", v.finite, {"low": 0, "low_open": True}),
                   ("rotary_percent", v.finite, {"low": 0, "low_open": True, "high": 1})]
        for field, check, bounds in checks:
            try:
                check(getattr(self, field), field, **bounds)
            except ShardwiseError as exc:
                problems.append(str(exc))
        flags = ("gated_mlp", "tie_embeddings", "bias", "dropout", "qkv_bias", "out_bias",
                 "rope_interleave", "norm_topk", "alibi", "parallel_residual")
        problems += [f"{f} must be true or false, got {getattr(self, f)!r}" for f in flags
                     if not isinstance(getattr(self, f), bool)]
        if not isinstance(self.name, str):
            problems.append(f"name must be a string, got {self.name!r}")
        if not problems:
            if not self.d_head and self.d_model % self.n_heads:
                problems.append(f"n_heads={self.n_heads} does not divide d_model={self.d_model}")
            if self.n_heads % self.n_kv_heads:
                problems.append(
                    f"n_kv_heads={self.n_kv_heads} does not divide n_heads={self.n_heads}"
                )
            if self.is_moe and not 1 <= self.top_k <= self.n_experts:
                problems.append(f"top_k={self.top_k} must be in 1..n_experts={self.n_experts}")
            if self.rope_dim % 2:
                problems.append(f"RoPE needs an even head width, got {self.rope_dim}")
            if self.alibi and (self.learned_positions or self.rotary_percent != 1.0):
                problems.append("ALiBi takes no learned positions and no rotary_percent")
            problems += self._mla_problems() + self._moe_problems()
        if self.norm not in ("rmsnorm", "layernorm"):
            problems.append(f"norm must be 'rmsnorm' or 'layernorm', got {self.norm!r}")
        if problems:
            raise ShardwiseError(f"model {self.name}: " + "; ".join(problems))
        return self

    def _mla_problems(self) -> list[str]:
        ranks = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                 "v_head_dim")
        if any(getattr(self, f) < 0 for f in ranks):
            return [f"{', '.join(ranks)} must be ≥ 0"]
        if not self.is_mla:
            extra = [f for f in ranks if getattr(self, f)]
            return [f"{', '.join(extra)} need kv_lora_rank > 0 (multi-head latent attention)"
                    ] if extra else []
        out = []
        if min(self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim) < 1:
            out.append("multi-head latent attention needs qk_nope_head_dim, qk_rope_head_dim "
                       "and v_head_dim ≥ 1")
        if self.n_kv_heads != self.n_heads:
            out.append(f"multi-head latent attention has n_kv_heads = n_heads={self.n_heads}, "
                       f"got {self.n_kv_heads}")
        if self.bias or self.qkv_bias or self.out_bias or self.d_head:
            out.append("multi-head latent attention takes no biases and no d_head "
                       "(its head widths are qk_nope_head_dim + qk_rope_head_dim, v_head_dim)")
        return out

    def _moe_problems(self) -> list[str]:
        out = []
        if not 0 <= self.first_dense_layers <= self.n_layers:
            out.append(f"first_dense_layers must be in 0..n_layers={self.n_layers}, got "
                       f"{self.first_dense_layers}")
        if self.router_score not in ("softmax", "sigmoid"):
            out.append(f"router_score must be 'softmax' or 'sigmoid', got {self.router_score!r}")
        if not self.routed_scaling > 0:
            out.append(f"routed_scaling must be > 0, got {self.routed_scaling}")
        if self.mtp_layers < 0:
            out.append(f"mtp_layers must be ≥ 0, got {self.mtp_layers}")
        g, k = self.expert_groups, self.topk_groups
        if g < 1 or not 1 <= k <= g:
            out.append(f"expert groups: need 1 ≤ topk_groups={k} ≤ expert_groups={g}")
        elif self.is_moe and (self.n_experts % g or self.top_k > k * self.n_experts // g):
            out.append(f"expert_groups={g} must divide n_experts={self.n_experts} and "
                       f"topk_groups={k} of them hold ≥ top_k={self.top_k} experts")
        elif self.is_moe and g > 1 and self.router_score == "sigmoid" and self.n_experts < 2 * g:
            out.append(f"sigmoid routing scores a group by its two best experts: "
                       f"expert_groups={g} needs ≥ 2 experts each")
        return out
    def seq_problems(self, seq_len: int) -> list[str]:
        """What this model cannot do at sequence length `seq_len`: attend past its sliding
        window (not implemented; up to the window it is full causal attention)."""
        if self.sliding_window and seq_len > self.sliding_window:
            return [f"sequence length {seq_len} exceeds {self.name}'s sliding_window "
                    f"{self.sliding_window}: sliding-window attention is not implemented "
                    f"(full causal attention equals it only up to the window); use a sequence "
                    f"length ≤ {self.sliding_window}"]
        return []

    def with_(self, **changes: object) -> ModelSpec:
        """A copy with some fields changed, validated."""
        return replace(self, **changes)  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    # ------------------------------------------------------------------------ param counts
    def attention_params(self) -> int:
        """Attention weights (and biases) of one layer; MLA: `sum(mla_params())` (its latent
        norms are counted with the norms, `latent_norm_params`)."""
        if self.is_mla:
            return sum(self.mla_params())
        h, q = self.d_model, self.q_dim
        weights = 2 * h * q + 2 * h * self.kv_dim  # Q and O: h·a·d each; K, V: h·a_kv·d each
        qkv = self.bias or self.qkv_bias
        biases = (q + 2 * self.kv_dim) * qkv + h * (self.bias or self.out_bias)
        return weights + biases

    def mlp_params(self, d_ff: int | None = None) -> int:
        h, f = self.d_model, d_ff or self.d_ff
        n_in = 2 if self.gated_mlp else 1
        weights = (n_in + 1) * h * f
        biases = (n_in * f + h) if self.bias else 0
        return weights + biases

    def mla_params(self) -> tuple[int, int]:
        """MLA weights of one layer: (replicated over tp: the down-projections `h·r_q` and
        `h·(r_kv + d_R)`; split by heads: the up-projections `r_q·a·d_qk` — `h·a·d_qk` without
        a q latent — and `r_kv·a·(d_nope + d_v)`, and the output `a·d_v·h`). Megatron-Core's
        MLASelfAttention keeps the down-projections duplicated on every tp rank
        (`linear_q_down_proj`/`linear_kv_down_proj`, parallel_mode "duplicated")."""
        if not self.is_mla:
            return 0, 0
        h, a = self.d_model, self.n_heads
        down = h * (self.q_lora_rank + self.kv_lora_rank + self.qk_rope_head_dim)
        up = ((self.q_lora_rank or h) * a * self.head_dim
              + self.kv_lora_rank * a * (self.qk_nope_head_dim + self.v_head_dim))
        return down, up + self.o_dim * h

    def latent_norm_params(self) -> int:
        """MLA's RMSNorms on the q and kv latents, `r_q + r_kv` per layer (0 otherwise)."""
        return self.q_lora_rank + self.kv_lora_rank if self.is_mla else 0

    def norm_params(self) -> int:
        """One norm: scale (and shift for LayerNorm)."""
        return self.d_model * (2 if self.norm == "layernorm" else 1)

    def router_params(self) -> int:
        return self.d_model * self.n_experts

    def moe_mlp_params(self, active: bool) -> int:
        """Experts of one MoE layer (all of them, or the `top_k` a token uses) + shared + router."""
        per_expert = self.mlp_params(self.expert_d_ff)
        routed = self.top_k if active else self.n_experts
        return (routed + self.n_shared_experts) * per_expert + self.router_params()

    def dense_layer_params(self) -> int:
        return (self.attention_params() + self.mlp_params() + 2 * self.norm_params()
                + self.latent_norm_params())

    def mtp_params(self) -> int:
        """Parameters of the `mtp_layers` multi-token-prediction modules (DeepSeek-V3 §2.2),
        not in `count_params`' total: per module the RMSNorms of its two inputs (`2h`), the
        projection M of their concatenation (`2h·h`), one Transformer layer (an MoE layer when
        the model is MoE) and its head's final norm (`h`); the embedding and the output head
        are the main model's (shared). DeepSeek-V3's checkpoint also stores a copy of both in
        its layer 61 (`2·V·h` more per module on disk)."""
        moe = self.is_moe and self.moe_every == 1
        mlp = self.moe_mlp_params(active=False) if moe else self.mlp_params()
        layer = (self.attention_params() + mlp + 2 * self.norm_params()
                 + self.latent_norm_params())
        h = self.d_model
        return self.mtp_layers * (layer + 2 * self.norm_params() + 2 * h * h
                                  + self.norm_params())

    def embedding_params(self) -> int:
        return self.vocab * self.d_model + self.learned_positions * self.d_model

    def head_params(self) -> int:
        return 0 if self.tie_embeddings else self.vocab * self.d_model

    def count_params(self) -> ParamCount:
        return count_params(self)

    @staticmethod
    def from_hf_config(path: str | Path) -> ModelSpec:
        """Read a Hugging Face `config.json` on disk (see `from_hf_config`)."""
        return from_hf_config(path)

    # ------------------------------------------------------------------------------- FLOPs
    def forward_flops_per_token(self, seq_len: int, causal: bool = False) -> float:
        """Forward FLOPs per token: `2·(active matmul params) + L·4·s·a·d` (× ½ when causal).

        Matmul parameters exclude the embedding lookup and the norms but include the output
        head (tied or not: the head matmul runs either way).
        """
        from shardwise.validate import MAX_SEQUENCES, integer

        integer(seq_len, "seq_len", low=1, high=MAX_SEQUENCES)
        counts = count_params(self)
        tied_head = self.vocab * self.d_model if self.tie_embeddings else 0
        matmul = counts.active - counts.embedding - counts.norms + tied_head
        return 2 * matmul + self._attention_flops(seq_len, causal)

    def _attention_flops(self, seq_len: int, causal: bool) -> float:
        """Scores and P·V per token, all layers: `L·2·s·a·(d_qk + d_v)` — `L·4·s·a·d` (a·d = h
        unless `d_head`) but for MLA, whose scores run at `d_nope + d_R` and P·V at `d_v`."""
        widths = self.q_dim + self.o_dim  # a·d_qk + a·d_v
        return self.n_layers * 2 * seq_len * widths * (0.5 if causal else 1.0)

    def training_flops_per_token(
        self, seq_len: int, causal: bool = False, recompute: str = "none"
    ) -> float:
        """FLOPs per token of one training step.

        Model FLOPs (MFU, `recompute="none"`): 3 × forward — backward costs two forwards.
        Hardware FLOPs (HFU): full recompute adds the forward of every layer once more (not the
        head), which is Narayanan et al. 2021's `96·B·s·l·h²·(1 + s/6h + V/16lh)` per
        iteration; selective recompute adds the attention score/PV forward once more; op-sac
        (torchtitan's per-op SAC) the matmuls it does not save (`op_sac_recomputed_flops`).
        """
        forward = self.forward_flops_per_token(seq_len, causal)
        attention = self._attention_flops(seq_len, causal)
        head = 2 * self.vocab * self.d_model  # the head is not recomputed
        extra = {"none": 0.0, "selective": attention, "full": forward - head,
                 "op-sac": self.op_sac_recomputed_flops()}
        if not isinstance(recompute, str) or recompute not in extra:
            raise ShardwiseError(
                f"recompute must be one of {', '.join(extra)}; got {recompute!r}")
        return 3 * forward + extra[recompute]

    def op_sac_recomputed_flops(self) -> float:
        """Forward FLOPs per token that torchtitan's per-op SAC recomputes: it saves every
        compute-intensive op's output except every second matmul of a block
        (torchtitan 0.3.0 distributed/activation_checkpoint.py, `SelectiveAC`), and a Llama
        block calls qkv (fused), wo, w1, w3, w2 (models/common: `FusedQKVLinear`,
        `FeedForward.forward = w2(silu(w1 x) · w3 x)`), so wo and w3 (w2 without a gate) run
        again — per token `2·(a·d·h + h·f)`, the routed and shared experts' in MoE layers."""
        out_proj = self.q_dim * self.d_model
        experts = (self.top_k + self.n_shared_experts) * self.d_model * self.expert_d_ff
        return 2.0 * (self.n_dense_layers * (out_proj + self.d_model * self.d_ff)
                      + self.n_moe_layers * (out_proj + experts))


@dataclass(frozen=True)
class ParamCount:
    """Parameters by component; `total` counts every expert, `active` those a token uses.
    `mtp`: the multi-token-prediction modules (`ModelSpec.mtp_params`), in neither."""

    attention: int
    mlp: int
    mlp_active: int
    norms: int
    embedding: int
    head: int
    mtp: int = 0

    @property
    def total(self) -> int:
        return self.attention + self.mlp + self.norms + self.embedding + self.head

    @property
    def active(self) -> int:
        return self.attention + self.mlp_active + self.norms + self.embedding + self.head


def count_params(model: ModelSpec) -> ParamCount:
    """Parameters by component (SPEC §1)."""
    if not isinstance(model, ModelSpec):
        raise ShardwiseError(f"model must be a ModelSpec (shardwise.get_model), got {model!r}"
                             [:200])
    dense, moe = model.n_dense_layers, model.n_moe_layers
    return ParamCount(
        attention=model.n_layers * model.attention_params(),
        mlp=dense * model.mlp_params() + moe * model.moe_mlp_params(active=False),
        mlp_active=dense * model.mlp_params() + moe * model.moe_mlp_params(active=True),
        norms=((2 * model.n_layers + 1) * model.norm_params()
               + model.n_layers * model.latent_norm_params()),
        embedding=model.embedding_params(),
        head=model.head_params(),
        mtp=model.mtp_params(),
    )


# ------------------------------------------------------------------------------------ presets
def _gpt3(name: str, layers: int, hidden: int, heads: int) -> ModelSpec:
    """GPT-3 family, Brown et al. 2020 Table 2.1: f = 4h, V = 50257, learned positions 2048,
    tied embeddings, LayerNorm, GELU."""
    return ModelSpec(
        name, layers, hidden, heads, heads, 4 * hidden, 50257, gated_mlp=False,
        tie_embeddings=True, norm="layernorm", dropout=True, learned_positions=2048, max_seq=2048,
    )


def _llama(name: str, layers: int, hidden: int, heads: int, kv: int, ff: int, vocab: int,
           max_seq: int, n_experts: int = 0, top_k: int = 0, **extra: Any) -> ModelSpec:
    return ModelSpec(name, layers, hidden, heads, kv, ff, vocab, max_seq=max_seq,
                     n_experts=n_experts, top_k=top_k, **extra)


def _deepseek(name: str, layers: int, hidden: int, heads: int, ff: int, vocab: int,
              **extra: Any) -> ModelSpec:
    """DeepSeek-V2/V3 family: MLA (`kv_lora_rank` 512, `d_nope` 128, `d_R` 64, `d_v` 128),
    DeepSeekMoE, RMSNorm ε 1e-6, RoPE on interleaved pairs, untied embeddings."""
    return ModelSpec(name, layers, hidden, heads, heads, ff, vocab, norm_eps=1e-6,
                     kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                     v_head_dim=128, rope_interleave=True, **extra)


# YaRN context extension of the DeepSeek checkpoints' config.json ("rope_scaling"):
# deepseek-ai/DeepSeek-V3 (mscale 1.0) and DeepSeek-V2-Lite (mscale 0.707); both pre-trained at
# 4K tokens, extended to 128K / 32K (DeepSeek-V3 §4.3, DeepSeek-V2 §3.1.3).
def _deepseek_yarn(mscale: float) -> tuple[tuple[str, Any], ...]:
    return (("beta_fast", 32), ("beta_slow", 1), ("factor", 40), ("mscale", mscale),
            ("mscale_all_dim", mscale), ("original_max_position_embeddings", 4096),
            ("rope_type", "yarn"))


# Llama 3.1's RoPE scaling (meta-llama/Llama-3.1-405B config.json, "rope_scaling").
_LLAMA31_ROPE = (("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                 ("original_max_position_embeddings", 8192), ("rope_type", "llama3"))


PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        _gpt3("gpt3-125m", 12, 768, 12),
        _gpt3("gpt3-350m", 24, 1024, 16),
        _gpt3("gpt3-1.3b", 24, 2048, 16),
        _gpt3("gpt3-2.7b", 32, 2560, 32),
        _gpt3("gpt3-6.7b", 32, 4096, 32),
        # Brown et al. 2020 print d_model = 5140 for 13B, a typo: 40 heads × d_head 128 = 5120
        # (the paper lists d_head = 128; 5140 is not divisible by 40).
        _gpt3("gpt3-13b", 40, 5120, 40),
        _gpt3("gpt3-175b", 96, 12288, 96),
        # Touvron et al. 2023 (Llama 2), Table 1 / model cards.
        _llama("llama2-7b", 32, 4096, 32, 32, 11008, 32000, 4096),
        _llama("llama2-13b", 40, 5120, 40, 40, 13824, 32000, 4096),
        _llama("llama2-70b", 80, 8192, 64, 8, 28672, 32000, 4096),
        # Llama 3 herd paper (Dubey et al. 2024), Table 3.
        # rope_theta 500000, rms_norm_eps 1e-5 (meta-llama/Meta-Llama-3-8B config.json);
        # the 405B exists only as Llama 3.1, with its "llama3" RoPE scaling.
        _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192, rope_theta=5e5),
        _llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192, rope_theta=5e5),
        _llama("llama3-405b", 126, 16384, 128, 8, 53248, 128256, 8192, rope_theta=5e5,
               rope_scaling=_LLAMA31_ROPE),
        # Nemotron-4 340B (NVIDIA 2024, arXiv:2406.11704, Table 1; NeMo's nemotron4_340b
        # config): LayerNorm, squared-ReLU MLP (not gated, 4.0·h wide), RoPE, no biases, GQA with
        # 8 KV groups, untied embeddings, 256k vocabulary, s = 4096.
        ModelSpec("nemotron4-340b", 96, 18432, 96, 8, 73728, 256000, gated_mlp=False,
                  norm="layernorm", max_seq=4096),
        # Mistral / Mixtral config.json on the Hugging Face hub: Mistral-7B-v0.1 rope_theta
        # 10000, rms_norm_eps 1e-5; Mixtral-8x7B-v0.1 and 8x22B-v0.1 rope_theta 1e6, eps 1e-5.
        _llama("mistral-7b", 32, 4096, 32, 8, 14336, 32000, 32768),
        _llama("mixtral-8x7b", 32, 4096, 32, 8, 14336, 32000, 32768, n_experts=8, top_k=2,
               rope_theta=1e6),
        _llama("mixtral-8x22b", 56, 6144, 48, 8, 16384, 32768, 65536, n_experts=8, top_k=2,
               rope_theta=1e6),
        # Qwen2.5 config.json (untied embeddings for 7B and 72B): rope_theta 1e6,
        # rms_norm_eps 1e-6, Q/K/V biases (Qwen2Attention: bias=True on q/k/v_proj).
        _llama("qwen2.5-7b", 28, 3584, 28, 4, 18944, 152064, 32768, rope_theta=1e6,
               norm_eps=1e-6, qkv_bias=True),
        _llama("qwen2.5-72b", 80, 8192, 64, 8, 29568, 152064, 32768, rope_theta=1e6,
               norm_eps=1e-6, qkv_bias=True),
        # DeepSeek-V3 (arXiv:2412.19437 §4.2; deepseek-ai/DeepSeek-V3 config.json, whose sizes
        # are transformers 5.24's DeepseekV3Config defaults): 61 layers, the first 3 dense
        # (f 18432), then 1 shared + 256 routed experts (f 2048), 8 routed per token from 4 of
        # 8 groups, sigmoid scores, gates renormalised × 2.5; q latent 1536; one MTP module.
        _deepseek("deepseek-v3", 61, 7168, 128, 18432, 129280, max_seq=163840,
                  rope_scaling=_deepseek_yarn(1.0), q_lora_rank=1536, n_experts=256,
                  top_k=8, d_ff_expert=2048, n_shared_experts=1, first_dense_layers=3,
                  router_score="sigmoid", routed_scaling=2.5, expert_groups=8, topk_groups=4,
                  mtp_layers=1),
        # DeepSeek-V2-Lite (arXiv:2405.04434 Appendix B; deepseek-ai/DeepSeek-V2-Lite
        # config.json): no q latent, the first layer dense (f 10944), 2 shared + 64 routed
        # experts (f 1408), 6 per token, softmax scores, gates not renormalised.
        _deepseek("deepseek-v2-lite", 27, 2048, 16, 10944, 102400, max_seq=163840,
                  rope_scaling=_deepseek_yarn(0.707), n_experts=64, top_k=6, d_ff_expert=1408,
                  n_shared_experts=2, first_dense_layers=1, norm_topk=False),
        # Small models for the executable runtime.
        _llama("tiny", 4, 64, 4, 2, 128, 256, 64),
        _llama("tiny-moe", 4, 64, 4, 2, 128, 256, 64, n_experts=4, top_k=2),
        # DeepSeek-V3's structure, small: MLA with a q latent and V narrower than Q/K, one
        # dense layer, a shared expert, sigmoid routing in groups with gates scaled.
        ModelSpec("tiny-deepseek", 3, 64, 4, 4, 128, 256, max_seq=64, norm_eps=1e-6,
                  q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                  v_head_dim=16, rope_interleave=True, n_experts=8, top_k=2, d_ff_expert=32,
                  n_shared_experts=1, first_dense_layers=1, router_score="sigmoid",
                  routed_scaling=2.5, expert_groups=2, topk_groups=1),
    )
}

DEFAULT_MODEL = "llama3-8b"


def get_model(name_or_path: str) -> ModelSpec:
    """A preset by name (case-insensitive) or a Hugging Face `config.json` on disk."""
    if not isinstance(name_or_path, str | Path):
        raise ShardwiseError(f"model must be a preset name or a config.json path, got "
                             f"{name_or_path!r} (see `shardwise models`)")
    key = str(name_or_path).lower()
    if key in PRESETS:
        return PRESETS[key]
    path = Path(name_or_path)
    if path.suffix == ".json" or path.is_dir() or path.exists():
        return ModelSpec.from_hf_config(path)
    close = difflib.get_close_matches(key, list(PRESETS), n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise ShardwiseError(
        f"unknown model {name_or_path!r}{hint} (see `shardwise models`, or pass a config.json)"
    )


# --------------------------------------------------------------------- Hugging Face configs
SUPPORTED_HF_TYPES = ("llama", "mistral", "mixtral", "qwen2", "gpt2", "gpt_neox", "bloom",
                      "deepseek_v2", "deepseek_v3")


@dataclass(frozen=True)
class HFFields:
    """What shardwise does with each `config.json` field of one model_type: `read` fields
    shape the `ModelSpec`; `fixed` ones must hold the one value shardwise implements (field →
    (the values, what another value would change)); `ignored` ones are known not to change
    what is trained or counted (field → why). Any other field is refused, naming it."""

    read: frozenset[str]
    fixed: dict[str, tuple[tuple[Any, ...], str]]
    ignored: dict[str, str]

    def check(self, cfg: dict[str, Any], where: str) -> None:
        kind = cfg.get("model_type")
        for key, value in cfg.items():
            if key in self.read or key in self.ignored or key in _HF_IGNORED:
                continue
            if key not in self.fixed:
                raise ShardwiseError(
                    f"config file {where!r}: field {key!r} is not one shardwise knows for "
                    f"model_type {kind!r} (it may change the model); remove it if it does "
                    "not (the fields known: shardwise.arch.HF_FIELDS)")
            values, why = self.fixed[key]
            if not any(_same_json(value, v) for v in values):
                shown = " or ".join(json.dumps(v) for v in values)
                raise ShardwiseError(f"config file {where!r}: {key}={json.dumps(value)} is not "
                                     f"supported ({why}); shardwise implements {key}={shown}")


def _same_json(value: Any, want: Any) -> bool:
    """Equal as JSON values: 0 and 0.0 alike, but false is not 0 and null only null."""
    return ((value is None) == (want is None) and isinstance(value, bool) == isinstance(
        want, bool) and value == want)


# Ignored in every model_type (transformers' PretrainedConfig bookkeeping).
_WHY_BOOKKEEPING = "names, labels and the saved dtype: bookkeeping (the run's --dtype decides)"
_WHY_TOKENS = "token ids: the tokenizer's business"
_WHY_OUTPUTS = "inference and output switches"
_HF_IGNORED: dict[str, str] = {
    **dict.fromkeys(("_name_or_path", "architectures", "auto_map", "transformers_version",
                     "torch_dtype", "dtype", "id2label", "label2id", "num_labels",
                     "problem_type", "finetuning_task", "task_specific_params",
                     "tokenizer_class", "prefix"), _WHY_BOOKKEEPING),
    **dict.fromkeys(("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id",
                     "sep_token_id", "decoder_start_token_id"), _WHY_TOKENS),
    **dict.fromkeys(("use_cache", "output_attentions", "output_hidden_states", "return_dict",
                     "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder",
                     "torchscript"), _WHY_OUTPUTS),
    "initializer_range": "initialisation only: a run starts from the checkpoint's weights or "
                         "from the runtime's own (std 0.02)",
}
_LLAMA_READ = frozenset((
    "model_type", "num_hidden_layers", "hidden_size", "num_attention_heads",
    "num_key_value_heads", "intermediate_size", "vocab_size", "max_position_embeddings",
    "tie_word_embeddings", "rms_norm_eps", "head_dim", "rope_theta", "rope_scaling",
    "rope_parameters", "attention_dropout"))
_SILU = {"hidden_act": (("silu", "swish"), "the runtime's MLP is SwiGLU")}
_SAME_COUNTS = "the parameter and FLOP counts are the same (the runtime trains Llama-style only)"
_FUSION = "a fusion or numerics switch of Megatron-DeepSpeed: the same parameters and FLOPs"
_DEEPSEEK_READ = frozenset((
    "model_type", "num_hidden_layers", "hidden_size", "num_attention_heads",
    "num_key_value_heads", "intermediate_size", "moe_intermediate_size", "vocab_size",
    "max_position_embeddings", "tie_word_embeddings", "rms_norm_eps", "rope_theta",
    "rope_scaling", "rope_parameters", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
    "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "n_shared_experts",
    "num_experts_per_tok", "first_k_dense_replace", "routed_scaling_factor",
    "attention_bias", "mlp_bias"))
_DEEPSEEK_FIXED = _SILU | {
    "moe_layer_freq": ((1,), "transformers makes every layer from first_k_dense_replace on "
                             "MoE (it does not read moe_layer_freq)"),
    "attention_dropout": ((0.0,), "attention dropout is not implemented with MLA")}
_DEEPSEEK_IGNORED = {
    "head_dim": "derived by transformers (qk_rope_head_dim)",
    "qk_head_dim": "derived by transformers (qk_nope_head_dim + qk_rope_head_dim)",
    "pretraining_tp": "transformers 5.24's DeepSeek models do not read it",
    "ep_size": "DeepSeek's own code's expert-parallel degree: a layout choice (--layout ep=…)",
    "quantization_config": "how the released weights are stored (FP8 blocks); the run's "
                           "--dtype and --fp8 decide how it trains",
    **dict.fromkeys(("aux_loss_alpha", "seq_aux", "output_router_logits"),
                    "the load-balancing loss weight is the run's --aux-loss-coef")}
HF_FIELDS: dict[str, HFFields] = {
    "llama": HFFields(
        _LLAMA_READ | {"attention_bias"},
        _SILU | {"mlp_bias": ((False,), "MLP biases are not implemented")},
        {"pretraining_tp": "transformers 5.24's LlamaModel does not read it"}),
    "mistral": HFFields(_LLAMA_READ | {"sliding_window"}, _SILU, {}),
    "mixtral": HFFields(
        _LLAMA_READ | {"sliding_window", "num_local_experts", "num_experts_per_tok"},
        _SILU | {"router_jitter_noise": ((0.0,), "router jitter is not implemented")},
        dict.fromkeys(("router_aux_loss_coef", "output_router_logits"),
                      "the load-balancing loss weight is the run's --aux-loss-coef")),
    "qwen2": HFFields(
        _LLAMA_READ | {"sliding_window", "use_sliding_window", "max_window_layers",
                       "layer_types"}, _SILU, {}),
    "gpt2": HFFields(
        frozenset(("model_type", "n_layer", "n_embd", "n_head", "n_inner", "vocab_size",
                   "n_positions", "resid_pdrop", "attn_pdrop", "embd_pdrop",
                   "tie_word_embeddings", "layer_norm_epsilon")),
        {"scale_attn_weights": ((True,), "attention scores are scaled by 1/√d"),
         "scale_attn_by_inverse_layer_idx": ((False,), "attention is not scaled by layer"),
         "add_cross_attention": ((False,), "the model is decoder-only")},
        {"activation_function": _SAME_COUNTS,
         "n_ctx": "an old name of n_positions that transformers no longer reads",
         "reorder_and_upcast_attn": "numerics of the attention product only",
         **dict.fromkeys(("summary_type", "summary_use_proj", "summary_activation",
                          "summary_proj_to_labels", "summary_first_dropout"),
                         "the sequence-classification head, not the language model")}),
    "gpt_neox": HFFields(
        frozenset(("model_type", "num_hidden_layers", "hidden_size", "num_attention_heads",
                   "intermediate_size", "vocab_size", "max_position_embeddings",
                   "tie_word_embeddings", "layer_norm_eps", "hidden_dropout",
                   "attention_dropout", "rope_theta", "rotary_emb_base", "rope_scaling",
                   "rope_parameters", "rotary_pct", "use_parallel_residual")),
        {"attention_bias": ((True,), "GPT-NeoX's MLP keeps its biases; biases on the MLP "
                                     "alone are not modelled")},
        {"hidden_act": _SAME_COUNTS, "classifier_dropout": "the classification head",
         "partial_rotary_factor": "transformers 5.24's GPTNeoXConfig does not read it at the "
                                  "top level (rotary_pct or rope_parameters)"}),
    "bloom": HFFields(
        frozenset(("model_type", "hidden_size", "n_embed", "n_layer", "num_hidden_layers",
                   "n_head", "num_attention_heads", "vocab_size", "seq_length",
                   "tie_word_embeddings", "hidden_dropout", "attention_dropout",
                   "layer_norm_epsilon")),
        {},
        {"n_inner": "transformers' BloomConfig does not read it (BLOOM's MLP is 4h)",
         "apply_residual_connection_post_layernorm": "the same parameters and FLOPs",
         **dict.fromkeys(("attention_softmax_in_fp32", "masked_softmax_fusion",
                          "bias_dropout_fusion", "skip_bias_add", "skip_bias_add_qkv",
                          "offset_alibi", "slow_but_exact", "pretraining_tp"), _FUSION)}),
    "deepseek_v3": HFFields(
        _DEEPSEEK_READ | {"norm_topk_prob", "n_group", "topk_group", "rope_interleave",
                          "num_nextn_predict_layers"},
        _DEEPSEEK_FIXED | {
            "scoring_func": (("sigmoid",), "DeepSeek-V3 scores experts with a sigmoid"),
            "topk_method": (("noaux_tc",), "DeepSeek-V3 picks experts by the biased scores "
                                           "within the best groups")},
        _DEEPSEEK_IGNORED),
    "deepseek_v2": HFFields(
        _DEEPSEEK_READ | {"topk_method", "n_group", "topk_group"},
        _DEEPSEEK_FIXED | {
            "scoring_func": (("softmax",), "DeepSeek-V2 scores experts with a softmax"),
            "topk_method": (("greedy", "group_limited_greedy"), "DeepSeek-V2's routers")},
        _DEEPSEEK_IGNORED | {"norm_topk_prob": "DeepseekV2TopkRouter does not read it (the "
                                               "gates are never renormalised)"}),
}
_LLAMA_LIKE = ("llama", "mistral", "mixtral", "qwen2")


def _window(cfg: dict, kind: str) -> int:
    """The sliding-window width the config's attention uses in some layer (0: none):
    Mistral's and Mixtral's `sliding_window`; Qwen2's when `use_sliding_window` gives layers
    from `max_window_layers` on, or `layer_types` names "sliding_attention" (transformers
    5.24's Qwen2Config)."""
    width = cfg.get("sliding_window") or 0
    if kind == "qwen2":
        layers = cfg.get("layer_types") or []
        windowed = "sliding_attention" in layers or (
            not layers and cfg.get("use_sliding_window", False)
            and cfg.get("max_window_layers", 28) < cfg["num_hidden_layers"])
        return width if windowed else 0
    return width


def _from_hf_dict(cfg: dict, name: str) -> ModelSpec:
    kind = cfg.get("model_type")
    if kind in ("deepseek_v2", "deepseek_v3"):
        return _from_deepseek(cfg, name, kind)
    if kind in _LLAMA_LIKE:
        heads = cfg["num_attention_heads"]
        moe = {}
        if kind == "mixtral":
            moe = {"n_experts": cfg["num_local_experts"], "top_k": cfg["num_experts_per_tok"]}
        attention_bias = cfg.get("attention_bias", False)
        return ModelSpec(
            name=name,
            n_layers=cfg["num_hidden_layers"],
            d_model=cfg["hidden_size"],
            n_heads=heads,
            n_kv_heads=cfg.get("num_key_value_heads") or heads,
            d_ff=cfg["intermediate_size"],
            vocab=cfg["vocab_size"],
            tie_embeddings=cfg.get("tie_word_embeddings", False),
            max_seq=cfg.get("max_position_embeddings", 4096),
            # transformers 5.24 defaults: rms_norm_eps 1e-6 (LlamaConfig, MistralConfig,
            # Qwen2Config) and 1e-5 (MixtralConfig); head_dim None → h/a
            norm_eps=float(cfg.get("rms_norm_eps", 1e-5 if kind == "mixtral" else 1e-6)),
            d_head=int(cfg.get("head_dim") or 0),
            qkv_bias=kind == "qwen2" or attention_bias,
            out_bias=attention_bias,
            dropout=cfg.get("attention_dropout", 0.0) > 0,
            sliding_window=_window(cfg, kind),
            **_hf_rope(cfg, kind),
            **moe,
        )
    if kind == "gpt2":
        hidden = cfg["n_embd"]
        dropout = max(cfg.get(k, 0.1) for k in ("resid_pdrop", "attn_pdrop", "embd_pdrop"))
        return ModelSpec(
            name=name, n_layers=cfg["n_layer"], d_model=hidden, n_heads=cfg["n_head"],
            n_kv_heads=cfg["n_head"], d_ff=cfg.get("n_inner") or 4 * hidden,
            vocab=cfg["vocab_size"], gated_mlp=False, bias=True,
            tie_embeddings=cfg.get("tie_word_embeddings", True), norm="layernorm",
            norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)), dropout=dropout > 0,
            learned_positions=cfg["n_positions"], max_seq=cfg["n_positions"],
        )
    if kind == "gpt_neox":
        # GPT-NeoX (transformers 5.24's GPTNeoXConfig): LayerNorm, GELU MLP, biases on every
        # linear (attention_bias, default true, and the MLP's always), partial RoPE.
        # RoPE turns `partial_rotary_factor` of each head (rope_parameters), else rotary_pct,
        # default 0.25; attention and MLP in parallel (use_parallel_residual, default true).
        heads = cfg["num_attention_heads"]
        dropout = max(cfg.get("hidden_dropout", 0.0), cfg.get("attention_dropout", 0.0))
        theta = cfg.get("rope_theta", cfg.get("rotary_emb_base"))
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        percent = rope.pop("partial_rotary_factor", cfg.get("rotary_pct", 0.25))
        if cfg.get("rope_parameters"):
            cfg = cfg | {"rope_parameters": rope}
        elif cfg.get("rope_scaling"):
            cfg = cfg | {"rope_scaling": rope}
        return ModelSpec(
            name=name, n_layers=cfg["num_hidden_layers"], d_model=cfg["hidden_size"],
            n_heads=heads, n_kv_heads=heads, d_ff=cfg["intermediate_size"],
            vocab=cfg["vocab_size"], gated_mlp=False,
            tie_embeddings=cfg.get("tie_word_embeddings", False), norm="layernorm",
            norm_eps=float(cfg.get("layer_norm_eps", 1e-5)), bias=True, dropout=dropout > 0,
            max_seq=cfg.get("max_position_embeddings", 2048), rotary_percent=float(percent),
            parallel_residual=cfg.get("use_parallel_residual", True),
            **_hf_rope(cfg | ({"rope_theta": theta} if theta is not None else {}), kind),
        )
    if kind == "bloom":
        # BLOOM (BigScience 2022): ALiBi (no rotary, no position table), LayerNorm, MHA, GELU
        # MLP of 4h, biases everywhere, tied embeddings. transformers' BloomConfig also reads
        # the older names n_embed / num_attention_heads. Not counted: the LayerNorm after the
        # embedding (2h parameters).
        hidden = cfg.get("hidden_size") or cfg["n_embed"]
        heads = cfg.get("n_head") or cfg["num_attention_heads"]
        return ModelSpec(
            name=name, n_layers=cfg.get("n_layer") or cfg["num_hidden_layers"], d_model=hidden,
            n_heads=heads, n_kv_heads=heads, d_ff=4 * hidden, vocab=cfg["vocab_size"],
            gated_mlp=False, tie_embeddings=cfg.get("tie_word_embeddings", True),
            norm="layernorm", norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)), bias=True,
            dropout=max(cfg.get("hidden_dropout", 0.0), cfg.get("attention_dropout", 0.0)) > 0,
            max_seq=cfg.get("seq_length", 2048), alibi=True,
        )
    raise ShardwiseError(
        f"unsupported model_type {kind!r} in config; supported: {', '.join(SUPPORTED_HF_TYPES)}"
    )


# transformers 5.24 DeepseekV3Config / DeepseekV2Config defaults for the fields read below
_DEEPSEEK_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v3": {
        "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
        "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5,
        "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
        "first_k_dense_replace": 3, "norm_topk_prob": True, "max_position_embeddings": 4096,
        "rope_interleave": True, "num_nextn_predict_layers": 1},
    "deepseek_v2": {
        "vocab_size": 102400, "hidden_size": 4096, "intermediate_size": 11008,
        "moe_intermediate_size": 1407, "num_hidden_layers": 32, "num_attention_heads": 32,
        "n_shared_experts": 2, "n_routed_experts": 64, "routed_scaling_factor": 1.0,
        "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "qk_nope_head_dim": 128, "first_k_dense_replace": 0, "max_position_embeddings": 2048,
        "topk_method": "greedy"},
}


def _from_deepseek(cfg: dict, name: str, kind: str) -> ModelSpec:
    """DeepSeek-V2/V3 as transformers 5.24 builds them (`DeepseekV3ForCausalLM`,
    `DeepseekV2ForCausalLM`): every layer from `first_k_dense_replace` on is MoE
    (`moe_layer_freq` is not read by either); V3 scores experts with a sigmoid (+ the
    correction bias) and picks top-k among the `topk_group` best of `n_group` groups
    (group score: the sum of its two best experts), gates renormalised when `norm_topk_prob`;
    V2 scores with a softmax, "greedy" or "group_limited_greedy" (group score: its best
    expert) and never renormalises (`DeepseekV2TopkRouter` ignores `norm_topk_prob`). Both
    scale the gates by `routed_scaling_factor`. Unset fields take transformers' defaults."""
    # a null field takes the default, but a null q_lora_rank means no q latent
    c = {**_DEEPSEEK_DEFAULTS[kind], **{k: v for k, v in cfg.items() if v is not None}}
    if "q_lora_rank" in cfg and cfg["q_lora_rank"] is None:
        c["q_lora_rank"] = 0
    heads = c["num_attention_heads"]
    if c.get("attention_bias") or c.get("mlp_bias"):
        raise ShardwiseError(f"config {name!r}: biases (attention_bias, mlp_bias) are not "
                             "supported with multi-head latent attention")
    kv_heads = c.get("num_key_value_heads") or heads
    if kv_heads != heads:
        raise ShardwiseError(f"config {name!r}: num_key_value_heads={kv_heads} ≠ "
                             f"num_attention_heads={heads}; MLA expands the latent to every head")
    v3 = kind == "deepseek_v3"
    grouped = v3 or c.get("topk_method") == "group_limited_greedy"
    return ModelSpec(
        name=name, n_layers=c["num_hidden_layers"], d_model=c["hidden_size"], n_heads=heads,
        n_kv_heads=heads, d_ff=c["intermediate_size"], vocab=c["vocab_size"],
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        max_seq=c["max_position_embeddings"], norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        q_lora_rank=c.get("q_lora_rank") or 0, kv_lora_rank=c["kv_lora_rank"],
        qk_nope_head_dim=c["qk_nope_head_dim"], qk_rope_head_dim=c["qk_rope_head_dim"],
        v_head_dim=c["v_head_dim"],
        # V2's rotary multiplies interleaved pairs as complex numbers: the same rotation
        rope_interleave=bool(c.get("rope_interleave", True)) if v3 else True,
        n_experts=c["n_routed_experts"], top_k=c["num_experts_per_tok"],
        d_ff_expert=c["moe_intermediate_size"], n_shared_experts=c["n_shared_experts"],
        first_dense_layers=c["first_k_dense_replace"],
        router_score="sigmoid" if v3 else "softmax",
        norm_topk=bool(c.get("norm_topk_prob")) if v3 else False,
        routed_scaling=float(c["routed_scaling_factor"]),
        expert_groups=(c.get("n_group") or 1) if grouped else 1,
        topk_groups=(c.get("topk_group") or 1) if grouped else 1,
        mtp_layers=c.get("num_nextn_predict_layers", 0) if v3 else 0,
        **_hf_rope(cfg, kind),
    )


def _hf_rope(cfg: dict, kind: str) -> dict[str, Any]:
    """RoPE θ and scaling from `rope_parameters` (transformers ≥ 5), or the older top-level
    `rope_theta` + `rope_scaling`. Default θ as transformers 5.24: 1e6 for Mixtral
    (MixtralConfig.default_theta), else 10000."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = params.pop("rope_theta", cfg.get("rope_theta"))
    theta = theta if theta is not None else (1e6 if kind == "mixtral" else 10000.0)
    kind_ = params.pop("rope_type", params.pop("type", "default"))
    scaling: tuple[tuple[str, Any], ...] = ()
    if kind_ != "default":
        params.setdefault("original_max_position_embeddings",
                          cfg.get("max_position_embeddings", 4096))
        scaling = tuple(sorted({**params, "rope_type": kind_}.items()))
    return {"rope_theta": float(theta), "rope_scaling": scaling}


def from_hf_config(path: str | Path) -> ModelSpec:
    """Read a Hugging Face `config.json` (a file, or a folder that holds one). No network."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    name = path.parent.name if path.name == "config.json" else path.stem
    return from_hf_dict(read_json(path, "config file"), name or "model", str(path))


def from_hf_dict(cfg: Any, name: str, where: str = "uploaded") -> ModelSpec:
    """A parsed Hugging Face `config.json` (e.g. an upload to the web app) → `ModelSpec`;
    `where` names its origin in error messages. Every field is read, fixed or ignored
    (`HF_FIELDS`); anything else, a value of the wrong type, a non-finite number or a nest
    deeper than any config is refused in one line."""
    from shardwise.files import check_json
    from shardwise.validate import hf_config

    if not isinstance(cfg, dict):
        raise ShardwiseError(f"config file {where!r} must hold a JSON object")
    if not isinstance(name, str):
        raise ShardwiseError(f"the model name must be a string, got {name!r}")
    check_json(cfg, f"config file {where!r}")
    kind = cfg.get("model_type")
    if kind not in HF_FIELDS:
        raise ShardwiseError(f"config file {where!r}: unsupported model_type {kind!r}; "
                             f"supported: {', '.join(SUPPORTED_HF_TYPES)}")
    hf_config(cfg, where)
    HF_FIELDS[kind].check(cfg, where)
    try:
        return _from_hf_dict(cfg, name)
    except ShardwiseError as exc:  # the model it describes is not a valid one
        raise ShardwiseError(f"config file {where!r}: {exc}") from None
    except KeyError as exc:
        raise ShardwiseError(
            f"config file {where!r} ({cfg.get('model_type')}) lacks the field {exc}"
        ) from None
    except (TypeError, ValueError) as exc:
        raise ShardwiseError(f"config file {where!r} has a field of the wrong type ({exc})"
                             ) from None
