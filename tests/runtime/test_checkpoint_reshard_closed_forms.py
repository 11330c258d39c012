"""A rank's share of a checkpoint (`runtime.checkpoint.reshard`) against closed forms written
here: where a TP/EP shard sits in the full tensor (`_place`: rank·size, replicated kv heads
counted once), the ZeRO spans of rank 1 of 2 (`_flat`: its half of each unit's padded flat
buffer, cut at the parameters' edges), a span's chunks (`_Span.blocks`: a partial first row,
whole rows, a partial last row, each the flat tensor's slice), and DCP itself writing two
ranks' uneven chunks of a 1.4 MB tensor (bigger than DCP's and our 1 MiB I/O chunks) and
reading them back into another split. The model objects are stand-ins holding only the
fields these functions read (ParamShard's, AxisGroup's rank and size, the ZeRO units');
a real ZeRO-3 save of a world of one checks the same spans end to end."""

from __future__ import annotations

import warnings
from dataclasses import replace
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
dist = torch.distributed

from shardwise.runtime.checkpoint import reshard as R  # noqa: E402
from shardwise.runtime.parallel_transformer import ParamShard  # noqa: E402


def _model(shards: dict[str, ParamShard], tp=(0, 1), ep=(0, 1), zero=None):
    """A stand-in ParallelTransformer: its shards, `axis(name)` (rank, size), its ZeRO."""
    axes = {"tp": SimpleNamespace(rank=tp[0], size=tp[1]),
            "ep": SimpleNamespace(rank=ep[0], size=ep[1])}
    return SimpleNamespace(shards=shards, axis=lambda name: axes[name], zero=zero)


# ------------------------------------------------------------------------------ _place
@pytest.mark.parametrize(("shard", "tp", "ep", "local", "full", "base"), [
    # column-parallel rows: rank 3 of 4 holds rows 15..19 of 20
    (ParamShard(tp_dim=0), (3, 4), (0, 1), (5, 7), (20, 7), (15, 0)),
    # row-parallel columns, kv heads replicated on pairs of tp ranks: rank 3 // 2 = slice 1
    # of 4 / 2 = 2 slices of 3 columns
    (ParamShard(tp_dim=1, tp_replicas=2), (3, 4), (0, 1), (6, 3), (6, 6), (0, 3)),
    # rank 2 of pairs: slice 1 too (not 2)
    (ParamShard(tp_dim=1, tp_replicas=2), (2, 4), (0, 1), (6, 3), (6, 6), (0, 3)),
    # experts over ep: rank 2 of 4 holds experts 4, 5 of 8
    (ParamShard(expert=True), (1, 2), (2, 4), (2, 8, 3), (8, 8, 3), (4, 0, 0)),
    # an expert's weight also split over tp along dim 2: both offsets
    (ParamShard(tp_dim=2, expert=True), (1, 2), (3, 4), (2, 8, 3), (8, 8, 6), (6, 0, 3)),
    # replicated over tp: the local shape is the full one, wherever the tp rank
    (ParamShard(), (3, 4), (1, 2), (9, 4), (9, 4), (0, 0)),
])
def test_place_puts_a_shard_at_rank_times_its_size(shard, tp, ep, local, full, base):
    model = _model({"w": shard}, tp=tp, ep=ep)
    key, got_full, got_base = R._place(model, "w", local)
    assert (key, got_full, got_base) == ("w", full, base)
    assert all(type(n) is int for n in got_full + got_base)  # a shape: torch.Size needs ints


def test_a_tied_copy_is_stored_as_the_embedding_it_copies():
    model = _model({"head.weight": ParamShard(tp_dim=0, tied_copy=True)}, tp=(1, 2))
    assert R._place(model, "head.weight", (8, 4)) == ("embedding.weight", (16, 4), (8, 0))


# ------------------------------------------------------------------------------- _flat
def _slot(name: str, shape: tuple[int, ...], offset: int) -> SimpleNamespace:
    n = 1
    for d in shape:
        n *= d
    return SimpleNamespace(qualname=name, shape=torch.Size(shape), offset=offset, numel=n)


