"""FP8 recipes (fp8.py) against their sources: torchao's own roofline (torchao 0.18.0
testing/training/roofline_utils.py `get_tensor_memory_traffic_ovhd_s`, run here at 1 byte/s
so its seconds are bytes) for the torchao recipes' bytes per element, and Transformer Engine's
copies by hand for the TE ones (a row-wise copy and, before Blackwell or under block scaling,
its transpose; a 1-byte E8M0 scale per 32 elements in MXFP8, a 4-byte scale per 128 in
blockwise; five scaled tensors per GEMM with the amax history and two scales in fp32)."""

import pytest

from shardwise.errors import ShardwiseError
from shardwise.fp8 import AMAX_HISTORY, RECIPES, CastBytes, get_recipe, recipe_names

NUMEL = 10**9  # large enough that torchao's launch-overhead floor never binds


@pytest.mark.parametrize(("name", "mx"), [("rowwise", None), ("rowwise_with_gw_hp", None),
                                          ("mxfp8", "mxfp8_cublas")])
def test_torchao_bytes_are_torchaos_roofline(name, mx):
    pytest.importorskip("torch")
    roofline = pytest.importorskip("torchao.testing.training.roofline_utils")
    specs = {"peak_mem_bw_bytes_sec": 1.0, "pct_achievable_mem_bw": 1.0}

    def kernels(role):  # bytes per element of each kernel casting a (1e9, 1) tensor
        out = roofline.get_tensor_memory_traffic_ovhd_s(
            specs, NUMEL, 1, role, None if mx else name, mx)
        return [float(x) / NUMEL for x in out]

    i, g, w = kernels("input"), kernels("grad_output"), kernels("weight")
    # the first kernel runs in the forward, the rest in the backward
    expected = (i[0], sum(i[1:]), sum(g), w[0], sum(w[1:]))
    recipe = get_recipe("torchao", name)
    assert recipe.torchao_bytes == pytest.approx(expected)
    assert recipe.cast_bytes("hopper") == pytest.approx(CastBytes(*expected, 0.0))
    # torchao keeps nothing across the step and saves bf16 inputs
    assert recipe.weight_copy_bytes("hopper") == 0 and recipe.saved_input_bytes() == 0
    assert recipe.scaling_state_bytes() == 0


@pytest.mark.parametrize(("name", "generation", "copy"), [
    ("delayed", "hopper", 2.0), ("delayed", "blackwell", 1.0),
    ("tensorwise", "hopper", 2.0), ("tensorwise", "blackwell", 1.0),
    ("mxfp8", "blackwell", 2 * (1 + 1 / 32)), ("blockwise", "hopper", 2 * (1 + 4 / 128))])
def test_te_weight_copies_saved_inputs_and_casts(name, generation, copy):
    recipe = get_recipe("te", name)
    assert recipe.weight_copy_bytes(generation) == pytest.approx(copy)
    assert recipe.weight_copy_bytes(generation, fsdp=True) == 0  # re-cast each micro-batch
    scale = {"mxfp8": 1 / 32, "blockwise": 4 / 128}.get(name, 0.0)
    assert recipe.saved_input_bytes() == pytest.approx(1 + scale)
    # each cast reads bf16 (2 B) and writes the copies; current scaling reads once more
    cast = 2 + copy + (2 if name == "tensorwise" else 0)
    assert recipe.cast_bytes(generation) == pytest.approx((cast, 0, cast, 0, 0, cast))
    assert recipe.cast_bytes(generation, fsdp=True) == pytest.approx((cast, 0, cast, cast, 0, 0))


def test_te_scaling_state_per_gemm():
    # five scaled tensors, each an amax history (delayed: 1024) and a scale and its inverse
    assert get_recipe("te", "delayed").scaling_state_bytes() == 5 * (1024 + 2) * 4
    assert AMAX_HISTORY == 1024
    assert get_recipe("te", "tensorwise").scaling_state_bytes() == 5 * 2 * 4


def test_recipe_flags_as_the_frameworks_set_them():
    # TE runs routed experts' grouped GEMMs in FP8 and keeps the LM head bf16; torchao's
    # Float8LinearConverter converts the head and leaves GroupedExperts bf16
    for (framework, _), recipe in RECIPES.items():
        assert recipe.head_fp8 is (framework == "torchao")
        if recipe.head_fp8:  # so the head's FP8 weights are never held (memory._StageParams)
            assert all(recipe.weight_copy_bytes(g) == 0.0 for g in ("hopper", "blackwell"))
        # Composer's recipe is Transformer Engine's te.Linear underneath (llm-foundry)
        assert recipe.experts_fp8 is (framework in ("te", "composer"))
    assert get_recipe("te", "tensorwise").amax_reduction_tp
    assert not get_recipe("te", "delayed").amax_reduction_tp
    assert not get_recipe("torchao", "rowwise_with_gw_hp").wgrad_fp8
    assert get_recipe("torchao", "rowwise").wgrad_fp8
    assert get_recipe("te", "mxfp8").architectures == ("blackwell",)
    assert get_recipe("te", "blockwise").architectures == ("hopper",)


def test_recipe_names_and_unknown_recipes():
    assert recipe_names("te") == ("delayed", "tensorwise", "mxfp8", "blockwise")
    # tensorwise: torchao's dynamic per-tensor scaling, torchtitan v0.1.0's default
    assert recipe_names("torchao") == ("rowwise", "rowwise_with_gw_hp", "mxfp8", "tensorwise")
    assert recipe_names("composer") == ("delayed",)
    assert recipe_names() == ("delayed", "tensorwise", "mxfp8", "blockwise", "rowwise",
                              "rowwise_with_gw_hp")
    with pytest.raises(ShardwiseError) as err:
        get_recipe("te", "rowwise")
    assert str(err.value) == ("no FP8 recipe 'rowwise' in te; valid: delayed, tensorwise, "
                              "mxfp8, blockwise")
    with pytest.raises(ShardwiseError) as err:
        get_recipe("apex", "delayed")
    assert str(err.value) == "no FP8 recipe 'delayed' in apex; valid: none"
