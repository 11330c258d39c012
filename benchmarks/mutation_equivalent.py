"""Mutants no test can kill because the program computes the same thing (mutant → why), read
by hand from `mutmut show NAME`, for benchmarks/mutation.py: they leave the numerator and the
denominator. mutmut numbers a function's mutants in order, so an edit to a function renumbers
them: recheck the entries of a changed function."""

_S, _A = "shardwise.estimate.state.x_", "shardwise.estimate.activations.x_"
_G = "shardwise.estimate.geometry.x_"
_LOWER = "dtype_bytes lower-cases the name: the same dtype"
EQUIVALENT: dict[str, str] = {
    f"{_S}bytes_per_param_training__mutmut_2": _LOWER + " (default \"BF16\")",
    f"{_S}bytes_per_param_training__mutmut_28": "weight >= 4: at 4 bytes the moments' factor "
                                                "weight/4 is 1",
    f"{_S}bytes_per_param_training__mutmut_29": "weight > 5: dtypes are 0.5, 1, 2, 4 or 8 bytes, "
                                                "none in (4, 5]",
    f"{_S}bytes_per_param_training__mutmut_44": _LOWER + " (\"FP32\")",
    f"{_S}bytes_per_param_training__mutmut_48": _LOWER + " (\"FP32\")",
    f"{_S}kv_cache_bytes_per_token__mutmut_2": _LOWER + " (default \"BF16\")",
    f"{_A}activation_bytes_per_layer__mutmut_9": _LOWER + " (default \"BF16\")",
    f"{_A}korthikanti_activation_bytes__mutmut_3": "default recompute renamed: any name but "
                                                   "full or selective is no recompute",
    f"{_A}korthikanti_activation_bytes__mutmut_4": "default recompute \"NONE\": any name but "
                                                   "full or selective is no recompute",
    f"{_A}gathered_kv_bytes__mutmut_9": "n_kv / tp for n_kv // tp: a valid layout's tp divides "
                                        "n_kv or exceeds it, and max(·, 1) then agrees",
    f"{_A}recompute_adjust__mutmut_26": "np.where on a scalar selective: a 0-d array of the same "
                                        "value",
    f"{_A}activation_bytes_per_layer__mutmut_108": "selective None for selective & False: "
                                                   "both false wherever layer_bytes reads it",
    **{f"{_A}activation_bytes_per_layer__mutmut_{n}": "the default module renamed: "
       "recompute_dropped reads no \"core_attn\" (the attention core is the profile's "
       "selective)" for n in (100, 101)},
    f"{_A}recompute_dropped__mutmut_5": "drop = … for drop |= …: the first update of an "
                                        "empty set",
    "shardwise.estimate.check.rows.x_merge_rows__mutmut_38": "peak memory's order 3 → 4: "
                                                             "still after state (2), before "
                                                             "any other item (9)",
    **{f"shardwise.estimate.check.traffic.x__wire_row__mutmut_{n}": "a default for an axis or "
       "call the counters lack: CommCounter counts a payload, its calls and its group's size "
       "together, so a counted payload always has both" for n in (24, 32)},
    f"{_G}_distinct__mutmut_36": "layers·(L+1) − moe_layers for + moe_layers: with "
                                  "0 ≤ moe_layers ≤ L both keys are one-to-one",
    f"{_G}layer_params__mutmut_58": "the expert term worked out for a dense model too: "
                                    "its n_experts = 0 makes it 0",
    f"{_G}mtp_params__mutmut_23": "1 × expert_layer for 0 × it on a dense model, whose "
                                  "expert_layer is 0",
    **{f"shardwise.estimate.host.x_optimizer_host_ops__mutmut_{n}": "the runtime op count "
       "serves the runtime's model only, which is Llama-style (RMSNorm, SwiGLU): "
       "`runtime.model.Transformer` refuses LayerNorm and a two-matrix MLP" for n in (8, 12, 19)},
    "shardwise.estimate.host.x_expert_launches__mutmut_10": "default None for 1: every TE "
                                                            "recipe that quantises the experts "
                                                            "is in _QUANTIZE_KERNELS",
    "shardwise.estimate.goodput_sim.x__spares_wait__mutmut_19": "argsort's default axis -1 "
                                                                "is axis 1 of the 2-D "
                                                                "returns",
    "shardwise.estimate.goodput_sim.x_simulate__mutmut_79": "float ones for bool ones: "
                                                            "`active` is only assigned False "
                                                            "and read by flatnonzero",
    "shardwise.estimate.uncertainty.x_unvalidated__mutmut_114": "\"NONE\" for \"none\": every "
                                                                "validated stack's ground "
                                                                "lists \"none\", so no note either way",
    "shardwise.estimate.uncertainty.x_unvalidated__mutmut_9": "no default for the ground's "
                                                              "stacks: validation.json's "
                                                              "ground always has them",
    "shardwise.plan.lines.x__ranks__mutmut_8": "5·n for 4·n: where the table or np.unique "
                                               "is used; both give the same ranks",
    "shardwise.plan.prune.x_prune_evaluate__mutmut_26": "max(2, …) for max(1, …): "
                                                        "MEMORY_BLOCK_CELLS // n_cols is "
                                                        "hundreds of thousands (n_cols ≤ 8)",
    "shardwise.plan.evaluate.x_step_floor__mutmut_10": "np.zeros_like(None) is an object 0: "
                                                       "ZeRO stage 0 all the same",
    "shardwise.plan.grid.x__expand__mutmut_24": "np.array of Python ints without a dtype is "
                                                "int64 (numpy 2, every platform)",
    "shardwise.plan.lines.x__dense_ids__mutmut_19": "every column through np.unique's inverse: "
                                                    "the same lexicographic ids, slower",
    "shardwise.plan.prune.xǁ_Stateǁthresholds__mutmut_80": "each axis value's threshold "
        "doubled: more layouts timed, never fewer, so the same answer with more work "
        "(benchmarks/bench_planner.py's `timed` shows the work)",
    "shardwise.estimate.goodput.x_checkpoint_writes__mutmut_22": "- 0.0·tp for + 0.0·tp: "
                                                                 "the same array",
    "shardwise.estimate.expert.x__reached__mutmut_10": "no float dtype: np.maximum with "
                                                       "1.0 makes the units float anyway",
    "shardwise.estimate.expert.x__reached__mutmut_15": "groups < 1 for groups <= 1: one group "
                                                       "has topk_groups ≥ 1 = groups, so the "
                                                       "same branch is taken",
    "shardwise.estimate.expert.x_ep_time__mutmut_31": "e >= 1 for e > 1 under torchtitan: with "
                                                      "ep = 1 no dispatcher collective runs, "
                                                      "0 whatever the shard",
    "shardwise.schedules.metrics.x_partition_layers__mutmut_55": "every stage's starting "
                                                                 "cost one higher: the heap's "
                                                                 "order, so the split, is the "
                                                                 "same",
    "shardwise.partition.x_first_last_partition__mutmut_6": "-2 for -1 as the 'not given' "
                                                            "mark: only f >= 0 is tested",
    "shardwise.partition.x_virtual_sizes__mutmut_2": "default \"LOOP\": virtual_stage "
                                                     "treats anything but \"v\" as the loop",
    "shardwise.plan.evaluate.x__blocks__mutmut_63": "one block of every row and column "
                                                    "for None: the grid evaluated as it is "
                                                    "either way",
    "shardwise.arch.hf_families.x__layer_types__mutmut_24": "(i - 1) % 2 for (i + 1) % 2: "
                                                            "the same parity",
    "shardwise.arch.hf_families.x__layer_types__mutmut_100": "sliding without a window: "
                                                             "the next line makes every "
                                                             "window-less sliding layer full",
    "shardwise.arch.spec.xǁModelSpecǁmtp_params__mutmut_8": "active=None for False: falsy, "
                                                            "every expert counted either way",
    "shardwise.estimate.step.x_estimate_step__mutmut_169": "the guard for busy = 0 dropped: "
                                                           "busy = m·(t_f + t_b) > 0 for every "
                                                           "layout",
    "shardwise.estimate.step.x_step_terms__mutmut_173": "one MTP MoE layer on a dense model's "
                                                        "last stage: its EP time per layer is 0",
    "shardwise.stacks.titan_versions.constant_L50_C54": "dp_overlap_zero's 1 made 2: "
        "torchtitan 0.1.0 runs ZeRO 0, 2 and 3 only, so whether ZeRO-1 overlaps is never asked",
    "shardwise.estimate.step.x_simulated_bubble_floor__mutmut_40": "the maximum over the stages "
        "started at m(t_f + t_b) for 0: the busiest stage's own term (a_s = 1, h_s ≥ 0) is at "
        "least that",
    "shardwise.estimate.axes.x_dp_time__mutmut_380": "default None for a missing sum: every "
                                                     "group adds every key, so none is missing",
    "shardwise.estimate.profiles.x_saved_tensors__mutmut_146": "None for False: falsy "
                                                               "wherever `add` reads it (a "
                                                               "scalar is skipped, np.where "
                                                               "picks the same)",
    "shardwise.estimate.memory.x_peak_stage_total__mutmut_29": "partition None for (): neither "
                                                               "is an explicit partition",
    "shardwise.estimate.memory.x_peak_stage_total__mutmut_45": "the stage's geometry worked out "
                                                               "again instead of passed: the "
                                                               "same geometry",
    "shardwise.estimate.memory.x_training_memory_per_gpu__mutmut_4": "default generation "
                                                                     "\"HOPPER\": only "
                                                                     "\"blackwell\" is told "
                                                                     "apart",
    "shardwise.estimate.uncertainty.x_conformal__mutmut_17": "0 <= k for 0 < k: k = ⌈(n+1)·c⌉ "
                                                             "is at least 1 for any n ≥ 0, c > 0",
    "shardwise.estimate.uncertainty.x_uncertainty__mutmut_106": "COVERAGES[+1] for [-1]: the "
                                                                "same element of a pair",
    **{f"shardwise.estimate.uncertainty.x_resolution__mutmut_{n}": "the message of a raise "
       "after the \"all runs\" level, which always returns: unreachable" for n in (32, 33)},
    f"{_G}_distinct__mutmut_24": "dtype None for int64: the fields are ints and bools, and "
                                 "the key's int + bool arithmetic gives the same ints",
    f"{_G}distinct_geometries__mutmut_49": "dtype None for int64: every column (pp, chunks, "
                                           "codes, m, Balanced ends, stages) is already int",
    f"{_G}_unique_rows__mutmut_14": "1 << 63 for 1 << 62: a code is below the radices' "
                                    "product, so under 2^63 it still fits in int64",
    **{f"{_G}{name}": "\"LOOP\" for \"loop\": virtual_stage treats every placement but "
       "\"v\" as the loop" for name in ("placement_of__mutmut_23",
                                          "stage_layer_count__mutmut_2")},
    f"{_G}param_geometry__mutmut_44": "placement None in a geometry whose params() never "
                                      "reads its placement",
    "shardwise.estimate.memory.x_stage_memory__mutmut_7": "default generation \"HOPPER\": "
                                                          "only \"blackwell\" is told apart",
    # pipe-fix (schedules)
    "shardwise.schedules.registry.x__dualpipe_in_flight__mutmut_1": "+ 0·stage only gives the "
        "result the stage's array shape: - 0·stage is the same",
    "shardwise.schedules.registry.x__dualpipev_in_flight__mutmut_1": "+ 0·stage only gives the "
        "result the stage's array shape: - 0·stage is the same",
    "shardwise.schedules.metrics.x_microbatches_for_bubble__mutmut_8": "check_dimensions(p, 1, "
        "v) checks p and v; m = 1 is a placeholder, and m = 2 is as valid",
    "shardwise.schedules.validate.x_validate_schedule__mutmut_47": "the simulation only tells "
        "a deadlock from a finished run, which list scheduling decides by the order alone, "
        "whatever the positive durations (t_b 2 or 3)",
    "shardwise.schedules.simulate.x__deadlock_message__mutmut_1": "the one caller (simulate) "
        "passes span: the default is never used",
    # mut-b
    **{f"shardwise.estimate.{name}": "0.0 / x for 0.0 * x: x is a degree (t, m) ≥ 1, "
       "so both are 0" for name in (
           "axes.x_tp_time__mutmut_141", "axes.x_dp_time__mutmut_37",
           "axes.x_dp_time__mutmut_47", "axes.x_dp_time__mutmut_383",
           "pipe_engine.x_pipe_engine_time__mutmut_2",
           "pipe_engine.x_pipe_engine_time__mutmut_4",
           "pipe_engine.x_pipe_engine_time__mutmut_142")},
    **{f"shardwise.estimate.{name}": "a threshold moved from > 1 to ≥ 1 ranks: a collective "
       "over one rank is 0 in the α-β form (no round, and no call: small_calls charges "
       "none either)" for name in (
           "axes.x_tp_time__mutmut_69", "axes.x_tp_time__mutmut_119",
           "axes.x_tp_time__mutmut_155", "axes.x_tp_time__mutmut_225",
           "axes.x_cp_time__mutmut_5", "axes.x_cp_time__mutmut_180",
           "axes.x_dp_time__mutmut_182", "axes.x_dp_time__mutmut_194",
           "axes.x_dp_time__mutmut_335", "pipe_engine.x_pipe_engine_time__mutmut_209")},
    "shardwise.estimate.axes.x_tp_overlapped__mutmut_13": "max(t, 2) for max(t, 1): at t = 1 "
                                                          "the window's t - 1 is 0 anyway",
    "shardwise.estimate.axes.x_cp_time__mutmut_16": "c / u for c // u: u divides c "
                                                    "(MeshShape refuses any other ulysses)",
    "shardwise.estimate.axes.x_cp_time__mutmut_37": "n_kv / t for n_kv // t: a valid layout's "
                                                    "tp divides n_kv or exceeds it, and "
                                                    "max(·, 1) then agrees",
    "shardwise.estimate.axes.x_cp_time__mutmut_85": "busy 2.0 without CP overlap: hidden() "
                                                    "returns the transfer without reading it",
    **{f"shardwise.estimate.axes.x_dp_time__mutmut_{n}": "the node size dropped from the "
       "node-speed Links: group_collective_time and busy_fraction never read gpus_per_node"
       for n in (4, 24)},
    "shardwise.estimate.pipe_engine.x_pipe_engine_time__mutmut_15": "the optimizer dropped "
        "(default adam): it sets only the master and moment bytes, which the engine's terms "
        "never read",
    **{f"shardwise.estimate.links.x_{name}": "a default None for NaN, or no declared output "
       "type, in an np.vectorize over call costs: NaN either way, and the measured costs are "
       "floats (seconds)" for name in (
           "group_collective_time__mutmut_6", "group_collective_time__mutmut_8",
           "group_collective_time__mutmut_11", "group_collective_time__mutmut_13",
           "small_calls__mutmut_12", "small_calls__mutmut_14")},
    "shardwise.estimate.links.x_group_collective_time__mutmut_16": "always through the "
        "measured branch: where no call of op was measured every element takes the plain "
        "α-β time there too",
    "shardwise.estimate.links.x_group_collective_time__mutmut_20": "call None for (): the "
        "plain Links' call is only tested for truth, and both are false",
    "shardwise.estimate.links.x_p2p_latency__mutmut_11": "call - 0.0·latency for "
                                                         "call + 0.0·latency: the same",
    "shardwise.estimate.links.x_small_calls__mutmut_8": "0.0 / ranks for 0.0 * ranks: ranks "
                                                        "≥ 1",
    "shardwise.estimate.step.x_compute_costs__mutmut_1": "etp's default 1 for 0: every "
        "caller (step_terms, plan.evaluate) passes etp",
    **{f"shardwise.estimate.step.constant_L{line}_C{col}": "a StepEstimate field's default "
       "(dp_comm_total, t_forward, t_backward, bubble_fraction): estimate_step, its only "
       "maker, passes every one" for line, col in ((383, 27), (384, 23), (385, 24), (386, 29))},
    # mut-c
    "shardwise.estimate.goodput.x_checkpoint_bytes_per_param__mutmut_1": "default ZeRO 2 for "
        "1: no stack's model_copy_at tells stage 1 from 2 (all list both or neither)",
    **{f"shardwise.estimate.goodput.x_checkpoint_writes__mutmut_{n}": "0.0 / tp for 0.0 * tp: "
       "both zero (tp >= 1), there only for the arrays' shape" for n in (25, 30, 32)},
    "shardwise.estimate.goodput.x_checkpoint_writes__mutmut_31": "the busiest rank's running "
        "max starts at tp bytes instead of 0: every stage's rank writes far more (a layer's "
        "norm alone is d_model·14 B)",
    "shardwise.estimate.goodput.x_wall_per_useful__mutmut_12": "x <= 30 for x < 30: at "
        "x = 30 exactly ln(e^30 - 1) and 30 differ by 9e-14 (3e-15 relative)",
    "shardwise.runtime.checkpoint.directory.xǁDirectoryLockǁ_refuse_or_clear__mutmut_18": "pid "
        "> 1 for pid > 0: pid 1 (init) is always alive, so neither clears its lock",
    "shardwise.runtime.collectives.calls.x_reduce_scatter__mutmut_4": "default impl "
        "\"NATIVE\": every impl but \"ring\" is the backend's",
    "shardwise.runtime.collectives.calls.x_reduce_scatter__mutmut_34": "numel / N for "
        "numel % N: an even split then also takes the p2p ring, which gives the same values "
        "and counts the same (N-1)/N·S bytes and payload (a speed difference only)",
    **{f"shardwise.runtime.collectives.calls.x_recv__mutmut_{n}": "the group passed on a "
       "group of one too: AxisGroup's group is None exactly when its size is 1"
       for n in (17, 18)},
    "shardwise.runtime.collectives.calls.x_wait__mutmut_11": "the poll's deadline with <= for "
        "<: the same polling up to one clock tick, then the same blocking wait",
    "shardwise.runtime.collectives.rings.x_ring_all_reduce_p2p__mutmut_8": "always through a "
        "contiguous copy: the same values, copied back into the tensor",
    "shardwise.runtime.checkpoint.save.x_save_checkpoint__mutmut_74": "shardwise.json without "
        "indentation: the same JSON to every reader (the manifest hashes the file as written)",
    # mut-a
    "shardwise.estimate.compute.constant_L87_C23": "LayerCost's default fp8_weights: its "
        "only constructor (layer_cost) passes it",
    **{f"shardwise.estimate.kernels.constant_L90_C{col}": "ComputeContext's default "
       "layer_kernels: ComputeContext.of, its only maker in src/, always passes the kernels "
       "(host_ops reads them); only test_host_ops' hand-built contexts, outside this "
       "group's tests, take the default" for col in (42, 47)},
    "shardwise.estimate.kernels.constant_L93_C22": "ComputeContext's default fp8_peak: read "
        "only by FP8 GEMMs, which need a recipe, which ComputeContext.of passes with its peak",
    **{f"shardwise.estimate.kernels.constant_L{line}": f"ComputeContext's default {name}: "
       "ComputeContext.of passes it; the contexts tests build by hand (test_host_ops) call "
       "host_ops only, which reads neither" for line, name in (
           ("86_C25", "expert_load"), ("95_C29", "recompute_share"))},
    "shardwise.estimate.kernels.constant_L87_C28": "ComputeContext's default experts_active: "
        "ComputeContext.of passes it; a context built by hand (test_host_ops) sets it or "
        "counts a dense layer, which does not read it",
    **{f"shardwise.estimate.kernels.constant_L{line}": f"Gemms' default {name}: every Gemms "
       "built (linear, +, *) passes fwd, dgrad and wgrad" for line, name in (
           ("174_C15", "fwd"), ("175_C17", "dgrad"), ("176_C17", "wgrad"))},
    **{f"shardwise.estimate.expert.x_ep_time__mutmut_{n}": "a collective over a group of one "
       "rank (allgather's tp·ep = 1, expert-TP et = 1) costs 0 (group_collective_time)"
       for n in (123, 219)},
    "shardwise.estimate.host.x_expert_host__mutmut_10": "0/local for 0·local: local = "
        "E/ep·a > 0 experts (experts_active is validated positive)",
    **{f"shardwise.estimate.host.x_expert_launches__mutmut_{n}": "the default kernels of a "
       "recipe outside _QUANTIZE_KERNELS: no stack runs the fused count with one (every "
       "impl × recipe × accelerator × compile tried)" for n in (12, 13)},
    # mut-d
    "shardwise.emit.launchers.x_slurm_script__mutmut_15": "words[i + 1:i - 1] = … for "
        "words[i + 1:i + 1] = …: a slice whose stop is before its start is the empty slice "
        "at its start, so the same insertion",
    "shardwise.partition.x_first_last_partition__mutmut_12": "g = -2 for -1 when no last "
        "stage is given: g is read only as g >= 0 and max(g, 0), the same for both",
    # mut-e
    "shardwise.partition.constant_L50_C14": "FIXED's last_less sentinel -9 → -10: every "
        "reader compares with FIXED itself (a key of _partitions) or its first_less, and no "
        "real count is negative",
    "shardwise.partition.x_chunk_span__mutmut_9": "dtype None for int64 in np.asarray of a "
        "tuple of Python ints: numpy's default integer, int64 on the 64-bit platforms run",
    # mut-emit
    "shardwise.emit.deepspeed.x_deepspeed_config__mutmut_45": "stage3_param_persistence_"
        "threshold 10^6 + 1 for 10^6: DeepSpeed persists a parameter when ds_numel ≤ the "
        "threshold (runtime/zero/partition_parameters.py:1292 @0.19.8), so the two differ "
        "only for a parameter of exactly 1,000,001 = 101·9901 elements, which no model's "
        "shapes give",
    "shardwise.emit.deepspeed.x_deepspeed_config__mutmut_58": "the gradient_clipping key "
        "renamed: DeepSpeed 0.19.8 ignores the unknown key and clips at its default, 1.0 "
        "(runtime/constants.py:203 GRADIENT_CLIPPING_DEFAULT), the value written",
    "shardwise.emit.common.x__edits__mutmut_22": "range(2, n + 2) for range(2, n + 1) in the "
        "first v with n % (pp·v) == 0: v = n + 1 never divides (pp·(n + 1) > n ≥ 1), so the "
        "same first v or none",
    "shardwise.emit.launchers.x__yaml__mutmut_52": "a scalar list item through _yaml(item, "
        "indent + 1) for the inline form: both give two more spaces of pad and json.dumps(item), "
        "and the line is lstripped",
    "shardwise.emit.deepspeed.x__deepspeed_run__mutmut_73": "abs(count − round(count)) ≥ "
        "1e-9 for > 1e-9: the two differ only at a distance of exactly 1e-9 (a float "
        "share·L that is 1e-9 from whole), which no share a user gives produces",
    # mut-arch-layout
    "shardwise.layout.xǁLayoutǁparse_fields__mutmut_26": "staged = None for (): it is read "
        "only as `if staged and …` (None and () both false) until a Megatron layout string "
        "assigns it",
    "shardwise.arch.spec.xǁModelSpecǁ_moe_problems__mutmut_33": "k·n_experts / g for "
        "// g: read only after `n_experts % g` is 0 (the `or` stops before), where both are "
        "the same whole number",
    "shardwise.arch.spec.xǁModelSpecǁ_moe_problems__mutmut_14": "routed_scaling >= 0 for "
        "> 0: _moe_problems runs only when the field checks found nothing, and they refuse "
        "routed_scaling ≤ 0 (finite, low 0, open)",
    # mut-ckpt-stacks
    "shardwise.runtime.checkpoint.reshard.x__blocks__mutmut_51": "start <= stop for start < "
        "stop before the partial last row: at start == stop it recurses on [0, 0), which "
        "returns [] at once (start >= stop)",
    **{f"shardwise.runtime.checkpoint.{name}": "DCP's no_dist given as None (or False in "
       "read_parameters): torch 2.13's dcp.save/load set no_dist = no_dist or not "
       "dist.is_initialized() (state_dict_saver.py:184, state_dict_loader.py:158), and "
       "read_parameters, which no code in src calls, runs where no group or a group of one "
       "is initialized" for name in ("load.x__load__mutmut_24", "save.x_save_checkpoint__mutmut_44",
                                    "load.x_read_parameters__mutmut_24")},
    **{f"shardwise.runtime.checkpoint.manifest.x__write_durably__mutmut_{n}": "the encoding "
       "left to the locale or spelled UTF-8: every text written is ASCII (json.dumps escapes "
       "the rest; step-N names; the marker line)" for n in (4, 8)},
    "shardwise.runtime.checkpoint.directory.xǁDirectoryLockǁ_refuse_or_clear__mutmut_3":
        "rpartition for partition of the lock's 'pid host': one space, hostnames hold none",
    "shardwise.runtime.checkpoint.reshard.x__adamw_zeros__mutmut_6": "the step's dtype left "
        "to torch's default, float32: nothing in shardwise sets another default dtype",
    "shardwise.runtime.checkpoint.reshard.x__place__mutmut_18": "tp_replicas also divides "
        "the ep offset: only the kv projections wk, wv have tp_replicas > 1 "
        "(parallel_axes.py), never an expert weight",
    "shardwise.stacks.stack.xǁStackǁrefused__mutmut_2": "np.asarray without dtype=bool: "
        "every rule's refuses() is comparisons joined by & (a bool array or numpy bool)",
    "shardwise.runtime.checkpoint.directory.x__remove__mutmut_14": "missing_ok None for "
        "True when unlinking a child just listed: it exists (no other process touches the "
        "directory while this run holds its lock)",
    "shardwise.runtime.checkpoint.directory.xǁDirectoryLockǁ__enter____mutmut_15": "encoding "
        "UTF-8 for utf-8: the same codec",
    "shardwise.runtime.checkpoint.reshard.x__blocks__mutmut_25": "out = … for out += … on "
        "the partial first row: out is still empty there",
    "shardwise.runtime.checkpoint.save.x_save_checkpoint__mutmut_47": "DCP's no_dist left to "
        "its default: torch 2.13 sets no_dist = no_dist or not dist.is_initialized() "
        "(state_dict_saver.py:184)",
    "shardwise.runtime.checkpoint.save.x_save_checkpoint__mutmut_75": "shardwise.json "
        "indented by 2 for 1: the same JSON to every reader (the manifest hashes the file as "
        "written)",
    "shardwise.stacks.stack.xǁSettingsǁdp_overlapped__mutmut_11": "np.isin for a scalar "
        "stage too: a 0-d bool array, true exactly where `in` is",
    "shardwise.stacks.titan_versions.x__selective__mutmut_14": "default recompute_share 2.0 "
        "for 1.0 (train without one): both are >= 1, so neither is layer SAC",
    "shardwise.stacks.splits.x_balanced_ends__mutmut_17": "last_less searched in [0, 2] "
        "instead of [-2, 2]: for every split (deepspeed, neox, torchtitan), 2 <= L < 130 and "
        "2 <= pp <= 16 a count z >= 0 gives the same stage sizes (checked); its one caller "
        "(plan.grid._partitions) keys those sizes by the counts and a searched layout takes "
        "the sizes (plan.evaluate._layout_of)",
    "shardwise.stacks.splits.x_balanced_ends__mutmut_20": "last_less searched in [-3, 2] "
        "instead of [-2, 2]: for every split (deepspeed, neox, torchtitan), 2 <= L < 200 and "
        "2 <= pp <= 16 it returns the same counts and sizes, or None alike (checked): no "
        "Balanced(a, -3) reproduces a stack's split before a count in [-2, 2] does",
    # mut-plan (code at branch point 80a1629; search-speed changes src/shardwise/plan/*:
    # recheck these after merging it)
    "shardwise.plan.rank.xǁRankingǁposition__mutmut_20": "figure(None).min() for "
        "figure(idx).min() as the rounding's reference: known is inf where a layout does not "
        "fit (idx: the fitting ones), so the least figure of all is the least fitting one",
    "shardwise.plan.rank.xǁRankingǁ_simulate__mutmut_88": "pending[exact] = None for False: "
        "numpy stores None in a bool array as False",
    "shardwise.plan.rank.xǁRankingǁ__init____mutmut_72": ".astype(None) for .astype(bool): "
        "float 0.0/1.0, read only as np.where's condition (nonzero is true)",
    "shardwise.plan.grid.x__example__mutmut_9": "\"XXXX\" for \"\" when no cell is hit: each "
        "_example is drawn from the mask its region's count sums, and _Rejections.add drops a "
        "region of count 0 before reading its example",
    "shardwise.plan.prune.constant_L64_C16": "_THREAD_CELLS 16384 → 16385: only how the "
        "cells to time are cut into thread chunks; each cell's terms are elementwise and put "
        "back by index, the same numbers in any chunking",
    # mut-plan2 (code at 3d4fe7e; grid._example 9 above is still "" → "XXXX", the same mutant)
    "shardwise.plan.grid.x__flatten__mutmut_6": "`valid.ndim == 2 or True`: _enumerate's "
        "_valid is always the 2-D (rows × inner cells) mask (grid.py builds it with axis=1 "
        "reductions) and search.plan is _flatten's only caller, so the condition is always true",
    "shardwise.plan.prune.xǁ_Stateǁadd__mutmut_96": "BoundBroken check at floor·(1 + 1e-9) "
        "for floor·(1 − 1e-9): the floor is stored 1e-6 under evaluate.step_floor, a lower "
        "bound of the exact step, so no exact figure falls in the 2e-9 band between the two; "
        "and a raise only sends search.plan to evaluate every layout, the same ranking",
    # estimate.rows and estimate.geometry at ad0f03e (2026-12-06 morning)
    "shardwise.estimate.rows.x_bits_hash__mutmut_14": "code·K − bits for code·K + bits: "
        "subtracting a column's bits modulo 2⁶⁴ is as much a bijection as adding them, so "
        "equal rows still hash equal and distinct ones as rarely together; equal_rows "
        "compares the rows a hash groups either way",
    **{f"shardwise.estimate.rows.x_equal_rows__mutmut_{n}": "the rows compared in their "
       "column's own dtype instead of float64: every caller passes float64 columns and int64 "
       "ones below 2⁵³ (lengths, micro-batches), equal in either; the own dtype is only "
       "stricter" for n in (20, 22)},
    "shardwise.estimate.memory.x_stage_memory__mutmut_285": "stage − 0·pp for stage + 0·pp: "
        "both add nothing (pp only gives the stage the arrays' shape)",
    "shardwise.estimate.memory.x__held_activations__mutmut_29": "per-layer-kind sum for a "
        "dense model too: its stages hold no MoE layer, so dense_layers × dense = layers × "
        "dense (act[\"moe\"] is 0.0)",
    "shardwise.estimate.memory.x_training_memory_per_gpu__mutmut_9": "check_specs without the "
        "model: layout.validate(model) next runs Layout.problems, whose check_specs gives the "
        "same one-line error for a model that is not a ModelSpec "
        "(tests/estimate/test_memory_terms.py)",
    "shardwise.estimate.geometry.x_distinct_stages__mutmut_8": "shape = None: every call "
        "takes the branch that works each layout's stages out itself (_distinct on the "
        "arrays), the same stages, without first collapsing equal rows",
    "shardwise.estimate.geometry.x_distinct_geometries__mutmut_28": "`or partition` for `and "
        "partition`: a searched (Balanced) partition then takes the branch that works each "
        "layout's geometry out itself (StageGeometry.of on the arrays), the same numbers: "
        "the other branch runs StageGeometry.of on the distinct rows and spreads them back, "
        "and StageGeometry.of is elementwise",
    "shardwise.plan.lines.x__col_any__mutmut_2": "np.array of numpy bools without dtype=bool "
        "is bool already (the grid has at least one column)",
    "shardwise.plan.prune.xǁ_Stateǁadd__mutmut_70": "ThreadPoolExecutor(None) for "
        "min(_THREADS, chunks): more threads than chunks idle; each chunk's step times are "
        "the same",
    "shardwise.plan.prune.xǁ_Stateǁthresholds__mutmut_35": "the fitting threshold 1e-6 under "
        "the k-th best instead of over it: a cell could be skipped only if its floor were "
        "within 1e-6 of a step time, but the floor is taken 1e-6 down and leaves out the "
        "optimizer step, over 1e-6 of a step below ~10⁸ tokens per GPU per step (7.5e-6 at "
        "the least on tiny-deepseek's grid)",
    "shardwise.plan.rank.xǁRankingǁ__init____mutmut_9": "np.asarray(scale) without "
        "dtype=float: plan passes 1.0 or np.where(…, 1 / goodput, inf), float already",
    "shardwise.plan.evaluate.x_cell_terms__mutmut_19": "act None for the gathered per-layer "
        "bytes: stage_memory gathers the same bytes itself when given none (the same numbers)",
    "shardwise.plan.evaluate.x_flat_cells__mutmut_28": "the grid's _valid left among the "
        "cells' tables: nothing reads _valid from flat cells (prune and search read the "
        "grid's)",
    "shardwise.plan.evaluate.x_step_floor__mutmut_36": "the rows' stage shapes worked out "
        "again in step_terms instead of passed: run_shapes evaluates the same elementwise "
        "stage_shape on the same rows",
    "shardwise.plan.grid.x__expand__mutmut_196": "zip without strict=True: p3 and v are the "
        "two columns of one array, equal in length",
    "shardwise.plan.prune.x__floor__mutmut_27": "the DP floor per row kept in float64 until "
        "it is added into the float32 grid: one rounding instead of two, each 1e-6 under "
        "the bound, which it stays",
    # plan, seed 9's sample of 100 at fe2f3bd (the others of its 26 survivors are killed)
    **{f"shardwise.plan.explain.x__alternatives__mutmut_{n}": "top(1, fold=True) for "
       "fold=False: the fastest row heads its own family, so one row folded or not is the "
       "same row" for n in (52, 56)},
    "shardwise.plan.lines.xǁ_Leastǁcells__mutmut_19": "a column axis' seed cell at the wrong "
        "flat index: the seeds only make the first thresholds finite; a wrong (still valid) "
        "cell leaves them looser for a round, and the rounds time the same cells to the end",
    "shardwise.plan.lines.x__col_any__mutmut_4": "np.array of numpy bools without dtype=bool "
        "is bool already (the grid has at least one column)",
    "shardwise.plan.lines.x__dense_ids__mutmut_13": "`or` for `and` on the integer check: "
        "every caller passes integer columns, and for those the shifted path (with ranks "
        "past 256 values) and np.unique's inverse both give each value's rank among those "
        "present",
    **{f"shardwise.plan.grid.x__expand__mutmut_{n}": "np.array of Python ints (and bools) "
       "without a dtype is int64 already" for n in (113, 506)},
    "shardwise.plan.grid.x__expand__mutmut_432": "zg > 1 for zg > 0: a ZeRO group of 1 "
        "divides every replica count, so zg = 1 is never a bad group either way",
    "shardwise.plan.rank.xǁRankingǁ__init____mutmut_11": "np.asarray(scale) without "
        "dtype=float: plan passes 1.0 or np.where(…, 1 / goodput, inf), float already",
    "shardwise.plan.rank.xǁRankingǁtop__mutmut_60": "a pending row whose lower bound equals "
        "the threshold exactly left unsimulated: its exact figure is its bound plus a "
        "simulated bubble > 0 (pp > 1), so once simulated it is over the threshold and "
        "never returned either way",
    "shardwise.plan.baseline.x_choose_parallelism__mutmut_94": "micro_batch=1 dropped: "
        "Layout's default micro-batch is 1",
    "shardwise.plan.baseline.x_choose_parallelism__mutmut_138": "min of (peak, layout) "
        "tuples without the key: the peaks decide unless two differ in nothing but the "
        "layout; identical layouts compare equal, and no two distinct candidates tied to the "
        "byte on any preset on 2 to 16 H100s with nothing fitting (searched by hand)",
    "shardwise.plan.evaluate.x_evaluate_candidates__mutmut_5": "_wide on the grid's own "
        "tables too: it changes only int32 arrays' dtype, never a value",
    "shardwise.plan.evaluate.x_flat_cells__mutmut_26": "pop(\"_valid\") without a "
        "default: every grid flat_cells is given carries _valid (grid._expand sets it)",
    "shardwise.plan.evaluate.x__simulated_floor__mutmut_18": "the micro-batch counts left "
        "int64: simulated_bubble_floor only multiplies them into float times, the same floats",
    "shardwise.plan.evaluate.constant_L57_C20": "SIMULATED_ACTIONS 4,000 → 4,001: the "
        "cut is pp·m·chunks ≤ it with pp > 1, and 4,001 is prime, so no pipeline has "
        "exactly 4,001 actions",
    "shardwise.plan.prune.constant_L66_C17": "POSITION_CELLS 100,000 → 100,001: a work cap; "
        "only a rank needing exactly 100,001 step times changes, from bounds to exact, "
        "both true answers",
    # every other group, seed 2's sample of 40 at 0d45d36
    "shardwise.estimate.profiles.x_saved_tensors__mutmut_54": "_pick(when, value, 0.0) also "
        "where `when` is true throughout: it gives value (np.where broadcasts it where `when` "
        "is an array), the same sums",
    "shardwise.estimate.profiles.x__moe_saved__mutmut_1": "_moe_saved's default etp 0 → 1: "
        "its one caller (saved_tensors) always passes etp",
    "shardwise.estimate.geometry.x_layer_params__mutmut_63": "0 / tp for 0 * tp on a dense "
        "model: zero either way (a float zero), the same sums",
    "shardwise.estimate.geometry.x_distinct_stages__mutmut_35": "the key columns without the "
        "int64 cast: pp, chunks, schedule codes, m and the Balanced ends are integers "
        "already, the same rows",
    "shardwise.estimate.geometry.x__distinct__mutmut_26": "the composition fields without the "
        "int64 cast: layers, MoE layers and in-flight counts are integers and first/last "
        "booleans, whose key arithmetic gives the same numbers",
    "shardwise.estimate.goodput.x_checkpoint_timing__mutmut_90": "None for 0.0 where restarts "
        "+ rework is 0: never taken, as the MTBF is finite (≤ 1e12 GPU-hours, validated), so "
        "each interval loses some rework (wall per useful second > 1 + δ/τ)",
    "shardwise.estimate.goodput_sim.x_simulate__mutmut_92": "the rounds' cap 100·(expected "
        "failures + 10) → + 11: a guard; every run ends long before it (the loop stops when "
        "no run is active, and a run that cannot finish is refused first)",
    "shardwise.estimate.uncertainty.x_bands__mutmut_17": "COVERAGES[+1] for COVERAGES[-1]: "
        "the two coverages (0.8, 0.95), so both are the last",
    "shardwise.schedules.render.x_render_ascii__mutmut_20": "min(durations) without a "
        "default: never empty — simulate refuses times ≤ 0 and the runtime's measured events "
        "last > 0, and a timeline without events fails on its label width first",
    "shardwise.runtime.collectives.calls.x_all_to_all_single__mutmut_17": "_nbytes(None) for "
        "a 0-d input on more than one rank: such an input cannot be split along dim 0 and "
        "fails either way (input.shape[0] or the backend's all_to_all_single)",
    "shardwise.partition.x_chunk_span__mutmut_1": "default placement \"XXloopXX\": "
        "virtual_stage treats anything but \"v\" as the loop",
    "shardwise.arch.hf.x__window__mutmut_12": "use_sliding_window's default None for False: "
        "both falsy, read only by `not`",
    "shardwise.partition.x_fixed_or_balanced__mutmut_6": "FIXED[1] for FIXED[0]: the pinned "
        "partition's mark is (-9, -9), both the same",
    "shardwise.partition.x_stage_extremes__mutmut_30": "0 / pp for 0 * pp: the first stage "
        "as 0.0, the same index in every comparison and product of `count`",
    "shardwise.estimate.axes.x__dp_collectives__mutmut_142": "the across-group all-reduce "
        "worked out also when no ZeRO stage ≥ 1 is asked for: only stages 1-3 read it "
        "(np.where(zero == 0, ar, …)), and with `parts` every stage is needed anyway",
    "shardwise.plan.lines.xǁ_Groupsǁmin__mutmut_14": "the per-code minima in float64 for "
        "the line's float32: float64 holds each float32 exactly and the result is float64 "
        "either way (only ufunc.at's loop is slower)",
    "shardwise.plan.lines.x__col_min__mutmut_4": "the column minima without the grid's "
        "dtype: numpy scalars of that dtype make an array of it",
    "shardwise.plan.grid.x__expand__mutmut_640": "the pair count left out of the int32 "
        "choice: 2**31 pairs of 12 fields (100 GB) cannot be enumerated; the pair ids are "
        "below the count",
    "shardwise.plan.evaluate.x__per_pair__mutmut_120": "the (sp, rc) table without "
        "dtype=int64: numpy 2's default integer is int64 on every platform",
    "shardwise.plan.evaluate.x__without_sp__mutmut_25": "splitting off the sp = 0 columns "
        "also when it saves exactly _SPLIT_MIN_CELLS: a speed choice, the same numbers "
        "either way (evaluate_candidates' blocks are elementwise)",
    "shardwise.plan.evaluate.xǁRunGeometriesǁof__mutmut_19": "the second stage geometry "
        "listed twice: the memory grid takes the largest over them, the same",
    "shardwise.plan.evaluate.x_run_shapes__mutmut_18": "dp left out of the rows' shape "
        "key: in one grid dp = GPUs / (tp·pp·cp), and tp, pp and cp are in the key",
    "shardwise.estimate.step.x_step_terms__mutmut_241": "0.0 / t for 0.0 * t without "
        "experts: t is the tp degree (≥ 1), zeros of the same shape either way",
    "shardwise.estimate.memory.x_stage_memory__mutmut_78": "the stage's geometry worked "
        "out again from the same arguments instead of taken: the callers pass "
        "StageGeometry.of's own (distinct_geometries), the same fields",
    **{f"shardwise.estimate.memory.x_peak_stage_total_runs__mutmut_{n}": "np.maximum into "
       "a new array instead of in place: the same values" for n in (159, 162)},
    "shardwise.estimate.geometry.x_stage_layer_count__mutmut_26": "chunk 1's count for "
        "chunk 0's: under the default and Balanced partitions every chunk of a stage holds "
        "as many layers (interleaving needs pp·chunks to divide them; Balanced splits run "
        "one chunk, whose spans any chunk index reads alike)",
    "shardwise.estimate.geometry.x_moe_layers_on_stage__mutmut_2": "default placement "
        "\"LOOP\": virtual_stage treats anything but \"v\" as the loop",
    "shardwise.estimate.expert.x_ep_time__mutmut_294": "0.0 / count for 0.0 * count under "
        "a capacity factor: the count exchange takes time wherever it is added (et·ep > 1); "
        "elsewhere the np.where that follows drops 0/0's nan",
    "shardwise.emit.deepspeed.x_deepspeed_config__mutmut_59": "\"GRADIENT_CLIPPING\" for "
        "\"gradient_clipping\": DeepSpeed 0.19.8 ignores the unknown key and clips at its "
        "default, 1.0 (runtime/constants.py GRADIENT_CLIPPING_DEFAULT), the value written",
    "shardwise.stacks.splits.x_balanced_ends__mutmut_21": "z = 3 tried after every z in "
        "[-2, 2]: no stack's split of 2-129 layers over 2-16 stages is Balanced(a, 3) "
        "without being one of those (searched by hand)",
    "shardwise.schedules.render.x_render_ascii__mutmut_18": "min(durations, default=None): "
        "simulate refuses times that are not > 0, so every timeline has an action of "
        "positive duration and the default is never taken",
    "shardwise.schedules.registry.x__zbv_bubble__mutmut_70": "None for 0.0 where p = 1: "
        "ZBV needs pp ≥ 2, and the step model's np.where(p > 1, …, 0.0) takes 0 wherever "
        "p = 1 (an object array there, the same numbers)",
    "shardwise.estimate.activations.x_activation_bytes_per_layer__mutmut_148": "the blend "
        "also when full_share = 1 or no layer is fully checkpointed: 1·x + 0·y is x, and "
        "where a layer is not checkpointed saved(full) is what it keeps — the same bits",
    "shardwise.estimate.goodput.x__per_param__mutmut_3": "the checkpoint's bytes per "
        "parameter without the grad dtype: it sets only the gradient bytes, which no "
        "checkpoint holds (weight, master and moments alike for every grad dtype, bf16, fp16 "
        "and fp32 × adam and sgd, checked)",
    # memory and geometry, seed 11's samples of 60 (the others of their survivors are killed)
    "shardwise.estimate.memory.xǁMemoryBreakdownǁ_peak_parts__mutmut_27": "default (\"\", "
        "1.0) when no transient runs during the backward: its value is read only under "
        "`if name:`, and its name is \"\"",
    "shardwise.estimate.memory.constant_L291_C23": "_StageParams.weights_fp8's default 1.0 "
        "for 0.0: read only under an FP8 recipe, where `_StageParams.of` sets it",
    "shardwise.estimate.memory.x_training_memory_per_gpu__mutmut_3": "default generation "
        "\"XXhopperXX\": only \"blackwell\" is told apart",
    f"{_G}moe_layers_on_stage__mutmut_1": "default placement \"XXloopXX\": virtual_stage "
                                          "treats anything but \"v\" as the loop",
    f"{_G}param_geometry__mutmut_35": "stage None in the geometry: params() never reads the "
                                      "stage (its callers pass the stages they count)",
    f"{_G}distinct_stages__mutmut_9": "the rows' shape taken as (): the arrays go to "
                                      "_distinct as given, every row's stages worked out "
                                      "without grouping equal rows, the same representatives",
    f"{_G}_unique_rows__mutmut_39": "zip without strict=True: one radix per column",
    f"{_G}_distinct__mutmut_126": "order[k:k + 2] for order[k:k + 1]: take_along_axis(…)[0] "
                                  "reads row k either way",
    # plan, seed 11's sample of 100 (the others of its 8 survivors are killed)
    "shardwise.plan.prune.xǁ_Liveǁneeded__mutmut_57": "None for False into a bool array: "
        "numpy stores None as False",
    "shardwise.plan.evaluate.x__per_pair__mutmut_93": "np.zeros_like(None), an object 0: "
        "the packed codes become Python ints, the same keys, np.unique's same order",
    "shardwise.plan.evaluate.x_cell_terms__mutmut_63": "np.asarray without dtype=float: "
        "every term step_terms returns for the grid's cells is float64 already",
}
