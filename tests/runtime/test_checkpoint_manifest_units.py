"""The checkpoint manifest's pure parts in one process, against hashlib and hand-written
directories: names, ordering (numeric, past six digits), the metadata checks one by one, the
manifest's SHA-256 of a file several hash chunks long and damage found in its last chunk,
and the data fingerprint of a text larger than the hash chunk."""

from __future__ import annotations

import hashlib
import json

import pytest

pytest.importorskip("torch")

from shardwise.errors import ShardwiseError
from shardwise.runtime.checkpoint import manifest as m


def _meta(**over):
    meta = {"format": m.FORMAT, "step": 12, "world_size": 4,
            "config": {"model": {}, "dtype": "bf16", "seq_len": 64, "global_batch": 8,
                       "seed": 0, "data": None}}
    for key, value in over.items():
        if key.startswith("config_"):
            meta["config"][key.removeprefix("config_")] = value
        else:
            meta[key] = value
    return meta


def _checkpoint(root, step: int, meta=None):
    path = root / m.checkpoint_name(step)
    path.mkdir()
    (path / m.MARKER).write_text("")
    (path / m.METADATA).write_text(json.dumps(meta or _meta(step=step)))
    return path


def test_names_and_the_order_of_complete_checkpoints(tmp_path):
    assert m.checkpoint_name(7) == "step-000007"
    assert m.checkpoint_name(1_234_567) == "step-1234567"
    for step in (1_000_000, 9, 10, 200):
        _checkpoint(tmp_path, step)
    (tmp_path / "step-000300").mkdir()  # not ours: no marker
    unfinished = tmp_path / "step-000400.tmp-0123456789abcdef0123456789abcdef"
    unfinished.mkdir()
    (unfinished / m.MARKER).write_text("")
    no_meta = tmp_path / "step-000500"
    no_meta.mkdir()
    (no_meta / m.MARKER).write_text("")
    found = m.complete_checkpoints(tmp_path)
    assert [p.name for p in found] == ["step-000009", "step-000010", "step-000200",
                                       "step-1000000"]
    assert m.latest_checkpoint(tmp_path).name == "step-1000000"
    assert m.complete_checkpoints(tmp_path / "absent") == []
    assert m.latest_checkpoint(tmp_path / "absent") is None


@pytest.mark.parametrize(("meta", "problem"), [
    ([1], "shardwise.json holds a list, not an object"),
    ({k: v for k, v in _meta().items() if k != "world_size"}, "has no 'world_size'"),
    (_meta(step="3"), "step is '3', not an integer"),
    (_meta(step=True), "step is True, not an integer"),
    (_meta(config_seq_len=None), "config.seq_len is None, not an integer"),
    (_meta(config_dtype=2), "config.dtype is 2, not of type <class 'str'>"),
    (_meta(format=m.FORMAT + 1), f"is of format {m.FORMAT + 1}; this version of shardwise "
                                 f"reads format {m.FORMAT}"),
    (_meta(step=-1), "step -1 or world_size 4 is invalid"),
    (_meta(world_size=0), "step 12 or world_size 0 is invalid"),
])
def test_each_metadata_problem_is_named(tmp_path, meta, problem):
    assert problem in m._metadata_problem(meta)
    path = tmp_path / "c"
    path.mkdir()
    (path / m.METADATA).write_text(json.dumps(meta))
    with pytest.raises(ShardwiseError, match=f"^checkpoint {path}: "):
        m.read_metadata(path)


def test_valid_metadata_reads_back(tmp_path):
    assert m._metadata_problem(_meta()) is None
    assert m._metadata_problem(_meta(step=0, world_size=1, config_data="corpus.txt")) is None
    path = _checkpoint(tmp_path, 12)
    assert m.read_metadata(path) == _meta()


