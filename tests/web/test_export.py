"""The planner's downloads (web/export.py) through the API: the file is the CLI's `--emit`
output under a header whose command prints that output again, each flag the file sets that
changes how it runs is explained, DeepSpeed's own config loader (hjson, as DeepSpeed 0.19.8's
`DeepSpeedConfig` reads a file) reads the JSON with its header, and a compared layout's error
names the layout field."""

from __future__ import annotations

import json
import re
import shlex

import pytest
from click.testing import CliRunner

from shardwise.cli import cli

STACKS = [("torchtitan", "torchtitan", "recompute=op-sac"),
          ("megatron-te", "megatron", "recompute=selective"),
          ("megatron-deepspeed", "deepspeed", "zero=1")]


def header_command(text: str) -> list[str]:
    return shlex.split(re.search(r"^# the same file: (.+)$", text, re.M)[1])


@pytest.mark.parametrize(("impl", "framework", "fix"), STACKS)
def test_download_is_the_cli_export_under_a_header(client, impl, framework, fix):
    out = client.post("/api/plan", json={"model": "llama3-8b", "gpus": 16, "impl": impl,
                                         "fix": fix, "seq": 4096, "layout": fix, "top": 3,
                                         "link": "http://example.org/planner?gpus=16"}).json()
    file = out["emits"][framework]["download"]
    text = file["text"]
    assert "# this plan: http://example.org/planner?gpus=16" in text
    command = header_command(text)
    assert command[:3] == ["shardwise", "plan", "llama3-8b"] and "--fix" in command
    printed = CliRunner().invoke(cli, command[1:], catch_exceptions=False)
    assert printed.exit_code == 0, printed.output
    config = out["emits"][framework]["config"]
    # the file ends with the export; the CLI prints it first (DeepSpeed's launch notes after)
    assert text.endswith(config) and printed.output.startswith(config)
    header = text[: len(text) - len(config)]
    assert all(line.startswith("#") for line in header.splitlines())
    if framework == "torchtitan":  # issue 46: the flag nobody explained
        assert re.search(r"^#   activation-checkpoint:selective: selective activation "
                         r"checkpointing", header, re.M)
        assert "--parallelism.tensor_parallel_degree" in header
    if framework == "megatron":
        assert "#   --recompute-activations: selective recompute" in header
        assert "#   --tensor-model-parallel-size" in header
    if framework == "deepspeed":
        hjson = pytest.importorskip("hjson")  # DeepSpeed's own reader of a config file
        assert hjson.loads(text) == json.loads(out["emits"]["deepspeed"]["config"])
        assert "#   stage 1: ZeRO stage" in header
        assert file["filename"] == "ds_config.json"


def test_other_frameworks_offer_their_stack(client):
    out = client.post("/api/plan", json={"gpus": 16, "impl": "torchtitan"}).json()
    assert out["emits"]["megatron"]["replan"]["impl"] == "megatron-te"
    assert out["emits"]["deepspeed"]["replan"]["impl"] == "megatron-deepspeed"
    assert "download" not in out["emits"]["megatron"]


@pytest.mark.parametrize(("body", "field"), [
    ({"layout": "tp=8,pp=3"}, "layout"),  # issue 46: not the GPUs field
    ({"layout": "tp=3", "gpus": 64}, "layout"),
    ({"gpus": 64, "gpus_per_node": 48}, None),  # the search's own error names no field
])
def test_a_layout_error_names_the_layout_field(client, body, field):
    response = client.post("/api/plan", json=body)
    assert response.status_code == 400
    assert response.json().get("field") == field
    assert isinstance(response.json()["detail"], str)


def test_the_fastest_choice_is_in_the_command(client):
    out = client.post("/api/plan", json={"gpus": 16, "choose": "fastest"}).json()
    text = out["emits"]["megatron"]["download"]["text"]
    command = header_command(text)
    assert command[-4:] == ["--choose", "fastest", "--emit", "megatron"]
    printed = CliRunner().invoke(cli, command[1:], catch_exceptions=False)
    assert text.endswith(printed.output) and out["ranked"][0]["short"] in printed.output


