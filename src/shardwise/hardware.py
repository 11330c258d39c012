"""Accelerators, links and clusters.

Figures are vendor datasheet values (dense, no sparsity), per GPU; links are per direction per
GPU. Memory capacities are in bytes as the datasheet's "GB" of HBM, which for HBM stacks is
binary (an "80GB" H100 holds 80 GiB of HBM3; `nvidia-smi` shows 81,559 MiB usable).
Where a comment cites "ml-engineering", it is stas00/ml-engineering@744d01e1,
compute/accelerator/README.md (its TFLOPS, memory, clock and power tables, each row with the
vendor page it was read from) or network/README.md (the link tables).

A clock cap (`resolve_gpu(..., clock_mhz=f)`) scales every compute peak by `f / boost_clock`
(tensor throughput is proportional to the clock, ml-engineering "How To Calculate Theoretical
TFLOPS"); HBM and link bandwidths stay; a power cap is not modelled.

A user-defined accelerator comes from a JSON file (`--gpu my.json`, docs/howto/accelerator.md).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from shardwise.errors import ShardwiseError

GiB = 2**30
TFLOPS = 1e12


@dataclass(frozen=True)
class Link:
    """A link class: bandwidth per direction per GPU (bytes/s) and per-message latency α (s)."""

    name: str
    bandwidth: float
    latency: float

    def validate(self) -> Link:
        """Name printable (`validate.label`); bandwidth and latency in `RANGES`."""
        from shardwise.validate import finite, label

        label(self.name, "a link's name")
        for key in ("bandwidth", "latency"):
            low, high, unit = RANGES[key]
            finite(getattr(self, key), f"link {self.name}: {key} ({unit})", low=low,
                   high=high)
        return self


# The physical range of each figure of an accelerator or link (SI units), far beyond any part
# made or planned, so that a typo (1e-300 FLOP/s, a latency of 1e300 s) is one line instead of
# a 300-digit step time: (low, high, unit).
RANGES: dict[str, tuple[float, float, str]] = {
    "memory_bytes": (2**20, 2**50, "bytes"),  # 1 MiB to 1 PiB per device
    "hbm_bandwidth": (1e8, 1e15, "bytes/s"),  # 100 MB/s to 1 PB/s
    "peak_bf16": (1e9, 1e18, "FLOP/s"),  # 1 GFLOP/s to 1 EFLOP/s per device
    "peak_fp8": (1e9, 1e18, "FLOP/s"),
    "peak_fp32": (1e9, 1e18, "FLOP/s"),
    "boost_clock_mhz": (10.0, 10_000.0, "MHz"),
    "tdp_w": (1.0, 100_000.0, "W"),
    "bandwidth": (1e6, 1e15, "bytes/s per direction"),  # 1 MB/s to 1 PB/s
    "latency": (0.0, 1.0, "s"),  # a message's α: 0 to one second
}


@dataclass(frozen=True)
class Accelerator:
    """One GPU/TPU: peak dense FLOP/s per dtype, HBM capacity (bytes) and bandwidth (B/s), and
    the links (`LINKS` names, or its own `links`) it ships with: `intra` inside its node/board,
    `inter` between, `host` to its host CPU's memory (PCIe, or NVLink-C2C on Grace superchips;
    what optimizer and parameter offload move over). `boost_clock_mhz`: the clock its peaks are quoted at (a clock cap scales
    them); `tdp_w`: board power (informational); `calibrated_as`: the accelerator whose
    calibration constants it takes (default: its own name)."""

    name: str
    memory_bytes: float
    hbm_bandwidth: float
    peak_bf16: float
    peak_fp8: float | None = None
    peak_fp32: float | None = None
    intra: str = "nvlink4"  # every entry of `ACCELERATORS` names its own (tested)
    inter: str = "ndr"
    boost_clock_mhz: float | None = None
    tdp_w: float | None = None
    calibrated_as: str | None = None
    links: tuple[Link, ...] = ()
    host: str = "pcie5"

    @property
    def calibration_name(self) -> str:
        """The key of its efficiency constants (`calibration.default_calibration`)."""
        return self.calibrated_as or self.name

    def peak_flops(self, dtype: str = "bf16") -> float:
        table = {"bf16": self.peak_bf16, "fp16": self.peak_bf16, "fp8": self.peak_fp8,
                 "fp32": self.peak_fp32, "tf32": self.peak_fp32}
        value = table.get(dtype)
        if value is None:
            raise ShardwiseError(f"{self.name} has no {dtype} peak figure; use bf16")
        return value

    def validate(self) -> Accelerator:
        """Name printable (`validate.label`); every figure in its `RANGES`."""
        from shardwise.validate import finite, label

        problems = []
        try:
            label(self.name, "name")
        except ShardwiseError as exc:
            problems.append(str(exc))
        for key in _SCALAR_FIELDS:
            value = getattr(self, key)
            if value is None and key not in _REQUIRED:
                continue
            low, high, unit = RANGES[key]
            try:
                finite(value, f"{key} ({unit})", low=low, high=high)
            except ShardwiseError as exc:
                problems.append(str(exc))
        if problems:
            from shardwise.validate import clean

            raise ShardwiseError(f"accelerator {clean(str(self.name), 64)}: "
                                 + "; ".join(problems))
        for link in self.links:
            link.validate()
        return self

    def at_clock(self, clock_mhz: float) -> Accelerator:
        """This accelerator with its compute peaks scaled by `clock_mhz / boost_clock_mhz`
        (a sustained-clock cap; see the module docstring). Above the boost clock: unchanged."""
        from shardwise.validate import finite

        low, high, _ = RANGES["boost_clock_mhz"]
        finite(clock_mhz, "--clock-mhz", low=low, high=high)
        if self.boost_clock_mhz is None:
            raise ShardwiseError(f"{self.name} has no boost clock to scale from; give "
                                 "boost_clock_mhz in a --gpu FILE")
        scale = min(1.0, clock_mhz / self.boost_clock_mhz)
        return replace(self, peak_bf16=self.peak_bf16 * scale,
                       peak_fp8=None if self.peak_fp8 is None else self.peak_fp8 * scale,
                       peak_fp32=None if self.peak_fp32 is None else self.peak_fp32 * scale,
                       name=f"{self.name}@{clock_mhz:g}MHz", boost_clock_mhz=clock_mhz
                       if scale < 1 else self.boost_clock_mhz,
                       calibrated_as=self.calibration_name)


ACCELERATORS: dict[str, Accelerator] = {
    a.name: a
    for a in (
        # NVIDIA A100 datasheet (SXM4): 312 TFLOP/s BF16 dense, 19.5 FP32; HBM2e 2,039 GB/s
        # (80GB) and HBM2 1,555 GB/s (40GB); 400 W; boost clock 1,410 MHz (A100 architecture
        # white paper, via ml-engineering). HGX A100: NVLink 3; one HDR port per GPU.
        # HGX A100 hosts the GPUs on PCIe 4.0 x16.
        Accelerator("a100-40gb", 40 * GiB, 1.555e12, 312 * TFLOPS, None, 19.5 * TFLOPS,
                    "nvlink3", "hdr", 1410, 400, host="pcie4"),
        Accelerator("a100-80gb", 80 * GiB, 2.039e12, 312 * TFLOPS, None, 19.5 * TFLOPS,
                    "nvlink3", "hdr", 1410, 400, host="pcie4"),
        # NVIDIA H100 datasheet (nvidia.com/en-us/data-center/h100): SXM 989 TFLOP/s BF16,
        # 1,979 FP8, 67 FP32, 80 GB HBM3 at 3.35 TB/s, 700 W; PCIe 756 / 1,513 / 51,
        # 2.0 TB/s, 350 W (H100 PCIe product brief PB-11133-001_v02); NVL 835 / 1,671 / 60,
        # 94 GB HBM3 at 3.9 TB/s, 400 W (PCIe card; NVLink bridges pair two cards, so a
        # node's GPUs talk over PCIe 5). 1,830 MHz is the clock the 989 TFLOP/s are computed at
        # (ml-engineering clock table, note 12); the PCIe (114 SMs) and NVL (132 SMs) clocks
        # are derived the same way, peak / (SMs × 4 tensor cores × 1,024 FLOP per clock).
        # HGX H100: NVLink 4, one NDR port per GPU.
        Accelerator("h100-sxm", 80 * GiB, 3.35e12, 989 * TFLOPS, 1979 * TFLOPS, 67 * TFLOPS,
                    "nvlink4", "ndr", 1830, 700),
        Accelerator("h100-pcie", 80 * GiB, 2.0e12, 756 * TFLOPS, 1513 * TFLOPS, 51 * TFLOPS,
                    "pcie5", "ndr", 1620, 350, "h100-sxm"),
        Accelerator("h100-nvl", 94 * GiB, 3.9e12, 835 * TFLOPS, 1671 * TFLOPS, 60 * TFLOPS,
                    "pcie5", "ndr", 1545, 400, "h100-sxm"),
        # NVIDIA H800 SXM: the H100 SXM die and HBM3 (same dense BF16/FP8 peaks) with NVLink cut
        # to 400 GB/s bidirectional, 200 GB/s per direction (philisun.com, "NVIDIA H800 vs
        # H100", a secondary source; NVIDIA's H800 page is not in our sources). DeepSeek-V3
        # technical report (arXiv:2412.19437, §3.2.2) measures 160 GB/s NVLink on H800.
        Accelerator("h800", 80 * GiB, 3.35e12, 989 * TFLOPS, 1979 * TFLOPS, 67 * TFLOPS,
                    "nvlink4-h800", "ndr", 1830, 700, "h100-sxm"),
        # NVIDIA H200 datasheet: H100 SXM compute, 141 GB HBM3e at 4.8 TB/s, 700 W.
        Accelerator("h200", 141 * GiB, 4.8e12, 989 * TFLOPS, 1979 * TFLOPS, 67 * TFLOPS,
                    "nvlink4", "ndr", 1830, 700),
        # NVIDIA GH200 Grace Hopper (ml-engineering tables, from NVIDIA's GH200 page): the
        # Hopper GPU's peaks, 96 GB HBM3 at 4.0 TB/s, or 141 GB HBM3e at 4.8 TB/s (the 900 W
        # module of ml-engineering's MAMF row). NVLink 4 between superchips; NVLink-C2C to
        # its Grace CPU's memory.
        Accelerator("gh200", 96 * GiB, 4.0e12, 989 * TFLOPS, 1979 * TFLOPS, 67 * TFLOPS,
                    "nvlink4", "ndr", 1830, 900, host="c2c-gh200"),
        Accelerator("gh200-141gb", 141 * GiB, 4.8e12, 989 * TFLOPS, 1979 * TFLOPS,
                    67 * TFLOPS, "nvlink4", "ndr", 1830, 900, "gh200", host="c2c-gh200"),
        # NVIDIA DGX B200 datasheet: 72 PF FP8 training per 8 GPUs (with 2:4 sparsity: 4.5 PF
        # dense FP8, 2.25 PF dense BF16 per GPU, ml-engineering table note 20), 1,440 GB HBM3e
        # and 64 TB/s per 8 GPUs; FP32 80 TF (ml-engineering table);
        # 1,000 W maximum TGP (DGX B200 user guide, power capping); max SM clock 1,965 MHz
        # (nvidia-smi, via ml-engineering).
        Accelerator("b200", 180 * GiB, 8.0e12, 2250 * TFLOPS, 4500 * TFLOPS, 80 * TFLOPS,
                    "nvlink5", "ndr", 1965, 1000),
        # NVIDIA GB200 NVL72 (per GPU, via ml-engineering): 2.5 PF BF16, 5 PF FP8, 80 TF FP32,
        # 186 GB HBM3e at 8 TB/s, 1,200 W (Mission Control power FAQ); max SM clock 2,062 MHz.
        # Its NVLink 5 domain spans the rack: plan it with --gpus-per-node 72.
        Accelerator("gb200", 186 * GiB, 8.0e12, 2500 * TFLOPS, 5000 * TFLOPS, 80 * TFLOPS,
                    "nvlink5", "ndr", 2062, 1200, host="c2c-gb200"),
        # AMD Instinct MI300X datasheet: 1,307.4 TFLOP/s BF16 dense, 2,614.9 FP8, 163.4 FP32,
        # 192 GB HBM3 at 5.3 TB/s, 750 W, peak engine clock 2,100 MHz; 8 GPUs per platform
        # fully connected by Infinity Fabric; a 400 Gb/s NIC per GPU between platforms.
        Accelerator("mi300x", 192 * GiB, 5.3e12, 1307.4 * TFLOPS, 2614.9 * TFLOPS,
                    163.4 * TFLOPS, "infinity-fabric", "ndr", 2100, 750),
        # AMD Instinct MI325X (amd.com MI325X specifications, via ml-engineering): MI300X
        # compute, 256 GB HBM3e at 6.0 TB/s, 1,000 W, the same Infinity Fabric platform.
        Accelerator("mi325x", 256 * GiB, 6.0e12, 1307.4 * TFLOPS, 2614.9 * TFLOPS,
                    163.4 * TFLOPS, "infinity-fabric", "ndr", 2100, 1000),
        # AMD Instinct MI355X (CDNA 4; amd.com/en/products/accelerators/instinct/mi350/
        # mi355x.html, figures also in Tom's Hardware 2025-06 "MI355X will consume 1,400
        # watts" and wccftech's Hot Chips 2025 report): 2,516.6 TFLOP/s BF16 dense, 5,033.2
        # FP8, 157.3 FP32, 288 GB HBM3E at 8.0 TB/s, 1,400 W, peak engine clock 2,400 MHz;
        # 8 OAMs per platform over 7 Infinity Fabric links of 153.6 GB/s; a 400 Gb/s NIC per
        # GPU. Calibration borrowed from the MI325X (`generation`: cdna4, unvalidated).
        Accelerator("mi355x", 288 * GiB, 8.0e12, 2516.6 * TFLOPS, 5033.2 * TFLOPS,
                    157.3 * TFLOPS, "infinity-fabric-mi355x", "ndr", 2400, 1400, "mi325x"),
        # NVIDIA H20 (the China-market Hopper; no NVIDIA datasheet in our sources — secondary:
        # willitrunai.com/gpus/h20-96gb and zangshuxian.com/new/674733024499207168, which
        # quote NVIDIA's product brief): 148 TFLOP/s BF16 dense, 296 FP8, 44 FP32, 96 GB HBM3
        # at 4.0 TB/s, NVLink 4 at 900 GB/s both ways, 400 W, 78 SMs. Its tensor rate is cut
        # below what 78 SMs give at any Hopper clock, so no boost clock is stated (a clock cap
        # is refused). Calibration borrowed from the H100 SXM (unvalidated, `BORROWED`).
        Accelerator("h20", 96 * GiB, 4.0e12, 148 * TFLOPS, 296 * TFLOPS, 44 * TFLOPS,
                    "nvlink4", "ndr", None, 400, "h100-sxm"),
        # NVIDIA HGX B300 (Blackwell Ultra), per GPU (NVIDIA's HGX B300 page as tabulated by
        # verda.com/blog/gb300-nvl72-architecture and glennklockwood.com/garden/processors/
        # B300): 2.25 PF BF16 dense, 4.5 PF FP8, 75 TF FP32, 1.1 kW, 288 GB HBM3e (2.3 TB per
        # 8) at 8 TB/s, NVLink 5 at 1.8 TB/s both ways, a ConnectX-8 800 Gb/s NIC per GPU
        # (XDR). No boost clock in these sources. Calibration borrowed from the B200
        # (unvalidated, `BORROWED`).
        Accelerator("b300", 288 * GiB, 8.0e12, 2250 * TFLOPS, 4500 * TFLOPS, 75 * TFLOPS,
                    "nvlink5", "xdr", None, 1100, "b200"),
        # NVIDIA GB300 NVL72 (Blackwell Ultra with Grace), per GPU: 2.5 PF BF16 dense, 5 PF FP8
        # dense, 80 TF FP32, 1.4 kW, 8 TB/s (verda.com/blog/gb300-nvl72-architecture, per-GPU
        # table "without sparsity"); 288 GB HBM3e (12-high stacks; the rack's 20.7 TB / 72) and
        # the rack as NVIDIA's GB300 NVL72 page gives it (glennklockwood.com/garden/processors/
        # B300): 360 PF FP8 for training, 20 TB HBM at 576 TB/s, NVLink 5 at 130 TB/s (1.8 TB/s
        # per GPU both ways), 72 ConnectX-8 NICs (800 Gb/s XDR each); NVLink-C2C to Grace as on
        # GB200. No boost clock in these sources. Its NVLink domain spans the rack (plan it with
        # --gpus-per-node 72). Calibration borrowed from the GB200 (unvalidated, `BORROWED`).
        Accelerator("gb300", 288 * GiB, 8.0e12, 2500 * TFLOPS, 5000 * TFLOPS, 80 * TFLOPS,
                    "nvlink5", "xdr", None, 1400, "gb200", host="c2c-gb200"),
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
        # NVLink per GPU per direction: v3 (A100) 300 GB/s, v4 (H100) 450 GB/s, v5 (B200) 900
        # (ml-engineering NVLink table); H800's NVLink 4 is cut to 200 GB/s per direction.
        Link("nvlink3", 300e9, 2e-6),
        Link("nvlink4", 450e9, 2e-6),
        Link("nvlink4-h800", 200e9, 2e-6),
        Link("nvlink5", 900e9, 2e-6),
        # One InfiniBand port per GPU: HDR 200 Gb/s = 25 GB/s, NDR 400 Gb/s = 50 GB/s,
        # XDR 800 Gb/s = 100 GB/s (ConnectX-8 / Quantum-X800).
        Link("hdr", 25e9, 5e-6),
        Link("ndr", 50e9, 5e-6),
        Link("xdr", 100e9, 5e-6),
        # RoCE v2 at 400 Gb/s: same line rate as NDR, a little more latency.
        Link("roce400", 50e9, 8e-6),
        # AWS EFA v4 on P6-B200: 8 × 400 Gb/s per 8 GPUs, 50 GB/s per GPU (ml-engineering).
        Link("efa400", 50e9, 8e-6),
        # PCIe x16 per direction: 4.0 ~32 GB/s, 5.0 ~64 GB/s.
        Link("pcie4", 32e9, 5e-6),
        Link("pcie5", 64e9, 5e-6),
        # NVLink-C2C between a Grace CPU and its GPUs: 900 GB/s both directions together
        # (NVIDIA GH200 and GB200 NVL72 datasheets), 450 GB/s per direction to GH200's one GPU,
        # shared by GB200's two (225 each). Latency taken as NVLink's.
        Link("c2c-gh200", 450e9, 2e-6),
        Link("c2c-gb200", 225e9, 2e-6),
        # AMD Instinct MI300X datasheet / platform brief: 7 Infinity Fabric links of 128 GB/s
        # (bidirectional) each to the other 7 GPUs, 896 GB/s aggregate peer bandwidth, i.e.
        # 7 × 64 = 448 GB/s per direction per GPU. Latency taken as NVLink's.
        Link("infinity-fabric", 448e9, 2e-6),
        # AMD Instinct MI355X datasheet: 7 links of 153.6 GB/s (bidirectional), 1,075.2 GB/s
        # aggregate: 7 × 76.8 = 537.6 GB/s per direction per GPU.
        Link("infinity-fabric-mi355x", 7 * 76.8e9, 2e-6),
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
    """The accelerator preset `name` (or an alias of it); a `ShardwiseError` naming the valid
    ones otherwise."""
    return _lookup(ACCELERATORS, name, "accelerator", ACCELERATOR_ALIASES)


def get_link(name: str, own: tuple[Link, ...] = ()) -> Link:
    """A link preset, or one of `own` (an accelerator file's links) by name."""
    mine = {link.name.lower(): link for link in own}
    return _lookup(LINKS | mine, name, "link")


_SCALAR_FIELDS = ("memory_bytes", "hbm_bandwidth", "peak_bf16", "peak_fp8", "peak_fp32",
                  "boost_clock_mhz", "tdp_w")
_FILE_KEYS = {f.name for f in fields(Accelerator)}
_REQUIRED = ("name", "memory_bytes", "hbm_bandwidth", "peak_bf16", "intra", "inter")


def accelerator_from_dict(data: Any, source: str) -> Accelerator:
    """An `Accelerator` from a JSON object with its fields (SI units: bytes, bytes/s, FLOP/s,
    MHz, W); `links` a list of {name, bandwidth (bytes/s per direction), latency (s)}.
    Unknown keys, missing fields, non-finite or non-positive numbers: one-line error."""
    where = f"accelerator file {source!r}"
    if not isinstance(data, dict):
        raise ShardwiseError(f"{where} must hold a JSON object")
    unknown = set(data) - _FILE_KEYS
    if unknown:
        raise ShardwiseError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}; valid: "
                             f"{', '.join(sorted(_FILE_KEYS))}")
    missing = [k for k in _REQUIRED if data.get(k) is None]  # absent or null
    if missing:
        raise ShardwiseError(f"{where}: missing {', '.join(missing)} (needed: "
                             f"{', '.join(_REQUIRED)})")
    from shardwise.validate import finite, label

    for key in ("name", "intra", "inter", "host", "calibrated_as"):
        if key in data and data[key] is not None:
            label(data[key], f"{where}: {key}")
    if data["name"].lower() in ACCELERATORS or data["name"].lower() in ACCELERATOR_ALIASES:
        raise ShardwiseError(f"{where}: name {data['name']!r} is a preset's; give your "
                             "accelerator its own name (the header would show the preset)")
    values = {k: finite(data[k], f"{where}: {k} ({RANGES[k][2]})", low=RANGES[k][0],
                        high=RANGES[k][1]) for k in _SCALAR_FIELDS if data.get(k) is not None}
    links = data.get("links", [])
    if not isinstance(links, list):
        raise ShardwiseError(f"{where}: links must be a list of {{name, bandwidth, latency}}")
    own: list[Link] = []
    for i, link in enumerate(links):
        if not isinstance(link, dict) or set(link) != {"name", "bandwidth", "latency"}:
            raise ShardwiseError(f"{where}: links[{i}] must be an object with exactly name, "
                                 f"bandwidth (bytes/s per direction), latency (s)")
        name = label(link["name"], f"{where}: links[{i}].name")
        if name.lower() in LINKS:
            raise ShardwiseError(f"{where}: links[{i}] is named {name!r} like a preset link; "
                                 f"give it its own name (presets: {', '.join(LINKS)})")
        if name.lower() in {x.name.lower() for x in own}:
            raise ShardwiseError(f"{where}: link {name!r} is defined twice")
        bandwidth, latency = (finite(link[k], f"{where}: links[{i}].{k} ({RANGES[k][2]})",
                                     low=RANGES[k][0], high=RANGES[k][1])
                              for k in ("bandwidth", "latency"))
        own.append(Link(name, bandwidth, latency).validate())
    calibrated_as = data.get("calibrated_as")
    if calibrated_as is not None:
        calibrated_as = get_accelerator(calibrated_as).name
    accelerator = Accelerator(name=data["name"], intra=data["intra"], inter=data["inter"],
                              calibrated_as=calibrated_as, links=tuple(own),
                              host=data.get("host") or "pcie5", **values).validate()
    for which in (accelerator.intra, accelerator.inter, accelerator.host):
        get_link(which, accelerator.links)  # a name neither preset nor its own: one line
    return accelerator


