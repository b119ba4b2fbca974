#!/usr/bin/env bash
# Installs everything compass needs into .venv, in the order that works offline-from-hubs on a CPU machine:
# torch's CPU wheel first, DeepSpeed built without isolation against it, then the locked set
# (infra/requirements.lock: what the suite last passed with) and the project. Idempotent: the Python packages sit
# behind a stamp (keyed on pyproject.toml, the lock and this script); each system package is checked on every run.
set -euo pipefail
cd "$(dirname "$0")/.."

UV_VERSION=0.13.9

uv_sources() {  # pip's find-links, indexes and constraints (pip.conf, PIP_* variables) as uv arguments
  local links extra index constraint
  links="$(pip config get global.find-links 2>/dev/null || true) ${PIP_FIND_LINKS:-}"
  extra="$(pip config get global.extra-index-url 2>/dev/null || true) ${PIP_EXTRA_INDEX_URL:-}"
  index="${PIP_INDEX_URL:-$(pip config get global.index-url 2>/dev/null || true)}"
  constraint="$(pip config get global.constraint 2>/dev/null || true) ${PIP_CONSTRAINT:-}"
  for link in $links; do [ -e "${link#file://}" ] && printf -- '--find-links\n%s\n' "$link"; done
  for url in $extra; do
    case "$url" in file://*) [ -e "${url#file://}" ] || continue ;; esac
    printf -- '--extra-index-url\n%s\n' "$url"
  done
  [ -n "$index" ] && printf -- '--index-url\n%s\n' "$index"
  for file in $constraint; do [ -e "$file" ] && printf -- '--constraint\n%s\n' "$file"; done
  printf -- '--index-strategy\nunsafe-best-match\n'  # pip's way: the best version on any index
  return 0
}

# uv takes each version's files from the first index holding it, pip the wheel this Python ranks highest: where a
# local mirror holds only an older Python's wheel or only a pure-Python fallback, they differ (see
# infra/wheel_choice.py). Each such distribution is installed again with pip, which chooses as a pip set-up would.
reinstall_as_pip_chooses() {
  local links extra stale
  links="$(pip config get global.find-links 2>/dev/null || true) ${PIP_FIND_LINKS:-}"
  extra="$(pip config get global.extra-index-url 2>/dev/null || true) ${PIP_EXTRA_INDEX_URL:-}"
  # shellcheck disable=SC2086
  stale=$(python infra/wheel_choice.py $links $extra)
  if [ -n "$stale" ]; then
    echo "compass: installing again as pip chooses: $(echo $stale)" >&2
    # shellcheck disable=SC2086
    pip install -q --no-compile --no-deps --force-reinstall $stale
  fi
}

install_with_uv() {
  pip install -q "uv==$UV_VERSION" || return 1
  local sources
  mapfile -t sources < <(uv_sources)
  # torch first: DeepSpeed builds against it, without isolation
  uv pip install -q "${sources[@]}" "$(grep '^torch==' infra/requirements.lock)" || return 1
  DS_BUILD_OPS=0 uv pip install -q "${sources[@]}" --no-build-isolation-package deepspeed \
    -r infra/requirements.lock || return 1
  uv pip install -q "${sources[@]}" -e ".[dev]" || return 1
  reinstall_as_pip_chooses
}

install_with_pip() {
  pip install -q --upgrade pip wheel setuptools
  pip install -q --no-compile torch==2.13.0         # the CPU wheel; an open 'torch' pulls a CUDA build
  compile_installed                                 # before DeepSpeed's build imports torch
  if ! python -c "import deepspeed" 2>/dev/null; then
    DS_BUILD_OPS=0 pip install -q --no-compile --no-build-isolation deepspeed==0.19.8
  fi
  pip install -q --no-compile -e ".[dev]"
}

# Byte-compiles what is installed, on every core: only where pip builds DeepSpeed, whose build imports torch.
# Otherwise nothing is compiled here: the Makefile's commands run with bytecode writing on (it unexports
# PYTHONDONTWRITEBYTECODE), so the first process importing a module compiles it once and every later one reads the
# .pyc. The suite imports 13k of the venv's 36k files: compiling all of them here cost 59 s of wall time on 2 cores
# (103 s of CPU) before the first test, the lazy way ~30 s of CPU spread over the run.
compile_installed() {
  python -m compileall -q -j 0 "$(python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" \
    >/dev/null || true
}

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# Python packages: a stamp keyed on pyproject.toml, the lock and this script skips them when nothing changed.
stamp=".venv/.compass-setup-$(cat pyproject.toml infra/setup.sh infra/requirements.lock | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo "compass: installing dependencies into .venv (first run takes a minute or two)" >&2
  . .venv/bin/activate
  export PIP_DISABLE_PIP_VERSION_CHECK=1
  # Before the namespace move this checkout installed as the distribution `compass` with top-level `specs`,
  # `flows`, ... packages; remove that install so only `compass.*` imports.
  if pip show compass 2>/dev/null | grep -qx "Editable project location: $PWD"; then
    pip uninstall -q -y compass
  fi
  # uv installs the locked set in parallel (~1 min against pip's ~4); pip's find-links, indexes and constraints
  # are passed on. Where uv cannot (no uv wheel, or no CPU torch wheel the lock names), pip installs them.
  if ! install_with_uv; then
    echo "compass: uv could not install infra/requirements.lock; installing with pip" >&2
    install_with_pip
  fi
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
