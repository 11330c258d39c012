import pytest

from shardwise.errors import ShardwiseError
from shardwise.units import parse_batch, parse_count, parse_size


@pytest.mark.parametrize(("text", "value"), [
    ("13.5GB", 13.5e9), ("2GiB", 2 * 2**30), ("512MB", 512e6), ("4000", 4000.0),
    ("4000B", 4000.0), ("1.5 TiB", 1.5 * 2**40), ("64mb", 64e6),
])
def test_parse_size(text, value):
    assert parse_size(text) == value


def test_parse_count_and_batch():
    assert parse_count("15T") == 15e12
    assert parse_count("2.5B") == 2.5e9
    # 16·10^6 / 8192 is not whole; 16·2^20 / 8192 = 2048 (Llama 3's batch) is.
    assert parse_batch("16M-tokens", 8192) == 2048
    assert parse_batch("4M-tokens", 8000) == 500  # decimal reading first
    assert parse_batch("1024", 8192) == 1024


@pytest.mark.parametrize("text", ["13.5 GX", "abc", "", "1..2GB"])
def test_bad_sizes_are_one_clear_error(text):
    with pytest.raises(ShardwiseError, match="cannot read size"):
        parse_size(text)


def test_bad_batches():
    with pytest.raises(ShardwiseError, match="whole number"):
        parse_batch("1.5", 4096)
    with pytest.raises(ShardwiseError, match="not a whole number of sequences"):
        parse_batch("10-tokens", 4096)
    with pytest.raises(ShardwiseError, match="not a whole number of sequences"):
        parse_batch("16.3M-tokens", 8192)
