#!/usr/bin/env bash
# The checks that need a GPU, prepared to run in one go on a machine lent for a few minutes:
#
#   bash benchmarks/gpu_checks.sh pytorch     (at most 7.7 minutes: the limits of its steps)
#   bash benchmarks/gpu_checks.sh jax         (at most 7 minutes)
#   bash benchmarks/gpu_checks.sh diagnose    (at most 6 minutes)
#   bash benchmarks/gpu_checks.sh cleanrl     (at most 4 minutes)
#
# A lent machine runs one command for at most 10 minutes; `all` runs `pytorch` and `jax` in one: on
# an NVIDIA H100 (2026-11-28) it took 483 s with the installs (the steps: 113, 22, 118, 204 and 23 s),
# so one call saves a machine's start, and each step's limit still stops one that hangs.
#
# pytorch:  ppo_atari.py's training speed on CUDA beside its workers alone, at 8 and 32 games, with
#           issue 41's command (training at least 0.7 of the workers, the rollout alone at least
#           0.8), the update alone launched step by step and replayed from a CUDA graph
#           (`graph_update.py`), then every test that needs a GPU for the PyTorch scripts.
# jax:      ppo_jax.py with 2,048 CartPole agents x 500k steps, the whole process against the
#           compiled program, twice (issue 42: at most 1.2 times), then ppo_jax.py's GPU tests.
# diagnose: where the time goes, when a check above fails: the training speed with the update's
#           minibatch steps launched one by one beside the graphed ones, in turns (`--eager-update`),
#           and a run of 2,048 agents whose chunks are timed on the device (its idle time between
#           them, and `in_dispatch_s`: whether a chunk's dispatch returns before it has run).
#
# cleanrl:  ppo_atari.py beside CleanRL's ppo_atari.py on CUDA, whole processes in turns
#           (`beside_cleanrl.py`), as the issue measured them before the rollout was rewritten. It
#           needs a checkout of vwxyzjn/cleanrl in `.cleanrl` and CleanRL's libraries as wheels in
#           `.whl-peers/cleanrl` (`bash ../shared/hooks/gpu-wheels.sh --peers`, then `pip download
#           --no-deps` of cloudpickle, farama-notifications and typing-extensions there), both carried.
#
# Each step has its own time limit and the script goes on after a failure, so that one slow step
# does not cost the others; it ends with a line per step and its exit status. The measurements go
# to $OUT (the folder the device machine sends back) or, without it, to benchmarks/results, named
# after the GPU.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
part=${1:-all}
out=${OUT:-benchmarks/results}
mkdir -p "$out"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 | tr -cs 'A-Za-z0-9' '-' | sed 's/-$//')
gpu=${gpu:-cuda}
summary=()

step() {  # step NAME SECONDS COMMAND...: run COMMAND under a time limit, log it, note how it ended
    local name=$1 seconds=$2
    shift 2
    echo "== $name: $*"
    local started=$SECONDS
    timeout -s INT "$seconds" "$@" 2>&1 | tee "$out/$name.log"
    local status=${PIPESTATUS[0]}
    summary+=("$name: exit $status after $((SECONDS - started)) s")
}

if [ "$part" = pytorch ] || [ "$part" = all ]; then
    step throughput 200 python benchmarks/throughput.py --part train --device cuda --precision fp32 \
        --num-envs 8 32 --rounds 3 --json "$out/throughput-cuda-$gpu.json"
    step graph-update 60 python benchmarks/graph_update.py --num-envs 8 32 --updates 12 \
        --json "$out/graph-update-$gpu.json"
    step torch-gpu-tests 200 python -m pytest -q -rs tests/test_ppo_atari_cuda.py \
        tests/test_ppo_atari_cli.py::test_ctrl_c_on_the_gpu_saves_a_checkpoint_and_leaves_no_process \
        tests/test_vpg_continuous_cli.py::test_trains_resumes_and_evaluates_on_the_gpu \
        tests/test_benchmarks.py::test_a_graphed_update_is_the_update_on_the_gpu
fi
if [ "$part" = jax ] || [ "$part" = all ]; then
    step ppo-jax-overhead 300 python benchmarks/ppo_jax_speed.py --part overhead --seeds 2048 \
        --total-timesteps 500000 --repeats 2 --json "$out/ppo_jax-overhead-$gpu.json"
    step jax-gpu-tests 120 python -m pytest -q -rs tests/test_ppo_jax_cli.py::test_trains_on_the_gpu_where_there_is_one
fi
if [ "$part" = diagnose ]; then
    step throughput-eager-update 270 python benchmarks/throughput.py --part train --device cuda \
        --precision fp32 --num-envs 8 32 --rounds 3 --eager-update --json "$out/throughput-eager-cuda-$gpu.json"
    step ppo-jax-chunks 90 python benchmarks/ppo_jax_chunks.py --seeds 2048 --part run --total-timesteps 204800 \
        --json "$out/ppo_jax-chunks-$gpu.json"
fi
if [ "$part" = cleanrl ]; then
    python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/cleanrl-site \
        .whl-peers/cleanrl/*.whl
    step beside-cleanrl 240 python benchmarks/beside_cleanrl.py --cleanrl .cleanrl --cleanrl-site /tmp/cleanrl-site \
        --device cuda --total-timesteps 24576 --rounds 2 --json "$out/beside-cleanrl-cuda-$gpu.json"
fi
printf '%s\n' "${summary[@]}"
