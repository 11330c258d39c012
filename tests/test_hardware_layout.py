"""Accelerator/link presets, clusters, and `Layout.validate` messages."""

import pytest

from shardwise.arch import PRESETS
from shardwise.errors import LayoutError, ShardwiseError
from shardwise.hardware import ACCELERATORS, LINKS, Cluster, get_accelerator
from shardwise.layout import Layout, TrainSpec

LLAMA8 = PRESETS["llama3-8b"]


def test_presets_are_complete():
    for name in ("a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "h200", "b200", "mi300x",
                 "tpu-v5p"):
        assert name in ACCELERATORS
    for name in ("nvlink3", "nvlink4", "nvlink5", "hdr", "ndr", "roce400", "pcie4", "pcie5"):
        assert name in LINKS
    # SPEC §5 link figures.
    assert LINKS["nvlink4"].bandwidth == 450e9 and LINKS["nvlink4"].latency == 2e-6
    assert LINKS["ndr"].bandwidth == 50e9 and LINKS["ndr"].latency == 5e-6
    assert LINKS["pcie5"].bandwidth == 64e9
    assert get_accelerator("h100").peak_flops("bf16") == 989e12
    assert get_accelerator("A100").memory_bytes == 80 * 2**30


def test_cluster_of():
    cluster = Cluster.of(16384, "h100")
    assert (cluster.nodes, cluster.gpus_per_node, cluster.n_gpus) == (2048, 8, 16384)
    assert cluster.intra.name == "nvlink4" and cluster.inter.name == "ndr"
    assert Cluster.of(4, "a100").nodes == 1
    with pytest.raises(ShardwiseError, match="do not fill whole nodes"):
        Cluster.of(12, "h100")
    with pytest.raises(ShardwiseError, match="unknown accelerator 'h1000'.*did you mean"):
        Cluster.of(8, "h1000")


def test_every_accelerator_names_its_own_links():
    for accelerator in ACCELERATORS.values():
        assert accelerator.intra in LINKS and accelerator.inter in LINKS
    # AMD MI300X platform: 7 Infinity Fabric links × 64 GB/s per direction (896 GB/s
    # aggregate bidirectional); TPU v5p: ICI 4,800 Gb/s per chip, both directions.
    mi300x = Cluster.of(16, "mi300x")
    assert mi300x.intra.name == "infinity-fabric" and mi300x.intra.bandwidth == 7 * 64e9
    v5p = Cluster.of(16, "tpu-v5p", gpus_per_node=4)
    assert v5p.intra.name == v5p.inter.name == "ici-v5p"
    assert 2 * v5p.intra.bandwidth * 8 == 4800e9
    assert Cluster.of(16, "a100").intra.name == "nvlink3"
    assert Cluster.of(16, "h100-pcie").intra.name == "pcie5"


def test_valid_layouts_pass():
    Layout(dp=8, tp=8, pp=16, zero=1, sp=True).validate(PRESETS["llama3-70b"].with_(n_layers=80),
                                                       Cluster.of(1024))
    # kv heads replicated when tp is a multiple of them (8 kv heads, tp 16).
    Layout(tp=16).validate(PRESETS["llama3-405b"].with_(n_layers=128))


def test_every_problem_is_reported_at_once():
    with pytest.raises(LayoutError) as info:
        Layout(dp=2, tp=3, pp=20, ep=2, zero=4, schedule="interleaved").validate(
            LLAMA8, Cluster.of(8))
    problems = info.value.problems
    text = " | ".join(problems)
    assert "tp=3 does not divide n_heads=32" in text
    assert ("pp=20 does not divide n_layers=32 and the balanced partition would leave a stage "
            "without layers") in text
    assert "interleaved schedule needs chunks ≥ 2" in text
    assert "zero stage must be 0, 1, 2 or 3, got 4" in text
    assert "ep=2 needs a mixture-of-experts model" in text
    assert "120 ranks, but the cluster has 8 GPUs" in text


def test_kv_heads_neither_divided_nor_replicated():
    model = PRESETS["llama3-8b"].with_(n_heads=48, d_model=6144, n_kv_heads=12)
    with pytest.raises(LayoutError, match="tp=8 neither divides n_kv_heads=12"):
        Layout(tp=8).validate(model)


def test_train_dependent_checks():
    train = TrainSpec(seq_len=4096, global_batch=100)
    with pytest.raises(LayoutError, match="not a multiple of dp·micro_batch=8·1"):
        Layout(dp=8).validate(LLAMA8, train=train)
    with pytest.raises(LayoutError, match="2·cp=6 does not divide seq_len=4096"):
        Layout(cp=3).validate(LLAMA8, train=TrainSpec(seq_len=4096))
    with pytest.raises(LayoutError, match="divisible by pp.*p=4, m=6"):
        Layout(dp=2, pp=4, chunks=2, schedule="interleaved").validate(
            LLAMA8, train=TrainSpec(global_batch=12))