THIS_MACHINE = "this-machine"  # the accelerator `shardwise calibrate` measures (calibration)
BORROWED = frozenset({"h20", "b300", "gb300", "mi355x"})
"""Presets timed with another part's calibration (`calibrated_as`) that no published run or
component benchmark measured: `estimate.uncertainty.unvalidated` names them (†)."""


def check_constants(data: Any, source: str, names: tuple[str, ...] = ()) -> None:
    """A calibration (constants) file names only accelerators and links that exist: the
    presets, `this-machine`, its own machine section's link, and `names` (the accelerator in
    use and its file's links); a typo is refused naming the valid ones, not ignored."""
    if not isinstance(data, dict):
        return  # `calibration._apply` says what it must hold
    from shardwise.validate import known

    where = f"calibration file {source!r}"
    section = data.get("accelerators")
    if isinstance(section, dict):
        known(section, dict.fromkeys((*ACCELERATORS, THIS_MACHINE, *names[:1])),
              f"{where}: accelerators")
    machine = data.get("machine")
    link = machine.get("link") if isinstance(machine, dict) else None
    own = (link.get("name", "gloo"),) if isinstance(link, dict) else ()
    for key in ("links", "link_latency"):
        if isinstance(data.get(key), dict):
            known(data[key], dict.fromkeys((*LINKS, *names[1:], *own)), f"{where}: {key}")


