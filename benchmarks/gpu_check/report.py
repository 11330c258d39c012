"""The report: gpu_check.json rewritten after every step, and summary.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpu_check.notebook import _error_text, _plain
from gpu_check.steps import Step


@dataclass
class Report:
    """gpu_check.json and summary.md in `out`, rewritten after every step."""

    out: Path
    data: dict[str, Any] = field(default_factory=dict)

    def write(self) -> None:
        """Both files, each replaced whole (a reader never sees half of one); a summary that
        cannot be drawn says why instead of stopping the run."""
        try:
            summary = summary_markdown(self.data)
        except Exception as exc:  # the JSON holds everything: never lose the run to a table
            summary = (f"# gpu_check\n\nThe summary failed ({_error_text(exc)}); "
                       "see gpu_check.json.\n")
        for name, text in (("gpu_check.json", json.dumps(_plain(self.data), indent=1,
                                                         default=str) + "\n"),
                           ("summary.md", summary)):
            tmp = self.out / f".{name}.tmp"
            tmp.write_text(text, encoding="utf-8")
            tmp.replace(self.out / name)

    def step(self, step: Step, entry: dict[str, Any]) -> None:
        section = self.data["sections"][step.section]
        section["steps"][step.name] = entry
        statuses = {e["status"] for e in section["steps"].values()}
        section["status"] = ("skipped" if statuses == {"skipped"} else
                             "failed" if statuses == {"failed"} else
                             "partial" if "failed" in statuses else "measured")
        section["wall_s"] = sum(e.get("wall_s", 0.0) for e in section["steps"].values())
        checks = [c for s in self.data["sections"].values() for e in s["steps"].values()
                  for c in e.get("checks", [])]
        self.data["checks"] = {"passed": sum(c["ok"] is True for c in checks),
                               "failed": sum(c["ok"] is False for c in checks),
                               "reported": sum(c["ok"] is None for c in checks)}
        self.write()


def _cell(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, int | float) else str(value)


MEMORY_FIGURES = ("max_memory_allocated", "reserved", "peak above", "allocated by the forward",
                  "layer 1 saved vs")  # the memory checks the summary lists


def summary_markdown(data: dict[str, Any]) -> str:
    """The short summary: the run, each step's status and time, failed checks, the
    calibration against the preset."""
    env = data.get("environment") or {}
    device = (env.get("devices") or [{"name": "no GPU (dry run)" if data["dry_run"]
                                      else "no GPU"}])[0]["name"]
    lines = [f"# gpu_check {'(dry run) ' if data['dry_run'] else ''}— {device}", "",
             f"Started {data['started']}, {data.get('wall_s', 0):.0f} s of a "
             f"{data['budget_s']:.0f} s budget; torch {env.get('torch')}, CUDA "
             f"{env.get('cuda')}, NCCL {env.get('nccl')}, {env.get('gpus', 0)} GPU(s). "
             f"Checks: {data.get('checks', {}).get('passed', 0)} passed, "
             f"{data.get('checks', {}).get('failed', 0)} failed, "
             f"{data.get('checks', {}).get('reported', 0)} reported.", "",
             "| section | step | status | seconds (budget) | note |", "|---|---|---|---:|---|"]
    for section, s in data["sections"].items():
        for name, e in s["steps"].items():
            note = (e.get("reason") or e.get("error") or "").splitlines()
            lines.append(f"| {section} | {name} | {e['status']} | {e.get('wall_s', 0):.1f} "
                         f"({e['timeout_s']:.0f}) | {(note[0] if note else '')[:160]} |")
    failed = [(name, c) for s in data["sections"].values() for name, e in s["steps"].items()
              for c in e.get("checks", []) if c["ok"] is False]
    if failed:
        lines += ["", "## Checks that failed", "", "| step | check | value | tolerance |",
                  "|---|---|---:|---:|"]
        lines += [f"| {name} | {c['what']} | {_cell(c['value'])} | {_cell(c['tolerance'])} |"
                  for name, c in failed]
    for title, section, keep in (
            ("Runtime against fp64", "runtime", lambda c: c["ok"] is not None),
            ("Memory", "memory", lambda c: any(key in c["what"] for key in MEMORY_FIGURES)),
            ("Multi-GPU step time", "multi-gpu", lambda c: "step time" in c["what"])):
        steps = data["sections"].get(section, {}).get("steps", {})
        rows = [(name, c) for name, e in steps.items() for c in e.get("checks", []) if keep(c)]
        if rows:
            lines += ["", f"## {title}", "", "| step | figure | value | tolerance | note |",
                      "|---|---|---:|---:|---|"]
            lines += [f"| {name} | {c['what']} | {_cell(c['value'])} | "
                      f"{_cell(c['tolerance']) if c['tolerance'] is not None else '-'} | "
                      f"{c['note'][:200]} |" for name, c in rows]
    fit = data["sections"].get("calibration", {}).get("steps", {}).get("fit", {})
    consts = (fit.get("items") or {}).get("constants")
    if consts:
        lines += ["", f"## Calibration ({fit['items']['file']}) against the preset", "",
                  "| constant | preset | measured |", "|---|---:|---:|"]
        for key in ("matmul_efficiency", "matmul_half_dim", "hbm_efficiency"):
            if key in consts["measured"]:
                lines.append(f"| {key} | {consts['preset'][key]} | {consts['measured'][key]} |")
        for kernel, params in consts["measured"].get("attention", {}).items():
            old = consts["preset"]["attention"].get(kernel, {})
            lines.append(f"| attention {kernel} (e, d½, s½, r_b) | "
                         f"{', '.join(str(old.get(k, '-')) for k in params)} | "
                         f"{', '.join(str(v) for v in params.values())} |")
    return "\n".join(lines) + "\n"


def accelerator_label(name: str, memory_bytes: int) -> str | None:
    """The hardware preset a CUDA device name stands for (None: none known)."""
    n = name.lower()
    for key, label in (("gh200", "gh200"), ("h200", "h200"), ("h100 pcie", "h100-pcie"),
                       ("h100 nvl", "h100-nvl"), ("h100", "h100-sxm"), ("b200", "b200")):
        if key in n:
            return label
    if "a100" in n:
        return "a100-80gb" if memory_bytes > 50 * 2**30 else "a100-40gb"
    return None


# What every step's ranks import: loaded once by the server they fork from (`launch.spawn`'s
# forkserver), not once per step (seconds each on a small machine).
