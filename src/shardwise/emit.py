"""Launch configuration of a layout for a real framework: go from the plan to a run.

    emit(framework, model, layout, train, gpus_per_node=8, cluster=None) -> Emitted(text, notes)

The plan's stack (`TrainSpec.impl`) must be the framework's (`Stack.export`): the search
already took only what that stack runs. Each exporter targets one framework version and is
tested against that version's own parser (tests/integration):

* `megatron` — Megatron-LM main (d98e8a6) `pretrain_gpt.py`: a shell script with the
  environment, a `torchrun` line and every argument the plan assumes (model shape, vocabulary,
  degrees, virtual stages or an explicit pipeline layout, SP, recompute, ZeRO as the
  distributed optimizer or Megatron-FSDP and their shard groups, precision and gradient
  dtype, the stack's overlap settings, attention backend).
* `torchtitan` — torchtitan 0.3.0: `torchrun -m torchtitan.train --module … --config …` plus
  `--section.key value` overrides and the `activation-checkpoint:<mode>` subcommand.
* `deepspeed` — a DeepSpeed 0.19.8 JSON config (batch, ZeRO stage, precision, gradient
  accumulation and communication dtypes, overlap); the Megatron-DeepSpeed (4efb479)
  `pretrain_gpt.py` launch line is the first note.

Exact or refused: the configuration runs every planned value, or `ShardwiseError` says in one
line what the framework cannot run, the nearest layout it runs and that layout's predicted
step time (`nearest`). docs/howto/export.md lists what each export runs and refuses.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, fields

from shardwise.arch import ModelSpec
from shardwise.errors import ShardwiseError
from shardwise.hardware import Cluster
from shardwise.layout import Layout, TrainSpec
from shardwise.schedules.registry import get_schedule
from shardwise.stacks import STACKS, Stack, stack_split, titan_partition

FRAMEWORKS = ("megatron", "torchtitan", "deepspeed")
VERSIONS = {"megatron": "Megatron-LM main d98e8a6", "torchtitan": "torchtitan 0.3.0",
            "deepspeed": "DeepSpeed 0.19.8 with Megatron-DeepSpeed 4efb479"}

__all__ = ["FRAMEWORKS", "VERSIONS", "Emitted", "deepspeed_config", "emit", "framework_stack",
           "layout_text", "megatron_args", "model_refusal", "nearest", "torchtitan_args",
           "unrunnable"]


@dataclass(frozen=True)
class Emitted:
    """The configuration text and what else the run needs (DeepSpeed: the launch line)."""

    framework: str
    text: str
    notes: tuple[str, ...] = ()


def framework_stack(framework: str) -> Stack:
    """The stack whose export `framework` is (`Stack.export`)."""
    key = framework.lower()
    for stack in STACKS.values():
        if stack.export == key:
            return stack
    raise ShardwiseError(f"unknown framework {framework!r}; valid: {', '.join(FRAMEWORKS)}")


def layout_text(layout: Layout) -> str:
    """`layout` as `--layout` text: every field but dp that differs from `Layout()`."""
    default = Layout()
    parts = []
    for f in fields(Layout):
        value = getattr(layout, f.name)
        if f.name == "dp" or value == getattr(default, f.name):
            continue
        if f.name == "partition":
            parts.append("partition=" + ":".join(map(str, value)))
        else:
            parts.append(f"{f.name}={int(value) if isinstance(value, bool) else value}")
    return ",".join(parts) or "dp only"


# ------------------------------------------------------------------------------- refusals
def _vocab_problems(framework: str, model: ModelSpec, layout: Layout) -> list[str]:
    """Megatron's vocabulary-parallel embedding splits V evenly over tp and pads V up to a
    multiple of `make_vocab_size_divisible_by · tp` (Megatron-LM megatron/training/tokenizer
    `_vocab_size_with_padding`; Megatron-DeepSpeed megatron/tokenizer/tokenizer.py:58): V % tp
    rows more than the plan counts."""
    if framework == "torchtitan" or model.vocab % layout.tp == 0:
        return []
    padded = -(-model.vocab // layout.tp) * layout.tp
    return [f"{framework} splits the vocabulary evenly over tp={layout.tp}: it pads "
            f"{model.vocab} to {padded} rows, which the plan does not count (plan a model with "
            f"vocab {padded} to run this layout)"]


def model_refusal(framework: str, model: ModelSpec, train: TrainSpec) -> str | None:
    """What no layout fixes: the framework does not run this model as planned (the stack's
    dtypes are checked by `TrainSpec.validate`)."""
    if framework == "torchtitan":
        if model.name not in _TITAN_CONFIGS:
            return (f"torchtitan 0.3.0 ships no {model.name} model (its llama3 configs fit "
                    f"{', '.join(_TITAN_CONFIGS)}); plan with --impl megatron-te for Megatron-LM")
        if model.name == "llama3-405b" and train.fp8 != "rowwise":
            return ("torchtitan 0.3.0's llama3_405b config trains its linear layers in Float8 "
                    "(rowwise) under torch.compile (models/llama3/config_registry.py): plan it "
                    "with --fp8 rowwise --compile, or with --impl megatron-te for Megatron-LM")
    if framework in ("megatron", "deepspeed"):
        name = VERSIONS[framework]
        if model.alibi:
            return (f"{model.name} adds ALiBi attention biases, which {name} has no option for "
                    "(its positions are learned or rotary): an export would train another model")
        if model.parallel_residual:
            return (f"{model.name} runs attention and MLP side by side on one normalised input "
                    f"(GPT-NeoX's use_parallel_residual), which {name}'s block does not: an "
                    "export would train another model")
    if framework == "deepspeed" and model.is_moe:
        return ("Megatron-DeepSpeed's MoE is DeepSpeed-MoE (capacity-factor token dropping and "
                "experts replicated over tensor-parallel ranks by default, megatron/arguments.py:"
                "910-919 @4efb479), which the megatron-deepspeed stack does not model; plan "
                "with --impl megatron-te for Megatron-LM")
    return None


def _refusals(framework: str | None, model: ModelSpec, layout: Layout, train: TrainSpec
              ) -> list[str]:
    """Everything the run's stack (and `framework`'s export of it) cannot run of this valid
    layout and run, one sentence each."""
    out = train.stack.layout_problems(layout, model.n_layers, train)
    if framework in ("torchtitan", "deepspeed") and layout.expert_tp != layout.tp:
        out.append(f"{VERSIONS[framework]} has no expert tensor parallelism (etp={layout.etp} "
                   f"≠ tp={layout.tp}); use etp=0")
    return out if framework is None else out + _vocab_problems(framework, model, layout)


def _edits(stack: Stack, model: ModelSpec, layout: Layout) -> Iterator[Layout]:
    """`layout` changed toward what `stack` runs, one choice at a time: each schedule, ZeRO
    stage and recompute policy it has, no shard groups, SP toggled, a degree folded into data
    parallelism or (tp, cp) into pipeline stages, the default or the stack's own partition."""
    for name in stack.schedules():
        if layout.pp > 1 and name != layout.schedule:
            chunks = (layout.chunks if layout.chunks > 1 else next(
                (v for v in range(2, model.n_layers + 1)
                 if model.n_layers % (layout.pp * v) == 0), 2)
                      ) if get_schedule(name).chunked else 1
            yield layout.with_(schedule=name, chunks=chunks)
    for z in stack.zero:
        if z != layout.zero:
            keep = layout.zero_group if z in stack.zero_hybrid else 0
            yield layout.with_(zero=z, zero_group=keep if z else 0)
    if layout.zero_group:
        yield layout.with_(zero_group=0)
    for name in stack.recompute:
        if name != layout.recompute:
            yield layout.with_(recompute=name)
    if layout.tp > 1:
        yield layout.with_(sp=not layout.sp)
    for axis in ("tp", "cp", "ep", "pp"):
        degree = getattr(layout, axis)
        if degree > 1:
            changes: dict[str, object] = {axis: 1}
            if axis == "tp":
                changes["sp"] = False
            if axis == "pp":
                changes.update(schedule="1f1b", chunks=1, partition=())
            yield layout.with_(**changes)
            if axis in ("tp", "cp") and layout.pp * degree <= model.n_layers:  # into stages
                yield layout.with_(**{axis: 1, "pp": layout.pp * degree, "partition": (),
                                      "sp": layout.sp and axis == "cp"})
    if layout.partition:
        yield layout.with_(partition=())
    own = stack_split(stack.split, model.n_layers, layout.pp)
    if layout.pp > 1 and layout.chunks == 1 and own and own != layout.stage_partition(
            model.n_layers):
        yield layout.with_(partition=own)


