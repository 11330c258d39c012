"""`--emit deepspeed` read by DeepSpeed 0.19.8's own `DeepSpeedConfig` and its engine's rules.

The data-parallel world comes from a Megatron-style `mpu` (the interface DeepSpeed asks
Megatron-DeepSpeed for); the engine's optimizer sanity check (`_do_optimizer_sanity_check`)
and the pipeline engine's ZeRO rule run on the parsed config without GPUs.
"""

import itertools

import pytest

from shardwise.arch import get_model
from tests.integration.conftest import emit, planned_batch, require
from tests.integration.plans import PLANS

pytestmark = pytest.mark.integration

# Plans DeepSpeed cannot run, with the reason the export gives.
REFUSED = {"405b-16k-searched": "cannot combine Megatron sequence parallelism",
           "70b-cp16": "cannot combine Megatron sequence parallelism",
           "70b-tp8-cp8-zero3g4": "cannot combine Megatron sequence parallelism",
           "70b-tp8-pp2-zero3": "pipeline engine refuses ZeRO-3",
           "70b-pp6-uneven-interleaved": "DeepSpeed cannot run the partition 12,14,14,14,14,12",
           # DeepSpeed's sequence parallelism is Ulysses only
           "70b-zbh1-cp": "Ulysses (all-to-all over heads) only: cp_kind=ring",
           "8b-hybrid-cp": "Ulysses (all-to-all over heads) only: cp_kind=hybrid",
           # the default run's winner once ranked by its simulated bubble: two stages of 17/15
           "8b-default": "DeepSpeed cannot run the partition 17,15"}


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


@pytest.mark.parametrize("plan", list(PLANS))
def test_deepspeed_config_reads_back_the_plan(capsys, tmp_path, deepspeed_dist, plan):
    require("deepspeed")
    import torch
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.config import ZeroStageEnum

    out = emit(capsys, plan, "deepspeed")
    if plan in REFUSED:
        assert out.code == 2 and len(out.err.splitlines()) == 1
        assert REFUSED[plan] in out.err
        return
    assert out.code == 0, out.err
    layout = out.layout
    path = tmp_path / "ds_config.json"
    path.write_text(out.text)
    config = DeepSpeedConfig(str(path), mpu=_Mpu(layout.dp))
    dtype = "fp16" if "fp16" in PLANS[plan] else "bf16"
    # batch: DeepSpeed checks train = micro · accumulation · dp itself
    assert config.train_batch_size == planned_batch(plan)
    assert config.train_micro_batch_size_per_gpu == layout.micro_batch
    assert config.gradient_accumulation_steps == config.train_batch_size // (
        layout.micro_batch * layout.dp)
    # ZeRO stage and the ZeRO++ group that stands in for hybrid ZeRO-3
    assert config.zero_optimization_stage == layout.zero
    assert config.zero_config.zero_hpz_partition_size == (
        layout.zero_group if layout.zero == 3 and layout.zero_group else 1)
    # precision and gradient dtype
    assert config.bfloat16_config.enabled == (dtype == "bf16")
    assert config.float16_config.enabled == (dtype == "fp16")
    want = torch.bfloat16 if dtype == "bf16" else torch.float16
    assert config.communication_data_type == want
    assert config.activation_checkpointing_config.partition_activations == (
        layout.recompute != "none" and layout.tp > 1)
    # the engine's own rules on the parsed config
    engine = DeepSpeedEngine.__new__(DeepSpeedEngine)
    torch.nn.Module.__init__(engine)
    engine._config, engine.global_rank, engine.pipeline_parallelism = config, 0, layout.pp > 1
    assert engine.get_data_types() == (want, want)
    engine._do_optimizer_sanity_check(torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))]))
    if layout.pp > 1:  # PipelineEngine.__init__'s assertion
        assert engine.zero_optimization_stage() < ZeroStageEnum.gradients
    # the launch line: deepspeed over whole nodes with the model-parallel degrees
    launch = out.notes[0]
    nodes = int(launch.split("--num_nodes ")[1].split()[0])
    gpus = int(launch.split("--num_gpus ")[1].split()[0])
    assert nodes * gpus == layout.world_size
    if layout.tp > 1 or layout.pp > 1 or layout.cp > 1:
        assert f"--tensor-model-parallel-size {layout.tp} " in launch
        assert f"--pipeline-model-parallel-size {layout.pp} " in launch
        assert ("--sequence-parallel" in launch.split()) == layout.sp
        assert (f"--ds-sequence-parallel-size {layout.cp}" in launch) == (layout.cp > 1)
    if layout.pp > 1:  # the stages, as DeepSpeed's PipelineModule partitions them
        from deepspeed.runtime.utils import partition_balanced, partition_uniform
        n = get_model(PLANS[plan][0]).n_layers
        ends = "type:transformer|embedding" in launch  # embedding, head: one layer each
        bounds = (partition_balanced([1] * (n + 2), layout.pp) if ends
                  else partition_uniform(n, layout.pp))  # the Megatron-DeepSpeed default
        sizes = [int(b - a) for a, b in itertools.pairwise(bounds)]
        if ends:
            sizes[0] -= 1
            sizes[-1] -= 1
        # one stage per rank: an interleaved plan's chunks run as 1F1B
        assert tuple(sizes) == tuple(k * layout.chunks for k in layout.stage_partition(n))
