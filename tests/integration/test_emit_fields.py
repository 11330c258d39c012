"""Every `TrainSpec` run setting × every export: set to a value the stack accepts (not its
default), emitted through the Python API (`shardwise.emit.emit`, what the CLI and the web app
call), then read back by the framework's own parser — Megatron-LM's (rebuilt from its table,
with `validate_args`' rules) and megatron-core 0.16.1's `TransformerConfig`; torchtitan
0.3.0's `ConfigManager`; Megatron-DeepSpeed's parser and DeepSpeed's `DeepSpeedConfig` — or
refused in one line (`ShardwiseError`). A new `TrainSpec` field fails
`test_every_run_setting_has_a_case` until each export writes or refuses it.
"""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Callable
from typing import Any

import pytest

from shardwise.arch import get_model
from shardwise.emit import emit
from shardwise.errors import ShardwiseError
from shardwise.layout import Layout, TrainSpec
from tests.integration import megatron_deepspeed
from tests.integration.conftest import require
from tests.integration.test_deepspeed import _Mpu, deepspeed_dist  # noqa: F401 (fixture)
from tests.integration.test_megatron import _config
from tests.integration.test_megatron_lm import USER, _parse, _validate

pytestmark = pytest.mark.integration

# TrainSpec fields that are not settings of the run an export launches
NOT_RUN_SETTINGS = {
    "impl": "names the stack, i.e. which export runs the plan (emit.common._checked refuses "
            "another stack's plan)",
    "expert_load": "the routing a run drew (`shardwise check` measures it), not a setting",
    "experts_active": "the routing a run drew, as expert_load",
}
IMPL = {"megatron": "megatron-te", "torchtitan": "torchtitan", "deepspeed": "megatron-deepspeed"}
REFUSED = None  # a case's check: the export refuses the setting in one line

DENSE = ("llama3-8b", {"dp": 4, "tp": 2, "sp": True, "zero": 1})
# DeepSeek-V2-Lite (MLA, 2 shared experts): expert parallelism over 16 of 32 GPUs, 2 nodes
MOE = ("deepseek-v2-lite", {"dp": 32, "ep": 16, "zero": 1})
TITAN_DENSE = ("llama3-8b", {"dp": 4, "tp": 2, "sp": True, "zero": 3})
TITAN_MOE = ("deepseek-v2-lite", {"dp": 16, "ep": 8, "zero": 3})
DS_MOE = ("mixtral-8x7b", {"dp": 16, "ep": 8, "zero": 1})


@dataclasses.dataclass(frozen=True)
class Case:
    framework: str
    field: str
    value: Any
    check: Callable[..., bool] | None  # (what the framework read) -> the setting came back
    run: tuple[str, dict] = DENSE
    also: tuple[tuple[str, Any], ...] = ()  # other settings the value needs

    @property
    def id(self) -> str:
        return f"{self.framework}-{self.field}={self.value}" + "".join(
            f"+{k}={v}" for k, v in self.also)


def _megatron(field, value, check, run=DENSE, also=()):
    return Case("megatron", field, value, check, run, tuple(also))


