"""The validation set (benchmarks/validation_runs.json) loads through shardwise's own API: every
row either builds into (ModelSpec, Cluster, Layout, TrainSpec) or says why it cannot, and the
transcribed figures and FLOP conventions agree with the sources' own derived columns."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardwise.errors import ShardwiseError
from tests.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def vr():
    return load_script("benchmarks/validation_rows.py", register=True)


@pytest.fixture(scope="module")
def loaded(vr):
    return vr.load()


def test_every_row_is_expressible_or_says_why(vr, loaded):
    data, sources, rows = loaded
    ids = [row["id"] for row in data["rows"]]
    assert len(ids) == len(set(ids))
    expressible = 0
    for row in rows:
        assert row["source"] in sources
        published = row["published"]
        assert published["quantity"] in vr.QUANTITIES, row["id"]
        if published["quantity"] in ("tflops_per_gpu", "mfu"):
            assert published["convention"] in vr.CONVENTIONS, row["id"]
            assert published["convention"] in data["conventions"], row["id"]
        if published["quantity"] == "mfu":
            assert published["peak_tflops"] > 0, row["id"]
        try:
            case = vr.build(row)
        except ShardwiseError as exc:  # any other exception is a malformed row: the test fails
            assert str(exc).strip(), row["id"]
            continue
        expressible += 1
        assert case.cluster.n_gpus == row["gpus"] == case.layout.world_size
    # every source family the file cites contributes at least one source; most rows build
    assert {s["family"] for s in sources.values()} >= {"narayanan2021", "llm-foundry",
                                                       "nvidia-dgxc", "ibm-fsdp"}
    assert expressible >= len(rows) // 2


def test_transcribed_throughput_matches_the_sources_other_columns(loaded):
    # llm-foundry prints both Throughput (T/s) and Throughput (T/s/GPU): they agree to the
    # rounding of the per-GPU column (a transcription or parsing slip would not)
    _, _, rows = loaded
    checked = 0
    for row in rows:
        also = row.get("also_published", {})
        if row["published"]["quantity"] == "tokens_per_s_per_gpu" and "tokens_per_s" in also:
            assert abs(also["tokens_per_s"] / row["gpus"] - row["published"]["value"]) <= 1.0, \
                row["id"]
            checked += 1
    assert checked >= 200


def test_megatron_llama_convention_reproduces_the_dgxc_mfu_column(vr, loaded):
    # NVIDIA/dgxc-benchmarking llama3.1 READMEs (v24.11): MFU = GBS · model FLOPs / step time /
    # GPUs / 989 TFLOP/s, their model FLOPs being the 'megatron-llama' count
    _, _, rows = loaded
    checked = 0
    for row in rows:
        if (row["source"] == "dgxc-v24.11" and row["id"].split(":")[1].startswith(
                ("llama3.1-8b-bf16", "llama3.1-70b-bf16"))):
            case = vr.build(row)
            mfu = vr.CONVENTIONS["megatron-llama"](case) / (
                row["published"]["value"] * row["gpus"] * 989e12)
            assert mfu == pytest.approx(row["also_published"]["mfu"], rel=0.005), row["id"]
            checked += 1
    assert checked == 11


def test_palm_convention_reproduces_the_ibm_mfu_within_the_stated_band(vr, loaded):
    # ibm-fsdp-2024 publishes tokens/s/GPU and MFU side by side; the 'palm-6n' count applied to
    # the tokens/s gives the published MFU within the -4 … +9 % the source's notes state
    _, _, rows = loaded
    for row in rows:
        if row["source"] == "ibm-fsdp-2024" and not row.get("not_expressible"):
            case = vr.build(row)
            tokens = row["global_batch"] * row["seq"]
            peak = 312e12 if row["accelerator"].startswith("a100") else 989e12
            mfu = vr.CONVENTIONS["palm-6n"](case) / tokens * row["published"]["value"] / peak
            assert -0.04 <= mfu / row["also_published"]["mfu"] - 1 <= 0.09, row["id"]


def test_megatron_bridge_moe_rows_agree_with_their_own_tflops_column(vr, loaded):
    # Megatron-Bridge's summaries print tokens/s/GPU and model TFLOP/s/GPU side by side: their
    # ratio is the page's FLOPs per token, one number per model, sequence and MTP choice, on
    # every system and in both releases (25.11, 26.02) — a transcription slip breaks it; and
    # 26.02's unlabelled DeepSeekV3 rows count MTP (25.11's 'w/ MTP' ratio, not 'w/o MTP')
    _, _, rows = loaded
    per_token: dict[tuple[str, int, bool], list[tuple[str, float]]] = {}
    for row in rows:
        if not row["source"].startswith("nemo-mbridge-") or "tflops_per_gpu" not in row.get(
                "also_published", {}):
            continue
        model = row["model"] if isinstance(row["model"], str) else row["model"]["spec"]["name"]
        if model not in ("deepseek-v3", "qwen3-30b-a3b", "qwen3-235b-a22b"):
            continue
        mtp = "with mtp" in row.get("notes", "").lower()
        ratio = row["also_published"]["tflops_per_gpu"] * 1e12 / row["published"]["value"]
        per_token.setdefault((model, row["seq"], mtp), []).append((row["id"], ratio))
    assert len(per_token) == 4 and sum(map(len, per_token.values())) >= 25
    for key, ratios in per_token.items():
        first = ratios[0][1]
        for rid, ratio in ratios:  # the columns are rounded to 3-4 digits
            assert ratio == pytest.approx(first, rel=0.006), (key, rid)
    with_mtp = per_token[("deepseek-v3", 4096, True)]
    assert {rid.split(":")[0] for rid, _ in with_mtp} == {"nemo-mbridge-25.11",
                                                          "nemo-mbridge-26.02"}
    without = per_token[("deepseek-v3", 4096, False)][0][1]
    assert with_mtp[0][1] / without - 1 == pytest.approx(0.04, abs=0.01)  # MTP's extra block and output head


def test_uneven_interleaved_rows_are_the_recipes_own_splits(vr, loaded):
    """Rows whose recipe splits with Megatron's account-for-embedding/loss carry exactly the
    split megatron-core builds (`accounted_partition`, checked against megatron-core in
    test_partition); DeepSeek-V3 on pp4·vp4 carries Megatron-Bridge's layout_map[(4, 4)]."""
    from shardwise.layout import accounted_partition

    seen = 0
    for row in loaded[2]:
        if "partition=" not in row["layout"] or "chunks=" not in row["layout"]:
            continue
        try:
            case = vr.build(row)
        except ShardwiseError:  # an accelerator shardwise lacks (gb300)
            continue
        layout = case.layout
        n = case.model.n_layers
        if any("account_for_embedding" in a for a in row["assumed"]):
            assert layout.partition == accounted_partition(n, layout.pp, layout.chunks)
            seen += 1
        elif row["model"] == "deepseek-v3" and (layout.pp, layout.chunks) == (4, 4):
            assert layout.partition == (4,) + (4,) * 14 + (1,)
            seen += 1
    assert seen >= 20


