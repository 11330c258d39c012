"""Decoder-only Transformer architectures: `ModelSpec`, presets, Hugging Face configs,
parameter counts and FLOPs per token (SPEC §1).

Parameter count (biases only with `bias`, or `qkv_bias`/`out_bias`), per layer, with head
width d (h/a unless the config names `head_dim`):

    attention  h·(a·d) (Q) + 2·h·(a_kv·d) (K, V) + (a·d)·h (O)  [+ a·d + 2·a_kv·d, + h biases]
    MLP        3·h·f gated (SwiGLU), 2·h·f otherwise
    norms      2·h
    model      L·per_layer + V·h (embedding) + V·h (head, unless tied) + h (final norm)

MoE layers count all experts in the *total* and `top_k` (+ shared) experts in the *active*
count, plus the router `h·n_experts`.

FLOPs: a `(n×k)·(k×m)` matmul costs `2nkm`. A forward pass costs 2 FLOPs per active matmul
parameter per token plus attention (scores and P·V) `4·s·a·d` (= `4·s·h`) per token per layer when every query
sees every key; causal attention halves it. Training = forward + backward = 3× forward.
"""

from __future__ import annotations

import difflib
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

    # ----------------------------------------------------------------------------- derived
    @property
    def head_dim(self) -> int:
        """Width d of one head: `d_head` when the config names it, else `h / a`."""
        return self.d_head or self.d_model // self.n_heads

    @property
    def q_dim(self) -> int:
        """Width of Q (and of O's input): `a · d` (= h unless `d_head` says otherwise)."""
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of K (and of V): `a_kv · d`."""
        return self.n_kv_heads * self.head_dim

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
        return self.n_layers // self.moe_every if self.is_moe else 0

    def is_moe_layer(self, index: int) -> bool:
        """Every `moe_every`-th layer is MoE, the last of each group."""
        return self.is_moe and index % self.moe_every == self.moe_every - 1

    @property
    def n_dense_layers(self) -> int:
        return self.n_layers - self.n_moe_layers

    def validate(self) -> ModelSpec:
        problems = []
        for field in ("n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "vocab"):
            if getattr(self, field) < 1:
                problems.append(f"{field} must be ≥ 1, got {getattr(self, field)}")
        if not problems:
            if self.d_head < 0:
                problems.append(f"d_head must be ≥ 0 (0: d_model / n_heads), got {self.d_head}")
            elif not self.d_head and self.d_model % self.n_heads:
                problems.append(f"n_heads={self.n_heads} does not divide d_model={self.d_model}")
            if self.n_heads % self.n_kv_heads:
                problems.append(
                    f"n_kv_heads={self.n_kv_heads} does not divide n_heads={self.n_heads}"
                )
        if self.norm not in ("rmsnorm", "layernorm"):
            problems.append(f"norm must be 'rmsnorm' or 'layernorm', got {self.norm!r}")
        if self.is_moe and not 1 <= self.top_k <= self.n_experts:
            problems.append(f"top_k={self.top_k} must be in 1..n_experts={self.n_experts}")
        if self.moe_every < 1:
            problems.append(f"moe_every must be ≥ 1, got {self.moe_every}")
        if self.norm_eps <= 0 or self.rope_theta <= 0:
            problems.append(f"norm_eps and rope_theta must be > 0, got {self.norm_eps} and "
                            f"{self.rope_theta}")
        if self.head_dim % 2:
            problems.append(f"RoPE needs an even head width, got {self.head_dim}")
        if problems:
            raise ShardwiseError(f"model {self.name}: " + "; ".join(problems))
        return self

    def with_(self, **changes: object) -> ModelSpec:
        """A copy with some fields changed, validated."""
        return replace(self, **changes).validate()  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    # ------------------------------------------------------------------------ param counts
    def attention_params(self) -> int:
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
        return self.attention_params() + self.mlp_params() + 2 * self.norm_params()

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
        counts = count_params(self)
        tied_head = self.vocab * self.d_model if self.tie_embeddings else 0
        matmul = counts.active - counts.embedding - counts.norms + tied_head
        return 2 * matmul + self._attention_flops(seq_len, causal)

    def _attention_flops(self, seq_len: int, causal: bool) -> float:
        """Scores and P·V per token, all layers: `L·4·s·a·d` (a·d = h unless `d_head`)."""
        return self.n_layers * 4 * seq_len * self.q_dim * (0.5 if causal else 1.0)

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
        if recompute not in extra:
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
    """Parameters by component; `total` counts every expert, `active` those a token uses."""

    attention: int
    mlp: int
    mlp_active: int
    norms: int
    embedding: int
    head: int

    @property
    def total(self) -> int:
        return self.attention + self.mlp + self.norms + self.embedding + self.head

    @property
    def active(self) -> int:
        return self.attention + self.mlp_active + self.norms + self.embedding + self.head


def count_params(model: ModelSpec) -> ParamCount:
    """Parameters by component (SPEC §1)."""
    dense, moe = model.n_dense_layers, model.n_moe_layers
    return ParamCount(
        attention=model.n_layers * model.attention_params(),
        mlp=dense * model.mlp_params() + moe * model.moe_mlp_params(active=False),
        mlp_active=dense * model.mlp_params() + moe * model.moe_mlp_params(active=True),
        norms=(2 * model.n_layers + 1) * model.norm_params(),
        embedding=model.embedding_params(),
        head=model.head_params(),
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
        # Small models for the executable runtime.
        _llama("tiny", 4, 64, 4, 2, 128, 256, 64),
        _llama("tiny-moe", 4, 64, 4, 2, 128, 256, 64, n_experts=4, top_k=2),
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
_LLAMA_LIKE = {"llama", "mistral", "mixtral", "qwen2", "qwen2_moe"}
SUPPORTED_HF_TYPES = ("llama", "mistral", "mixtral", "qwen2", "gpt2", "gpt_neox", "bloom")


def _from_hf_dict(cfg: dict, name: str) -> ModelSpec:
    kind = cfg.get("model_type")
    if kind in _LLAMA_LIKE:
        heads = cfg["num_attention_heads"]
        moe = {}
        if "num_local_experts" in cfg:
            moe = {"n_experts": cfg["num_local_experts"], "top_k": cfg["num_experts_per_tok"]}
        if cfg.get("mlp_bias"):
            raise ShardwiseError(f"config {name!r}: mlp_bias is not supported")
        attention_bias = bool(cfg.get("attention_bias", False))
        return ModelSpec(
            name=name,
            n_layers=cfg["num_hidden_layers"],
            d_model=cfg["hidden_size"],
            n_heads=heads,
            n_kv_heads=cfg.get("num_key_value_heads") or heads,
            d_ff=cfg["intermediate_size"],
            vocab=cfg["vocab_size"],
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_seq=cfg.get("max_position_embeddings", 4096),
            # transformers 5.24 defaults: rms_norm_eps 1e-6 (LlamaConfig, MistralConfig,
            # Qwen2Config) and 1e-5 (MixtralConfig); head_dim None → h/a
            norm_eps=float(cfg.get("rms_norm_eps", 1e-5 if kind == "mixtral" else 1e-6)),
            d_head=int(cfg.get("head_dim") or 0),
            qkv_bias=kind in ("qwen2", "qwen2_moe") or attention_bias,
            out_bias=attention_bias,
            **_hf_rope(cfg, kind),
            **moe,
        )
    if kind == "gpt2":
        hidden = cfg["n_embd"]
        return ModelSpec(
            name=name, n_layers=cfg["n_layer"], d_model=hidden, n_heads=cfg["n_head"],
            n_kv_heads=cfg["n_head"], d_ff=cfg.get("n_inner") or 4 * hidden,
            vocab=cfg["vocab_size"], gated_mlp=False, tie_embeddings=True, norm="layernorm",
            dropout=cfg.get("resid_pdrop", 0.0) > 0, learned_positions=cfg["n_positions"],
            max_seq=cfg["n_positions"],
        )
    if kind == "gpt_neox":
        heads = cfg["num_attention_heads"]
        return ModelSpec(
            name=name, n_layers=cfg["num_hidden_layers"], d_model=cfg["hidden_size"],
            n_heads=heads, n_kv_heads=heads, d_ff=cfg["intermediate_size"],
            vocab=cfg["vocab_size"], gated_mlp=False,
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)), norm="layernorm",
            max_seq=cfg.get("max_position_embeddings", 2048),
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
            gated_mlp=False, tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            norm="layernorm", bias=True,
            dropout=max(cfg.get("hidden_dropout", 0.0), cfg.get("attention_dropout", 0.0)) > 0,
            max_seq=cfg.get("seq_length", 2048),
        )
    raise ShardwiseError(
        f"unsupported model_type {kind!r} in config; supported: {', '.join(SUPPORTED_HF_TYPES)}"
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
    `where` names its origin in error messages."""
    from shardwise.validate import hf_config

    if not isinstance(cfg, dict):
        raise ShardwiseError(f"config file {where!r} must hold a JSON object")
    hf_config(cfg, where)
    try:
        return _from_hf_dict(cfg, name).validate()
    except KeyError as exc:
        raise ShardwiseError(
            f"config file {where!r} ({cfg.get('model_type')}) lacks the field {exc}"
        ) from None
    except (TypeError, ValueError) as exc:
        raise ShardwiseError(f"config file {where!r} has a field of the wrong type ({exc})"
                             ) from None

