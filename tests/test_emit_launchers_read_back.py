"""Each launcher's job (emit.launchers) for exports on one and on several nodes, read back
in-process: the YAML by PyYAML (the PyTorchJob's replicas, the SkyPilot task's nodes and
accelerator), the Slurm script's `#SBATCH` directives, and in every job the torchrun command
by PyTorch's own `torch.distributed.run` parser — nodes, processes per node, rendezvous or
node rank and master, the program and every argument of the exported configuration, and the
files the program reads written where it reads them. tests/integration/test_launchers.py runs
the jobs with the real tools."""

from __future__ import annotations

import re
import shlex

import pytest

from shardwise.arch import get_model
from shardwise.emit import emit
from shardwise.emit.launchers import LAUNCHERS, MASTER_PORT, launcher_script
from shardwise.errors import ShardwiseError
from shardwise.layout import Layout, TrainSpec

yaml = pytest.importorskip("yaml")
run = pytest.importorskip("torch.distributed.run")

IMPL = {"megatron": "megatron-te", "torchtitan": "torchtitan", "deepspeed": "megatron-deepspeed"}
EXPORTS = {
    # 2 nodes of 8, environment variables (CUDA_DEVICE_MAX_CONNECTIONS)
    "megatron-2-nodes": ("megatron", "deepseek-v2-lite", dict(dp=4, tp=2, cp=2, ep=4, zero=1,
                                                              sp=True)),
    # one node of 4: no rendezvous, no worker
    "megatron-1-node": ("megatron", "llama3-8b", dict(dp=2, tp=2, zero=1, sp=True)),
    # 3 nodes of 8 with DeepSpeed's JSON file
    "deepspeed-3-nodes": ("deepspeed", "llama3-8b", dict(dp=12, tp=2, zero=1, sp=True)),
    # `-m torchtitan.train`
    "torchtitan-2-nodes": ("torchtitan", "llama3-8b", dict(dp=8, tp=2, zero=3)),
}


def _launch(export: str):
    framework, model, layout = EXPORTS[export]
    layout = Layout(**layout)
    out = emit(framework, get_model(model), layout,
               TrainSpec(impl=IMPL[framework], global_batch=384, seq_len=4096),
               gpus_per_node=min(8, layout.world_size))
    assert out.launch is not None
    return out.launch, layout.world_size


# what the launchers' variables hold on the second node (the shell expands them)
SHELL = {"RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29501",
         "SKYPILOT_NODE_RANK": "1", "SLURM_JOB_ID": "42"}


def _torchrun(command: str, launch) -> object:
    """torch.distributed.run's reading of a `torchrun …` shell command, its variables
    expanded as on the second node (`SHELL`); the program and its arguments must be the
    export's."""
    command = re.sub(r"\$\{?(\w+)\}?", lambda m: SHELL[m.group(1)], command)
    words = shlex.split(command.replace("\\\n", " "))
    assert words[0] == "torchrun"
    args = run.get_args_parser().parse_args(words[1:])
    program = [args.training_script, *args.training_script_args]
    if args.module:
        program = ["-m", *program]
    assert program == launch.words
    assert (args.nnodes, args.nproc_per_node) == (str(launch.nodes), str(launch.gpus_per_node))
    return args


def _heredocs(script: str) -> dict[str, str]:
    return {name: text + "\n" for name, text in re.findall(
        r"cat > (\S+) <<'SHARDWISE_EOF'\n(.*?)\nSHARDWISE_EOF", script, flags=re.S)}


def _files_written(script: str, launch) -> None:
    assert _heredocs(script) == {k: v.rstrip() + "\n" for k, v in launch.files.items()}