MEGATRON = [
    _megatron("seq_len", 8192, lambda a, c: a.seq_length == 8192),
    _megatron("global_batch", 512, lambda a, c: a.global_batch_size == 512),
    _megatron("dtype", "fp16", lambda a, c: a.fp16 and not a.bf16 and c.fp16),
    _megatron("grad_dtype", "fp32", lambda a, c: a.accumulate_allreduce_grads_in_fp32
              and not a.grad_reduce_in_bf16),
    _megatron("optimizer", "sgd", lambda a, c: a.optimizer == "sgd" and a.sgd_momentum == 0),
    _megatron("optimizer", "sgd-momentum", lambda a, c: (a.optimizer, a.sgd_momentum)
              == ("sgd", 0.9)),
    _megatron("optimizer", "adafactor", REFUSED),
    _megatron("flash_attention", False, lambda a, c: a.attention_backend == "unfused"),
    _megatron("compile", True, REFUSED),
    _megatron("tp_overlap", "bulk", lambda a, c: a.tp_comm_overlap),
    _megatron("dp_overlap", True, lambda a, c: a.overlap_grad_reduce and a.overlap_param_gather),
    _megatron("attention", "fa3", lambda a, c: a.attention_backend == "flash"),
    _megatron("fp8", "tensorwise", lambda a, c: (a.fp8, a.fp8_recipe)
              == ("hybrid", "tensorwise")),
    _megatron("offload", "optimizer", lambda a, c: a.optimizer_cpu_offload
              and a.use_precision_aware_optimizer),
    _megatron("offload_fraction", 0.5, lambda a, c: a.optimizer_offload_fraction == 0.5,
              also=[("offload", "optimizer")]),
    _megatron("recompute_modules", ("moe_act", "mla_up_proj"),
              lambda a, c: c.recompute_granularity == "selective"
              and c.recompute_modules == ["moe_act", "mla_up_proj"],
              run=("deepseek-v2-lite", MOE[1] | {"recompute": "selective"})),
    _megatron("recompute_modules", ("core_attn", "layernorm"), REFUSED,  # delayed FP8
              run=("llama3-8b", DENSE[1] | {"recompute": "selective"}),
              also=[("fp8", "delayed")]),
    _megatron("recompute_modules", ("shared_experts", "moe_act"), REFUSED,
              run=("deepseek-v2-lite", MOE[1] | {"recompute": "selective"}),
              also=[("moe_overlap", "shared")]),
    # 32 layers over pp=2: 16 per stage, half of them: the first 8 of each
    _megatron("recompute_share", 0.5, lambda a, c: (c.recompute_granularity, c.recompute_method,
                                                    c.recompute_num_layers) == ("full", "block", 8),
              run=("llama3-8b", {"dp": 4, "pp": 2, "zero": 1, "recompute": "full"})),
    _megatron("recompute_share", 0.3, REFUSED,  # 4.8 of 16 layers
              run=("llama3-8b", {"dp": 4, "pp": 2, "zero": 1, "recompute": "full"})),
    _megatron("exp_avg_dtype", "bf16", lambda a, c: a.use_precision_aware_optimizer
              and (a.exp_avg_dtype, a.exp_avg_sq_dtype) == ("bf16", "fp32")),
    _megatron("exp_avg_sq_dtype", "fp16", lambda a, c: a.use_precision_aware_optimizer
              and (a.exp_avg_dtype, a.exp_avg_sq_dtype) == ("fp32", "fp16")),
    _megatron("main_params_dtype", "fp16", lambda a, c: a.use_precision_aware_optimizer
              and a.main_params_dtype == "fp16"),
    _megatron("exp_avg_dtype", "fp8", REFUSED,  # the precision-aware optimizer needs ZeRO
              run=("llama3-8b", {"dp": 4, "tp": 2, "sp": True})),
    _megatron("act_fp8_store", True, REFUSED),  # no Megatron-LM flag at the pinned commit
    _megatron("mtp_layers", 2, lambda a, c: c.mtp_num_layers == 2, run=MOE),
    _megatron("offload_modules", ("core_attn", "attn_proj", "expert_fc1"),
              lambda a, c: c.fine_grained_activation_offloading
              and c.offload_modules == ["core_attn", "attn_proj", "expert_fc1"], run=MOE),
    _megatron("moe_dispatcher", "flex", lambda a, c: (
        c.moe_token_dispatcher_type, c.moe_flex_dispatcher_backend) == ("flex", "deepep"),
              run=MOE),
    _megatron("moe_dispatcher", "allgather", lambda a, c: c.moe_token_dispatcher_type
              == "allgather", run=MOE),
    _megatron("moe_overlap", "shared", lambda a, c: c.moe_shared_expert_overlap
              and c.moe_token_dispatcher_type == "alltoall", run=MOE),
    _megatron("moe_overlap", "1f1b", lambda a, c: c.overlap_moe_expert_parallel_comm
              and not c.moe_shared_expert_overlap, run=MOE),
    _megatron("moe_dispatch_fp8", True, REFUSED, run=MOE, also=[("moe_dispatcher", "flex")]),
    _megatron("moe_capacity", 1.25, lambda a, c: c.moe_expert_capacity_factor == 1.25
              and c.moe_pad_expert_input_to_capacity, run=MOE),
    _megatron("comm_sms", 24, lambda a, c: c.moe_deepep_num_sms == 24, run=MOE,
              also=[("moe_dispatcher", "flex"), ("moe_overlap", "1f1b")]),
    _megatron("comm_sms", 24, REFUSED, run=MOE),  # NCCL's all-to-all takes no SM count
    _megatron("cuda_graph", ("attn", "moe_router"), lambda a, c: a.cuda_graph_impl
              == "transformer_engine" and [s.name for s in c.cuda_graph_scope]
              == ["attn", "moe_router"], run=MOE),
]


