"""Every `TrainSpec` run setting × every export, read back by the framework's own parser or
refused in one line — tests/integration/test_emit_fields.py's cases and checks, run here
in-process and unmarked so that mutation testing of shardwise.emit (emit.megatron_run's
dispatcher, MoE overlap, capacity, recompute modules and share, precision-aware optimizer,
offloading, CUDA graphs) runs them. DeepSpeedConfig gets the rank from a patched
`deepspeed.comm.get_rank` instead of a gloo process group (it asks only for the rank before
the mpu's data-parallel size).
"""

from __future__ import annotations

import re

import pytest

import shardwise.emit  # noqa: F401 (the module these tests check)
from shardwise.errors import ShardwiseError
from tests.integration import test_emit_fields as fields
from tests.integration.conftest import FRAMEWORKS


class _Request:
    """The `request` the integration test asks for its DeepSpeed fixture."""

    def __init__(self, monkeypatch):
        self.monkeypatch = monkeypatch

    def getfixturevalue(self, name):
        assert name == "deepspeed_dist"
        import deepspeed.comm

        self.monkeypatch.setattr(deepspeed.comm, "get_rank", lambda *_, **__: 0)


def _id(case) -> str:
    """The case's id in characters a command line passes whole (mutmut reruns tests by id)."""
    return re.sub(r"[^\w=.+-]+", "_", case.id)


@pytest.mark.parametrize("case", fields.CASES, ids=_id)
def test_each_run_setting_comes_back_or_is_refused(case, tmp_path, monkeypatch):
    pytest.importorskip(FRAMEWORKS[case.framework])
    fields.test_the_framework_reads_back_each_run_setting(case, tmp_path, _Request(monkeypatch))
    if case.check is fields.REFUSED:  # an export's own refusal names the refused setting
        with pytest.raises(ShardwiseError) as info:
            fields._emitted(case)
        head, _, why = str(info.value).partition(" as planned: ")
        if head.startswith(f"--emit {case.framework} cannot run "):
            assert case.field in head and why


def test_each_export_has_a_case_per_run_setting():
    fields.test_every_run_setting_has_a_case()


@pytest.mark.parametrize("case,flags", [
    pytest.param(*p.values, id=p.id) if hasattr(p, "values") else p
    for p in fields.test_megatron_refuses_what_the_export_refuses.pytestmark[0].args[1]])
def test_megatron_refuses_what_the_export_refuses(case, flags):
    pytest.importorskip("megatron.core")
    fields.test_megatron_refuses_what_the_export_refuses(case, flags)
