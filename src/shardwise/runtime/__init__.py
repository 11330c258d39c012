"""Executable parallelism on torch.distributed (SPEC §8): gloo on CPU, NCCL on GPU.

The numerics shared with `emulate/` come from `shardwise.ops`; nothing here imports
`emulate/` or `demos/` (tests/test_layers.py). Import the submodules directly
(`from shardwise.runtime import collectives as C`).

Design notes: docs/concepts/runtime.md#runtime.
"""
