"""Executable parallelism on torch.distributed (SPEC §8): gloo on CPU, NCCL on GPU.

The only package that imports torch.distributed. Modules, one per concern:

    launch            spawn N local ranks / init under torchrun
    mesh              named device mesh (pp, dp, cp, tp; ep inside dp×cp) from a `Layout`
    collectives       the one counted layer all communication goes through; p2p rings
    data_parallel     the gradient reducer: bucketed, hook-driven, overlapped with backward
    zero              ZeRO-1/2/3 over the dp axis
    tensor_parallel   Megatron f/g, column/row-parallel linears, SP, vocab-parallel
    pipeline          the executor of the shared schedule action lists (real send/recv)
    context_parallel  ring attention over the cp axis (exact log-sum-exp merge)
    expert_parallel   MoE with all-to-all dispatch and combine over the ep axis
    model             the single-device Llama-style model (saves exactly SPEC §3's count)
    parallelize       TP/SP → CP → EP → PP → recompute → DP/ZeRO on a mesh, one axis at a time
    parallel_transformer  the training-step object: micro-batches, gradient sync, norm, loss
    train             the training loop (`shardwise train`, or under torchrun)
    data              built-in corpus, byte tokenizer, seeded data-parallel loader
    checkpoint        sharded, layout-independent, atomic checkpoints (DCP); resume anywhere
    measure           what a run saves and moves (`estimate.check` predicts it; SPEC §9)

The numerics shared with `emulate/` come from `shardwise.ops`; nothing here imports
`emulate/` or `demos/` (tests/test_layers.py). Import the submodules directly
(`from shardwise.runtime import collectives as C`).
"""
