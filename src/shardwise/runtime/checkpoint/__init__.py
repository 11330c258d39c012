"""Sharded checkpoints with torch.distributed.checkpoint (DCP): save on one layout, resume on
any other, bit-identically on the same one.

Every tensor is stored as the single-device `Transformer`'s (`model.{name}`,
`optim.{name}.exp_avg|exp_avg_sq|step`, `rng`) next to `shardwise.json` and a SHA-256
manifest; a save is published by one atomic rename. Modules: `manifest` (names, metadata,
checksums, `damage`), `directory` (lock, prune, publish), `start` (`check_start`),
`reshard` (a rank's share as chunks of the full tensors), `save`, `load`.
Design (content, atomicity, ownership, integrity, resume): docs/concepts/runtime.md#checkpoints.
"""

from shardwise.runtime.checkpoint.directory import DirectoryLock, _publish, prune
from shardwise.runtime.checkpoint.load import load_checkpoint, read_parameters
from shardwise.runtime.checkpoint.manifest import (
    DCP_METADATA,
    FORMAT,
    LATEST,
    LOCK,
    MANIFEST,
    MARKER,
    METADATA,
    checkpoint_name,
    complete_checkpoints,
    damage,
    data_fingerprint,
    latest_checkpoint,
    read_metadata,
    resume_point,
    write_manifest,
)
from shardwise.runtime.checkpoint.reshard import _blocks
from shardwise.runtime.checkpoint.save import _start_save, save_checkpoint
from shardwise.runtime.checkpoint.start import check_start

__all__ = ["DCP_METADATA", "FORMAT", "LATEST", "LOCK", "MANIFEST", "MARKER", "METADATA",
           "DirectoryLock", "_blocks", "_publish", "_start_save", "check_start",
           "checkpoint_name", "complete_checkpoints", "damage", "data_fingerprint",
           "latest_checkpoint", "load_checkpoint", "prune", "read_metadata", "read_parameters",
           "resume_point", "save_checkpoint", "write_manifest"]
