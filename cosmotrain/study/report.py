"""A scale study's numbers: the measured step of a point, speedup and efficiency, and
the results files (results.json, results.csv, results.md; the plots are drawn by
:mod:`cosmotrain.study.plots`, which :func:`render` calls with the document it derived:
the plots never import the report).

The measured step of a point is its *median step*: the ``train`` records of
``metrics.jsonl`` after the warm-up steps, ordered by step time, and the middle one (the
lower of the two middle ones for an even count).  Taking one real step, rather than the
median of each phase separately, keeps its breakdown summing to its step time.
Everything derived (speedup, efficiency, prediction error) is recomputed from the points
whenever the files are written, so ``scale-study --report`` re-renders an edited or older
results.json the same way.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from cosmotrain.files.atomic import write_atomically
from cosmotrain.errors import DataError
from cosmotrain.train.outputs.metrics import TIME_KEYS, read_metrics

RESULTS_JSON, RESULTS_CSV, RESULTS_MD = "results.json", "results.csv", "results.md"
COMM_KEYS = ("halo", "channel", "redistribution", "allreduce")
STUDY_KEYS = ("config", "model", "width", "base_batch", "steps", "warmup", "launcher")
POINT_KEYS = ("name", "ranks", "strategy", "batch", "status")
PREDICTED_KEYS = ("compute", "halo", "channel", "redistribution", "allreduce", "other")
PLOTS_HINT = ("plots skipped: matplotlib, a dependency of cosmotrain, cannot be imported; "
              "reinstall cosmotrain (pip install -e .) and rerun with --report DIR")


def measure(metrics_file: Path, batch: int, warmup: int) -> dict[str, Any]:
    """The median step after ``warmup`` steps of a run's ``metrics.jsonl``."""
    records = read_metrics(metrics_file, "train")
    kept = [r for r in records if r["step"] > warmup]
    if not kept:
        raise ValueError(f"{metrics_file}: {len(records)} train record(s), none after the "
                         f"{warmup} warm-up step(s); raise --steps above --warmup")
    median = sorted(kept, key=lambda r: r["step_time_s"])[(len(kept) - 1) // 2]
    step_s = float(median["step_time_s"])
    return {"step_s": step_s, "samples_per_s": batch / step_s if step_s > 0 else 0.0,
            "time_s": dict(median["time_s"]), "comm_share": comm_share(median["time_s"]),
            "median_step": median["step"], "steps_used": len(kept),
            "step_times_s": [r["step_time_s"] for r in kept],
            "memory_hwm_mib_max": max(max(r["memory_hwm_mib"]) for r in records)}


def comm_share(seconds: Mapping[str, float]) -> float:
    """Share of a step spent in halo exchange, channel/filter collectives,
    redistribution and gradient allreduce."""
    total = sum(seconds.values())
    return sum(seconds.get(k, 0.0) for k in COMM_KEYS) / total if total > 0 else 0.0


def baseline(points: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The reference point: the fastest measured one at the smallest rank count."""
    ok = [p for p in points if p["status"] == "ok"]
    return min(ok, key=lambda p: (p["ranks"], p["measured"]["step_s"])) if ok else None


def derive(doc: dict[str, Any]) -> None:
    """Speedup, efficiency and prediction error of every point, in place.

    Strong scaling (fixed global batch): speedup = t_base / t and efficiency = speedup x
    P_base / P.  Weak scaling (fixed batch per rank): efficiency = t_base / t (ideal: a
    constant step) and speedup = throughput / base throughput (ideal: P / P_base).
    """
    base = baseline(doc["points"])
    doc["baseline"] = base["name"] if base else None
    for point in doc["points"]:
        point["speedup"] = point["efficiency"] = point["error_pct"] = None
        measured, predicted = point.get("measured"), point.get("predicted")
        if base is not None and point["status"] == "ok" and measured["step_s"] > 0:
            ratio = base["measured"]["step_s"] / measured["step_s"]
            if doc["mode"] == "strong":
                point["speedup"] = ratio
                point["efficiency"] = ratio * base["ranks"] / point["ranks"]
            else:
                point["efficiency"] = ratio
                point["speedup"] = (measured["samples_per_s"] /
                                    base["measured"]["samples_per_s"])
        if measured and predicted and measured["step_s"] > 0:
            point["error_pct"] = 100.0 * (predicted["step_s"] / measured["step_s"] - 1.0)


def document(results: Mapping[str, Any]) -> dict[str, Any]:
    """results as plain JSON data (points as dicts) with the derived numbers."""
    doc = dict(results)
    doc["points"] = [p.to_json() if hasattr(p, "to_json") else dict(p)
                     for p in results["points"]]
    derive(doc)
    return doc


def write_results(results: Mapping[str, Any], out: Path) -> Path:
    """results.json, atomically (rewritten after every point of a running study)."""
    text = json.dumps(document(results), indent=2, allow_nan=False) + "\n"
    return write_atomically(out / RESULTS_JSON, lambda tmp: tmp.write_text(text))


def load_results(out: Path) -> dict[str, Any]:
    """A study's results.json, for ``scale-study --report``."""
    path = out / RESULTS_JSON
    if not path.is_file():
        raise DataError(path, "not found", "pass the --out directory of a scale study",
                        kind="results file")
    try:
        doc = json.loads(path.read_text())
        if not isinstance(doc, dict) or not isinstance(doc.get("points"), list) \
                or doc.get("mode") not in ("strong", "weak"):
            raise ValueError("no 'points' list or 'mode'")
        missing = [k for k in STUDY_KEYS if k not in doc]
        if missing:
            raise ValueError(f"lacks {', '.join(missing)}")
        for point in doc["points"]:
            missing = [k for k in POINT_KEYS if k not in point]
            if missing or (point["status"] == "ok" and not point.get("measured")):
                raise ValueError(f"point {point.get('name', '?')} lacks "
                                 f"{', '.join(missing) or 'measured'}")
    except ValueError as err:
        raise DataError(path, f"not a scale-study results file ({err})",
                        "rerun the study or restore the file", kind="results file") from None
    return doc


def render(results: Mapping[str, Any], out: Path,
           echo: Callable[[str], None] = print) -> list[Path]:
    """results.csv, results.md and the plots from ``results``; the paths written."""
    doc = document(results)
    written = [write_atomically(out / RESULTS_CSV, lambda t: t.write_text(csv_text(doc))),
               write_atomically(out / RESULTS_MD, lambda t: t.write_text(markdown(doc)))]
    try:
        from cosmotrain.study.plots import write_plots
    except ImportError:
        echo(f"scale-study: {PLOTS_HINT}")
        return written
    return written + write_plots(doc, out)


CSV_COLUMNS = (["name", "ranks", "strategy", "origin", "batch", "status", "step_s",
                "samples_per_s", *[f"{k}_s" for k in TIME_KEYS], "comm_share",
                "memory_hwm_mib_max", "predicted_step_s", "predicted_samples_per_s",
                *[f"predicted_{k}_s" for k in PREDICTED_KEYS], "predicted_memory_mib",
                "error_pct", "speedup", "efficiency", "exit_code", "reason"])


def csv_row(point: Mapping[str, Any]) -> dict[str, Any]:
    """One point as a results.csv row (empty cells for what it lacks)."""
    measured, predicted = point.get("measured") or {}, point.get("predicted") or {}
    row = {key: point.get(key) for key in ("name", "ranks", "strategy", "batch", "status",
                                           "error_pct", "speedup", "efficiency",
                                           "exit_code", "reason")}
    row["origin"] = " ".join(point.get("origin", []))
    for key in ("step_s", "samples_per_s", "comm_share", "memory_hwm_mib_max"):
        row[key] = measured.get(key)
    for key in TIME_KEYS:
        row[f"{key}_s"] = (measured.get("time_s") or {}).get(key)
    row["predicted_step_s"] = predicted.get("step_s")
    row["predicted_samples_per_s"] = predicted.get("samples_per_s")
    row["predicted_memory_mib"] = predicted.get("memory_mib")
    for key in PREDICTED_KEYS:
        row[f"predicted_{key}_s"] = (predicted.get("time_s") or {}).get(key)
    return {key: "" if value is None else value for key, value in row.items()}


def csv_text(doc: Mapping[str, Any]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_COLUMNS, lineterminator="\n")
    writer.writeheader()
    for point in doc["points"]:
        writer.writerow(csv_row(point))
    return buffer.getvalue()


def _num(value: float | None, fmt: str = ".4g") -> str:
    return "" if value is None else format(value, fmt)


def strategy_label(point: Mapping[str, Any]) -> str:
    """The strategy, marked ``(plan)`` when it is the planner's choice."""
    plan = "plan" in point.get("origin", []) and point["strategy"] != "plan"
    return point["strategy"] + (" (plan)" if plan else "")


def markdown(doc: Mapping[str, Any]) -> str:
    """results.md: what was measured, one table row per point, the reasons of the rest."""
    lines = [f"# Scale study: {doc['mode']} scaling of {Path(doc['config']).name}", "",
             *_preamble(doc), "",
             "| ranks | strategy | batch | step s | predicted s | error % | samples/s | "
             "speedup | efficiency | comm % | memory MiB | status |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for p in doc["points"]:
        m, pred = p.get("measured") or {}, p.get("predicted") or {}
        share = m.get("comm_share")
        lines.append(
            f"| {p['ranks']} | {strategy_label(p)} | {p['batch']} | {_num(m.get('step_s'))} | "
            f"{_num(pred.get('step_s'))} | {_num(p.get('error_pct'), '+.1f')} | "
            f"{_num(m.get('samples_per_s'))} | {_num(p.get('speedup'), '.2f')} | "
            f"{_num(p.get('efficiency'), '.2f')} | "
            f"{_num(None if share is None else 100 * share, '.1f')} | "
            f"{_num(m.get('memory_hwm_mib_max'), '.0f')} | {p['status']} |")
    others = [p for p in doc["points"] if p["status"] != "ok"]
    if others:
        lines += ["", "Not measured:", ""]
        lines += [f"- {p['name']} ({p['status']}"
                  + (f", exit {p['exit_code']}" if p["status"] == "failed" else "")
                  + f"): {p['reason']}" for p in others]
    return "\n".join(lines) + "\n"


def _preamble(doc: Mapping[str, Any]) -> list[str]:
    batch = (f"global batch {doc['base_batch']} at every rank count" if doc["mode"] == "strong"
             else f"batch {doc['base_batch']} per rank (global batch {doc['base_batch']} x P)")
    base = next((p for p in doc["points"] if p["name"] == doc.get("baseline")), None)
    lines = [f"Model `{doc['model']}` at W={doc['width']}, {batch}; {doc['steps']} steps per "
             f"point, the median step after {doc['warmup']} warm-up step(s).  Launcher: "
             f"{doc['launcher']}; created {doc.get('created', '?')} on {doc.get('host', '?')}.",
             *[f"{note[0].upper()}{note[1:]}." for note in doc.get("notes", [])]]
    if base is not None:
        lines.append(f"Speedup and efficiency are relative to {base['name']} "
                     f"({base['measured']['step_s']:.4g} s/step on {base['ranks']} rank(s)); "
                     f"error % = predicted / measured - 1; comm % = halo, channel, "
                     f"redistribution and allreduce time of the step.")
    return lines
