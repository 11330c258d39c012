"""`shardwise train|check … --launcher L`: each job run with the stand-ins (`launch_jobs`), the
argv its torchrun receives parsed by PyTorch's own `torch.distributed.run` parser, and the
program's arguments by shardwise's own click command (`make_context`: parsed and checked, not
run) into the same parameters as the command the user typed, less the launcher options."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.cli_helpers import assert_one_line_error
from tests.integration.conftest import IMAGE
from tests.integration.launch_jobs import VALIDATORS, run_job, tool

torch_run = pytest.importorskip("torch.distributed.run")

# torch refused: the job is written (or refused) before the runtime is imported
NO_TORCH = "import sys; sys.modules['torch'] = None; from shardwise.cli import main; main()"
# dp·tp·cp = 2·2·2 ranks on 2 nodes of 4; a value with a space and a flag to carry over
RUN = ["--model", "tiny", "--dp", "2", "--tp", "2", "--cp", "2", "--seq", "32",
       "--global-batch", "16", "--data", "my corpus/text.txt", "--dtype", "bf16", "--sp"]
EXTRA = {"train": ["--steps", "7", "--lr", "1e-3", "--checkpoint-dir", "ckpt dir"],
         "check": ["--steps", "3", "--per-rank"]}
SHAPE = ["--nodes", "2", "--gpus-per-node", "4"]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", NO_TORCH, *args], capture_output=True,
                          text=True, timeout=120)


def launched(launcher: str, job: str, tmp) -> list[str]:
    """The argv the job's torchrun receives on the first node."""
    if launcher == "torchrun":
        done, calls = run_job(job, tmp, {"MASTER_ADDR": "node-001"})
    elif launcher == "slurm":
        done, calls = run_job(job, tmp, {"SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_ID": "42",
                                         "SLURM_JOB_NODELIST": "node-[001-002]"})
    else:  # read by the tool's own parser in the launchers' environment
        (tmp / "job.yaml").write_text(job)
        read = subprocess.run([tool("python"), str(VALIDATORS), launcher, str(tmp / "job.yaml")],
                              text=True, capture_output=True, timeout=120)
        assert read.returncode == 0, read.stderr[-2000:]
        got = json.loads(read.stdout)
        if launcher == "k8s":
            assert got["Worker"]["replicas"] == 1 and got["nproc"] == "4"
            done, calls = run_job(got["Master"]["command"], tmp,
                                  {"RANK": "0", "MASTER_ADDR": "job-master-0",
                                   "MASTER_PORT": "23456"})
        else:
            assert got["num_nodes"] == 2 and list(got["accelerators"].values()) == [4]
            done, calls = run_job(got["run"], tmp, {"SKYPILOT_NODE_RANK": "0",
                                                    "SKYPILOT_NODE_IPS": "10.0.0.1\n10.0.0.2"})
    assert done.returncode == 0, done.stderr
    (argv,) = calls
    return argv


@pytest.mark.parametrize("launcher", ["torchrun", "slurm", "k8s", "skypilot"])
@pytest.mark.parametrize("command", ["train", "check"])
def test_the_job_runs_the_same_command_on_the_planned_nodes(command, launcher, tmp_path):
    from shardwise.cli.runs import check, train

    typed = [*RUN, *EXTRA[command]]
    out = cli(command, *typed, "--launcher", launcher, *SHAPE, "--image", IMAGE,
              "--job-name", "my job")
    assert out.returncode == 0, out.stderr
    args = torch_run.get_args_parser().parse_args(launched(launcher, out.stdout, tmp_path))
    assert (args.nnodes, args.nproc_per_node) == ("2", "4")
    assert args.module and args.training_script == "shardwise"
    assert args.training_script_args[0] == command
    click_command = {"train": train, "check": check}[command]
    got = click_command.make_context(command, args.training_script_args[1:]).params
    want = click_command.make_context(command, list(typed)).params
    assert got == want and got["data_path"] == "my corpus/text.txt"
    assert got["launcher"] is None and got["nodes"] is None  # not passed on


def test_a_shape_that_does_not_match_the_layout_is_refused():
    # 8 ranks on 3 nodes of 4: 12 would start
    assert_one_line_error(cli("train", *RUN, "--launcher", "slurm", "--nodes", "3",
                              "--gpus-per-node", "4"), "8 GPUs do not fill 3 nodes of 4")
    assert_one_line_error(cli("check", *RUN, "--launcher", "skypilot", "--gpus-per-node", "3"),
                          "8 GPUs do not fill 3 nodes of 3")
    assert_one_line_error(cli("train", *RUN, "--launcher", "k8s"), "needs --image")
    assert_one_line_error(cli("train", *RUN, "--nodes", "2"), "--nodes need --launcher")
    # the layout is checked as the run checks it (tp must divide the heads)
    assert_one_line_error(cli("train", "--model", "tiny", "--tp", "3", "--launcher",
                              "torchrun"), "tp")
