#!/usr/bin/env bash
# The one command a GPU window runs (docs/gpu.md). From the repository root, on a bare GPU machine whose image
# already has torch (CUDA), Triton, pytest, hypothesis and transformers: it installs nothing, and imports multihead,
# the tests' helpers and the benchmarks from this checkout (PYTHONPATH=src:tests:benchmarks).
#
#   scripts/gpu_check.sh [--part 1|2|3|4|all] [--out DIR] [--smoke]
#
#   part 1  env.txt, env.json: nvidia-smi, versions (torch, CUDA, cuDNN, Triton), the device, multihead's import;
#           tests.txt, tests.xml: the portable test suite on CUDA (pytest -m portable --device cuda)
#   part 2  gpu_kernels.{json,md,log}: auto and each multihead backend against torch SDPA's flash, cuDNN and
#           efficient kernels and compiled FlexAttention (benchmarks/gpu_kernels.py)
#   part 3  gpu_heads.{json,md,log}: exact per-head weights on a Llama-shaped layer (benchmarks/gpu_heads.py);
#           host_overhead.{json,md,log}: decode latency, auto against torch SDPA and the cached layer step
#           (benchmarks/host_overhead.py --device cuda)
#   part 4  parallel_nccl.{txt,xml}: the equality tests of multihead.parallel and the transformers split on CUDA,
#           NCCL, one process per GPU (world sizes above the GPU count skip); parallel_shared.{txt,xml}: the same
#           tests with the ranks sharing the GPUs over gloo (MULTIHEAD_RANKS_SHARE_GPU=1: 2 to 4 processes on one GPU)
#
# Each part fits one device call of at most 9 minutes (each step has its own timeout, and the benchmarks keep
# what they measured when cut short); the default runs all four. Everything goes into one folder: --out, else
# $OUT when set (the device tool's folder that comes back), else gpu-check/. summary-part<N>.txt lists each
# step's status, exit code and seconds; the script exits 1 when a step failed, 0 otherwise.
#
# --smoke runs the same steps on the CPU with tiny sizes (n = 64/128, 1-2 rounds, a small test selection), so
# tests/core/test_gpu_check.py keeps this script from rotting on machines without a GPU.
set -uo pipefail

usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }

PART=all
SMOKE=0
OUT_DIR="${OUT:-gpu-check}"
while [ $# -gt 0 ]; do
    case "$1" in
        --part) PART="${2:-}"; shift 2 ;;
        --part=*) PART="${1#--part=}"; shift ;;
        --out) OUT_DIR="${2:-}"; shift 2 ;;
        --out=*) OUT_DIR="${1#--out=}"; shift ;;
        --smoke) SMOKE=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument '$1'. Usage: scripts/gpu_check.sh [--part 1|2|3|4|all] [--out DIR] [--smoke]" >&2; exit 2 ;;
    esac
done
case "$PART" in
    1|2|3|4|all) ;;
    *) echo "gpu_check.sh: --part: expected 1, 2, 3, 4 or all, got '$PART'" >&2; exit 2 ;;
esac
if [ -z "$OUT_DIR" ]; then
    echo "gpu_check.sh: --out: expected a folder, got an empty string" >&2
    exit 2
fi

cd "$(dirname "$0")/.." || exit 2
mkdir -p "$OUT_DIR" || { echo "gpu_check.sh: cannot create the output folder '$OUT_DIR'" >&2; exit 2; }
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
PY="${PYTHON:-python}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
# This checkout's multihead, the tests' helpers and the benchmarks; a PYTHONPATH already set comes first.
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}src:tests:benchmarks"
export PYTHONDONTWRITEBYTECODE=1
# Tests never read the user's home (tests/conftest.py holds the same rule); the compile caches stay in the run.
export HOME="${TMPDIR:-/tmp}/gpu-check-home-$$"
mkdir -p "$HOME"
unset MULTIHEAD_CACHE XDG_CACHE_HOME XDG_CONFIG_HOME

