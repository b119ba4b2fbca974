"""A Prometheus for one run's monitoring folder: it discovers the training ranks from the files they register
under `targets/` (file service discovery), evaluates the shipped alert rules, and listens on loopback unless told
otherwise. Debian's `prometheus` package provides the binary (infra/setup.sh installs it)."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from compass.infra.die_with_parent import die_with_parent

RULES = Path(__file__).resolve().parent / "observability" / "compass-alerts.rules.yml"
DASHBOARD = Path(__file__).resolve().parent / "observability" / "grafana-dashboard.json"


def write_config(folder: Path, scrape_interval_s: float = 5.0) -> Path:
    """prometheus.yml in `folder`: every rank's endpoint from targets/*.json, with its own labels kept."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "targets").mkdir(exist_ok=True)
    interval = f"{max(1, round(scrape_interval_s))}s"
    config = {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "rule_files": [str(RULES)],
        "scrape_configs": [{
            "job_name": "compass",
            "honor_labels": True,  # run, step, stage, node, rank come from the ranks themselves
            "file_sd_configs": [{"files": [str(folder / "targets" / "*.json")], "refresh_interval": interval}],
        }],
    }
    path = folder / "prometheus.yml"
    path.write_text(json.dumps(config, indent=1))  # JSON is YAML
    return path


def binary() -> str:
    found = shutil.which("prometheus")
    if not found:
        raise FileNotFoundError("prometheus is not installed: `make setup` installs Debian's prometheus as root "
                                "(apt-get install prometheus)")
    return found


def start(folder: Path, port: int, listen: str = "127.0.0.1", scrape_interval_s: float = 5.0,
          tied: bool = False) -> subprocess.Popen:
    """Start Prometheus on `listen:port` with its data in `folder/prometheus-data`; `tied`: it dies with us."""
    config = write_config(folder, scrape_interval_s)
    log = open(folder / "prometheus.log", "ab")  # noqa: SIM115 (the child holds it)
    return subprocess.Popen(
        [binary(), f"--config.file={config}", f"--storage.tsdb.path={folder / 'prometheus-data'}",
         f"--web.listen-address={listen}:{port}", "--web.enable-lifecycle"],
        stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent if tied else None)


def query(url: str, expr: str, timeout: float = 10) -> list[dict[str, Any]]:
    """An instant query through Prometheus's HTTP API: [{metric: {...}, value: [time, "v"]}, ...]."""
    with urllib.request.urlopen(f"{url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}",
                                timeout=timeout) as response:
        body = json.load(response)
    if body.get("status") != "success":
        raise RuntimeError(f"Prometheus query {expr!r} failed: {body}")
    return body["data"]["result"]
