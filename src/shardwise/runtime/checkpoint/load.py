"""`load_checkpoint` (resume, on any layout, falling back to an older checkpoint when DCP
cannot load the newest) and `read_parameters` (the single-device weights, one process).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from shardwise.errors import ShardwiseError
from shardwise.runtime import launch
from shardwise.runtime.checkpoint.manifest import (
    MANIFEST,
    METADATA,
    damage,
    read_metadata,
    resume_point,
)
from shardwise.runtime.checkpoint.reshard import _adamw_zeros, _state_dict, _stepped
from shardwise.runtime.checkpoint.save import _errors
from shardwise.runtime.checkpoint.start import _check_compatible
from shardwise.runtime.mixed_precision import MasterOptimizer
from shardwise.runtime.state import (
    TrainConfig,
    TrainState,
)


def load_checkpoint(state: TrainState, directory: str | Path,
                    report: Callable[[str], None] | None = None) -> bool:
    """Load the newest intact checkpoint in `directory` (or the checkpoint `directory`
    itself) into `state`, a freshly `build`-ed state on any layout, in place. Collective.
    Returns False (and leaves `state` as built) when there is no checkpoint. A checkpoint
    that passes `damage` but that DCP then fails to load is damage like any other: the next
    older intact one is loaded instead (`report(line)`, on rank 0, hears of it); raises
    `ShardwiseError` on every rank when none loads or the checkpoint does not fit."""
    failed: list[Path] = []
    while True:
        found: tuple[str | None, str | None] = (None, None)  # (path, error)
        if launch.rank() == 0:  # rank 0 verifies; every rank reads the same checkpoint
            found = _choose(Path(directory), state.config, tuple(failed))
        path, error = launch.from_rank0(found)
        if error is not None:
            raise ShardwiseError(error)
        if path is None:
            return False
        problem = launch.first_problem(_load(state, Path(path)))
        if problem is None:
            return True
        failed.append(Path(path))
        if report is not None and launch.rank() == 0:
            report(f"checkpoint {path} cannot be loaded ({problem}); trying an older one")


def _choose(given: Path, config: TrainConfig, failed: tuple[Path, ...]
            ) -> tuple[str | None, str | None]:
    """Rank 0: (the checkpoint to load, None), (None, None) for none, or (None, why not)."""
    try:
        if (given / METADATA).is_file() or (given / MANIFEST).is_file():  # one checkpoint
            problem = "DCP could not load it" if given in failed else damage(given)
            if problem:
                raise ShardwiseError(f"checkpoint {given} is damaged: {problem}")
            path: Path | None = given
        else:
            path, _ = resume_point(given, skip=failed)
            if path is None and failed:
                raise ShardwiseError(f"no checkpoint in {given} loads: "
                                     f"{', '.join(map(str, failed))} failed")
        if path is not None:
            _check_compatible(path, read_metadata(path), config)
        return (None if path is None else str(path)), None
    except ShardwiseError as exc:
        return None, str(exc)


def _load(state: TrainState, path: Path) -> str | None:
    """Load checkpoint `path` into `state` (this rank's share); None, or why it failed."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load

    meta = read_metadata(path)
    stepped = _stepped(state)
    mixed = isinstance(state.optimizer, MasterOptimizer)
    moments = [_adamw_zeros(p) | ({"master": torch.empty_like(p)} if mixed else {})
               for p in stepped]  # loaded into
    content = _state_dict(state, moments)
    content["rng"] = torch.get_rng_state()
    try:
        dcp_load(content, storage_reader=FileSystemReader(path),
                 no_dist=not dist.is_initialized())
    except (Exception, CheckpointException) as exc:  # I/O, unpickling; DCP's is a BaseException
        first = _errors(exc)[-1]
        text = str(first).strip().splitlines()
        return f"{type(first).__name__}: {text[0] if text else ''}"[:300]
    if mixed:  # the fp32 masters; the bf16 weights came with `model.*` (their rounding)
        with torch.no_grad():
            for moment, master in zip(moments, stepped):
                master.copy_(moment.pop("master"))
    adamw = state.optimizer.optimizer if mixed else state.optimizer
    adamw.load_state_dict({"state": dict(enumerate(moments)),
                           "param_groups": adamw.state_dict()["param_groups"]})
    torch.set_rng_state(content["rng"])
    state.rng = content["rng"]
    state.step = int(meta["step"])
    return None


def read_parameters(path: str | Path) -> dict[str, torch.Tensor]:
    """The single-device parameters of checkpoint `path`, in this process (no process group
    needed): what a single-device `Transformer` would load."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load

    reader = FileSystemReader(path)
    saved = reader.read_metadata().state_dict_metadata
    out = {key: torch.empty(md.size, dtype=md.properties.dtype) for key, md in saved.items()
           if key.startswith("model.")}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp_load(out, storage_reader=reader, no_dist=True)
    return {key.removeprefix("model."): t for key, t in out.items()}

