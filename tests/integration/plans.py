"""The 15 kinds of plan of issue 11, the context-parallel kinds of issue 36, and the published uneven pipelines of issue 9 (Llama 3
405B: 126 layers over 16 stages; BLOOM-176B: 70 over 12), as the `shardwise plan` arguments a
user types."""

from pathlib import Path

BLOOM = str(Path(__file__).resolve().parents[1] / "fixtures" / "hf" / "bloom" / "config.json")

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
    # uneven stages: 7, 8 × 14, 7 (Llama 3 paper §3.3) and 5, 6 × 10, 5 (BLOOM)
    "405b-8k-pp16": ["llama3-405b", "--gpus", "8192", "--global-batch", "16M-tokens",
                     "--layout", "tp=8,pp=16,zero=1,sp=1,recompute=full"],
    "405b-16k-pp16": ["llama3-405b", "--gpus", "16384", "--global-batch", "16M-tokens",
                      "--layout", "tp=8,pp=16,zero=1,sp=1,recompute=full"],
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
}