def nearest(framework: str | None, model: ModelSpec, layout: Layout, train: TrainSpec,
            cluster: Cluster, depth: int = 3) -> tuple[Layout, float, bool] | None:
    """The layout `framework`'s export (None: the run's stack) runs that is reached from
    `layout` by at most `depth` edits of distinct fields (`_edits`; dp takes the GPUs left)
    and differs from it in the fewest fields, one that fits in memory before one that does
    not, then the fastest: (layout, predicted step time in s, fits); None when none is."""
    from shardwise.plan.evaluate import evaluate_layout

    edits = [(_changed(layout, new), new) for new in _edits(train.stack, model, layout)]
    found: dict[Layout, int] = {}
    for k in range(1, depth + 1):
        for combo in itertools.combinations(edits, k):
            touched = [name for names, _ in combo for name in names]
            if len(touched) != len(set(touched)):  # two edits of one field
                continue
            cand = layout
            for _, new in combo:
                cand = _merge(cand, layout, new)
            if cand in found or cand.problems(model, cluster, train) or _refusals(
                    framework, model, cand, train):
                continue
            found[cand] = len(_changed(layout, cand))
    best: tuple[tuple[bool, int, float], Layout] | None = None
    for distance in sorted(set(found.values())):
        for cand in (c for c, d in found.items() if d == distance):
            entry = evaluate_layout(model, cluster, train, cand, simulate=False)
            key = (not entry.fits, distance, entry.estimate.total)
            if best is None or key < best[0]:
                best = (key, cand)
        if best is not None and not best[0][0]:
            break  # a fitting layout at the fewest changes that have one
    if best is None:
        return None
    entry = evaluate_layout(model, cluster, train, best[1])
    return best[1], entry.estimate.total, entry.fits


