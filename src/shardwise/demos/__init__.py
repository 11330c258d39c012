"""The multi-process demonstrations behind `shardwise demo NAME` (SPEC §8, §9).

Demos may import `runtime/`, `ops/` and `emulate/`; nothing in `runtime/` imports demos.

Design notes: docs/concepts/runtime.md#demos.
"""
