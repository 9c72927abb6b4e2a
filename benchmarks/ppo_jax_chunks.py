"""Where `ppo_jax.py`'s command line spends its time between the chunks of a run, as the device sees it.

`ppo_jax_speed.py --part overhead` times the chunks from the run's own `charts/SPS` events: from a
chunk's dispatch to the moment the main thread learns it is done. That moment comes late whenever
the main thread was kept busy meanwhile, so a host that makes the device wait shows up there as
slow chunks. This script tells the two apart, in this process, for CartPole-v1 agents (4 envs x 128
steps, the defaults):

(A) the programs, without the command line: `--updates` updates of every agent as the one compiled
    program (`jax.jit(jax.vmap(train))`), and as the command line's chunk program (a scan of 100
    updates, `compile_train_chunk`) called with 100 updates and with `--count`, each time with and
    without the one flag the command line reads after each chunk; milliseconds per update.
(B) `ppo_jax.main` itself, `--total-timesteps` per agent, with the chunk program wrapped so that a
    thread of its own notes when the device finished each chunk: the device's busy time, its idle
    time between chunks, the time before the first chunk and after the last, and the seconds the
    main thread spent handing chunks to the logging thread (`Run.log`, which waits for the last one)
    and writing checkpoints (`Run.write_checkpoint`), and the logging thread in `log_chunk`; and the
    seconds the main thread spent in the calls that dispatch the chunks (`in_dispatch_s`): near none
    where a call returns before its chunk has run, near the device's busy time where it returns only
    once the chunk is (nearly) done.

    python benchmarks/ppo_jax_chunks.py --seeds 2048                        # on a GPU: (A) and (B)
    python benchmarks/ppo_jax_chunks.py --seeds 2048 --part run --script old/ppo_jax.py

`--script` measures another `ppo_jax.py` (an earlier version, say). Nothing here is asserted in a test.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LENGTH = 100  # the command line's chunk program at its default --checkpoint-every


def load(path: Path):
    spec = importlib.util.spec_from_file_location("ppo_jax", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["ppo_jax"] = module
    spec.loader.exec_module(module)
    return module


def measure_programs(ppo_jax, seeds: int, updates: int, count: int) -> dict:
    import jax
    import jax.numpy as jnp

    config = ppo_jax.Config(env="CartPole-v1", total_timesteps=updates * 512, num_envs=4, num_steps=128,
                            num_seeds=seeds)
    keys, training = ppo_jax.agent_keys(config), ppo_jax.make_train(config)
    whole = jax.jit(jax.vmap(training.train)).lower(keys).compile()
    started = time.perf_counter()
    jax.block_until_ready(whole(keys))
    result = {"updates": updates, "whole_ms_per_update": 1e3 * (time.perf_counter() - started) / updates}
    mesh = ppo_jax.seed_mesh(seeds)
    runners = jax.device_put(jax.jit(jax.vmap(training.init))(keys), ppo_jax.split_over_seeds(mesh))
    chunk = ppo_jax.compile_train_chunk(training, LENGTH, runners, mesh)
    jax.block_until_ready(chunk(runners, jnp.int32(1)))
    for size in (LENGTH, count):
        for flag in (False, True):
            calls, state, started = updates // size, runners, time.perf_counter()
            for _ in range(calls):
                state, metrics = chunk(state, jnp.int32(size))
                if flag:
                    bool(jnp.any(metrics["diverged"]))
            jax.block_until_ready((state, metrics))
            name = f"chunk_of_{size}_ms_per_update" + ("_reading_the_flag" if flag else "")
            result[name] = 1e3 * (time.perf_counter() - started) / (calls * size)
    return result


def measure_run(ppo_jax, seeds: int, total_timesteps: int, run_dir: Path) -> dict:
    import jax

    chunks, spans = [], {"log": [], "write_checkpoint": [], "log_chunk": []}
    compile_train_chunk = ppo_jax.compile_train_chunk

    def watched_compile(*args, **kwargs):
        train_chunk = compile_train_chunk(*args, **kwargs)

        def dispatch(runners, count):
            chunk = {"dispatched": time.perf_counter(), "count": int(count)}
            outputs = train_chunk(runners, count)
            chunk["returned"] = time.perf_counter()
            chunks.append(chunk)
            threading.Thread(target=lambda: (jax.block_until_ready(outputs),
                                             chunk.__setitem__("done", time.perf_counter())), daemon=True).start()
            return outputs
        return dispatch

    def timed(owner, name):
        function = getattr(owner, name)

        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                spans[name].append(time.perf_counter() - started)
        setattr(owner, name, wrapper)

    ppo_jax.compile_train_chunk = watched_compile
    for owner, name in [(ppo_jax.Run, "log"), (ppo_jax.Run, "write_checkpoint"), (ppo_jax, "log_chunk")]:
        timed(owner, name)
    started = time.perf_counter()
    status = ppo_jax.main(["--env", "CartPole-v1", "--num-seeds", str(seeds), "--total-timesteps", str(total_timesteps),
                           "--run-dir", str(run_dir)])
    ended = time.perf_counter()
    while any("done" not in chunk for chunk in chunks):
        time.sleep(0.01)
    busy = idle = 0.0
    for index, chunk in enumerate(chunks):
        begun = max(chunk["dispatched"], chunks[index - 1]["done"]) if index else chunk["dispatched"]
        busy += chunk["done"] - begun
        idle += begun - chunks[index - 1]["done"] if index else 0.0
    return {"status": status, "seconds": ended - started, "before_first_chunk_s": chunks[0]["dispatched"] - started,
            "device_busy_s": busy, "device_idle_between_chunks_s": idle, "after_last_chunk_s": ended - chunks[-1]["done"],
            "busy_ms_per_update": 1e3 * busy / sum(chunk["count"] for chunk in chunks),
            "chunk_counts": [chunk["count"] for chunk in chunks],
            "in_dispatch_s": sum(chunk["returned"] - chunk["dispatched"] for chunk in chunks),
            **{f"{name}_s": sum(seconds) for name, seconds in spans.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=2048, help="agents (default: 2048)")
    parser.add_argument("--part", choices=["all", "programs", "run"], default="all")
    parser.add_argument("--updates", type=int, default=200, help=f"(A): updates of each program, at least {LENGTH} (default: 200)")
    parser.add_argument("--count", type=int, default=65, help=f"(A): the shorter chunk's updates, below {LENGTH} (default: 65)")
    parser.add_argument("--total-timesteps", type=int, default=204800, help="(B): steps per agent (default: 204,800, 400 updates)")
    parser.add_argument("--script", type=Path, default=ROOT / "ppo_jax.py", help="the ppo_jax.py to measure")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    for name, least in (("seeds", 1), ("updates", LENGTH), ("total_timesteps", 1)):
        if getattr(args, name) < least:
            parser.error(f"--{name.replace('_', '-')} must be at least {least}, not {getattr(args, name)}")
    if not 1 <= args.count < LENGTH:
        parser.error(f"--count must be in [1, {LENGTH - 1}], not {args.count}")
    if not args.script.is_file():
        parser.error(f"--script {args.script} is not a file")
    ppo_jax = load(args.script)
    import jax

    results = {"device": str(jax.devices()[0]), "script": str(args.script), "seeds": args.seeds}
    if args.part in ("all", "programs"):
        results["programs"] = measure_programs(ppo_jax, args.seeds, args.updates, args.count)
        print("(A)", json.dumps(results["programs"]), flush=True)
    if args.part in ("all", "run"):
        run_dir = Path(tempfile.mkdtemp(prefix="ppo_jax_chunks-"))
        try:
            results["run"] = measure_run(ppo_jax, args.seeds, args.total_timesteps, run_dir)
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)
        print("(B)", json.dumps(results["run"]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
