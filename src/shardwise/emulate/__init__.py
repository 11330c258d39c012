"""In-process emulation of parallelism (SPEC §8, "teaching oracles").

One process holds a list of shards; rank i is index i. No process group, no communication:
each collective is written out step by step so the algorithm can be read and checked exactly
against the unsharded computation.

    collectives      ring all-reduce (reduce-scatter + all-gather, snapshotted steps)
    data_parallel    data-parallel gradients == the full-batch gradient
    tensor_parallel  Megatron MLP / SwiGLU / head-parallel attention, shard helpers, f and g
    pipeline         micro-batch gradient accumulation == the full-batch gradient
    ring_attention   the ring of online-softmax attention blocks, causal work per layout
    ulysses          all-to-all over heads around ordinary attention (DeepSpeed-Ulysses)
    moe              emulated expert parallelism (all-to-all dispatch and combine)

Teaching code: the numerics it shares with the runtime (SwiGLU, attention blocks and their
merge, MoE routing and dispatch) live in `shardwise.ops`, which both import; nothing in
`runtime/` imports this package.
"""
