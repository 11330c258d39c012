"""Built-in corpus, byte tokenizer, and the seeded data-parallel loader."""

import pytest
import torch

from shardwise.errors import ShardwiseError
from shardwise.runtime.data import Batches, builtin_corpus, decode, encode, load_tokens


def test_corpus_is_deterministic_and_round_trips():
    text = builtin_corpus()
    assert text == builtin_corpus() and len(text) > 100_000
    tokens = encode(text)
    assert tokens.max() < 256 and decode(tokens) == text


def test_dp_shards_tile_the_global_batch():
    batches = Batches(load_tokens(), seq_len=32, global_batch=8, seed=3)
    rows = batches.global_rows(5)
    shards = [batches.shard(5, r, 4) for r in range(4)]
    torch.testing.assert_close(torch.cat([x for x, _ in shards]), rows[:, :-1])
    torch.testing.assert_close(torch.cat([y for _, y in shards]), rows[:, 1:])
    # Targets are the inputs shifted by one token within the same text window.
    x, y = shards[0]
    torch.testing.assert_close(x[:, 1:], y[:, :-1])


def test_steps_differ_and_epochs_reshuffle():
    batches = Batches(encode("abcdefghij" * 40), seq_len=4, global_batch=4)
    per_epoch = batches.n_windows // 4
    assert not torch.equal(batches.global_rows(0), batches.global_rows(1))
    assert not torch.equal(batches.global_rows(0), batches.global_rows(per_epoch))


def test_user_text_file(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("hello world " * 100)
    assert decode(load_tokens(path)).startswith("hello world")
    with pytest.raises(ShardwiseError, match="data file .* not found"):
        load_tokens(tmp_path / "missing.txt")
    with pytest.raises(ShardwiseError, match="fewer than one global batch"):
        Batches(encode("tiny"), seq_len=8, global_batch=2)
