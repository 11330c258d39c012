"""No winner of `shardwise plan --emit F` (the search bound to F's stack) fails F's parser: the
planner's own choice, not a hand-written layout, over a grid of models, GPU counts and
sequence lengths per framework, every planned value read back as in the framework's own test
module (megatron-core, torchtitan, DeepSpeed with Megatron-DeepSpeed's pinned checks).

Models are the presets whose vocabulary every searched tp divides (Megatron pads GPT-3's
50257 rows at tp > 1, which the plan does not count: that export is refused, see
test_refusals.py `megatron-vocab`).
"""

import pytest

from shardwise.arch import get_model
from tests.integration import test_deepspeed, test_megatron, test_torchtitan
from tests.integration.conftest import Emit, require

pytestmark = pytest.mark.integration

GRID = {
    "megatron": [("llama3-8b", 64, 8192), ("qwen2.5-7b", 16, 4096), ("mixtral-8x7b", 64, 4096),
                 ("llama3-70b", 128, 32768)],
    "torchtitan": [("llama3-8b", 64, 8192), ("llama3-8b", 16, 2048), ("llama3-70b", 64, 8192),
                   ("llama3-70b", 256, 32768)],
    "deepspeed": [("llama3-8b", 64, 8192), ("qwen2.5-7b", 16, 4096), ("llama3-70b", 128, 8192),
                  ("mistral-7b", 32, 16384)],
}
CASES = [(framework, *case) for framework, cases in GRID.items() for case in cases]


@pytest.mark.parametrize(("framework", "model", "gpus", "seq"), CASES)
def test_the_winner_runs_as_planned(capsys, tmp_path, framework, model, gpus, seq, request):
    require({"megatron": "megatron", "torchtitan": "torchtitan",
             "deepspeed": "deepspeed"}[framework])
    out = Emit(capsys, [model, "--gpus", str(gpus), "--seq", str(seq), "--top", "1"],
               framework)
    assert out.code == 0, out.err
    spec = get_model(model)
    if framework == "megatron":
        assert out.notes == []
        test_megatron.reads_back(out, spec)
    elif framework == "torchtitan":
        assert out.notes == []
        test_torchtitan.reads_back(out, spec)
    else:
        request.getfixturevalue("deepspeed_dist")
        test_deepspeed.reads_back(out, spec, tmp_path)


deepspeed_dist = test_deepspeed.deepspeed_dist
