"""ZeRO stages 0–3 over the data-parallel axis (Rajbhandari et al. 2020, "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models").

Modules: `units` (`ZeroConfig`, `UnitSpec`, the flat sharded buffers and their gather,
reduce-scatter and deferred gradients), `engine` (`ZeroDataParallel`: hooks, forward, step).
What each stage keeps, communicates and when: docs/concepts/runtime.md#zero.
"""

from shardwise.runtime.zero.engine import ZeroDataParallel
from shardwise.runtime.zero.units import UnitSpec, ZeroConfig

__all__ = ["UnitSpec", "ZeroConfig", "ZeroDataParallel"]
