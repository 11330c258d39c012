"""Launchers: the job that runs an exported configuration on the planned cluster shape.

    launcher_script(launcher, launch, name=…, image=…) -> str

`Launch` is what runs on every node: `torchrun` over `nodes × gpus_per_node` ranks, the
environment the stack documents, the program and its arguments, and any file the program
reads (DeepSpeed's JSON). `torchrun` prints the multi-node command (rendezvous at
`$MASTER_ADDR`); `slurm` an `sbatch` script (rendezvous on the allocation's first node, one
`srun` task per node, refusing an allocation of another shape); `k8s` a Kubeflow PyTorchJob
(`kubeflow.org/v1`: one Master and `nodes − 1` Workers whose `PET_*` variables give torchrun its
node rank and master); `skypilot` a SkyPilot task (`num_nodes`, the accelerator, torchrun
from `SKYPILOT_*`). A plan whose ranks do not fill whole nodes is refused. docs/howto/launch.md.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field

from shardwise.errors import ShardwiseError

LAUNCHERS = ("torchrun", "slurm", "k8s", "skypilot")
MASTER_PORT = 29500
# SkyPilot's accelerator names (`sky show-gpus`) for the catalogue's accelerators
SKYPILOT_ACCELERATORS = {"a100-40gb": "A100", "a100-80gb": "A100-80GB", "h100-sxm": "H100",
                         "h100-pcie": "H100", "h100-nvl": "H100-NVL", "h800": "H800",
                         "h200": "H200", "gh200": "GH200", "b200": "B200", "gb200": "GB200",
                         "mi300x": "MI300X", "mi325x": "MI325X"}


@dataclass(frozen=True)
class Launch:
    """What one node runs: `torchrun` with `gpus_per_node` processes on each of `nodes`,
    `env` ("NAME=value"), `program` (a script or `-m module`) and its `args` (shell words as the
    configuration prints them), and `files` the program reads (name → text)."""

    nodes: int
    gpus_per_node: int
    env: tuple[str, ...]
    program: tuple[str, ...]
    args: tuple[str, ...]
    header: str = ""
    files: dict[str, str] = field(default_factory=dict)

    @property
    def words(self) -> list[str]:
        """The program and its arguments as argv words."""
        return [*self.program, *shlex.split(" ".join(self.args))]

    def torchrun(self, rendezvous: str | None) -> list[str]:
        """torchrun's argv words before the program: c10d rendezvous at `rendezvous`
        (host:port) across nodes, or none (static: torchrun reads `PET_*` variables)."""
        words = ["torchrun", "--nnodes", str(self.nodes), "--nproc-per-node",
                 str(self.gpus_per_node)]
        if self.nodes > 1 and rendezvous:
            words += ["--rdzv-backend", "c10d", "--rdzv-endpoint", rendezvous]
        return words


def check_shape(launch: Launch, ranks: int) -> None:
    """Refuse, in one line, `ranks` ranks that do not fill `launch`'s nodes (a launcher
    starts `gpus_per_node` processes on every node)."""
    if launch.nodes * launch.gpus_per_node != ranks:
        raise ShardwiseError(
            f"the plan's {ranks} GPUs do not fill {launch.nodes} nodes of "
            f"{launch.gpus_per_node} GPUs ({launch.nodes * launch.gpus_per_node} ranks would "
            f"start); plan for a multiple of {launch.gpus_per_node} GPUs or set "
            "--gpus-per-node to match the nodes you have")


def _name(text: str) -> str:
    """A DNS-1123 label (Kubernetes, Slurm and SkyPilot accept it): lower case, digits, '-'."""
    label = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:52].strip("-")
    return label or "shardwise"


def _heredocs(files: dict[str, str]) -> list[str]:
    return [f"cat > {name} <<'SHARDWISE_EOF'\n{text.rstrip()}\nSHARDWISE_EOF"
            for name, text in files.items()]


def _command(launcher: list[str], program: list[str], indent: str = "  ") -> str:
    """A launcher's and its program's argv words as one shell command: each option with its
    value on a continued line, the program on a line of its own; words that start with `$` or
    `"$` are left to the shell to expand."""
    lines: list[list[str]] = [[]]
    for i, word in enumerate([*launcher, *program]):
        if lines[-1] and (word.startswith("-") or i == len(launcher)):
            lines.append([])
        lines[-1].append(word if word.startswith(("$", '"$')) else shlex.quote(word))
    return f" \\\n{indent}".join(" ".join(line) for line in lines)


def torchrun_script(launch: Launch) -> str:
    """The multi-node `torchrun` command (run it on every node with MASTER_ADDR set)."""
    env = [f"export {item}" for item in launch.env]
    rdzv = "$MASTER_ADDR:" + str(MASTER_PORT)
    body = [*_heredocs(launch.files), *env, _command(launch.torchrun(rdzv), launch.words)]
    return "\n".join(filter(None, [launch.header, *body])) + "\n"


def slurm_script(launch: Launch, name: str) -> str:
    """An `sbatch` script: `nodes` exclusive nodes of `gpus_per_node` GPUs, one `srun` task per
    node running torchrun, rendezvous on the allocation's first node."""
    n, g = launch.nodes, launch.gpus_per_node
    words = launch.torchrun('"$MASTER_ADDR:$MASTER_PORT"')
    if n > 1:
        words[words.index("c10d") + 1:words.index("c10d") + 1] = ["--rdzv-id",
                                                                    '"$SLURM_JOB_ID"']
    lines = ["#!/bin/bash", launch.header,
             f"#SBATCH --job-name={_name(name)}", f"#SBATCH --nodes={n}",
             "#SBATCH --ntasks-per-node=1", f"#SBATCH --gpus-per-node={g}",
             "#SBATCH --exclusive", "#SBATCH --output=%x-%j.out", "set -euo pipefail",
             f'if [ "${{SLURM_JOB_NUM_NODES:-0}}" -ne {n} ]; then',
             f'  echo "this plan needs {n} nodes of {g} GPUs; the allocation has '
             '${SLURM_JOB_NUM_NODES:-0} nodes" >&2',
             "  exit 2", "fi",
             'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)',
             f"MASTER_PORT={MASTER_PORT}", "export MASTER_ADDR MASTER_PORT",
             *[f"export {item}" for item in launch.env], *_heredocs(launch.files),
             f"srun --nodes={n} --ntasks-per-node=1 " + _command(words, launch.words)]
    return "\n".join(filter(None, lines)) + "\n"


