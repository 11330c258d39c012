"""Every launcher's job for every exported plan of the export tests, read by the real tools:

* each job runs (bash, with stand-in `torchrun`, `srun` and `scontrol` that record what they
  are handed) and the argv torchrun gets is parsed by PyTorch's own `torch.distributed.run`
  parser: whole nodes, the program and every argument of the exported configuration, and
  DeepSpeed's JSON written where the program reads it;
* the Slurm script passes shellcheck and its `#SBATCH` directives are options `sbatch --help`
  lists (Debian's slurm-client); an allocation of another shape makes it exit 2;
* the PyTorchJob is checked against the training operator's OpenAPI models (kubeflow-training),
  the SkyPilot task is read by SkyPilot's `Task.from_yaml` (offline), both in the launchers'
  own environment (`.venv/launchers`, scripts/install-frameworks.sh).
"""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from tests.cli_helpers import assert_one_line_error, shardwise
from tests.integration.conftest import IMAGE, emit, require
from tests.integration.launch_jobs import VALIDATORS, run_job, sbatch_options, tool
from tests.integration.plans import EXPECTED, PLANS

torch_run = pytest.importorskip("torch.distributed.run")


def exported(capsys, framework: str) -> list[tuple[str, object]]:
    require(framework)
    return [(plan, emit(capsys, plan, framework)) for plan in PLANS
            if EXPECTED[plan][framework] is None]


@pytest.mark.timeout(1200)  # every plan of the export tests (cached when they ran first)
@pytest.mark.parametrize("framework", ["megatron", "torchtitan", "deepspeed"])
def test_every_launcher_runs_the_export_on_the_planned_nodes(capsys, framework, tmp_path):
    options = sbatch_options()
    shellcheck = tool("shellcheck")
    k8s_files, sky_files, expected = [], [], []
    for plan, out in exported(capsys, framework):
        jobs, world = out.launchers, out.layout.world_size
        torchrun_job = jobs["torchrun"]
        if framework != "deepspeed":  # the configuration is the torchrun job itself
            assert torchrun_job == out.text
        work = tmp_path / f"{plan}-{framework}"
        work.mkdir()
        # torchrun: every node runs it with MASTER_ADDR set
        done, calls = run_job(torchrun_job, work, {"MASTER_ADDR": "node-001"})
        assert done.returncode == 0, done.stderr
        (argv,) = calls
        args = torch_run.get_args_parser().parse_args(argv)
        assert int(args.nnodes) * int(args.nproc_per_node) == world
        program = ["-m", args.training_script] if args.module else [args.training_script]
        if framework == "deepspeed":  # the JSON is where --deepspeed_config reads it
            assert json.loads((work / "ds_config.json").read_text()) == json.loads(out.text)
            assert args.training_script_args[-2:] == ["--deepspeed_config", "ds_config.json"]
        else:
            _, words = out.command()
            assert words[words.index(program[-1]) + 1:] == args.training_script_args
        nodes = int(args.nnodes)
        # Slurm: shellcheck, sbatch's own options, the allocation's shape checked, srun
        slurm = jobs["slurm"]
        check = subprocess.run([shellcheck, "-s", "bash", "-"], input=slurm, text=True,
                               capture_output=True, timeout=60)
        assert check.returncode == 0, check.stdout
        directives = dict(re.findall(r"^#SBATCH --([a-z-]+)(?:=(\S+))?$", slurm, re.M))
        assert set(directives) <= options, set(directives) - options
        assert (directives["nodes"], directives["gpus-per-node"]) == (
            str(nodes), args.nproc_per_node)
        done, calls = run_job(slurm, work, {"SLURM_JOB_NUM_NODES": str(nodes),
                                            "SLURM_JOB_NODELIST": "node-[001-002]",
                                            "SLURM_JOB_ID": "42"})
        assert done.returncode == 0, done.stderr
        if nodes > 1:  # the same torchrun, with the job's id and first node as rendezvous
            at = argv.index("--rdzv-endpoint")
            argv = [*argv[:at], "--rdzv-id", "42", "--rdzv-endpoint", "node-001:29500",
                    *argv[at + 2:]]
        assert calls == [argv]
        wrong, _ = run_job(slurm, work, {"SLURM_JOB_NUM_NODES": str(nodes + 1),
                                         "SLURM_JOB_NODELIST": "node-[001-002]"})
        assert wrong.returncode == 2 and f"needs {nodes} nodes" in wrong.stderr
        # the files the tools' own parsers read below, in one process each
        (work / "job.yaml").write_text(jobs["k8s"])
        (work / "task.yaml").write_text(jobs["skypilot"])
        k8s_files.append(work / "job.yaml")
        sky_files.append(work / "task.yaml")
        expected.append((work, nodes, args, argv))
    python = tool("python")
    for files, kind in ((k8s_files, "k8s"), (sky_files, "skypilot")):
        for path, (work, nodes, args, _) in zip(files, expected):
            read = subprocess.run([python, str(VALIDATORS), kind, str(path)], text=True,
                                  capture_output=True, timeout=120)
            assert read.returncode == 0, read.stderr[-2000:]
            got = json.loads(read.stdout)
            if kind == "k8s":
                assert got["nproc"] == args.nproc_per_node and got["Master"]["replicas"] == 1
                assert got.get("Worker", {"replicas": 0})["replicas"] == nodes - 1
                done, calls = run_job(got["Master"]["command"], work,
                                      {"RANK": "0", "MASTER_ADDR": "job-master-0",
                                       "MASTER_PORT": "23456"})
            else:
                assert got["num_nodes"] == nodes
                assert list(got["accelerators"].values()) == [int(args.nproc_per_node)]
                done, calls = run_job(got["run"], work,
                                      {**got["envs"], "SKYPILOT_NODE_RANK": "0",
                                       "SKYPILOT_NODE_IPS": "10.0.0.1\n10.0.0.2"})
            assert done.returncode == 0, done.stderr
            (launched,) = calls
            again = torch_run.get_args_parser().parse_args(launched)
            assert again.training_script_args == args.training_script_args
            assert int(again.nnodes) * int(again.nproc_per_node) == int(args.nnodes) * int(
                args.nproc_per_node)


def test_a_plan_that_does_not_fill_its_nodes_is_refused():
    # 12 ranks on 8-GPU nodes: two nodes would start 16 (refused before the search)
    assert_one_line_error(shardwise("plan", "llama3-8b", "--gpus", "12", "--global-batch",
                                    "48", "--layout", "tp=4,zero=1", "--emit", "megatron",
                                    "--launcher", "slurm", check=False),
                          "12 GPUs do not fill whole nodes of 8")
    assert_one_line_error(shardwise("plan", "llama3-8b", "--gpus", "16", "--emit", "megatron",
                                    "--launcher", "k8s", check=False), "needs --image")
    assert_one_line_error(shardwise("plan", "--gpus", "16", "--launcher", "slurm",
                                    check=False), "need --emit")
    ok = shardwise("plan", "llama3-8b", "--gpus", "16", "--emit", "megatron", "--launcher",
                   "k8s", "--image", IMAGE).stdout
    assert "kind: \"PyTorchJob\"" in ok