def test_moe_expert_parallel_checks():
    mixtral = PRESETS["mixtral-8x7b"]
    Layout(dp=8, ep=8).validate(mixtral)
    with pytest.raises(LayoutError, match="ep=3 does not divide n_experts=8"):
        Layout(dp=3, ep=3).validate(mixtral)
    with pytest.raises(LayoutError, match="ep=4 must divide dp·cp=2"):
        Layout(dp=2, ep=4).validate(mixtral)
    # Megatron's parallel folding (megatron-core parallel_state.py: the expert ranks are
    # etp·ep·edp = tp·dp·cp): at etp = tp the experts use dp·cp only; etp=1 folds in tp too,
    # and the refusal says so where that would fit
    assert Layout(dp=2, tp=2, ep=4).problems(mixtral)[0].endswith(
        "with etp=1 (Megatron's --expert-tensor-parallel-size 1) the experts fold over tp·dp·cp")
    assert Layout(dp=2, tp=2, ep=4, etp=1).problems(mixtral) == []
    assert "fold" not in Layout(dp=2, tp=2, ep=8).problems(mixtral)[0]


def test_context_parallel_kinds():
    """Ulysses gives each rank of its all-to-all 1/u of a tp rank's query and key/value heads
    (Transformer Engine's a2a asserts both divide); the hybrid names its all-to-all degree."""
    llama70 = PRESETS["llama3-70b"]  # 64 query heads, 8 key/value heads
    hybrid = Layout.parse("cp=8,cp_kind=hybrid,ulysses=2,tp=4")
    assert (hybrid.cp_kind, hybrid.ulysses, hybrid.ulysses_degree) == ("hybrid", 2, 2)
    assert hybrid.problems(llama70) == []
    assert "a2a2×ring4" in hybrid.short()
    assert Layout(cp=4).ulysses_degree == 1 and Layout(cp=4, cp_kind="ulysses").ulysses_degree == 4
    assert Layout(cp=2, tp=4, cp_kind="ulysses").problems(llama70) == []
    cases = {  # layout: the one line it gets
        "cp=4,tp=4,cp_kind=ulysses": "4 ranks splits each tensor-parallel rank's 2 key/value "
                                     "heads (n_heads=64, n_kv_heads=8, tp=4): 4 must divide 2",
        "cp=2,tp=8,cp_kind=ulysses": "2 must divide 1",  # one kv head per tp rank
        "cp=8,cp_kind=hybrid": "cp_kind=hybrid needs ulysses=u with 1 < u < cp=8",
        "cp=8,cp_kind=hybrid,ulysses=3": "u dividing cp",
        "cp=8,cp_kind=hybrid,ulysses=8": "1 < u < cp=8",
        "cp=4,ulysses=2": "ulysses=2 applies to cp_kind=hybrid only",
        "cp=4,cp_kind=star": "cp_kind 'star' unknown; valid: ring, ulysses, hybrid",
    }
    for text, line in cases.items():
        problems = Layout.parse(text).problems(llama70)
        assert len(problems) == 1 and line in problems[0], (text, problems)
    with pytest.raises(LayoutError, match="must divide 2"):
        Layout.parse("cp=4,tp=4,cp_kind=ulysses").validate(llama70)


def test_layout_parse_and_microbatches():
    layout = Layout.parse("tp=8, pp=16, zero=1, sp=1, schedule=interleaved, v=2, mbs=2", dp=4)
    assert (layout.tp, layout.pp, layout.zero, layout.sp, layout.chunks, layout.micro_batch,
            layout.dp) == (8, 16, 1, True, 2, 2, 4)
    assert layout.microbatches(TrainSpec(global_batch=1024)) == 1024 // (4 * 2)
    with pytest.raises(ShardwiseError, match="cannot read layout item 'foo=1'"):
        Layout.parse("foo=1")
    with pytest.raises(ShardwiseError, match="must be an integer"):
        Layout.parse("tp=eight")


# ------------------------------------------------------------- accelerators as sold (issue 30)
def test_every_accelerator_is_valid_and_calibrated():
    from shardwise.calibration import default_calibration

    for accelerator in ACCELERATORS.values():
        accelerator.validate()
        assert accelerator.peak_fp8 is None or accelerator.peak_fp8 >= accelerator.peak_bf16
        cal = default_calibration(accelerator.calibration_name)
        assert cal.accelerator == accelerator.calibration_name