if [ "$SMOKE" = 1 ]; then
    DEVICE=cpu
    SMOKE_FLAG=--smoke
    # one thread: on a small shared CPU, two threads waiting on each other stall the tiny calls
    export OMP_NUM_THREADS=1
else
    DEVICE=cuda
    SMOKE_FLAG=
    if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
        version="$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo 'not importable')"
        echo "gpu_check.sh: no CUDA device is visible to torch ($version) on this machine." >&2
        echo "Fix: run it on a GPU machine (docs/gpu.md), or pass --smoke to check the script on the CPU." >&2
        exit 2
    fi
fi

FAILED=0
SUMMARY=
# step NAME TIMEOUT_S LOG COMMAND...: run COMMAND under `timeout`, its output into LOG, and record the outcome.
step() {
    local name="$1" limit="$2" log="$3"
    shift 3
    local started=$SECONDS rc status
    echo "== $name (timeout ${limit}s) -> $log"
    # through bash so COMMAND may be one of the functions below (exported); timeout signals the whole group
    timeout --signal=INT --kill-after=20 "$limit" bash -c '"$@"' _ "$@" >"$log" 2>&1
    rc=$?
    case "$rc" in
        0) status=ok ;;
        124|137) status="timed out after ${limit}s" ;;
        *) status=failed ;;
    esac
    if [ "$rc" = 5 ] && { [ "${name%%_*}" = tests ] || [ "${name%%_*}" = parallel ]; }; then
        status="no tests selected"  # pytest's 5: nothing in the selection carries the marker (not a failure)
    fi
    case "$status" in ok|"no tests selected") ;; *) FAILED=1 ;; esac
    [ "$rc" = 0 ] || tail -n 20 "$log" | sed 's/^/   | /'
    echo "   $name: $status (exit $rc, $((SECONDS - started)) s)"
    SUMMARY="${SUMMARY}${name}	${status}	exit ${rc}	$((SECONDS - started)) s	${log#"$OUT_DIR"/}
"
}

# ---------------------------------------------------------------------------------------------------- part 1

environment() {
    {
        echo "# gpu_check.sh environment report ($(date -u +%Y-%m-%dT%H:%M:%SZ)), smoke=$SMOKE"
        echo "## uname"; uname -a
        echo "## git"; git rev-parse HEAD 2>/dev/null || echo "not a git checkout"
        git status --porcelain 2>/dev/null | head -n 20
        echo "## nvidia-smi"
        if command -v nvidia-smi >/dev/null 2>&1; then nvidia-smi; else echo "nvidia-smi: not found"; fi
        echo "## python"
        "$PY" - "$OUT_DIR/env.json" <<'EOF'
import json, platform, sys
from importlib import metadata

def version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None

import torch

info = {
    "python": platform.python_version(),
    "executable": sys.executable,
    "torch": torch.__version__,
    "cuda": torch.version.cuda,
    "cuda_available": torch.cuda.is_available(),
    "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
    "packages": {name: version(name) for name in ("triton", "pytest", "hypothesis", "transformers", "numpy")},
    "devices": [],
}
if torch.cuda.is_available():
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        info["devices"].append({
            "index": index,
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "memory_gib": round(props.total_memory / 2**30, 1),
            "multiprocessors": props.multi_processor_count,
        })
    info["flash_sdp_enabled"] = torch.backends.cuda.flash_sdp_enabled()
    info["cudnn_sdp_enabled"] = torch.backends.cuda.cudnn_sdp_enabled()
    info["mem_efficient_sdp_enabled"] = torch.backends.cuda.mem_efficient_sdp_enabled()
try:
    import multihead

    info["multihead"] = {"version": multihead.__version__, "file": multihead.__file__, "import": "ok"}
except Exception as error:  # the report says why, whatever it is
    info["multihead"] = {"import": f"{type(error).__name__}: {error}"}
with open(sys.argv[1], "w") as out:
    json.dump(info, out, indent=1)
for key, value in info.items():
    print(f"{key}: {value}")
sys.exit(0 if info["multihead"]["import"] == "ok" else 1)
EOF
    } 2>&1
}

