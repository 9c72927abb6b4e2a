"""Throughput of ppo_atari.py, measured two ways in one run.

(a) Environment only: agent steps per second of the script's `Workers` (Python processes, frames in
    shared memory) against ale-py's own C++ `AtariVectorEnv` with the same number of games and the
    same preprocessing, both driven with random actions. The two alternate, `--repeats` times, and
    the medians are compared, so that a noisy neighbour on a shared machine hits both alike.

(b) Training: agent steps per second of the real trainer with the default hyperparameters, beside
    the speed of its workers alone (the same `Workers`, stepped with random actions just before),
    which training can at best reach. The time of an iteration is split into waiting for the games,
    inference (choosing actions and values, and storing the rollout) and the update, for each
    precision asked for. Part 1's code holds no timer: Part 3's `RunWorkers` and `RunTrainer` time
    its methods, as in a run. Beside the speed, the JSON holds the ATen calls a step of the rollout
    makes (counted with `TorchDispatchMode` in a rollout of its own, untimed). `--baseline FILE`
    measures another copy of `ppo_atari.py` (an earlier commit's, say) in the same run, the two
    taking turns, so that a change is measured side by side on one machine; `--eager-update`
    measures, in the same turns, this script's trainer with the update's minibatch steps launched
    one by one instead of replayed from a CUDA graph (what the graph gains, end to end, on CUDA).

(c) The host's side of a step: the microseconds the main process spends on a step of the rollout
    with the games and the network's call taken out (fixed frames, and the network's outputs made
    once, as a CUDA graph leaves the host nothing but to copy them), for frames stored channels
    last (as the trainer stores them on a CPU) and channels first (as on CUDA). It runs on a CPU
    alone, so it counts here what a GPU run's main process does between two replays of the graph.

    python benchmarks/throughput.py                   # both parts, Breakout, 8 and 32 games
    python benchmarks/throughput.py --part train --device cuda --precision fp32 --num-envs 8 32 --rounds 3
    python benchmarks/throughput.py --part host --num-envs 8 32
    python benchmarks/throughput.py --part train --device cuda --precision fp32 --eager-update
    git show 30d4d64:ppo_atari.py > /tmp/before.py
    python benchmarks/throughput.py --part train --precision auto --rounds 3 --baseline /tmp/before.py

Timings are never asserted in tests; this script is where they are measured.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import ppo_atari  # noqa: E402  (the script is the thing measured)


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def time_steps(step, num_envs: int, n_actions: int, steps: int, rng: np.random.Generator) -> float:
    """Agent steps per second of `step(actions)` over `steps` calls with random actions."""
    actions = rng.integers(0, n_actions, size=(steps, num_envs))
    started = time.perf_counter()
    for row in actions:
        step(row)
    return steps * num_envs / (time.perf_counter() - started)


def env_throughput(env_id: str, num_envs: int, num_workers: int, steps: int, repeats: int) -> dict:
    import ale_py

    config = ppo_atari.Config()
    rng = np.random.default_rng(0)

    def ours():
        return ppo_atari.Workers(env_id, num_envs, num_workers, seed=1, game_options=ppo_atari.game_options(config))

    def theirs(**protocol):
        # The script's protocol: 4-frame skip with max-pooling, 84 x 84 grey, 4 frames stacked, up
        # to 30 no-ops, FIRE on reset, clipped rewards, no sticky actions, the 108,000-frame cap and
        # same-step auto-reset.
        return ale_py.AtariVectorEnv(
            ppo_atari.game_name(env_id), num_envs=num_envs, frameskip=config.frame_skip, noop_max=config.noop_max,
            repeat_action_probability=0.0, max_num_frames_per_episode=config.max_episode_frames,
            img_height=84, img_width=84, grayscale=True, stack_num=4, maxpool=True, reward_clipping=True,
            use_fire_reset=True, autoreset_mode="SameStep", **protocol)

    def measure(make) -> float:
        # Each env runs alone: the vector env's C++ threads wait for work by spinning, which would
        # steal the cores of the other side if both were alive at once.
        env = make()
        try:
            if isinstance(env, ppo_atari.Workers):
                env.reset()
                n_actions = env.n_actions
            else:
                env.reset(seed=1)
                n_actions = env.single_action_space.n
            time_steps(env.step, num_envs, n_actions, 100, rng)  # warm-up
            return time_steps(env.step, num_envs, n_actions, steps, rng)
        finally:
            env.close()

    # ale-py's `episodic_life=True` is much slower than its default (it plays extra frames at each
    # lost life), so the comparison is made against its fastest setting as well as the equal one.
    runs = {"workers": [], "vector_env": [], "vector_env_episodic_life": []}
    makers = {"workers": ours, "vector_env": theirs,
              "vector_env_episodic_life": lambda: theirs(episodic_life=True)}
    for _ in range(repeats):
        for name, make in makers.items():
            runs[name].append(measure(make))
    medians = {name: statistics.median(values) for name, values in runs.items()}
    return {"num_envs": num_envs, "num_workers": num_workers, **{f"{k}_sps": v for k, v in medians.items()},
            "ratio": medians["workers"] / medians["vector_env"], "runs": runs}


def workers_alone(env_id: str, num_envs: int, num_workers: int, steps: int) -> float:
    """Agent steps per second of the `Workers` a run trains with, stepped with random actions."""
    config = ppo_atari.Config()
    rng = np.random.default_rng(0)
    with ppo_atari.Workers(env_id, num_envs, num_workers, seed=1,
                           game_options=ppo_atari.game_options(config)) as envs:
        envs.reset()
        time_steps(envs.step, num_envs, envs.n_actions, 100, rng)  # warm-up
        return time_steps(envs.step, num_envs, envs.n_actions, steps, rng)


# What each part measures uses of a script: a `--baseline` that lacks one is refused before anything runs.
USED_BY_PART = {"train": ("RunConfig", "RunWorkers", "RunTrainer", "game_options"),
                "host": ("Config", "Game", "Trainer", "FastSamplingTrainer")}


def load_script(path: Path):
    """A copy of ppo_atari.py as a module of its own, so that two copies can be measured in one run."""
    name = f"measured_{abs(hash(str(path)))}"
    # Read as Python whatever its name ends with: `git show 30d4d64:ppo_atari.py > /tmp/before` is a copy too.
    spec = importlib.util.spec_from_file_location(name, path,
                                                  loader=importlib.machinery.SourceFileLoader(name, str(path)))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look themselves up here
    spec.loader.exec_module(module)
    return module


def aten_calls_per_step(script, env_id: str, num_envs: int, num_workers: int, device: torch.device,
                        precision: str) -> float:
    """The ATen calls of one rollout of the trainer a run uses, per step (the first rollout, which
    resets the games and may capture a CUDA graph, is not counted)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    config = script.RunConfig(env=env_id, num_envs=num_envs, precision=precision)
    with script.RunWorkers(env_id, num_envs, num_workers, seed=1, game_options=script.game_options(config)) as envs:
        trainer = script.RunTrainer(config, envs, device)
        trainer.collect_rollout()
        with Count():
            trainer.collect_rollout()
    return Count.calls / config.num_steps


