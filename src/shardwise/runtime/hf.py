"""Hugging Face checkpoints in and out: `config.json` + safetensors (one file, or shards with
`model.safetensors.index.json`) for Llama, Mistral and Qwen2 (`LlamaForCausalLM`,
`MistralForCausalLM`, `Qwen2ForCausalLM`: the same module tree).

Names (HF ↔ runtime `runtime.model.Transformer`; nn.Linear weights are (out, in) in both):

    model.embed_tokens.weight                     embedding.weight
    model.layers.i.input_layernorm.weight         blocks.i.attention_norm.weight
    model.layers.i.self_attn.{q,k,v,o}_proj.*     blocks.i.attention.w{q,k,v,o}.*   (.bias too)
    model.layers.i.post_attention_layernorm.weight  blocks.i.mlp_norm.weight
    model.layers.i.mlp.{gate,up,down}_proj.weight blocks.i.mlp.w_{gate,up,down}.weight
    model.norm.weight                             norm.weight
    lm_head.weight                                head.weight  (absent when tied)

Mixtral (`MixtralForCausalLM`, the checkpoint layout `save_pretrained` writes): each MoE
layer's `model.layers.i.block_sparse_moe.gate.weight` (E, h) is `blocks.i.mlp.router` (h, E)
transposed, and expert N's `experts.N.w1` / `w3` (f, h) and `w2` (h, f) are row N of the
stacked `blocks.i.mlp.w_gate` / `w_up` (E, h, f) and `w_down` (E, f, h), transposed. HF's
router is the runtime's: softmax over all E experts, top-k, gates renormalised over the k
(`ops.moe.RoutingRule(normalize=True)`); expert parallelism then keeps each rank's experts.

Loading (`load_hf_weights`): every rank reads the whole state dict on CPU into the
single-device model it builds from the seed, before `parallelize` keeps its slice — the simplest
correct path, and the memory cost is one full copy of the weights per rank while loading (a
7B model in fp32: 28 GB per rank, briefly); sharded reading per layout is not done.

Saving (`save_hf`): `ParallelTransformer.full_parameters()` gathers each pipeline stage's
parameters over tp, ep and ZeRO; the rank at coordinate 0 of every axis but pp writes its
stage's tensors to `model-0000k-of-0000p.safetensors` (one `model.safetensors` when pp = 1);
rank 0 writes `config.json` and, with several files, the index. No gather across stages.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from shardwise.arch import ModelSpec
from shardwise.errors import ShardwiseError

__all__ = ["hf_config", "hf_weight_files", "load_hf_weights", "save_hf", "to_hf_name",
           "to_hf_tensors", "to_runtime_name"]

_INDEX = "model.safetensors.index.json"
_BLOCK = {  # runtime name inside blocks.i ↔ HF name inside model.layers.i
    "attention_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
    "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
    "mlp.w_gate": "mlp.gate_proj", "mlp.w_up": "mlp.up_proj", "mlp.w_down": "mlp.down_proj",
}
_TOP = {"embedding": "model.embed_tokens", "norm": "model.norm", "head": "lm_head"}
_EXPERT = {"w1": "w_gate", "w3": "w_up", "w2": "w_down"}  # Mixtral expert linear ↔ runtime
_MOE = re.compile(r"model\.layers\.(\d+)\.block_sparse_moe\."
                  r"(?:gate|experts\.(\d+)\.(w[123]))\.weight")


def _moe_target(hf_name: str) -> tuple[str, int | None] | None:
    """A Mixtral MoE tensor's runtime parameter and expert row (None: the router); None for
    any other tensor. Every one of them is stored transposed."""
    m = _MOE.fullmatch(hf_name)
    if m is None:
        return None
    layer, expert, linear = m.groups()
    if expert is None:
        return f"blocks.{layer}.mlp.router", None
    return f"blocks.{layer}.mlp.{_EXPERT[linear]}", int(expert)


def to_hf_tensors(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """A runtime parameter as the Hugging Face tensor(s) holding it (an MoE layer's stacked
    experts become one (out, in) tensor per expert)."""
    m = re.fullmatch(r"blocks\.(\d+)\.mlp\.(router|w_gate|w_up|w_down)", name)
    if m is None:
        return {to_hf_name(name): tensor}
    base = f"model.layers.{m.group(1)}.block_sparse_moe"
    if m.group(2) == "router":
        return {f"{base}.gate.weight": tensor.T.contiguous()}  # (h, E) -> (E, h)
    linear = {v: k for k, v in _EXPERT.items()}[m.group(2)]
    return {f"{base}.experts.{i}.{linear}.weight": tensor[i].T.contiguous()
            for i in range(tensor.shape[0])}


def to_hf_name(name: str) -> str:
    """Runtime parameter name → Hugging Face name."""
    m = re.fullmatch(r"blocks\.(\d+)\.(.+)\.(weight|bias)", name)
    if m and m.group(2) in _BLOCK:
        return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}.{m.group(3)}"
    module, _, leaf = name.rpartition(".")
    if module in _TOP:
        return f"{_TOP[module]}.{leaf}"
    raise ShardwiseError(f"parameter {name!r} has no Hugging Face Llama/Qwen2 name (an MoE "
                         "layer's: to_hf_tensors)")


def to_runtime_name(name: str) -> str:
    """Hugging Face name → runtime parameter name."""
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", name)
    inverse = {v: k for k, v in _BLOCK.items()}
    if m and m.group(2) in inverse:
        return f"blocks.{m.group(1)}.{inverse[m.group(2)]}.{m.group(3)}"
    module, _, leaf = name.rpartition(".")
    top = {v: k for k, v in _TOP.items()}
    if module in top:
        return f"{top[module]}.{leaf}"
    raise ShardwiseError(f"checkpoint tensor {name!r} is not a Llama/Mistral/Qwen2/Mixtral "
                         "weight shardwise knows")


def hf_weight_files(directory: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint folder ([] when it holds none)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    index = directory / _INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        return [directory / f for f in sorted(set(weight_map.values()))]
    single = directory / "model.safetensors"
    return [single] if single.is_file() else []


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, directory: str | Path) -> None:
    """Copy the checkpoint in `directory` into `model` (a single-device `Transformer`, before
    `parallelize`), converting to the model's dtype. Every runtime parameter must be present
    (the head may be absent when embeddings are tied) and no tensor may be left over."""
    from safetensors.torch import load_file

    files = hf_weight_files(directory)
    if not files:
        raise ShardwiseError(f"{directory}: no model.safetensors or {_INDEX} to load")
    params = dict(model.named_parameters())
    seen: set[tuple[str, int | None]] = set()
    for path in files:
        for hf_name, tensor in load_file(str(path)).items():
            moe = _moe_target(hf_name)
            name, row = moe if moe is not None else (to_runtime_name(hf_name), None)
            if name not in params:
                raise ShardwiseError(f"{path.name}: tensor {hf_name!r} has no place in the "
                                     "model config.json describes")
            dest = params[name] if row is None else params[name][row]
            dest = dest.T if moe is not None else dest  # Mixtral's MoE tensors: transposed
            if tuple(tensor.shape) != tuple(dest.shape):
                raise ShardwiseError(f"{path.name}: {hf_name} has shape {tuple(tensor.shape)}, "
                                     f"config.json implies {tuple(dest.shape)}")
            dest.copy_(tensor.to(dest.dtype))
            seen.add((name, row))
    expected = {(n, r) for n, p in params.items() for r in (
        range(p.shape[0]) if re.fullmatch(r"blocks\.\d+\.mlp\.w_(gate|up|down)", n) else [None])}
    missing = sorted(n if r is None else f"{n}[{r}]" for n, r in expected - seen)
    if missing:
        raise ShardwiseError(f"{directory}: the checkpoint lacks {', '.join(missing[:3])}"
                             f"{' …' if len(missing) > 3 else ''}")


def hf_config(spec: ModelSpec) -> dict[str, Any]:
    """A `config.json` transformers reads back as the same model: `mixtral` for an MoE model,
    `qwen2` when the spec has Q/K/V biases without an O bias, else `llama` (Mistral's weights
    are Llama's)."""
    mixtral = spec.is_moe
    if (spec.bias or spec.norm != "rmsnorm" or not spec.gated_mlp or (mixtral and (
            spec.n_shared_experts or spec.moe_every != 1 or spec.qkv_bias or spec.out_bias))):
        raise ShardwiseError(f"{spec.name}: only Llama-style models (dense, or Mixtral's MoE in "
                             "every layer without shared experts) can be saved in the Hugging "
                             "Face format")
    qwen2 = spec.qkv_bias and not spec.out_bias
    rope: dict[str, Any] = {"rope_theta": spec.rope_theta, "rope_type": "default"}
    rope.update(dict(spec.rope_scaling))
    config: dict[str, Any] = {
        "architectures": ["Qwen2ForCausalLM" if qwen2 else "LlamaForCausalLM"],
        "model_type": "qwen2" if qwen2 else "llama",
        "hidden_size": spec.d_model, "intermediate_size": spec.d_ff,
        "num_hidden_layers": spec.n_layers, "num_attention_heads": spec.n_heads,
        "num_key_value_heads": spec.n_kv_heads, "head_dim": spec.head_dim,
        "vocab_size": spec.vocab, "max_position_embeddings": spec.max_seq,
        "rms_norm_eps": spec.norm_eps, "rope_parameters": rope,
        "tie_word_embeddings": spec.tie_embeddings, "hidden_act": "silu",
    }
    if mixtral:
        config |= {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                   "intermediate_size": spec.expert_d_ff, "num_local_experts": spec.n_experts,
                   "num_experts_per_tok": spec.top_k, "router_jitter_noise": 0.0}
    elif not qwen2:
        config["attention_bias"] = spec.qkv_bias
    return config


def save_hf(parallel: Any, directory: str | Path) -> None:
    """Write the trained model of a `ParallelTransformer` to `directory` as config.json +
    safetensors (collective: every rank calls it)."""
    from safetensors.torch import save_file

    from shardwise.runtime import collectives as C

    directory = Path(directory)
    full = parallel.full_parameters()  # this stage's parameters, gathered over tp/ep/ZeRO
    coord, pp = parallel.mesh.coord, parallel.layout.pp
    writer = all(v == 0 for k, v in coord.items() if k != "pp")
    names = {p: f"model-{p + 1:05d}-of-{pp:05d}.safetensors" for p in range(pp)}
    if pp == 1:
        names = {0: "model.safetensors"}
    if writer:
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().cpu().contiguous() for n, t in full.items()
                   for k, v in to_hf_tensors(n, t).items()}
        save_file(tensors, str(directory / names[coord.get("pp", 0)]),
                  metadata={"format": "pt"})
    C.barrier()
    if all(v == 0 for v in coord.values()):  # rank 0
        spec = parallel.model.spec
        (directory / "config.json").write_text(
            json.dumps(hf_config(spec) | {"torch_dtype": str(parallel.model.dtype)[6:]},
                       indent=2), encoding="utf-8")
        if pp > 1:
            from safetensors import safe_open

            weight_map = {}
            for name in names.values():
                with safe_open(str(directory / name), "pt") as f:
                    weight_map.update(dict.fromkeys(f.keys(), name))
            (directory / _INDEX).write_text(json.dumps({"metadata": {}, "weight_map":
                                                        weight_map}, indent=2),
                                            encoding="utf-8")
    C.barrier()