def generation(accelerator: str) -> str:
    """The generation of an accelerator preset by name (`h100-sxm`, `h200`, `h800`, `h20` and
    `gh200` are Hopper; `b200`, `gb200`, `b300`, `gb300` Blackwell; `mi355x` CDNA 4, the
    MI300X/MI325X CDNA 3; …): the validation groups' span and the FP8 recipes' support
    (`fp8.Fp8Recipe.architectures`). Callers timing a step pass `calibration_name`, so a
    borrowed calibration's generation is the one its constants come from."""
    for prefix, gen in (("a100", "ampere"), ("mi355", "cdna4"), ("h", "hopper"), ("gh", "hopper"),
                        ("b", "blackwell"), ("gb", "blackwell"), ("mi", "cdna3"),
                        ("tpu", "tpu")):
        if accelerator.startswith(prefix):
            return gen
    return accelerator


def resolve_gpu(gpu: str | Accelerator, *, clock_mhz: float | None = None,
                files: bool = False) -> Accelerator:
    """The accelerator `--gpu` names: a preset (or alias), or — with `files` (the CLI) — a JSON
    file of `Accelerator` fields (`accelerator_from_dict`); then the clock cap, if any
    (`Accelerator.at_clock`). The one place every interface resolves `--gpu`."""
    if isinstance(gpu, Accelerator):
        accelerator = gpu
    elif files and (gpu.lower().endswith(".json") or Path(gpu).is_file()):
        from shardwise.files import read_json

        accelerator = accelerator_from_dict(read_json(gpu, "accelerator file"), gpu)
    else:
        accelerator = get_accelerator(gpu)
    return accelerator if clock_mhz is None else accelerator.at_clock(clock_mhz)


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
    def of(cls, gpus: int, gpu: str | Accelerator = "h100", gpus_per_node: int = 8,
           intra: str | None = None, inter: str | None = None) -> Cluster:
        """A cluster of `gpus` accelerators (a preset name or an `Accelerator`, see
        `resolve_gpu`), filled node by node (fewer than one node: one partial node)."""
        from shardwise.validate import degree

        degree(gpus, "gpus")
        degree(gpus_per_node, "gpus_per_node")
        accelerator = resolve_gpu(gpu)
        if gpus < 1 or gpus_per_node < 1:
            raise ShardwiseError(f"need gpus ≥ 1 and gpus_per_node ≥ 1, got {gpus}, "
                                 f"{gpus_per_node}")
        per_node = min(gpus, gpus_per_node)
        if gpus % per_node:
            raise ShardwiseError(
                f"{gpus} GPUs do not fill whole nodes of {gpus_per_node}; use a multiple of "
                f"{gpus_per_node} or set --gpus-per-node"
            )
        own = accelerator.links
        return cls(
            nodes=gpus // per_node,
            gpus_per_node=per_node,
            accelerator=accelerator,
            intra=get_link(intra or accelerator.intra, own),
            inter=get_link(inter or accelerator.inter, own),
        ).validate()