def _titan(field, value, check, run=TITAN_DENSE, also=()):
    return Case("torchtitan", field, value, check, run, tuple(also))


TORCHTITAN = [
    _titan("seq_len", 8192, lambda c: c.training.seq_len == 8192),
    _titan("global_batch", 512, lambda c: c.training.global_batch_size == 512),
    _titan("dtype", "fp32", lambda c: c.training.mixed_precision_param == "float32"),
    _titan("grad_dtype", "bf16", REFUSED),  # FSDP2 reduces in float32
    _titan("optimizer", "sgd", REFUSED),
    _titan("flash_attention", False, REFUSED),
    _titan("compile", True, lambda c: c.compile.enable),
    _titan("tp_overlap", "async", lambda c: c.compile.enable
           and c.compile.enable_async_tensor_parallel, also=[("compile", True)]),
    _titan("dp_overlap", False, REFUSED),
    _titan("attention", "fa3", REFUSED),
    _titan("fp8", "rowwise", REFUSED),  # llama3_8b's config has no Float8 converter
    _titan("offload", "params", lambda c: c.training.enable_cpu_offload),
    _titan("offload_fraction", 0.5, REFUSED, also=[("offload", "params")]),
    _titan("recompute_modules", ("core_attn", "mlp"), REFUSED),
    _titan("recompute_share", 0.5, REFUSED, run=("llama3-8b", TITAN_DENSE[1]
                                                 | {"recompute": "full"})),
    _titan("exp_avg_dtype", "bf16", REFUSED),
    _titan("exp_avg_sq_dtype", "bf16", REFUSED),
    _titan("main_params_dtype", "fp16", REFUSED),
    _titan("act_fp8_store", True, REFUSED),
    _titan("mtp_layers", 1, REFUSED, run=TITAN_MOE),
    _titan("offload_modules", ("core_attn", "attn_proj"), REFUSED),
    _titan("moe_dispatcher", "flex", REFUSED, run=TITAN_MOE),
    _titan("moe_overlap", "shared", REFUSED, run=TITAN_MOE),
    _titan("moe_dispatch_fp8", True, REFUSED, run=TITAN_MOE),
    _titan("moe_capacity", 1.25, REFUSED, run=TITAN_MOE),
    _titan("comm_sms", 24, REFUSED, run=TITAN_MOE),
    _titan("cuda_graph", ("attn",), REFUSED),
]


def _ds(field, value, check, run=DENSE, also=()):
    return Case("deepspeed", field, value, check, run, tuple(also))


