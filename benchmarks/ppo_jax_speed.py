"""Speed of ppo_jax.py, measured three ways; each measurement runs in a fresh process.

(a) The compiled run: CartPole-v1, 4 envs x 128 steps, `--total-timesteps` per agent (500,000 by
    default), as `jax.jit(jax.vmap(train))` of `make_train`: seconds to trace, to compile and to
    run, for each number of agents in `--seeds`.
(b) The whole process: `python ppo_jax.py --num-seeds N --total-timesteps T` with the same
    settings, from start to exit: Python's start, imports, compilation, training, TensorBoard
    events, the agents' file and checkpoints. Printed beside (a), with the ratio of the two: what
    the command line costs on top of the compiled program (`--part overhead` measures the two one
    after the other, `--repeats` times). From the run's own `charts/SPS` events (one a chunk: the
    agent steps of the chunk over the seconds from its dispatch to its end), the time inside the
    chunks and their agent steps per second, beside the compiled program's; the rest of the
    process is the time outside them, also given per update. With several `--seeds`, the time
    outside the chunks per update at the most agents over that at the fewest.
(c) Atari: agent steps per second of ppo_jax.py's compiled iteration (ale-py's vector env stepped
    inside the program) beside ppo_atari.py's trainer (worker processes), with the same settings
    (Breakout, 8 games x 128 steps, the default update); ppo_atari.py twice, in its default
    precision (bfloat16 on a CPU that multiplies in it, float32 elsewhere) and in float32, ppo_jax.py
    in float32, its only precision. ppo_jax.py's iteration is one program, so its rollout (games and
    inference) and its update are also timed as programs of their own. And the games alone, random
    actions, no network: ppo_jax.py's `AtariEnv` in a compiled scan against ppo_atari.py's `Workers`.

The kinds of measurement alternate, `--repeats` times, and medians are reported, so that a noisy
neighbour on a shared machine hits all alike; the load average is printed with each result.

    python benchmarks/ppo_jax_speed.py                 # all three
    python benchmarks/ppo_jax_speed.py --part overhead --seeds 256 --total-timesteps 32768
    python benchmarks/ppo_jax_speed.py --part overhead --seeds 256 2048 --total-timesteps 2048 --repeats 1
    python benchmarks/ppo_jax_speed.py --part atari --repeats 2
    python benchmarks/ppo_jax_speed.py --part atari --compare old/ppo_jax.py   # another version alternated with it

`--compare PATH` measures the ppo_jax.py at PATH too (its Atari iteration or its process), taking
turns with this one's, so that two versions are compared on one machine under one load.

Timings are never asserted in tests; this script is where they are measured. JAX's persistent
compilation cache is switched off for every measurement, so that compile times are real.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def environment() -> dict:
    env = {key: value for key, value in os.environ.items() if key != "JAX_COMPILATION_CACHE_DIR"}
    return {**env, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])}


def measure_compiled(seeds: int, total_timesteps: int) -> dict:
    """Trace, compile and run CartPole's whole training for `seeds` agents (in this process)."""
    import jax
    import numpy as np

    import ppo_jax

    config = ppo_jax.Config(env="CartPole-v1", total_timesteps=total_timesteps, num_envs=4, num_steps=128,
                            num_seeds=seeds)
    keys = ppo_jax.agent_keys(config)
    started = time.perf_counter()
    lowered = jax.jit(jax.vmap(ppo_jax.make_train(config).train)).lower(keys)
    traced = time.perf_counter()
    compiled = lowered.compile()
    compiled_at = time.perf_counter()
    runners, metrics = compiled(keys)
    returns = np.asarray(jax.block_until_ready(metrics)["episodic_return"])
    finished = time.perf_counter()
    final = np.nanmean(returns[:, -10:], axis=1)
    return {"seeds": seeds, "trace_s": traced - started, "compile_s": compiled_at - traced,
            "run_s": finished - compiled_at, "program_s": finished - started,
            "sps": config.num_updates * config.batch_size * seeds / (finished - compiled_at),
            "final_return_min": float(final.min()), "final_return_mean": float(final.mean())}


