"""A plan's launch configuration as a file to download: the framework's text under a header
comment with the share link, the equivalent `shardwise plan … --emit …` command and one note per
flag the file sets (what `activation-checkpoint:selective` or `--use-distributed-optimizer`
does), and each launcher's job under the same header (`download_job`). The web planner's
Download buttons serve them; the CLI can print the same header.

`#` starts a comment in the launch scripts (bash) and in DeepSpeed's config, which DeepSpeed
0.19.8 reads with hjson (deepspeed/runtime/config.py, `DeepSpeedConfig.__init__`).
"""

from __future__ import annotations

import re
import shlex
from typing import Any

FILES = {"megatron": "launch-megatron.sh", "torchtitan": "launch-torchtitan.sh",
         "deepspeed": "ds_config.json"}

# What each parallelism, memory and precision setting does, by the flag (or JSON key) that sets
# it; the sources are the frameworks' argument help (Megatron-LM d98e8a6
# megatron/training/arguments.py, torchtitan 0.3.0 config/job_config.py, DeepSpeed 0.19.8
# docs/_pages/config-json.md).
FLAG_NOTES: dict[str, str] = {
    # Megatron-LM
    "--tensor-model-parallel-size": "tensor parallelism: each layer's matrices split over "
                                    "this many GPUs of a node",
    "--pipeline-model-parallel-size": "pipeline parallelism: the layers split into this many "
                                      "stages",
    "--num-virtual-stages-per-pipeline-rank": "interleaved schedule: model chunks per pipeline "
                                              "rank (a smaller bubble, more p2p)",
    "--decoder-first-pipeline-num-layers": "layers of the first pipeline stage (the rest even)",
    "--decoder-last-pipeline-num-layers": "layers of the last pipeline stage",
    "--pipeline-model-parallel-layout": "which layers each virtual pipeline stage holds",
    "--context-parallel-size": "context parallelism: each sequence split over this many GPUs",
    "--cp-comm-type": "how context-parallel attention exchanges K/V (p2p: ring; a2a: Ulysses)",
    "--hierarchical-context-parallel-sizes": "hybrid context parallelism: all-to-all groups "
                                             "inside rings",
    "--expert-model-parallel-size": "expert parallelism: the experts split over this many GPUs",
    "--expert-tensor-parallel-size": "tensor parallelism inside each expert",
    "--sequence-parallel": "sequence parallelism: LayerNorm and dropout activations split "
                           "over the tensor-parallel group (reduce-scatter/all-gather "
                           "instead of all-reduce)",
    "--use-distributed-optimizer": "ZeRO-1: optimizer state sharded over the data-parallel "
                                   "replicas",
    "--data-parallel-sharding-strategy": "Megatron-FSDP: what is sharded over data parallelism "
                                         "(optim: ZeRO-1, optim_grads: ZeRO-2, "
                                         "optim_grads_params: ZeRO-3)",
    "--use-megatron-fsdp": "shard with Megatron-FSDP (ZeRO-2/3)",
    "--num-distributed-optimizer-instances": "hybrid sharding: the optimizer state sharded "
                                             "within groups, replicated across them",
    "--recompute-activations": "selective recompute: attention's core is recomputed in "
                               "backward instead of stored",
    "--recompute-granularity": "what is recomputed in backward (full: whole layers; "
                               "selective: attention's core)",
    "--recompute-method": "which layers full recompute covers (uniform / block)",
    "--recompute-num-layers": "layers per recompute group",
    "--micro-batch-size": "sequences per GPU per forward/backward",
    "--global-batch-size": "sequences per optimizer step (gradient accumulation makes up the "
                           "rest)",
    "--overlap-grad-reduce": "data-parallel gradient reduction overlapped with backward",
    "--overlap-param-gather": "ZeRO parameter all-gather overlapped with forward",
    "--tp-comm-overlap": "Transformer Engine userbuffers: tensor-parallel communication "
                         "overlapped with GEMMs",
    "--grad-reduce-in-bf16": "gradients reduced in bf16 (half the bytes of fp32)",
    "--accumulate-allreduce-grads-in-fp32": "gradients accumulated and reduced in fp32",
    "--attention-backend": "attention kernel (fused: cuDNN; flash: FlashAttention; "
                           "unfused: materialised softmax)",
    "--fp8-format": "FP8 training with Transformer Engine (the format of the scaled GEMMs)",
    "--fp8-recipe": "FP8 scaling recipe",
    "--optimizer-cpu-offload": "optimizer state and step on the host",
    "--optimizer-offload-fraction": "the share of the optimizer kept on the host",
    "--moe-token-dispatcher-type": "how tokens reach their experts (alltoall, allgather, or "
                                   "flex: DeepEP's node-aware all-to-all)",
    "--moe-flex-dispatcher-backend": "the flex dispatcher's library (deepep)",
    "--moe-grouped-gemm": "each rank's experts run as one grouped GEMM (TEGroupedMLP)",
    "--moe-shared-expert-overlap": "expert-parallel communication hidden behind the shared "
                                   "experts' GEMMs",
    "--overlap-moe-expert-parallel-comm": "one micro-batch's expert all-to-alls overlapped "
                                          "with another's compute",
    "--moe-expert-capacity-factor": "rows each expert takes, as a multiple of the balanced share",
    "--moe-pad-expert-input-to-capacity": "every expert padded to its capacity (static sizes)",
    "--moe-deepep-num-sms": "SMs DeepEP's kernels hold",
    "--recompute-modules": "the modules selective recompute runs again in backward",
    "--use-precision-aware-optimizer": "optimizer state kept at the dtypes below",
    "--exp-avg-dtype": "Adam's first moment dtype",
    "--exp-avg-sq-dtype": "Adam's second moment dtype",
    "--main-params-dtype": "master weights dtype",
    "--fine-grained-activation-offloading": "the listed modules' inputs offloaded to the host",
    "--offload-modules": "the modules whose inputs go to host memory",
    "--cuda-graph-impl": "CUDA graphs: the captured scopes replay without host launches",
    "--cuda-graph-scope": "the parts of each layer captured as CUDA graphs",
    "--mtp-num-layers": "multi-token-prediction modules trained beside the head",
    "CUDA_DEVICE_MAX_CONNECTIONS=1": "one CUDA work queue, so communication kernels start in "
                                     "the order Megatron issues them (needed with sequence "
                                     "parallelism and overlap)",
    # torchtitan
    "--parallelism.data_parallel_replicate_degree": "FSDP2/HSDP: replicas of the model (DDP "
                                                    "across shard groups)",
    "--parallelism.data_parallel_shard_degree": "FSDP2: GPUs each parameter, gradient and "
                                                "optimizer state is sharded over",
    "--parallelism.fsdp_reshard_after_forward": "FSDP2 frees gathered parameters after "
                                                "forward (always: ZeRO-3) or keeps them "
                                                "(never: ZeRO-2)",
    "--parallelism.tensor_parallel_degree": "tensor parallelism degree",
    "--parallelism.enable_sequence_parallel": "sequence parallelism with tensor parallelism",
    "--parallelism.no_enable_sequence_parallel": "tensor parallelism without sequence "
                                                 "parallelism",
    "--parallelism.pipeline_parallel_degree": "pipeline stages",
    "--parallelism.pipeline_parallel_schedule": "pipeline schedule (torchtitan's name)",
    "--parallelism.pipeline_parallel_microbatch_size": "sequences per pipeline micro-batch",
    "--parallelism.pipeline_parallel_layers_per_stage": "layers per (virtual) pipeline stage",
    "--parallelism.context_parallel_degree": "context parallelism degree",
    "--parallelism.expert_parallel_degree": "expert parallelism degree",
    "--training.local_batch_size": "sequences per GPU per step (the micro-batch without a "
                                   "pipeline)",
    "--training.global_batch_size": "sequences per optimizer step (gradient accumulation "
                                    "makes up the rest)",
    "--training.mixed_precision_param": "FSDP2's parameter dtype in compute",
    "--training.mixed_precision_reduce": "FSDP2's gradient reduction dtype",
    "--compile.enable": "torch.compile of each block",
    "--compile.enable_async_tensor_parallel": "async tensor parallelism (micro-pipelined "
                                              "collectives; needs compile)",
    "--training.enable_cpu_offload": "FSDP2 CPU offload of parameters, gradients, optimizer",
    "activation-checkpoint:none": "no activation checkpointing: every activation stored",
    "activation-checkpoint:full": "full activation checkpointing: each block's forward is "
                                  "run again in backward",
    "activation-checkpoint:selective": "selective activation checkpointing (torchtitan's "
                                       "op-level SAC: keep the outputs of compute-heavy and "
                                       "communication ops except every second matmul; "
                                       "recompute the rest)",
    # DeepSpeed config keys
    "train_micro_batch_size_per_gpu": "sequences per GPU per forward/backward",
    "gradient_accumulation_steps": "micro-batches per optimizer step",
    "train_batch_size": "sequences per optimizer step",
    "stage": "ZeRO stage: 1 optimizer state, 2 + gradients, 3 + parameters sharded over the "
             "data-parallel GPUs",
    "overlap_comm": "whether ZeRO's communication overlaps backward",
    "reduce_bucket_size": "elements per gradient reduction bucket",
    "allgather_bucket_size": "elements per parameter all-gather bucket",
    "stage3_prefetch_bucket_size": "ZeRO-3: elements of parameters fetched ahead",
    "stage3_param_persistence_threshold": "ZeRO-3: parameters below this many elements stay "
                                          "gathered",
    "communication_data_type": "dtype of gradient communication",
    "offload_optimizer": "optimizer state and step on the host",
}


