"""`ModelSpec`: a decoder-only Transformer, dense or MoE, with its parameter counts and FLOPs
per token (SPEC §1).

The formulas (standard attention, MLA, MoE, MTP, attention FLOPs, MFU vs HFU) and their sources
are derived in docs/concepts/model.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

from shardwise.arch.counts import ParamCount
from shardwise.errors import ShardwiseError


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
    # 0: all (the runtime's attention core masks the band, `ops.attention.window_bias`).
    sliding_window: int = 0
    # Position and residual variants no framework export reproduces unless named: ALiBi
    # attention biases instead of rotary or learned positions (BLOOM; no parameters), RoPE on
    # the first `rotary_percent` of each head's dimensions (GPT-NeoX's rotary_pct), attention
    # and MLP on the same normalised input, summed (GPT-J / GPT-NeoX use_parallel_residual).
    # None changes a parameter or FLOP count.
    alibi: bool = False
    rotary_percent: float = 1.0
    parallel_residual: bool = False
    # Attention variants (docs/concepts/attention.md): each layer's kind (`layer_types`:
    # "full"; "sliding": the last `sliding_window` keys; "chunked": causal within blocks of
    # `attention_chunk` tokens — Llama 4; empty: every layer "sliding" when `sliding_window`,
    # else "full"), layers without RoPE (`nope_layers`), QK-norm on Q and K (`qk_norm`: "head"
    # RMSNorm over d — Qwen3, Gemma 3, GLM-4.5; "full" over a·d and a_kv·d — OLMo 2; "l2"
    # without parameters — Llama 4), one learned sink logit per head (gpt-oss), tanh caps on
    # the scores and the logits (Gemma 2; no parameters), RoPE θ of the sliding layers
    # (Gemma 3's rope_local_base_freq; 0: `rope_theta`).
    layer_types: tuple[str, ...] = ()
    attention_chunk: int = 0
    nope_layers: tuple[int, ...] = ()
    qk_norm: str = ""
    attention_sinks: bool = False
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    rope_local_theta: float = 0.0
    # Block variants: where the norms sit (`block_norms`: "pre"; "post" — OLMo 2 normalises
    # each sublayer's output instead of its input; "sandwich" — Gemma 2/3: both, four per
    # layer), the gated MLP's activation ("silu": SwiGLU; "gelu_tanh": GeGLU — Gemma;
    # "swiglu_clamp": gpt-oss's clamped SwiGLU), biases on the MLP alone (`mlp_bias`) and on
    # the router (gpt-oss), MoE layers kept dense (Qwen3-MoE's mlp_only_layers), and scalar
    # multipliers (Granite's, Gemma's √h embedding scale: sorted (name, value) pairs).
    block_norms: str = "pre"
    gated_act: str = "silu"
    mlp_bias: bool = False
    router_bias: bool = False
    mlp_only_layers: tuple[int, ...] = ()
    multipliers: tuple[tuple[str, float], ...] = ()

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
        """`L//q - F//q`: layers `i ≥ F` with `i % q == q - 1` (`is_moe_layer`), less the
        `mlp_only_layers` among them."""
        if not self.is_moe:
            return 0
        kept = sum(self._moe_slot(i) for i in set(self.mlp_only_layers) if 0 <= i < self.n_layers)
        return self.n_layers // self.moe_every - self.first_dense_layers // self.moe_every - kept

    def _moe_slot(self, index: int) -> bool:
        return index >= self.first_dense_layers and index % self.moe_every == self.moe_every - 1

    def is_moe_layer(self, index: int) -> bool:
        """Every `moe_every`-th layer is MoE, the last of each group, except the first
        `first_dense_layers` (F) and the `mlp_only_layers`."""
        return self.is_moe and self._moe_slot(index) and index not in self.mlp_only_layers

    def layer_kind(self, index: int) -> str:
        """Layer `index`'s attention: "full", "sliding" or "chunked" (`layer_types`)."""
        if self.layer_types:
            return self.layer_types[index]
        return "sliding" if self.sliding_window else "full"

    def attention_span(self, index: int) -> int:
        """Keys layer `index` may attend to at most: the window, the chunk, or 0 (all)."""
        kind = self.layer_kind(index)
        return {"full": 0, "sliding": self.sliding_window, "chunked": self.attention_chunk}[kind]

    def attention_keys(self, seq_len: Any, causal: bool = True) -> Any:
        """Keys per query averaged over the layers: `s` (causal `s/2`), less under windows and
        chunks (`arch.variants.attention_keys`)."""
        from shardwise.arch.variants import attention_keys

        return attention_keys(self, seq_len, causal)

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
                   "topk_groups": v.MAX_WIDTH, "attention_chunk": v.MAX_VOCAB}
        checks: list[tuple[str, Callable[..., Any], dict[str, Any]]] = [
            (f, v.integer, {"low": 1, "high": high}) for f, high in caps.items()]
        checks += [(f, v.integer, {"low": 0, "high": high}) for f, high in zero_ok.items()]
        checks += [("max_seq", v.integer, {"low": 1, "high": v.MAX_VOCAB}),
                   ("moe_every", v.integer, {"low": 1, "high": v.MAX_LAYERS}),
                   ("expert_groups", v.integer, {"low": 1, "high": v.MAX_WIDTH}),
                   ("routed_scaling", v.finite, {"low": 0, "low_open": True}),
                   ("norm_eps", v.finite, {"low": 0, "low_open": True}),
                   ("rope_theta", v.finite, {"low": 0, "low_open": True}),
                   ("rotary_percent", v.finite, {"low": 0, "low_open": True, "high": 1}),
                   ("attn_softcap", v.finite, {"low": 0}), ("final_softcap", v.finite, {"low": 0}),
                   ("rope_local_theta", v.finite, {"low": 0})]
        for field, check, bounds in checks:
            try:
                check(getattr(self, field), field, **bounds)
            except ShardwiseError as exc:
                problems.append(str(exc))
        flags = ("gated_mlp", "tie_embeddings", "bias", "dropout", "qkv_bias", "out_bias",
                 "rope_interleave", "norm_topk", "alibi", "parallel_residual",
                 "attention_sinks", "mlp_bias", "router_bias")
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
            problems += self._mla_problems() + self._moe_problems() + self._variant_problems()
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

    def _variant_problems(self) -> list[str]:
        from shardwise.arch.variants import variant_problems

        return variant_problems(self)

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
    def runtime_variants(self) -> list[str]:
        """The variants the training runtime does not implement (`arch.variants`)."""
        from shardwise.arch.variants import runtime_variants

        return runtime_variants(self)

    def seq_problems(self, seq_len: int) -> list[str]:
        """What the training runtime cannot run of this model at sequence length `seq_len`:
        the variants it does not implement (`runtime_lacks`), attention past a chunk (up to
        the chunk it is full causal attention). The analytic side models them."""
        from shardwise.arch.variants import runtime_lacks

        variants = runtime_lacks(self)
        if variants:
            return [f"{self.name} has {', '.join(variants)}, which the training runtime does not "
                    "implement (memory, plan and time model them)"]
        chunked = "chunked" in self.layer_types  # sliding windows run (runtime/model)
        if chunked and seq_len > self.attention_chunk:
            return [f"sequence length {seq_len} exceeds {self.name}'s attention_chunk "
                    f"{self.attention_chunk}: the training runtime attends over every earlier "
                    f"key (full causal attention equals chunked attention only up to the "
                    f"chunk); use a sequence length ≤ {self.attention_chunk} to train it"]
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
        return weights + biases + self.n_heads * self.attention_sinks  # a sink logit per head

    def mlp_params(self, d_ff: int | None = None) -> int:
        h, f = self.d_model, d_ff or self.d_ff
        n_in = 2 if self.gated_mlp else 1
        weights = (n_in + 1) * h * f
        biases = (n_in * f + h) if self.bias or self.mlp_bias else 0
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
        """The norms of one layer beyond its two block norms (replicated over tp): MLA's
        RMSNorms on the q and kv latents `r_q + r_kv`; QK-norm's `2d` ("head") or
        `a·d + a_kv·d` ("full", OLMo 2); Gemma's two more block norms ("sandwich")."""
        mla = self.q_lora_rank + self.kv_lora_rank if self.is_mla else 0
        qk = {"head": 2 * self.head_dim, "full": self.q_dim + self.kv_dim}.get(self.qk_norm, 0)
        return mla + qk + (2 * self.norm_params() if self.block_norms == "sandwich" else 0)

    def norm_params(self) -> int:
        """One norm: scale (and shift for LayerNorm)."""
        return self.d_model * (2 if self.norm == "layernorm" else 1)

    def router_params(self) -> int:
        return (self.d_model + self.router_bias) * self.n_experts

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
        """Scores and P·V per token, all layers: `L·2·k·a·(d_qk + d_v)` with `k` the keys per
        query (`attention_keys`: `s`, `s/2` causal, less under windows and chunks) — `L·4·s·a·d`
        (a·d = h unless `d_head`) but for MLA, whose scores run at `d_nope + d_R` and P·V at
        `d_v`."""
        widths = self.q_dim + self.o_dim  # a·d_qk + a·d_v
        return self.n_layers * 2 * self.attention_keys(seq_len, causal) * widths

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
        again — per token `2·(a·d_v·h + h·f)`; MoE layers: the shared experts' w3, and every
        routed-expert matmul (`aten._grouped_mm`, not on its save list) and the router gate
        (`force_recompute_mm_shapes_by_fqns`)."""
        out_proj = self.o_dim * self.d_model  # wo: a·d_v → h (MLA: d_v ≠ d)
        routed = self.top_k * (3 if self.gated_mlp else 2) + self.n_shared_experts
        experts = routed * self.d_model * self.expert_d_ff + self.d_model * self.n_experts
        return 2.0 * (self.n_dense_layers * (out_proj + self.d_model * self.d_ff)
                      + self.n_moe_layers * (out_proj + experts))


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

