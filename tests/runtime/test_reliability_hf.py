"""Every weight a Hugging Face checkpoint folder holds is read, or the run stops before any
rank starts (issue 32, class 1): never trained from random initialisation because a file
could not be found, never cast from a quantised dtype, never started from NaN.

References: the checkpoint transformers' `save_pretrained` writes (its own files), and the
damage each example does to it (the tensor, file or index entry it names).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardwise.arch import from_hf_config
from shardwise.errors import ShardwiseError
from shardwise.runtime import hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

TMP = settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A tiny Llama as transformers saves it: config.json + model.safetensors."""
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=256, max_position_embeddings=64)
    torch.manual_seed(0)
    where = tmp_path_factory.mktemp("hf") / "llama"
    transformers.LlamaForCausalLM(config).save_pretrained(where, safe_serialization=True)
    return where


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return safetensors_torch.load_file(str(path))


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    safetensors_torch.save_file(tensors, str(path), metadata={"format": "pt"})


def _shard(folder: Path, weight_map_edit=None) -> dict[str, str]:
    """Split model.safetensors into two files with an index (as large checkpoints are)."""
    tensors = _tensors(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    files = {"model-00001-of-00002.safetensors": names[::2],
             "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in files.items():
        _save({k: tensors[k] for k in keys}, folder / file)
    weight_map = {k: f for f, keys in files.items() for k in keys}
    (folder / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return weight_map


DAMAGE = ["int8", "uint8", "int32", "nan", "inf", "dir", "loop", "fifo", "dangling",
          "no-weight-map", "map-not-object", "escape", "missing-shard", "moved-tensor",
          "both", "pickle-only", "shards-without-index"]


@settings(TMP, max_examples=40)
@given(kind=st.sampled_from(DAMAGE), data=st.data())
def test_weights_that_cannot_all_be_read_are_refused_before_any_rank(saved, tmp_path_factory,
                                                                    kind, data):
    folder = tmp_path_factory.mktemp("c") / "llama"
    shutil.copytree(saved, folder)
    single = folder / "model.safetensors"
    names = sorted(_tensors(single))
    name = data.draw(st.sampled_from(names), label="tensor")
    expect = name
    if kind in ("int8", "uint8", "int32"):
        tensors = _tensors(single)
        tensors[name] = (tensors[name] * 100).to(getattr(torch, kind))
        _save(tensors, single)
        expect = {"int8": "I8", "uint8": "U8", "int32": "I32"}[kind]
    elif kind in ("nan", "inf"):
        tensors = _tensors(single)
        flat = tensors[name].view(-1)
        flat[data.draw(st.integers(0, flat.numel() - 1), label="index")] = float(kind)
        _save(tensors, single)
    elif kind in ("dir", "loop", "fifo", "dangling"):
        single.unlink()
        {"dir": single.mkdir, "fifo": lambda: os.mkfifo(single),
         "loop": lambda: os.symlink(single.name, single),
         "dangling": lambda: os.symlink("nowhere.safetensors", single)}[kind]()
        expect = "model.safetensors"
    elif kind == "no-weight-map":
        _shard(folder)
        (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": 1}}))
        expect = "no weight_map"
    elif kind == "map-not-object":
        _shard(folder)
        (folder / INDEX).write_text(json.dumps({"weight_map": ["model.safetensors"]}))
        expect = "no weight_map"
    elif kind == "escape":
        weight_map = _shard(folder)
        weight_map[name] = "../" + weight_map[name]
        (folder / INDEX).write_text(json.dumps({"weight_map": weight_map}))
        expect = "not a file name in the checkpoint folder"
    elif kind == "missing-shard":
        weight_map = _shard(folder)
        (folder / weight_map[name]).unlink()
        expect = weight_map[name]
    elif kind == "moved-tensor":  # the index says another file than the one holding it
        weight_map = _shard(folder)
        other = next(f for f in sorted(set(weight_map.values())) if f != weight_map[name])
        weight_map[name] = other
        (folder / INDEX).write_text(json.dumps({"weight_map": weight_map}))
    elif kind == "both":
        _shard(folder)
        shutil.copy(saved / "model.safetensors", single)
        expect = "holds both"
    elif kind == "pickle-only":
        torch.save(_tensors(single), folder / "pytorch_model.bin")
        single.unlink()
        expect = "pytorch_model.bin"
    elif kind == "shards-without-index":
        _shard(folder)
        (folder / INDEX).unlink()
        expect = "model-00001-of-00002.safetensors"
    with pytest.raises(ShardwiseError) as info:
        hf.check_hf_weights(from_hf_config(folder), folder)
    message = str(info.value)
    assert expect in message and "\n" not in message, (kind, message)


def test_the_cli_refuses_them_in_one_line_and_starts_no_rank(saved, tmp_path, capsys):
    """`train --model DIR` (in this process: a refusal launches nothing)."""
    from shardwise.cli import main

    cases = {}
    for kind, edit in (("dir", lambda f: ((f / "model.safetensors").unlink(),
                                          (f / "model.safetensors").mkdir())),
                       ("index", lambda f: (_shard(f), (f / INDEX).write_text("{}")))):
        folder = tmp_path / kind
        shutil.copytree(saved, folder)
        edit(folder)
        cases[kind] = folder
    for folder in cases.values():
        with pytest.raises(SystemExit) as exit_:
            main(["train", "--model", str(folder), "--steps", "1", "--seq", "16",
                  "--global-batch", "2"])
        lines = capsys.readouterr().err.strip().splitlines()
        assert exit_.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: ")