def test_gpt_oss_rows_are_the_models_transformers_configures(loaded, vr):
    """The gpt-oss rows build the architecture transformers' own `GptOssConfig` gives each size
    (its defaults are gpt-oss-120b's shapes; 20b: 24 layers, 32 experts): windows alternating
    with full layers, sinks, the parameter count."""
    transformers = pytest.importorskip("transformers")
    from shardwise.arch.hf import from_hf_dict

    sizes = {"gpt-oss-120b": {}, "gpt-oss-20b": {"num_hidden_layers": 24,
                                                 "num_local_experts": 32}}
    seen = set()
    for row in loaded[2]:
        if "gpt-oss" not in str(row["model"]):
            continue
        model = vr.model_of(row["model"])
        config = transformers.GptOssConfig(**sizes[model.name]).to_dict()
        theirs = from_hf_dict(config, model.name)
        assert model.count_params().total == theirs.count_params().total
        assert (model.layer_types, model.sliding_window, model.attention_sinks) == (
            theirs.layer_types, theirs.sliding_window, theirs.attention_sinks)
        assert 0 < model.sliding_window < row["seq"] and "full" in model.layer_types
        seen.add(model.name)
    assert seen == set(sizes)


def test_row_moe_settings_reach_the_train_spec(vr, loaded):
    """A row's stated MoE settings (dispatcher, EP overlap, capacity, MTP, recompute modules)
    become the TrainSpec fields `estimate_step` reads, and the capacity reaches the routed
    rows: Megatron pads each expert to `capacity = factor·T·k/E` (`moe_utils.get_capacity`),
    so every rank sends `factor·T·k` rows."""
    from shardwise.estimate.expert import ep_volumes

    row = next(r for r in loaded[2] if r["id"] == "dgxc-v25.05:deepseek-v3-h100-sxm-g1024")
    train = vr.build(row).train
    assert (train.moe_dispatcher, train.moe_overlap, train.moe_capacity, train.mtp_layers,
            train.recompute_modules) == ("alltoall", "shared", 1.0, 1, ("mla_up_proj",))
    padded = vr.build({**row, "stack": {**row["stack"], "moe_capacity": 1.25}})
    model = padded.model
    vol = ep_volumes(model, padded.train, tokens=2048.0, e=64, et=1, ep_in_node=4,
                     act_bytes=2.0)
    assert vol["rows"] == pytest.approx(2048 * model.top_k * 1.25)
    assert vol["combine"] == pytest.approx(2048 * model.top_k * 1.25 * model.d_model * 2)