@pytest.mark.parametrize(("name", "sms"), [("h100-sxm", 132), ("h100-pcie", 114),
                                           ("h100-nvl", 132), ("h200", 132), ("h800", 132)])
def test_hopper_peaks_are_their_clock_times_tensor_core_rate(name, sms):
    # peak = SMs × 4 tensor cores × 1,024 dense BF16 FLOP per clock × the boost clock
    # (ml-engineering "How To Calculate Theoretical TFLOPS"; H100 whitepaper's 132/114 SMs)
    acc = get_accelerator(name)
    assert sms * 4 * 1024 * acc.boost_clock_mhz * 1e6 == pytest.approx(acc.peak_bf16, rel=2e-3)


def test_datasheet_figures_of_the_new_parts():
    # DGX B200: 72 PF FP8 (sparse: twice dense) and 64 TB/s per 8 GPUs, BF16 half of FP8;
    # H800: 400 GB/s NVLink both ways together;
    # MI325X: the MI300X's compute with 256 GB at 6 TB/s.
    b200 = get_accelerator("b200")
    assert 2 * b200.peak_fp8 * 8 == pytest.approx(72e15) and b200.peak_fp8 == 2 * b200.peak_bf16
    assert get_accelerator("b200").hbm_bandwidth * 8 == pytest.approx(64e12)
    assert 2 * Cluster.of(8, "h800").intra.bandwidth == 400e9
    mi300x, mi325x = get_accelerator("mi300x"), get_accelerator("mi325x")
    assert mi325x.peak_bf16 == mi300x.peak_bf16 and mi325x.memory_bytes == 256 * 2**30
    assert get_accelerator("gb200").peak_bf16 == 2.5e15


def test_clock_cap_scales_every_compute_peak_and_nothing_else():
    from shardwise.hardware import resolve_gpu

    h100 = get_accelerator("h100")
    half = resolve_gpu("h100", clock_mhz=915)  # half the 1,830 MHz the datasheet peaks assume
    assert half.peak_bf16 == pytest.approx(h100.peak_bf16 / 2)
    assert half.peak_fp8 == pytest.approx(h100.peak_fp8 / 2)
    assert half.peak_fp32 == pytest.approx(h100.peak_fp32 / 2)
    assert (half.hbm_bandwidth, half.memory_bytes) == (h100.hbm_bandwidth, h100.memory_bytes)
    assert half.name == "h100-sxm@915MHz" and half.calibration_name == "h100-sxm"
    assert resolve_gpu("h100", clock_mhz=2500).peak_bf16 == h100.peak_bf16  # no overclock
    with pytest.raises(ShardwiseError, match="no boost clock"):
        resolve_gpu("tpu-v5p", clock_mhz=1000)


def _accelerator_file(tmp_path, **fields):
    import json

    base = {"name": "h100-96gb-hbm2e", "memory_bytes": 96 * 2**30, "hbm_bandwidth": 2.4e12,
            "peak_bf16": 8.0e14, "peak_fp8": 1.6e15, "intra": "my-nvlink", "inter": "ndr",
            "boost_clock_mhz": 1480, "tdp_w": 500, "calibrated_as": "h100",
            "links": [{"name": "my-nvlink", "bandwidth": 4.0e11, "latency": 3e-6}]}
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(base | fields))
    return path


def test_gpu_file_round_trips_through_the_cli(tmp_path):
    from shardwise.hardware import Link, resolve_gpu
    from tests.cli_helpers import shardwise_json

    path = _accelerator_file(tmp_path)
    acc = resolve_gpu(str(path), files=True)
    assert acc.peak_bf16 == 8.0e14 and acc.calibrated_as == "h100-sxm"
    cluster = Cluster.of(16, acc)
    assert cluster.intra == Link("my-nvlink", 4.0e11, 3e-6) and cluster.inter.name == "ndr"
    out = shardwise_json("memory", "llama3-8b", "--gpus", "8", "--gpu", str(path))
    assert out["accelerator"] == "h100-96gb-hbm2e" and out["memory_bytes"] == 96 * 2**30


