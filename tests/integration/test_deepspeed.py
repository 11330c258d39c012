"""`--emit deepspeed` read by DeepSpeed 0.19.8's own `DeepSpeedConfig`, its engine's rules and
partitioner, and the launch line by Megatron-DeepSpeed's parser and checks at its pinned
commit (`tests.integration.megatron_deepspeed`: it is not on PyPI).

The data-parallel world comes from a Megatron-style `mpu` (the interface DeepSpeed asks
Megatron-DeepSpeed for); the engine's optimizer sanity check (`_do_optimizer_sanity_check`)
runs on the parsed config without GPUs.
"""

import itertools
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.arch import get_model
from tests.integration import megatron_deepspeed
from tests.integration.conftest import Emit, emit, require
from tests.integration.plans import EXPECTED, PLANS

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def deepspeed_dist(tmp_path_factory):
    """A one-rank gloo group, so DeepSpeedConfig asks the mpu for the data-parallel size."""
    require("deepspeed")
    import deepspeed
    import torch.distributed as dist

    store = tmp_path_factory.mktemp("ds") / "store"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOCAL_RANK", "0")
        deepspeed.init_distributed("gloo", auto_mpi_discovery=False, verbose=False,
                                   init_method=f"file://{store}", rank=0, world_size=1)
        yield
        dist.destroy_process_group()


class _Mpu:
    """The data-parallel size Megatron-DeepSpeed reports to DeepSpeed."""

    def __init__(self, dp):
        self.dp = dp

    def get_data_parallel_world_size(self):
        return self.dp


def launch(out: Emit) -> tuple[dict[str, str], list[str], int, int]:
    """(environment, pretrain_gpt.py arguments, nodes, GPUs per node) of the launch note."""
    words = shlex.split(out.notes[0].split(": ", 1)[1])
    env = {}
    while "=" in words[0]:
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    assert words[0] == "deepspeed"
    nodes = int(words[words.index("--num_nodes") + 1])
    gpus = int(words[words.index("--num_gpus") + 1])
    return env, words[words.index("pretrain_gpt.py") + 1:], nodes, gpus


def deepspeed_stages(n_layers: int, pp: int) -> tuple[int, ...]:
    """Blocks per stage as DeepSpeed's PipelineModule partitions GPTModelPipe: its
    'type:transformer' method weighs the transformer blocks 1 and the other specs 0 (a cast,
    the embedding; the final norm, the head and a cast; megatron/model/gpt_model.py:339-440
    @4efb479), `deepspeed.runtime.utils.partition_balanced` (0.19.8)."""
    from deepspeed.runtime.utils import partition_balanced

    weights = [0, 0] + [1] * n_layers + [0, 0, 0]
    bounds = partition_balanced(weights, pp)
    return tuple(sum(weights[a:b]) for a, b in itertools.pairwise(bounds))


