"""`--emit torchtitan` read by torchtitan 0.3.0's own code: `ConfigManager.parse_args` (the
`--module/--config` loader, tyro parsing and `Trainer.Config` validation), `ParallelDims` and
its device mesh (on PyTorch's fake process group, the backend of torchtitan's own dry-run
mode), the pipeline stage split, FSDP's reshard policy and the trainer's batch arithmetic.
"""

import pytest

from shardwise.arch import get_model
from tests.integration.conftest import emit, planned_batch, planned_seq, require
from tests.integration.plans import PLANS

pytestmark = pytest.mark.integration

# Plans torchtitan cannot run, with the reason the export gives.
REFUSED = {"mixtral-ep8": "ships no mixtral-8x7b model",
           "mixtral-ep8-zero1": "ships no mixtral-8x7b model",
           "8b-fp16": "bfloat16 or float32 only",
           "gpt3-1.3b-zero3": "ships no gpt3-1.3b model",
           "175b-a100-noflash": "ships no gpt3-175b model",
           "bloom-pp12": "ships no bloom model",
           # torchtitan shortens only the first and the last virtual stage
           "70b-pp6-uneven-interleaved": "torchtitan cannot split 80 layers",
           # its context parallelism exchanges K/V; no all-to-all over heads
           "8b-ulysses": "cp_kind=ulysses cannot run", "8b-hybrid-cp": "cp_kind=hybrid cannot run",
           "405b-16k-searched": "cp_kind=hybrid cannot run"}  # the search's best: cp8 hybrid


def _parse(argv, monkeypatch):
    """torchtitan's Trainer.Config from the arguments after `-m torchtitan.train`."""
    require("torchtitan")
    import torchtitan.components.quantization.float8 as float8
    from torchtitan.config.manager import ConfigManager

    # llama3_405b converts its linears to Float8, which probes for an SM89+ GPU; stand in
    # for the H100s the plan targets (the conversion itself is torchao's, run as shipped).
    monkeypatch.setattr(float8, "has_cuda_capability", lambda major, minor: True)
    return ConfigManager().parse_args(argv)


def _mesh(parallelism, world_size):
    """ParallelDims validated and its mesh built over `world_size` fake ranks."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torchtitan.distributed.parallel_dims import ParallelDims

    dims = ParallelDims.from_config(parallelism, world_size)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        dims.build_mesh()  # runs _validate_meshes: every axis has its expected size
        sizes = {name: mesh.size() for name, mesh in dims._single_axis_meshes.items()}
    finally:
        dist.destroy_process_group()
    return dims, sizes


@pytest.mark.parametrize("plan", list(PLANS))
def test_torchtitan_reads_back_the_plan(capsys, monkeypatch, plan):
    require("torchtitan")
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.distributed.fsdp import get_fsdp_reshard_after_forward_policy
    from torchtitan.distributed.pipeline_parallel import (
        _generate_llm_fqn_per_model_part,
        _get_pipeline_metadata,
    )

    out = emit(capsys, plan, "torchtitan")
    if plan in REFUSED:
        assert out.code == 2 and len(out.err.splitlines()) == 1
        assert REFUSED[plan] in out.err
        return
    assert out.code == 0, out.err
    layout = out.layout
    env, words = out.command()
    assert env == {}  # torchtitan needs no environment beyond torchrun's
    assert words[0] == "torchrun" and words[words.index("-m") + 1] == "torchtitan.train"
    launch = words[:words.index("-m")]
    nodes = int(launch[launch.index("--nnodes") + 1])
    assert nodes * int(launch[launch.index("--nproc-per-node") + 1]) == layout.world_size
    config = _parse(words[words.index("-m") + 2:], monkeypatch)
    par, training = config.parallelism, config.training
    # the model torchtitan builds has the planned shape
    model = get_model(PLANS[plan][0] if PLANS[plan] else "llama3-8b")
    spec = config.model_spec.model
    assert (len(spec.layers), spec.dim, spec.vocab_size) == (model.n_layers, model.d_model,
                                                             model.vocab)
    # parallel degrees: the mesh has the planned dp·cp·tp·pp and ep
    dims, sizes = _mesh(par, layout.world_size)
    assert (sizes["tp"], sizes["pp"], sizes["cp"], sizes["ep"]) == (layout.tp, layout.pp,
                                                                    layout.cp, layout.ep)
    assert sizes["batch"] == layout.dp
    assert par.enable_sequence_parallel == (layout.sp or layout.tp == 1)
    # ZeRO: FSDP shards over dp_shard·cp ranks (the hybrid group) and reshards after forward
    # exactly for ZeRO-3
    group = layout.zero_group or layout.dp * layout.cp
    if layout.zero and group % layout.cp == 0:
        assert dims.dp_shard * layout.cp == group
    assert get_fsdp_reshard_after_forward_policy(par.fsdp_reshard_after_forward,
                                                 layout.pp > 1) == (layout.zero == 3)
    # pipeline: pp·chunks stages of L/(pp·chunks) layers each
    if layout.pp > 1:
        stages, layers, first, last = _get_pipeline_metadata(dims, par, spec)
        assert stages == layout.pp * layout.chunks
        parts = _generate_llm_fqn_per_model_part(stages, layers, first, last)
        per_stage = tuple(sum(name.startswith("layers.") for name in part) for part in parts)
        assert per_stage == layout.stage_sizes(model.n_layers)
        assert par.pipeline_parallel_microbatch_size == layout.micro_batch
        schedule = {"interleaved": "Interleaved1F1B", "gpipe": "GPipe"}
        assert par.pipeline_parallel_schedule == schedule.get(layout.schedule, "1F1B")
    # batch, as the trainer computes it (torchtitan/trainer.py): accumulation steps and
    # pipeline micro-batches multiply to the planned micro-batches per step
    assert training.global_batch_size == planned_batch(plan)
    assert training.seq_len == planned_seq(plan)
    accumulation = training.global_batch_size // (training.local_batch_size * layout.dp)
    micro = (training.local_batch_size // par.pipeline_parallel_microbatch_size
             if layout.pp > 1 else 1)
    assert accumulation * micro * layout.dp * layout.micro_batch == planned_batch(plan)
    if layout.pp == 1:  # without pp the local batch is the micro-batch
        assert training.local_batch_size == layout.micro_batch
    # precision, activation checkpointing, CUDA graphs
    assert training.mixed_precision_param == "bfloat16"
    kind = {"none": type(None), "selective": SelectiveAC.Config, "full": FullAC.Config}
    assert type(config.activation_checkpoint) is kind[layout.recompute]
    assert training.disable_cuda_graphs == (layout.pp > 1 or layout.ep > 1)
