"""Writes grafana-dashboard.json: a panel for every metric a training rank exports, by node and rank, in the
playbook's three layers (algorithm, system, hardware), with the alert rules' thresholds drawn.

    python -m compass.infra.observability.dashboard   # rewrites the JSON beside this file
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

OUT = Path(__file__).with_name("grafana-dashboard.json")
SELECT = 'run=~"$run", step=~"$step", node=~"$node", rank=~"$rank"'
BY_RANK = "{{node}} rank {{rank}}"

# (title, PromQL, unit, alert threshold or None, legend); thresholds are the alert rules' (compass-alerts.rules.yml)
ROWS: dict[str, list[tuple[str, str, str, float | None, str]]] = {
    "Algorithm": [
        ("Loss", f"compass_train_loss{{{SELECT}}}", "none", None, BY_RANK),
        ("Gradient norm", f"compass_train_grad_norm{{{SELECT}}}", "none", None, BY_RANK),
        ("Learning rate", f"compass_train_learning_rate{{{SELECT}}}", "none", None, BY_RANK),
        ("Optimizer step", f"compass_train_step{{{SELECT}}}", "none", None, BY_RANK),
        ("Tokens seen", f"compass_train_tokens{{{SELECT}}}", "short", None, BY_RANK),
    ],
    "System": [
        ("Throughput (tokens/s)", f"compass_train_tokens_per_second{{{SELECT}}}", "short", None, BY_RANK),
        ("MFU", f"compass_train_mfu{{{SELECT}}}", "percentunit", None, BY_RANK),
        ("Step time", f"compass_train_step_seconds{{{SELECT}}}", "s", None, BY_RANK),
        ("Where step time goes", f"compass_train_phase_seconds{{{SELECT}}}", "s", None,
         "{{node}} rank {{rank}} {{phase}}"),
        ("Share of step time waiting for data",
         f'compass_train_phase_seconds{{phase="data_wait", {SELECT}}} / ignoring(phase) '
         f"compass_train_step_seconds{{{SELECT}}}", "percentunit", 0.2, BY_RANK),
        ("Goodput: the stage's time by cause (compute is goodput)", f"compass_train_stage_seconds{{{SELECT}}}", "s",
         None, "{{node}} rank {{rank}} {{cause}}"),
        ("Seconds since the last step (hung rank)", f"time() - compass_train_last_step_timestamp_seconds{{{SELECT}}}",
         "s", 600, BY_RANK),
        ("Host memory (RSS)", f"compass_host_memory_rss_bytes{{{SELECT}}}", "bytes", None, BY_RANK),
        ("Host CPU", f"compass_host_cpu_percent{{{SELECT}}}", "percent", None, BY_RANK),
    ],
    "Hardware": [
        ("GPU temperature", f"compass_gpu_temperature_celsius{{{SELECT}}}", "celsius", 85, BY_RANK),
        ("GPU power", f"compass_gpu_power_watts{{{SELECT}}}", "watt", None, BY_RANK),
        ("GPU SM clock", f"compass_gpu_sm_clock_mhz{{{SELECT}}}", "rothz", None, BY_RANK),
        ("GPU utilisation", f"compass_gpu_utilization_percent{{{SELECT}}}", "percent", None, BY_RANK),
        ("GPU memory used", f"compass_gpu_memory_used_bytes{{{SELECT}}}", "bytes", None, BY_RANK),
        ("GPU throttling", f"compass_gpu_throttling{{{SELECT}}}", "none", 1, "{{node}} rank {{rank}} {{reason}}"),
        ("GPU uncorrected ECC errors", f"compass_gpu_ecc_errors_uncorrected{{{SELECT}}}", "none", 1, BY_RANK),
    ],
}


def panel(panel_id: int, title: str, expr: str, unit: str, threshold: float | None, legend: str, x: int,
          y: int) -> dict[str, Any]:
    steps: list[dict[str, Any]] = [{"color": "green", "value": None}]
    if threshold is not None:
        steps.append({"color": "red", "value": threshold})
    return {
        "id": panel_id, "type": "timeseries", "title": title,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 8, "x": x, "y": y},
        "targets": [{"refId": "A", "expr": expr, "legendFormat": legend}],
        "fieldConfig": {"defaults": {"unit": unit, "thresholds": {"mode": "absolute", "steps": steps},
                                     "custom": {"thresholdsStyle": {"mode": "line" if threshold is not None
                                                                    else "off"}}},
                        "overrides": []},
    }


def variable(name: str, label: str) -> dict[str, Any]:
    return {"name": name, "type": "query", "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "query": f"label_values(compass_train_step, {label})", "includeAll": True, "multi": True,
            "current": {"text": "All", "value": "$__all"}, "refresh": 2}


def dashboard() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    y, panel_id = 0, 1
    for row, entries in ROWS.items():
        panels.append({"id": panel_id, "type": "row", "title": row, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        panel_id, y = panel_id + 1, y + 1
        for i, entry in enumerate(entries):
            panels.append(panel(panel_id, *entry, x=(i % 3) * 8, y=y + (i // 3) * 8))
            panel_id += 1
        y += 8 * ((len(entries) + 2) // 3)
    datasource = {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"}
    return {
        "title": "compass training", "uid": "compass-training", "schemaVersion": 39, "version": 1,
        "tags": ["compass"], "timezone": "browser", "refresh": "10s",
        "time": {"from": "now-6h", "to": "now"},
        "templating": {"list": [datasource, *(variable(v, v) for v in ("run", "step", "node", "rank"))]},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=1) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