class FixedFrames:
    """A vector env whose steps cost nothing: the same frames, no reward and no episode end at every step."""

    def __init__(self, num_envs: int, observation_shape: tuple[int, ...]):
        self.num_envs, self.n_actions, self.observation_shape = num_envs, 4, observation_shape
        self.obs = np.random.default_rng(0).integers(0, 256, (num_envs, *observation_shape), dtype=np.uint8)
        self.rewards, self.ends = np.zeros(num_envs, np.float32), np.zeros(num_envs, bool)

    def reset(self) -> np.ndarray:
        return self.obs

    def step(self, actions: np.ndarray):
        return ppo_atari.VecStep(self.obs, self.rewards, self.ends, self.ends, self.obs, [])


def host_microseconds_per_step(script, num_envs: int, channels_last: bool, rollouts: int = 5) -> float:
    """The fastest of `rollouts` rollouts of `script`'s `FastSamplingTrainer` on the CPU, in microseconds a step,
    with `FixedFrames` for games and the network's call made once: what is left is the host's own work, storing
    the frames (channels last, or as the games give them) and the rest of the rollout."""

    class HostOnly(script.FastSamplingTrainer):
        def sample_actions(self, obs):
            if not hasattr(self, "outputs"):
                self.outputs = tuple(output.clone() for output in super().sample_actions(obs))
            return self.outputs

        def frame_array(self, leading):
            return super().frame_array(leading) if channels_last else script.Trainer.frame_array(self, leading)

    config = script.Config(num_envs=num_envs)
    trainer = HostOnly(config, FixedFrames(num_envs, script.Game.observation_shape), torch.device("cpu"))
    trainer.collect_rollout()
    seconds = []
    for _ in range(rollouts):
        started = time.perf_counter()
        trainer.collect_rollout()
        seconds.append(time.perf_counter() - started)
    return min(seconds) / config.num_steps * 1e6