def reads_back(out: Emit, model, tmp_path) -> None:
    """Every planned value of a `--emit deepspeed` config and launch line, as DeepSpeed and
    Megatron-DeepSpeed read them."""
    import torch
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.engine import DeepSpeedEngine

    layout, plan = out.layout, out.plan
    stack = plan["stack"]
    path = tmp_path / "ds_config.json"
    path.write_text(out.text)
    config = DeepSpeedConfig(str(path), mpu=_Mpu(layout.dp))
    # batch: DeepSpeed checks train = micro · accumulation · dp itself
    assert config.train_batch_size == plan["global_batch"]
    assert config.train_micro_batch_size_per_gpu == layout.micro_batch
    assert config.gradient_accumulation_steps == config.train_batch_size // (
        layout.micro_batch * layout.dp)
    # ZeRO stage, no ZeRO++ secondary partition, the overlap the stack says
    assert config.zero_optimization_stage == layout.zero
    assert config.zero_config.zero_hpz_partition_size == 1
    overlapped = (stack["dp_overlap"] if stack["dp_overlap"] is not None
                  else layout.zero in stack["dp_overlap_by_default_at_zero"])
    assert config.zero_config.overlap_comm == overlapped
    # precision and gradient dtype: accumulation and communication
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    assert config.bfloat16_config.enabled == (plan["dtype"] == "bf16")
    assert config.float16_config.enabled == (plan["dtype"] == "fp16")
    assert config.communication_data_type == dtypes[plan["grad_dtype"]]
    engine = DeepSpeedEngine.__new__(DeepSpeedEngine)  # the engine's own rules, config only
    torch.nn.Module.__init__(engine)
    engine._config, engine.global_rank, engine.pipeline_parallelism = config, 0, layout.pp > 1
    assert engine.get_data_types() == (dtypes[plan["dtype"]], dtypes[plan["grad_dtype"]])
    engine._do_optimizer_sanity_check(torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))]))
    # the launch line, read and checked as Megatron-DeepSpeed does (pinned model)
    env, argv, nodes, gpus = launch(out)
    assert nodes * gpus == layout.world_size
    args = megatron_deepspeed.parse(argv, layout.world_size, env)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
            args.ds_sequence_parallel_size, args.data_parallel_size) == (
        layout.tp, layout.pp, layout.cp, layout.dp)
    assert args.zero_stage == layout.zero and args.deepspeed
    assert args.no_pipeline_parallel == (layout.pp == 1)
    assert args.enable_zbh1_pipeline == (layout.pp > 1 and layout.schedule == "zb-h1")
    assert args.sequence_parallel == layout.sp
    assert args.recompute_granularity == (None if layout.recompute == "none"
                                          else layout.recompute)
    assert (args.micro_batch_size, args.global_batch_size, args.seq_length) == (
        layout.micro_batch, plan["global_batch"], plan["seq_len"])
    assert (args.bf16, args.fp16) == (plan["dtype"] == "bf16", plan["dtype"] == "fp16")
    assert args.use_flash_attn_v2 == (stack["attention"] == "fa2")
    assert (args.num_layers, args.hidden_size, args.num_attention_heads,
            args.num_key_value_heads) == (model.n_layers, model.d_model, model.n_heads,
                                          model.n_kv_heads)
    # the dense MLPs' width (and DeepSpeed-MoE's experts', ParallelMLPs of the same)
    assert args.ffn_hidden_size == (model.d_ff if model.n_dense_layers else model.expert_d_ff)
    assert args.swiglu == model.gated_mlp
    assert args.normalization == model.norm
    assert args.use_rotary_position_embeddings == (not model.learned_positions)
    # the tokenizer's V stays unpadded (megatron/tokenizer/tokenizer.py:58)
    assert model.vocab % (args.make_vocab_size_divisible_by * layout.tp) == 0
    if model.is_moe:
        moe_reads_back(args, model, layout)
    else:
        assert args.num_experts == [1]
    if layout.pp > 1:  # the stages, as DeepSpeed partitions GPTModelPipe
        assert deepspeed_stages(model.n_layers, layout.pp) == layout.stage_partition(
            model.n_layers)
        from deepspeed.runtime.zero.config import ZeroStageEnum
        assert config.zero_optimization_stage < ZeroStageEnum.gradients  # engine.py:76