# Test files to leave out, as they would fail at collection: on an image whose transformers is outside the
# integration's tested range (TRANSFORMERS_TESTED in multihead.integrations.transformers_versions) the files that
# import transformers at the top, directly or through another test module (the integration refuses that version, by
# design); and files importing a package the image lacks (matplotlib, playwright, ...: it installs nothing). Each
# is named with its reason in tests-ignored.txt. With everything installed and in range nothing is left out.
transformers_ignores() {
    "$PY" - <<'EOF'
import ast, importlib.util, re, sys
from importlib import metadata
from pathlib import Path

from multihead.integrations.transformers_versions import TRANSFORMERS_TESTED

def key(text):
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])

try:
    installed = metadata.version("transformers")
except metadata.PackageNotFoundError:
    installed = None
in_range = installed is not None and key(TRANSFORMERS_TESTED[0]) <= key(installed) <= key(TRANSFORMERS_TESTED[1])
if not in_range:
    print(f"# transformers {installed} is outside the tested range {TRANSFORMERS_TESTED[0]} to "
          f"{TRANSFORMERS_TESTED[1]}: the files importing it are left out", file=sys.stderr)
SAFE = "multihead.integrations.transformers_versions"  # free of transformers by design

def imports_transformers(module):
    top = module.split(".")[0]
    return top in ("transformers", "sentence_transformers") or (
        module.startswith("multihead.integrations.transformers") and not (module + ".").startswith(SAFE + ".")
    )

# the helpers at tests/ and the tests of each wing (core, lab, cli); tests/fuzz keeps to the packages it imports
files = [*Path("tests").glob("*.py"), *(path for wing in ("core", "lab", "cli") for path in Path("tests", wing).glob("*.py"))]
modules = {path.stem: path for path in files}
local = {*modules, *(path.stem for path in Path("benchmarks").glob("*.py")), "harness"}  # on PYTHONPATH or sys.path
imports = {}
for name, path in modules.items():
    tree = ast.parse(path.read_text())
    found = set()
    for node in tree.body:  # top-level imports only: those run at collection
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)  # from package import module
    imports[name] = found

def missing(module):
    """A package this image lacks (it installs nothing: a file importing it cannot be collected)."""
    top = module.split(".")[0]
    return top not in local and top not in ("multihead", "__future__") and importlib.util.find_spec(top) is None

reasons = {}
def why(name, seen=()):
    if name not in reasons:
        reasons[name] = None
        for m in sorted(imports[name]):
            if not in_range and imports_transformers(m):
                reasons[name] = f"imports {m}"
            elif missing(m):
                reasons[name] = f"imports {m}, not installed"
            elif m in modules and m not in seen and m != name and why(m, (*seen, name)):
                reasons[name] = f"imports {m} ({why(m)})"
            if reasons[name]:
                break
    return reasons[name]

for name in sorted(modules):
    if name.startswith("test_") and why(name):
        print(f"# {modules[name]}: {why(name)}", file=sys.stderr)
        print(f"--ignore={modules[name]}")
EOF
}

# the test files left out of this image's run (transformers_ignores), as --ignore=PATH words; their reasons in
# tests-ignored.txt
test_ignores() {
    local ignores
    ignores="$(transformers_ignores 2>"$OUT_DIR/tests-ignored.txt")" || {
        echo "could not decide which transformers tests to leave out:" >&2
        cat "$OUT_DIR/tests-ignored.txt" >&2
        return 2
    }
    if [ -n "$ignores" ]; then
        echo "$ignores" >>"$OUT_DIR/tests-ignored.txt"
    else
        echo "# nothing left out: transformers is within the tested range and every import is installed" \
            >>"$OUT_DIR/tests-ignored.txt"
    fi
    echo "$ignores"
}

