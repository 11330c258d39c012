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
           "to_runtime_name"]

_INDEX = "model.safetensors.index.json"
_BLOCK = {  # runtime name inside blocks.i ↔ HF name inside model.layers.i
    "attention_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
    "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
    "mlp.w_gate": "mlp.gate_proj", "mlp.w_up": "mlp.up_proj", "mlp.w_down": "mlp.down_proj",
}
_TOP = {"embedding": "model.embed_tokens", "norm": "model.norm", "head": "lm_head"}


def to_hf_name(name: str) -> str:
    """Runtime parameter name → Hugging Face name."""
    m = re.fullmatch(r"blocks\.(\d+)\.(.+)\.(weight|bias)", name)
    if m and m.group(2) in _BLOCK:
        return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}.{m.group(3)}"
    module, _, leaf = name.rpartition(".")
    if module in _TOP:
        return f"{_TOP[module]}.{leaf}"
    raise ShardwiseError(f"parameter {name!r} has no Hugging Face Llama/Qwen2 name "
                         "(MoE layers are not mapped)")


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
    raise ShardwiseError(f"checkpoint tensor {name!r} is not a Llama/Mistral/Qwen2 weight "
                         "shardwise knows")


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
    seen: set[str] = set()
    for path in files:
        for hf_name, tensor in load_file(str(path)).items():
            name = to_runtime_name(hf_name)
            if name not in params:
                raise ShardwiseError(f"{path.name}: tensor {hf_name!r} has no place in the "
                                     "model config.json describes")
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise ShardwiseError(f"{path.name}: {hf_name} has shape {tuple(tensor.shape)}, "
                                     f"config.json implies {tuple(params[name].shape)}")
            params[name].copy_(tensor.to(params[name].dtype))
            seen.add(name)
    missing = sorted(set(params) - seen)
    if missing:
        raise ShardwiseError(f"{directory}: the checkpoint lacks {', '.join(missing[:3])}"
                             f"{' …' if len(missing) > 3 else ''}")


def hf_config(spec: ModelSpec) -> dict[str, Any]:
    """A `config.json` transformers reads back as the same model: `qwen2` when the spec has
    Q/K/V biases without an O bias, else `llama` (Mistral's weights are Llama's)."""
    if spec.is_moe or spec.bias or spec.norm != "rmsnorm" or not spec.gated_mlp:
        raise ShardwiseError(f"{spec.name}: only dense Llama-style models can be saved in the "
                             "Hugging Face format")
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
    if not qwen2:
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
        tensors = {to_hf_name(n): t.detach().cpu().contiguous() for n, t in full.items()}
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
