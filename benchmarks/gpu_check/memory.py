"""Memory as the GPU reports it: the runtime's saved bytes and allocator peaks against the
memory model, and transformers' layers against their activation profiles.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from gpu_check.config import PROFILE_TARGET, Context
from gpu_check.kernels import _memory_stats, _release
from gpu_check.notebook import Notebook, _cores, _row_checks, check_item
from shardwise.arch import get_model


def _layer_model(ctx: Context) -> Any:
    """Llama-3-8B cut to 2 layers (dry run: its shape scaled down)."""

    h, a, kv, f, vocab = ctx.sizes.layer_shape
    return replace(get_model("llama3-8b"), name="llama3-8b-2layers", n_layers=2, d_model=h,
                   n_heads=a, n_kv_heads=kv, d_ff=f, vocab=vocab)


def _check_memory(ctx: Context, note: Notebook, spec: Any, seq: int, batch: int) -> None:
    """`check_layout` of `spec` in bf16 on this rank (as `shardwise check` runs it) and the
    allocator's statistics after it."""
    from shardwise.layout import Layout
    from shardwise.runtime import launch
    from shardwise.runtime.measure import check_layout
    from shardwise.runtime.train import TrainConfig

    config = TrainConfig(spec, Layout(), steps=2, seq_len=seq, global_batch=batch,
                         dtype="bf16")
    rows = check_layout(config, steps=2)
    note(f"{spec.name}: rows", [row.as_dict() for row in rows])
    note(f"{spec.name}: memory_stats", _memory_stats(launch.device()))


def layer_memory_rank(ctx: Context, path: str) -> None:
    """The Llama-3-8B layers through `check_layout` (NCCL on one GPU)."""
    import torch

    if not ctx.dry_run:  # the 1.5B-parameter model is drawn on the CPU
        torch.set_num_threads(_cores())
    _check_memory(ctx, Notebook(path), _layer_model(ctx), ctx.sizes.layer_seq, 1)


def tiny_memory_rank(ctx: Context, path: str) -> None:
    """tiny, tiny-moe, tiny-deepseek through `check_layout` (`shardwise check`'s defaults)."""

    note = Notebook(path)
    for model in ctx.sizes.memory_models:
        _check_memory(ctx, note, get_model(model), 64, 8)


def hf_layers_rank(ctx: Context, path: str) -> None:
    """transformers' `LlamaForCausalLM` with the layer model's shapes (2 layers), bf16, one
    forward + backward of the loss per attention implementation (`_hf_step`)."""
    import transformers

    note = Notebook(path)
    note("transformers", transformers.__version__)
    for attention in ("sdpa", "eager"):
        note(attention, _hf_step(ctx, attention))
        _release(ctx.device())


def _hf_step(ctx: Context, attention: str) -> dict[str, Any]:
    """Bytes each layer saves (`runtime.measure.saved_bytes_per_layer`), allocated by the
    forward, and the forward + backward peak above the weights (GPU)."""
    import torch
    import transformers

    from shardwise.runtime.measure import saved_bytes_per_layer

    device, spec, seq = ctx.device(), _layer_model(ctx), ctx.sizes.layer_seq
    config = transformers.LlamaConfig(
        hidden_size=spec.d_model, num_attention_heads=spec.n_heads,
        num_key_value_heads=spec.n_kv_heads, intermediate_size=spec.d_ff, num_hidden_layers=2,
        vocab_size=spec.vocab, max_position_embeddings=max(seq, 4096),
        attn_implementation=attention)
    torch.manual_seed(0)
    with device:  # drawn where it runs (1.5B parameters: seconds on a GPU)
        model = transformers.LlamaForCausalLM(config)
    model = model.to(torch.bfloat16).train()
    _release(device)  # the fp32 draw's blocks
    ids = torch.randint(0, spec.vocab, (1, seq), device=device)
    gpu = device.type == "cuda"
    if gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if gpu else 0
    outputs: list[Any] = []
    saved = saved_bytes_per_layer(model, list(model.model.layers),
                                  lambda: outputs.append(model(input_ids=ids, labels=ids)))
    after = torch.cuda.memory_allocated() if gpu else 0
    outputs[0].loss.backward()
    result = {"saved_per_layer": saved, "weights_bytes": sum(
        p.numel() * p.element_size() for p in model.parameters())}
    if gpu:
        result |= {"allocated_by_forward": after - before,
                   "peak_above_weights": torch.cuda.max_memory_allocated() - before,
                   "memory_stats": _memory_stats(device)}
    return result