def moe_reads_back(args, model, layout) -> None:
    """DeepSpeed-MoE as Megatron-DeepSpeed builds it from `args` (megatron/model/
    transformer.py:1066-1083 @4efb479), checked by DeepSpeed 0.19.8's own classes: the MoE
    layers, experts per rank, the gate's k, dropless capacity and no sampled second expert,
    experts split over tp; then the gate's routing on random tokens equals the planned
    model's (shardwise's router, which tests/runtime hold to transformers' Mixtral)."""
    import torch
    from deepspeed.moe.layer import MoE

    from shardwise.ops.moe import RoutingRule

    assert megatron_deepspeed.moe_layers(args) == [model.is_moe_layer(i)
                                                   for i in range(model.n_layers)]
    assert args.num_experts == [model.n_experts] and args.mlp_type == "standard"
    assert args.moe_expert_parallel_size == layout.ep
    assert args.enable_expert_tensor_parallelism == (layout.tp > 1)  # etp = tp
    assert args.create_moe_param_group  # ZeRO 1/2 assert on it (stage_1_and_2.py)
    h = 32
    moe = MoE(h, torch.nn.Linear(h, h), num_experts=args.num_experts[0],
              ep_size=args.moe_expert_parallel_size, k=args.topk,
              use_residual=args.mlp_type == "residual",
              capacity_factor=args.moe_train_capacity_factor,
              eval_capacity_factor=args.moe_eval_capacity_factor,
              min_capacity=args.moe_min_capacity, drop_tokens=args.moe_token_dropping,
              enable_expert_tensor_parallelism=args.enable_expert_tensor_parallelism,
              top2_2nd_expert_sampling=args.moe_top2_2nd_expert_sampling)
    assert moe.num_local_experts == model.n_experts // layout.ep
    # the expert-parallel groups DeepSpeed builds with expert TP over this world
    # (deepspeed/utils/groups.py `_get_expert_parallel_ranks`): each of ep ranks
    from deepspeed.utils import groups

    ep_groups, _ = groups._get_expert_parallel_ranks(layout.world_size, layout.tp, layout.ep,
                                                     layout.pp)
    assert {len(g) for g in ep_groups} == {layout.ep}
    gate = moe.deepspeed_moe.gate
    torch.manual_seed(0)
    x = torch.randn(256, h)
    combine = gate(x)[1]  # (tokens, experts, capacity): every token kept when dropless
    routed = combine.sum(dim=-1)
    probs = torch.softmax(x @ gate.wg.weight.T, dim=-1)
    chosen, gates = RoutingRule(model.top_k, normalize=model.norm_topk,
                                score=model.router_score, scale=model.routed_scaling).choose(
        probs)
    ours = torch.zeros_like(probs).scatter(1, chosen, gates)
    torch.testing.assert_close(routed, ours)


def _model(plan):
    return get_model(PLANS[plan][0] if PLANS[plan] else "llama3-8b")


@pytest.mark.parametrize("plan", [p for p in PLANS if EXPECTED[p]["deepspeed"] is None])
def test_deepspeed_reads_back_the_plan(capsys, tmp_path, deepspeed_dist, plan):
    out = emit(capsys, plan, "deepspeed")
    assert out.code == 0, out.err
    assert all(note.startswith(("launch", "on the other nodes")) for note in out.notes)
    reads_back(out, _model(plan), tmp_path)


@pytest.mark.parametrize("plan", [p for p in PLANS if EXPECTED[p]["deepspeed"] is not None])
def test_deepspeed_refuses_in_one_line(capsys, plan):
    out = emit(capsys, plan, "deepspeed")
    phrase, _ = EXPECTED[plan]["deepspeed"]
    assert out.code == 2 and len(out.err.splitlines()) == 1 and phrase in out.err, out.err


OTHER_RUNS = {
    # ZB-H1 (--enable-zbh1-pipeline), DeepSpeed's own uneven split of 32 blocks over 3
    "8b-zbh1-11-11-10": ["llama3-8b", "--gpus", "24", "--global-batch", "96", "--layout",
                         "tp=8,pp=3,zero=1,schedule=zb-h1,recompute=full",
                         "--partition", "11,11,10"],
    # ZeRO-2 without a pipeline, fp32 gradients, SP (CUDA_DEVICE_MAX_CONNECTIONS=1)
    "8b-zero2-fp32-grads": ["llama3-8b", "--gpus", "16", "--global-batch", "128",
                            "--grad-dtype", "fp32", "--layout", "tp=2,sp=1,zero=2"],
    # DeepSpeed-MoE with experts split over tp=2 (no SP: DeepSpeed-MoE takes the tp ranks'
    # tokens as duplicates), ep=4 inside dp=8, ZeRO-1's MoE parameter group, 2 stages
    "mixtral-tp2-ep4-zero1-pp2": ["mixtral-8x7b", "--gpus", "32", "--global-batch", "256",
                                  "--layout", "tp=2,pp=2,ep=4,zero=1,recompute=full"],
    # fp16 with ZeRO-1 and selective recompute
    "8b-fp16-zero1": ["llama3-8b", "--gpus", "16", "--global-batch", "128", "--dtype", "fp16",
                      "--layout", "tp=2,zero=1,recompute=selective"],
}


@pytest.mark.parametrize("run", list(OTHER_RUNS))
def test_deepspeed_reads_back_other_runs(capsys, tmp_path, deepspeed_dist, run):
    out = Emit(capsys, OTHER_RUNS[run], "deepspeed")
    assert out.code == 0, out.err
    reads_back(out, get_model(OTHER_RUNS[run][0]), tmp_path)


