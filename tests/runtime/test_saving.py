"""`train --checkpoint-every auto` (runtime/saving.py): every save's bytes and seconds in its
step's record, the tensors' bytes by hand, and each automatic interval Daly's formula (worked
out here) of the writes and steps the run measured, the next save at exactly that step."""

import math
import statistics

import pytest
import torch
from tests.cli_helpers import shardwise_json

from shardwise.arch import get_model
from shardwise.runtime.model import Transformer


@pytest.mark.slow
def test_auto_interval_is_dalys_from_the_measured_write(tmp_path):
    mtbf_gpu_hours = 2 / 3600  # one rank: a failure every 2 s
    records = shardwise_json("train", "--steps", "30", "--seq", "16", "--global-batch", "4",
                             "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "auto",
                             "--mtbf-gpu-hours", str(mtbf_gpu_hours), "--quiet")["records"]
    saves = [r for r in records if "checkpoint_seconds" in r]
    assert saves[0]["step"] == 0 and saves[-1]["step"] == 29  # after step 1, after the last
    # fp32 weights and AdamW's two fp32 moments per parameter, plus a 4-byte step count per
    # parameter tensor and the CPU generator's state
    model = Transformer(get_model("tiny"), dtype=torch.float32)
    tensors = sum(p.numel() for p in model.parameters())
    others = 4 * len(list(model.parameters())) + torch.get_rng_state().numel()
    assert all(r["checkpoint_bytes"] == 12 * tensors + others for r in saves)
    mtbf = mtbf_gpu_hours * 3600
    for i, save in enumerate(saves[:-1]):
        write = statistics.fmean(s["checkpoint_seconds"] for s in saves[:i + 1])
        step = statistics.median(r["seconds"] for r in records[:save["step"] + 1])
        x = write / (2 * mtbf)
        daly = (math.sqrt(2 * write * mtbf) * (1 + math.sqrt(x) / 3 + x / 9) - write
                if x < 1 else mtbf)
        assert save["checkpoint_every"] == max(1, round(daly / step)), (save, write, step)
        due = save["step"] + save["checkpoint_every"]  # steps counted from 1
        assert saves[i + 1]["step"] == min(due, 29), (saves[i + 1], due)
