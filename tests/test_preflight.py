"""Pre-flight: a bad output path, a sequence beyond the model, a run larger than the machine
are refused in one line (exit 2) before any rank starts.

References: the operating system (a path under /proc cannot be created, a file cannot be a
directory), the preset's `max_seq`, and the memory model's own figure for the run compared
with /proc/meminfo.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.arch import get_model
from shardwise.errors import ShardwiseError
from shardwise.estimate.memory import training_memory_per_gpu
from shardwise.layout import Layout, TrainSpec
from shardwise.preflight import available_memory, check_run, run_memory, writable_dir, writable_file
from tests.cli_helpers import assert_one_line_error, shardwise


def test_output_paths_are_tried_before_work(tmp_path):
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    for path, fragment in ((tmp_path / "missing" / "x.png", "does not exist"),
                           (a_file / "x.png", "is not a directory"),
                           (tmp_path, "is a directory"),
                           (Path("/proc/x.png"), "cannot write there")):
        with pytest.raises(ShardwiseError, match=f"--plot {path}: .*{fragment}"):
            writable_file(path, "--plot")
    writable_file(tmp_path / "new.png", "--plot")
    assert not (tmp_path / "new.png").exists()  # tried, then removed
    writable_file(a_file, "--log")
    assert a_file.read_text() == "x"  # an existing file is left as it was
    with pytest.raises(ShardwiseError, match="is a file, not a directory"):
        writable_dir(a_file, "--checkpoint-dir")
    with pytest.raises(ShardwiseError, match="cannot write there"):
        writable_dir("/proc/ck", "--checkpoint-dir")
    writable_dir(tmp_path / "a" / "b", "--checkpoint-dir")
    assert (tmp_path / "a" / "b").is_dir() and not list((tmp_path / "a" / "b").iterdir())


def test_a_read_only_directory_is_refused(tmp_path):
    """A directory without write permission; as root (who writes past permission bits, and
    CI runs as), a read-only bind mount of it in a mount namespace of its own."""
    if os.geteuid() != 0:
        tmp_path.chmod(0o555)
        try:
            with pytest.raises(ShardwiseError, match="Permission denied"):
                writable_file(tmp_path / "x.png", "--plot")
        finally:
            tmp_path.chmod(0o755)
        return
    if shutil.which("unshare") is None:
        pytest.skip("no `unshare` (util-linux) for a mount namespace")
    target = tmp_path / "x.png"
    code = ("from shardwise.errors import ShardwiseError\n"
            "from shardwise.preflight import writable_file\n"
            f"try:\n    writable_file({str(target)!r}, '--plot')\n"
            "except ShardwiseError as exc:\n    print(exc)")
    run = subprocess.run(["unshare", "--mount", "sh", "-c",
                          'mount --bind -o ro "$0" "$0" && exec "$1" -c "$2"', str(tmp_path),
                          sys.executable, code], capture_output=True, text=True, timeout=60)
    if run.returncode and "mount" in run.stderr + run.stdout:
        pytest.skip(f"no read-only bind mount here: {run.stderr.strip()}")
    assert run.stdout.strip() == f"--plot {target}: cannot write there (Read-only file system)"
    assert not target.exists()


def test_the_memory_figure_is_the_memory_models():
    tiny, layout = get_model("tiny"), Layout(dp=2, tp=2)
    stage = training_memory_per_gpu(tiny, layout, TrainSpec(seq_len=32, global_batch=8,
                                                            dtype="fp64", impl="shardwise"))[0]
    assert run_memory(tiny, layout, 32, 8, "fp64") == pytest.approx(4 * stage.total)
    assert available_memory() > 0
    check_run(tiny, layout, 32, 8, "fp32")  # fits
    with pytest.raises(ShardwiseError, match="exceeds tiny's maximum sequence length 64"):
        check_run(tiny, layout, 65, 8, "fp32")


@pytest.mark.parametrize(("args", "fragments"), [
    (("--model", "llama3-8b"), ("needs about 12", "GiB of memory", "available")),
    (("--seq", "40000"), ("--seq 40000 exceeds tiny's maximum sequence length 64",)),
    (("--plot", "/proc/x.png", "--json"), ("--plot /proc/x.png",)),
    (("--log", "/nonexistent/d/x.jsonl"), ("/nonexistent/d does not exist",)),
    (("--checkpoint-dir", "/proc/ck"), ("--checkpoint-dir /proc/ck",)),
])
def test_train_refuses_before_starting(args, fragments):
    result = shardwise("train", "--steps", "1", *args, check=False)
    assert_one_line_error(result, *fragments)
    assert result.stdout == ""


def test_check_refuses_a_run_larger_than_the_machine():
    assert_one_line_error(shardwise("check", "--model", "llama3-8b", check=False),
                          "GiB of memory")
