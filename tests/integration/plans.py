"""The 15 kinds of plan of issue 11, the context-parallel kinds of issue 36, the published
uneven pipelines of issue 9 (Llama 3 405B: 126 layers over 16 stages; BLOOM-176B: 70 over 12)
and GPT-NeoX's parallel block, as the `shardwise plan` arguments a user types."""

from pathlib import Path

BLOOM = str(Path(__file__).resolve().parents[1] / "fixtures" / "hf" / "bloom" / "config.json")
PYTHIA = str(Path(__file__).resolve().parents[1] / "fixtures" / "hf" / "pythia-1.4b" /
             "config.json")

PLANS: dict[str, list[str]] = {
    "405b-16k-interleaved": ["llama3-405b", "--gpus", "16384", "--global-batch", "16M-tokens",
                             "--layout", "tp=8,pp=2,zero=1,sp=1,schedule=interleaved,chunks=21,"
                             "recompute=full"],
    "405b-16k-searched": ["llama3-405b", "--gpus", "16384", "--global-batch", "16M-tokens"],
    "8b-default": [],
    "70b-cp16": ["llama3-70b", "--gpus", "256", "--seq", "131072", "--global-batch", "16",
                 "--layout", "tp=8,cp=16,zero=1,sp=1,recompute=full"],
    "mixtral-ep8": ["mixtral-8x7b", "--gpus", "64", "--global-batch", "512",
                    "--layout", "tp=2,ep=8,sp=1,recompute=full"],
    "mixtral-ep8-zero1": ["mixtral-8x7b", "--gpus", "64", "--global-batch", "512",
                          "--layout", "tp=2,ep=8,zero=1,sp=1,recompute=selective"],
    # the dropless top-2 DeepSpeed-MoE launch of issue 43: experts over ep=8, no tp
    "mixtral-ep8-dp64": ["mixtral-8x7b", "--gpus", "64", "--seq", "4096",
                         "--layout", "ep=8,zero=0"],
    "8b-zero3": ["llama3-8b", "--gpus", "64", "--global-batch", "512", "--layout", "zero=3"],
    "8b-hybrid-zero3": ["llama3-8b", "--gpus", "64", "--global-batch", "512",
                        "--layout", "zero=3,zero_group=8"],
    "70b-zbh1-cp": ["llama3-70b", "--gpus", "128", "--global-batch", "256",
                    "--layout", "tp=8,pp=4,cp=2,zero=1,schedule=zb-h1,recompute=full"],
    "8b-gpipe": ["llama3-8b", "--gpus", "32", "--global-batch", "256",
                 "--layout", "tp=2,pp=4,zero=1,schedule=gpipe"],
    "8b-fp16": ["llama3-8b", "--gpus", "16", "--global-batch", "128", "--dtype", "fp16",
                "--layout", "tp=2,zero=1,recompute=selective"],
    "gpt3-1.3b-zero3": ["gpt3-1.3b", "--gpus", "16", "--seq", "2048", "--global-batch", "512",
                        "--layout", "zero=3"],
    "175b-a100-noflash": ["gpt3-175b", "--gpu", "a100", "--gpus", "1024", "--seq", "2048",
                          "--global-batch", "1536", "--no-flash",
                          "--layout", "tp=8,pp=16,zero=1,sp=1,recompute=full"],
    "70b-tp8-cp8-zero3g4": ["llama3-70b", "--gpus", "256", "--seq", "65536", "--global-batch",
                            "32", "--layout", "tp=8,cp=8,zero=3,zero_group=4,sp=1,"
                            "recompute=full"],
    "70b-tp8-pp2-zero3": ["llama3-70b", "--gpus", "64", "--global-batch", "256",
                          "--layout", "tp=8,pp=2,zero=3,sp=1,recompute=selective"],
    # uneven stages: 7, 8 × 14, 7 (Llama 3 paper §3.3; the default, and given explicitly)
    # and 5, 6 × 10, 5 (BLOOM); where the default is not the stack's split, a layout without
    # stages takes the stack's (DeepSpeed's 8 × 14, 7, 7)
    "405b-8k-pp16": ["llama3-405b", "--gpus", "8192", "--global-batch", "16M-tokens",
                     "--layout", "tp=8,pp=16,zero=1,sp=1,recompute=full"],
    "405b-16k-pp16": ["llama3-405b", "--gpus", "16384", "--global-batch", "16M-tokens",
                      "--layout", "tp=8,pp=16,zero=1,sp=1,recompute=full",
                      "--first-stage-layers", "7", "--last-stage-layers", "7"],
    # uneven and interleaved (Megatron's rule: each stage's layers split evenly over its 2
    # chunks): 80 layers as 12, 14 × 4, 12
    "70b-pp6-uneven-interleaved": ["llama3-70b", "--gpus", "96", "--global-batch", "96",
                                   "--layout", "tp=8,pp=6,sp=1,schedule=interleaved,chunks=2,"
                                   "recompute=full", "--first-stage-layers", "12",
                                   "--last-stage-layers", "12"],
    # context parallelism by all-to-all over heads: Ulysses (8 kv heads / tp 2 = 4 per rank
    # over cp 4), and the hybrid, all-to-all inside the node's 4 cp ranks, ring across 4 nodes
    "8b-ulysses": ["llama3-8b", "--gpus", "16", "--seq", "32768", "--global-batch", "32",
                   "--layout", "tp=2,cp=4,cp_kind=ulysses,zero=1,recompute=selective"],
    "8b-hybrid-cp": ["llama3-8b", "--gpus", "32", "--seq", "65536", "--global-batch", "16",
                     "--layout", "tp=2,cp=16,cp_kind=hybrid,ulysses=4,zero=1,recompute=full"],
    "bloom-pp12": [BLOOM, "--gpu", "a100", "--gpus", "384", "--seq", "2048",
                   "--global-batch", "2048", "--layout", "tp=4,pp=12,zero=1,recompute=full"],
    # GPT-NeoX's block: attention and MLP side by side (use_parallel_residual)
    "pythia-parallel-residual": [PYTHIA, "--gpus", "16", "--seq", "2048", "--global-batch",
                                 "256", "--layout", "tp=2,zero=1"],
}

