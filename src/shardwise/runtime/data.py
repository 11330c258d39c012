"""Training data without a network: a built-in corpus, a byte tokenizer and a seeded loader
in which every data-parallel rank reads its own shard of each global batch.

The built-in corpus is generated deterministically (a small grammar over a fixed lexicon), so
every rank and every run sees the same text; `--data FILE` trains on a user's own text. Bytes
are tokens (vocabulary 256), which fits the `tiny` presets.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

from shardwise.errors import ShardwiseError

BYTE_VOCAB = 256
# A `--data` file is read whole by every rank, 8 bytes per token (int64): 256 MiB of text
# is 2 GiB per rank.
MAX_DATA_BYTES = 256 * 2**20

_SUBJECTS = ("the planner", "a pipeline stage", "each rank", "the optimizer", "a tensor shard",
             "the ring", "every expert", "the scheduler", "a micro-batch", "the gradient")
_VERBS = ("sends", "gathers", "reduces", "splits", "waits for", "computes", "saves", "rotates",
          "merges", "checks")
_OBJECTS = ("its activations", "the weights", "a partial sum", "the next block", "the loss",
            "two buffers", "the key and value blocks", "the routing table", "the bubble",
            "a checkpoint")
_ENDINGS = (".", " before the step ends.", " and then rests.", " in fixed order.",
            " across the mesh.")


def builtin_corpus(n_sentences: int = 4000, seed: int = 1234) -> str:
    """A deterministic text of simple sentences about distributed training."""
    rng = random.Random(seed)
    sentences = (
        f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
        f"{rng.choice(_ENDINGS)}"
        for _ in range(n_sentences)
    )
    return " ".join(s[0].upper() + s[1:] for s in sentences)


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes as int64 token ids in [0, 256)."""
    data = bytearray(text.encode("utf-8"))
    if not data:
        return torch.zeros(0, dtype=torch.int64)
    return torch.frombuffer(data, dtype=torch.uint8).to(torch.int64)


def decode(tokens: torch.Tensor) -> str:
    """Text of byte tokens (invalid UTF-8 replaced): the inverse of `encode`."""
    return bytes(tokens.tolist()).decode("utf-8", errors="replace")


def load_tokens(path: str | Path | None = None) -> torch.Tensor:
    """Tokens of a user's text file, or of the built-in corpus."""
    from shardwise.files import read_bytes

    if path is None:
        return encode(builtin_corpus())
    raw = read_bytes(path, "data file", MAX_DATA_BYTES)  # a regular file, size capped
    return encode(raw.decode("utf-8", errors="replace"))


@dataclass(frozen=True)
class Batches:
    """Step `k`'s global batch: `global_batch` windows of `seq_len + 1` tokens picked by a
    seeded permutation of all windows; rank `r` of `dp` reads rows `[r·B/dp, (r+1)·B/dp)`.

    The position is just the step number, so resuming from a checkpoint at step `k` reads
    exactly what an uninterrupted run reads.
    """

    tokens: torch.Tensor
    seq_len: int
    global_batch: int
    seed: int = 0

    def __post_init__(self) -> None:
        if self.n_windows < self.global_batch:
            raise ShardwiseError(
                f"the data holds {len(self.tokens):,} tokens (bytes), fewer than one global "
                f"batch needs: {self.global_batch} windows of --seq + 1 = {self.seq_len + 1} "
                f"tokens, each starting {self.seq_len} after the last, take "
                f"{self.global_batch * self.seq_len + 1:,}; use shorter --seq, a smaller "
                "--global-batch or more text"
            )

    @property
    def n_windows(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def _order(self, epoch: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.n_windows, generator=generator)

    def global_rows(self, step: int) -> torch.Tensor:
        """(B, s + 1) token windows of step `step`."""
        per_epoch = self.n_windows // self.global_batch
        epoch, index = divmod(step, per_epoch)
        starts = self._order(epoch)[index * self.global_batch:(index + 1) * self.global_batch]
        offsets = torch.arange(self.seq_len + 1)
        return self.tokens[starts[:, None] * self.seq_len + offsets[None, :]]  # (B, s+1)

    def shard(self, step: int, dp_rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This dp rank's (inputs, targets), each (B/dp, s)."""
        if self.global_batch % dp:
            raise ShardwiseError(f"global batch {self.global_batch} is not a multiple of dp={dp}")
        per_rank = self.global_batch // dp
        rows = self.global_rows(step)[dp_rank * per_rank:(dp_rank + 1) * per_rank]
        return rows[:, :-1], rows[:, 1:]
