"""Where a run starts: `check_start` refuses a directory or checkpoint the run cannot use
(another model, dtype, data or schedule; a directory shardwise did not write) with one line.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardwise.errors import ShardwiseError
from shardwise.runtime.checkpoint.directory import _foreign
from shardwise.runtime.checkpoint.manifest import (
    _STEP_DIR,
    _candidates,
    data_fingerprint,
    read_metadata,
    resume_point,
)
from shardwise.runtime.state import (
    TrainConfig,
    json_config,
    schedule_changes,
)


def check_start(config: TrainConfig, report: Callable[[str], None] | None = None
                ) -> Path | None:
    """Where a run of `config` starts: the checkpoint it resumes from, or None (from step 0).

    Refused with one sentence each: a fresh run into a directory that already holds
    checkpoints (it would mix two runs), a checkpoint of another model or dtype or of other
    data settings (sequence length, global batch, seed, data path or its text), one whose
    optimizer schedule this run changes for steps already taken (unless `config.override`
    names the change), one already at `config.steps`, a directory whose checkpoints are all
    damaged, a directory shardwise did not write where this run would save a checkpoint. A
    damaged newest checkpoint is skipped for the newest intact one; `report(line)` (if given)
    hears of each skipped one. Resuming from a directory with no checkpoint yet starts from
    step 0 (the first launch of a job that is relaunched as it is after each failure)."""
    if not config.checkpoint_dir:
        return None
    root = Path(config.checkpoint_dir)
    if not config.resume:
        found = _candidates(root)
        if found:
            raise ShardwiseError(
                f"{config.checkpoint_dir} already holds checkpoints (newest: {found[0].name}); "
                "resume from them (--resume) or choose an empty directory")
        _check_saves(config, root, 0)
        return None
    path, skipped = resume_point(root)
    for line in skipped:
        if report is not None:
            report(f"{line}; resuming from the older {path.name if path else None}")
    if path is None:
        _check_saves(config, root, 0)
        return None
    meta = read_metadata(path)
    if meta["step"] >= config.steps:
        raise ShardwiseError(f"{path} is already at step {meta['step']} of steps="
                             f"{config.steps}; train for more steps to continue")
    _check_compatible(path, meta, config)
    _check_saves(config, root, meta["step"])
    return path


def _check_saves(config: TrainConfig, root: Path, start: int) -> None:
    """No checkpoint this run will save (after step `start`) would replace a directory
    shardwise did not write."""
    if not root.is_dir():
        return
    for entry in root.iterdir():
        m = _STEP_DIR.fullmatch(entry.name)
        if m is None:
            continue
        step = int(m.group(1))
        every = config.checkpoint_every
        if start < step <= config.steps and (step == config.steps or (every and
                                                                      step % every == 0)):
            problem = _foreign(entry)
            if problem:
                raise ShardwiseError(f"this run would save checkpoint {entry.name}, but "
                                     f"{problem}")


def _check_compatible(path: Path, meta: dict[str, Any], config: TrainConfig) -> None:
    """The checkpoint at `path` holds this run's model in its dtype and data settings (the
    layout may differ), and this run takes the steps before it with the same optimizer
    schedule, unless `config.override` names what changes."""
    saved = meta["config"]
    if saved["model"] != json_config(config)["model"]:  # tuples → lists
        raise ShardwiseError(f"{path} holds model {saved['model'].get('name')!r}, not "
                             f"{config.model.name!r} (or with other dimensions); it cannot "
                             "resume this run")
    if saved["dtype"] != config.dtype:
        raise ShardwiseError(f"{path} was trained in {saved['dtype']}, this run in "
                             f"{config.dtype}; use dtype {saved['dtype']}")
    # The data position is the step number: another batch, length, seed or text would
    # silently change which tokens the remaining steps read.
    for key, option in (("seq_len", "--seq"), ("global_batch", "--global-batch"),
                        ("seed", "--seed"), ("data", "--data")):
        if saved[key] != getattr(config, key):
            raise ShardwiseError(f"{path} was trained with {key}={saved[key]!r}, this run has "
                                 f"{getattr(config, key)!r}; resume with {option} "
                                 f"{saved[key]}")
    saved_text = meta.get("data_sha256")
    if saved_text is not None and saved_text != data_fingerprint(config.data):
        what = f"the text of --data {config.data}" if config.data else "the built-in corpus"
        raise ShardwiseError(f"{path} was trained on other text: {what} changed since the "
                             "checkpoint (SHA-256 differs); resume on the original text or "
                             "start a new run in an empty directory")
    changed = [k for k in schedule_changes(saved, config, meta["step"])
               if k not in config.override]
    if changed:
        was = ", ".join(f"{k}={saved.get(k)!r} → {json_config(config)[k]!r}" for k in changed)
        raise ShardwiseError(f"{path} took its {meta['step']} step(s) with another optimizer "
                             f"schedule ({was}); resume with the same settings, or say the "
                             f"change is meant with --override {','.join(changed)}")


