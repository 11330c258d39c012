"""Torch numerics shared by the runtime (`shardwise.runtime`) and the teaching oracles
(`shardwise.emulate`): autograd functions and kernels with no process group and no
communication. `runtime/` imports these, never `emulate/`; nothing here imports either.

    swiglu     SwiGLU saving only its two inputs (SPEC §3)
    attention  sequence layouts, causal block plans, one block's forward/backward, LSE merge
    moe        routing, capacity, load-balancing loss, dispatch plan, gather/combine, experts
"""