def _changed(base: Layout, new: Layout) -> tuple[str, ...]:
    """The fields (dp aside) in which `new` differs from `base`."""
    return tuple(f.name for f in fields(Layout)
                 if f.name != "dp" and getattr(new, f.name) != getattr(base, f.name))


def _merge(current: Layout, base: Layout, changed: Layout) -> Layout:
    """`current` with the fields `changed` changed from `base` (edits applied one after
    another; dp takes the GPUs the other axes leave)."""
    values = {f.name: getattr(current, f.name) for f in fields(Layout)}
    values.update({name: getattr(changed, name) for name in _changed(base, changed)})
    values["dp"] = base.world_size // (values["tp"] * values["pp"] * values["cp"])
    return Layout(**values)


def unrunnable(model: ModelSpec, layout: Layout, train: TrainSpec, cluster: Cluster,
               framework: str | None = None) -> ShardwiseError | None:
    """The one-line refusal of a valid layout the run's stack (with `framework`: that
    framework's export) cannot run — what, the nearest layout it runs and that layout's
    predicted step time — or None when it runs."""
    problems = _refusals(framework, model, layout, train)
    if not problems:
        return None
    who = (f"{framework} ({VERSIONS[framework]})" if framework else
           f"{train.stack.name} ({train.stack.version})")
    head = f"{who} cannot run this layout: {'; '.join(problems)}"
    found = nearest(framework, model, layout, train, cluster)
    if found is None:
        return ShardwiseError(head + "; no layout within three changes runs")
    near, seconds, fits = found
    return ShardwiseError(
        f"{head}; nearest it runs: {near.short()} (--layout {layout_text(near)}), "
        f"{seconds:.3g} s per step predicted{'' if fits else ', over the memory budget'}")


def _checked(framework: str, model: ModelSpec, layout: Layout, train: TrainSpec,
             cluster: Cluster | None, gpus_per_node: int) -> tuple[int, str]:
    """(global batch, gradient dtype) of a layout and run `framework` runs exactly, else the
    refusal."""
    layout.validate(model)
    train.validate()
    if train.global_batch is None:
        raise ShardwiseError("emitting a launch configuration needs a global batch")
    stack = framework_stack(framework)
    if train.stack.name != stack.name:
        own = (f"its own export is --emit {train.stack.export}" if train.stack.export
               else f"{train.stack.name} has no export")
        raise ShardwiseError(
            f"this plan is for the {train.stack.name} stack ({own}); --emit {framework} runs "
            f"{stack.name}: plan with --impl {stack.name}")
    refusal = model_refusal(framework, model, train)
    if refusal:
        raise ShardwiseError(f"{framework} ({VERSIONS[framework]}) cannot run this plan: "
                             f"{refusal}")
    refusal_of_layout = unrunnable(
        model, layout, train, cluster or Cluster.of(layout.world_size, gpus_per_node=min(
            gpus_per_node, layout.world_size)), framework)
    if refusal_of_layout is not None:
        raise refusal_of_layout
    layout.validate(model, train=train)
    return train.global_batch, train.grad_dtype or train.dtype


def _nodes(layout: Layout, gpus_per_node: int) -> tuple[int, int]:
    """(nodes, processes per node) of a `layout.world_size`-rank launch."""
    per_node = min(gpus_per_node, layout.world_size)
    return math.ceil(layout.world_size / per_node), per_node


def _torchrun(layout: Layout, gpus_per_node: int) -> str:
    nodes, per_node = _nodes(layout, gpus_per_node)
    rdzv = " --rdzv-backend c10d --rdzv-endpoint $MASTER_ADDR:29500" if nodes > 1 else ""
    return f"torchrun --nnodes {nodes} --nproc-per-node {per_node}{rdzv}"


def _script(header: str, env: list[str], command: str, args: list[str]) -> str:
    """`export`s, then `command` with one argument per continued line."""
    lines = [header] + [f"export {item}" for item in env] + [command + " \\"]
    lines += [f"  {arg} \\" for arg in args[:-1]] + [f"  {args[-1]}"]
    return "\n".join(lines) + "\n"


def _header(framework: str, model: ModelSpec, layout: Layout, train: TrainSpec, gb: int) -> str:
    return (f"# shardwise: {model.name}, {layout.short()}, s={train.seq_len}, global batch {gb} "
            f"sequences, {train.dtype} — {train.stack.label} for {VERSIONS[framework]}")


