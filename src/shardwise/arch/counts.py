"""Parameters by component (`ParamCount`; counted by `arch.spec.count_params`, SPEC §1)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParamCount:
    """Parameters by component; `total` counts every expert, `active` those a token uses.
    `mtp`: the multi-token-prediction modules (`ModelSpec.mtp_params`), in neither."""

    attention: int
    mlp: int
    mlp_active: int
    norms: int
    embedding: int
    head: int
    mtp: int = 0

    @property
    def total(self) -> int:
        return self.attention + self.mlp + self.norms + self.embedding + self.head

    @property
    def active(self) -> int:
        return self.attention + self.mlp_active + self.norms + self.embedding + self.head
