"""`Layout`'s derived figures and its text form (layout.py) by hand, every degree > 1 and
distinct (dp 3, tp 2, pp 4, cp 8, ep 6) so no product or quotient can stand for another:
world size, the expert-tensor degree, ZeRO's shard span, the all-to-all degree per cp kind,
micro-batches, the integer codes the array models take, the one-line summary, and the
parser's aliases and one-line refusals."""

import pytest

from shardwise.errors import ShardwiseError
from shardwise.layout import Layout, TrainSpec


def test_derived_degrees():
    layout = Layout(dp=3, tp=2, pp=4, cp=8, ep=6)
    assert layout.world_size == 3 * 2 * 4 * 8  # ep lives inside dp·cp·tp
    assert (layout.expert_tp, layout.with_(etp=1).expert_tp) == (2, 1)
    assert (layout.zero_degree, layout.with_(zero_group=4).zero_degree) == (24, 4)
    assert layout.ulysses_degree == 1  # ring
    assert layout.with_(cp_kind="ulysses").ulysses_degree == 8
    assert layout.with_(cp_kind="hybrid", ulysses=2).ulysses_degree == 2


def test_microbatches():
    layout = Layout(dp=3, micro_batch=2, pp=4)
    assert layout.microbatches(TrainSpec(seq_len=1024, global_batch=60)) == 10
    assert layout.microbatches(TrainSpec(seq_len=1024, global_batch=7)) == 1  # at least one
    assert layout.microbatches(TrainSpec(seq_len=1024, global_batch=None)) == 4  # one per stage


def test_codes_for_the_array_models():
    layout = Layout(dp=3, tp=2, pp=4, sp=True, schedule="interleaved", chunks=2,
                    recompute="full", cp=2, cp_kind="allgather", partition=(1, 1, 1, 1, 1, 1,
                                                                            1, 1))
    codes = layout.codes()
    assert "partition" not in codes
    assert (codes["sp"], codes["cp_kind"], codes["recompute"]) == (1, 3, 2)
    assert codes["schedule"] == 2  # gpipe 0, 1f1b 1, interleaved 2 (the registry's order)
    assert (codes["dp"], codes["tp"], codes["pp"], codes["chunks"]) == (3, 2, 4, 2)


def test_short_names_every_non_default_choice():
    assert Layout().short() == "single mb1"
    full = Layout(dp=3, tp=2, pp=4, cp=8, ep=6, etp=1, cp_kind="hybrid", ulysses=2, zero=3,
                  zero_group=4, sp=True, schedule="interleaved", chunks=2, micro_batch=2,
                  recompute="selective", partition=(3, 2, 2, 3))
    assert full.short() == ("dp3 tp2 pp4 cp8 a2a2×ring4 ep6 etp1 zero3/4 sp interleaved×2 mb2 "
                            "selective layers 3/2/2/3")
    assert Layout(cp=2, cp_kind="ulysses").short() == "cp2 ulysses mb1"
    assert Layout(tp=2, etp=2, zero=1).short() == "tp2 zero1 mb1"


def test_parse_aliases_types_and_refusals():
    layout = Layout.parse("tp=2, mbs=4 ,v=2,sp=yes,pp=2,schedule=interleaved", dp=3)
    assert (layout.tp, layout.micro_batch, layout.chunks, layout.sp, layout.dp) == (2, 4, 2,
                                                                                   True, 3)
    assert Layout.parse("mb=2,sp=0").micro_batch == 2 and not Layout.parse("sp=off").sp
    assert Layout.parse("partition=3:2:2:3,pp=4").partition == (3, 2, 2, 3)
    for text, message in (
            ("tp", "cannot read layout item 'tp'; write key=value with key in dp, tp, pp"),
            ("zz=1", "cannot read layout item 'zz=1'"),
            ("tp=2,tp=4", "layout 'tp=2,tp=4' sets tp twice; give each key once"),
            ("tp=two", "layout tp='two' must be an integer"),
            ("tp=2=3", "layout tp='2=3' must be an integer"),  # the key ends at the first =
            ("sp=maybe", "layout sp='maybe' must be one of")):
        with pytest.raises(ShardwiseError) as err:
            Layout.parse(text)
        assert str(err.value).startswith(message), str(err.value)
    with pytest.raises(ShardwiseError) as err:
        Layout(schedule="zigzag").codes()
    assert str(err.value).startswith("schedule 'zigzag' unknown; valid: gpipe, 1f1b")
    with pytest.raises(ShardwiseError) as err:
        Layout(partition=(1.5, 2))
    assert str(err.value) == "partition must be whole layer counts per stage, got (1.5, 2)"


def test_a_partition_of_comma_separated_counts_is_those_counts():
    """`partition=3,1` inside the comma-separated layout text is two stages of 3 and 1 layers
    (was read as one stage of 31: the counts were joined without their comma); colons and
    Megatron's layout string, whose commas are cosmetic, read as before."""
    assert Layout.parse("pp=2,partition=3,1,tp=2").partition == (3, 1)
    assert Layout.parse("pp=4,partition=7:8:8:7").partition == (7, 8, 8, 7)
    megatron = Layout.parse("pp=2,partition=Et|t,tL")
    assert megatron.partition == Layout.parse("pp=2,partition=Et|ttL").partition == (1, 2)