@pytest.mark.parametrize(("fields", "fragment"), [
    ({"colour": "green"}, "unknown key(s) colour"),
    ({"peak_bf16": -1}, "peak_bf16 (FLOP/s) must be a finite number in [1e+09, 1e+18]"),
    ({"hbm_bandwidth": "NaN"}, "hbm_bandwidth (bytes/s) must be a finite number in"),
    ({"intra": "warp-drive", "links": []}, "unknown link 'warp-drive'"),
    ({"links": [{"name": "x", "bandwidth": 1e9}]}, "links[0] must be an object with exactly"),
    ({"calibrated_as": "h1000"}, "unknown accelerator 'h1000'"),
])
def test_gpu_file_faults_name_the_field(tmp_path, fields, fragment):
    from shardwise.hardware import resolve_gpu

    path = _accelerator_file(tmp_path, **fields)
    with pytest.raises(ShardwiseError, match="accelerator file|unknown") as info:
        resolve_gpu(str(path), files=True)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_gpu_file_and_clock_faults_are_one_line_from_the_cli(tmp_path):
    import json

    from tests.cli_helpers import assert_one_line_error, shardwise

    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({"name": "x", "memory_bytes": 1e9}))
    assert_one_line_error(shardwise("memory", "--gpu", str(path), check=False),
                          "missing hbm_bandwidth, peak_bf16, intra, inter")
    assert_one_line_error(shardwise("plan", "--clock-mhz", "-5", check=False), "--clock-mhz")


def test_datasheet_figures_of_the_parts_users_run_beside_the_catalogue():
    # HGX B300 per 8 GPUs: 36 PF BF16 and 72 PF FP8 with sparsity (twice dense), 2.3 TB HBM3e,
    # NVLink 5 at 14.4 TB/s (both ways); MI355X: 7 Infinity Fabric links of 153.6 GB/s both
    # ways; H20: FP8 twice BF16
    b300 = get_accelerator("b300")
    assert 2 * b300.peak_bf16 * 8 == pytest.approx(36e15)
    assert 2 * b300.peak_fp8 * 8 == pytest.approx(72e15)
    assert b300.memory_bytes * 8 / 2**40 == pytest.approx(2.25)  # "2.3 TB" of binary GB
    assert 2 * Cluster.of(8, "b300").intra.bandwidth * 8 == pytest.approx(14.4e12)
    assert Cluster.of(8, "mi355x").intra.bandwidth * 2 == pytest.approx(7 * 153.6e9)
    h20 = get_accelerator("h20")
    assert h20.peak_fp8 == 2 * h20.peak_bf16 and h20.memory_bytes == 96 * 2**30


def test_gb300_is_its_nvl72_rack_over_72_gpus():
    """NVIDIA's GB300 NVL72 rack figures: 360 PF FP8 for training (dense), 20.7 TB HBM3e at
    576 TB/s, NVLink 5 at 130 TB/s (rounded from 72 × 1.8 TB/s both ways), one 800 Gb/s
    ConnectX-8 per GPU; against the GB200 NVL72: the same NVLink and C2C host link, 288 GB of
    HBM3e per GPU where GB200 has 186 GB, 1.4 kW where GB200 draws 1.2 kW."""
    gb300, gb200 = get_accelerator("gb300"), get_accelerator("gb200")
    rack = Cluster.of(72, "gb300", gpus_per_node=72)
    assert 72 * gb300.peak_fp8 == pytest.approx(360e15)
    assert 72 * gb300.peak_bf16 == pytest.approx(180e15)
    assert 72 * gb300.hbm_bandwidth == pytest.approx(576e12)
    assert 72 * gb300.memory_bytes / 1e12 == pytest.approx(22.3, abs=0.05)  # 288 binary GB
    assert 72 * 2 * rack.intra.bandwidth == pytest.approx(129.6e12)  # "130 TB/s"
    assert rack.inter.bandwidth * 8 == pytest.approx(800e9)  # ConnectX-8, per direction
    assert (gb300.host, gb300.intra) == (gb200.host, gb200.intra)
    assert gb300.memory_bytes == 288 / 186 * gb200.memory_bytes and gb300.tdp_w == 1400


@pytest.mark.parametrize(("name", "borrows", "generation_", "phrase"), [
    ("h20", "h100-sxm", "hopper", "h20 GPUs (timed with h100-sxm's constants)"),
    ("b300", "b200", "blackwell", "b300 GPUs (timed with b200's constants)"),
    ("gb300", "gb200", "blackwell", "gb300 GPUs (timed with gb200's constants)"),
    ("mi355x", "mi325x", "cdna4", "cdna4 GPUs")])
def test_a_part_timed_with_anothers_calibration_is_marked_unvalidated(name, borrows,
                                                                      generation_, phrase):
    from shardwise.estimate.uncertainty import unvalidated
    from shardwise.hardware import generation
    from shardwise.layout import TrainSpec

    acc = get_accelerator(name)
    assert acc.calibration_name == borrows and generation(name) == generation_
    # the step is timed with the borrowed part's generation (its constants' kernels, FP8)
    assert generation(acc.calibration_name) == generation(borrows)
    assert phrase in unvalidated(name, "megatron-te", Layout(dp=8), TrainSpec())
    assert not any("GPUs" in p for p in unvalidated(borrows, "megatron-te", Layout(dp=8),
                                                     TrainSpec()))