def cli_output(command: list[str]) -> str:
    printed = CliRunner().invoke(cli, command, catch_exceptions=False)
    assert printed.exit_code == 0, printed.output
    return printed.stdout  # the notes go to stderr


def under_header(text: str, job: str) -> bool:
    """`text` is `job` with a comment header after its first line (a shebang) or before it."""
    if job.startswith("#!"):
        first, rest = job.split("\n", 1)
        header = text[len(first) + 1: len(text) - len(rest)]
        return text.startswith(first + "\n") and text.endswith(rest) and all(
            line.startswith("#") for line in header.splitlines())
    header = text[: len(text) - len(job)]
    return text.endswith(job) and all(line.startswith("#") for line in header.splitlines())


@pytest.mark.parametrize(("impl", "framework", "fix"), STACKS)
def test_each_launcher_download_is_the_cli_job(client, impl, framework, fix):
    # 32 GPUs on 8-GPU nodes: 4 nodes; k8s only with an image. The compared layout is the
    # one exported (the recommended one can differ: `plan --emit` searches the framework's
    # own layouts)
    body = {"model": "llama3-8b", "gpus": 32, "impl": impl, "fix": fix, "seq": 4096,
            "layout": fix, "top": 2}
    emits = client.post("/api/plan", json=body).json()["emits"][framework]
    assert "needs --image" in emits["launchers"]["k8s"]["error"]
    assert set(emits["jobs"]) == {"torchrun", "slurm", "skypilot"}
    emits = client.post("/api/plan", json={**body, "image": "registry.example.com/t:1"}
                        ).json()["emits"][framework]
    assert set(emits["jobs"]) == {"torchrun", "slurm", "k8s", "skypilot"}
    for launcher, file in emits["jobs"].items():
        command = header_command(file["text"])
        assert command[-2:] == (["--image", "registry.example.com/t:1"] if launcher == "k8s"
                                else ["--launcher", launcher])
        # the header's command (`plan … --emit F --launcher L`) prints the job
        assert command[:3] == ["shardwise", "plan", "llama3-8b"] and "--fix" in command
        job = cli_output(command[1:])
        assert job == emits["launchers"][launcher]
        assert under_header(file["text"], job), file["text"][:400]
    assert emits["jobs"]["slurm"]["filename"] == f"{framework}.sbatch"
    assert "#SBATCH --nodes=4" in emits["jobs"]["slurm"]["text"]


def test_the_moe_and_memory_flags_of_a_megatron_export_are_explained():
    """The flags a DeepSeek-V3-style plan adds (dispatcher, overlap, recompute modules, the
    precision-aware optimizer, activation offload) each get a line in the file's header."""
    from shardwise.arch import get_model
    from shardwise.emit import emit
    from shardwise.layout import Layout, TrainSpec
    from shardwise.web.export import flag_notes

    train = TrainSpec(seq_len=4096, global_batch=1024, impl="megatron-te", fp8="blockwise",
                      moe_dispatcher="alltoall", moe_overlap="shared", exp_avg_dtype="bf16",
                      exp_avg_sq_dtype="bf16", recompute_modules=("mla_up_proj", "moe_act"),
                      offload_modules=("expert_fc1",))
    layout = Layout.parse("dp=16,pp=4,ep=16,zero=1,recompute=selective")
    config = emit("megatron", get_model("deepseek-v3"), layout, train, 8).text
    explained = {line.split(" ")[0].rstrip(":") for line in flag_notes(config)}
    run_flags = {"--moe-token-dispatcher-type", "--moe-grouped-gemm", "--moe-shared-expert-overlap",
                 "--recompute-modules", "--use-precision-aware-optimizer", "--exp-avg-dtype",
                 "--exp-avg-sq-dtype", "--fine-grained-activation-offloading",
                 "--offload-modules", "--fp8-recipe"}
    assert run_flags <= set(re.findall(r"--[\w-]+", config))  # the plan's settings are written
    assert run_flags <= explained, run_flags - explained