# What each framework does with each plan (issue 33's acceptance, `--emit F` on F's stack):
# None — accepted, every planned value read back by the framework (test_megatron*,
# test_torchtitan, test_deepspeed); otherwise (a phrase of the one-line refusal, the
# refusal kind whose framework code test_refusals.py runs to confirm it).
ACCEPTED = None
EXPECTED: dict[str, dict[str, tuple[str, str] | None]] = {
    "405b-16k-interleaved": {"megatron": ACCEPTED,
                             "torchtitan": ("Float8", "torchtitan-405b-float8"),
                             "deepspeed": ("no interleaved", "deepspeed-1f1b-or-zbh1")},
    "405b-16k-searched": {"megatron": ACCEPTED,
                          "torchtitan": ("Float8", "torchtitan-405b-float8"),
                          "deepspeed": ACCEPTED},
    "8b-default": {"megatron": ACCEPTED, "torchtitan": ACCEPTED, "deepspeed": ACCEPTED},
    "70b-cp16": {"megatron": ACCEPTED,
                 "torchtitan": ("all-gather of K/V", "torchtitan-cp-allgather"),
                 "deepspeed": ("Ulysses", "deepspeed-ulysses-alone")},
    "mixtral-ep8": {"megatron": ACCEPTED,
                    "torchtitan": ("ships no mixtral-8x7b", "torchtitan-models"),
                    "deepspeed": ("sequence parallelism makes distinct", "deepspeed-moe-sp")},
    "mixtral-ep8-zero1": {"megatron": ACCEPTED,
                          "torchtitan": ("ships no mixtral-8x7b", "torchtitan-models"),
                          "deepspeed": ("sequence parallelism makes distinct",
                                        "deepspeed-moe-sp")},
    "mixtral-ep8-dp64": {"megatron": ACCEPTED,
                         "torchtitan": ("ships no mixtral-8x7b", "torchtitan-models"),
                         "deepspeed": ACCEPTED},
    "8b-zero3": {"megatron": ACCEPTED, "torchtitan": ACCEPTED, "deepspeed": ACCEPTED},
    "8b-hybrid-zero3": {"megatron": ACCEPTED, "torchtitan": ACCEPTED,
                        "deepspeed": ("cannot shard ZeRO-3 in groups", "deepspeed-no-groups")},
    "70b-zbh1-cp": {"megatron": ("no zb-h1", "megatron-schedules"),
                    "torchtitan": ("no zb-h1", "torchtitan-zbh1"),
                    "deepspeed": ("without tensor and pipeline parallelism",
                                  "deepspeed-ulysses-alone")},
    "8b-gpipe": {"megatron": ("no gpipe", "megatron-schedules"),
                 "torchtitan": ("no ZeRO-1", "torchtitan-no-zero1"),
                 "deepspeed": ("no gpipe", "deepspeed-1f1b-or-zbh1")},
    "8b-fp16": {"megatron": ACCEPTED,
                "torchtitan": ("does not train in fp16", "torchtitan-dtypes"),
                "deepspeed": ACCEPTED},
    "gpt3-1.3b-zero3": {"megatron": ACCEPTED,
                        "torchtitan": ("ships no gpt3-1.3b", "torchtitan-models"),
                        "deepspeed": ACCEPTED},
    "175b-a100-noflash": {"megatron": ("pads 50257 to 50264", "megatron-vocab"),
                          "torchtitan": ("fused attention kernel (flex)", "torchtitan-flex"),
                          "deepspeed": ("pads 50257 to 50264", "megatron-vocab")},
    "70b-tp8-cp8-zero3g4": {"megatron": ACCEPTED,
                            "torchtitan": ("all-gather of K/V", "torchtitan-cp-allgather"),
                            "deepspeed": ("Ulysses", "deepspeed-ulysses-alone")},
    "70b-tp8-pp2-zero3": {"megatron": ACCEPTED,
                          "torchtitan": ("no selective recompute", "torchtitan-recompute"),
                          "deepspeed": ("asserts ZeRO < 2", "deepspeed-zero-pp")},
    "405b-8k-pp16": {"megatron": ACCEPTED,
                     "torchtitan": ("Float8", "torchtitan-405b-float8"),
                     "deepspeed": ACCEPTED},
    "405b-16k-pp16": {"megatron": ACCEPTED,
                      "torchtitan": ("Float8", "torchtitan-405b-float8"),
                      "deepspeed": ("cannot split 126 layers", "deepspeed-split")},
    "70b-pp6-uneven-interleaved": {"megatron": ACCEPTED,
                                   "torchtitan": ("cannot split 80 layers", "torchtitan-split"),
                                   "deepspeed": ("no interleaved", "deepspeed-1f1b-or-zbh1")},
    "bloom-pp12": {"megatron": ("ALiBi", "megatron-positions"),
                   "torchtitan": ("ships no bloom", "torchtitan-models"),
                   "deepspeed": ("ALiBi", "deepspeed-positions")},
    "pythia-parallel-residual": {"megatron": ("side by side", "megatron-parallel-residual"),
                                 "torchtitan": ("ships no pythia", "torchtitan-models"),
                                 "deepspeed": ("side by side", "deepspeed-parallel-residual")},
    "8b-ulysses": {"megatron": ACCEPTED,
                   "torchtitan": ("all-gather of K/V", "torchtitan-cp-allgather"),
                   "deepspeed": ("without tensor and pipeline parallelism",
                                 "deepspeed-ulysses-alone")},
    "8b-hybrid-cp": {"megatron": ACCEPTED,
                     "torchtitan": ("all-gather of K/V", "torchtitan-cp-allgather"),
                     "deepspeed": ("Ulysses", "deepspeed-ulysses-alone")},
}

