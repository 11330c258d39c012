"""The files of a checkpoint without a training run, for tests of the checks on them: what
`save_checkpoint` writes — `MARKER`, DCP's `.metadata` and a shard (a real `dcp.save` of one
4096-element fp32 tensor: `__0_0.distcp`, 16 KiB), `shardwise.json` — and the manifest."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint import save as dcp_save

from shardwise.runtime import checkpoint


def write_checkpoint(path: Path, meta: dict[str, Any], extra: dict[str, bytes] | None = None
                     ) -> Path:
    """`path` made a checkpoint holding `meta` as shardwise.json (and `extra` files)."""
    path.mkdir(parents=True)
    (path / checkpoint.MARKER).write_text("a checkpoint directory written by shardwise\n")
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp_save({"x": torch.arange(4096, dtype=torch.float32)},
                 storage_writer=FileSystemWriter(path), no_dist=True)
    for name, data in (extra or {}).items():
        (path / name).write_bytes(data)
    (path / checkpoint.METADATA).write_text(json.dumps(meta))
    checkpoint.write_manifest(path)
    return path