def _yaml(value: object, indent: int = 0) -> str:
    """`value` as YAML (JSON is YAML; block style for the readers' sake, scalars as JSON)."""
    pad = "  " * indent
    if isinstance(value, dict):
        out = []
        for key, item in value.items():
            if isinstance(item, (dict, list)) and item:
                out.append(f"{pad}{key}:\n{_yaml(item, indent + 1)}")
            elif isinstance(item, str) and "\n" in item:
                block = "\n".join(f"{pad}  {line}" if line else "" for line in
                                  item.rstrip("\n").split("\n"))
                out.append(f"{pad}{key}: |\n{block}")
            else:
                out.append(f"{pad}{key}: {json.dumps(item)}")
        return "\n".join(out)
    if isinstance(value, list):
        out = []
        for item in value:
            if isinstance(item, str) and "\n" in item:
                block = "\n".join(f"{pad}    {line}" if line else "" for line in
                                  item.rstrip("\n").split("\n"))
                out.append(f"{pad}- |\n{block}")
                continue
            text = _yaml(item, indent + 1) if isinstance(item, (dict, list)) else \
                f"{pad}  {json.dumps(item)}"
            out.append(f"{pad}- {text.lstrip()}")
        return "\n".join(out)
    return f"{pad}{json.dumps(value)}"


