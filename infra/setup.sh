#!/usr/bin/env bash
# Installs everything compass needs into .venv, in the order that works offline-from-hubs on a CPU machine:
# torch's CPU wheel first, DeepSpeed built without isolation against it, then the project and its pins.
# Idempotent: the Python packages sit behind a stamp (keyed on pyproject.toml and this script); each system
# package is checked on every run.
set -euo pipefail
cd "$(dirname "$0")/.."

# Byte-compiles what is installed, on every core (pip compiles on one; hence its --no-compile below). Compiled here
# or never: where PYTHONDONTWRITEBYTECODE is set (CI, this machine) nothing compiled later is kept, and every process
# would compile torch and transformers again. A file that does not compile (a template shipped as .py) is skipped,
# as pip skips it; files already compiled are checked, not compiled again.
compile_installed() {
  python -m compileall -q -j 0 "$(python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" \
    >/dev/null || true
}

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# Python packages: a stamp keyed on pyproject.toml and this script skips them when nothing changed.
stamp=".venv/.compass-setup-$(cat pyproject.toml infra/setup.sh | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo "compass: installing dependencies into .venv (first run takes a few minutes)" >&2
  . .venv/bin/activate
  export PIP_DISABLE_PIP_VERSION_CHECK=1
  pip install -q --upgrade pip wheel setuptools
  # --no-compile: everything is byte-compiled once at the end, on every core (pip compiles on one)
  pip install -q --no-compile torch==2.13.0         # the CPU wheel; an open 'torch' pulls a CUDA build
  compile_installed                                 # before DeepSpeed's build imports torch
  if ! python -c "import deepspeed" 2>/dev/null; then
    DS_BUILD_OPS=0 pip install -q --no-compile --no-build-isolation deepspeed==0.19.8
  fi
  # Before the namespace move this checkout installed as the distribution `compass` with top-level `specs`,
  # `flows`, ... packages; remove that install so only `compass.*` imports.
  if pip show compass 2>/dev/null | grep -qx "Editable project location: $PWD"; then
    pip uninstall -q -y compass
  fi
  pip install -q --no-compile -e ".[dev]"
  compile_installed
  rm -f .venv/.compass-setup-*
  touch "$stamp"
fi

# System packages: each checked on every run (`command -v` costs milliseconds), never behind the stamp, so a
# machine first set up without root gets them when the set-up runs again as root.

# Debian package lists, so deb:// sources can be downloaded (apt-get download); skipped where apt is absent.
if command -v apt-get >/dev/null 2>&1; then
  if ! ls /var/lib/apt/lists/*_Packages* >/dev/null 2>&1; then
    apt-get update -qq || echo "compass: apt-get update failed; deb:// sources will not download" >&2
  fi
  # Debian's Chromium and its driver, for the web-UI test (selenium drives them; nothing downloads a browser).
  if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then
    if [ "$(id -u)" = 0 ]; then
      apt-get install -y -qq chromium chromium-driver >/dev/null \
        || echo "compass: could not install chromium; the web-UI test will fail" >&2
    else
      echo "compass: run 'apt-get install chromium chromium-driver' as root for the web-UI test" >&2
    fi
  fi
  # Slurm and munge, for the Slurm tests (tests/slurm_cluster.py starts a one-node cluster on loopback).
  if ! command -v slurmctld >/dev/null 2>&1 || ! command -v munged >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ]; then
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null \
        || echo "compass: could not install slurm-wlm and munge; the Slurm tests will fail" >&2
    else
      echo "compass: run 'apt-get install slurm-wlm munge' as root for the Slurm tests" >&2
    fi
  fi
  # Prometheus and promtool, for `compass monitor` and the observability tests (Prometheus on loopback).
  if ! command -v prometheus >/dev/null 2>&1 || ! command -v promtool >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ]; then
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null \
        || echo "compass: could not install prometheus; compass monitor and its tests will not work" >&2
    else
      echo "compass: run 'apt-get install prometheus' as root for compass monitor and its tests" >&2
    fi
  fi
  # PostgreSQL, for `compass server --database` and the team-server tests (a cluster of their own on loopback, run
  # as the package's `postgres` user when the tests run as root: PostgreSQL refuses to run as root).
  if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && ! command -v initdb >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ]; then
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends postgresql >/dev/null \
        || echo "compass: could not install postgresql; the team-server tests will fail" >&2
    else
      echo "compass: run 'apt-get install postgresql' as root for the team-server tests" >&2
    fi
  fi
else
  echo "compass: apt-get not found: deb:// sources, the web-UI test's browser, Slurm and PostgreSQL are unavailable" >&2
fi
