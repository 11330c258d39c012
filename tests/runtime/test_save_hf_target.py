"""`shardwise train --save-hf DIR` into a folder that already holds a checkpoint (issue 47,
item 3): the old checkpoint is replaced as a whole, never left beside the new one (an index
next to a `model.safetensors` is a folder every reader refuses), and the folder's other files
stay; a folder that cannot be replaced so is refused in one line before any rank starts.

References: the weights transformers' own `from_pretrained` reads from the source folders the
test wrote with `save_pretrained` (two models, so the new content is told from the old), and
the files the test put in the folder.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tests.cli_helpers import shardwise

from shardwise.arch import from_hf_config
from shardwise.errors import ShardwiseError
from shardwise.runtime import hf, hf_target

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

INDEX = "model.safetensors.index.json"
SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
TOKENIZER = b'{"a tokenizer the user keeps": true}'


def _source(where: Path, seed: int) -> Path:
    """A tiny Llama as transformers saves it (config.json + model.safetensors)."""
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=256, max_position_embeddings=64)
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).save_pretrained(where, safe_serialization=True)
    return where


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _save_hf(src: Path, out: Path, *layout: str):
    return shardwise("train", "--model", str(src), "--steps", "0", "--seq", "16",
                     "--global-batch", "4", "--dtype", "fp32", "--quiet", "--save-hf", str(out),
                     *layout, check=False)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_save_hf_replaces_a_sharded_checkpoint_and_back(tmp_path):
    first, second = _source(tmp_path / "first", 0), _source(tmp_path / "second", 1)
    want_first, want_second = _weights(first), _weights(second)
    assert not _same(want_first, want_second)
    out = tmp_path / "out"
    run = _save_hf(first, out, "--pp", "2")  # two stages: an index and two shards
    assert run.returncode == 0, run.stderr
    assert sorted(hf_target.held_checkpoint(out)) == sorted([INDEX, *SHARDS])
    (out / "tokenizer.json").write_bytes(TOKENIZER)

    run = _save_hf(second, out)  # one stage: model.safetensors
    assert run.returncode == 0, run.stderr
    assert hf_target.held_checkpoint(out) == ["model.safetensors"]  # no stale index or shard
    assert hf.hf_weight_files(out) == [out / "model.safetensors"]  # the reader takes it
    hf.check_hf_weights(from_hf_config(out), out)
    assert _same(_weights(out), want_second)
    assert (out / "tokenizer.json").read_bytes() == TOKENIZER
    assert sorted(p.name for p in tmp_path.iterdir()) == ["first", "out", "second"]

    run = _save_hf(first, out, "--pp", "2")  # and back: the single file goes
    assert run.returncode == 0, run.stderr
    assert sorted(hf_target.held_checkpoint(out)) == sorted([INDEX, *SHARDS])
    assert hf.hf_weight_files(out) == [out / s for s in SHARDS]
    assert _same(_weights(out), want_first)
    assert (out / "tokenizer.json").read_bytes() == TOKENIZER
    assert sorted(p.name for p in tmp_path.iterdir()) == ["first", "out", "second"]


def test_a_folder_that_cannot_be_swapped_is_refused_before_any_rank(tmp_path, monkeypatch,
                                                                   capsys):
    """A --save-hf folder holding a checkpoint on a mount point (renaming it would fail after
    the training): one line naming what is there and what to do, exit 2, no rank started,
    the folder untouched."""
    from shardwise.cli import main
    from shardwise.runtime import train

    src = _source(tmp_path / "src", 0)
    out = tmp_path / "out"
    _source(out, 1)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real_ismount = os.path.ismount
    monkeypatch.setattr(os.path, "ismount",
                        lambda p: Path(p) == out.resolve() or real_ismount(p))

    def no_rank(*args, **kwargs):
        raise AssertionError("a rank was launched")

    monkeypatch.setattr(train.launch, "launch", no_rank)
    capsys.readouterr()  # transformers' progress bars while the test wrote the folders
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--model", str(src), "--steps", "1", "--seq", "16", "--global-batch",
              "2", "--save-hf", str(out)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: --save-hf ") and str(out) in lines[0]
    assert "model.safetensors" in lines[0] and "mount point" in lines[0]
    assert "remove those files from it or choose another folder" in lines[0]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_the_target_check_names_what_the_folder_holds(tmp_path):
    """`check_save_target` on its own: nothing to replace, or a replaceable folder, passes;
    a sharded one on a mount point names its index and shard count."""
    hf_target.check_save_target(tmp_path / "missing")
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("no weights here")
    hf_target.check_save_target(tmp_path / "plain")
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    for name in (INDEX, *SHARDS):
        (sharded / name).write_bytes(b"")
    hf_target.check_save_target(sharded)  # its parent is writable: it will be swapped
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os.path, "ismount", lambda p: Path(p) == sharded.resolve())
        with pytest.raises(ShardwiseError, match=f"{INDEX} and 2 safetensors files.*mount"):
            hf_target.check_save_target(sharded)


def test_publish_swaps_in_the_new_set_and_keeps_the_other_files(tmp_path):
    """The swap on its own, over files the test wrote: the old index, every file it names
    (whatever their names) and the old single file go; the new files, the folder's other
    files and folders, and its permissions stay; nothing is left beside it."""
    out = tmp_path / "out"
    (out / "extra").mkdir(parents=True)
    out.chmod(0o750)
    old = {"weights-a.safetensors": b"a", "weights-b.safetensors": b"b"}
    for name, data in old.items():
        (out / name).write_bytes(data)
    (out / INDEX).write_text('{"weight_map": {"x": "weights-a.safetensors", '
                             '"y": "weights-b.safetensors"}}')
    (out / "model.safetensors").write_bytes(b"an old single file as well")
    (out / "config.json").write_text("old config")
    (out / "tokenizer.json").write_bytes(TOKENIZER)
    (out / "extra" / "notes.md").write_text("kept")
    staging, swap = hf_target.stage(out)
    assert swap and staging.parent == tmp_path and staging != out
    for name in SHARDS:
        (staging / name).write_bytes(name.encode())
    (staging / INDEX).write_text("new index")
    (staging / "config.json").write_text("new config")
    hf_target.publish(staging, out)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["config.json", "extra", "tokenizer.json", INDEX, *SHARDS])
    assert (out / "config.json").read_text() == "new config"
    assert (out / INDEX).read_text() == "new index"
    assert (out / "tokenizer.json").read_bytes() == TOKENIZER
    assert (out / "extra" / "notes.md").read_text() == "kept"
    assert out.stat().st_mode & 0o777 == 0o750
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    fresh = tmp_path / "fresh"
    assert hf_target.stage(fresh) == (fresh, False) and fresh.is_dir()  # nothing to replace