def _zero(stage: int, rank: int, world: int = 2) -> SimpleNamespace:
    """Two units: a (2, 5) and b (3, 5) — 25 elements padded to 26 — and c (7,) padded to
    8, each split into `world` equal rows."""
    units = []
    for slots in ([_slot("a", (2, 5), 0), _slot("b", (3, 5), 10)], [_slot("c", (7,), 0)]):
        numel = sum(s.numel for s in slots)
        padded = -(-numel // world) * world
        row = padded // world
        units.append(SimpleNamespace(slots=slots, padded=padded, lo=rank * row,
                                     hi=(rank + 1) * row))
    return SimpleNamespace(units=units, config=SimpleNamespace(stage=stage))


def test_zero_spans_are_the_ranks_row_of_each_flat_buffer():
    """Rank 1 of 2 holds elements [13, 26) of unit 0 — b's elements 3..14 (a ends at 10; 25
    is padding) at 0 — and [4, 8) of unit 1: c's elements 4..6 (7 is padding) at 0."""
    shards = {n: ParamShard() for n in "abc"}
    spans = R._flat(_model(shards, zero=_zero(stage=3, rank=1)))
    assert spans == [R._Span("b", (3, 5), (3, 5), (0, 0), 0, 0, 3, 12),
                     R._Span("c", (7,), (7,), (0,), 1, 0, 4, 3)]
    # rank 0: a whole, b's first 3 elements at 10; c's first 4
    spans = R._flat(_model(shards, zero=_zero(stage=3, rank=0)))
    assert spans == [R._Span("a", (2, 5), (2, 5), (0, 0), 0, 0, 0, 10),
                     R._Span("b", (3, 5), (3, 5), (0, 0), 0, 10, 0, 3),
                     R._Span("c", (7,), (7,), (0,), 1, 0, 0, 4)]


def test_zero_stage_0_spans_the_whole_flat_buffer():
    shards = {n: ParamShard() for n in "abc"}
    spans = R._flat(_model(shards, zero=_zero(stage=0, rank=1)))
    assert spans == [R._Span("a", (2, 5), (2, 5), (0, 0), 0, 0, 0, 10),
                     R._Span("b", (3, 5), (3, 5), (0, 0), 0, 10, 0, 15),
                     R._Span("c", (7,), (7,), (0,), 1, 0, 0, 7)]


def test_zero_spans_of_a_tp_shard_sit_at_its_tp_offset():
    """b split over tp rows (tp rank 1 of 2: its rows are rows 3..5 of 6)."""
    shards = {"a": ParamShard(), "b": ParamShard(tp_dim=0), "c": ParamShard()}
    spans = R._flat(_model(shards, tp=(1, 2), zero=_zero(stage=2, rank=1)))
    assert spans[0] == R._Span("b", (6, 5), (3, 5), (3, 0), 0, 0, 3, 12)


# ------------------------------------------------------------------------ _Span.blocks
def test_span_chunks_are_slices_of_the_flat_tensor_at_their_full_offsets():
    """Elements [2, 10) of a (3, 4) shard at base (6, 0) of a (12, 4) tensor, stored from
    element 5 of flat tensor 0: row 0's elements 2, 3 (flat 5..6), row 1 whole (flat 7..10),
    row 2's elements 0, 1 (flat 11..12)."""
    flat = torch.arange(20.0)
    span = R._Span("w", (12, 4), (3, 4), (6, 0), 0, 5, 2, 8)
    blocks = span.blocks(flat)
    assert tuple(blocks.shape) == (12, 4) and blocks.dtype == flat.dtype
    got = [(offsets, t.tolist()) for offsets, t in blocks._chunks]
    assert got == [((6, 2), [[5.0, 6.0]]), ((7, 0), [[7.0, 8.0, 9.0, 10.0]]),
                   ((8, 0), [[11.0, 12.0]])]
    chunks = blocks.__create_chunk_list__()
    assert [(tuple(c.offsets), tuple(c.sizes)) for c in chunks] == [
        ((6, 2), (1, 2)), ((7, 0), (1, 4)), ((8, 0), (1, 2))]
    # the chunks are views: a load writes into the flat tensor itself
    blocks._chunks[1][1].fill_(-1.0)
    assert flat[7:11].tolist() == [-1.0] * 4 and flat[6] == 6.0 and flat[11] == 11.0
    index = SimpleNamespace(offset=torch.Size((8, 0)), fqn="w")
    assert blocks.__get_tensor_shard__(index).tolist() == [[11.0, 12.0]]
    with pytest.raises(ValueError, match=r"no local chunk of w at \(8, 1\)"):
        blocks.__get_tensor_shard__(SimpleNamespace(offset=torch.Size((8, 1)), fqn="w"))
    with pytest.raises(RuntimeError, match="checkpoint metadata, not a tensor"):
        blocks + 1


def test_empty_ranges_have_no_blocks_whatever_the_rank():
    for shape in ((), (5,), (3, 4)):
        for at in (0, 1, 3):
            assert R._blocks(shape, at, at) == []
    assert R._blocks((), 0, 1) == [((), ())]


# ------------------------------------------------- DCP: save one split, load another
ROWS, COLS = 600, 600  # fp32: 1.44 MB, more than DCP's and our 1 MiB chunks


def _share(spans: list[R._Span], flats: list[torch.Tensor]) -> R._Blocks:
    chunks = [c for s in spans for c in s.blocks(flats[s.tensor])._chunks]
    return R._Blocks((ROWS, COLS), chunks)


def _split(cut: int) -> list[R._Span]:
    """The full tensor as two ranks' flat shards cut at element `cut` (mid-row)."""
    total = ROWS * COLS
    return [R._Span("w", (ROWS, COLS), (ROWS, COLS), (0, 0), 0, 0, 0, cut),
            R._Span("w", (ROWS, COLS), (ROWS, COLS), (0, 0), 1, 0, cut, total - cut)]


def test_dcp_reads_chunks_written_on_one_split_into_another(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint import save as dcp_save

    full = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(3))
    flat = full.reshape(-1)
    cut = 1000 * 117 + 13  # inside row 195
    saved = [flat[:cut].clone(), flat[cut:].clone()]
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp_save({"w": _share(_split(cut), saved)}, storage_writer=FileSystemWriter(tmp_path),
                 no_dist=True)
        assert sum(p.stat().st_size for p in tmp_path.glob("*.distcp")) > 4 * ROWS * COLS
        other = 77 * COLS + 599  # another rank split: the last element of row 77
        loaded = [torch.zeros(other), torch.zeros(ROWS * COLS - other)]
        dcp_load({"w": _share(_split(other), loaded)},
                 storage_reader=FileSystemReader(tmp_path), no_dist=True)
    assert torch.equal(loaded[0], flat[:other]) and torch.equal(loaded[1], flat[other:])


# ------------------------------------------------------- a real ZeRO-3 save, one rank
def test_a_zero3_checkpoint_holds_the_single_device_weights_and_resumes(world_of_one,
                                                                          tmp_path):
    """ZeRO-3 keeps only flat shards: the saved `model.*` tensors are each parameter's
    slice [offset, offset + numel) of its unit's shard, in its own shape; the moments too;
    a resume on ZeRO-3 then steps bit-identically to the uninterrupted run."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load

    from shardwise.arch import get_model
    from shardwise.layout import Layout
    from shardwise.runtime import train as T
    from shardwise.runtime.checkpoint import load_checkpoint, read_parameters, save_checkpoint
    from shardwise.runtime.state import TrainConfig

    cfg = TrainConfig(get_model("tiny"), Layout(zero=3), steps=4, seq_len=16, global_batch=2,
                      dtype="fp64", lr=3e-3, warmup=1, checkpoint_dir=str(tmp_path / "ck"))
    state = T.build(cfg)
    T.train_step(state)
    path = save_checkpoint(state, tmp_path / "ck")
    zero = state.model.zero
    saved = read_parameters(path)
    expected = {s.qualname: zero.shards[i].detach()[s.offset:s.offset + s.numel].view(s.shape)
                for i, unit in enumerate(zero.units) for s in unit.slots}
    assert saved.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(saved[name], value), name
    # AdamW's second moment of the first unit's last parameter, as stored
    unit = zero.units[1]
    last = unit.slots[-1]
    moment = state.optimizer.state[zero.shards[1]]["exp_avg_sq"]
    out = {f"optim.{last.qualname}.exp_avg_sq": torch.empty(last.shape, dtype=torch.float64)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp_load(out, storage_reader=FileSystemReader(path), no_dist=True)
    assert torch.equal(next(iter(out.values())),
                       moment[last.offset:last.offset + last.numel].view(last.shape))
    assert float(moment.abs().sum()) > 0
    T.train_step(state)  # the uninterrupted run's step 2 (a save changes nothing)
    fresh = T.build(replace(cfg, resume=True))
    assert load_checkpoint(fresh, tmp_path / "ck") is True and fresh.step == 1
    T.train_step(fresh)
    for a, b in zip(state.model.zero.shards, fresh.model.zero.shards, strict=True):
        assert torch.equal(a, b)