@pytest.mark.parametrize("export", list(EXPORTS))
def test_torchrun_and_slurm(export):
    launch, ranks = _launch(export)
    multi = launch.nodes > 1
    script = launcher_script("torchrun", launch, ranks)
    _files_written(script, launch)
    env = [line[len("export "):] for line in script.splitlines() if line.startswith("export ")]
    assert env == list(launch.env)
    command = script[script.index("torchrun"):]
    args = _torchrun(command, launch)
    assert args.rdzv_endpoint == (f"10.0.0.1:{MASTER_PORT}" if multi else "")
    assert args.rdzv_backend == ("c10d" if multi else "static")

    slurm = launcher_script("slurm", launch, ranks, name="Llama 3 / 8B!")
    sbatch = dict(re.findall(r"^#SBATCH --([a-z-]+)=?(\S*)$", slurm, flags=re.M))
    assert sbatch["job-name"] == "llama-3-8b"
    assert (sbatch["nodes"], sbatch["gpus-per-node"], sbatch["ntasks-per-node"]) == (
        str(launch.nodes), str(launch.gpus_per_node), "1")
    assert "exclusive" in sbatch
    assert f'"${{SLURM_JOB_NUM_NODES:-0}}" -ne {launch.nodes} ]' in slurm
    assert [line[len("export "):] for line in slurm.splitlines()
            if line.startswith("export ") and "MASTER" not in line] == list(launch.env)
    _files_written(slurm, launch)
    srun = slurm[slurm.index("srun "):]
    assert srun.startswith(f"srun --nodes={launch.nodes} --ntasks-per-node=1 torchrun")
    args = _torchrun(srun[srun.index("torchrun"):], launch)
    if multi:
        assert (args.rdzv_endpoint, args.rdzv_id) == ("10.0.0.1:29501", "42")


@pytest.mark.parametrize("export", list(EXPORTS))
def test_k8s_pytorchjob(export):
    launch, ranks = _launch(export)
    with pytest.raises(ShardwiseError, match="needs --image"):
        launcher_script("k8s", launch, ranks)
    job = yaml.safe_load(launcher_script("k8s", launch, ranks, name="My_Run", image="img:1"))
    assert (job["apiVersion"], job["kind"], job["metadata"]["name"]) == (
        "kubeflow.org/v1", "PyTorchJob", "my-run")
    spec = job["spec"]
    assert spec["nprocPerNode"] == str(launch.gpus_per_node)
    replicas = spec["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1
    assert replicas.get("Worker", {"replicas": 0})["replicas"] == launch.nodes - 1
    for role in replicas.values():
        pod = role["template"]["spec"]
        container, = pod["containers"]
        # the training operator finds its container by the name "pytorch"; /dev/shm is an
        # in-memory emptyDir (Kubernetes' medium "Memory") mounted by the volume's name
        assert container["name"] == "pytorch" and container["image"] == "img:1"
        volumes = {v["name"]: v for v in pod["volumes"]}
        for mount in container["volumeMounts"]:
            assert volumes[mount["name"]]["emptyDir"] == {"medium": "Memory"}
            assert mount["mountPath"] == "/dev/shm"
        assert container["resources"]["limits"]["nvidia.com/gpu"] == str(launch.gpus_per_node)
        assert [f"{e['name']}={e['value']}" for e in container.get("env", [])] == list(
            launch.env)
        assert container["command"][:2] == ["bash", "-c"]
        script = container["command"][2]
        _files_written(script, launch)
        args = _torchrun(script[script.index("torchrun"):], launch)
        if launch.nodes > 1:  # the operator's PET_* variables give rank and master
            assert (args.node_rank, args.master_addr, args.master_port) == (
                1, "10.0.0.1", 29501)
        else:
            assert args.rdzv_endpoint == ""


@pytest.mark.parametrize("export", list(EXPORTS))
def test_skypilot_task(export):
    launch, ranks = _launch(export)
    with pytest.raises(ShardwiseError, match="SkyPilot has no name"):
        launcher_script("skypilot", launch, ranks, accelerator="tpu-v5")
    task = yaml.safe_load(launcher_script("skypilot", launch, ranks, name="run",
                                          accelerator="h200"))
    assert task["num_nodes"] == launch.nodes
    assert task["resources"]["accelerators"] == f"H200:{launch.gpus_per_node}"
    assert task.get("envs", {}) == dict(e.split("=", 1) for e in launch.env)
    _files_written(task["run"], launch)
    args = _torchrun(task["run"][task["run"].index("torchrun"):], launch)
    assert args.rdzv_endpoint == (f"10.0.0.1:{MASTER_PORT}" if launch.nodes > 1 else "")
    if launch.nodes > 1:
        assert args.node_rank == 1


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_ranks_that_do_not_fill_the_nodes_are_one_line(launcher):
    launch, ranks = _launch("megatron-2-nodes")
    for wrong in (ranks - 1, ranks + launch.gpus_per_node):
        with pytest.raises(ShardwiseError) as info:
            launcher_script(launcher, launch, wrong, image="img")
        message = str(info.value)
        assert "\n" not in message and f"plan's {wrong} GPUs do not fill {launch.nodes} " \
            f"nodes of {launch.gpus_per_node} GPUs ({ranks} ranks would start)" in message
        assert message.endswith(f"plan for a multiple of {launch.gpus_per_node} GPUs or set "
                                "--gpus-per-node to match the nodes you have")