def memory_checks(items: dict[str, Any], spec: Any, seq: int, batch: int
                  ) -> list[dict[str, Any]]:
    """The rows of a `check_layout` of `batch` sequences (targets as `shardwise check`), the
    measured bytes saved per layer and micro-batch (of 1 sequence, `Layout`'s default)
    against every activation profile (reported: the runtime saves `shardwise`'s), and the
    allocator's reserved peak against its allocated one and the modelled peak."""
    from shardwise.estimate.memory import training_memory_per_gpu
    from shardwise.estimate.profiles import profile_names, saved_tensors
    from shardwise.layout import Layout, TrainSpec

    rows = items.get(f"{spec.name}: rows") or []
    checks = _row_checks(spec.name, rows)
    layers: dict[int, float] = {}  # a MoE layer's rows: "layer k attention", "layer k MoE"
    for row in rows:
        if row["item"] == "activations" and row["what"].startswith("layer "):
            k = int(row["what"].split()[1])
            layers[k] = layers.get(k, 0.0) + row["measured"]
    for k, measured in layers.items():
        for impl in profile_names():
            predicted = sum(saved_tensors(impl, spec, seq, 1, flash=True, dtype_bytes_=2,
                                          moe=spec.is_moe_layer(k)).values())
            checks.append(check_item(f"{spec.name}: layer {k} saved vs the {impl} profile",
                                     abs(measured / predicted - 1), None,
                                     f"measured {measured:.0f} B (the runtime), profile "
                                     f"{predicted:.0f} B"))
    stats = items.get(f"{spec.name}: memory_stats") or {}
    if stats.get("reserved_bytes.all.peak"):
        peak, reserved = stats["allocated_bytes.all.peak"], stats["reserved_bytes.all.peak"]
        stage = training_memory_per_gpu(spec, Layout(), TrainSpec(
            seq_len=seq, global_batch=batch, dtype="bf16", impl="shardwise"))[0]
        terms = ", ".join(f"{k} {v / 2**30:.2f}" for k, v in
                          (*stage.as_dict().items(), *stage.transients) if v)
        checks.append(check_item(f"{spec.name}: peak reserved / peak allocated − 1",
                                 reserved / peak - 1, None,
                                 f"allocated {peak / 2**30:.2f} GiB, reserved "
                                 f"{reserved / 2**30:.2f} GiB (the allocator's cache and "
                                 f"fragmentation: what nvidia-smi adds)"))
        checks.append(check_item(f"{spec.name}: peak reserved vs the modelled peak",
                                 abs(reserved / stage.peak - 1), None,
                                 f"reserved {reserved / 2**30:.2f} GiB, modelled peak "
                                 f"{stage.peak / 2**30:.2f} GiB (peak term {stage.peak_term}, "
                                 f"transient {stage.peak_transient or 'none'}; GiB: {terms})"))
    return checks


def hf_checks(items: dict[str, Any], spec: Any, seq: int) -> list[dict[str, Any]]:
    """transformers' second layer against its profile (target 1 %, as measured on CPU by
    tests/estimate/test_profiles_measured.py), and the peak against the modelled one."""
    from shardwise.estimate.memory import training_memory_per_gpu
    from shardwise.estimate.profiles import saved_tensors
    from shardwise.layout import Layout, TrainSpec

    checks = []
    for attention, impl in (("sdpa", "hf-sdpa"), ("eager", "hf-eager")):
        got = items.get(attention)
        if not got:
            continue
        predicted = sum(saved_tensors(impl, spec, seq, 1, dtype_bytes_=2).values())
        measured = got["saved_per_layer"][1]  # layer 0 also holds the shared RoPE tables
        checks.append(check_item(f"transformers {attention}: layer 1 saved vs {impl}",
                                 abs(measured / predicted - 1), PROFILE_TARGET,
                                 f"measured {measured:.0f} B, profile {predicted:.0f} B"))
        if "peak_above_weights" in got:
            stage = training_memory_per_gpu(spec, Layout(), TrainSpec(
                seq_len=seq, global_batch=1, dtype="bf16", impl=impl))[0]
            held = stage.activations + stage.logits
            checks.append(check_item(
                f"transformers {attention}: allocated by the forward vs modelled",
                abs(got["allocated_by_forward"] / held - 1), None,
                f"measured {got['allocated_by_forward'] / 2**30:.2f} GiB; modelled "
                f"{held / 2**30:.2f} GiB = the {impl} profile's activations of 2 layers, the "
                "final norm's input and the fp32 logits (estimate/memory.py)"))
            modelled = (stage.grads + stage.activations + stage.logits
                        + max(v for k, v in stage.transients if k != "optimizer step"))
            checks.append(check_item(
                f"transformers {attention}: forward + backward peak above the weights vs "
                "modelled", abs(got["peak_above_weights"] / modelled - 1), None,
                f"measured {got['peak_above_weights'] / 2**30:.2f} GiB; modelled "
                f"{modelled / 2**30:.2f} GiB = grads + activations + logits + the largest "
                f"transient (estimate/memory.py; peak term {stage.peak_transient})"))
    return checks