def test_manifest_hashes_files_longer_than_the_chunk_and_finds_late_damage(tmp_path):
    assert m.HASH_CHUNK == 1 << 20
    path = _checkpoint(tmp_path, 12)
    big = bytes(range(256)) * ((3 * m.HASH_CHUNK + 1234) // 256)  # three chunks and a bit
    (path / "__0_0.distcp").write_bytes(big)
    (path / "sub").mkdir()
    (path / "sub" / "x.bin").write_bytes(b"abc")
    (path / m.DCP_METADATA).write_bytes(b"not read: the checksums fail first")
    m.write_manifest(path)
    files = json.loads((path / m.MANIFEST).read_text())["files"]
    assert files["__0_0.distcp"] == {"bytes": len(big),
                                     "sha256": hashlib.sha256(big).hexdigest()}
    assert files["sub/x.bin"]["sha256"] == hashlib.sha256(b"abc").hexdigest()
    assert m.MANIFEST not in files and {m.MARKER, m.METADATA} <= set(files)
    # one byte changed in the last chunk, the size kept
    damaged = bytearray(big)
    damaged[-5] ^= 0xFF
    (path / "__0_0.distcp").write_bytes(bytes(damaged))
    assert m._sha256(path / "__0_0.distcp") == hashlib.sha256(bytes(damaged)).hexdigest()
    assert m.damage(path) == ("__0_0.distcp fails its SHA-256 checksum (bytes changed since "
                              "the save)")
    (path / "__0_0.distcp").write_bytes(big[:-1])
    assert m.damage(path) == (f"__0_0.distcp is {len(big) - 1} bytes, {len(big)} when saved "
                              "(truncated or overwritten)")
    (path / "__0_0.distcp").write_bytes(big)
    (path / "extra").write_bytes(b"")
    assert m.damage(path) == "extra is not in its manifest (added or renamed since the save)"
    # a manifest naming a file outside the checkpoint is refused
    (path / m.MANIFEST).write_text(json.dumps({"files": {"../x": {"bytes": 1, "sha256": ""}}}))
    assert "outside the checkpoint" in m.damage(path)


def test_data_fingerprint_reads_past_the_first_chunk(tmp_path):
    text = tmp_path / "corpus.txt"
    body = b"a" * (m.HASH_CHUNK + 10)
    text.write_bytes(body)
    assert m.data_fingerprint(str(text)) == hashlib.sha256(body).hexdigest()
    text.write_bytes(body[:-1] + b"b")  # the change is past the first chunk
    assert m.data_fingerprint(str(text)) == hashlib.sha256(body[:-1] + b"b").hexdigest()
    assert m.data_fingerprint(str(tmp_path / "absent")) is None
    assert m.data_fingerprint(str(tmp_path)) is None  # a directory is not read
    assert len(m.data_fingerprint(None)) == 64


# ------------------------------------------------- starting a save and a run (one process)
def _config(tmp_path, **kw):
    from shardwise.arch import get_model
    from shardwise.layout import Layout
    from shardwise.runtime.state import TrainConfig

    fields = {"steps": 10, "seq_len": 32, "global_batch": 8, "dtype": "fp64",
              "checkpoint_dir": str(tmp_path), "checkpoint_every": 4} | kw
    return TrainConfig(get_model("tiny"), Layout(dp=2), **fields)


def test_a_save_starts_in_a_fresh_marked_directory_and_clears_leftovers(tmp_path):
    from shardwise.runtime.checkpoint.save import _start_save

    leftover = tmp_path / "run" / "step-000002.tmp-0123456789abcdef0123456789abcdef"
    leftover.mkdir(parents=True)
    (leftover / m.MARKER).write_text("")
    name, failure = _start_save(tmp_path / "run" / "step-000003")
    assert failure is None and not leftover.exists()
    tmp = tmp_path / "run" / name.rsplit("/", 1)[-1]
    assert m._OUR_TMP.fullmatch(tmp.name) and tmp.name.startswith("step-000003.tmp-")
    assert (tmp / m.MARKER).is_file()
    _, failure = _start_save(tmp_path / "a" / "b" / "step-000001")  # parents made
    assert failure is None and (tmp_path / "a" / "b").is_dir()
    (tmp_path / "run" / "step-000005").mkdir()  # not ours
    name, failure = _start_save(tmp_path / "run" / "step-000005")
    assert name is None and failure.startswith(f"cannot save checkpoint {tmp_path}/run/"
                                               "step-000005: ")


def test_the_lock_makes_its_directory(tmp_path):
    from shardwise.runtime.checkpoint.directory import DirectoryLock

    with DirectoryLock(tmp_path / "x" / "y") as lock:
        assert lock.held and (tmp_path / "x" / "y" / m.LOCK).is_file()
    assert not (tmp_path / "x" / "y" / m.LOCK).exists()


def test_saves_this_run_would_make_are_checked_for_foreign_directories(tmp_path):
    """steps 10, every 4, resuming at step 4: it saves steps 8 and 10 — a directory there
    that shardwise did not write is refused; one at 2 (before), 9 (not a save) or 12 (after
    the run) is not."""
    from shardwise.runtime.checkpoint.start import _check_saves

    cfg = _config(tmp_path)
    for step in (2, 9, 12):
        (tmp_path / m.checkpoint_name(step)).mkdir()
    _check_saves(cfg, tmp_path, 4)
    for step in (8, 10):
        (tmp_path / m.checkpoint_name(step)).mkdir()
        with pytest.raises(ShardwiseError, match=f"would save checkpoint step-0000{step:02d}"):
            _check_saves(cfg, tmp_path, 4)
        (tmp_path / m.checkpoint_name(step)).rmdir()


@pytest.mark.parametrize(("key", "value", "option"), [
    ("seq_len", 64, "--seq 32"), ("global_batch", 16, "--global-batch 8"),
    ("seed", 7, "--seed 0"), ("data", "other.txt", "--data None")])
def test_a_resume_names_the_option_that_restores_the_data(tmp_path, key, value, option):
    from shardwise.runtime.checkpoint.start import _check_compatible
    from shardwise.runtime.state import json_config

    saved = _config(tmp_path)
    meta = {"format": m.FORMAT, "step": 4, "world_size": 2, "config": json_config(saved)}
    changed = _config(tmp_path, **{key: value})
    with pytest.raises(ShardwiseError, match=f"; resume with {option}$"):
        _check_compatible(tmp_path, meta, changed)
    # the text itself: the built-in corpus named as such
    meta["data_sha256"] = "0" * 64
    with pytest.raises(ShardwiseError, match="other text: the built-in corpus changed"):
        _check_compatible(tmp_path, meta, saved)


def test_a_failed_save_is_one_line_with_its_cause(tmp_path):
    """The per-rank failures of a DCP error and their causes are searched: a full disk (ENOSPC
    anywhere in the chain) says so; another OS error names its reason and file; anything else
    its type and first line; the previous checkpoint is named as kept."""
    import errno

    from shardwise.runtime.checkpoint.save import _errors, _save_failure

    class Dcp(Exception):
        def __init__(self, failures):
            super().__init__("checkpoint failed")
            self.failures = failures

    full = OSError(errno.ENOSPC, "No space left on device", "x.distcp")
    denied = OSError(errno.EACCES, "Permission denied", "y.distcp")
    try:
        try:
            raise denied
        except OSError as inner:
            raise Dcp({1: (full, "trace")}) from inner
    except Dcp as exc:
        chain = _errors(exc)
    assert chain[0].args == ("checkpoint failed",) and full in chain and denied in chain
    assert len(chain) == len({id(e) for e in chain})  # each once
    previous = _checkpoint(tmp_path, 4)
    final = tmp_path / m.checkpoint_name(8)
    line = _save_failure(Dcp({0: full}), final)
    assert line.startswith("no space left on device ") and f"saving checkpoint {final}" in line
    assert f"the previous checkpoint {previous} is kept" in line
    line = _save_failure(denied, final)
    assert line == (f"cannot save checkpoint {final}: Permission denied (y.distcp); the "
                    f"previous checkpoint {previous} is kept")
    line = _save_failure(ValueError("bad\nsecond line"), tmp_path / "empty" / "step-000001")
    assert line.endswith(": ValueError: bad; no checkpoint kept")


def test_adamw_state_before_the_first_step_is_torchs():
    """What torch.optim.AdamW creates lazily: a 0-d fp32 step and zero moments like p."""
    import torch

    from shardwise.runtime.checkpoint.reshard import _adamw_zeros

    p = torch.nn.Parameter(torch.ones(3, 2, dtype=torch.float64))
    zeros = _adamw_zeros(p)
    opt = torch.optim.AdamW([p], foreach=False)
    p.grad = torch.zeros_like(p)
    opt.step()
    real = opt.state[p]
    assert set(zeros) == set(real) == {"step", "exp_avg", "exp_avg_sq"}
    for key in ("exp_avg", "exp_avg_sq"):
        assert zeros[key].dtype == real[key].dtype and zeros[key].shape == real[key].shape
        assert not zeros[key].any()
    assert zeros["step"].dtype == real["step"].dtype and zeros["step"].shape == ()
    assert float(zeros["step"]) == 0.0 and float(real["step"]) == 1.0