def test_dgxc_deepseek_rows_carry_the_nemo_recipe_split_and_attention(vr, loaded):
    """NeMo r2.3.0's pretrain_deepseek_v3.py puts 64/pp − 1 layers on the first stage and
    64/pp − 2 on the last (the middle ones 64/pp: 61 in all); on Blackwell, Transformer
    Engine 2.2 runs MLA unfused (FlashAttention refuses head_dim_qk ≠ head_dim_v, cuDNN's
    arbitrary-seqlen kernel refuses head_dim_qk > 128 on sm_arch ≥ 100), on Hopper fused."""
    from shardwise.hardware import generation

    seen = 0
    for row in loaded[2]:
        if not row["id"].startswith("dgxc-v25.05:deepseek-v3-"):
            continue
        case = vr.build(row)
        p, mid = case.layout.pp, 64 // case.layout.pp
        assert case.layout.partition == (mid - 1,) + (mid,) * (p - 2) + (mid - 2,)
        assert sum(case.layout.partition) == case.model.n_layers == 61
        model = case.model
        unfused = (generation(case.cluster.accelerator.name) == "blackwell"
                   and model.head_dim > 128 and model.head_dim != model.value_head_dim)
        assert case.train.flash_attention is not unfused
        seen += 1
    assert seen == 5


def test_dgxc_gb200_nvlink_domain_is_nemos_slurm_segment(vr, loaded):
    """NeMo's performance-script executor (scripts/performance/utils.py at the dgxc recipes'
    NeMo commits) asks Slurm for `--segment` = the largest divisor ≤ 18 of the tray count when
    a GB200 job (4 GPUs per tray) spans more than 18 trays: each segment shares one NVL72's
    NVLink domain. Every dgxc GB200 row's `gpus_per_node` (shardwise's NVLink domain) is that
    segment's GPUs, or the whole job within one rack."""
    def segment_gpus(gpus: int) -> int:
        trays = gpus // 4
        if trays <= 18:
            return gpus
        return 4 * next(s for s in range(18, 0, -1) if trays % s == 0)

    rows = [r for r in loaded[2]
            if r["source"].startswith("dgxc") and r.get("accelerator") == "gb200"]
    assert len(rows) >= 30
    for row in rows:
        assert vr.build(row).cluster.gpus_per_node == segment_gpus(row["gpus"]), row["id"]


def test_recipe_moe_settings_reach_the_estimate_and_deepep_rows_run_expert_parallel(vr, loaded):
    """A row's dispatcher, EP overlap and CUDA-graph scopes (its recipe's, cited in `assumed`)
    arrive in the TrainSpec `estimate_step` reads; every row that runs DeepEP/HybridEP — its
    stack's flex dispatcher or a 'DeepEP' kernel note (NeMo AutoModel's table) — has
    tp·ep > 1, which megatron-core 0.16.1 asserts for the flex dispatcher
    (token_dispatcher.py `MoEFlexTokenDispatcher`: "Flex token dispatcher requires TPxEP > 1")
    and DeepEP needs to have ranks to exchange with."""
    keys = {"moe_dispatcher": "flex", "moe_overlap": "1f1b", "cuda_graph": None}
    carried = deepep = 0
    for row in loaded[2]:
        stack = row["stack"]
        try:
            case = vr.build(row)
        except ShardwiseError:  # an accelerator or split shardwise cannot express
            continue
        for key in keys:
            if key in stack:
                want = tuple(stack[key]) if key == "cuda_graph" else stack[key]
                assert getattr(case.train, key) == want, (row["id"], key)
                assert row.get("settings_source") or any(
                    "Recipe settings" in a or "enable_deepep" in a for a in row["assumed"]), row["id"]
                carried += 1
        if stack.get("moe_dispatcher") == "flex" or "deepep" in row.get("notes", "").lower():
            assert case.layout.tp * case.layout.ep > 1, row["id"]
            assert case.train.moe_dispatcher == "flex", row["id"]
            deepep += 1
    assert carried >= 20 and deepep >= 10
