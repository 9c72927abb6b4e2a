"""Learning curve and speed of vpg_continuous.py on HalfCheetah-v5, one run per seed.

Each run is the script itself, through its command line, exactly as a user starts it; this file
then reads the TensorBoard events the run leaves and reports the return curve (the mean episodic
return of the episodes that ended in each tenth of the run), the return at the end (the mean of
the last 20 episodes, the number the script's progress line shows), the SPS, the wall time, and
the seconds spent in each phase of an update (`perf/env_seconds`, `perf/inference_seconds` and
`perf/update_seconds`, which the script measures around its trainer's methods, not inside them).

    python benchmarks/vpg_halfcheetah.py                                   # seed 1, 1M steps
    python benchmarks/vpg_halfcheetah.py --seeds 1 2 3 --json results.json
    python benchmarks/vpg_halfcheetah.py --seeds 1 -- --state-dependent-std    # an ablation

Anything after `--` is passed to vpg_continuous.py. Runs go to runs/benchmark/<env>__<seed>__<label>,
the label being `--label`, else the flags after `--` (`state-dependent-std` above), else `default`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).resolve().parent.parent


def summarise(run_dir: Path, total_timesteps: int, points: int = 10) -> dict:
    """The return curve, the final return, the speed and the time of each phase, from a run's TensorBoard events."""
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    # A run too short to end an episode has logged no return: its curve and final return are NaN.
    ended = "charts/episodic_return" in events.Tags()["scalars"]
    returns = [(e.step, e.value) for e in events.Scalars("charts/episodic_return")] if ended else []
    sps = [e.value for e in events.Scalars("charts/SPS")]
    curve = []
    for i in range(1, points + 1):
        low, high = total_timesteps * (i - 1) / points, total_timesteps * i / points
        window = [value for step, value in returns if low < step <= high]
        curve.append((int(high), float(np.mean(window)) if window else float("nan")))
    phases = {tag.removeprefix("perf/").removesuffix("_seconds"): float(sum(e.value for e in events.Scalars(tag)))
              for tag in events.Tags()["scalars"] if tag.startswith("perf/")}
    final_return = float(np.mean([value for _, value in returns[-20:]])) if returns else float("nan")
    return {"final_return": final_return, "curve": curve, "episodes": len(returns), "sps": sps[-1], "phase_seconds": phases}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", default="HalfCheetah-v5")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1])
    parser.add_argument("--total-timesteps", type=int, default=1_000_000)
    parser.add_argument("--label", help="names the runs' directories (default: `default`, or the flags after --)")
    parser.add_argument("--runs", type=Path, default=ROOT / "runs" / "benchmark", help="where the runs go")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("script_args", nargs="*", help="after --: flags for vpg_continuous.py")
    args = parser.parse_args()
    # An ablation's runs go beside the default's, not into them: its label is its flags.
    args.label = args.label or "_".join(arg.strip("-").replace("/", "-") for arg in args.script_args) or "default"
    # Checked, not created: a file made now would be left empty by a run that fails or is stopped.
    if args.json is not None and (args.json.is_dir() or not args.json.parent.is_dir()
                                  or not os.access(args.json.parent, os.W_OK)):
        parser.error(f"--json {args.json}: cannot write there")  # now, not after the runs
    # vpg_continuous.py runs in the repository's root and its events are read from here: made absolute, a
    # relative --runs names one folder to both.
    args.runs = args.runs.resolve()

    results = []
    for seed in args.seeds:
        run_dir = args.runs / f"{args.env}__{seed}__{args.label}"
        command = [sys.executable, str(ROOT / "vpg_continuous.py"), "--env", args.env, "--seed", str(seed),
                   "--total-timesteps", str(args.total_timesteps), "--run-dir", str(run_dir), *args.script_args]
        print(" ".join(command[1:]), file=sys.stderr, flush=True)
        started = time.perf_counter()
        if status := subprocess.run(command, cwd=ROOT).returncode:  # the script has said why, in its own line
            sys.exit(f"vpg_continuous.py ended with exit status {status}; seeds before {seed} are done" if results
                     else f"vpg_continuous.py ended with exit status {status}")
        result = {"seed": seed, "run_dir": str(run_dir), "seconds": time.perf_counter() - started,
                  **summarise(run_dir, args.total_timesteps)}
        results.append(result)
        curve = "  ".join(f"{step // 1000}k:{value:.0f}" for step, value in result["curve"])
        phases = ", ".join(f"{phase} {seconds:.1f} s" for phase, seconds in result["phase_seconds"].items())
        returned = f"return {result['final_return']:.1f} (last 20 episodes)" if result["episodes"] else "no episode ended"
        print(f"seed {seed}: {returned} | {result['sps']:,.0f} SPS | "
              f"{result['seconds'] / 60:.1f} min ({phases}) | curve {curve}", flush=True)
    finals = [result["final_return"] for result in results]
    spread = f" ± {statistics.stdev(finals):.1f}" if len(finals) > 1 else ""
    print(f"{args.env}, {args.total_timesteps:,} steps, {len(finals)} seeds ({args.label}): "
          f"return {statistics.mean(finals):.1f}{spread}, {statistics.mean(r['sps'] for r in results):,.0f} SPS")
    if args.json:
        args.json.write_text(json.dumps({"env": args.env, "total_timesteps": args.total_timesteps,
                                         "label": args.label, "script_args": args.script_args,
                                         "runs": results}, indent=2))


if __name__ == "__main__":
    main()
