"""The launchers' jobs (emit.launchers) checked where the in-process read-back stops: SkyPilot's
run block executed by bash with SkyPilot's own variables (SKYPILOT_NODE_IPS, one address a
line, and SKYPILOT_NODE_RANK, docs.skypilot.co "Environment variables"), torchrun stubbed to
print what it receives; the PyTorchJob's restart policies as Kubeflow's training operator
spells them; the header's comment lines; environment values holding "="."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from shardwise.arch import get_model
from shardwise.emit import emit
from shardwise.emit.launchers import LAUNCHERS, MASTER_PORT, Launch, launcher_script
from shardwise.errors import ShardwiseError
from shardwise.layout import Layout, TrainSpec

yaml = pytest.importorskip("yaml")


def _launch():
    """Megatron-LM over 2 nodes of 8 (tp·cp·ep = 16, SP: CUDA_DEVICE_MAX_CONNECTIONS)."""
    layout = Layout(dp=4, tp=2, cp=2, ep=4, zero=1, sp=True)
    out = emit("megatron", get_model("deepseek-v2-lite"), layout,
               TrainSpec(impl="megatron-te", global_batch=384, seq_len=4096))
    assert out.launch is not None and out.launch.nodes == 2
    return out.launch


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_skypilots_run_block_starts_torchrun_at_the_first_nodes_address(tmp_path):
    launch = _launch()
    task = yaml.safe_load(launcher_script("skypilot", launch, 16, name="run",
                                          accelerator="h100-sxm"))
    stub = 'torchrun() { printf "%s\\n" "$@"; }\n'
    env = {"PATH": "/usr/bin:/bin", "SKYPILOT_NODE_IPS": "10.0.0.7\n10.0.0.8",
           "SKYPILOT_NODE_RANK": "1"}
    done = subprocess.run(["bash", "-c", stub + task["run"]], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    words = done.stdout.splitlines()
    assert words[words.index("--rdzv-endpoint") + 1] == f"10.0.0.7:{MASTER_PORT}"
    assert words[words.index("--node-rank") + 1] == "1"
    assert words[words.index("--nnodes") + 1] == "2"


def test_the_pytorchjobs_replicas_restart_on_failure():
    """Kubeflow training-operator v1 ReplicaSpec.restartPolicy: one of Always, OnFailure,
    Never, ExitCode (pkg/apis/kubeflow.org/v1/common_types.go), case and all."""
    job = yaml.safe_load(launcher_script("k8s", _launch(), 16, name="run", image="img:1"))
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert {role: spec["restartPolicy"] for role, spec in replicas.items()} == {
        "Master": "OnFailure", "Worker": "OnFailure"}


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_the_header_is_one_comment_line_per_line(launcher):
    launch = _launch()
    text = launcher_script(launcher, launch, 16, name="run", image="img:1")
    first = launch.header.splitlines()[0]
    assert first.startswith("# shardwise: ")
    assert first in text.splitlines() and "# # " not in text


def test_an_unknown_launcher_is_one_line():
    with pytest.raises(ShardwiseError) as info:
        launcher_script("mpirun", _launch(), 16)
    assert str(info.value) == ("unknown launcher 'mpirun'; valid: " + ", ".join(LAUNCHERS))


def test_skypilot_envs_keep_values_with_equals_signs():
    """`KEY=VALUE` splits at the first "=": XLA-style flags keep theirs."""
    launch = Launch(1, 8, ("NCCL_DEBUG=INFO", "XLA_FLAGS=--xla_gpu_enable=true=1"),
                    ("train.py",), ("--steps 10",), "# shardwise: test", {})
    task = yaml.safe_load(launcher_script("skypilot", launch, 8, name="run",
                                          accelerator="h100-sxm"))
    assert task["envs"] == {"NCCL_DEBUG": "INFO", "XLA_FLAGS": "--xla_gpu_enable=true=1"}