def k8s_manifest(launch: Launch, name: str, image: str | None) -> str:
    """A Kubeflow PyTorchJob (training-operator, kubeflow.org/v1): a Master and `nodes − 1`
    Workers, each one pod of `gpus_per_node` GPUs running torchrun, whose node rank and
    master address come from the operator's `PET_*` variables; /dev/shm in memory for NCCL."""
    if not image:
        raise ShardwiseError("--launcher k8s needs --image: the container image holding the "
                             "framework the configuration runs")
    words = launch.torchrun(None)
    if launch.nodes > 1:  # the operator's variables: this pod's rank, the master's address
        words += ["--node-rank", '"$RANK"', "--master-addr", '"$MASTER_ADDR"',
                  "--master-port", '"$MASTER_PORT"']
    script = "\n".join([*_heredocs(launch.files), _command(words, launch.words)])
    env = [{"name": k, "value": v} for k, v in (item.split("=", 1) for item in launch.env)]
    container = {"name": "pytorch", "image": image, "command": ["bash", "-c", script],
                 "resources": {"limits": {"nvidia.com/gpu": str(launch.gpus_per_node)}},
                 "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}]}
    if env:
        container["env"] = env
    template = {"spec": {"containers": [container],
                         "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]}}
    replicas = {"Master": {"replicas": 1, "restartPolicy": "OnFailure", "template": template}}
    if launch.nodes > 1:
        replicas["Worker"] = {"replicas": launch.nodes - 1, "restartPolicy": "OnFailure",
                              "template": template}
    job = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
           "metadata": {"name": _name(name)},
           "spec": {"nprocPerNode": str(launch.gpus_per_node), "pytorchReplicaSpecs": replicas,
                    # keep the pods (and their logs) when the job ends
                    "runPolicy": {"cleanPodPolicy": "None"}}}
    header = "\n".join(f"# {line.lstrip('# ')}" for line in launch.header.splitlines())
    return (header + "\n" if header else "") + _yaml(job) + "\n"


def skypilot_task(launch: Launch, name: str, accelerator: str) -> str:
    """A SkyPilot task: `num_nodes` nodes with `gpus_per_node` of the plan's accelerator,
    torchrun from SkyPilot's `SKYPILOT_NODE_RANK`, `SKYPILOT_NODE_IPS` (the first is the
    master)."""
    sky = SKYPILOT_ACCELERATORS.get(accelerator)
    if sky is None:
        raise ShardwiseError(f"SkyPilot has no name for {accelerator}; valid accelerators for "
                             f"--launcher skypilot: {', '.join(SKYPILOT_ACCELERATORS)}")
    words = launch.torchrun("$MASTER_ADDR:" + str(MASTER_PORT))
    if launch.nodes > 1:
        words += ["--node-rank", "$SKYPILOT_NODE_RANK"]
    run = "\n".join([*_heredocs(launch.files),
                     'MASTER_ADDR=$(echo "$SKYPILOT_NODE_IPS" | sed -n 1p)',
                     _command(words, launch.words)])
    task: dict[str, object] = {"name": _name(name), "num_nodes": launch.nodes,
                               "resources": {"accelerators": f"{sky}:{launch.gpus_per_node}"}}
    if launch.env:
        task["envs"] = dict(item.split("=", 1) for item in launch.env)
    task["run"] = run + "\n"
    header = "\n".join(f"# {line.lstrip('# ')}" for line in launch.header.splitlines())
    return (header + "\n" if header else "") + _yaml(task) + "\n"


def launcher_script(launcher: str, launch: Launch, ranks: int, *, name: str = "shardwise",
                    image: str | None = None, accelerator: str = "h100-sxm") -> str:
    """The job `launcher` (one of `LAUNCHERS`) writes for `launch` of `ranks` ranks."""
    check_shape(launch, ranks)
    if launcher == "torchrun":
        return torchrun_script(launch)
    if launcher == "slurm":
        return slurm_script(launch, name)
    if launcher == "k8s":
        return k8s_manifest(launch, name, image)
    if launcher == "skypilot":
        return skypilot_task(launch, name, accelerator)
    raise ShardwiseError(f"unknown launcher {launcher!r}; valid: {', '.join(LAUNCHERS)}")
