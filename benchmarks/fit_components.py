"""Fit the step model's component constants on published component benchmarks.

    python benchmarks/fit_components.py          # fit, write the three outputs below
    python benchmarks/fit_components.py --check  # fit, and fail if the outputs would change

Reads `src/shardwise/data/components.json` (every point with its source) and writes
`src/shardwise/data/calibration.json` (the constants per accelerator; the end-to-end overlap
constants and the `default` section are carried over unchanged), `docs/accuracy/components.json`
(every point's prediction and residual) and `docs/accuracy/components.md` (the same as tables).
Every prediction is the model's own (`shardwise.estimate.components.predict`), so a residual
is the model's error on that measurement. Fits are grid searches minimising the squared log
ratio predicted/measured (each point counts alike whatever its size):

    GEMM         e_max (≤ 1) and d½ of `gemm_efficiency` per generation with a shape sweep (A100,
                 H100); elsewhere d½ transferred from H100 and e_max from the one large-shape point
    attention    e_k (≤ 1), d½, s½, r_b of `attention_efficiency` per (generation, kernel); what
                 a source does not measure (a head dim, the backward) is transferred, and said so
    HBM          measured / datasheet bandwidth
    links        efficiency η (≤ 1) and α per ring round, through `estimate.comm.collective_time`
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from shardwise.calibration import Calibration, default_calibration
from shardwise.calibration.components import (
    COMPONENTS,
    accelerator_of,
    load_components,
    measured,
    residual_summary,
    ring_model,
)
from shardwise.estimate.components import predict
from shardwise.hardware import ACCELERATORS

ROOT = Path(__file__).resolve().parents[1]
CALIBRATION = ROOT / "src/shardwise/data/calibration.json"
RESULTS = ROOT / "docs/accuracy/components.json"
DOCS = ROOT / "docs/accuracy/components.md"

# SDPA math (materialised attention) is memory-bound: the efficiency curve does not describe it
# (its fit is reported, not shipped); the step model's materialised path (flash=False) does.
NOT_SHIPPED = ("math",)
# Which label's constants each preset takes ("label" = the accelerator field of the points).
# A preset absent here takes its `calibrated_as` (h100-pcie, h100-nvl, h800, gh200-141gb) or,
# with neither (tpu-v5p), the `default` section.
GEMM_OF = {"a100-40gb": "a100", "a100-80gb": "a100", "h100-sxm": "h100", "h200": "h100",
           "gh200": "gh200", "b200": "b200", "gb200": "gb200", "mi300x": "mi300x",
           "mi325x": "mi325x"}
HBM_OF = {"a100-40gb": "a100-40gb", "a100-80gb": "a100-40gb", "h100-sxm": "h100-sxm",
          "h200": "h100-sxm", "gh200": "h100-sxm", "b200": "gb200", "gb200": "gb200",
          "mi300x": "h100-sxm", "mi325x": "h100-sxm"}
ATTENTION_OF = {"a100-40gb": "a100", "a100-80gb": "a100", "h100-sxm": "h100", "h200": "h100",
                "gh200": "h100", "b200": "b200", "gb200": "b200", "mi300x": "mi300x",
                "mi325x": "mi300x"}
# The kernel the step model's flash path uses (`Calibration.attention_kernel`) until the stack
# profiles choose: FlashAttention-2 where it is all that was measured, cuDNN's fused attention
# (what Transformer Engine calls) on Hopper.
DEFAULT_KERNEL = {"a100": "fa2", "h100": "cudnn", "b200": "fa4", "mi300x": "fa2"}
LINK_FROM = {"nvlink4-h800": "nvlink4", "ndr": "efa400", "roce400": "efa400", "xdr": "efa400",
             "hdr": "efa400"}
TILE = 256.0  # the largest cuBLAS/CUTLASS output-tile side (fit_gemm)
UNFITTED_LINKS = {"pcie4": 0.8, "pcie5": 0.8}  # no component source found: kept, assumed
E2E_KEYS = ("kernel_overhead", "dp_bucket_bytes", "overlap_contention", "tp_overlap_efficiency",
            "sustained_compute")


# ------------------------------------------------------------------------------------ helpers
def _loss(pred: np.ndarray, meas: np.ndarray, robust: bool = False) -> Any:
    """Σ log²(pred/meas), or Σ |log(pred/meas)| (`robust`: the collective sweeps, whose
    smallest messages carry first-call and launch costs of the benchmark itself)."""
    ratio = np.log(pred / meas)
    return np.sum(np.abs(ratio) if robust else ratio**2, axis=-1)


def _residuals(component: str, points: list[dict], cal: Calibration | None = None) -> list[float]:
    return [(measured(component, p) - predict(component, p, cal)) / measured(component, p)
            for p in points]


# ---------------------------------------------------------------------------------------- GEMM
def fit_gemm(points: list[dict]) -> dict[str, dict[str, Any]]:
    """(e_max, d½) per label: a sweep (≥ 5 points) is fitted; fewer points take H100's d½.

    The fit also frees a fixed time per call `t₀` (0–20 µs), not shipped: the published sweeps
    time each call with their harness's own fixed costs (a 1024³ GEMM on H100 takes 17.7 µs in
    triton-3672, ~3 µs of it arithmetic), which the model charges apart (`kernel_overhead`, per
    kernel). d½ is bounded by the largest output tile T = 256 (CUTLASS/cuBLAS 128×256 tiles on
    Hopper, 256×128 on Ampere): for a dimension d → 0 the form must not cost more than the
    tile it pads to, d/(d + d½) ≥ d/(d + T) (a GEMV stays HBM-bound, as it measures).
    """
    out: dict[str, dict[str, Any]] = {}
    labels = sorted({p["accelerator"] for p in points}, key=lambda lab: lab != "h100")
    for label in labels:
        rows = [p for p in points if p["accelerator"] == label and p["dtype"] in ("bf16", "fp16")
                and "outlier" not in p]
        if not rows:
            continue
        acc = accelerator_of(label)
        m, n, k = (np.array([p[x] for p in rows], float) for x in "mnk")
        flops = 2 * m * n * k
        seconds = flops / (np.array([p["tflops"] for p in rows]) * 1e12)
        if len(rows) >= 5:  # a sweep: e_max, d½ and the harness's t₀ identifiable
            halves, fixed, how = np.geomspace(8, TILE, 121), np.linspace(0, 20e-6, 41), "fitted"
        else:
            halves = np.array([out["h100"]["matmul_half_dim"]])
            fixed, how = np.array([0.0]), "d½ from h100"
        best = None
        for t0 in fixed:
            need = flops / (acc.peak_bf16 * np.maximum(seconds - t0, 1e-9))  # e_max · Π sat
            sat = np.stack([(m / (m + h)) * (n / (n + h)) * (k / (k + h)) for h in halves])
            e = np.minimum(1.0, np.exp(np.median(np.log(need / sat), axis=1)))
            loss = _loss(t0 + flops / (acc.peak_bf16 * e[:, None] * sat), seconds)
            i = int(np.argmin(loss))
            if best is None or loss[i] < best[0]:
                best = (loss[i], e[i], halves[i], t0)
        assert best is not None
        out[label] = {"matmul_efficiency": float(f"{best[1]:.4g}"),
                      "matmul_half_dim": round(float(best[2]), 1),
                      "harness_fixed_us": round(float(best[3]) * 1e6, 1), "how": how}
    return out


# ----------------------------------------------------------------------------------- attention
def fit_attention_kernel(rows: list[dict], half_dim: float | None = None,
                         backward_ratio: float | None = None) -> dict[str, Any]:
    """(e_k, d½, s½, r_b) of one kernel on one accelerator (`rows`: its points, one label):
    a grid search of `e_k·d/(d + d½)·s'/(s' + s½)` (s' = s/2 causal; backward × r_b; a
    fwd+bwd point at `3.5/(1/e_f + 2.5/e_b)`), e_k the median ratio at each grid point.
    `half_dim` / `backward_ratio` given: held at that value (transferred) instead of fitted."""
    acc = accelerator_of(rows[0]["accelerator"])
    d = np.array([p["head_dim"] for p in rows], float)
    s = np.array([p["seq"] * (0.5 if p["causal"] else 1.0) for p in rows], float)
    passes = [p["pass"] for p in rows]
    meas = np.array([p["tflops"] for p in rows]) * 1e12 / acc.peak_bf16
    halves_d = np.geomspace(1, 2048, 56) if half_dim is None else np.array([half_dim])
    ratios = np.linspace(0.5, 1.3, 33) if backward_ratio is None else np.array([backward_ratio])
    halves_s = np.geomspace(1, 16384, 60)
    sd = (d / (d + halves_d[:, None]))[:, None, None, :]  # (D, 1, 1, P)
    ss = (s / (s + halves_s[:, None]))[None, :, None, :]  # (1, S, 1, P)
    r = ratios[None, None, :, None]  # (1, 1, R, 1)
    fwd_share = np.array([{"fwd": 1.0, "bwd": 0.0, "fwd+bwd": 1.0}[x] for x in passes])
    bwd_only = np.array([x == "bwd" for x in passes])
    combined = np.array([x == "fwd+bwd" for x in passes])
    unit = sd * ss  # forward efficiency at e_k = 1
    shape = np.where(combined, 3.5 / (1 / unit + 2.5 / (r * unit)),
                     np.where(bwd_only, r * unit, fwd_share * unit))
    e = np.minimum(1.0, np.exp(np.median(np.log(meas / shape), axis=-1, keepdims=True)))
    loss = _loss(e * shape, meas)
    i, j, q = np.unravel_index(int(np.argmin(loss)), loss.shape)
    fit_res = residual_summary(1 - e[i, j, q, 0] * shape[i, j, q] / meas)
    return {"fit_median_abs": round(fit_res["median_abs"], 4),
            "fit_max_abs": round(fit_res["max_abs"], 4),
            "efficiency": float(f"{e[i, j, q, 0]:.4g}"),
            "half_dim": round(float(halves_d[i]), 1), "half_seq": round(float(halves_s[j]), 1),
            "backward_ratio": round(float(ratios[q]), 3)}


def fit_attention(points: list[dict]) -> dict[str, dict[str, dict[str, Any]]]:
    """(e_k, d½, s½, r_b) per (label, kernel); what the points cannot tell is transferred."""
    fits: dict[str, dict[str, dict[str, Any]]] = {}
    order = [("h100", "fa2"), ("h100", "fa3"), ("h100", "math"), ("h100", "cudnn"),
             ("h100", "triton"), ("a100", "fa2"), ("a100", "math"), ("a100", "triton"),
             ("b200", "fa2"), ("b200", "fa4")]
    for label, kernel in order:
        rows = [p for p in points if p["accelerator"] == label and p["kernel"] == kernel]
        passes = {p["pass"] for p in rows}
        notes, half_dim, ratio = [], None, None
        if len({p["head_dim"] for p in rows}) < 2:
            half_dim = fits["h100"][kernel]["half_dim"]
            notes.append("d½ from h100 (one head dim measured)")
        has_ratio = "fwd+bwd" in passes or {"fwd", "bwd"} <= passes
        if not has_ratio or (label != "h100" and not {"fwd", "bwd"} <= passes):
            donor = {"cudnn": "fa3", "fa4": "fa3", "triton": "fa2"}.get(kernel, kernel)
            ratio = fits["h100"][donor]["backward_ratio"]
            notes.append(f"backward ratio from h100 {donor}")
        fits.setdefault(label, {})[kernel] = fit_attention_kernel(rows, half_dim, ratio) | {
            "how": "; ".join(notes) or "fitted"}
    # MI300X: no attention benchmark found; H100's FlashAttention-2 curve (CK's kernel is an
    # FA2-style one) as a fraction of peak
    fits["mi300x"] = {"fa2": dict(fits["h100"]["fa2"], how="transferred from h100 fa2")}
    return fits


def fit_hbm(points: list[dict]) -> dict[str, dict[str, float]]:
    """`hbm_efficiency` per label: a copy's measured bandwidth ÷ the datasheet's."""
    return {p["accelerator"]: {"hbm_efficiency": float(
        f"{p['gbps'] * 1e9 / accelerator_of(p['accelerator']).hbm_bandwidth:.3g}")}
        for p in points}


# ----------------------------------------------------------------------------------------- links
def fit_links(points: list[dict], base: Calibration, wire: dict[str, float]
              ) -> dict[str, dict[str, Any]]:
    """(η, α) per link class over the ring-model points; intra links before the inter link.
    A link with a direct wire measurement (`wire`: EFA's RDMA write) takes η from it and fits
    α alone."""
    fits: dict[str, dict[str, Any]] = {}
    ring = [p for p in points if ring_model(p)]

    def grid(link: str, rows: list[dict], cal: Calibration, alphas: np.ndarray,
             etas: np.ndarray) -> tuple[float, float]:
        meas = np.array([p["busbw_gbps"] for p in rows])
        best = None
        for eta in etas:
            for alpha in alphas:
                trial = replace(cal, link_efficiency=cal.link_efficiency | {link: eta},
                                link_latency=cal.link_latency | {link: alpha})
                pred = np.array([predict("collectives", p, trial) for p in rows])
                loss = float(_loss(pred, meas, robust=True))
                if best is None or loss < best[0]:
                    best = (loss, eta, alpha)
        assert best is not None
        return best[1], best[2]

    cal = base
    alphas = np.geomspace(1e-7, 1e-3, 81)
    for link in ("nvlink3", "nvlink4", "nvlink5", "infinity-fabric", "efa400"):
        rows = [p for p in ring if (p["inter"] or p["intra"]) == link]
        how = "fitted"
        if all(p["size_bytes"] is None or p["size_bytes"] >= 2**30 for p in rows):
            link_alphas, how = np.array([fits["nvlink4"]["latency"]]), "α from nvlink4"
        else:
            link_alphas = alphas
        etas = np.linspace(0.3, 1.0, 71)
        if link in wire:
            etas, how = np.array([wire[link]]), "η from the wire measurement, α fitted"
        eta, alpha = grid(link, rows, cal, link_alphas, etas)
        fits[link] = {"efficiency": round(eta, 3), "latency": float(f"{alpha:.3g}"), "how": how}
        cal = replace(cal, link_efficiency=cal.link_efficiency | {link: eta},
                      link_latency=cal.link_latency | {link: alpha})
    for link, donor in LINK_FROM.items():
        if link.startswith("nvlink"):
            fits[link] = dict(fits[donor], how=f"transferred from {donor}")
        else:  # α of a 4-node sweep is no per-round latency for thousands of nodes: preset α
            fits[link] = {"efficiency": fits[donor]["efficiency"], "latency": None,
                          "how": f"η transferred from {donor}'s wire measurement; α preset"}
    for link, eta in UNFITTED_LINKS.items():
        fits[link] = {"efficiency": eta, "latency": None, "how": "assumed (no component source)"}
    return fits


def nvls_gain(points: list[dict]) -> list[dict[str, Any]]:
    """NVLink SHARP all-reduce over the ring at the same size and GPUs (not in the model)."""
    rows = []
    for p in points:
        if p["algorithm"] != "nvls":
            continue
        same = [q for q in points if q["algorithm"] == "ring" and q["op"] == p["op"]
                and q["ranks"] == p["ranks"] and q["size_bytes"] == p["size_bytes"]
                and q["intra"] == p["intra"] and q["source"] == p["source"]]
        if same:
            rows.append({"link": p["intra"], "ranks": p["ranks"], "size_bytes": p["size_bytes"],
                         "gain": round(p["busbw_gbps"] / same[0]["busbw_gbps"], 3)})
    return rows


# ------------------------------------------------------------------------------------- outputs
def calibration_json(old: dict[str, Any], gemm: dict, attention: dict, hbm: dict,
                     links: dict, sources: dict[str, Any]) -> dict[str, Any]:
    accelerators: dict[str, dict[str, Any]] = {}
    for name in GEMM_OF:
        g, a = gemm[GEMM_OF[name]], attention[ATTENTION_OF[name]]
        # a GEMM shape constant no sweep measured is validate_published.py's to fit
        e2e = (*E2E_KEYS, "matmul_half_dim") if g["how"] != "fitted" else E2E_KEYS
        keep = {k: v for k, v in old.get("accelerators", {}).get(name, {}).items()
                if k in e2e}
        kernel = DEFAULT_KERNEL.get(ATTENTION_OF[name], "fa2")
        accelerators[name] = {
            "matmul_efficiency": g["matmul_efficiency"], "matmul_half_dim": g["matmul_half_dim"],
            "hbm_efficiency": hbm[HBM_OF[name]]["hbm_efficiency"],
            "attention": {k: {x: v[x] for x in ("efficiency", "half_dim", "half_seq",
                                                "backward_ratio")}
                          for k, v in a.items() if k not in NOT_SHIPPED},
            "attention_kernel": kernel, **keep}
    doc = [
        "Efficiency constants of shardwise's step-time model (estimate/compute.py, estimate/step.py).",
        "WRITTEN BY benchmarks/fit_components.py from data/components.json (published component",
        "benchmarks, each with its source): GEMM (matmul_efficiency, matmul_half_dim), fused attention per",
        "kernel (attention, attention_kernel), HBM (hbm_efficiency), links (links: efficiency, link_latency: α",
        "per ring round). Residuals per component: docs/accuracy/components.md. What no source measures is",
        "transferred from a named accelerator or link ('sources' says which).",
        "END-TO-END, carried over unchanged: 'default' (Narayanan et al. 2021 Table 1, A100; now only for",
        "accelerators without component constants: tpu-v5p), and per accelerator sustained_compute,",
        "overlap_contention, tp_overlap_efficiency and, where no GEMM sweep measured it, matmul_half_dim:",
        "fitted on published runs by benchmarks/validate_published.py --fit (leave-one-family-out in",
        "docs/generated/accuracy-published.md).",
        "Override from a file with `shardwise plan --calibration my.json` (same shape, only the keys it names)."]
    return {"_doc": doc, "default": old["default"], "accelerators": accelerators,
            "links": {k: v["efficiency"] for k, v in links.items()},
            "link_latency": {k: v["latency"] for k, v in links.items() if v["latency"] is not None},
            "sources": sources}


def sources_of(gemm: dict, attention: dict, hbm: dict, links: dict) -> dict[str, str]:
    """Per accelerator: which points its constants come from (a label other than its own name
    means transferred from that accelerator)."""
    out = {}
    for name in GEMM_OF:
        g, a, h = GEMM_OF[name], ATTENTION_OF[name], HBM_OF[name]
        kernels = ", ".join(f"{k} ({v['how']})" for k, v in attention[a].items())
        out[name] = (f"GEMM: {g} points, {gemm[g]['how']}; attention: {a} points, {kernels}; "
                     f"HBM: {h} point")
    out["links"] = "; ".join(f"{k}: {v['how']}" for k, v in links.items())
    out["data"] = "src/shardwise/data/components.json (every point's source; SOURCES.md)"
    return out


def residual_table(data: dict[str, Any]) -> dict[str, Any]:
    """Every point's prediction and residual with the fitted built-in constants."""
    out: dict[str, Any] = {}
    for component in COMPONENTS:
        rows = data[component]
        if component == "collectives":
            rows = [p for p in rows if ring_model(p)]
        if component == "attention":
            rows = [p for p in rows if p["kernel"] not in NOT_SHIPPED]
        rows = [p for p in rows if "outlier" not in p]
        res = _residuals(component, rows)
        out[component] = {"summary": residual_summary(res), "points": [
            p | {"predicted": round(predict(component, p), 2), "residual": round(r, 4)}
            for p, r in zip(rows, res)]}
    return out


def groups(component: str, rows: list[dict]) -> dict[str, list[float]]:
    key = {"gemm": lambda p: p["accelerator"],
           "attention": lambda p: f"{p['accelerator']} {p['kernel']}",
           "hbm": lambda p: p["accelerator"],
           "collectives": lambda p: p["inter"] or p["intra"]}[component]
    out: dict[str, list[float]] = {}
    for p in rows:
        out.setdefault(key(p), []).append(p["residual"])
    return out


def markdown(results: dict[str, Any], fits: dict[str, Any], data: dict[str, Any]) -> str:
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip() or "unknown"
    lines = ["# Component calibration: fit and residuals", "",
             f"Written by `python benchmarks/fit_components.py` (tree at commit {commit}). "
             "Every point below is a published measurement (`src/shardwise/data/components.json`, "
             "sources in `src/shardwise/calibration/SOURCES.md`); *predicted* is the step model's "
             "own value for it with the built-in constants (`shardwise.estimate.components."
             "predict`); residual = (measured − predicted) / measured. These are in-sample "
             "residuals of component fits, not a validation of step times.", "",
             "## Residuals per component", "",
             "| component | group | points | median abs | max abs |", "|---|---|---|---|---|"]
    for component in COMPONENTS:
        for group, res in sorted(groups(component, results[component]["points"]).items()):
            s = residual_summary(res)
            lines.append(f"| {component} | {group} | {s['points']} | {s['median_abs']:.1%} | "
                         f"{s['max_abs']:.1%} |")
        s = results[component]["summary"]
        lines.append(f"| **{component}** | all | {s['points']} | {s['median_abs']:.1%} | "
                     f"{s['max_abs']:.1%} |")
    lines += ["", "## Fitted constants", "", "### GEMM (`gemm_efficiency = e_max·Π d/(d + d½)`)",
              "", "| label | e_max | d½ | harness t₀ (µs, not shipped) | how |",
              "|---|---|---|---|---|"]
    for label, g in fits["gemm"].items():
        lines.append(f"| {label} | {g['matmul_efficiency']} | {g['matmul_half_dim']} | "
                     f"{g['harness_fixed_us']} | {g['how']} |")
    fp8 = [p for p in data["gemm"] if p["dtype"] == "fp8"]
    bf16 = {p["accelerator"]: p["tflops"] for p in data["gemm"] if p["dtype"] == "bf16"
            and p["source"] == "mamf"}
    lines += ["", "FP8 over BF16 at each part's best shape (ml-engineering MAMF; not in the model, "
              "which uses the BF16 efficiency against the FP8 peak): " + ", ".join(
                  f"{p['accelerator']} {p['tflops'] / bf16[p['accelerator']]:.2f}×"
                  for p in fp8 if p["accelerator"] in bf16) + ".", "",
              "### Attention (`e_k·d/(d + d½)·s'/(s' + s½)`, backward × r_b)", "",
              "| label | kernel | e_k | d½ | s½ | r_b | fit median / max abs | how |",
              "|---|---|---|---|---|---|---|---|"]
    for label, kernels in fits["attention"].items():
        for kernel, a in kernels.items():
            shipped = "" if kernel not in NOT_SHIPPED else " — not shipped (memory-bound: " \
                "the model's materialised path)"
            lines.append(f"| {label} | {kernel} | {a['efficiency']} | {a['half_dim']} | "
                         f"{a['half_seq']} | {a['backward_ratio']} | "
                         f"{a.get('fit_median_abs', 0):.1%} / {a.get('fit_max_abs', 0):.1%} | "
                         f"{a['how']}{shipped} |")
    lines += ["", "### HBM", "", "| accelerator | measured / datasheet |", "|---|---|"]
    for label, h in fits["hbm"].items():
        lines.append(f"| {label} | {h['hbm_efficiency']} |")
    lines += ["", "### Links (η of the datasheet bandwidth, α per ring round)", "",
              "| link | η | α (µs) | how |", "|---|---|---|---|"]
    for link, v in fits["links"].items():
        alpha = "preset" if v["latency"] is None else f"{v['latency'] * 1e6:.2f}"
        lines.append(f"| {link} | {v['efficiency']} | {alpha} | {v['how']} |")
    lines += ["", "NVLink SHARP (NCCL's `NVLS` all-reduce) over the ring at the same size and "
              "GPUs — not in the model (a ring), measured on H200 and B200 nodes:", "",
              "| link | GPUs | size | gain |", "|---|---|---|---|"]
    for row in fits["nvls"]:
        lines.append(f"| {row['link']} | {row['ranks']} | {row['size_bytes'] / 2**30:g} GiB | "
                     f"{row['gain']}× |")
    lines += ["", "## Left out", "", "Kept in the data, not fitted, not in the summaries:", ""]
    for component in COMPONENTS:
        for p in data[component]:
            why = p.get("outlier") or p.get("model_gap")
            if why:
                lines.append(f"- {component} {p.get('accelerator') or p.get('intra')} "
                             f"({p['source']}): {why} — predicted {predict(component, p):.1f}, "
                             f"measured {measured(component, p)}")
        if component == "attention":
            lines.append("- attention, kernel `math` (SDPA math path, both sources): fitted, "
                         "not shipped (see the fit table)")
    for component in COMPONENTS:
        lines += ["", f"## Points: {component}", ""]
        rows = results[component]["points"]
        keys = [k for k in rows[0] if k not in ("source", "note", "predicted", "residual",
                                                  "library", "tokens", "outlier", "model_gap")]
        lines.append("| " + " | ".join(keys) + " | predicted | residual | source |")
        lines.append("|" + "---|" * (len(keys) + 3))
        for p in rows:
            lines.append("| " + " | ".join(str(p[k]) for k in keys) +
                         f" | {p['predicted']} | {p['residual']:+.1%} | {p['source']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="fail (exit 1) if the written files would change")
    args = parser.parse_args()
    data = load_components()
    old = json.loads(CALIBRATION.read_text())
    base = default_calibration("h100-sxm")
    gemm = fit_gemm(data["gemm"])
    attention = fit_attention(data["attention"])
    hbm = fit_hbm(data["hbm"])
    wire = {p["link"]: p["efficiency"] for p in data["links"]}
    links = fit_links(data["collectives"], replace(base, link_efficiency={}, link_latency={}),
                      wire)
    new = calibration_json(old, gemm, attention, hbm, links,
                           sources_of(gemm, attention, hbm, links))
    assert set(GEMM_OF) <= set(ACCELERATORS)
    text = json.dumps(new, indent=2, ensure_ascii=False) + "\n"
    if args.check:
        if text != CALIBRATION.read_text():
            print("data/calibration.json differs from the fit: run benchmarks/fit_components.py")
            return 1
    else:
        CALIBRATION.write_text(text)
    results = residual_table(data)
    fits = {"gemm": gemm, "attention": attention, "hbm": hbm, "links": links,
            "nvls": nvls_gain(data["collectives"])}
    if not args.check:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps({"fits": fits, "residuals": results}, indent=1) + "\n")
        DOCS.write_text(markdown(results, fits, data))
    for component in COMPONENTS:
        s = results[component]["summary"]
        print(f"{component:12s} {s['points']:4d} points  median |res| {s['median_abs']:.1%}  "
              f"max {s['max_abs']:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