portable_tests() {
    local ignores
    ignores="$(test_ignores)" || return 2
    cat "$OUT_DIR/tests-ignored.txt"
    local selection=(tests)
    if [ "$SMOKE" = 1 ]; then
        # a small fast selection on the CPU: the functional entry's portable tests
        selection=(tests/core/test_functional.py)
    fi
    # shellcheck disable=SC2086  # $ignores is a list of --ignore=PATH words
    "$PY" -m pytest -m portable --device "$DEVICE" -q -p no:cacheprovider -o timeout=300 \
        --junitxml="$OUT_DIR/tests.xml" $ignores "${selection[@]}"
}

part1() {
    step env 120 "$OUT_DIR/env.txt" environment
    step tests 420 "$OUT_DIR/tests.txt" portable_tests
}

# ---------------------------------------------------------------------------------------------------- part 2

part2() {
    # gpu_kernels.py starts no case after 400 s and rewrites its reports after each one
    step gpu_kernels 500 "$OUT_DIR/gpu_kernels.log" \
        "$PY" benchmarks/gpu_kernels.py --device "$DEVICE" --max-run-s 400 --out "$OUT_DIR" $SMOKE_FLAG
}

# ---------------------------------------------------------------------------------------------------- part 3

part3() {
    step gpu_heads 240 "$OUT_DIR/gpu_heads.log" \
        "$PY" benchmarks/gpu_heads.py --device "$DEVICE" --out "$OUT_DIR" $SMOKE_FLAG
    step host_overhead 200 "$OUT_DIR/host_overhead.log" \
        "$PY" benchmarks/host_overhead.py --device "$DEVICE" --out "$OUT_DIR" $SMOKE_FLAG
}

# ---------------------------------------------------------------------------------------------------- part 4

# parallel_tests NAME: the portable tests of multihead.parallel and of the transformers split on $DEVICE, into
# NAME.xml; the ranks share the GPUs over gloo when MULTIHEAD_RANKS_SHARE_GPU=1 is set (tests/distributed.py)
parallel_tests() {
    local name="$1" ignores
    ignores="$(test_ignores)" || return 2
    local selection=(tests/core/test_parallel_*.py tests/lab/test_*parallel*.py)
    if [ "$SMOKE" = 1 ]; then
        selection=(tests/core/test_parallel_sinks.py)  # one small file: the steps and their reports, not the GPU
    fi
    # shellcheck disable=SC2086  # $ignores is a list of --ignore=PATH words
    "$PY" -m pytest -m portable --device "$DEVICE" -q -p no:cacheprovider -o timeout=300 \
        --junitxml="$OUT_DIR/$name.xml" $ignores "${selection[@]}"
}

shared_parallel_tests() {
    MULTIHEAD_RANKS_SHARE_GPU=1 parallel_tests parallel_shared
}

part4() {
    step parallel_nccl 240 "$OUT_DIR/parallel_nccl.txt" parallel_tests parallel_nccl
    step parallel_shared 240 "$OUT_DIR/parallel_shared.txt" shared_parallel_tests
}

run_part() {
    local part="$1" started=$SECONDS
    SUMMARY=
    echo "gpu_check.sh part $part -> $OUT_DIR (device $DEVICE, smoke=$SMOKE)"
    "part$part"
    printf 'part %s, device %s, smoke=%s, %s s\n%s' "$part" "$DEVICE" "$SMOKE" "$((SECONDS - started))" "$SUMMARY" \
        >"$OUT_DIR/summary-part$part.txt"
}

export PY OUT_DIR SMOKE DEVICE
export -f environment transformers_ignores test_ignores portable_tests parallel_tests shared_parallel_tests

if [ "$PART" = all ]; then
    for part in 1 2 3 4; do run_part "$part"; done
else
    run_part "$PART"
fi
echo "results in $OUT_DIR"
exit "$FAILED"
