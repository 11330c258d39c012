"""The run settings of a megatron-te plan (`TrainSpec`'s expert-parallel communication,
recompute, precision-aware optimizer, activation offloading, CUDA graphs, MTP) as Megatron-LM
main (d98e8a6) arguments, each the flag megatron-core 0.16.1's `TransformerConfig` /
`OptimizerConfig` field reads; a setting that Megatron-LM cannot run as planned is refused
in one line naming the field and what Megatron lacks. Tested field by field against
Megatron-LM's parser and megatron-core's config classes (tests/integration/test_emit_fields.py).
"""

from __future__ import annotations

from shardwise.arch import ModelSpec
from shardwise.errors import ShardwiseError
from shardwise.layout import Layout, TrainSpec
from shardwise.schedules.registry import get_schedule

__all__ = ["megatron_optimizer", "megatron_run_settings"]


def _refuse(field: str, why: str, framework: str = "megatron") -> ShardwiseError:
    return ShardwiseError(f"--emit {framework} cannot run {field} as planned: {why}")


def megatron_optimizer(train: TrainSpec, framework: str = "megatron") -> list[str]:
    """`TrainSpec.optimizer` as Megatron's `--optimizer` (Megatron-LM d98e8a6 and
    Megatron-DeepSpeed 4efb479 both take adam and sgd; `--sgd-momentum` defaults to 0.9):
    adam the default, sgd-momentum `--optimizer sgd`, sgd `--optimizer sgd --sgd-momentum 0`
    (torch's SGD keeps no momentum buffer then). 8-bit Adam and Adafactor: refused."""
    if train.optimizer == "adam":
        return []
    if train.optimizer == "sgd-momentum":
        return ["--optimizer sgd"]
    if train.optimizer == "sgd":
        return ["--optimizer sgd", "--sgd-momentum 0"]
    raise _refuse(f"optimizer {train.optimizer}", "Megatron's --optimizer runs adam or sgd "
                  "(with or without momentum) only", framework)


def _moe_comm(model: ModelSpec, layout: Layout, train: TrainSpec) -> list[str]:
    """Token dispatcher (`--moe-token-dispatcher-type`; flex as DeepEP,
    `--moe-flex-dispatcher-backend deepep`), the collectives' overlap
    (`--moe-shared-expert-overlap`; `--overlap-moe-expert-parallel-comm`, whose
    `TransformerConfig.__post_init__` rules are checked here), the capacity factor padded to
    capacity (`--moe-expert-capacity-factor F --moe-pad-expert-input-to-capacity`), DeepEP's
    SMs (`--moe-deepep-num-sms`, TransformerConfig.moe_deepep_num_sms) and the grouped-GEMM
    experts (`--moe-grouped-gemm`)."""
    if not model.is_moe:
        return []
    dispatcher = train.moe_dispatcher or "alltoall"
    # TEGroupedMLP, the experts the plan times (estimate.profiles, estimate.host); without
    # the flag megatron-core builds SequentialMLP, a loop over the local experts
    args = ["--moe-grouped-gemm"]
    if layout.ep > 1 or train.moe_dispatcher is not None:  # Megatron's default: allgather
        args.append(f"--moe-token-dispatcher-type {dispatcher}")
        if dispatcher == "flex":
            args.append("--moe-flex-dispatcher-backend deepep")
    if train.moe_overlap == "shared":
        args.append("--moe-shared-expert-overlap")
    elif train.moe_overlap == "1f1b":
        mtp = model.mtp_layers if train.mtp_layers is None else train.mtp_layers
        lacks = [why for why, bad in (
            ("expert parallelism (ep > 1)", layout.ep == 1),
            ("no full recompute", layout.recompute == "full"),
            ("virtual pipeline stages when pp > 1", layout.pp > 1 and not (
                get_schedule(layout.schedule).chunked and layout.chunks > 1)),
            ("bf16 or fp16 weights", train.dtype == "fp32"),
            ("at most one MTP module, and pp > 1 with one", mtp > 1 or (mtp == 1
                                                                     and layout.pp == 1)),
            ("no moe or mlp CUDA-graph scope", bool({"moe", "mlp"} & set(train.cuda_graph))),
        ) if bad]
        if lacks:
            raise _refuse("moe_overlap 1f1b", "megatron-core 0.16.1's "
                          "--overlap-moe-expert-parallel-comm needs " + "; ".join(lacks)
                          + " (transformer_config.py __post_init__)")
        args.append("--overlap-moe-expert-parallel-comm")
    if train.moe_dispatch_fp8:
        raise _refuse("moe_dispatch_fp8", "megatron-core 0.16.1's flex dispatcher sends bf16 "
                      "(moe/fused_a2a.py: DeepEP's dispatch takes no FP8 payload, HybridEP's "
                      "fp8_dispatch is fixed False) and Megatron-LM has no FP8-dispatch flag")
    if train.moe_capacity is not None:
        if dispatcher == "flex":
            raise _refuse("moe_capacity", "megatron-core 0.16.1 refuses "
                          "--moe-pad-expert-input-to-capacity with the flex (DeepEP) "
                          "dispatcher (transformer_config.py)")
        args += [f"--moe-expert-capacity-factor {train.moe_capacity:g}",
                 "--moe-pad-expert-input-to-capacity"]
    if train.comm_sms is not None:
        if dispatcher != "flex":
            raise _refuse("comm_sms", f"Megatron-LM sets the SMs of DeepEP's kernels only "
                          f"(--moe-deepep-num-sms, flex dispatcher); its {dispatcher} "
                          "dispatcher's NCCL collectives take no SM count")
        args.append(f"--moe-deepep-num-sms {train.comm_sms}")
    return args