# Further Megatron-LM runs issue 33 names: fp16 with ZeRO-3 (Megatron-FSDP trains fp16;
# only --use-torch-fsdp2 refuses it), a partition whose middle stages differ (an explicit
# --pipeline-model-parallel-layout) and ZeRO-2 in shard groups (Megatron-FSDP's HSDP).
MEGATRON_EXTRA: dict[str, list[str]] = {
    # context parallelism by all-gathered K/V (Llama 3's kind; --cp-comm-type all_gather)
    "70b-cp8-allgather": ["llama3-70b", "--gpus", "128", "--seq", "65536", "--global-batch",
                          "16", "--layout", "tp=8,cp=8,cp_kind=allgather,zero=1,sp=1,"
                          "recompute=full"],
    "8b-fp16-zero3": ["llama3-8b", "--gpus", "16", "--global-batch", "128", "--dtype", "fp16",
                      "--layout", "tp=2,zero=3"],
    "8b-pp4-7-9-8-8": ["llama3-8b", "--gpus", "32", "--global-batch", "256",
                       "--layout", "tp=2,pp=4,zero=1", "--partition", "7,9,8,8"],
    "8b-hybrid-zero2": ["llama3-8b", "--gpus", "64", "--global-batch", "512",
                        "--layout", "zero=2,zero_group=8"],
    "8b-fp32-grads-overlap": ["llama3-8b", "--gpus", "16", "--global-batch", "128",
                              "--grad-dtype", "fp32", "--dp-overlap", "--tp-overlap", "bulk",
                              "--layout", "tp=2,sp=1,zero=1"],
}
