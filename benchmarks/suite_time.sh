#!/usr/bin/env bash
# The README's test command (`python -m pytest -n 2`), timed as a slower machine would run it:
#
#   bash benchmarks/suite_time.sh [--avx2] [--busy N] [pytest arguments...]
#
# --avx2    the CPU seen as one with AVX2 alone: PyTorch's kernels (ATEN_CPU_CAPABILITY), oneDNN's
#           (ONEDNN_MAX_CPU_ISA) and XLA's (XLA_FLAGS) held to AVX2, and /proc/cpuinfo read without
#           its AVX-512 and AMX flags, so that `ppo_atari.py --precision auto` keeps float32 as it
#           does on such a CPU. (A `sitecustomize` on PYTHONPATH does the last, in every Python
#           process the tests start.) What it leaves as it was: the clock, the caches, and compiled
#           code that picks its instructions by itself (the emulators, MuJoCo).
# --busy N  N busy loops beside the tests, started first and stopped at the end: each takes a share
#           of the cores, as other work on a shared machine does.
#
# The tests run in `$PYTHON` (default: the `python` first on PATH, as in CI's activated venv).
# The time is bash's `time` at the end of the output; pytest's own line says what passed.
set -euo pipefail
cd "$(dirname "$0")/.."
busy=0
while [ $# -gt 0 ]; do
    case $1 in
        --avx2)
            site=$(mktemp -d)
            cat > "$site/sitecustomize.py" <<'EOF'
# Written by benchmarks/suite_time.sh --avx2: /proc/cpuinfo read as a CPU without AVX-512 or AMX.
import pathlib

_read_text = pathlib.Path.read_text


def _read_text_without_avx512(self, *args, **kwargs):
    text = _read_text(self, *args, **kwargs)
    if str(self) == "/proc/cpuinfo":
        text = "\n".join(" ".join(flag for flag in line.split(" ") if not flag.startswith(("avx512", "amx")))
                         for line in text.split("\n"))
    return text


pathlib.Path.read_text = _read_text_without_avx512
EOF
            export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
            export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
            export XLA_FLAGS="--xla_cpu_max_isa=AVX2${XLA_FLAGS:+ $XLA_FLAGS}"
            shift ;;
        --busy)
            if ! [[ ${2:-} =~ ^[0-9]+$ ]]; then
                echo "suite_time.sh: error: --busy needs a number of busy loops, not '${2:-}'" >&2
                exit 2
            fi
            busy=$2
            shift 2 ;;
        *)
            break ;;
    esac
done
loops=()
for _ in $(seq 1 "$busy"); do
    python3 -c "while True: pass  # a busy loop of suite_time.sh" &
    loops+=($!)
done
trap '[ ${#loops[@]} -eq 0 ] || kill "${loops[@]}"; [ -z "${site:-}" ] || rm -rf "$site"' EXIT
time "${PYTHON:-python}" -m pytest -n 2 "$@"
