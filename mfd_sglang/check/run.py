"""The machinery of a check (`mfd_sglang.check`): sections run in order under one deadline, rows recorded as
they finish, verdicts, the report and its summary.

`run_sections(check, sections, writer)` starts a section only while `section.min_seconds` are left before
`check.deadline` (else it is recorded as not run); a section's exception is its error (the rows it yielded
before stay), `StructuralSkip` its structural skip. `Writer` rewrites `report.json` (atomically: a call killed
mid-write leaves the previous one) and appends to `rows.jsonl` after every row, with `failures` (a line per
failed item, `failures`) and `passed` recomputed each time.
"""

from __future__ import annotations

import json
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator


class StructuralSkip(Exception):
    """A section this machine cannot run by construction (needs CUDA on a CPU run, FlashInfer where it is
    not installed); its message says why."""


@dataclass
class Check:
    """What every section reads: the device, the deadline, where results and scratch files go."""

    device: str
    deadline: float  # time.time() after which no section or server starts
    out: Path
    pair: Path | None  # the GPU check's carried tiny pair (None: not carried, or the self-check)
    workdir: Path  # scratch: server logs, written models
    report: dict = field(default_factory=dict)
    logs: object = None  # servers.ServerLogs
    source_root: Path | None = None  # a source checkout the plugin must not be imported from (environment)

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    def left(self) -> float:
        return self.deadline - time.time()

    def launch(self):
        from .servers import Launch

        return Launch(self.device, self.deadline, self.workdir, self.logs)


@dataclass(frozen=True)
class Section:
    name: str
    run: Callable[[Check], Iterator[dict]]
    verdicts: bool  # rows carry ok / skipped (correctness); False: measurements
    min_seconds: float  # not started with less time left (its rows would not finish)


def measured_row(labels: dict, measure: Callable[[dict], None], *, verdict: bool = True) -> dict:
    """One row: its labels, then what measure(row) records in it (inputs built, run, compared). An exception
    is recorded as the row's error, with ok False on a row that carries a verdict; what measure recorded
    before it stays."""
    row = dict(labels)
    try:
        measure(row)
    except Exception as exc:
        if verdict:
            row.update(ok=False, error=f"{type(exc).__name__}: {exc}")
        else:
            row["error"] = f"{type(exc).__name__}: {exc}"
    return row


def section_failures(name: str, entry: dict, verdicts: bool) -> list[str]:
    """What makes one section fail, a line each: not run, raised, no rows where a verdict is due, and every
    row that failed or erred (a `skipped` row or section is structural and passes)."""
    if "not_run" in entry:
        return [f"{name}: NOT RUN ({entry['not_run']})"]
    if "error" in entry:
        return [f"{name}: ERROR {entry['error'].strip().splitlines()[-1]}"]
    if "skipped" in entry:
        return []
    rows, out = entry.get("rows", []), []
    if verdicts and not any("ok" in r or "skipped" in r for r in rows):
        out.append(f"{name}: no rows with a verdict (nothing was checked)")
    for i, row in enumerate(rows):
        label = f"{name}[{i}]"
        errors = {k: v for k, v in row.items() if (k == "error" or k.endswith("_error")) and isinstance(v, str)}
        if errors:
            out.append(f"{label}: ERROR " + "; ".join(f"{k}: {str(v).strip().splitlines()[0]}" for k, v in errors.items()))
        elif "skipped" not in row and row.get("ok") is False:
            shown = {k: v for k, v in row.items() if not isinstance(v, (list, dict))}
            out.append(f"{label}: FAILED {shown}")
    return out


def failures(report: dict, sections: list[Section]) -> list[str]:
    return [line for s in sections for line in section_failures(s.name, report["sections"].get(s.name, {}), s.verdicts)]


class Writer:
    """report.json rewritten (atomically) and rows.jsonl appended as each row finishes."""

    def __init__(self, out: Path, report: dict, sections: list[Section]):
        self.out, self.report, self.sections = out, report, sections

    def save(self) -> None:
        self.report["failures"] = failures(self.report, self.sections)
        self.report["passed"] = not self.report["failures"]
        tmp = self.out / "report.json.tmp"
        tmp.write_text(json.dumps(self.report, indent=1, default=str) + "\n")
        tmp.replace(self.out / "report.json")

    def row(self, section: str, row: dict) -> None:
        self.report["sections"][section].setdefault("rows", []).append(row)
        with open(self.out / "rows.jsonl", "a") as f:
            f.write(json.dumps({"section": section, **row}, default=str) + "\n")
        self.save()


def run_sections(check: Check, sections: list[Section], writer: Writer, tag: str = "gpu_check") -> None:
    """Each section in order (progress lines on stdout prefixed `[tag]`), recorded in check.report."""
    for section in sections:
        entry = check.report["sections"].setdefault(section.name, {})
        if check.left() < section.min_seconds:
            entry["not_run"] = f"{check.left():.0f} s left before the call's deadline"
            writer.save()
            continue
        left = f" ({check.left():.0f} s left)" if check.left() < float("inf") else ""
        print(f"[{tag}] {section.name}{left} ...", flush=True)
        start = time.perf_counter()
        try:
            for row in section.run(check):
                writer.row(section.name, row)
                print(f"[{tag}]   {section.name}: {short(row)}", flush=True)
        except StructuralSkip as skipped:
            entry["skipped"] = str(skipped)
        except Exception:
            entry["error"] = traceback.format_exc()[-6000:]
        entry["seconds"] = round(time.perf_counter() - start, 1)
        writer.save()


def short(row: dict) -> str:
    shown = {k: v for k, v in row.items() if not isinstance(v, (list, dict)) and k not in ("output_tail",)}
    return json.dumps(shown, default=str)[:400]


def print_summary(report: dict, title: str, details: Callable[[str, list[dict]], None]) -> None:
    """A line per section (rows ok / with a verdict, or why it did not run), `details(name, rows)` under each
    section that ran, then RESULT: PASS / FAIL and every failure."""
    print(f"\n=== {title} ===")
    for name, entry in report["sections"].items():
        rows = entry.get("rows", [])
        if "not_run" in entry or "error" in entry or "skipped" in entry:
            why = entry.get("not_run") or entry.get("skipped") or entry["error"].strip().splitlines()[-1]
            print(f"{name}: {'NOT RUN' if 'not_run' in entry else 'SKIPPED' if 'skipped' in entry else 'ERROR'}: {why}")
            continue
        verdict = [r for r in rows if "ok" in r]
        print(f"{name}: {sum(bool(r['ok']) for r in verdict)}/{len(verdict)} ok"
              + (f", {sum('skipped' in r for r in rows)} skipped" if any("skipped" in r for r in rows) else "")
              + f" ({entry.get('seconds')} s)")
        details(name, rows)
    failed = report.get("failures", [])
    print(f"\nRESULT: {'FAIL' if failed else 'PASS'}" + (f" ({len(failed)} items)" if failed else ""))
    for line in failed:
        print("  " + line)