def flag_notes(config: str) -> list[str]:
    """One `flag value: what it does` line per known setting in `config`, in file order."""
    notes, seen = [], set()
    pattern = re.compile(r'(CUDA_DEVICE_MAX_CONNECTIONS=1|activation-checkpoint:\w+|--[\w.-]+'
                         r'|"(\w+)":)[ ]?([^\s\\"{]*)')
    for m in pattern.finditer(config):
        flag = m[2] or m[1]
        if flag in FLAG_NOTES and flag not in seen:
            seen.add(flag)
            value = m[3].rstrip(",") if m[3] not in ("", "\\") else ""
            notes.append(f"{flag}{' ' + value if value else ''}: {FLAG_NOTES[flag]}")
    return notes


# not in the command: how many rows the page lists changes nothing in the file (a compared
# --layout stays: --emit exports it, as the plan's payload does)
SKIPPED = {"emit", "top", "image"}
# a launcher's job: its file name (`{framework}` the exported framework's)
JOB_FILES = {"torchrun": "torchrun-{framework}.sh", "slurm": "{framework}.sbatch",
             "k8s": "{framework}-pytorchjob.yaml", "skypilot": "{framework}-skypilot.yaml"}


def plan_command(request: dict[str, Any], framework: str) -> str:
    """The `shardwise plan … --emit FRAMEWORK` command that prints `framework`'s file for the
    planner's `request` (its fields named as `shardwise plan`'s parameters; defaults left
    out). An uploaded config.json is `config.json` on the command line."""
    import click

    from shardwise.cli.planner import plan as command

    words = ["shardwise", "plan", "config.json" if request.get("hf_config") else
             str(request.get("model", ""))]
    for param in command.params:
        key = param.opts[0].lstrip("-").replace("-", "_")  # --fix → fix (its name: fix_text)
        if not isinstance(param, click.Option) or key not in request:
            continue
        value, default = request[key], param.default
        if value is None or value == default or key in SKIPPED:
            continue
        if param.is_flag and param.secondary_opts:  # --flash / --no-flash
            words.append(param.opts[0] if value else param.secondary_opts[0])
        elif param.is_flag:
            if value:
                words.append(param.opts[0])
        elif not isinstance(value, bool):
            words += [param.opts[0], str(value)]
    return shlex.join([*words, "--emit", framework])


