"""Launch configuration of a layout for a real framework: go from the plan to a run.

    emit(framework, model, layout, train, gpus_per_node=8) -> Emitted(text, notes)

Each exporter targets one named framework version and is tested against that version's own
parser (tests/integration):

* `megatron` — Megatron-LM `pretrain_gpt.py` (main branch, megatron-core 0.16–0.20): a shell
  script with the environment, a `torchrun` line and every argument the plan assumes (model
  shape, rotary base, vocabulary, parallel degrees, virtual stages, SP, recompute, ZeRO through
  the distributed optimizer or Megatron-FSDP, precision and gradient-reduce dtype, attention
  backend).
* `torchtitan` — torchtitan 0.3.x: `torchrun -m torchtitan.train --module … --config …` plus
  `--section.key value` overrides and the `activation-checkpoint:<mode>` subcommand.
* `deepspeed` — a DeepSpeed 0.19.8 JSON config (batch, ZeRO stage and ZeRO++ partition, precision,
  gradient-accumulation and communication dtypes, activation checkpointing); the `deepspeed`
  launch line (Megatron-DeepSpeed flags for TP/PP/sequence parallelism) is the first note.

What a framework cannot run exactly is either refused — `ShardwiseError`, one line, when the run
would need more memory than planned or the framework rejects it — or emitted as the nearest
equivalent with a note saying how the run differs from the plan.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace

from shardwise.arch import ModelSpec
from shardwise.errors import ShardwiseError
from shardwise.layout import Layout, TrainSpec, stage_partition
from shardwise.schedules.registry import get_schedule
from shardwise.stacks import STACKS

FRAMEWORKS = ("megatron", "torchtitan", "deepspeed")
VERSIONS = {"megatron": "Megatron-LM main (megatron-core 0.16-0.20)",
            "torchtitan": "torchtitan 0.3.x", "deepspeed": "DeepSpeed 0.19.8"}

__all__ = ["FRAMEWORKS", "VERSIONS", "Emitted", "deepspeed_config", "emit", "megatron_args",
           "torchtitan_args"]

# Rotary base (`rope_theta`) of the presets, from each model's Hugging Face config.json;
# models not listed use 10000 (the RoPE paper's base, and Megatron's default).
_ROPE_BASE = {"llama3-8b": 500000, "llama3-70b": 500000, "llama3-405b": 500000,
              "mistral-7b": 1000000, "mixtral-8x7b": 1000000, "mixtral-8x22b": 1000000,
              "qwen2.5-7b": 1000000, "qwen2.5-72b": 1000000}


@dataclass(frozen=True)
class Emitted:
    """The configuration text and how the run differs from the plan."""

    framework: str
    text: str
    notes: tuple[str, ...] = ()


def _check(model: ModelSpec, layout: Layout, train: TrainSpec, framework: str = ""
           ) -> tuple[int, str]:
    """Validated (global batch, gradient dtype); `framework` named: one without expert
    tensor parallelism, which refuses etp ≠ tp."""
    layout.validate(model, train=train)
    if framework and layout.expert_tp != layout.tp:
        raise ShardwiseError(f"{framework} has no expert tensor parallelism (etp={layout.etp} "
                             f"≠ tp={layout.tp}); emit it for Megatron-LM, or use etp=0")
    if train.global_batch is None:
        raise ShardwiseError("emitting a launch configuration needs a global batch")
    grad = train.grad_dtype or train.dtype
    for what, dtype in (("dtype", train.dtype), ("grad dtype", grad)):
        if dtype not in ("bf16", "fp16", "fp32"):
            raise ShardwiseError(f"{what} {dtype} has no launch configuration; valid: bf16, "
                                 "fp16, fp32")
    return train.global_batch, grad


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
            f"sequences, {train.dtype} — for {VERSIONS[framework]}")


# ----------------------------------------------------------------------------------- Megatron
def _megatron_vocab(model: ModelSpec, tp: int, notes: list[str]) -> list[str]:
    """`--vocab-size` and a `--make-vocab-size-divisible-by` that keeps it unpadded.

    Megatron pads the vocabulary to a multiple of `make_vocab_size_divisible_by · tp` (default
    128·tp); the largest divisor d ≤ 128 with `d·tp | V` keeps the planned V.
    """
    v = model.vocab
    divisor = math.gcd(v // tp, 128) if v % tp == 0 else 1
    padded = -(-v // (divisor * tp)) * divisor * tp
    if padded != v:
        notes.append(f"Megatron pads the vocabulary {v} to {padded} (a multiple of tp={tp}); "
                     f"embedding and head grow by {padded - v} rows")
    return [f"--vocab-size {v}", f"--make-vocab-size-divisible-by {divisor}"]


def _megatron_partition(model: ModelSpec, layout: Layout) -> list[str]:
    """Uneven stages as Megatron-LM's `--decoder-first-pipeline-num-layers F
    --decoder-last-pipeline-num-layers G` (the middle stages even: megatron-core's
    `num_layers_in_first/last_pipeline_stage`); refused when the middle stages differ. With
    a virtual pipeline the counts are per stage over its chunks, each a multiple of `chunks`
    (`Layout.problems` checks that, as megatron-core does)."""
    parts = tuple(n * layout.chunks for n in layout.stage_partition(model.n_layers))
    if len(set(parts)) == 1:
        return []
    first, *middle, last = parts
    if len(set(middle)) > 1:
        raise ShardwiseError(
            f"Megatron-LM cannot run the partition {','.join(map(str, parts))}: its uneven "
            "stages are a first and a last stage with the middle ones equal")
    return [f"--decoder-first-pipeline-num-layers {first}",
            f"--decoder-last-pipeline-num-layers {last}"]


# `Layout.cp_kind` as Megatron-Core's `cp_comm_type` (transformer_config.py, 0.16.1): ring
# attention "p2p", Ulysses "a2a", the hybrid "a2a+p2p" (all-to-all inside, ring across).
_MEGATRON_CP = {"ring": "p2p", "ulysses": "a2a", "hybrid": "a2a+p2p"}


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
                  gpus_per_node: int = 8) -> Emitted:
    """Megatron-LM `pretrain_gpt.py` launch script for `layout`.

    ZeRO-1 is the distributed optimizer; ZeRO-2/3 are Megatron-FSDP's `optim_grads` /
    `optim_grads_params` strategies (`--use-torch-fsdp2` refuses pipeline parallelism and tied
    embeddings, Megatron-FSDP does not). Gradients: Megatron accumulates and reduces them in
    fp32 for bf16 unless `--grad-reduce-in-bf16` is passed, so a bf16 gradient plan passes it.
    """
    gb, grad = _check(model, layout, train)
    notes: list[str] = []
    args = [f"--num-layers {model.n_layers}", f"--hidden-size {model.d_model}",
            f"--ffn-hidden-size {model.d_ff}", f"--num-attention-heads {model.n_heads}"]
    if model.n_kv_heads != model.n_heads:
        args += ["--group-query-attention", f"--num-query-groups {model.n_kv_heads}"]
    if model.gated_mlp:
        args.append("--swiglu")
    args.append("--normalization " + ("RMSNorm" if model.norm == "rmsnorm" else "LayerNorm"))
    if model.learned_positions:
        args.append("--position-embedding-type learned_absolute")
    else:
        rope = _ROPE_BASE.get(model.name)
        if rope is None:
            rope = 10000
            notes.append(f"rotary base of {model.name} unknown; emitted Megatron's default "
                         "--rotary-base 10000 (set your model's rope_theta)")
        args += ["--position-embedding-type rope", f"--rotary-base {rope}"]
    args += _megatron_vocab(model, layout.tp, notes)
    if not model.tie_embeddings:
        args.append("--untie-embeddings-and-output-weights")
    if not model.bias:
        args.append("--disable-bias-linear")
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
    args += _megatron_partition(model, layout)
    schedule = get_schedule(layout.schedule)
    if schedule.megatron is None and layout.pp > 1:
        notes.append(f"Megatron-LM main has no {schedule.title} schedule ({schedule.source}); "
                     "as emitted it runs 1F1B, with 1F1B's bubble and activations in flight")
    elif schedule.chunked:
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
            notes.append("--tp-comm-overlap needs --sequence-parallel: not emitted, and the "
                         "plan charges this layout's TP communication fully exposed")
    if layout.recompute == "selective":
        args.append("--recompute-activations")
    elif layout.recompute == "full":
        args += ["--recompute-granularity full", "--recompute-method uniform",
                 "--recompute-num-layers 1"]
    fsdp = layout.zero >= 2
    overlap = ["--overlap-grad-reduce"] if settings.dp_overlapped(layout.zero) else []
    overlap_both = overlap + (["--overlap-param-gather"] if overlap else [])
    if layout.zero == 0:
        args += overlap
    elif layout.zero == 1:
        args += ["--use-distributed-optimizer", *overlap_both]
        if layout.zero_group:
            args.append("--num-distributed-optimizer-instances "
                        f"{layout.dp * layout.cp // layout.zero_group}")
    else:
        strategy = "optim_grads" if layout.zero == 2 else "optim_grads_params"
        args += ["--use-megatron-fsdp", f"--data-parallel-sharding-strategy {strategy}",
                 "--ckpt-format fsdp_dtensor", *overlap_both]
        if layout.zero_group:
            notes.append(f"Megatron-FSDP shards over all {layout.dp * layout.cp} data-parallel "
                         f"ranks, not groups of {layout.zero_group}: less memory, the "
                         "all-gathers and reduce-scatters span every replica (evaluate that "
                         "run with zero_group=0 in --layout)")
    if train.dtype == "bf16":
        args.append("--bf16")
    elif train.dtype == "fp16":
        if fsdp:
            raise ShardwiseError(f"Megatron-FSDP (ZeRO-{layout.zero}) does not train in fp16; "
                                 "use --dtype bf16 or zero ≤ 1")
        args.append("--fp16")
    if train.dtype != "fp32":
        if grad == train.dtype == "bf16":
            args.append("--grad-reduce-in-bf16")
        elif grad == "fp32":
            args.append("--accumulate-allreduce-grads-in-fp32")
        elif grad != train.dtype:
            raise ShardwiseError(f"Megatron reduces {train.dtype} gradients in {train.dtype} "
                                 f"or fp32, not {grad}; use --grad-dtype fp32")
    elif grad != "fp32":
        raise ShardwiseError("Megatron keeps fp32 gradients for fp32 training; drop --grad-dtype")
    args.append("--attention-backend " + ("flash" if train.flash_attention else "unfused"))
    args += _megatron_fp8_offload(train)
    env = []
    if (layout.tp > 1 or layout.cp > 1) and not fsdp:
        # Megatron orders TP/CP communication before compute with a single hardware queue.
        env.append("CUDA_DEVICE_MAX_CONNECTIONS=1")
    elif layout.tp > 1 or layout.cp > 1:
        notes.append("Megatron-FSDP refuses CUDA_DEVICE_MAX_CONNECTIONS=1, so TP/CP "
                     "communication overlaps compute less than the plan assumes")
    text = _script(_header("megatron", model, layout, train, gb), env,
                   _torchrun(layout, gpus_per_node) + " pretrain_gpt.py", args)
    return Emitted("megatron", text, tuple(notes))


# --------------------------------------------------------------------------------- torchtitan
# torchtitan ships these models as `--module llama3 --config <name>` (models/llama3/
# config_registry.py); each has the preset's shape.
_TITAN_CONFIGS = {"llama3-8b": ("llama3", "llama3_8b"), "llama3-70b": ("llama3", "llama3_70b"),
                  "llama3-405b": ("llama3", "llama3_405b")}


def _titan_shards(layout: Layout, notes: list[str]) -> tuple[int, int]:
    """(dp_replicate, dp_shard): FSDP shards over dp_shard·cp ranks, so ZeRO groups are too."""
    if layout.zero == 0:
        if layout.cp > 1:
            notes.append(f"torchtitan always applies FSDP over the cp={layout.cp} ranks, so "
                         "weights, gradients and optimizer states are sharded over them "
                         "(less memory than planned)")
        return layout.dp, 1
    group = layout.zero_group or layout.dp * layout.cp
    shard = max(1, group // layout.cp)
    if shard * layout.cp != group:
        notes.append(f"zero_group={group} is not a multiple of cp={layout.cp}; torchtitan "
                     f"shards over groups of {shard * layout.cp} (dp_shard·cp)")
    return layout.dp // shard, shard


def _titan_split(stages: int, n_layers: int, first_less: int, last_less: int) -> list[int]:
    """Layers per virtual stage as torchtitan 0.3 splits them
    (`distributed/pipeline_parallel.py: _generate_llm_fqn_per_model_part`): `L + first_less +
    last_less` units, `units // stages` each, the remainder one more on the first stages, the
    first stage `first_less` layers short and the last `last_less`."""
    units = n_layers + first_less + last_less
    q, r = divmod(units, stages)
    sizes = [q + (i < r) for i in range(stages)]
    sizes[0] -= first_less
    sizes[-1] -= last_less
    return sizes


def _titan_partition(model: ModelSpec, layout: Layout) -> tuple[int, int, int]:
    """(`pipeline_parallel_layers_per_stage`, `first_stage_less_layers`,
    `last_stage_less_layers`) that make torchtitan split the layers as `layout.stage_sizes`;
    torchtitan makes `ceil((L + first + last)/layers_per_stage)` virtual stages."""
    sizes = list(layout.stage_sizes(model.n_layers))
    stages, n = len(sizes), model.n_layers
    pairs = sorted(((a, b) for a in range(max(sizes) + 1) for b in range(max(sizes) + 1)),
                   key=lambda ab: (abs(ab[0] - ab[1]), ab))  # the symmetric choice first
    for first, last in pairs:
        units = n + first + last
        if units // stages < max(first, last) or _titan_split(stages, n, first, last) != sizes:
            continue
        for per_stage in range(max(1, units // stages), units + 1):
            if math.ceil(units / per_stage) == stages:
                return per_stage, first, last
    raise ShardwiseError(f"torchtitan cannot split {n} layers as {','.join(map(str, sizes))} "
                         "(its stages differ by at most one layer beside the embedding and "
                         "head); use the balanced default partition")


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
                    gpus_per_node: int = 8) -> Emitted:
    """torchtitan 0.3.x `torchrun -m torchtitan.train` command line for `layout`."""
    gb, grad = _check(model, layout, train, "torchtitan 0.3.0")
    if model.name not in _TITAN_CONFIGS:
        raise ShardwiseError(f"torchtitan 0.3 ships no {model.name} model (its llama3 configs "
                             f"fit {', '.join(_TITAN_CONFIGS)}); use --emit megatron or deepspeed")
    if train.dtype == "fp16":
        raise ShardwiseError("torchtitan 0.3 trains in bfloat16 or float32 only (no fp16 mixed "
                             "precision); use --dtype bf16")
    if layout.cp > 1 and layout.cp_kind != "ring":
        raise ShardwiseError(f"torchtitan 0.3's context parallelism shards the sequence and "
                             f"exchanges K/V (PyTorch's context_parallel), it has no "
                             f"all-to-all over heads: cp_kind={layout.cp_kind} cannot run; "
                             "use cp_kind=ring or --emit megatron")
    notes: list[str] = []
    module, config = _TITAN_CONFIGS[model.name]
    replicate, shard = _titan_shards(layout, notes)
    if layout.ep > 1 and (shard * layout.cp * layout.tp) % layout.ep:
        raise ShardwiseError(f"torchtitan borrows expert-parallel ranks from FSDP, CP and TP: "
                             f"ep={layout.ep} must divide dp_shard·cp·tp="
                             f"{shard * layout.cp * layout.tp}; use a larger zero_group or zero≥1")
    # ZeRO-3 reshards after every forward ("default" keeps weights gathered when pp > 1);
    # ZeRO-1/2 are nearest FSDP without resharding.
    reshard = "always" if layout.zero == 3 else "never"
    if layout.zero in (1, 2):
        notes.append(f"torchtitan has no ZeRO-{layout.zero}: FSDP without resharding after "
                     "forward keeps ZeRO-2's traffic and holds each layer's full weights from "
                     "its forward to its backward")
    # Without pp, local_batch_size is the micro-batch and torchtitan accumulates gradients up
    # to global_batch_size; with pp, one local batch is split into pipeline micro-batches.
    local = gb // layout.dp if layout.pp > 1 else layout.micro_batch
    precision = "bfloat16" if train.dtype == "bf16" else "float32"
    args = [f"--module {module}", f"--config {config}",
            f"--training.local_batch_size {local}", f"--training.global_batch_size {gb}",
            f"--training.seq_len {train.seq_len}",
            f"--training.mixed_precision_param {precision}"]
    if layout.pp > 1 or layout.ep > 1:
        args.append("--training.disable_cuda_graphs")
    args += [f"--parallelism.data_parallel_replicate_degree {replicate}",
             f"--parallelism.data_parallel_shard_degree {shard}",
             f"--parallelism.fsdp_reshard_after_forward {reshard}",
             f"--parallelism.tensor_parallel_degree {layout.tp}",
             f"--parallelism.pipeline_parallel_degree {layout.pp}",
             f"--parallelism.context_parallel_degree {layout.cp}",
             f"--parallelism.expert_parallel_degree {layout.ep}"]
    if layout.tp > 1:
        args.append("--parallelism." + ("" if layout.sp else "no_") + "enable_sequence_parallel")
    if layout.pp > 1:
        per_stage, first_less, last_less = _titan_partition(model, layout)
        schedule = get_schedule(layout.schedule)
        args += [f"--parallelism.pipeline_parallel_schedule {schedule.torchtitan or '1F1B'}",
                 f"--parallelism.pipeline_parallel_microbatch_size {layout.micro_batch}",
                 f"--parallelism.pipeline_parallel_layers_per_stage {per_stage}",
                 f"--parallelism.pipeline_parallel_first_stage_less_layers {first_less}",
                 f"--parallelism.pipeline_parallel_last_stage_less_layers {last_less}"]
        if schedule.torchtitan is None:
            notes.append(f"PyTorch pipelining has no {schedule.title} schedule with this many "
                         "stages per rank; emitted as 1F1B (a larger bubble than planned)")
    args += _titan_fp8_offload(config, train, notes)
    args.append(f"activation-checkpoint:{layout.recompute}")
    if layout.recompute == "selective":
        notes.append("torchtitan's selective checkpointing is op-level (it keeps matmul outputs "
                     "and recomputes the rest), close to but not Korthikanti's selective set")
    if grad != "fp32" and layout.dp * layout.cp > 1:
        notes.append("torchtitan reduces gradients in float32 (mixed_precision_reduce accepts "
                     "float32 only): gradient reductions move twice the planned bytes (evaluate "
                     "that run with --grad-dtype fp32)")
    if not train.flash_attention:
        notes.append("torchtitan's llama3 runs fused SDPA attention; the plan's unfused "
                     "attention memory and time are an overestimate")
    if config == "llama3_405b" and train.fp8 is None:
        notes.append("torchtitan's llama3_405b config trains its linear layers in Float8 with "
                     "torch.compile (not changeable from the command line); the plan assumes "
                     f"{train.dtype} matmuls")
    text = _script(_header("torchtitan", model, layout, train, gb), [],
                   _torchrun(layout, gpus_per_node) + " -m torchtitan.train", args)
    return Emitted("torchtitan", text, tuple(notes))


# ---------------------------------------------------------------------------------- DeepSpeed
def _deepspeed_partition(model: ModelSpec, layout: Layout) -> bool:
    """Whether the stages are uneven: DeepSpeed's `partition_method='type:transformer'` (the
    Megatron-DeepSpeed default) splits the blocks evenly; `'type:transformer|embedding'`
    balances `L + 2` layers (embedding and head one each), which gives the balanced default when
    `pp` divides `L + 2` (`deepspeed.runtime.utils.partition_balanced`). Other partitions are
    refused: DeepSpeed takes no explicit layer counts (and no virtual stages: the counts are
    per stage over its chunks)."""
    parts = tuple(n * layout.chunks for n in layout.stage_partition(model.n_layers))
    if len(set(parts)) == 1:
        return False
    if (model.n_layers + 2) % layout.pp or parts != stage_partition(model.n_layers, layout.pp):
        raise ShardwiseError(
            f"DeepSpeed cannot run the partition {','.join(map(str, parts))}: its pipeline "
            "splits blocks evenly or balances them with the embedding and head as one layer "
            f"each ({(model.n_layers + 2) // layout.pp - 1} on the first and last stage)")
    return True


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
                     gpus_per_node: int = 8) -> Emitted:
    """A DeepSpeed 0.19.8 JSON config for `layout`; the launch line is the first note."""
    gb, grad = _check(model, layout, train, "DeepSpeed 0.19.8")
    if layout.pp > 1 and layout.zero >= 2:
        raise ShardwiseError(f"DeepSpeed's pipeline engine refuses ZeRO-{layout.zero} with "
                             f"pp={layout.pp} (ZeRO-2 and ZeRO-3 are incompatible with pipeline "
                             "parallelism); use zero ≤ 1 or pp=1")
    if layout.cp > 1 and layout.sp:
        raise ShardwiseError("Megatron-DeepSpeed cannot combine Megatron sequence parallelism "
                             f"(sp) with DeepSpeed sequence parallelism (cp={layout.cp}); use "
                             "sp=0 or cp=1")
    if layout.cp > 1 and layout.cp_kind != "ulysses":
        raise ShardwiseError(f"DeepSpeed's sequence parallelism is Ulysses (all-to-all over "
                             f"heads) only: cp_kind={layout.cp_kind} cannot run; use "
                             "cp_kind=ulysses or --emit megatron")
    if layout.zero == 0 and grad != train.dtype:
        raise ShardwiseError(f"DeepSpeed without ZeRO accumulates gradients in the model dtype "
                             f"({train.dtype}), not {grad}; use zero ≥ 1 or --grad-dtype "
                             f"{train.dtype}")
    notes: list[str] = []
    zero: dict[str, object] = {"stage": layout.zero,
                               "overlap_comm": bool(train.settings().dp_overlapped(layout.zero)),
                               "contiguous_gradients": True,
                               "reduce_bucket_size": int(5e8), "allgather_bucket_size": int(5e8)}
    if layout.zero == 3:
        zero.update({"stage3_prefetch_bucket_size": int(5e8),
                     "stage3_param_persistence_threshold": int(1e6)})
        if layout.zero_group:
            # MiCS (per-group shards) is removed in 0.19; ZeRO++ hpZ keeps a secondary weight
            # shard per group so the backward all-gathers stay inside it.
            zero["zero_hpz_partition_size"] = layout.zero_group
            notes.append(f"DeepSpeed 0.19 has no hybrid ZeRO-3 (MiCS was removed): emitted as "
                         f"ZeRO-3 over all {layout.dp * layout.cp} replicas with a ZeRO++ "
                         f"secondary weight shard per {layout.zero_group} ranks; memory is "
                         "the plan's plus 1/(dp·cp) of the weights, forward all-gathers span "
                         "every replica")
    elif layout.zero_group:
        notes.append(f"DeepSpeed has no shard groups for ZeRO-{layout.zero}; it shards over all "
                     f"{layout.dp * layout.cp} replicas (less memory than planned)")
    _deepspeed_offload(train, zero)
    names = {"bf16": "bf16", "fp16": "fp16", "fp32": "fp32"}
    config: dict[str, object] = {
        "train_batch_size": gb,
        "train_micro_batch_size_per_gpu": layout.micro_batch,
        "gradient_accumulation_steps": layout.microbatches(train),
        "gradient_clipping": 1.0,
        "zero_optimization": zero,
        "data_types": {"grad_accum_dtype": names[grad]},
        "communication_data_type": names[grad],
        "steps_per_print": 10,
        "wall_clock_breakdown": False,
    }
    if train.dtype == "fp16":
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    elif train.dtype == "bf16":
        config["bf16"] = {"enabled": True}
    if layout.recompute != "none":
        config["activation_checkpointing"] = {
            "partition_activations": layout.tp > 1, "contiguous_memory_optimization": False,
            "cpu_checkpointing": False, "number_checkpoints": None,
            "synchronize_checkpoint_boundary": False, "profile": False}
    nodes, per_node = _nodes(layout, gpus_per_node)
    launch = f"deepspeed --num_nodes {nodes} --num_gpus {per_node}"
    if layout.tp > 1 or layout.pp > 1 or layout.cp > 1 or layout.ep > 1:
        flags = [f"--tensor-model-parallel-size {layout.tp}",
                 f"--pipeline-model-parallel-size {layout.pp}",
                 f"--micro-batch-size {layout.micro_batch}", f"--global-batch-size {gb}",
                 f"--zero-stage {layout.zero}"]
        if layout.pp == 1:
            flags.append("--no-pipeline-parallel")
        elif _deepspeed_partition(model, layout):
            flags.append("--pp-partition-method 'type:transformer|embedding'")
            notes.append("uneven stages: DeepSpeed's PipelineModule(partition_method="
                         "'type:transformer|embedding') balances the blocks with the embedding "
                         "and the head counted as one layer each (BigScience Megatron-DeepSpeed's "
                         "--pp-partition-method, as BLOOM-176B trained)")
        if layout.sp:
            flags.append("--sequence-parallel")
        if layout.cp > 1:
            flags.append(f"--ds-sequence-parallel-size {layout.cp}")
        if layout.ep > 1:
            flags += [f"--num-experts {model.n_experts}", f"--moe-expert-parallel-size {layout.ep}"]
        if layout.recompute == "full":
            flags += ["--checkpoint-activations", "--deepspeed-activation-checkpointing"]
        elif layout.recompute == "selective":
            flags.append("--recompute-activations")
        notes.insert(0, f"launch (Megatron-DeepSpeed): {launch} pretrain_gpt.py "
                        + " ".join(flags) + " --deepspeed --deepspeed_config ds_config.json")
    else:
        notes.insert(0, f"launch: {launch} train.py --deepspeed --deepspeed_config "
                        "ds_config.json")
    if layout.pp > 1 and get_schedule(layout.schedule).deepspeed is None:
        notes.append(f"DeepSpeed's pipeline engine runs 1F1B with one stage per rank; "
                     f"{layout.schedule} is emitted as 1F1B (a different bubble)")
    return Emitted("deepspeed", json.dumps(config, indent=2) + "\n", tuple(notes))


def emit(framework: str, model: ModelSpec, layout: Layout, train: TrainSpec,
         gpus_per_node: int = 8) -> Emitted:
    """The launch configuration of `layout` for `framework` (one of `FRAMEWORKS`)."""
    table = {"megatron": megatron_args, "torchtitan": torchtitan_args,
             "deepspeed": deepspeed_config}
    key = framework.lower()
    if key not in table:
        raise ShardwiseError(f"unknown framework {framework!r}; valid: {', '.join(FRAMEWORKS)}")
    if gpus_per_node < 1:
        raise ShardwiseError(f"gpus_per_node must be ≥ 1, got {gpus_per_node}")
    if train.stack.export != key:  # the run will use that framework's stack, at its defaults
        stack = next(s for s in STACKS.values() if s.export == key)
        train = replace(train, impl=stack.name, compile=None, tp_overlap=None, dp_overlap=None,
                        attention=None)
    return table[key](model, layout, train, gpus_per_node)