def test_a_partial_rotary_share_reaches_megatron_deepspeed(capsys, tmp_path):
    from tests.integration.test_megatron_lm import sequential_neox

    out = Emit(capsys, [sequential_neox(tmp_path), "--gpus", "16", "--seq", "2048",
                        "--global-batch", "256", "--layout", "tp=2,zero=1"], "deepspeed")
    assert out.code == 0, out.err
    env, argv, nodes, gpus = launch(out)
    args = megatron_deepspeed.parse(argv, nodes * gpus, env)
    assert args.use_rotary_position_embeddings and args.rotary_percent == 0.25


_REAL = """
import json, sys, types, argparse
import deepspeed, torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
sys.path.insert(0, sys.argv[1])
sys.modules.setdefault("six", types.ModuleType("six"))
import megatron.arguments as arguments
from megatron.core import parallel_state
out = []
for argv, world in json.loads(sys.stdin.read()):
    sys.argv = ["pretrain_gpt.py", *argv]
    try:
        args = arguments.parse_args()
        args.world_size, args.rank = world, 0
        arguments.validate_args(args)
        if args.ds_sequence_parallel_size > 1 and args.sequence_parallel:
            raise RuntimeError("initialize.py:247")
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        try:
            parallel_state.initialize_model_parallel(
                args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                args.ds_sequence_parallel_size)
        finally:
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
        out.append(["ok", {k: getattr(args, k) for k in
                           ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                            "data_parallel_size", "sequence_parallel", "recompute_granularity",
                            "zero_stage", "enable_zbh1_pipeline", "no_pipeline_parallel")}])
    except (AssertionError, RuntimeError, SystemExit) as exc:
        out.append(["refused", str(exc)])
print(json.dumps(out))
"""


def test_model_matches_the_checkout(capsys):
    """With a Megatron-DeepSpeed checkout at `COMMIT` in $MEGATRON_DEEPSPEED (it is not on
    PyPI): its own parse_args, validate_args and initialize_model_parallel (on PyTorch's fake
    process group) accept and read the launch lines as the pinned model does, and refuse
    what it refuses; and `megatron_deepspeed_args.json` is what its parser builds."""
    checkout = os.environ.get("MEGATRON_DEEPSPEED")
    if not checkout:
        pytest.skip("set MEGATRON_DEEPSPEED to a Megatron-DeepSpeed checkout at "
                    f"{megatron_deepspeed.COMMIT[:7]}")
    require("deepspeed")
    cases = []
    for args in [*(PLANS[p] for p in PLANS if EXPECTED[p]["deepspeed"] is None),
                 *OTHER_RUNS.values()]:
        out = Emit(capsys, args, "deepspeed")
        _, argv, _, _ = launch(out)
        world = out.layout.world_size
        cases.append((argv, world))
        # what the model refuses too: Ulysses with TP, ZB-H1 with SP, an odd world
        cases.append(([*argv, "--ds-sequence-parallel-size", "2"], world * 2))
        cases.append(([*argv, "--sequence-parallel", "--enable-zbh1-pipeline"], world))
        cases.append((argv, world + 1))
    env = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}  # the CPU accelerator skips that check there
    real = json.loads(subprocess.run(
        [sys.executable, "-c", _REAL, checkout], input=json.dumps(cases), text=True,
        capture_output=True, check=True, env=os.environ | {"PYTHONPATH": ""}).stdout
        .strip().splitlines()[-1])
    for (argv, world), (verdict, values) in zip(cases, real, strict=True):
        try:
            model = megatron_deepspeed.parse(argv, world, env)
        except megatron_deepspeed.Refused:
            assert verdict == "refused", (argv, values)
            continue
        assert verdict == "ok", (argv, values)
        assert {k: getattr(model, k) for k in values} == values
    fresh = json.loads(subprocess.run(
        [sys.executable, "-c", "import json, sys; from tests.integration import "
         "megatron_deepspeed as m; print(json.dumps(m._dump(__import__('pathlib').Path("
         "sys.argv[1]))))", checkout], text=True, capture_output=True, check=True,
        cwd=Path(__file__).parents[2]).stdout.strip().splitlines()[-1])
    assert fresh["options"] == megatron_deepspeed.options()
