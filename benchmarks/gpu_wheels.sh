#!/usr/bin/env bash
# The GPU node kit, prepared on this (CPU, networked) machine for a GPU node without network:
#   .whl/         cp312 manylinux x86_64 wheels of what tests/gpu and benchmarks/gpu_throughput.py import and the
#                 node's image lacks (the node: Python 3.12, torch 2.11+cu130, transformers 5.17, accelerate 1.15,
#                 huggingface_hub 1.33, tokenizers 0.23.2, safetensors, numpy, pandas, pyarrow, peft, pytest, ...)
#   .devkit/data  the minimal spec's data artifacts (the node cannot run the data steps: no datatrove/spaCy),
#                 built here by benchmarks/gpu_session/build_data.py for the `prebuilt_data` pytest plugin
# Both folders are git-ignored (.git/info/exclude); travel them with the run's carry: [".whl", ".devkit"].
# On the node, benchmarks/gpu_session.sh installs and runs everything.
#
#   bash benchmarks/gpu_wheels.sh            # fetches what .whl lacks; rebuilds .devkit/data (KEEP_DATA=1: keeps it)
#   FRESH=1 bash benchmarks/gpu_wheels.sh    # start both folders over
#
# Pins: the versions of this repository's .venv (`.venv/bin/pip freeze`), except where the node's own copy is
# compatible (huggingface_hub 1.33, accelerate 1.15, tokenizers 0.23.2, safetensors: kept from the node).
# Not shipped, so their tests fail with the install command, as intended: flash-attn (a CUDA build, hundreds of
# MB), bitsandbytes (tens of MB), vllm.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
WHL=$REPO/.whl
DEVKIT=$REPO/.devkit
PY=${PY:-python3}                 # any python with pip: the flags below choose the node's wheels
VENV_PY=${VENV_PY:-$REPO/.venv/bin/python}

for line in /.whl/ /.devkit/; do  # keep the kit out of git (a local exclude: .gitignore is not touched)
  mkdir -p .git/info && touch .git/info/exclude
  grep -qxF "$line" .git/info/exclude || echo "$line" >>.git/info/exclude
done
if [[ -n "${FRESH:-}" ]]; then rm -rf "$WHL" "$DEVKIT"; fi
mkdir -p "$WHL" "$DEVKIT"

# name==version: a binary wheel (cp312 manylinux) or a pure one (py3-none-any) of each; one version of each.
WHEELS=(
  # compass's specs and manifests (every test imports them)
  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0
  ruamel.yaml==0.19.1 ruamel.yaml.clib==0.2.15 fsspec==2026.6.0
  # compiling any plan imports every step kind, the data kinds' datatrove.io among them (the data steps never run
  # there: datatrove's processing extras, spaCy, ... are not shipped)
  datatrove==0.10.1 loguru==0.7.3 humanize==4.17.0
  # the model code's transformers (the node has 5.17) and the regex it asks for
  transformers==5.23.0 regex==2026.11.19
  # post-training on the GPU (TRL's SFT rank, LoRA)
  trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 xxhash==3.8.2 peft==0.21.2
  # DeepSpeed's runtime dependencies (the engine itself is built below)
  hjson==3.1.0 msgpack==1.2.4 ninja==1.13.2 py-cpuinfo==9.0.0 einops==0.8.2
  # `compass preflight` (tests/gpu/test_preflight_on_cuda.py runs the CLI): its store root comes from
  # compass.flows.lifecycle, which imports prefect; what `import prefect` loads (no server runs)
  prefect==3.8.8 pydantic-settings==2.16.3 pydantic-extra-types==2.11.1 python-dotenv==1.2.4 asgi-lifespan==2.1.0
  starlette==1.10.0 cachetools==7.3.3 cloudpickle==3.1.3 coolname==5.0.0 exceptiongroup==1.3.2 griffecli==2.4.1
  griffelib==2.4.1 jsonpointer==3.12 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0
  rpds-py==2026.9.1 rfc3339-validator==0.1.4 orjson==3.13.0 pathspec==1.1.1 pendulum==3.3.0 tzdata==2026.6
  python-slugify==9.0.0 text-unidecode==1.3 toml==0.10.2 websockets==16.1.1 amplitude-analytics==1.3.0
  opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2
  opentelemetry-proto==1.45.2 opentelemetry-exporter-http-transport==0.66b2 opentelemetry-exporter-otlp-common==0.66b2
  opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-exporter-otlp-proto-http==1.45.2
  opentelemetry-exporter-prometheus==0.66b2 attrs==26.1.0 sniffio==1.3.1
  # Liger's fused loss (GPU extra)
  liger-kernel==0.8.5
  # each training rank's telemetry: Prometheus endpoint, TensorBoard event files
  prometheus_client==0.26.0 tensorboard==2.21.0 protobuf==7.36.2 absl-py==2.5.1
)
DEEPSPEED=deepspeed==0.19.8