def measure_process(seeds: int, total_timesteps: int, script: Path) -> dict:
    """`python ppo_jax.py` with its defaults (and `seeds` agents, `total_timesteps` each), start to exit; and, from
    its `charts/SPS` events, the seconds inside its chunks."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with tempfile.TemporaryDirectory() as run_dir:
        started = time.perf_counter()
        result = subprocess.run([sys.executable, str(script), "--num-seeds", str(seeds),
                                 "--total-timesteps", str(total_timesteps), "--run-dir", run_dir],
                                capture_output=True, text=True, env=environment())
        seconds = time.perf_counter() - started
        if result.returncode != 0:
            sys.stderr.write(result.stderr)
            raise SystemExit(f"{script} ended with exit status {result.returncode}")
        events = EventAccumulator(run_dir)
        events.Reload()
        chunks = [(event.step, event.value) for event in events.Scalars("charts/SPS")]
    # The line `compiled in N s`, which a --compare of another version may not print.
    compiled = next((line for line in result.stderr.splitlines() if "compiled in" in line), None)
    ends = [0] + [step for step, _ in chunks]
    inside = sum((end - start) * seeds / sps for start, end, (_, sps) in zip(ends, ends[1:], chunks))
    return {"seeds": seeds, "script": str(script), "process_s": seconds, "inside_chunks_s": inside,
            "updates": total_timesteps // (4 * 128), "agent_steps": ends[-1] * seeds,
            "compile_line_s": float(compiled.split("compiled in ")[1].split(" s")[0]) if compiled else float("nan")}


# What each part measures uses of a ppo_jax.py: a `--compare` that lacks one is refused before anything runs.
USED_BY_PART = {"process": ("main",), "atari": ("RunConfig", "PRESETS", "resolve_env", "choose_device", "make_train",
                                                "convolution_layer", "make_update_agent", "make_optimizer")}


def names_defined(path: Path) -> set[str]:
    """The names the Python file at `path` defines at its top level, read without running it (a
    `SyntaxError`, or for a binary file a `ValueError`, if it is not Python)."""
    names = set()
    for node in ast.parse(path.read_bytes(), str(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            names |= {target.id for target in ast.walk(node) if isinstance(target, ast.Name)
                      and isinstance(target.ctx, ast.Store)}
    return names


def import_ppo_jax(path: Path):
    """The ppo_jax.py at `path`, imported as the module `ppo_jax`."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ppo_jax", path)
    module = sys.modules["ppo_jax"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measure_atari(script: str, iterations: int, warmup: int, path: Path = ROOT / "ppo_jax.py") -> dict:
    """Agent steps per second of one script's Atari training: Breakout, 8 games x 128 steps, the default update."""
    import numpy as np

    script, _, precision = script.partition(":")
    if script == "ppo_jax":
        import jax

        ppo_jax = import_ppo_jax(path)

        ppo_jax.choose_device("auto")
        config = ppo_jax.RunConfig(env=ppo_jax.resolve_env("Breakout")[0], **ppo_jax.PRESETS["Atari"])
        training = ppo_jax.make_train(config, conv=ppo_jax.convolution_layer())
        runner = jax.jit(training.init)(jax.random.key(1))
        programs = {"iteration": jax.jit(training.update), "rollout": jax.jit(training.collect)}
        update_agent = jax.jit(ppo_jax.make_update_agent(training.network, ppo_jax.make_optimizer(config), config))
        rollout = programs["rollout"](runner)[1]
        programs["update"] = lambda runner: update_agent(runner.agent, rollout, runner.key, 2.5e-4, 0.1)
        seconds = {}
        for name, program in programs.items():
            timed = []
            for iteration in range(warmup + iterations):
                started = time.perf_counter()
                result = jax.block_until_ready(program(runner))
                if iteration >= warmup:
                    timed.append(time.perf_counter() - started)
                if name == "iteration":
                    runner = result[0]
            seconds[name] = statistics.median(timed)
        return {"script": script, "path": str(path), "precision": "fp32",
                "sps": config.batch_size / seconds["iteration"],
                "seconds_per_iteration": seconds["iteration"], "rollout_s": seconds["rollout"],
                "update_s": seconds["update"]}

    import torch

    import ppo_atari as module

    env_id = module.resolve_env_id("Breakout")
    config = module.RunConfig(env=env_id, num_envs=8, precision=precision or "auto")
    num_workers = min(config.num_envs, len(os.sched_getaffinity(0)))
    with module.RunWorkers(env_id, config.num_envs, num_workers, 1, module.game_options(config)) as envs:
        torch.manual_seed(1)
        device = module.choose_device("auto")
        # The trainer a run uses, which times its phases as ppo_atari.py's log shows them.
        trainer = module.RunTrainer(config, envs, device)
        per_iteration, splits = [], []
        for iteration in range(warmup + iterations):
            before = {**envs.seconds, **trainer.seconds}
            started = time.perf_counter()
            trainer.update_policy(trainer.collect_rollout())
            if iteration >= warmup:
                per_iteration.append(time.perf_counter() - started)
                timed = {**envs.seconds, **trainer.seconds}
                splits.append({name: timed[name] - before[name] for name in timed})
    seconds = statistics.median(per_iteration)
    return {"script": script, "precision": "bf16" if trainer.model.bf16 else "fp32",
            "sps": config.batch_size / seconds, "seconds_per_iteration": seconds,
            "rollout_s": float(np.median([s["sampling"] for s in splits])),
            "env_s": float(np.median([s["env"] for s in splits])),
            "update_s": float(np.median([s["update"] for s in splits]))}


def measure_games(script: str, steps: int = 1024) -> dict:
    """Agent steps per second of Breakout's 8 games alone, random actions: `steps` steps of each game, after as many untimed."""
    import numpy as np

    if script == "ppo_jax":
        import jax

        import ppo_jax

        config = ppo_jax.RunConfig(env=ppo_jax.resolve_env("Breakout")[0], **ppo_jax.PRESETS["Atari"])
        env = ppo_jax.AtariEnv(config.env, config.num_envs, config)

        @jax.jit
        def play(state, key):
            def step(state, key):
                actions = jax.random.randint(key, (env.num_envs,), 0, env.action_dim)
                return env.step(key, state, actions)[1], None

            return jax.lax.scan(step, state, jax.random.split(key, steps))[0]

        state = jax.jit(env.reset)(jax.random.key(1))[1]
        state = jax.block_until_ready(play(state, jax.random.key(2)))  # compiles, and warms the games up
        started = time.perf_counter()
        jax.block_until_ready(play(state, jax.random.key(3)).frames)
        seconds = time.perf_counter() - started
        num_envs = env.num_envs
    else:
        import ppo_atari

        env_id = ppo_atari.resolve_env_id("Breakout")
        config = ppo_atari.Config(env=env_id, num_envs=8)
        num_envs = config.num_envs
        rng = np.random.default_rng(0)
        with ppo_atari.Workers(env_id, num_envs, min(num_envs, len(os.sched_getaffinity(0))), 1,
                               ppo_atari.game_options(config)) as envs:
            envs.reset()
            for actions in rng.integers(0, envs.n_actions, (steps, num_envs)):
                envs.step(actions)
            started = time.perf_counter()
            for actions in rng.integers(0, envs.n_actions, (steps, num_envs)):
                envs.step(actions)
            seconds = time.perf_counter() - started
    return {"script": script, "sps": steps * num_envs / seconds}


def in_fresh_process(*args: str) -> dict:
    """Run one measurement in a new Python process; its result, with the load average around it."""
    load_before = os.getloadavg()[0]
    result = subprocess.run([sys.executable, __file__, "--measure", *args], capture_output=True, text=True,
                            env=environment())
    if result.returncode != 0:  # its traceback, or the script's own error, then one line of ours
        sys.stderr.write(result.stderr)
        raise SystemExit(f"ppo_jax_speed.py: measuring `{' '.join(args)}` failed (exit status "
                         f"{result.returncode}); what it wrote is above")
    return {**json.loads(result.stdout.strip().splitlines()[-1]), "load": (load_before, os.getloadavg()[0])}


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(run[key] for run in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["compiled", "process", "overhead", "atari", "all"], default="all",
                        help="overhead: (a) and (b), one after the other")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 16], help="agents per CartPole run")
    parser.add_argument("--total-timesteps", type=int, default=500_000, help="steps per agent of a CartPole run")
    parser.add_argument("--repeats", type=int, default=3, help="measurements of each kind, alternated")
    parser.add_argument("--iterations", type=int, default=6, help="timed Atari iterations per measurement")
    parser.add_argument("--warmup", type=int, default=2, help="untimed Atari iterations first")
    parser.add_argument("--json", type=Path, help="also write every measurement here")
    parser.add_argument("--compare", type=Path, help="another ppo_jax.py, measured in turns with this one's "
                        "(its process and its Atari iteration)")
    parser.add_argument("--measure", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    # A CartPole run is at least one batch of its 4 envs x 128 steps.
    for name, least in [("seeds", 1), ("total_timesteps", 512), ("repeats", 1), ("iterations", 1), ("warmup", 0)]:
        given = getattr(args, name)
        if (value := min(given if isinstance(given, list) else [given])) < least:
            parser.error(f"--{name.replace('_', '-')} must be at least {least}, not {value}")
    if args.compare is not None and not args.compare.is_file():
        parser.error(f"--compare {args.compare} is not a file")
    if args.compare is not None:
        try:
            defined = names_defined(args.compare)
        except (SyntaxError, ValueError) as error:
            parser.error(f"--compare {args.compare} is not Python: {error}".splitlines()[0])
        parts = {"process": ["process"], "overhead": ["process"], "atari": ["atari"], "all": ["process", "atari"]}
        if missing := [name for part in parts.get(args.part, []) for name in USED_BY_PART[part] if name not in defined]:
            parser.error(f"--compare {args.compare} is not a ppo_jax.py: it defines no {', '.join(missing)}")
    # Checked, not created: a file made now would be left empty by a run that fails or is stopped.
    if args.json is not None and (args.json.is_dir() or not args.json.parent.is_dir()
                                  or not os.access(args.json.parent, os.W_OK)):
        parser.error(f"--json {args.json}: cannot write there")  # now, not after the measurements

    if args.measure:
        kind, value, *steps = args.measure
        if kind == "compiled":
            result = measure_compiled(int(value), int(steps[0]))
        elif kind == "process":
            result = measure_process(int(value), int(steps[0]), Path(steps[1]))
        elif kind == "games":
            result = measure_games(value)
        else:
            result = measure_atari(value, args.iterations, args.warmup, *map(Path, steps))
        print(json.dumps(result))
        return

    print(f"{os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f} at the start; medians of {args.repeats}")
    results: dict[str, list[dict]] = {}
    kinds = []
    steps = str(args.total_timesteps)
    versions = [str(ROOT / "ppo_jax.py"), *([str(args.compare.resolve())] if args.compare else [])]
    for seeds in args.seeds:
        if args.part in ("compiled", "overhead", "all"):
            kinds.append(("compiled", str(seeds), steps))
        if args.part in ("process", "overhead", "all"):
            kinds += [("process", str(seeds), steps, version) for version in versions]
    if args.part in ("atari", "all"):
        kinds += [*(("atari", "ppo_jax", version) for version in versions), ("atari", "ppo_atari"),
                  ("atari", "ppo_atari:fp32"), ("games", "ppo_jax"), ("games", "ppo_atari")]
    for _ in range(args.repeats):
        for kind in kinds:
            results.setdefault(" ".join(kind), []).append(in_fresh_process(*kind, "--iterations", str(args.iterations),
                                                                           "--warmup", str(args.warmup))
                                                          if kind[0] == "atari" else in_fresh_process(*kind))
    for name, runs in results.items():
        loads = ", ".join(f"{a:.1f}-{b:.1f}" for a, b in (run["load"] for run in runs))
        kind, value, *_ = name.split()
        if kind == "compiled":
            print(f"(a) CartPole-v1, {args.total_timesteps:,} steps x {value} agent{'s' * (value != '1')}: trace "
                  f"{median_of(runs, 'trace_s'):.1f} s, compile {median_of(runs, 'compile_s'):.1f} s, run "
                  f"{median_of(runs, 'run_s'):.1f} s ({median_of(runs, 'sps'):,.0f} SPS); worst agent's final return "
                  f"{min(run['final_return_min'] for run in runs):.0f}   [load {loads}]")
        elif kind == "process":
            script = "" if runs[0]["script"] == str(ROOT / "ppo_jax.py") else f" [{runs[0]['script']}]"
            inside = [run["agent_steps"] / run["inside_chunks_s"] for run in runs]
            outside = [(run["process_s"] - run["inside_chunks_s"]) for run in runs]
            print(f"(b) python ppo_jax.py --num-seeds {value} --total-timesteps {args.total_timesteps}{script}: "
                  f"{median_of(runs, 'process_s'):.1f} s start to exit (of which tracing and compiling "
                  f"{median_of(runs, 'compile_line_s'):.1f} s)   [load {loads}]")
            print(f"    inside the chunks {median_of(runs, 'inside_chunks_s'):.1f} s "
                  f"({statistics.median(inside):,.0f} agent steps/s); outside them {statistics.median(outside):.1f} s, "
                  f"{statistics.median(outside) / runs[0]['updates']:.2f} s per update of {runs[0]['updates']}")
            program = results.get(f"compiled {value} {args.total_timesteps}")
            if program:
                ratios = [run["process_s"] / compiled["program_s"] for run, compiled in zip(runs, program)]
                print(f"    the compiled program: {median_of(program, 'sps'):,.0f} agent steps/s; the process over "
                      f"the compiled program (trace, compile, run: {median_of(program, 'program_s'):.1f} s): "
                      f"{statistics.median(ratios):.2f}x (each pair: {', '.join(f'{ratio:.2f}' for ratio in ratios)})")
        elif kind == "games":
            what = "AtariEnv, a compiled scan" if value == "ppo_jax" else "Workers, one process per core"
            print(f"(c) {value}'s games alone ({what}), Breakout, 8 games, random actions: "
                  f"{median_of(runs, 'sps'):,.0f} agent steps/s   [load {loads}]")
        else:
            env = ""
            if value.startswith("ppo_atari"):
                env = f" (of which the games {median_of(runs, 'env_s'):.2f})"
                value = f"ppo_atari, its torso in {runs[0]['precision']}"
            else:
                path = runs[0].get("path", str(ROOT / "ppo_jax.py"))
                value = "ppo_jax, in float32" + ("" if path == str(ROOT / "ppo_jax.py") else f" [{path}]")
            print(f"(c) {value} on Breakout, 8 games x 128 steps: {median_of(runs, 'sps'):,.0f} SPS | per iteration "
                  f"{median_of(runs, 'seconds_per_iteration'):.2f} s; rollout {median_of(runs, 'rollout_s'):.2f} s"
                  f"{env}, update {median_of(runs, 'update_s'):.2f} s   [load {loads}]")
    outside = {int(name.split()[1]): statistics.median(run["process_s"] - run["inside_chunks_s"] for run in runs)
               for name, runs in results.items() if name.startswith("process") and name.endswith(versions[0])}
    if len(outside) > 1:
        print(f"time outside the chunks per update, {max(outside)} agents over {min(outside)}: "
              f"{outside[max(outside)] / outside[min(outside)]:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
