"""ppo_atari.py beside CleanRL's ppo_atari.py: each a whole process, the two in turns.

    python benchmarks/beside_cleanrl.py --cleanrl ~/cleanrl --cleanrl-site ~/cleanrl-site \\
        --device cuda --total-timesteps 24576 --rounds 2 --json results/beside-cleanrl.json

`--cleanrl` is a checkout of github.com/vwxyzjn/cleanrl: its `cleanrl/ppo_atari.py` runs unchanged,
with the libraries it was written for installed apart from this project's, in the folder that
`--cleanrl-site` names, which goes first on its path (PyTorch, NumPy and TensorBoard are shared):

    git clone https://github.com/vwxyzjn/cleanrl ~/cleanrl
    pip install --no-deps --target ~/cleanrl-site gymnasium==0.29.1 ale-py==0.9.0 tyro docstring-parser \
        shtab typeguard cloudpickle farama-notifications typing-extensions

ale-py 0.9 registers its games with gymnasium when it is imported, where the 0.8 that CleanRL pins
did it through an entry point, so its runner imports ale-py before running the script.

Both play Breakout with their defaults, 8 games x 128 steps an update, in float32 (`--precision
fp32` for ppo_atari.py; CleanRL's one precision), seed 1: `python ppo_atari.py --env Breakout`
(ALE/Breakout-v5, its own frame skip and max-pool) and CleanRL's `BreakoutNoFrameskip-v4` with its
wrappers; either way an agent step is 4 frames of the emulator. Two speeds of each run: steps over
the seconds from start to exit (imports, start-up and all), and steps over the seconds between its
first and last `charts/SPS` events (one an update, in both scripts: start-up and the first update
left out alike). The two scripts alternate, `--rounds` times, and medians are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).resolve().parent.parent
RUN_CLEANRL = "import ale_py, runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"


def commands(args: argparse.Namespace, run_dir: Path) -> dict[str, tuple[list[str], dict[str, str]]]:
    """The command line of each script, run in `run_dir`, and what its environment sets: CleanRL's path is its
    own libraries and its checkout alone, so that none of this project's (gymnasium 1.3, say) comes first."""
    steps = str(args.total_timesteps)
    ours = [sys.executable, str(ROOT / "ppo_atari.py"), "--env", "Breakout", "--device", args.device,
            "--precision", "fp32", "--seed", "1", "--total-timesteps", steps, "--run-dir", str(run_dir / "run")]
    cleanrl = [sys.executable, "-c", RUN_CLEANRL, str(args.cleanrl / "cleanrl" / "ppo_atari.py"), "--seed", "1",
               "--total-timesteps", steps, "--cuda" if args.device == "cuda" else "--no-cuda"]
    site = [str(args.cleanrl_site)] if args.cleanrl_site else []
    return {"ppo_atari.py": (ours, {}),
            "CleanRL": (cleanrl, {"PYTHONPATH": os.pathsep.join([*site, str(args.cleanrl)])})}


def sps_between_events(run_dir: Path) -> float:
    """Steps per second between the first and the last `charts/SPS` event under `run_dir`."""
    (events,) = {path.parent for path in run_dir.rglob("events.out.tfevents.*")}
    accumulator = EventAccumulator(str(events))
    accumulator.Reload()
    first, *_, last = accumulator.Scalars("charts/SPS")
    return (last.step - first.step) / (last.wall_time - first.wall_time)


def measure(name: str, command: list[str], added: dict[str, str], run_dir: Path) -> dict:
    """Run one script to its end in `run_dir`; its two speeds."""
    run_dir.mkdir(parents=True)
    started = time.perf_counter()
    result = subprocess.run(command, cwd=run_dir, env={**os.environ, **added}, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        sys.exit(f"{name} exited with status {result.returncode}:\n{result.stdout[-2000:]}{result.stderr[-4000:]}")
    return {"seconds": seconds, "sps_whole_process": int(command[command.index("--total-timesteps") + 1]) / seconds,
            "sps_between_events": sps_between_events(run_dir)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cleanrl", type=Path, required=True, help="a checkout of vwxyzjn/cleanrl")
    parser.add_argument("--cleanrl-site", type=Path, help="the folder of CleanRL's own libraries (pip install --target)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--total-timesteps", type=int, default=24576, help="steps of each run (default: 24576)")
    parser.add_argument("--rounds", type=int, default=2, help="turns of each script (default: 2)")
    parser.add_argument("--json", type=Path, help="write the runs and the medians here")
    args = parser.parse_args(argv)
    if not (args.cleanrl / "cleanrl" / "ppo_atari.py").is_file():
        parser.error(f"--cleanrl {args.cleanrl} holds no cleanrl/ppo_atari.py")
    if args.total_timesteps < 2048:  # two updates of 8 games x 128 steps: two `charts/SPS` events
        parser.error(f"--total-timesteps must be at least 2048, not {args.total_timesteps}")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, not {args.rounds}")
    args.cleanrl, args.cleanrl_site = args.cleanrl.resolve(), args.cleanrl_site and args.cleanrl_site.resolve()
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as folder:
        for round_ in range(args.rounds):
            for name in ["ppo_atari.py", "CleanRL"]:
                run_dir = Path(folder) / f"round{round_}" / name
                runs.setdefault(name, []).append(measure(name, *commands(args, run_dir)[name], run_dir))
                print(f"round {round_ + 1}, {name}: {runs[name][-1]['sps_whole_process']:,.0f} steps/s from start to "
                      f"exit, {runs[name][-1]['sps_between_events']:,.0f} between its first and last update", flush=True)
    medians = {name: {key: statistics.median(run[key] for run in these) for key in these[0]} for name, these in runs.items()}
    ours, theirs = medians["ppo_atari.py"], medians["CleanRL"]
    print(f"Breakout, {args.total_timesteps:,} steps, {args.device}, medians of {args.rounds}: ppo_atari.py "
          f"{ours['sps_whole_process']:,.0f} steps/s from start to exit, CleanRL {theirs['sps_whole_process']:,.0f} "
          f"({ours['sps_whole_process'] / theirs['sps_whole_process']:.2f} times); between the first and the last "
          f"update {ours['sps_between_events']:,.0f} and {theirs['sps_between_events']:,.0f} "
          f"({ours['sps_between_events'] / theirs['sps_between_events']:.2f} times)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": args.device, "total_timesteps": args.total_timesteps,
                                         "runs": runs, "medians": medians}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