def train_throughput(script, env_id: str, num_envs: int, num_workers: int, device: torch.device, precision: str,
                     iterations: int, warmup: int, cuda_graph: bool = True, cuda_graph_update: bool = True) -> dict:
    """Agent steps per second of the trainer a run uses (Part 3's `RunTrainer` of `script`, its
    update replayed from a CUDA graph on CUDA unless `cuda_graph_update` is false), and the time of each iteration split into its phases, as a run times them
    (`RunWorkers` and `RunTrainer`): waiting for the games (the workers' `step`), sampling
    (`collect_rollout`, of which the rest is inference and storing the rollout) and the update
    (`update_policy`)."""
    config = script.RunConfig(env=env_id, num_envs=num_envs, precision=precision)
    torch.manual_seed(1)
    with script.RunWorkers(env_id, num_envs, num_workers, seed=1,
                           game_options=script.game_options(config)) as envs:
        trainer = script.RunTrainer(config, envs, device)
        trainer.cuda_graph, trainer.cuda_graph_update = cuda_graph, cuda_graph_update
        per_iteration, splits = [], []
        for iteration in range(warmup + iterations):
            before = {**envs.seconds, **trainer.seconds}
            started = time.perf_counter()
            trainer.update_policy(trainer.collect_rollout())
            if device.type == "cuda":
                torch.cuda.synchronize()
            if iteration >= warmup:
                per_iteration.append(time.perf_counter() - started)
                timings = {**envs.seconds, **trainer.seconds}
                spent = {phase: timings[phase] - before[phase] for phase in timings}
                splits.append({"env": spent["env"], "inference": spent["sampling"] - spent["env"],
                               "update": spent["update"]})
    median_seconds = statistics.median(per_iteration)
    return {"script": getattr(script, "__file__", "ppo_atari.py"), "trainer": type(trainer).__name__, "device": str(device),
            "precision": "bf16" if trainer.model.bf16 else "fp32", "num_envs": num_envs,
            "num_workers": num_workers, "cuda_graph": cuda_graph and device.type == "cuda",
            "cuda_graph_update": cuda_graph_update and device.type == "cuda",
            "sps": config.batch_size / median_seconds, "seconds_per_iteration": median_seconds,
            **{f"{k}_seconds": statistics.median(s[k] for s in splits) for k in splits[0]}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", default="Breakout")
    parser.add_argument("--part", choices=["env", "train", "host", "all"], default="all")
    parser.add_argument("--num-envs", type=int, nargs="+", default=[8, 32], help="games played at once; each is measured")
    parser.add_argument("--num-workers", type=int, default=0, help="0: one per CPU core, at most one per game")
    parser.add_argument("--steps", type=int, default=2000, help="env steps per timed env run")
    parser.add_argument("--repeats", type=int, default=5, help="timed env runs of each kind")
    parser.add_argument("--iterations", type=int, default=10, help="timed training iterations")
    parser.add_argument("--warmup", type=int, default=2, help="untimed training iterations first")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16", "both"], default="both")
    parser.add_argument("--baseline", type=Path, help="another copy of ppo_atari.py, measured in turns with this one")
    parser.add_argument("--rounds", type=int, default=1,
                        help="training runs of each kind, taking turns with each other and with the workers alone; "
                             "the medians are compared")
    parser.add_argument("--no-cuda-graph", action="store_true", help="choose actions on CUDA without the CUDA graph")
    parser.add_argument("--eager-update", action="store_true",
                        help="also train with the update's minibatch steps launched one by one, not from a CUDA graph, in turns")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    for name, least in [("num_envs", 1), ("num_workers", 0), ("steps", 1), ("repeats", 1), ("iterations", 1),
                        ("warmup", 0), ("rounds", 1)]:
        given = getattr(args, name)
        if (value := min(given if isinstance(given, list) else [given])) < least:
            parser.error(f"--{name.replace('_', '-')} must be at least {least}, not {value}")
    if args.baseline is not None and not args.baseline.is_file():
        parser.error(f"--baseline {args.baseline} is not a file")
    # Checked, not created: a file made now would be left empty by a run that fails or is stopped.
    if args.json is not None and (args.json.is_dir() or not args.json.parent.is_dir()
                                  or not os.access(args.json.parent, os.W_OK)):
        parser.error(f"--json {args.json}: cannot write there")  # now, not after the measurements
    try:
        env_id = ppo_atari.resolve_env_id(args.env)
        if args.part in ("train", "all"):
            ppo_atari.choose_device(args.device)  # --device cuda without a GPU: refused before anything runs
    except ppo_atari.ConfigError as error:
        parser.error(str(error))
    results = {"cpu_count": cpu_count(), "torch": torch.__version__, "env_id": env_id, "env": [], "train": [],
               "host": []}
    scripts = {"this": ppo_atari}
    if args.baseline:
        try:
            scripts["baseline"] = load_script(args.baseline)
        except Exception as error:  # the user's file, whatever it holds: what stopped it, in one line
            parser.error(f"--baseline {args.baseline} does not load as a copy of ppo_atari.py: "
                         f"{type(error).__name__}: {error}".splitlines()[0])
        if missing := [name for part, names in USED_BY_PART.items() if args.part in (part, "all")
                       for name in names if not hasattr(scripts["baseline"], name)]:
            parser.error(f"--baseline {args.baseline} is not a copy of ppo_atari.py: it defines no {', '.join(missing)}")
    # What trains, by name: a script, and whether its update may be replayed from a CUDA graph.
    kinds = {name: (name, True) for name in scripts}
    if args.eager_update:
        kinds["this, eager update"] = ("this", False)
    for num_envs in args.num_envs:
        num_workers = args.num_workers or min(num_envs, cpu_count())
        if args.part in ("env", "all"):
            env = env_throughput(env_id, num_envs, num_workers, args.steps, args.repeats)
            results["env"].append(env)
            print(f"(a) env only, {env_id}, {num_envs} games, {cpu_count()} cores, median of {args.repeats} runs "
                  f"of {args.steps} steps")
            print(f"    ppo_atari Workers ({num_workers} processes):            {env['workers_sps']:8,.0f} agent steps/s")
            print(f"    ale_py AtariVectorEnv (C++ threads):            {env['vector_env_sps']:8,.0f} agent steps/s")
            print(f"    ale_py AtariVectorEnv, episodic_life=True:      {env['vector_env_episodic_life_sps']:8,.0f} agent steps/s")
            print(f"    ratio, Workers / AtariVectorEnv (its fastest): {env['ratio']:.2f}")
        if args.part in ("train", "all"):
            device = ppo_atari.choose_device(args.device)
            precisions = ["fp32", "bf16"] if args.precision == "both" else [args.precision]
            print(f"(b) training, {env_id}, {num_envs} games x 128 steps, {num_workers} workers, {device}"
                  f"{', no CUDA graph' if args.no_cuda_graph else ''}, median of {args.iterations} iterations"
                  f"{f', the middle run of {args.rounds} rounds' if args.rounds > 1 else ''}"
                  f"{' (the faster of the middle two: give an odd --rounds for a median)' if args.rounds % 2 == 0 else ''}")
            for precision in precisions:
                # The kinds take turns, so that a noisy neighbour on a shared machine hits them alike.
                alone, runs = [], {name: [] for name in kinds}
                for _ in range(args.rounds):
                    alone.append(workers_alone(env_id, num_envs, num_workers, args.steps))
                    for name, (script, graph_update) in kinds.items():
                        runs[name].append(train_throughput(scripts[script], env_id, num_envs, num_workers, device,
                                                           precision, args.iterations, args.warmup,
                                                           not args.no_cuda_graph, graph_update))
                alone_sps = statistics.median(alone)
                print(f"    workers alone, random actions: {alone_sps:6,.0f} SPS")
                # A script's rollout is its `RunTrainer`'s whatever the trainer: counted once a script.
                aten_calls = {name: aten_calls_per_step(script, env_id, num_envs, num_workers, device, precision)
                              for name, script in scripts.items()}
                for name, (script, _) in kinds.items():
                    run = sorted(runs[name], key=lambda run: run["sps"])[len(runs[name]) // 2]
                    run.update(workers_alone_sps=alone_sps, of_workers_alone=run["sps"] / alone_sps,
                               rounds_sps=[each["sps"] for each in runs[name]], aten_calls_per_step=aten_calls[script])
                    results["train"].append(run)
                    rounds = f" (each round: {', '.join(f'{sps:,.0f}' for sps in run['rounds_sps'])})" if args.rounds > 1 else ""
                    print(f"    {name}, {run['precision']}: {run['sps']:6,.0f} SPS{rounds} "
                          f"({run['of_workers_alone']:.2f} of the workers alone, "
                          f"{run['aten_calls_per_step']:.1f} ATen calls a step)"
                          f" | per iteration {run['seconds_per_iteration']:.3f} s"
                          f" = waiting for games {run['env_seconds']:.3f} + inference {run['inference_seconds']:.3f}"
                          f" + update {run['update_seconds']:.3f}")
        if args.part in ("host", "all"):
            print(f"(c) the host's side of a step, {num_envs} games: the rollout with the games and the network's "
                  f"call taken out, on the CPU, one thread, the fastest of 5 rollouts")
            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # as the trainer samples
            try:
                for name, script in scripts.items():
                    host = {"script": getattr(script, "__file__", "ppo_atari.py"), "num_envs": num_envs,
                            **{f"{layout}_us_per_step": host_microseconds_per_step(script, num_envs, layout == "channels_last")
                               for layout in ("channels_last", "channels_first")}}
                    results["host"].append(host)
                    print(f"    {name}: {host['channels_last_us_per_step']:5.0f} us a step with the frames stored channels "
                          f"last (a CPU's run), {host['channels_first_us_per_step']:5.0f} channels first (a CUDA run's)")
            finally:
                torch.set_num_threads(threads)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
