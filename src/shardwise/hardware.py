"""Accelerators, links and clusters.

Figures are vendor datasheet values (dense, no sparsity), per GPU; links are per direction per
GPU. Memory capacities are in bytes as the datasheet's "GB" of HBM, which for HBM stacks is
binary (an "80GB" H100 holds 80 GiB of HBM3; `nvidia-smi` shows 81,559 MiB usable).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from shardwise.errors import ShardwiseError

GiB = 2**30
TFLOPS = 1e12


@dataclass(frozen=True)
class Accelerator:
    """One GPU/TPU: peak dense FLOP/s per dtype, HBM capacity (bytes) and bandwidth (B/s), and
    the links (`LINKS` names) it ships with: `intra` inside its node/board, `inter` between."""

    name: str
    memory_bytes: float
    hbm_bandwidth: float
    peak_bf16: float
    peak_fp8: float | None = None
    peak_fp32: float | None = None
    intra: str = "nvlink4"  # every entry of `ACCELERATORS` names its own (tested)
    inter: str = "ndr"

    def peak_flops(self, dtype: str = "bf16") -> float:
        table = {"bf16": self.peak_bf16, "fp16": self.peak_bf16, "fp8": self.peak_fp8,
                 "fp32": self.peak_fp32, "tf32": self.peak_fp32}
        value = table.get(dtype)
        if value is None:
            raise ShardwiseError(f"{self.name} has no {dtype} peak figure; use bf16")
        return value


@dataclass(frozen=True)
class Link:
    """A link class: bandwidth per direction per GPU (bytes/s) and per-message latency α (s)."""

    name: str
    bandwidth: float
    latency: float


ACCELERATORS: dict[str, Accelerator] = {
    a.name: a
    for a in (
        # NVIDIA A100 datasheet (SXM4): 312 TFLOP/s BF16 dense, 19.5 FP32; HBM2e 2,039 GB/s
        # (80GB) and HBM2 1,555 GB/s (40GB).
        # HGX A100 baseboards: NVLink 3; the clusters of that era: one HDR port per GPU.
        Accelerator("a100-40gb", 40 * GiB, 1.555e12, 312 * TFLOPS, None, 19.5 * TFLOPS,
                    "nvlink3", "hdr"),
        Accelerator("a100-80gb", 80 * GiB, 2.039e12, 312 * TFLOPS, None, 19.5 * TFLOPS,
                    "nvlink3", "hdr"),
        # NVIDIA H100 datasheet: SXM 989 TFLOP/s BF16, 1,979 FP8, 3.35 TB/s; PCIe 756 / 1,513,
        # 2.0 TB/s. HGX H100: NVLink 4, one NDR port per GPU; PCIe cards talk over PCIe 5.
        Accelerator("h100-sxm", 80 * GiB, 3.35e12, 989 * TFLOPS, 1979 * TFLOPS, 67 * TFLOPS,
                    "nvlink4", "ndr"),
        Accelerator("h100-pcie", 80 * GiB, 2.0e12, 756 * TFLOPS, 1513 * TFLOPS, 51 * TFLOPS,
                    "pcie5", "ndr"),
        # NVIDIA H200 datasheet: same compute as H100 SXM, 141 GB HBM3e at 4.8 TB/s.
        Accelerator("h200", 141 * GiB, 4.8e12, 989 * TFLOPS, 1979 * TFLOPS, 67 * TFLOPS,
                    "nvlink4", "ndr"),
        # NVIDIA DGX B200 datasheet: 72 PF FP8 / 36 PF BF16 dense training per 8 GPUs
        # (so 2.25 PF BF16 per GPU), 1,440 GB HBM3e per 8 GPUs, 64 TB/s per 8 GPUs.
        Accelerator("b200", 180 * GiB, 8.0e12, 2250 * TFLOPS, 4500 * TFLOPS, 75 * TFLOPS,
                    "nvlink5", "ndr"),
        # AMD Instinct MI300X datasheet: 1,307.4 TFLOP/s BF16 dense, 2,614.9 FP8, 192 GB HBM3,
        # 5.3 TB/s; 8 GPUs per platform fully connected by Infinity Fabric; a 400 Gb/s NIC per
        # GPU between platforms.
        Accelerator("mi300x", 192 * GiB, 5.3e12, 1307.4 * TFLOPS, 2614.9 * TFLOPS,
                    163.4 * TFLOPS, "infinity-fabric", "ndr"),
        # Google Cloud TPU v5p: 459 TFLOP/s BF16, 918 TOPS INT8, 95 GB HBM2e, 2,765 GB/s. The
        # chips of a pod (up to 8,960) share one ICI 3D torus, so ICI is also the "inter" link.
        Accelerator("tpu-v5p", 95 * GiB, 2.765e12, 459 * TFLOPS, 918 * TFLOPS, None,
                    "ici-v5p", "ici-v5p"),
    )
}
ACCELERATOR_ALIASES = {"a100": "a100-80gb", "h100": "h100-sxm", "mi300": "mi300x",
                       "v5p": "tpu-v5p"}

LINKS: dict[str, Link] = {
    link.name: link
    for link in (
        # NVLink per GPU per direction: v3 (A100) 300 GB/s, v4 (H100) 450 GB/s, v5 (B200) 900.
        Link("nvlink3", 300e9, 2e-6),
        Link("nvlink4", 450e9, 2e-6),
        Link("nvlink5", 900e9, 2e-6),
        # One InfiniBand port per GPU: HDR 200 Gb/s = 25 GB/s, NDR 400 Gb/s = 50 GB/s.
        Link("hdr", 25e9, 5e-6),
        Link("ndr", 50e9, 5e-6),
        # RoCE v2 at 400 Gb/s: same line rate as NDR, a little more latency.
        Link("roce400", 50e9, 8e-6),
        # PCIe x16 per direction: 4.0 ~32 GB/s, 5.0 ~64 GB/s.
        Link("pcie4", 32e9, 5e-6),
        Link("pcie5", 64e9, 5e-6),
        # AMD Instinct MI300X datasheet / platform brief: 7 Infinity Fabric links of 128 GB/s
        # (bidirectional) each to the other 7 GPUs, 896 GB/s aggregate peer bandwidth, i.e.
        # 7 × 64 = 448 GB/s per direction per GPU. Latency taken as NVLink's.
        Link("infinity-fabric", 448e9, 2e-6),
        # Google Cloud TPU v5p documentation: inter-chip interconnect 4,800 Gb/s per chip
        # (600 GB/s, both directions together), so 300 GB/s per direction. Latency as NVLink's.
        Link("ici-v5p", 300e9, 2e-6),
    )
}



def _lookup(table: dict, name: str, what: str, aliases: dict[str, str] | None = None):
    if not isinstance(name, str):
        raise ShardwiseError(f"{what} must be a name (one of {', '.join(table)}), got "
                             f"{name!r}"[:300])
    key = name.lower()
    key = (aliases or {}).get(key, key)
    if key in table:
        return table[key]
    close = difflib.get_close_matches(key, list(table), n=3, cutoff=0.4)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    raise ShardwiseError(f"unknown {what} {name!r}{hint}; valid: {', '.join(table)}")


def get_accelerator(name: str) -> Accelerator:
    return _lookup(ACCELERATORS, name, "accelerator", ACCELERATOR_ALIASES)


def get_link(name: str) -> Link:
    return _lookup(LINKS, name, "link")


@dataclass(frozen=True)
class Cluster:
    """`nodes × gpus_per_node` accelerators; `intra` links GPUs of a node, `inter` the nodes."""

    nodes: int
    gpus_per_node: int
    accelerator: Accelerator
    intra: Link
    inter: Link

    @property
    def n_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def validate(self) -> Cluster:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ShardwiseError(
                f"cluster needs nodes ≥ 1 and gpus_per_node ≥ 1, got {self.nodes}×"
                f"{self.gpus_per_node}"
            )
        return self

    @classmethod
    def of(cls, gpus: int, gpu: str = "h100", gpus_per_node: int = 8,
           intra: str | None = None, inter: str | None = None) -> Cluster:
        """A cluster of `gpus` accelerators, filled node by node (fewer than one node: one
        partial node)."""
        from shardwise.validate import degree

        degree(gpus, "gpus")
        degree(gpus_per_node, "gpus_per_node")
        accelerator = get_accelerator(gpu)
        if gpus < 1 or gpus_per_node < 1:
            raise ShardwiseError(f"need gpus ≥ 1 and gpus_per_node ≥ 1, got {gpus}, "
                                 f"{gpus_per_node}")
        per_node = min(gpus, gpus_per_node)
        if gpus % per_node:
            raise ShardwiseError(
                f"{gpus} GPUs do not fill whole nodes of {gpus_per_node}; use a multiple of "
                f"{gpus_per_node} or set --gpus-per-node"
            )
        return cls(
            nodes=gpus // per_node,
            gpus_per_node=per_node,
            accelerator=accelerator,
            intra=get_link(intra or accelerator.intra),
            inter=get_link(inter or accelerator.inter),
        ).validate()