def _vocab_divisor(model: ModelSpec, tp: int) -> int:
    """The `--make-vocab-size-divisible-by` that keeps V unpadded: the largest d ≤ 128 with
    `d·tp | V` (Megatron pads V to a multiple of d·tp, default d = 128; V % tp == 0 is
    checked before, `_vocab_problems`)."""
    return math.gcd(model.vocab // tp, 128)


# ----------------------------------------------------------------------------------- Megatron
# `Stack.settings().attention` as Megatron's --attention-backend (megatron-core
# transformer/enums.py AttnBackend): Transformer Engine's cuDNN fused attention is "fused",
# FlashAttention "flash" (TE runs FA3 on Hopper when flash-attn 3 is installed, else FA2), the
# materialised softmax "unfused".
_MEGATRON_ATTENTION = {"cudnn": "fused", "fa2": "flash", "fa3": "flash", "math": "unfused"}


def _megatron_partition(model: ModelSpec, layout: Layout) -> list[str]:
    """Uneven stages: `--decoder-first/last-pipeline-num-layers` when the middle stages are
    equal (per stage over its chunks), else `--pipeline-model-parallel-layout` with every
    virtual stage's layers (megatron-core transformer/pipeline_parallel_layer_layout.py: stages
    in virtual-stage order `c·pp + i`, `E` the embedding on the first, `L` the loss on the
    last)."""
    parts = layout.stage_layers(model.n_layers)
    if len(set(parts)) == 1 and not layout.virtual_stages:
        return []
    first, *middle, last = parts
    if len(set(middle)) <= 1 and not layout.virtual_stages:
        return [f"--decoder-first-pipeline-num-layers {first}",
                f"--decoder-last-pipeline-num-layers {last}"]
    sizes = layout.stage_sizes(model.n_layers)
    stages = [f"t*{n}" if n else "" for n in sizes]
    stages[0], stages[-1] = "E" + stages[0], stages[-1] + "L"
    return [f"--pipeline-model-parallel-layout '{'|'.join(stages)}'"]


# `Layout.cp_kind` as Megatron-Core's `cp_comm_type` (transformer_config.py, 0.16.1): ring
# attention "p2p", Ulysses "a2a", the hybrid "a2a+p2p" (all-to-all inside, ring across).
_MEGATRON_CP = {"ring": "p2p", "ulysses": "a2a", "hybrid": "a2a+p2p", "allgather": "all_gather"}


def _megatron_deepseek(model: ModelSpec, notes: list[str]) -> list[str]:
    """Multi-head latent attention and DeepSeekMoE as Megatron-LM arguments (MLATransformerConfig
    and TransformerConfig fields of megatron-core 0.16.1, their flags in Megatron-LM's
    arguments.py): `--multi-latent-attention`, the latent ranks and head widths (Megatron's
    `qk_head_dim` is the no-RoPE part, `qk_pos_emb_head_dim` the RoPE part), the latent norms
    (`--qk-layernorm`: MLA's up-projections fuse them), YaRN (`--rotary-scaling-factor`,
    `--mscale`, `--mscale-all-dim`; its other constants are MLATransformerConfig's defaults,
    DeepSeek's), the dense first layers (`--moe-layer-freq` as a pattern), shared experts (one
    MLP of `n_shared · f`), the router (score function; expert bias for sigmoid; scaling;
    group-limited top-k) and `--mtp-num-layers`. Refused in one line: what Megatron's router
    cannot compute (sigmoid gates left unnormalised: it normalises top-k > 1)."""
    args: list[str] = []
    if model.is_mla:
        args += ["--multi-latent-attention", f"--kv-lora-rank {model.kv_lora_rank}",
                 f"--qk-head-dim {model.qk_nope_head_dim}",
                 f"--qk-pos-emb-head-dim {model.qk_rope_head_dim}",
                 f"--v-head-dim {model.value_head_dim}", "--qk-layernorm"]
        if model.q_lora_rank:
            args.append(f"--q-lora-rank {model.q_lora_rank}")
        rope = dict(model.rope_scaling)
        if model.rope_type == "yarn":
            if (rope.get("beta_fast", 32), rope.get("beta_slow", 1),
                    rope.get("original_max_position_embeddings", 4096)) != (32, 1, 4096):
                raise ShardwiseError(
                    f"{model.name}'s YaRN beta_fast/beta_slow/original_max_position_embeddings "
                    "differ from Megatron-LM's fixed MLA defaults (32, 1, 4096), which it "
                    "has no flags for")
            args += ["--rope-type yarn", f"--rotary-scaling-factor {rope.get('factor', 1.0):g}",
                     f"--mscale {rope.get('mscale', 1.0):g}",
                     f"--mscale-all-dim {rope.get('mscale_all_dim', 0.0):g}"]
        elif model.rope_type != "default":
            raise ShardwiseError(f"Megatron-LM's MLA has no {model.rope_type} RoPE scaling "
                                 "(rope or yarn)")
        else:
            args.append("--rope-type rope")
    if model.is_moe and (model.first_dense_layers or model.moe_every > 1):
        pattern = ",".join(str(int(model.is_moe_layer(i))) for i in range(model.n_layers))
        args.append(f"--moe-layer-freq '[{pattern}]'")
    if model.n_shared_experts:
        args.append("--moe-shared-expert-intermediate-size "
                    f"{model.n_shared_experts * model.expert_d_ff}")
    if model.is_moe and model.router_score == "sigmoid":
        if not model.norm_topk and model.top_k > 1:
            raise ShardwiseError("Megatron-LM normalises sigmoid top-k gates (moe_utils."
                                 "topk_routing_with_score_function); this model leaves them "
                                 "unnormalised (norm_topk_prob false)")
        args += ["--moe-router-score-function sigmoid", "--moe-router-enable-expert-bias"]
    elif model.is_moe and not model.norm_topk:
        args.append("--moe-router-pre-softmax")  # softmax over all experts, then top-k
    if model.is_moe and model.routed_scaling != 1.0:
        args.append(f"--moe-router-topk-scaling-factor {model.routed_scaling:g}")
    if model.is_moe and model.expert_groups > 1:
        args += [f"--moe-router-num-groups {model.expert_groups}",
                 f"--moe-router-group-topk {model.topk_groups}"]
    if model.mtp_layers:
        args.append(f"--mtp-num-layers {model.mtp_layers}")
        notes.append(f"--mtp-num-layers {model.mtp_layers}: Megatron trains the multi-token-"
                     "prediction module(s) too; the plan counts their parameters apart "
                     "(ModelSpec.mtp_params) and not their time or memory")
    return args


def _megatron_fp8_offload(train: TrainSpec) -> list[str]:
    """`--fp8-format hybrid --fp8-recipe R` (delayed: the amax history the plan assumes) and
    the optimizer offload (`--optimizer-cpu-offload`, which needs
    `--use-precision-aware-optimizer`; `--overlap-cpu-optimizer-d2h-h2d`, the pipelining the
    plan assumes; `--optimizer-offload-fraction`). A recipe or offload Megatron-LM does not
    have: one line (`Stack.fp8_recipe`, `Stack.offload_support`)."""
    args: list[str] = []
    if train.fp8 is not None:
        recipe = train.stack.fp8_recipe(train.fp8)
        args += ["--fp8-format hybrid", f"--fp8-recipe {recipe.name}"]
        if recipe.history:
            args += [f"--fp8-amax-history-len {recipe.history}", "--fp8-amax-compute-algo max"]
    if train.stack.offload_support(train.offload) is not None:
        args += ["--optimizer-cpu-offload", "--use-precision-aware-optimizer",
                 "--overlap-cpu-optimizer-d2h-h2d"]
        if train.offload_fraction < 1:
            args.append(f"--optimizer-offload-fraction {train.offload_fraction:g}")
    return args


def megatron_args(model: ModelSpec, layout: Layout, train: TrainSpec,
                  gpus_per_node: int = 8, cluster: Cluster | None = None) -> Emitted:
    """Megatron-LM main `pretrain_gpt.py` launch script for `layout`.

    ZeRO-1 is the distributed optimizer; ZeRO-2/3 are Megatron-FSDP's `optim_grads` /
    `optim_grads_params` (it trains fp16 too; `--use-torch-fsdp2` would refuse fp16, pipeline
    parallelism and tied embeddings). Shard groups: `--num-distributed-optimizer-instances`
    (dp·cp / group), HSDP under Megatron-FSDP. Gradients: the distributed optimizer reduces
    bf16 in fp32 unless `--grad-reduce-in-bf16`, fp16 in fp16 unless
    `--accumulate-allreduce-grads-in-fp32`; Megatron-FSDP takes `--megatron-fsdp-main-grads-
    dtype`.
    """
    gb, grad = _checked("megatron", model, layout, train, cluster, gpus_per_node)
    notes: list[str] = []
    args = [f"--num-layers {model.n_layers}", f"--hidden-size {model.d_model}",
            f"--ffn-hidden-size {model.d_ff}", f"--num-attention-heads {model.n_heads}"]
    if model.d_head and model.d_head != model.d_model // model.n_heads:
        args.append(f"--kv-channels {model.d_head}")
    if model.n_kv_heads != model.n_heads:
        args += ["--group-query-attention", f"--num-query-groups {model.n_kv_heads}"]
    if model.gated_mlp:
        args.append("--swiglu")
    args.append("--normalization " + ("RMSNorm" if model.norm == "rmsnorm" else "LayerNorm"))
    if model.learned_positions:
        args.append("--position-embedding-type learned_absolute")
    else:
        args += ["--position-embedding-type rope", f"--rotary-base {int(model.rope_theta)}"]
        if model.rotary_percent != 1.0:
            args.append(f"--rotary-percent {model.rotary_percent:g}")
        if model.rope_type == "llama3":  # Llama 3.1's frequency scaling, factor 8
            args += ["--use-rope-scaling",
                     f"--rope-scaling-factor {dict(model.rope_scaling)['factor']:g}"]
    args += [f"--vocab-size {model.vocab}",
             f"--make-vocab-size-divisible-by {_vocab_divisor(model, layout.tp)}"]
    if not model.tie_embeddings:
        args.append("--untie-embeddings-and-output-weights")
    if not model.bias:
        args.append("--disable-bias-linear")
    if model.qkv_bias:
        args.append("--add-qkv-bias")
    if not model.dropout:
        args += ["--attention-dropout 0.0", "--hidden-dropout 0.0"]
    if model.is_moe:
        args += [f"--num-experts {model.n_experts}", f"--moe-router-topk {model.top_k}",
                 f"--moe-ffn-hidden-size {model.expert_d_ff}"]
        if layout.ep > 1:
            args.append("--moe-token-dispatcher-type alltoall")
    args += _megatron_deepseek(model, notes)
    args += [f"--seq-length {train.seq_len}",
             f"--max-position-embeddings {max(train.seq_len, model.max_seq)}",
             f"--micro-batch-size {layout.micro_batch}", f"--global-batch-size {gb}",
             f"--tensor-model-parallel-size {layout.tp}",
             f"--pipeline-model-parallel-size {layout.pp}"]
    partition = _megatron_partition(model, layout)
    args += partition
    explicit = any(a.startswith("--pipeline-model-parallel-layout") for a in partition)
    if layout.pp > 1 and get_schedule(layout.schedule).chunked and not explicit:
        args.append(f"--num-virtual-stages-per-pipeline-rank {layout.chunks}")
    if layout.cp > 1:  # Megatron-LM arguments.py: --cp-comm-type, and a2a+p2p's group sizes
        args += [f"--context-parallel-size {layout.cp}",
                 f"--cp-comm-type {_MEGATRON_CP[layout.cp_kind]}"]
        if layout.cp_kind == "hybrid":
            args.append(f"--hierarchical-context-parallel-sizes {layout.ulysses} "
                        f"{layout.cp // layout.ulysses}")
    if layout.ep > 1:
        args.append(f"--expert-model-parallel-size {layout.ep}")
    if layout.etp and layout.etp != layout.tp:  # Megatron's default is tp (etp = 0)
        args.append(f"--expert-tensor-parallel-size {layout.etp}")
    if layout.sp:
        args.append("--sequence-parallel")
    settings = train.settings()
    if settings.tp_overlap == "bulk" and layout.tp > 1:  # TE userbuffers; Megatron requires SP
        if layout.sp:
            args.append("--tp-comm-overlap")
        else:
            notes.append("TP overlap applies with --sequence-parallel only (training/arguments."
                         "py); as planned, this layout's TP communication is charged exposed")
    if layout.recompute == "selective":
        args.append("--recompute-activations")
    elif layout.recompute == "full":
        args += ["--recompute-granularity full", "--recompute-method uniform",
                 "--recompute-num-layers 1"]
    fsdp = layout.zero >= 2
    overlap = ["--overlap-grad-reduce"] if settings.dp_overlapped(layout.zero) else []
    overlap_both = overlap + (["--overlap-param-gather"] if overlap else [])
    instances = (layout.dp * layout.cp // layout.zero_group) if layout.zero_group else 1
    if layout.zero == 0:
        args += overlap
    elif layout.zero == 1:
        args += ["--use-distributed-optimizer", *overlap_both]
    else:
        strategy = "optim_grads" if layout.zero == 2 else "optim_grads_params"
        args += ["--use-megatron-fsdp", f"--data-parallel-sharding-strategy {strategy}",
                 "--ckpt-format fsdp_dtensor", *overlap_both]
    if instances > 1:  # ZeRO-1 in groups; Megatron-FSDP: HSDP, replicas across the groups
        args.append(f"--num-distributed-optimizer-instances {instances}")
    args += {"bf16": ["--bf16"], "fp16": ["--fp16"], "fp32": []}[train.dtype]
    if fsdp:
        args.append(f"--megatron-fsdp-main-grads-dtype {grad}")
    elif train.dtype == "bf16" and grad == "bf16":
        args.append("--grad-reduce-in-bf16")
    elif train.dtype == "fp16" and grad == "fp32":
        args.append("--accumulate-allreduce-grads-in-fp32")
    args.append(f"--attention-backend {_MEGATRON_ATTENTION[settings.attention]}")
    args += _megatron_fp8_offload(train)
    # Megatron orders TP/CP communication before compute with one hardware queue; FSDP
    # asserts it is not set (training/arguments.py validate_args)
    env = ["CUDA_DEVICE_MAX_CONNECTIONS=1"] if (layout.tp > 1 or layout.cp > 1) and not fsdp \
        else []
    text = _script(_header("megatron", model, layout, train, gb), env,
                   _torchrun(layout, gpus_per_node) + " pretrain_gpt.py", args)
    return Emitted("megatron", text, tuple(notes))


# --------------------------------------------------------------------------------- torchtitan
# torchtitan ships these models as `--module llama3 --config <name>` (models/llama3/
# config_registry.py); each has the preset's shape.
_TITAN_CONFIGS = {"llama3-8b": ("llama3", "llama3_8b"), "llama3-70b": ("llama3", "llama3_70b"),
                  "llama3-405b": ("llama3", "llama3_405b")}
# `Layout.recompute` as torchtitan's activation-checkpoint subcommand
# (distributed/activation_checkpoint.py): op-sac is SelectiveAC ("selective").
_TITAN_RECOMPUTE = {"none": "none", "full": "full", "op-sac": "selective"}


def _titan_fp8_offload(config: str, train: TrainSpec, notes: list[str]) -> list[str]:
    """FSDP2 CPU offload (`--training.enable_cpu_offload`) and FP8: torchtitan 0.3 applies
    Float8 through a config_registry function's `model_registry(converters=…)`, not a flag;
    llama3_405b's is `Float8LinearConverter.Config(filter_fqns=["lm_head"])` (rowwise, the
    head in bf16). Another recipe or config: one line."""
    args = ["--training.enable_cpu_offload"] if train.offload == "params" else []
    train.stack.offload_support(train.offload)  # one line when torchtitan has no such offload
    if train.fp8 is None:
        return args
    train.stack.fp8_recipe(train.fp8)
    if config != "llama3_405b" or train.fp8 != "rowwise":
        raise ShardwiseError(
            f"torchtitan 0.3 turns on FP8 ({train.fp8}) in a config function "
            "(model_registry(..., converters=[Float8LinearConverter.Config(recipe_name=…)])), "
            "not on the command line; only its llama3_405b config has one (rowwise): write "
            "your own, or emit for Megatron-LM")
    notes.append("llama3_405b's Float8 converter leaves lm_head in bf16 (filter_fqns); the "
                 "plan charged the head's GEMMs in FP8")
    return args


def torchtitan_args(model: ModelSpec, layout: Layout, train: TrainSpec,
                    gpus_per_node: int = 8, cluster: Cluster | None = None) -> Emitted:
    """torchtitan 0.3.0 `torchrun -m torchtitan.train` command line for `layout`.

    FSDP2 wraps every run (models/llama3/parallelize.py): ZeRO-0 replicates
    (`data_parallel_replicate_degree`), ZeRO-2/3 shard over the group and reshard after
    forward never / always, HSDP across the groups; gradients reduce in float32.
    """
    gb, _ = _checked("torchtitan", model, layout, train, cluster, gpus_per_node)
    module, config = _TITAN_CONFIGS[model.name]
    group = (layout.zero_group or layout.dp * layout.cp) if layout.zero else layout.cp
    shard = group // layout.cp
    replicate = layout.dp // shard
    # Without pp, local_batch_size is the micro-batch and torchtitan accumulates gradients up
    # to global_batch_size; with pp, one local batch is split into pipeline micro-batches.
    local = gb // layout.dp if layout.pp > 1 else layout.micro_batch
    precision = "bfloat16" if train.dtype == "bf16" else "float32"
    settings = train.settings()
    args = [f"--module {module}", f"--config {config}",
            f"--training.local_batch_size {local}", f"--training.global_batch_size {gb}",
            f"--training.seq_len {train.seq_len}",
            f"--training.mixed_precision_param {precision}",
            "--training.mixed_precision_reduce float32"]
    if layout.pp > 1 or layout.ep > 1:
        args.append("--training.disable_cuda_graphs")
    args += [f"--parallelism.data_parallel_replicate_degree {replicate}",
             f"--parallelism.data_parallel_shard_degree {shard}",
             "--parallelism.fsdp_reshard_after_forward "
             + ("always" if layout.zero == 3 else "never"),
             f"--parallelism.tensor_parallel_degree {layout.tp}",
             f"--parallelism.pipeline_parallel_degree {layout.pp}",
             f"--parallelism.context_parallel_degree {layout.cp}",
             f"--parallelism.expert_parallel_degree {layout.ep}"]
    if layout.tp > 1:
        args.append("--parallelism." + ("" if layout.sp else "no_") + "enable_sequence_parallel")
    if layout.pp > 1:
        split = titan_partition(model.n_layers, layout.stage_sizes(model.n_layers))
        assert split is not None  # the stack's split rule passed (`_refusals`)
        per_stage, first_less, last_less = split
        name = get_schedule(layout.schedule).torchtitan
        args += [f"--parallelism.pipeline_parallel_schedule {name}",
                 f"--parallelism.pipeline_parallel_microbatch_size {layout.micro_batch}",
                 f"--parallelism.pipeline_parallel_layers_per_stage {per_stage}",
                 f"--parallelism.pipeline_parallel_first_stage_less_layers {first_less}",
                 f"--parallelism.pipeline_parallel_last_stage_less_layers {last_less}"]
    if settings.compile:
        args.append("--compile.enable")
        if settings.tp_overlap == "async" and layout.tp > 1:
            args.append("--compile.enable_async_tensor_parallel")
    notes: list[str] = []
    args += _titan_fp8_offload(config, train, notes)
    args.append(f"activation-checkpoint:{_TITAN_RECOMPUTE[layout.recompute]}")
    text = _script(_header("torchtitan", model, layout, train, gb), [],
                   _torchrun(layout, gpus_per_node) + " -m torchtitan.train", args)
    return Emitted("torchtitan", text, tuple(notes))


# ---------------------------------------------------------------------------------- DeepSpeed
def _deepspeed_launch(model: ModelSpec, layout: Layout, train: TrainSpec, gb: int) -> list[str]:
    """Megatron-DeepSpeed `pretrain_gpt.py` arguments (megatron/arguments.py @4efb479) for
    the model, the degrees, the schedule, recompute, precision and attention."""
    args = [f"--num-layers {model.n_layers}", f"--hidden-size {model.d_model}",
            f"--ffn-hidden-size {model.d_ff}", f"--num-attention-heads {model.n_heads}",
            f"--num-key-value-heads {model.n_kv_heads}",
            f"--seq-length {train.seq_len}",
            f"--max-position-embeddings {max(train.seq_len, model.max_seq)}",
            f"--make-vocab-size-divisible-by {_vocab_divisor(model, layout.tp)}",
            "--normalization " + ("rmsnorm" if model.norm == "rmsnorm" else "layernorm")]
    if model.gated_mlp:
        args.append("--swiglu")
    if not model.learned_positions:
        args += ["--use-rotary-position-embeddings", "--no-position-embedding",
                 f"--rotary-position-embeddings-theta {int(model.rope_theta)}"]
        if model.rotary_percent != 1.0:
            args.append(f"--rotary-percent {model.rotary_percent:g}")
    if not model.tie_embeddings:
        args.append("--untie-embeddings-and-output-weights")
    if not model.bias:
        args.append("--disable-bias-linear")
    if not model.dropout:
        args += ["--attention-dropout 0.0", "--hidden-dropout 0.0"]
    args += [f"--micro-batch-size {layout.micro_batch}", f"--global-batch-size {gb}",
             f"--tensor-model-parallel-size {layout.tp}",
             f"--pipeline-model-parallel-size {layout.pp}", f"--zero-stage {layout.zero}"]
    if layout.pp == 1:  # DeepSpeedEngine, not the pipeline engine (which refuses ZeRO-2/3)
        args.append("--no-pipeline-parallel")
    elif layout.schedule == "zb-h1":
        args.append("--enable-zbh1-pipeline")
    if layout.sp:
        args.append("--sequence-parallel")
    if layout.cp > 1:
        args.append(f"--ds-sequence-parallel-size {layout.cp}")
    if layout.recompute == "full":
        args += ["--recompute-granularity full", "--recompute-method uniform",
                 "--recompute-num-layers 1"]
    elif layout.recompute == "selective":
        args.append("--recompute-activations")
    args += {"bf16": ["--bf16"], "fp16": ["--fp16"], "fp32": []}[train.dtype]
    if train.settings().attention == "fa2":
        args.append("--use-flash-attn-v2")
    return [*args, "--deepspeed", "--deepspeed_config ds_config.json"]


def _deepspeed_offload(train: TrainSpec, zero: dict[str, object]) -> None:
    """ZeRO-Offload (`offload_optimizer`) and ZeRO-Infinity's parameter offload
    (`offload_param`, with the optimizer) to pinned CPU memory, in `zero_optimization`
    (deepspeed/runtime/zero/offload_config.py). FP8: DeepSpeed's stack here has none (one
    line, `Stack.fp8_recipe`)."""
    if train.fp8 is not None:
        train.stack.fp8_recipe(train.fp8)
    support = train.stack.offload_support(train.offload)
    if support is None:
        return
    cpu = {"device": "cpu", "pin_memory": True}
    zero["offload_optimizer"] = dict(cpu)
    if support.kind == "params":
        zero["offload_param"] = dict(cpu)


def deepspeed_config(model: ModelSpec, layout: Layout, train: TrainSpec,
                     gpus_per_node: int = 8, cluster: Cluster | None = None) -> Emitted:
    """A DeepSpeed 0.19.8 JSON config for `layout`; the Megatron-DeepSpeed launch line is the
    first note (the tokenizer and data are the user's: its vocabulary must be the plan's V)."""
    gb, grad = _checked("deepspeed", model, layout, train, cluster, gpus_per_node)
    zero: dict[str, object] = {"stage": layout.zero,
                               "overlap_comm": bool(train.settings().dp_overlapped(layout.zero)),
                               "contiguous_gradients": True,
                               "reduce_bucket_size": int(5e8), "allgather_bucket_size": int(5e8)}
    if layout.zero == 3:
        zero.update({"stage3_prefetch_bucket_size": int(5e8),
                     "stage3_param_persistence_threshold": int(1e6)})
    _deepspeed_offload(train, zero)
    config: dict[str, object] = {
        "train_batch_size": gb,
        "train_micro_batch_size_per_gpu": layout.micro_batch,
        "gradient_accumulation_steps": layout.microbatches(train),
        "gradient_clipping": 1.0,
        "zero_optimization": zero,
        "data_types": {"grad_accum_dtype": grad},
        "communication_data_type": grad,
        "steps_per_print": 10,
        "wall_clock_breakdown": False,
    }
    if train.dtype == "fp16":
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    elif train.dtype == "bf16":
        config["bf16"] = {"enabled": True}
    nodes, per_node = _nodes(layout, gpus_per_node)
    # Megatron-DeepSpeed raises without it under SP (megatron/arguments.py:403 @4efb479)
    env = "CUDA_DEVICE_MAX_CONNECTIONS=1 " if layout.sp else ""
    notes = [f"launch (Megatron-DeepSpeed 4efb479): {env}deepspeed --num_nodes {nodes} "
             f"--num_gpus {per_node} pretrain_gpt.py "
             + " ".join(_deepspeed_launch(model, layout, train, gb))]
    if env and nodes > 1:
        notes.append("on the other nodes CUDA_DEVICE_MAX_CONNECTIONS=1 comes from "
                     ".deepspeed_env (the launcher forwards only its listed variables, "
                     "deepspeed/launcher/runner.py:36)")
    return Emitted("deepspeed", json.dumps(config, indent=2) + "\n", tuple(notes))


def emit(framework: str, model: ModelSpec, layout: Layout, train: TrainSpec,
         gpus_per_node: int = 8, cluster: Cluster | None = None) -> Emitted:
    """The launch configuration of `layout` for `framework` (one of `FRAMEWORKS`), whose stack
    `train` must name; `cluster` prices the nearest layout of a refusal (default: H100s)."""
    table = {"megatron": megatron_args, "torchtitan": torchtitan_args,
             "deepspeed": deepspeed_config}
    key = framework.lower()
    if key not in table:
        raise ShardwiseError(f"unknown framework {framework!r}; valid: {', '.join(FRAMEWORKS)}")
    if gpus_per_node < 1:
        raise ShardwiseError(f"gpus_per_node must be ≥ 1, got {gpus_per_node}")
    return table[key](model, layout, train, gpus_per_node, cluster)