DEEPSPEED = [
    _ds("seq_len", 8192, lambda a, c: a.seq_length == 8192),
    _ds("global_batch", 512, lambda a, c: a.global_batch_size == c.train_batch_size == 512),
    _ds("dtype", "fp16", lambda a, c: a.fp16 and c.float16_config.enabled),
    _ds("grad_dtype", "fp32", lambda a, c: str(c.communication_data_type) == "torch.float32"),
    _ds("optimizer", "sgd", lambda a, c: (a.optimizer, a.sgd_momentum) == ("sgd", 0)),
    _ds("optimizer", "adam-8bit", REFUSED),
    _ds("flash_attention", False, lambda a, c: not a.use_flash_attn_v2),
    _ds("compile", True, REFUSED),
    _ds("tp_overlap", "bulk", REFUSED),
    _ds("dp_overlap", True, lambda a, c: c.zero_config.overlap_comm),
    _ds("attention", "fa3", REFUSED),
    _ds("fp8", "tensorwise", REFUSED),
    _ds("offload", "optimizer", lambda a, c: c.zero_config.offload_optimizer is not None
        and c.zero_config.offload_optimizer.device == "cpu"),
    _ds("offload_fraction", 0.5, REFUSED, also=[("offload", "optimizer")]),
    _ds("recompute_modules", ("core_attn", "mlp"), REFUSED,
        run=("llama3-8b", DENSE[1] | {"recompute": "selective"})),
    # no pipeline stages: one ParallelTransformer of 32 layers, the first 16 recomputed
    _ds("recompute_share", 0.5, lambda a, c: (a.recompute_granularity, a.recompute_method,
                                              a.recompute_num_layers) == ("full", "block", 16),
        run=("llama3-8b", DENSE[1] | {"recompute": "full"})),
    _ds("exp_avg_dtype", "bf16", REFUSED),
    _ds("exp_avg_sq_dtype", "bf16", REFUSED),
    _ds("main_params_dtype", "fp16", REFUSED),
    _ds("act_fp8_store", True, REFUSED),
    _ds("mtp_layers", 1, REFUSED),
    _ds("offload_modules", ("core_attn", "attn_proj"), REFUSED),
    _ds("moe_dispatcher", "flex", REFUSED, run=DS_MOE),
    _ds("moe_overlap", "shared", REFUSED, run=DS_MOE),
    _ds("moe_dispatch_fp8", True, REFUSED, run=DS_MOE),
    _ds("moe_capacity", 1.25, lambda a, c: a.moe_train_capacity_factor == 1.25
        and a.moe_token_dropping, run=DS_MOE),
    _ds("comm_sms", 24, REFUSED, run=DS_MOE),
    _ds("cuda_graph", ("attn",), REFUSED),
]
CASES = MEGATRON + TORCHTITAN + DEEPSPEED


def _emitted(case: Case, default: bool = False):
    """The export of the case's run; `default`: with the field left at its default."""
    model_name, layout = case.run
    base = {"impl": IMPL[case.framework], "global_batch": 256, "seq_len": 4096}
    setting = {} if default else {case.field: case.value}
    train = TrainSpec(**base | setting | dict(case.also))
    return emit(case.framework, get_model(model_name), Layout(**layout), train)


def _argv(args: tuple[str, ...]) -> list[str]:
    return [word for arg in args for word in shlex.split(arg)]


