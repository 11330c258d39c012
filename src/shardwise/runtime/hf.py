"""Hugging Face checkpoints in and out: `config.json` + safetensors (one file, or shards with
`model.safetensors.index.json`) for Llama, Mistral and Qwen2 (`LlamaForCausalLM`,
`MistralForCausalLM`, `Qwen2ForCausalLM`: the same module tree), Mixtral, Gemma 3
(`Gemma3ForCausalLM`: sandwich norms, QK-norm) and gpt-oss (`GptOssForCausalLM`: sinks, its
experts' interleaved gate/up and biases; `hf_variants`).

Either prefix (`block_sparse_moe` or `mlp`) goes with either layout, as in transformers.
`save_hf` writes the per-expert layout under `block_sparse_moe`: what transformers 5.24's
`save_pretrained` writes by default and what every transformers version loads. HF's router
is the runtime's: softmax over all E experts, top-k, gates renormalised over the k
(`ops.moe.RoutingRule(normalize=True)`); expert parallelism then keeps each rank's experts.

Design notes: docs/concepts/runtime.md#runtime-hf.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from shardwise.arch import ModelSpec
from shardwise.errors import ShardwiseError
from shardwise.runtime import hf_target, hf_variants

__all__ = ["check_hf_weights", "hf_config", "hf_state", "hf_weight_files", "load_hf_weights",
           "save_hf", "to_hf_name", "to_hf_tensors", "to_runtime_name"]

_INDEX = hf_target.INDEX
_BLOCK = {  # runtime name inside blocks.i ↔ HF name inside model.layers.i
    "attention_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
    "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
    "mlp.w_gate": "mlp.gate_proj", "mlp.w_up": "mlp.up_proj", "mlp.w_down": "mlp.down_proj",
}
_BLOCK |= {"attention.q_norm": "self_attn.q_norm", "attention.k_norm": "self_attn.k_norm",
           "mlp_out_norm": "post_feedforward_layernorm"}
# Gemma's sandwich: the runtime's attention_out_norm and mlp_norm (the pre-MLP norm)
_SANDWICH = _BLOCK | {"attention_out_norm": "post_attention_layernorm",
                      "mlp_norm": "pre_feedforward_layernorm"}
_TOP = {"embedding": "model.embed_tokens", "norm": "model.norm", "head": "lm_head"}
_EXPERT = {"w1": "w_gate", "w3": "w_up", "w2": "w_down"}  # Mixtral expert linear ↔ runtime
_MOE = re.compile(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.(?:gate\.weight|"
                  r"experts\.(?:(\d+)\.(w[123])\.weight|(gate_up_proj|down_proj)))")
_STACKED = re.compile(r"blocks\.\d+\.mlp\.w_(gate|up|down)")  # (E, ·, ·): one row per expert


Views = list[tuple[str, int | None, torch.Tensor]]


def _destinations(hf_name: str, params: dict[str, torch.Tensor]) -> Views:
    """Where a checkpoint tensor goes: (runtime parameter, expert row or None for all of it,
    a view of it in the checkpoint's orientation). Several views (the fused `gate_up_proj`)
    take consecutive slices of the tensor along dim -2 (gpt-oss's after `hf_variants.reorder`)."""
    oss = hf_variants.gpt_oss_views(hf_name, params)
    if oss is not None:
        return oss
    m = _MOE.fullmatch(hf_name)
    if m is None:
        name = to_runtime_name(hf_name, hf_variants.sandwich(params))
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


def to_hf_tensors(name: str, tensor: torch.Tensor, sandwich: bool = False
                  ) -> dict[str, torch.Tensor]:
    """A runtime parameter as the Hugging Face tensor(s) holding it (an MoE layer's stacked
    experts become one (out, in) tensor per expert; gpt-oss's: `hf_variants.gpt_oss_tensors`).
    `sandwich`: Gemma's norm names."""
    m = re.fullmatch(r"blocks\.(\d+)\.mlp\.(router|w_gate|w_up|w_down)", name)
    if m is None:
        return {to_hf_name(name, sandwich): tensor}
    base = f"model.layers.{m.group(1)}.block_sparse_moe"
    if m.group(2) == "router":
        return {f"{base}.gate.weight": tensor.T.contiguous()}  # (h, E) -> (E, h)
    linear = {v: k for k, v in _EXPERT.items()}[m.group(2)]
    return {f"{base}.experts.{i}.{linear}.weight": tensor[i].T.contiguous()
            for i in range(tensor.shape[0])}


def hf_state(full: dict[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Runtime parameters (by name) → the tensors `save_pretrained` writes for this model."""
    gemma = hf_variants.family(spec) == "gemma3_text"
    out: dict[str, torch.Tensor] = {}
    for name, tensor in full.items():
        oss = hf_variants.gpt_oss_tensors(name, full)
        out.update(oss if oss is not None else to_hf_tensors(name, tensor, gemma))
    return out


def _hf_name_of(name: str, row: int | None, params: dict[str, torch.Tensor]) -> str:
    """The Hugging Face name of runtime parameter `name` (expert `row`), for messages."""
    return hf_variants.gpt_oss_name(name, params) or list(to_hf_tensors(
        name, params[name].detach(), hf_variants.sandwich(params)))[row or 0]


def to_hf_name(name: str, sandwich: bool = False) -> str:
    """Runtime parameter name → Hugging Face name (`sandwich`: Gemma's norm names)."""
    block = _SANDWICH if sandwich else _BLOCK
    m = re.fullmatch(r"blocks\.(\d+)\.(.+)\.(weight|bias)", name)
    if m and m.group(2) in block:
        return f"model.layers.{m.group(1)}.{block[m.group(2)]}.{m.group(3)}"
    m = re.fullmatch(r"blocks\.(\d+)\.attention\.sinks", name)
    if m:
        return f"model.layers.{m.group(1)}.self_attn.sinks"
    module, _, leaf = name.rpartition(".")
    if module in _TOP:
        return f"{_TOP[module]}.{leaf}"
    raise ShardwiseError(f"parameter {name!r} has no Hugging Face Llama/Qwen2 name (an MoE "
                         "layer's: to_hf_tensors)")


def to_runtime_name(name: str, sandwich: bool = False) -> str:
    """Hugging Face name → runtime parameter name (`sandwich`: Gemma's norm names)."""
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", name)
    inverse = {v: k for k, v in (_SANDWICH if sandwich else _BLOCK).items()}
    if m and m.group(2) in inverse:
        return f"blocks.{m.group(1)}.{inverse[m.group(2)]}.{m.group(3)}"
    m = re.fullmatch(r"model\.layers\.(\d+)\.self_attn\.sinks", name)
    if m:
        return f"blocks.{m.group(1)}.attention.sinks"
    module, _, leaf = name.rpartition(".")
    top = {v: k for k, v in _TOP.items()}
    if module in top:
        return f"{top[module]}.{leaf}"
    raise ShardwiseError(f"checkpoint tensor {name!r} is not a Llama/Mistral/Qwen2/Mixtral "
                         "weight shardwise knows (nor a Gemma 3 or gpt-oss one)")


# Files that hold weights in the formats shardwise does not read (PyTorch pickles, TF, Flax,
# GGUF): a folder holding them without safetensors is refused, never trained from scratch.
_OTHER_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.h5", "*.msgpack", "*.gguf")
# safetensors dtypes shardwise loads (converted to the run's dtype); int8/uint8/fp8 and other
# quantised tensors are refused, never cast.
_FLOAT_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def _weight_map(index: Path) -> dict[str, str]:
    """The `weight_map` of a safetensors index: tensor name → file name in the folder."""
    from shardwise.files import read_json

    data = read_json(index, "safetensors index")
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ShardwiseError(f"safetensors index {str(index)!r} has no weight_map (tensor → "
                             "file); it cannot say where the weights are")
    for name, file in weight_map.items():
        if not isinstance(file, str) or Path(file).name != file or file in ("", ".", ".."):
            raise ShardwiseError(f"safetensors index {str(index)!r}: {name!r} maps to "
                                 f"{file!r}, not a file name in the checkpoint folder")
    return weight_map


def hf_weight_files(directory: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint folder: the files its index names, or
    `model.safetensors`; [] for a folder with a config alone (or a path that is not a
    folder). Weights that cannot all be read are refused in one line, never skipped: an index
    without a weight_map, a named file missing or not a regular file (a directory, a symlink
    loop), both an index and `model.safetensors`, or weights in another format."""
    from shardwise.files import regular_file
    from shardwise.validate import MAX_BYTES

    directory = Path(directory)
    if not directory.is_dir():
        return []
    index, single = directory / _INDEX, directory / "model.safetensors"
    if os.path.lexists(index) and os.path.lexists(single):
        raise ShardwiseError(f"{directory} holds both {_INDEX} and model.safetensors; keep the "
                             "one that is the checkpoint")
    if os.path.lexists(index):
        names = sorted(set(_weight_map(index).values()))
        return [regular_file(directory / n, "checkpoint file", MAX_BYTES) for n in names]
    if os.path.lexists(single):
        return [regular_file(single, "checkpoint file", MAX_BYTES)]
    others = sorted({p.name for pattern in ("*.safetensors", *_OTHER_WEIGHTS)
                     for p in directory.glob(pattern)})
    if others:
        raise ShardwiseError(f"{directory} holds weights shardwise cannot read as a checkpoint "
                             f"({', '.join(others[:3])}{' …' if len(others) > 3 else ''}): it "
                             f"reads model.safetensors, or shards named by {_INDEX}")
    return []


def _tensors(path: Path) -> Iterator[tuple[str, tuple[int, ...], str, torch.Tensor]]:
    """(name, shape, safetensors dtype, tensor) of each tensor of a safetensors file, one at
    a time. An unreadable file is one line."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safe_open, not a dict)
                view = f.get_slice(name)
                yield name, tuple(view.get_shape()), view.get_dtype(), f.get_tensor(name)
    except (OSError, SafetensorError) as exc:
        raise ShardwiseError(f"{path}: not a readable safetensors file ({exc})") from None


def check_hf_weights(spec: ModelSpec, directory: str | Path) -> None:
    """`load_hf_weights`'s checks (every name placed, every shape as config.json implies,
    float dtypes, finite values, nothing read twice, nothing missing, the index's map
    honoured) against the model built on the meta device: a bad checkpoint is refused before
    any rank starts. Reads every tensor once, one at a time."""
    from shardwise.runtime.model import Transformer

    with torch.device("meta"):
        model = Transformer(spec)
    load_hf_weights(model, directory, copy=False)


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, directory: str | Path, *,
                    copy: bool = True) -> None:
    """Copy the checkpoint in `directory` into `model` (a single-device `Transformer`, before
    `parallelize`), converting float tensors to the model's dtype. Every runtime parameter
    must be present (the head may be absent when embeddings are tied), no tensor may be left
    over, every tensor must be a float one holding finite values, and each file must hold
    exactly the tensors the index maps to it. `copy=False`: the same checks, nothing copied."""
    files = hf_weight_files(directory)
    if not files:
        raise ShardwiseError(f"{directory}: no model.safetensors or {_INDEX} to load")
    index = Path(directory) / _INDEX
    mapped = _weight_map(index) if index.exists() else None
    params = dict(model.named_parameters())
    seen: dict[tuple[str, int | None], str] = {}  # (parameter, expert row) → checkpoint tensor
    for path in files:
        names = set()
        for hf_name, tensor_shape, dtype, tensor in _tensors(path):
            names.add(hf_name)
            if dtype not in _FLOAT_DTYPES:
                raise ShardwiseError(f"{path.name}: {hf_name} is {dtype}; shardwise loads "
                                     f"float tensors ({', '.join(_FLOAT_DTYPES)}), not "
                                     "quantised ones")
            if not bool(torch.isfinite(tensor).all()):
                bad = int((~torch.isfinite(tensor)).sum())
                raise ShardwiseError(f"{path.name}: {hf_name} holds {bad:,} NaN or infinite "
                                     "value(s); a model cannot train from them")
            _place(hf_name, tensor_shape, tensor if copy else None, params, seen, path)
        if mapped is not None:
            _check_mapped(path, names, mapped)
    expected = {(n, r) for n, p in params.items()
                for r in (range(p.shape[0]) if _STACKED.fullmatch(n) else [None])}
    missing = sorted(_hf_name_of(n, r, params) for n, r in expected - seen.keys())
    if missing:
        fused = " (or the fused experts.gate_up_proj / down_proj)" if any(
            ".experts." in m for m in missing) else ""
        raise ShardwiseError(f"{directory}: the checkpoint lacks {', '.join(missing[:3])}"
                             f"{' …' if len(missing) > 3 else ''}{fused}")


def _check_mapped(path: Path, names: set[str], mapped: dict[str, str]) -> None:
    """The file holds exactly the tensors the index maps to it."""
    listed = {n for n, f in mapped.items() if f == path.name}
    for extra, where in ((sorted(listed - names), "the index maps it there but the file lacks "
                          "it"), (sorted(names - listed), "the file holds it but the index "
                                 "does not map it there")):
        if extra:
            raise ShardwiseError(f"{path.name}: {extra[0]}: {where}")


def _place(hf_name: str, tensor_shape: tuple[int, ...], tensor: torch.Tensor | None,
           params: dict[str, torch.Tensor], seen: dict[tuple[str, int | None], str],
           path: Path) -> None:
    """Check where checkpoint tensor `hf_name` goes (and copy `tensor` there, if given)."""
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
    shape = hf_variants.file_shape(hf_name, tuple(shape), params)
    if tensor_shape != tuple(shape):
        raise ShardwiseError(f"{path.name}: {hf_name} has shape {tensor_shape}, "
                             f"config.json implies {tuple(shape)}")
    if tensor is not None:
        tensor = hf_variants.reorder(hf_name, tensor, params)
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


def hf_config(spec: ModelSpec) -> dict[str, Any]:
    """A `config.json` transformers reads back as the same model: `mixtral` for an MoE model,
    `qwen2` when the spec has Q/K/V biases without an O bias, `mistral` with a sliding window,
    else `llama` (Mistral's weights are Llama's)."""
    if hf_variants.family(spec):
        return hf_variants.hf_config(spec)
    if spec.runtime_variants():
        raise ShardwiseError(f"{spec.name} has {', '.join(spec.runtime_variants())}: only "
                             "Gemma 3's and gpt-oss's variants can be saved in the Hugging Face "
                             "format")
    mixtral = spec.is_moe
    if (spec.bias or spec.norm != "rmsnorm" or not spec.gated_mlp or (mixtral and (
            spec.n_shared_experts or spec.moe_every != 1 or spec.qkv_bias or spec.out_bias))
            or (spec.sliding_window and (spec.qkv_bias or spec.out_bias))):
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
                   "num_experts_per_tok": spec.top_k, "router_jitter_noise": 0.0,
                   "sliding_window": spec.sliding_window or None}
    elif spec.sliding_window:
        config |= {"architectures": ["MistralForCausalLM"], "model_type": "mistral",
                   "sliding_window": spec.sliding_window}
    elif not qwen2:
        config["attention_bias"] = spec.qkv_bias
    return config


def save_hf(parallel: Any, directory: str | Path) -> None:
    """Write the trained model of a `ParallelTransformer` to `directory` as config.json +
    safetensors (collective: every rank calls it). A checkpoint already there is replaced
    as a whole (`hf_target`: written beside it, then swapped in). A write that fails on any
    rank raises `ShardwiseError` on every rank (none is left waiting) and leaves `directory`
    as it was."""
    from safetensors.torch import save_file

    from shardwise.runtime import launch

    directory = Path(directory)
    full = parallel.full_parameters()  # this stage's parameters, gathered over tp/ep/ZeRO
    coord, pp = parallel.mesh.coord, parallel.layout.pp
    writer = all(v == 0 for k, v in coord.items() if k != "pp")
    rank0 = all(v == 0 for v in coord.values())
    names = {p: f"model-{p + 1:05d}-of-{pp:05d}.safetensors" for p in range(pp)}
    if pp == 1:
        names = {0: "model.safetensors"}
    where: tuple[str | None, bool, str | None] = (None, False, None)  # (folder, swap, problem)
    if rank0:  # before any rank writes: where the files go
        try:
            staged, swap = hf_target.stage(directory)
            where = (str(staged), swap, None)
        except ShardwiseError as exc:
            where = (None, False, str(exc))
        except OSError as exc:
            where = (None, False, f"cannot write the model to {directory}: {exc.strerror}")
    folder, swap, refused = launch.from_rank0(where)
    if refused is not None:
        raise ShardwiseError(refused)
    out = Path(folder)
    problem = None
    if writer:
        tensors = {k: v.detach().cpu().contiguous()
                   for k, v in hf_state(full, parallel.model.spec).items()}
        try:
            save_file(tensors, str(out / names[coord.get("pp", 0)]), metadata={"format": "pt"})
        except (OSError, RuntimeError) as exc:  # safetensors reports I/O as either
            problem = f"{directory}: {getattr(exc, 'strerror', None) or exc}"
    problem = launch.first_problem(problem)
    if rank0:
        try:
            if problem is None:
                _write_config(parallel, out, list(names.values()))
                if swap:
                    hf_target.publish(out, directory)
        except OSError as exc:
            problem = f"{directory}: {exc.strerror}"
        except ShardwiseError as exc:  # a model the format cannot describe
            problem = f"{directory}: {exc}"
        if problem is not None and swap:
            hf_target.discard(out)
    problem = launch.first_problem(problem)
    if problem is not None:
        raise ShardwiseError(f"cannot write the model to {problem}")


def _write_config(parallel: Any, directory: Path, files: list[str]) -> None:
    """Rank 0: config.json and, with several files, the index."""
    from safetensors import safe_open

    spec = parallel.model.spec
    (directory / "config.json").write_text(
        json.dumps(hf_config(spec) | {"torch_dtype": str(parallel.model.dtype)[6:]},
                   indent=2), encoding="utf-8")
    if len(files) > 1:
        weight_map = {}
        for name in files:
            with safe_open(str(directory / name), "pt") as f:
                weight_map.update(dict.fromkeys(f.keys(), name))
        (directory / _INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map},
                                                   indent=2), encoding="utf-8")
