"""In-process emulation of parallelism (SPEC §8, "teaching oracles").

One process holds a list of shards; rank i is index i. No process group, no communication:
each collective is written out step by step so the algorithm can be read and checked exactly
against the unsharded computation.

Teaching code: the numerics it shares with the runtime (SwiGLU, attention blocks and their
merge, MoE routing and dispatch) live in `shardwise.ops`, which both import; nothing in
`runtime/` imports this package.

Design notes: docs/concepts/runtime.md#emulate.
"""
