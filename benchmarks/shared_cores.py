"""What happens to `ppo_atari.py`'s update when another process's threads share the cores.

PyTorch runs a CPU operation on as many threads as there are cores, and its threads wait for each
other by spinning. Two processes that both do so on the same cores can keep each other waiting. This
script times minibatch steps of `ppo_atari.py`'s network (a forward and backward pass over 256 frame
stacks, the default minibatch, then a step of Adam) in fresh processes, `--runs` of them one after
another, each beside a neighbour: a process multiplying 512 x 512 matrices on `--neighbour-threads`
threads (0: no neighbour). `--threads` is the steps' own number of threads (`OMP_NUM_THREADS`).

    python benchmarks/shared_cores.py                               # both on every core
    python benchmarks/shared_cores.py --threads 1 --neighbour-threads 1

A run that takes more than `--limit` seconds is stopped and reported as such.
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

ROOT = Path(__file__).resolve().parent.parent


def neighbour() -> None:
    """Multiply matrices until killed, on the threads `OMP_NUM_THREADS` gives."""
    import torch

    matrix = torch.randn(512, 512)
    while True:
        matrix @ matrix


def time_steps(steps: int, precision: str) -> None:
    """Print, as JSON, the seconds each of `steps` minibatch steps took (after one to warm up)."""
    import torch

    sys.path.insert(0, str(ROOT))
    import ppo_atari

    torch.manual_seed(0)
    model = ppo_atari.TunedActorCritic(ppo_atari.make_model((4, 84, 84), 4),
                                       ppo_atari.use_bf16(precision, torch.device("cpu")))
    optimizer = torch.optim.Adam(model.parameters(), lr=2.5e-4, eps=1e-5)
    frames = torch.randint(0, 256, (256, 4, 84, 84), dtype=torch.uint8)
    seconds = []
    for _ in range(steps + 1):
        started = time.perf_counter()
        logits, values = model(frames)
        optimizer.zero_grad()
        (logits.logsumexp(-1).mean() + values.square().mean()).backward()
        optimizer.step()
        seconds.append(time.perf_counter() - started)
    print(json.dumps({"threads": torch.get_num_threads(), "bf16": model.bf16, "seconds": seconds[1:]}))


def at_least(low: float, kind=int):
    """An argparse type: a number of `kind`, at least `low`."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not value >= low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, not {text}")
        return value
    return parse


positive = at_least(1)


def main() -> None:
    cores = len(os.sched_getaffinity(0))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=positive, default=cores, help=f"threads of the steps (default: {cores}, the cores)")
    parser.add_argument("--neighbour-threads", type=at_least(0), default=cores,
                        help=f"threads of the neighbour, 0 for none (default: {cores})")
    parser.add_argument("--runs", type=positive, default=6, help="fresh processes, one after another (default: 6)")
    parser.add_argument("--steps", type=positive, default=16, help="minibatch steps timed in each (default: 16)")
    parser.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto",
                        help="the torso's precision, as ppo_atari.py's --precision (default: auto)")
    parser.add_argument("--limit", type=at_least(0.1, float), default=60.0, help="seconds after which a run is stopped (default: 60)")
    parser.add_argument("--json", type=Path, help="also write the runs here")
    parser.add_argument("--neighbour", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--time-steps", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.neighbour:
        return neighbour()
    if args.time_steps:
        return time_steps(args.steps, args.precision)

    me = [sys.executable, str(Path(__file__).resolve())]
    beside = None
    if args.neighbour_threads:
        beside = subprocess.Popen(me + ["--neighbour"], env={**os.environ, "OMP_NUM_THREADS": str(args.neighbour_threads)})
    runs = []
    try:
        time.sleep(1.0)  # the neighbour at work before the first run
        for index in range(args.runs):
            started = time.perf_counter()
            try:
                done = subprocess.run(me + ["--time-steps", "--steps", str(args.steps), "--precision", args.precision],
                                      env={**os.environ, "OMP_NUM_THREADS": str(args.threads)}, capture_output=True,
                                      text=True, timeout=args.limit, check=True)
            except subprocess.TimeoutExpired:
                runs.append(None)
                print(f"run {index + 1}: stopped after {args.limit:g} s", flush=True)
                continue
            run = json.loads(done.stdout.strip().splitlines()[-1])
            runs.append(run)
            seconds = run["seconds"]
            print(f"run {index + 1}: {args.steps} steps in {sum(seconds):.2f} s (median {statistics.median(seconds):.3f} s, "
                  f"longest {max(seconds):.3f} s); {time.perf_counter() - started:.1f} s with the start", flush=True)
    finally:
        if beside is not None:
            beside.kill()
            beside.wait()
    slow = sum(run is None for run in runs)
    totals = [sum(run["seconds"]) for run in runs if run is not None]
    print(f"{args.threads} thread{'s' * (args.threads != 1)} beside {args.neighbour_threads} on {cores} cores: "
          f"{len(totals)} of {args.runs} runs finished"
          + (f", in {min(totals):.2f} to {max(totals):.2f} s" if totals else "")
          + (f"; {slow} stopped after {args.limit:g} s" if slow else ""))
    if args.json:
        args.json.write_text(json.dumps({"cores": cores, "threads": args.threads, "neighbour_threads": args.neighbour_threads,
                                         "steps": args.steps, "precision": args.precision, "limit_s": args.limit,
                                         "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