def _recompute(model: ModelSpec, layout: Layout, train: TrainSpec,
               notes: list[str]) -> list[str]:
    """Selective: `--recompute-granularity selective --recompute-modules …` (no modules: the
    default core_attn, `--recompute-activations`). Full: every layer (`--recompute-method
    uniform --recompute-num-layers 1`), or a share of each (virtual) stage's layers as
    Megatron's block method counts them (transformer_block.py: the first N layers of each
    chunk, `len(self.layers)`), exact only when every chunk holds the same number of layers
    and the share of it is whole."""
    if train.recompute_modules is not None and layout.recompute != "selective":
        notes.append(f"recompute_modules {','.join(train.recompute_modules)} apply with "
                     f"selective recompute only; this layout recomputes {layout.recompute}, as "
                     "planned")
    if layout.recompute == "selective":
        if train.recompute_modules is None:
            return ["--recompute-activations"]
        modules = set(train.recompute_modules)
        recipe = train.stack.fp8_recipe(train.fp8).name if train.fp8 is not None else None
        for bad, why in (
                (recipe == "delayed" and bool(modules & {"moe_act", "layernorm"}),
                 "delayed FP8 scaling cannot recompute moe_act or layernorm"),
                ("shared_experts" in modules and train.moe_overlap == "shared"
                 and model.n_shared_experts > 0,
                 "shared_experts recompute cannot run with --moe-shared-expert-overlap")):
            if bad:
                raise _refuse("recompute_modules " + ",".join(train.recompute_modules),
                              f"megatron-core 0.16.1: {why} (transformer_config.py)")
        return ["--recompute-granularity selective",
                "--recompute-modules " + " ".join(train.recompute_modules)]
    if layout.recompute != "full":
        return []
    if train.recompute_share == 1:
        return ["--recompute-granularity full", "--recompute-method uniform",
                "--recompute-num-layers 1"]
    sizes = {n for n in layout.stage_sizes(model.n_layers) if n}
    counts = {n * train.recompute_share for n in sizes}
    if len(sizes) != 1 or len(counts) != 1 or not abs(
            (count := counts.pop()) - round(count)) < 1e-9 or round(count) < 1:
        raise _refuse(f"recompute_share {train.recompute_share:g}", "Megatron's "
                      "--recompute-method block recomputes the same N first layers of every "
                      "(virtual) stage chunk; this layout's chunks hold "
                      f"{'/'.join(map(str, sorted(sizes)))} layers, which no whole N matches")
    return ["--recompute-granularity full", "--recompute-method block",
            f"--recompute-num-layers {round(count)}"]


def _memory(layout: Layout, train: TrainSpec, offloaded: bool) -> list[str]:
    """The precision-aware optimizer's moments and master weights (`--exp-avg-dtype`,
    `--exp-avg-sq-dtype`, `--main-params-dtype`; OptimizerConfig: adam and the distributed
    optimizer only), fine-grained activation offloading (`--fine-grained-activation-
    offloading --offload-modules …`). `act_fp8_store`: megatron-core's
    `activation_func_fp8_input_store` has no Megatron-LM flag at d98e8a6: refused."""
    args: list[str] = []
    dtypes = [(name, getattr(train, name)) for name in
              ("exp_avg_dtype", "exp_avg_sq_dtype", "main_params_dtype")]
    if any(value is not None for _, value in dtypes):
        if train.optimizer != "adam" or layout.zero == 0:
            raise _refuse(", ".join(n for n, v in dtypes if v is not None),
                          "megatron-core 0.16.1's --use-precision-aware-optimizer runs adam "
                          "with the distributed optimizer only (optimizer_config.py), not "
                          f"{train.optimizer} at zero={layout.zero}")
        if not offloaded:
            args.append("--use-precision-aware-optimizer")
        args += [f"--{name.replace('_', '-')} {value}" for name, value in dtypes
                 if value is not None]
    if train.act_fp8_store:
        raise _refuse("act_fp8_store", "Megatron-LM d98e8a6's parser has no "
                      "--activation-func-fp8-input-store (megatron-core 0.16.1's "
                      "TransformerConfig.activation_func_fp8_input_store is not exposed)")
    if train.offload_modules:
        args += ["--fine-grained-activation-offloading",
                 "--offload-modules " + " ".join(train.offload_modules)]
    return args


def megatron_run_settings(model: ModelSpec, layout: Layout, train: TrainSpec,
                          notes: list[str], offloaded: bool) -> list[str]:
    """Every run setting above, then the CUDA graphs (`--cuda-graph-impl transformer_engine
    --cuda-graph-scope …`). `offloaded`: the optimizer offload already wrote
    `--use-precision-aware-optimizer`."""
    args = megatron_optimizer(train) + _moe_comm(model, layout, train)
    args += _recompute(model, layout, train, notes)
    args += _memory(layout, train, offloaded)
    if train.cuda_graph:
        args += ["--cuda-graph-impl transformer_engine",
                 "--cuda-graph-scope " + " ".join(train.cuda_graph)]
    return args
