"""The multi-process demonstrations behind `shardwise demo NAME` (SPEC §8, §9).

Each `run_*_demo(ranks, …)` starts real ranks (gloo on CPU, or the ranks torchrun started),
runs one parallelism of `shardwise.runtime` next to an independent reference — the
single-device computation, PyTorch's own implementation — and returns rows of checks, each with
an `ok` column (`shardwise demo` exits non-zero when one is False). Modules, one per demo:

    common            dtypes, tolerances, the row of a check
    ring              p2p ring all-reduce vs the backend's            (`demo ring`)
    data_parallel     bucketed DDP vs PyTorch DDP; ZeRO-0..3          (`demo ddp`, `demo zero`)
    tensor_parallel   Megatron TP (+SP) block and vocab-parallel LM   (`demo tp`)
    pipeline          a schedule's action lists on real ranks         (`demo pipeline`)
    context_parallel  ring attention over the cp axis                 (`demo ring-attention`)
    expert_parallel   the expert-parallel MoE layer                   (`demo moe`)

Demos may import `runtime/`, `ops/` and `emulate/`; nothing in `runtime/` imports demos.
"""