def _read_back(case: Case, out, tmp_path) -> tuple:
    """What the framework's own code reads from the export."""
    assert out.launch is not None
    words = _argv(out.launch.args)
    world = out.launch.nodes * out.launch.gpus_per_node
    env = dict(e.split("=", 1) for e in out.launch.env)
    if case.framework == "megatron":
        require("megatron")
        args = _parse([*words, *USER])
        _validate(args, world, env)
        return args, _config(words)[1]
    if case.framework == "torchtitan":
        require("torchtitan")
        from torchtitan.config.manager import ConfigManager

        return (ConfigManager().parse_args(words),)
    require("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig

    path = tmp_path / "ds_config.json"
    path.write_text(out.text)
    args = megatron_deepspeed.parse(words, world, env)
    return args, DeepSpeedConfig(str(path), mpu=_Mpu(args.data_parallel_size))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_the_framework_reads_back_each_run_setting(case, tmp_path, request):
    """The setting comes back, and the check fails on the same run with the field at its
    default (it reads this field); a refusal is one line, and the run with the field at its
    default is exported (the field is what is refused)."""
    default = next(f for f in dataclasses.fields(TrainSpec) if f.name == case.field).default
    assert case.value != default
    if case.framework == "deepspeed":
        request.getfixturevalue("deepspeed_dist")
    if case.check is REFUSED:
        with pytest.raises(ShardwiseError) as err:
            _emitted(case)
        assert str(err.value) and len(str(err.value).splitlines()) == 1
        _emitted(case, default=True)
        return
    out = _emitted(case)
    assert case.check(*_read_back(case, out, tmp_path)), out.launch.args
    assert not case.check(*_read_back(case, _emitted(case, default=True), tmp_path))


def test_every_run_setting_has_a_case():
    """Each export writes or refuses every TrainSpec field that is a run setting."""
    names = {f.name for f in dataclasses.fields(TrainSpec)}
    assert set(NOT_RUN_SETTINGS) <= names
    for framework in IMPL:
        covered = {c.field for c in CASES if c.framework == framework}
        assert covered == names - set(NOT_RUN_SETTINGS), framework



@pytest.mark.parametrize("case,flags", [
    # what the refused setting would add, on the run exported without it
    (_megatron("recompute_modules", ("shared_experts", "moe_act"), REFUSED,
               run=("deepseek-v2-lite", MOE[1] | {"recompute": "selective"}),
               also=[("moe_overlap", "shared")]),
     ["--recompute-granularity", "selective", "--recompute-modules", "shared_experts",
      "moe_act"]),
    (_megatron("moe_capacity", 1.25, REFUSED, run=MOE, also=[("moe_dispatcher", "flex")]),
     ["--moe-expert-capacity-factor", "1.25", "--moe-pad-expert-input-to-capacity"]),
    (_megatron("moe_overlap", "1f1b", REFUSED, run=("deepseek-v2-lite", {
        "dp": 16, "pp": 2, "ep": 8, "zero": 1})), ["--overlap-moe-expert-parallel-comm"]),
    (_megatron("act_fp8_store", True, REFUSED), ["--activation-func-fp8-input-store"]),
], ids=lambda x: x.id if isinstance(x, Case) else "")
def test_megatron_refuses_what_the_export_refuses(case, flags):
    """The export's refusals are megatron-core's or Megatron-LM's own: the flag added to the
    exported run fails their parser or config class."""
    import argparse

    with pytest.raises(ShardwiseError):
        _emitted(case)
    out = _emitted(case, default=True)
    words = [w for w in _argv(out.launch.args) if w != "--recompute-activations"] + flags
    with pytest.raises((ValueError, AssertionError, argparse.ArgumentError)):
        _parse([*words, *USER])
        _config(words)


def test_recompute_modules_without_selective_recompute_are_a_note():
    """Without selective recompute the modules change neither the plan's memory nor
    Megatron's run: the export leaves `--recompute-modules` out and says so."""
    from shardwise.estimate.memory import training_memory_per_gpu

    model, layout = get_model(MOE[0]), Layout(**MOE[1] | {"recompute": "full"})
    case = _megatron("recompute_modules", ("moe_act", "mlp"), None, run=(MOE[0], {
        **MOE[1], "recompute": "full"}))
    out, plain = _emitted(case), _emitted(case, default=True)
    assert out.launch.args == plain.launch.args
    assert any("recompute_modules moe_act,mlp apply with selective" in n for n in out.notes)
    train = TrainSpec(global_batch=256, seq_len=4096)
    assert training_memory_per_gpu(model, layout, train) == training_memory_per_gpu(
        model, layout, dataclasses.replace(train, recompute_modules=("moe_act", "mlp")))


def test_the_cli_carries_the_run_settings_to_megatron_lm(capsys):
    """`shardwise plan … --emit megatron` with the stack options: Megatron-LM's parser and
    megatron-core read each of them back (EP over 16 GPUs of 2 nodes, DeepEP)."""
    from tests.integration.conftest import Emit
    from tests.integration.test_megatron_lm import megatron_lm_args

    out = Emit(capsys, ["deepseek-v2-lite", "--gpus", "32", "--seq", "4096", "--global-batch",
                        "256", "--layout", "ep=16,zero=1,recompute=selective",
                        "--moe-dispatcher", "flex", "--moe-overlap", "1f1b", "--comm-sms", "24",
                        "--recompute-modules", "moe_act,mla_up_proj", "--exp-avg-dtype", "bf16",
                        "--offload-modules", "expert_fc1", "--cuda-graph-scope", "attn"],
               "megatron")
    args = megatron_lm_args(out)
    env, words = out.command()
    config = _config(words[words.index("pretrain_gpt.py") + 1:])[1]
    assert (config.moe_token_dispatcher_type, config.moe_flex_dispatcher_backend,
            config.overlap_moe_expert_parallel_comm, config.moe_deepep_num_sms) == (
        "flex", "deepep", True, 24)
    assert config.recompute_modules == ["moe_act", "mla_up_proj"]
    assert args.use_precision_aware_optimizer and args.exp_avg_dtype == "bf16"
    assert config.offload_modules == ["expert_fc1"] and env["NVTE_CPU_OFFLOAD_V1"] == "1"
    assert [s.name for s in config.cuda_graph_scope] == ["attn"]
