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

Mixtral (`MixtralForCausalLM`): each MoE layer's router `gate.weight` (E, h) is
`blocks.i.mlp.router` (h, E) transposed. The experts come in two on-disk layouts, both of which
transformers 5 loads (its `conversion_mapping.py` "mixtral" entry: rename `.block_sparse_moe.`
→ `.mlp.`, merge `experts.*.w1`/`w3` into `gate_up_proj` and `experts.*.w2` into `down_proj`):

    per expert (what `save_pretrained` writes by default, `save_original_format=True`, and
    every Mixtral checkpoint written before transformers 5):
      model.layers.i.block_sparse_moe.gate.weight             (E, h)
      model.layers.i.block_sparse_moe.experts.N.w1/w3.weight  (f, h)   row N of w_gate/w_up, .T
      model.layers.i.block_sparse_moe.experts.N.w2.weight     (h, f)   row N of w_down, .T
    fused (transformers 5's in-memory `MixtralExperts`, `save_pretrained(...,
    save_original_format=False)`):
      model.layers.i.mlp.gate.weight                          (E, h)
      model.layers.i.mlp.experts.gate_up_proj                 (E, 2f, h) = cat(w_gate.mT, w_up.mT, dim 1)
      model.layers.i.mlp.experts.down_proj                    (E, h, f)  = w_down.mT

Either prefix (`block_sparse_moe` or `mlp`) goes with either layout, as in transformers.
`save_hf` writes the per-expert layout under `block_sparse_moe`: what transformers 5.24's
`save_pretrained` writes by default and what every transformers version loads. HF's router
is the runtime's: softmax over all E experts, top-k, gates renormalised over the k
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

__all__ = ["check_hf_weights", "hf_config", "hf_weight_files", "load_hf_weights", "save_hf",
           "to_hf_name", "to_hf_tensors", "to_runtime_name"]

_INDEX = "model.safetensors.index.json"
_BLOCK = {  # runtime name inside blocks.i ↔ HF name inside model.layers.i
    "attention_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
    "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
    "mlp.w_gate": "mlp.gate_proj", "mlp.w_up": "mlp.up_proj", "mlp.w_down": "mlp.down_proj",
}
_TOP = {"embedding": "model.embed_tokens", "norm": "model.norm", "head": "lm_head"}
_EXPERT = {"w1": "w_gate", "w3": "w_up", "w2": "w_down"}  # Mixtral expert linear ↔ runtime
_MOE = re.compile(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.(?:gate\.weight|"
                  r"experts\.(?:(\d+)\.(w[123])\.weight|(gate_up_proj|down_proj)))")
_STACKED = re.compile(r"blocks\.\d+\.mlp\.w_(gate|up|down)")  # (E, ·, ·): one row per expert


def _destinations(hf_name: str, params: dict[str, torch.Tensor]
                  ) -> list[tuple[str, int | None, torch.Tensor]]:
    """Where a checkpoint tensor goes: (runtime parameter, expert row or None for all of it,
    a view of it in the checkpoint's orientation). Several views (the fused `gate_up_proj`)
    take consecutive slices of the tensor along dim -2."""
    m = _MOE.fullmatch(hf_name)
    if m is None:
        name = to_runtime_name(hf_name)
        return [(name, None, params[name])] if name in params else []
    layer, expert, linear, fused = m.groups()
    mlp = f"blocks.{layer}.mlp"
    if f"{mlp}.router" not in params:
        return []
    if fused == "gate_up_proj":  # (E, 2f, h) = [w_gate (E, h, f).mT ; w_up.mT] along dim 1
        return [(f"{mlp}.{w}", None, params[f"{mlp}.{w}"].mT) for w in ("w_gate", "w_up")]
    if fused == "down_proj":  # (E, h, f) = w_down (E, f, h).mT
        return [(f"{mlp}.w_down", None, params[f"{mlp}.w_down"].mT)]
    if expert is None:  # the router: (E, h) = router (h, E).T
        return [(f"{mlp}.router", None, params[f"{mlp}.router"].T)]
    name, row = f"{mlp}.{_EXPERT[linear]}", int(expert)
    if row >= params[name].shape[0]:
        return []
    return [(name, row, params[name][row].T)]  # (f, h) or (h, f)


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


def _tensors(path: Path, headers_only: bool
             ) -> list[tuple[str, tuple[int, ...], torch.Tensor | None]]:
    """(name, shape, tensor) of each tensor of a safetensors file; the tensor is None when
    only the header is read. An unreadable file is one line."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    try:
        if headers_only:
            with safe_open(str(path), "pt") as f:
                return [(k, tuple(f.get_slice(k).get_shape()), None)
                        for k in f.keys()]  # noqa: SIM118 (a safe_open, not a dict)
        return [(k, tuple(t.shape), t) for k, t in load_file(str(path)).items()]
    except (OSError, SafetensorError) as exc:
        raise ShardwiseError(f"{path}: not a readable safetensors file ({exc})") from None


def check_hf_weights(spec: ModelSpec, directory: str | Path) -> None:
    """`load_hf_weights`'s checks (every name placed, every shape as config.json implies,
    nothing read twice, nothing missing) on the files' headers alone, against the model built
    on the meta device: a bad checkpoint is refused before any rank starts."""
    from shardwise.runtime.model import Transformer

    with torch.device("meta"):
        model = Transformer(spec)
    load_hf_weights(model, directory, headers_only=True)


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, directory: str | Path, *,
                    headers_only: bool = False) -> None:
    """Copy the checkpoint in `directory` into `model` (a single-device `Transformer`, before
    `parallelize`), converting to the model's dtype. Every runtime parameter must be present
    (the head may be absent when embeddings are tied) and no tensor may be left over.
    `headers_only`: the same checks on names and shapes, nothing copied."""
    files = hf_weight_files(directory)
    if not files:
        raise ShardwiseError(f"{directory}: no model.safetensors or {_INDEX} to load")
    params = dict(model.named_parameters())
    seen: dict[tuple[str, int | None], str] = {}  # (parameter, expert row) → checkpoint tensor
    for path in files:
        for hf_name, tensor_shape, tensor in _tensors(path, headers_only):
            try:
                views = _destinations(hf_name, params)
            except ShardwiseError as exc:  # a name shardwise does not know
                raise ShardwiseError(f"{path.name}: {exc}") from None
            if not views:
                raise ShardwiseError(f"{path.name}: tensor {hf_name!r} has no place in the "
                                     "model config.json describes")
            shape = views[0][2].shape  # the views stacked along dim -2
            if len(views) > 1:
                shape = (*shape[:-2], sum(v.shape[-2] for _, _, v in views), shape[-1])
            if tensor_shape != tuple(shape):
                raise ShardwiseError(f"{path.name}: {hf_name} has shape {tensor_shape}, "
                                     f"config.json implies {tuple(shape)}")
            pieces = ([None] * len(views) if tensor is None else
                      tensor.split([v.shape[-2] for _, _, v in views], dim=-2)
                      if len(views) > 1 else [tensor])
            for (name, row, view), piece in zip(views, pieces, strict=True):
                rows = range(view.shape[0]) if row is None and _STACKED.fullmatch(name) else [row]
                for key in ((name, r) for r in rows):
                    if key in seen:
                        raise ShardwiseError(f"{path.name}: {hf_name} holds weights already "
                                             f"read from {seen[key]} (two expert layouts?)")
                    seen[key] = hf_name
                if piece is not None:
                    view.copy_(piece)  # (converting the dtype)
    expected = {(n, r) for n, p in params.items()
                for r in (range(p.shape[0]) if _STACKED.fullmatch(n) else [None])}
    missing = sorted(list(to_hf_tensors(n, params[n].detach()))[r or 0]  # its HF name
                     for n, r in expected - seen.keys())
    if missing:
        fused = " (or the fused experts.gate_up_proj / down_proj)" if any(
            ".experts." in m for m in missing) else ""
        raise ShardwiseError(f"{directory}: the checkpoint lacks {', '.join(missing[:3])}"
                             f"{' …' if len(missing) > 3 else ''}{fused}")


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