norm() { echo "$1" | tr 'A-Z_.' 'a-z--'; }   # a distribution name as pip compares them
have() {  # a wheel of name==version already in .whl
  local name version f
  name=$(norm "${1%%==*}") version=${1##*==}
  for f in "$WHL"/*.whl; do
    [[ -e "$f" ]] || continue
    f=$(basename "$f")
    [[ "$(norm "${f%%-*}")" == "$name" && "$(echo "$f" | cut -d- -f2)" == "$version" ]] && return 0
  done
  return 1
}

if [[ -x "$VENV_PY" ]]; then  # say where a pin left the venv's version (the venv is what the CPU tests prove)
  freeze=$("$VENV_PY" -m pip freeze 2>/dev/null || true)
  for req in "${WHEELS[@]}" "$DEEPSPEED"; do
    name=$(norm "${req%%==*}")
    got=$(echo "$freeze" | awk -F'==' -v n="$name" '{k=tolower($1); gsub(/[_.]/,"-",k); if (k==n) print $2}')
    [[ -z "$got" || "$got" == "${req##*==}" ]] || echo "note: $req here, the .venv has ${got}" >&2
  done
fi

drop_other_versions() {  # a pin that moved: its old wheel goes (one version of each name)
  local name f
  name=$(norm "${1%%==*}")
  for f in "$WHL"/*.whl; do
    [[ -e "$f" && "$(norm "$(basename "$f" | cut -d- -f1)")" == "$name" ]] && { echo "removing $(basename "$f")"; rm -f "$f"; }
  done
  return 0
}
missing=()
for req in "${WHEELS[@]}"; do have "$req" || { drop_other_versions "$req"; missing+=("$req"); }; done
have "$DEEPSPEED" || drop_other_versions "$DEEPSPEED"
if ((${#missing[@]})); then
  echo "downloading ${#missing[@]} wheels: ${missing[*]}"
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$WHL" "${missing[@]}" 2> >(grep -v 'is ignored: it is neither' >&2)
fi

# Payloads nothing on the node reads, cut from three wheels (RECORD updated; same name and version): datatrove's
# URL-filter blocklist (18 MB unpacked, read by the data steps' URLFilter only), Prefect's two web UI bundles
# (5 MB: no Prefect server runs there) and TensorBoard's web UI (4 MB: only torch's SummaryWriter runs there).
SLIM=(datatrove/assets/url_filterblacklists prefect/server/ui/ prefect/server/ui-v2/ tensorboard/webfiles.zip)
for f in "$WHL"/datatrove-*.whl "$WHL"/prefect-*.whl "$WHL"/tensorboard-*.whl; do
  [[ -e "$f" ]] || continue
  "$VENV_PY" - "$f" "${SLIM[@]}" <<'PYTHON'
import os, sys, zipfile
path, drop = sys.argv[1], tuple(sys.argv[2:])
with zipfile.ZipFile(path) as z:
    if any(n.startswith(drop) for n in z.namelist()):
        with zipfile.ZipFile(path + ".tmp", "w", zipfile.ZIP_DEFLATED) as out:
            for info in z.infolist():
                if info.filename.startswith(drop):
                    continue
                data = z.read(info)
                if info.filename.endswith(".dist-info/RECORD"):
                    data = b"".join(line for line in data.splitlines(keepends=True)
                                    if not line.decode().startswith(drop))
                out.writestr(info, data)
        os.replace(path + ".tmp", path)
        print(f"cut {os.path.basename(path)} to {os.path.getsize(path):,} bytes")
PYTHON
done

if ! have "$DEEPSPEED"; then
  # No prebuilt ops (DS_BUILD_OPS=0): a pure wheel; on CUDA it JIT-builds an op only if one is asked for (compass
  # passes torch's AdamW). Its setup.py imports torch: built with the .venv's, without build isolation.
  echo "building $DEEPSPEED (DS_BUILD_OPS=0)"
  tmp=$(mktemp -d)
  DS_BUILD_OPS=0 "$VENV_PY" -m pip download -q --no-deps --no-binary=:all: -d "$tmp" "$DEEPSPEED" \
    2> >(grep -v 'is ignored: it is neither' >&2)
  DS_BUILD_OPS=0 "$VENV_PY" -m pip wheel -q --no-deps --no-build-isolation -w "$WHL" "$tmp"/deepspeed-*.tar.gz
  rm -rf "$tmp"
fi

# Exactly one wheel per name, each a cp312 manylinux x86_64 or a pure one.
bad=0
for f in "$WHL"/*.whl; do
  b=$(basename "$f")
  case "$b" in
    *-py3-none-any.whl | *-py2.py3-none-any.whl | *-py312-none-any.whl) ;;
    *-cp312-cp312-*manylinux*x86_64*.whl | *-cp3*-abi3-*manylinux*x86_64*.whl | *-py3-none-*manylinux*x86_64*.whl) ;;
    *) echo "not a wheel for the node: $b" >&2; bad=1 ;;
  esac
done
dups=$(for f in "$WHL"/*.whl; do norm "$(basename "$f" | cut -d- -f1)"; done | sort | uniq -d)
[[ -z "$dups" ]] || { echo "more than one version of: $dups" >&2; bad=1; }
((bad == 0)) || exit 1

if [[ -z "${KEEP_DATA:-}" || ! -f "$DEVKIT/data/data.json" ]]; then  # 15 s: rebuilt, so it follows the code
  echo "building the minimal spec's data artifacts into .devkit/data"
  mkdir -p "$DEVKIT/tmp"
  OMP_NUM_THREADS=1 GPU_KIT_SCRATCH="$DEVKIT/tmp" "$VENV_PY" benchmarks/gpu_session/build_data.py "$DEVKIT/data"
  rm -rf "$DEVKIT/tmp"
fi

ls -l "$WHL" | awk 'NR > 1 {printf "%9d  %s\n", $5, $9}'
du -sh "$WHL" "$DEVKIT"
echo "kit ready: run benchmarks/gpu_session.sh on the node with carry [\".whl\", \".devkit\"]"