def header(link: str | None, command: str, notes: list[str]) -> list[str]:
    """The header comment's lines (without `# `)."""
    lines = ["written by shardwise (the web planner's Download)"]
    if link:
        lines.append(f"this plan: {link}")
    lines += ["the same file: " + command, "", "what each setting does:"]
    lines += [f"  {note}" for note in notes]
    return lines


def download(framework: str, config: str, command: str, link: str | None) -> dict[str, str]:
    """The file a Download button saves: its name and text, the header comment first."""
    lines = header(link, command, flag_notes(config))
    top = "\n".join(f"# {line}".rstrip() for line in lines) + "\n"
    if config.startswith("#!"):  # keep a shebang first
        first, rest = config.split("\n", 1)
        return {"filename": FILES[framework], "text": f"{first}\n{top}{rest}"}
    return {"filename": FILES[framework], "text": top + config}


def download_job(framework: str, launcher: str, job: str, command: str, link: str | None,
                 image: str | None) -> dict[str, str]:
    """A launcher's job as a file: `download`'s header (its command `plan … --emit F
    --launcher L`, `--image` for k8s) over the job `plan … --launcher L` prints."""
    words = ["--launcher", launcher, *(["--image", image] if launcher == "k8s" and image else [])]
    file = download(framework, job, f"{command} {shlex.join(words)}", link)
    return {"filename": JOB_FILES[launcher].format(framework=framework), "text": file["text"]}
