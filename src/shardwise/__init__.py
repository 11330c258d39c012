"""shardwise: plan, simulate and run distributed training of Transformer language models.

The analytic side (`arch`, `hardware`, `layout`, `estimate`, `schedules`, `plan`) needs only
NumPy; `runtime` and `emulate` need torch (`pip install shardwise[torch]`). `validate` checks
public arguments (one checker per kind of quantity), `preflight` what a run needs before any
rank starts (writable outputs, sequence length, memory).
"""

from shardwise.arch import PRESETS, ModelSpec, get_model
from shardwise.errors import LayoutError, ShardwiseError
from shardwise.hardware import Cluster
from shardwise.layout import Layout, TrainSpec

__version__ = "0.1.0"
__all__ = ["PRESETS", "Cluster", "Layout", "LayoutError", "ModelSpec", "ShardwiseError",
           "TrainSpec", "get_model"]
