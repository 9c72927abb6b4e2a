r"""Learning curves of this project's scripts, drawn beside the published curves they should match.

A curve is made the way a user would make it: the script itself runs through its command line, one
process per seed, with the schedule of a full run (`--total-timesteps`, so that the learning rate
and the clip range anneal as they would over the whole run) and is stopped at a budget of steps. A
run stopped at the budget keeps its checkpoint, so a later call with a larger budget resumes it: a
10M-step curve can be built over several sittings, on several machines, one chunk at a time. For
`ppo_jax.py` on a gymnax env it is the same curve as one run's, bit for bit: the environments' state
is in its checkpoint. ALE's games (in `ppo_atari.py` and in `ppo_jax.py`'s Atari path) and
`vpg_continuous.py`'s envs restart at each sitting, their state not saved: the weights, the
optimizer and the schedule go on, but from a sitting's first step the episodes are not the ones an
unbroken run would have played, and the curve differs from its curve there. This file then reads the
TensorBoard events the runs leave and writes, per task, under `benchmarks/results/`:

- `<task>.csv`: the curve, one row per point of a regular grid of steps (the format below);
- `<task>.png`: the score against steps, the mean over the seeds with their spread (min to max)
  shaded, and the published points of the task's anchors on the same axes, and, for a task drawn
  beside another (`breakout-jax` beside `breakout`), the other's mean curve, read from its CSV;
- `<task>_time.png`: the same curve against the training time.

    python benchmarks/learning_curves.py --list                  # the tasks, their settings and anchors
    python benchmarks/learning_curves.py breakout                # ppo_atari.py, 10M schedule, 3 seeds to 2M
    python benchmarks/learning_curves.py breakout --budget 5M    # later: the same runs resumed to 5M
    python benchmarks/learning_curves.py halfcheetah --seeds 1 2 3
    python benchmarks/learning_curves.py cartpole-jax --plot-only    # redraw, from the runs or the CSV
    python benchmarks/learning_curves.py --script ppo_atari.py --env Pong --schedule 10M --budget 1M \
        --seeds 1 2 --name pong -- --num-envs 16                 # any script, env and flags
    python benchmarks/learning_curves.py breakout-fp32 --cluster slurm --partition gpu \
        --gpus-per-job 1 --time-limit 240                        # one SLURM job per seed (see below)
    python benchmarks/learning_curves.py breakout-fp32 --status    # where those jobs stand
    python benchmarks/learning_curves.py --suite atari57 --script ppo_jax.py --cluster slurm --no-wait

Anything after `--` is passed on to the script, after the task's own flags. Step counts may be
written `2M`, `500k`, `1e6` or `2_000_000`. A mistake in the input is one line on stderr and exit
status 2; a script that fails makes this exit 1, and Ctrl-C 130 (the run saves its checkpoint and
the same command resumes it), as do SIGTERM and a hang-up (the terminal closed) while a run trains.

## The runs

Seed `S` of task `T` runs in `runs/curves/T/seed-S/` (`--runs` moves it; `runs/` is ignored by
git), as

    python <script> --env <env> --seed S --total-timesteps <schedule> --run-dir runs/curves/T/seed-S [flags]

with `--resume <run dir>/checkpoint.pt` (ppo_jax.py: `checkpoint.msgpack`) added when the run
dir already holds a checkpoint; flags typed on a resumed run's command line override the
checkpoint's. A seed whose events already reach the budget is skipped. The scripts have no flag to
stop at a step: this file reads their progress line (`step 1,024/10,000,000 (0.0%) | ...`) and
sends one SIGINT once the step shown reaches the budget; the script finishes what it is doing,
writes its checkpoint and exits 130. The script's stderr is a pseudo-terminal, because the scripts
print their progress line after every update on a terminal but only every 10 seconds into a pipe
or a file. ppo_atari.py and vpg_continuous.py then stop exactly at the
first update that reaches the budget: the SIGINT arrives while the next rollout is played, and they
drop an unfinished rollout. ppo_jax.py (on gymnax and on Atari alike) runs compiled pieces of
`--checkpoint-every` updates and sees a signal only between two of them: it stops at the end of
the first piece that reaches the budget, or of the one after it when the signal comes late (give it
`-- --checkpoint-every N` with pieces that end on the budget). Steps past the budget stay in the
run and are simply past the end of this budget's curve. When the
budget is the schedule, the run is left to finish by itself (exit 0). What the script prints goes
to `<run dir>/learning_curves.log`, and its other lines and a progress line every 10 seconds to
this terminal.

## On a cluster

`--cluster slurm` submits each run (a task and a seed) as one job, through submitit, instead of
running the seeds one after another here; `--cluster local` does the same with submitit's local
executor, on this machine. A job runs the sittings above on its node. `--partition`, `--time-limit`
(minutes), `--cpus-per-job` and `--gpus-per-job` say what each job asks for, and every
`--slurm-arg KEY=VALUE` is passed on to sbatch as `--KEY=VALUE`. `--runs` must be on a file system
that the nodes and this machine share, and so must the Python that runs this file. The command then
waits, saying each run's state as it changes (`--no-wait`: it exits once the jobs are submitted),
and makes the CSVs and plots, as above, once every run has reached its budget; the same command run
again, or `--status`, says which runs are done, running, queued or failed (a failed one with the
last lines of its log) and submits only the runs that have no job under way. A job stopped before
its run's end leaves the run's checkpoint: before its time limit SLURM sends SIGUSR2 (`--signal`, 90
s ahead), and the job stops the script, waits for its checkpoint and is requeued; at the limit
itself, on `scancel` or a preemption, SIGTERM reaches the script, which saves and exits, and the
waiting command submits the run again. Either way the run resumes from its checkpoint (with its
games begun afresh, as above, where they are not in it). A run whose job ended without getting it
any further is failed, and submitted again only with `--retry-failed`. `benchmarks/README.md` shows
a run on a single-node SLURM.

## The Atari suite

`--suite atari3` (CleanRL's three games: Pong, BeamRider, Breakout) and `--suite atari57` (the 57
games of the ALE) run `--script` (ppo_atari.py, or ppo_jax.py) on each game as a task of its own,
`<script>-<Game>`, with a 10M-step schedule and seeds 1 to 3. Games the installed ale-py lacks are
named in one line and skipped. Once the curves are drawn, each game's score (the mean over its seeds
of the curve's last point) is human-normalised, $(score - random) / (human - random)$, and
`<suite>-<script>-hns.csv` and `.md` list them with their median and mean over the games, beside
CleanRL's median of 1.04 for its JAX PPO after 10M steps on all 57.

## What a point of the curve is

The score at step `t` is the mean of the last `--window` (100) scores logged under
`charts/episodic_return` at a step of at most `t`, in the order they were logged. ppo_atari.py
logs one score per finished game (the game's real score over all its lives) and vpg_continuous.py
one per finished episode, each at the step of the update in which it ended: for them a point is
the mean real score of the last 100 whole games or episodes. ppo_jax.py cannot log its episodes
one by one from inside its compiled program; it keeps the returns of its last 100 (on Atari, the
real scores of the last 100 whole games) and logs their mean under
`charts/episodic_return_last_100` after every update in which an episode ended. For its runs a
point is the last of those means logged at a step of at most `t`: the same mean of the last 100,
computed by the script (`--window` does not apply). With `--num-seeds N` it trains N agents in one
process and logs each in `<run dir>/agent-<i>/` (the run dir itself holds their mean, which is not
used here). Each agent is a curve of its own, spread and mean are over agents, and training time is
that of the process, shared by them. Runs of ppo_jax.py from before it kept its last 100 have only
`charts/episodic_return`, the mean return of each update's episodes; for them a point is the mean
over the last `--window` updates in which an episode ended (an update's episodes weigh as one, so
the window spans updates, not episodes), and the plots say so.

A point is empty for a curve that has no finished game (or episode, or update with one) at or
before it, and for a run that did not get that far. A run that finished its schedule is counted
to the schedule's end even when the schedule is not a whole number of batches.

Resumed sittings: each sitting of a run writes a new event file; all are read, in the order they
were opened. A sitting resumed from a checkpoint older than the last events (a run killed without
the chance to save) logs again the steps after that checkpoint; the earlier sitting's events from
the resumed sitting's first step on are dropped, as TensorBoard's purge does, so the assembled
sittings read as one run's events.

## Training time

The time of an event is the time since the first event of its file (the writer opening, after the
script has started its workers, or compiled), plus the whole length of every earlier sitting (from
its first event to its last): sittings are laid end to end, and the pauses between them do not
count. The time plot places each point of the curve at the mean over the seeds of the time each
took to reach that step.

## The CSV

    step,seed_1,seed_2,mean,seconds_seed_1,seconds_seed_2
    20000,0.6,1.2,0.9,96.3,95.1

- `step`: the point of the grid, `budget * i / --points` for i = 1 .. `--points` (100), rounded, and
  at most one point per step (more points than steps give every step from 1 to the budget);
- `seed_<s>` (one agent per process) or `seed_<s>_agent_<i>` (several, ppo_jax.py's
  `--num-seeds`): the score of each curve at that step, as above, rounded to 3 decimals; empty
  where it has none;
- `mean`: the mean of those scores, empty unless every curve's run has reached the step and at
  least one has a score there;
- `seconds_<curve>`: the training time in seconds at which that curve's run logged the step (its
  first update at or past it), one decimal; empty where the run has not reached it.

The curve at a step depends only on the events logged up to it, so a CSV remade after the runs are
resumed to a larger budget holds the same values at the steps the two grids share. A CSV remade
from runs keeps the columns of the CSV already there that no run here replaces, when the two grids
are the same: seed 1 trained on one machine and seed 2 on another (`--seeds 2` into its own
`--runs`) end in one CSV, and a seed whose runs are gone is not lost.
"""

from __future__ import annotations

import argparse
import bisect
import codecs
import collections
import contextlib
import csv
import difflib
import fcntl
import getpass
import io
import json
import math
import os
import pickle
import pty
import re
import select
import signal
import statistics
import subprocess
import sys
import time
import typing
from dataclasses import dataclass, field, replace
from pathlib import Path

if __name__ == "__main__":  # a Ctrl-C while the libraries below load: exit status 130 at once, not a traceback
    signal.signal(signal.SIGINT, lambda signum, frame: os._exit(128 + signum))

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend that needs no display)
from matplotlib.ticker import FuncFormatter  # noqa: E402
from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PROG = "learning_curves.py"
CHECKPOINT_NAMES = ("checkpoint.pt", "checkpoint.msgpack")
SCORE_TAG = "charts/episodic_return"
RING_TAG = "charts/episodic_return_last_100"
"""ppo_jax.py's own mean return of its last 100 episodes, logged after each update in which one ended."""


# ## The tasks
#
# A task is a preset: the script, the environment, the schedule of the full run, the budget and the
# seeds of the curve the issue asks for, and its anchors. The anchors' sources: CleanRL's docs page of
# `ppo_atari.py` (docs.cleanrl.dev, PPO, its Breakout curve read by eye at 1M, 2M and 5M; 414.66 ± 28.09
# at 10M from its table); Spinning Up's benchmark page (VPG in PyTorch on HalfCheetah-v3, 3M steps, ≈ 630
# at the end); PureJaxRL's README (github.com/luchris429/purejaxrl), whose two plots are against
# seconds, not steps, and end at 500 on CartPole-v1 and near 40 on MinAtar-Breakout; rl-baselines3-zoo's
# benchmark.md (DLR-RM/rl-baselines3-zoo, "Performance of trained agents": one run each, its trained
# agent evaluated with the deterministic policy, 1M steps): A2C 3,041.174 ± 157.265 on HalfCheetah-v3,
# A2C 733.454 ± 376.574 and PPO 2,410.435 ± 10.026 on Hopper-v3.


@dataclass(frozen=True)
class Anchor:
    """Published numbers drawn on the same axes as a curve."""

    source: str
    """Who published them and where they were read: the legend's label."""
    points: tuple[tuple[int, float], ...]
    """(step, score) pairs."""
    level: bool = False
    """Draw the first point as a dashed horizontal line: a single number, published at a step that
    may lie past the budget (the label says at which)."""


@dataclass(frozen=True)
class Task:
    """A script on an environment, with the schedule of its full run, the budget it is stopped at
    and the seeds it is run with; its flags; what its score is called; and its anchors."""

    name: str
    script: str
    env: str
    schedule: int
    budget: int
    seeds: tuple[int, ...]
    flags: tuple[str, ...] = ()
    score: str = "return"
    unit: str = "episodes"
    """What the score averages, for the y axis: `games` or `episodes` (or, for ppo_jax.py's runs from
    before it kept its last 100 episodes, `updates`)."""
    anchors: tuple[Anchor, ...] = ()
    beside: tuple[str, ...] = ()
    """Other tasks on the same environment, whose curves (read from their CSVs in the results
    directory) are drawn on the same axes: one script beside another."""


CLEANRL_BREAKOUT = Anchor(
    "CleanRL ppo_atari.py, read off its docs plot (414.66 ± 28.09 at 10M, 3 seeds)",
    ((1_000_000, 20.0), (2_000_000, 47.5), (5_000_000, 200.0), (10_000_000, 414.7)))

TASKS = {task.name: task for task in [
    # `breakout`'s seeds 1 and 2 ran with `--precision auto` on an AMD CPU with AVX-512 BF16, where it
    # takes the bfloat16 torso, and seed 3 with `--precision bf16` on an Intel Xeon; the task names
    # bfloat16, so that every seed trains in it, on any machine. `breakout-fp32` is the same run in
    # float32 (on a GPU, the precision `auto` takes there).
    Task("breakout", "ppo_atari.py", "Breakout", schedule=10_000_000, budget=2_000_000, seeds=(1, 2, 3),
         flags=("--precision", "bf16"), score="score", unit="games", anchors=(CLEANRL_BREAKOUT,)),
    Task("breakout-fp32", "ppo_atari.py", "Breakout", schedule=10_000_000, budget=2_000_000, seeds=(1, 2, 3),
         flags=("--precision", "fp32"), score="score", unit="games", anchors=(CLEANRL_BREAKOUT,),
         beside=("breakout",)),
    Task("halfcheetah", "vpg_continuous.py", "HalfCheetah-v5", schedule=1_000_000, budget=1_000_000, seeds=(1, 2, 3),
         anchors=(Anchor("rl-zoo A2C (HalfCheetah-v3, one run): 3,041 at 1M", ((1_000_000, 3041.2),), level=True),
                  Anchor("Spinning Up VPG (PyTorch, HalfCheetah-v3): ≈ 630 at 3M", ((3_000_000, 630.0),), level=True))),
    Task("hopper", "vpg_continuous.py", "Hopper-v5", schedule=1_000_000, budget=1_000_000, seeds=(1, 2, 3),
         anchors=(Anchor("rl-zoo A2C (Hopper-v3, one run): 733 at 1M", ((1_000_000, 733.5),), level=True),
                  Anchor("rl-zoo PPO (Hopper-v3, one run): 2,410 at 1M", ((1_000_000, 2410.4),), level=True))),
    Task("cartpole-jax", "ppo_jax.py", "CartPole-v1", schedule=500_000, budget=500_000, seeds=(1,),
         flags=("--num-seeds", "16"),
         anchors=(Anchor("PureJaxRL PPO (README plot): 500 at its run's end", ((500_000, 500.0),), level=True),)),
    # The README does not say how long its MinAtar run was; PureJaxRL's MinAtar example notebook trains
    # for 1e7 steps of 64 envs x 128 steps, the scale of this preset (but with a learning rate of 5e-3).
    Task("minatar-breakout-jax", "ppo_jax.py", "Breakout-MinAtar", schedule=10_000_000, budget=10_000_000,
         seeds=(1,), flags=("--num-seeds", "4"),
         anchors=(Anchor("PureJaxRL PPO (README plot, against seconds): ≈ 40 at its run's end",
                         ((10_000_000, 40.0),), level=True),)),
    Task("breakout-jax", "ppo_jax.py", "Breakout", schedule=10_000_000, budget=2_000_000, seeds=(1, 2),
         score="score", unit="games", anchors=(CLEANRL_BREAKOUT,), beside=("breakout",)),
]}

UNITS = {"ppo_atari.py": "games", "vpg_continuous.py": "episodes", "ppo_jax.py": "episodes"}


class UsageError(Exception):
    """A mistake in what was asked for: one line, exit status 2."""


class RunError(Exception):
    """A script that failed: one line, exit status 1."""


class Interrupted(Exception):
    """Ctrl-C, SIGTERM or SIGHUP: the script under way saved its checkpoint; exit status 130."""


def parse_steps(text: str) -> int:
    """A step count: `2000000`, `2_000_000`, `2,000,000`, `2e6`, `2M` or `500k`."""
    cleaned = text.strip().replace("_", "").replace(",", "")
    scale = {"k": 1_000, "m": 1_000_000}.get(cleaned[-1:].lower(), 1)
    number = cleaned[:-1] if scale > 1 else cleaned
    try:
        value = float(number) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of steps: {text!r}") from None
    if not value.is_integer() or value < 1:
        raise argparse.ArgumentTypeError(f"not a whole, positive number of steps: {text!r}")
    return int(value)


def format_steps(steps: float) -> str:
    """`10M`, `2.5M`, `500k`, `2,048`."""
    if steps >= 1_000_000 and steps % 10_000 == 0:
        return f"{steps / 1_000_000:g}M"
    if steps >= 1_000 and steps % 1_000 == 0:
        return f"{steps / 1_000:g}k"
    return f"{steps:,.0f}"


# ## Running a seed


def run_dir_of(task: Task, seed: int, runs: Path) -> Path:
    return runs / task.name / f"seed-{seed}"


def checkpoint_of(run_dir: Path) -> Path | None:
    return next((run_dir / name for name in CHECKPOINT_NAMES if (run_dir / name).exists()), None)


def script_command(task: Task, seed: int, run_dir: Path, checkpoint: Path | None) -> list[str]:
    command = [sys.executable, str(ROOT / task.script), "--env", task.env, "--seed", str(seed),
               "--total-timesteps", str(task.schedule), "--run-dir", str(run_dir)]
    if checkpoint is not None:
        command += ["--resume", str(checkpoint)]
    return command + list(task.flags)


PROGRESS = re.compile(r"step (\d[\d,]*)/(\d[\d,]*)")
ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def clean(line: str) -> str:
    """A line of terminal output without its escape sequences (the progress line's erase-line)."""
    return ESCAPE.sub("", line)


class Child:
    """The script a sitting runs, as the signal handlers and a cluster job's `checkpoint` reach it."""

    def __init__(self, process: subprocess.Popen, master: int, log_file: typing.TextIO):
        self.process, self.master, self.log_file = process, master, log_file
        self.sent = 0
        """Stop requests (SIGINT) sent to it: one asks it to save and exit, a second one aborts it."""

    def stop(self) -> None:
        """Ask the script to stop at its next safe point and save its checkpoint, unless already asked."""
        if self.sent == 0 and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            self.sent = 1

    def wait_saved(self) -> int:
        """Wait for the stopped script to exit, copying what it prints to the run's log meanwhile."""
        while self.process.poll() is None:
            ready, _, _ = select.select([self.master], [], [], 0.5)
            if ready:
                try:
                    text = os.read(self.master, 65536).decode("utf-8", "replace")
                except OSError:  # EIO: the script has closed its terminal
                    self.process.wait()
                    break
                self.log_file.write(clean(text.replace("\r", "\n")))
        self.log_file.flush()
        return self.process.returncode


RUNNING: list[Child] = []
"""The sitting under way in this process, if any (a cluster job's `checkpoint` stops it)."""


def ignore_preemption_signal() -> None:
    """In the script of a cluster job, before it starts: ignore SIGUSR2. SLURM sends it to every process
    of the job before the time limit, and its default action would kill the script without a
    checkpoint; submitit's handler in the job's own process stops the script instead."""
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)


def run_sitting(command: list[str], stop_at: int | None, log: Path, label: str,
                job: str | None = None) -> tuple[int, bool, bool]:
    """Run one sitting of a script, its output on a pseudo-terminal, and send it one SIGINT once its
    progress line shows `stop_at` steps or more. The exit status; whether this sent the SIGINT at the
    budget; whether this process was interrupted (its first signal is passed on as the script's stop
    request, a second one as the script's abort).

    `job` is the cluster when this runs inside a job (`slurm` or `local`). On SLURM a time limit, a
    preemption or `scancel` signals every process of the job, the script included: the script has
    its stop request already and this process passes nothing on (a second signal would abort it).
    submitit's local executor signals this process alone: it passes on one stop request, and never
    a second, so a job always leaves its checkpoint."""
    master, slave = pty.openpty()
    # A session of its own: a Ctrl-C at this terminal reaches this process alone, which passes on
    # exactly one SIGINT (a second one would make the scripts abort without a checkpoint). In a
    # SLURM job the script stays in the job's process group, where SLURM's signals reach it.
    process = subprocess.Popen(command, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave,
                               start_new_session=job != "slurm",
                               preexec_fn=ignore_preemption_signal if job else None)
    os.close(slave)
    at_budget, interruptions = False, 0

    def interrupt(signum, frame) -> None:
        nonlocal interruptions
        interruptions += 1
        if job == "slurm":
            return
        if child.sent == 0 or (interruptions > 1 and job is None):
            process.send_signal(signal.SIGINT)
            child.sent += 1

    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    pending, last_progress, last_shown, shown_at = "", "", "", 0.0
    with log.open("a") as log_file:
        child = Child(process, master, log_file)
        RUNNING[:] = [child]
        # SIGHUP too, when the terminal goes: the script, in a session of its own, would never hear it
        # and would train on alone, past the budget. Under `nohup`, which ignores it, it stays ignored.
        hangup = [signal.SIGHUP] if signal.getsignal(signal.SIGHUP) != signal.SIG_IGN else []
        previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM, *hangup)}

        def show(line: str) -> None:
            nonlocal last_shown, shown_at
            print(line, file=log_file, flush=True)
            with contextlib.suppress(OSError):  # a terminal that is gone: the log still has the line
                print(f"[{label}] {line}", file=sys.stderr, flush=True)
            last_shown, shown_at = line, time.monotonic()

        show("$ " + " ".join(command))
        try:
            while True:
                ready, _, _ = select.select([master], [], [], 0.5)
                if not ready:
                    if process.poll() is not None:
                        break
                    continue
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: every process that held the terminal has closed it
                    break
                if not chunk:
                    break
                # On a terminal the progress line is redrawn in place ("\r", erase, line) with no newline
                # after it: it is complete once written, so the unfinished tail is searched too.
                *lines, pending = re.split(r"[\r\n]", pending + decoder.decode(chunk))
                for line in map(clean, lines):
                    if PROGRESS.match(line):
                        last_progress = line
                        if time.monotonic() - shown_at >= 10.0:
                            show(line)
                    elif line.strip():
                        show(line)
                for line in map(clean, [*lines, pending]):
                    match = PROGRESS.match(line)
                    if match and stop_at is not None and child.sent == 0 and int(match[1].replace(",", "")) >= stop_at:
                        child.stop()
                        at_budget = True
                        show(line)
                        show(f"the budget of {stop_at:,} steps is reached: SIGINT sent")
                        last_progress = line
            if clean(pending).strip():
                show(clean(pending))
            if last_progress and last_progress not in (last_shown, clean(pending)):
                show(last_progress)
            status = process.wait()
        finally:
            RUNNING.clear()
            os.close(master)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    return status, at_budget, interruptions > 0


def train_seed(task: Task, seed: int, runs: Path, job: str | None = None) -> None:
    """Run one seed of a task to its budget, fresh or resumed; nothing when it is already there.
    `job`: the cluster, when this runs inside a cluster's job (see `run_sitting`)."""
    run_dir = run_dir_of(task, seed, runs)
    label = f"{task.name} seed {seed}"
    if run_dir.exists():
        record = read_record(run_dir, task.schedule)
        if record.end >= task.budget:
            print(f"[{label}] already at step {record.end:,} (budget {task.budget:,}): skipped", file=sys.stderr)
            return
        checkpoint = checkpoint_of(run_dir)
        if checkpoint is None and record.time_steps:
            raise UsageError(f"{run_dir} holds the events of a run but no checkpoint to resume it from; "
                             "remove the directory to start that seed again")
    else:
        checkpoint = None
    run_dir.mkdir(parents=True, exist_ok=True)
    # The run is stopped at the budget, unless the budget is the schedule: then the script ends by itself.
    stop_at = task.budget if task.budget < task.schedule else None
    started = time.monotonic()
    status, at_budget, interrupted = run_sitting(script_command(task, seed, run_dir, checkpoint), stop_at,
                                                 run_dir / "learning_curves.log", label, job)
    if interrupted:
        raise Interrupted(f"{label} stopped with status {status}")
    if status != 0 and not (status == 130 and at_budget):
        raise RunError(f"{label}: {task.script} exited with status {status}; "
                       f"its output is in {run_dir / 'learning_curves.log'}")
    print(f"[{label}] sitting done in {(time.monotonic() - started) / 60:.1f} min", file=sys.stderr)


# ## Reading the events


@dataclass
class Sitting:
    """One event file: one sitting of a run, from the writer opening to its last event."""

    start: float
    """Wall time of the file's first event."""
    span: float
    """Seconds from the first event to the last."""
    steps: list[tuple[int, float]]
    """(step, wall time) of every scalar, in the order logged."""
    scores: list[tuple[int, float]]
    """(step, score) of every finite `charts/episodic_return`, in the order logged."""
    means: list[tuple[int, float]]
    """(step, mean) of every finite `charts/episodic_return_last_100` (ppo_jax.py's), in the order logged."""


def read_sitting(path: Path) -> Sitting:
    steps, scores, means, first, last = [], [], [], None, None
    for event in LegacyEventFileLoader(str(path)).Load():
        first = event.wall_time if first is None else first
        last = event.wall_time
        for value in event.summary.value:
            if value.WhichOneof("value") != "simple_value":
                continue
            steps.append((event.step, event.wall_time))
            if value.tag in (SCORE_TAG, RING_TAG) and math.isfinite(value.simple_value):
                (scores if value.tag == SCORE_TAG else means).append((event.step, value.simple_value))
    if first is None:
        return Sitting(0.0, 0.0, [], [], [])
    return Sitting(first, last - first, steps, scores, means)


@dataclass
class Record:
    """One agent's run over all its sittings."""

    score_steps: list[int]
    scores: list[float]
    time_steps: list[int]
    seconds: list[float]
    """Training time at each logged scalar, steps in order."""
    end: int
    """The step the run is known to have reached."""
    averaged: bool = False
    """Each score is already the mean of the last 100 (ppo_jax.py's `charts/episodic_return_last_100`)."""


def event_files(directory: Path) -> list[Path]:
    return [path for path in directory.glob("events.out.tfevents.*") if path.is_file()]


def read_record(directory: Path, schedule: int) -> Record:
    """The scores and the training time of a run directory's events, all its sittings assembled."""
    sittings = sorted((read_sitting(path) for path in event_files(directory)), key=lambda sitting: sitting.start)
    # ppo_jax.py's means of its last 100 episodes, where every sitting that logged a score logged them
    # (a run resumed from a checkpoint older than them starts its last 100 afresh; its updates' own
    # means are read instead).
    averaged = any(sitting.means for sitting in sittings) and all(sitting.means or not sitting.scores
                                                                   for sitting in sittings)
    if averaged:
        sittings = [replace(sitting, scores=sitting.means) for sitting in sittings]
    scores: list[tuple[int, float]] = []
    times: list[tuple[int, float]] = []
    offset = 0.0
    for sitting in sittings:
        if sitting.steps:
            # A resumed sitting's first step is one update past its checkpoint: what an earlier
            # sitting logged from there on was done again, and this sitting's events replace it.
            first = min(step for step, _ in sitting.steps)
            scores = [item for item in scores if item[0] < first] + sitting.scores
            times = [item for item in times if item[0] < first]
            times += [(step, offset + wall - sitting.start) for step, wall in sitting.steps]
        offset += sitting.span
    times.sort(key=lambda item: item[0])  # stable: the events of one step keep their order
    end = times[-1][0] if times else 0
    # A run that finished its schedule got as far as it can, even when the schedule is not a whole
    # number of batches (the script trains `schedule // batch` updates): the next update would pass it.
    distinct = sorted({step for step, _ in times})
    batch = min((b - a for a, b in zip(distinct, distinct[1:])), default=None)
    if batch is not None and end + batch > schedule:
        end = max(end, schedule)
    return Record([step for step, _ in scores], [score for _, score in scores],
                  [step for step, _ in times], [seconds for _, seconds in times], end, averaged)


def score_at(record: Record, step: int, window: int) -> float | None:
    """The mean of the last `window` scores logged at or before `step` (the last one, where each is already
    the mean of the last 100); None without one or past the run's end."""
    window = 1 if record.averaged else window
    if record.end < step:
        return None
    count = bisect.bisect_right(record.score_steps, step)
    if count == 0:
        return None
    values = record.scores[max(0, count - window):count]
    return sum(values) / len(values)


def seconds_at(record: Record, step: int) -> float | None:
    """The training time at which the run logged `step` (its first update at or past it)."""
    if record.end < step or not record.seconds:
        return None
    index = bisect.bisect_left(record.time_steps, step)
    return record.seconds[min(index, len(record.seconds) - 1)]


def records_of(task: Task, runs: Path, seeds: typing.Iterable[int]) -> dict[str, Record]:
    """Each curve of a task's runs, by its CSV name: `seed_<s>`, or `seed_<s>_agent_<i>` for each agent
    of a ppo_jax.py run of several (their `agent-<i>/` directories; the run dir holds their mean)."""
    records = {}
    for seed in seeds:
        run_dir = run_dir_of(task, seed, runs)
        agents = sorted((path for path in run_dir.glob("agent-*") if path.is_dir()),
                        key=lambda path: int(path.name.split("-")[1]))
        if agents:
            for agent in agents:
                records[f"seed_{seed}_agent_{agent.name.split('-')[1]}"] = read_record(agent, task.schedule)
        elif run_dir.is_dir():
            records[f"seed_{seed}"] = read_record(run_dir, task.schedule)
    # A run that has logged nothing yet (stopped while it started) is no curve: without one, the CSV
    # already there is drawn rather than overwritten by empty columns.
    return {name: record for name, record in records.items() if record.scores or record.seconds}


# ## The curve and its CSV


@dataclass
class Curve:
    """The curves of a task on a grid of steps: what the CSV holds."""

    steps: list[int]
    scores: dict[str, list[float | None]]
    seconds: dict[str, list[float | None]]
    mean: list[float | None]


def grid(budget: int, points: int) -> list[int]:
    """`points` steps evenly spaced up to the budget, rounded; at most one per step, none at step 0
    (more points than steps gives every step from 1 to the budget)."""
    return sorted({max(1, round(budget * i / points)) for i in range(1, points + 1)})


def mean_of(scores: list[float | None], seconds: list[float | None]) -> float | None:
    """The mean over the curves, where every run has reached the step and at least one has a score."""
    present = [score for score in scores if score is not None]
    if not present or any(value is None for value in seconds):
        return None
    return sum(present) / len(present)


def make_curve(records: dict[str, Record], budget: int, points: int, window: int) -> Curve:
    steps = grid(budget, points)
    scores = {name: [score_at(record, step, window) for step in steps] for name, record in records.items()}
    seconds = {name: [seconds_at(record, step) for step in steps] for name, record in records.items()}
    mean = [mean_of([scores[name][i] for name in records], [seconds[name][i] for name in records])
            for i in range(len(steps))]
    return Curve(steps, scores, seconds, mean)


def cell(value: float | None, digits: int) -> str:
    return "" if value is None else str(round(value, digits))


def write_csv(curve: Curve, path: Path) -> None:
    names = list(curve.scores)
    with path.open("w", newline="") as file:
        writer = csv.writer(file, lineterminator="\n")
        writer.writerow(["step", *names, "mean", *(f"seconds_{name}" for name in names)])
        for i, step in enumerate(curve.steps):
            writer.writerow([step, *(cell(curve.scores[name][i], 3) for name in names), cell(curve.mean[i], 3),
                             *(cell(curve.seconds[name][i], 1) for name in names)])


def read_csv(path: Path) -> Curve:
    try:
        with path.open(newline="") as file:
            rows = list(csv.reader(file))
    except (ValueError, csv.Error):  # not UTF-8 text, or a NUL byte in it
        rows = []
    header = rows[0] if rows else []
    if len(header) < 3 or header[0] != "step" or "mean" not in header:
        raise UsageError(f"{path} is not a learning-curve CSV (its header should be step,seed_<s>...,mean,...)")
    names = header[1:header.index("mean")]
    if header[header.index("mean") + 1:] != [f"seconds_{name}" for name in names]:
        raise UsageError(f"{path}: the columns after `mean` should be seconds_<curve> for each curve")

    def value(text: str) -> float | None:
        return float(text) if text else None

    body = rows[1:]
    for line, row in enumerate(body, start=2):
        try:
            if len(row) != len(header):
                raise ValueError
            int(row[0]), [float(text) for text in row[1:] if text]
        except ValueError:
            raise UsageError(f"{path}, line {line}: damaged (cut short, or a cell that is not a number); "
                             "remove it, or remake it from the runs") from None
    column = {name: index for index, name in enumerate(header)}
    return Curve([int(row[0]) for row in body],
                 {name: [value(row[column[name]]) for row in body] for name in names},
                 {name: [value(row[column[f"seconds_{name}"]]) for row in body] for name in names},
                 [value(row[column["mean"]]) for row in body])


# ## Many runs at once: one job per run, on a cluster
#
# With `--cluster slurm` (or `local`, the same code path on this machine, for trying it) each run
# (a task and a seed) is one job, submitted through submitit. A job does on its node what
# `train_seed` does at a terminal: it trains its run to the budget, fresh or resumed from the run's
# checkpoint. So `--runs` must be on a file system that every node and the submitting machine share,
# and the Python that runs this file (a virtual environment, say) too: submitit starts the job with
# the same interpreter.
#
# A job's run dir holds `job.json`: the cluster, the job's id, and the step the run had reached when
# it was submitted. Whether a run is done is read from its events, as at a terminal; whether its job
# is queued or running, from `squeue` (SLURM) or from the job's process (local); how a job ended,
# from the result that submitit leaves in `<runs>/<task>/jobs/`. A job that SLURM stops leaves the
# run's checkpoint behind, either way it is stopped:
#
# - before its time limit (and on a preemption, where the cluster sends it) SLURM sends SIGUSR2,
#   which submitit's handler in the job catches: it calls `RunJob.checkpoint`, which stops the script
#   at its next safe point and waits for its checkpoint, then requeues the job (same id; submitit
#   gives a checkpoint 90 s by default);
# - at its time limit, on `scancel` or on a preemption without that signal, SLURM sends SIGTERM to
#   every process of the job: the script saves its checkpoint and exits, the job ends, and the
#   submitting command, seeing the run short of its budget and its job gone, submits it again.
#
# A run whose job ended without getting it any further, or with an error, is failed: it is shown with
# the last lines of its log and is not submitted again unless asked (`--retry-failed`). A run whose job
# is queued or running is never submitted again.

JOB_RECORD = "job.json"
LIVE_STATES = {"PENDING": "queued", "REQUEUED": "queued", "CONFIGURING": "running", "RUNNING": "running",
               "COMPLETING": "running", "SUSPENDED": "running", "REQUEUE_HOLD": "queued", "REQUEUE_FED": "queued",
               "RESIZING": "running", "SIGNALING": "running", "STAGE_OUT": "running"}
"""SLURM's states of a job that has not ended, and what `--status` calls them."""


@dataclass(frozen=True)
class RunJob:
    """One run (a task and a seed) as a cluster job: submitit pickles it, a node calls it, and it trains
    the run to its budget as `train_seed` does. Only plain values, so that the job needs nothing of
    the submitting process but this file."""

    name: str
    script: str
    env: str
    schedule: int
    budget: int
    flags: tuple[str, ...]
    seed: int
    runs: str

    def __call__(self) -> str:
        task = Task(self.name, self.script, self.env, self.schedule, self.budget, (self.seed,), self.flags)
        try:
            train_seed(task, self.seed, Path(self.runs), job=os.environ.get("SUBMITIT_EXECUTOR", "local"))
        except Interrupted as stopped:
            return f"stopped ({stopped}); its checkpoint is saved"
        return "at its budget"

    def checkpoint(self):
        """Called by submitit on SIGUSR2 (a time limit or a preemption ahead): stop the script, wait for
        its checkpoint, and hand back this same job, which submitit requeues."""
        import submitit

        for child in list(RUNNING):
            child.stop()
            child.wait_saved()
        return submitit.helpers.DelayedSubmission(self)


@dataclass
class RunState:
    """Where one run stands: `done`, `running`, `queued`, `stopped` (its job ended short of the
    budget: it is submitted again), `failed`, or `new` (never submitted)."""

    task: Task
    seed: int
    state: str
    step: int = 0
    job_id: str = ""
    detail: list[str] = field(default_factory=list)
    """For a failed run, why and the last lines of its log; for a running one, its last progress line."""

    @property
    def label(self) -> str:
        return f"{self.task.name} seed {self.seed}"


def jobs_folder(task: Task, runs: Path) -> Path:
    """submitit's folder for a task's jobs: their pickles, results and logs (`<job id>_0_log.err`)."""
    return runs / task.name / "jobs"


def read_job_record(run_dir: Path) -> dict | None:
    path = run_dir / JOB_RECORD
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text())
        if not (isinstance(record, dict) and record.get("cluster") in ("slurm", "local")
                and isinstance(record.get("job_id"), str) and isinstance(record.get("step"), int)):
            raise ValueError
    except ValueError:  # JSON's errors, and a file that is not UTF-8, are ValueErrors
        raise UsageError(f"{path} is damaged: once no job of this run is queued or running, remove it, "
                         "and the same command submits the run again") from None
    return record


def live_jobs(records: list[dict]) -> dict[str, str]:
    """`{job id: queued or running}` for the jobs of `records` that have not ended."""
    live = {}
    slurm_ids = {record["job_id"] for record in records if record["cluster"] == "slurm"}
    if slurm_ids:
        try:
            listing = subprocess.run(["squeue", "--noheader", "--format=%i %T", f"--user={getpass.getuser()}"],
                                     capture_output=True, text=True, timeout=60)
        except FileNotFoundError:
            raise RunError("runs were submitted to SLURM, but there is no squeue here: "
                           "run this on a machine of the cluster") from None
        if listing.returncode != 0:
            raise RunError(f"squeue failed: {(listing.stderr.strip().splitlines() or ['no message'])[-1]}")
        for line in listing.stdout.splitlines():
            job_id, _, state = line.strip().partition(" ")
            if job_id in slurm_ids and state in LIVE_STATES:
                live[job_id] = LIVE_STATES[state]
    for record in records:
        if record["cluster"] == "local" and local_job_alive(record["job_id"]):
            live[record["job_id"]] = "running"
    return live


def local_job_alive(job_id: str) -> bool:
    """A job of submitit's local executor is its controller process, whose id is the job's."""
    try:
        state = Path(f"/proc/{job_id}/stat").read_text().rsplit(")", 1)[1].split()[0]
        command = Path(f"/proc/{job_id}/cmdline").read_bytes()
    except (OSError, IndexError):
        return False
    return state != "Z" and b"submitit" in command


def job_result(task: Task, runs: Path, record: dict) -> tuple[str, str] | None:
    """What submitit recorded at a job's end: `("success", what the job returned)` or `("error",
    traceback)`; None for a job that was killed before it could record anything. (A local job's id is
    a process id, which an earlier job may have had: its result is older than this job.) A record
    that cannot be read (a disk that filled as it was written) is the job's failure, said as such."""
    path = jobs_folder(task, runs) / f"{record['job_id']}_0_result.pkl"
    if not path.exists() or path.stat().st_mtime < record.get("submitted_at", 0.0):
        return None
    try:
        with path.open("rb") as file:
            result = pickle.load(file)
        if isinstance(result, tuple) and len(result) == 2 and result[0] in ("success", "error"):
            return result
    except Exception:  # noqa: BLE001  (unpickling damaged bytes can raise almost anything)
        pass
    return "error", f"the record of its job's end, {path}, is damaged"


def last_lines(path: Path, count: int = 8) -> list[str]:
    """The last `count` lines of a log, progress lines redrawn in place counted as lines."""
    if not path.exists():
        return []
    with path.open("rb") as file:
        file.seek(max(0, path.stat().st_size - 16384))
        text = clean(file.read().decode("utf-8", "replace"))
    return [line for line in re.split(r"[\r\n]", text) if line.strip()][-count:]


def run_state(task: Task, seed: int, runs: Path, live: dict[str, str]) -> RunState:
    run_dir = run_dir_of(task, seed, runs)
    record = read_job_record(run_dir)
    if record and record["job_id"] in live:
        progress = [line for line in last_lines(run_dir / "learning_curves.log", 20) if PROGRESS.match(line)]
        return RunState(task, seed, live[record["job_id"]], record["step"], record["job_id"], progress[-1:])
    step = read_record(run_dir, task.schedule).end if run_dir.is_dir() else 0
    if step >= task.budget:
        return RunState(task, seed, "done", step, record["job_id"] if record else "")
    if record is None:
        return RunState(task, seed, "new", step)
    log = run_dir / "learning_curves.log"
    result = job_result(task, runs, record)
    if result is not None and result[0] == "error":
        why = result[1].strip().splitlines()[-1]
        return RunState(task, seed, "failed", step, record["job_id"], [why, *last_lines(log)])
    if step <= record["step"]:
        why = (f"its job ended at step {step:,} without getting further (job log: "
               f"{jobs_folder(task, runs) / (record['job_id'] + '_0_log.err')})")
        return RunState(task, seed, "failed", step, record["job_id"], [why, *last_lines(log)])
    return RunState(task, seed, "stopped", step, record["job_id"])


def check_cpus_per_job(args: argparse.Namespace) -> None:
    """Refuse jobs larger than every node that could run them: SLURM would leave them queued for ever
    (its reason, `PartitionConfig`, shown by squeue alone). On SLURM the nodes' sizes are sinfo's, when
    it answers; else sbatch is left to judge."""
    if args.cluster == "local":
        available, where = os.cpu_count() or 1, "this machine has"
    else:
        partition = args.partition or dict(args.slurm_arg).get("partition")
        try:
            listing = subprocess.run(["sinfo", "--noheader", "--Node", "--format=%P %c"], capture_output=True,
                                     text=True, timeout=60).stdout
        except (OSError, subprocess.TimeoutExpired):
            return
        sizes = collections.defaultdict(int)  # the largest node of each partition, the default's as ""
        for line in listing.splitlines():
            name, _, cpus = line.strip().partition(" ")
            if cpus.isdigit():
                for key in [name.rstrip("*")] + ([""] if name.endswith("*") else []):
                    sizes[key] = max(sizes[key], int(cpus))
        available = sizes.get(partition or "")
        if available is None:  # a partition sinfo does not know: sbatch says so
            return
        where = f"the largest node of {f'partition {partition}' if partition else 'the default partition'} has"
    if args.cpus_per_job > available:
        raise UsageError(f"--cpus-per-job {args.cpus_per_job}: {where} {available} CPUs; ask for at most that "
                         "(on SLURM a larger job waits in the queue for ever)")


def make_executor(args: argparse.Namespace, task: Task, runs: Path):
    """A submitit executor for a task's jobs, with the resources asked for."""
    import submitit

    executor = submitit.AutoExecutor(folder=jobs_folder(task, runs), cluster=args.cluster,
                                     slurm_max_num_timeout=1000)
    parameters = dict(timeout_min=args.time_limit, cpus_per_task=args.cpus_per_job, name=f"curves-{task.name}")
    if args.gpus_per_job:
        parameters.update(gpus_per_node=args.gpus_per_job)
    if args.cluster == "slurm":
        parameters.update(slurm_additional_parameters=dict(args.slurm_arg))
        if args.partition:
            parameters.update(slurm_partition=args.partition)
    else:
        parameters = {key: value for key, value in parameters.items() if key in ("timeout_min", "gpus_per_node")}
    executor.update_parameters(**parameters)
    return executor


def job_class() -> type:
    """`RunJob` of this file imported under its own module name: submitit pickles a class by reference
    to its module, and a job could not import `__main__`'s (this file, when run as a script)."""
    if __name__ == "learning_curves":
        return RunJob
    import learning_curves  # this file's folder is sys.path[0] when it is run as a script

    return learning_curves.RunJob


def submit(executor, state: RunState, runs: Path, cluster: str) -> tuple[str, bool]:
    """Submit a run's job and record it in its run dir, before anything else can ask about it. The
    job's id, and whether this submitted it (False: another command did, since `state` was read)."""
    task = state.task
    run_dir = run_dir_of(task, state.seed, runs)
    run_dir.mkdir(parents=True, exist_ok=True)
    from submitit.core.utils import FailedJobError

    # Two commands started at once for the same run both see it without a job. Each submits holding
    # the run's lock (`flock`'s, which the system lets go of however the process ends) and reads the
    # record again under it: the second finds the first's job there, and follows that one instead.
    with open(run_dir / "job.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        record = read_job_record(run_dir)
        if record is not None and record["job_id"] != state.job_id:
            return record["job_id"], False
        # submitit's local executor starts the job's controller in this terminal's process group, where
        # a Ctrl-C reaches it too, and it died of it with a traceback. It inherits SIGINT ignored (and
        # Python then leaves it so): the job alone takes the Ctrl-C, stops its script, which saves,
        # and the controller ends with it.
        ignoring = signal.signal(signal.SIGINT, signal.SIG_IGN) if cluster == "local" else None
        try:
            # submitit prints sbatch's complaint before raising it: it is said once, in the error below.
            with contextlib.redirect_stderr(io.StringIO()):
                job = executor.submit(job_class()(task.name, task.script, task.env, task.schedule, task.budget,
                                                  task.flags, state.seed, str(runs)))
        except FailedJobError as refused:  # sbatch said no: a partition, a --slurm-arg, a limit of the cluster
            # sbatch's own reason, not the "Try sbatch --help" that may follow it.
            lines = str(refused).strip().splitlines()
            reason = ([line for line in lines if line.startswith("sbatch:")] or lines or ["no reason given"])[-1]
            raise UsageError(f"the job of {state.label} was refused: {reason}") from None
        except FileNotFoundError as missing:
            raise UsageError(f"cannot submit the job of {state.label}: {missing.filename or missing} not found") \
                from None
        finally:
            if ignoring is not None:
                signal.signal(signal.SIGINT, ignoring)
        submitted_at = time.time()
        record = {"cluster": cluster, "job_id": str(job.job_id), "step": state.step, "submitted_at": submitted_at,
                  "submitted": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(submitted_at))}
        temporary = run_dir / (JOB_RECORD + ".tmp")
        temporary.write_text(json.dumps(record) + "\n")
        temporary.replace(run_dir / JOB_RECORD)
    return record["job_id"], True


def describe_state(state: RunState) -> list[str]:
    job = f" (job {state.job_id})" if state.job_id else ""
    what = {"done": f"done at step {state.step:,}", "new": "not submitted", "queued": "queued",
            "running": "running", "failed": f"failed at step {state.step:,}",
            "stopped": f"stopped at step {state.step:,}, to be submitted again"}[state.state]
    lines = [f"[{state.label}] {what}{job}"]
    if state.state == "running" and state.detail:
        lines[0] += f": {state.detail[0]}"
    elif state.state == "failed":
        lines += [f"    {line}" for line in state.detail]
    return lines


def run_on_cluster(tasks: list[Task], args: argparse.Namespace, runs: Path) -> bool:
    """Submit every run of `tasks` that is not done and has no job under way, then (unless `--status`
    or `--no-wait`) wait for them, submitting again the runs whose jobs stopped, and printing what
    changes. Whether every run is done."""
    try:
        import submitit  # noqa: F401  (a missing submitit is said here, before anything is submitted)
    except ImportError:
        raise UsageError("--cluster and --status need submitit: pip install -r requirements/benchmarks.txt") from None

    # The job unpickles `RunJob` by this file's module name, from this folder.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parent),
                                                             os.environ.get("PYTHONPATH")]))
    executors, retried, shown = {}, set(), {}
    while True:
        records = [record for task in tasks for seed in task.seeds
                   if (record := read_job_record(run_dir_of(task, seed, runs))) is not None]
        live = live_jobs(records)
        states = [run_state(task, seed, runs, live) for task in tasks for seed in task.seeds]
        for state in states:
            again = state.state == "failed" and args.retry_failed and state.label not in retried
            if args.status or not (state.state in ("new", "stopped") or again):
                continue
            if args.cluster is None:
                raise UsageError(f"{state.label} has no job under way: give --cluster to submit it")
            if not executors:
                check_cpus_per_job(args)
            if state.task.name not in executors:
                executors[state.task.name] = make_executor(args, state.task, runs)
            retried.add(state.label)
            before = {"new": "", "stopped": f"its job {state.job_id} stopped at step {state.step:,}: ",
                      "failed": f"failed in job {state.job_id}, tried again: "}[state.state]
            state.job_id, submitted = submit(executors[state.task.name], state, runs, args.cluster)
            state.state, state.detail = "queued", []
            if submitted:
                print(f"[{state.label}] {before}submitted as job {state.job_id} ({args.cluster}), "
                      f"from step {state.step:,}", file=sys.stderr)
            else:
                print(f"[{state.label}] submitted meanwhile by another command, as job {state.job_id}",
                      file=sys.stderr)
        # Every run with --status; while waiting, each run whose state has changed since the last look.
        counts = collections.Counter(state.state for state in states)
        changed = [state for state in states if args.status or shown.get(state.label) != (state.state, state.job_id)]
        if changed:
            print("\n".join(line for state in changed for line in describe_state(state)), file=sys.stderr)
            print(", ".join(f"{count} {name}" for name, count in sorted(counts.items())), file=sys.stderr, flush=True)
        shown = {state.label: (state.state, state.job_id) for state in states}
        if args.status or args.no_wait or counts["done"] + counts["failed"] == len(states):
            if counts["failed"] and not args.status:
                raise RunError(f"{counts['failed']} of {len(states)} runs failed (above, with their last lines); "
                               "fix the cause and run the same command with --retry-failed")
            return counts["done"] == len(states)
        time.sleep(args.poll)


# ## The Atari suite, scored as the field scores it
#
# `--suite atari3` is CleanRL's three games (its benchmark of `ppo_atari.py`: Pong, BeamRider and
# Breakout) and `--suite atari57` the 57 games of the ALE on which Atari agents are compared (the
# "Atari-57" of Agent57, Badia et al., 2020, and of the papers before it). Each game is a task of
# its own, named `<script>-<Game>` (`ppo_atari-Pong`), with the 10M-step schedule of CleanRL's runs,
# 3 seeds, and the script's defaults. A game's score is the mean over its seeds of the curve's last
# point (the mean real score of each seed's last 100 games at the budget, from its CSV), and its
# human-normalised score
#
# $$\mathrm{HNS} = \frac{\text{score} - \text{random}}{\text{human} - \text{random}},$$
#
# 0 for a random agent and 1 for the professional human tester. The suite is summed up by the median
# and the mean of the HNS over its games.
#
# The random and human scores are the table of the 57 games that DeepMind's DQN Zoo normalises with
# (Quan and Ostrovski, 2020, github.com/deepmind/dqn_zoo, `dqn_zoo/atari_data.py`): the random agent's
# and a professional human tester's, each the mean of at least 3 episodes begun after 1 to 30 no-ops
# and capped at 108,000 frames. Papers do not all normalise with the same human scores (DQN's Nature
# paper, Mnih et al. 2015, gives its own for the 49 games it played): a median compares with another
# only where both used this table, as CleanRL's below does.
ATARI_SCORES = {
    "Alien": (227.8, 7127.7), "Amidar": (5.8, 1719.5), "Assault": (222.4, 742.0), "Asterix": (210.0, 8503.3),
    "Asteroids": (719.1, 47388.7), "Atlantis": (12850.0, 29028.1), "BankHeist": (14.2, 753.1),
    "BattleZone": (2360.0, 37187.5), "BeamRider": (363.9, 16926.5), "Berzerk": (123.7, 2630.4),
    "Bowling": (23.1, 160.7), "Boxing": (0.1, 12.1), "Breakout": (1.7, 30.5), "Centipede": (2090.9, 12017.0),
    "ChopperCommand": (811.0, 7387.8), "CrazyClimber": (10780.5, 35829.4), "Defender": (2874.5, 18688.9),
    "DemonAttack": (152.1, 1971.0), "DoubleDunk": (-18.6, -16.4), "Enduro": (0.0, 860.5),
    "FishingDerby": (-91.7, -38.7), "Freeway": (0.0, 29.6), "Frostbite": (65.2, 4334.7), "Gopher": (257.6, 2412.5),
    "Gravitar": (173.0, 3351.4), "Hero": (1027.0, 30826.4), "IceHockey": (-11.2, 0.9), "Jamesbond": (29.0, 302.8),
    "Kangaroo": (52.0, 3035.0), "Krull": (1598.0, 2665.5), "KungFuMaster": (258.5, 22736.3),
    "MontezumaRevenge": (0.0, 4753.3), "MsPacman": (307.3, 6951.6), "NameThisGame": (2292.3, 8049.0),
    "Phoenix": (761.4, 7242.6), "Pitfall": (-229.4, 6463.7), "Pong": (-20.7, 14.6), "PrivateEye": (24.9, 69571.3),
    "Qbert": (163.9, 13455.0), "Riverraid": (1338.5, 17118.0), "RoadRunner": (11.5, 7845.0),
    "Robotank": (2.2, 11.9), "Seaquest": (68.4, 42054.7), "Skiing": (-17098.1, -4336.9),
    "Solaris": (1236.3, 12326.7), "SpaceInvaders": (148.0, 1668.7), "StarGunner": (664.0, 10250.0),
    "Surround": (-10.0, 6.5), "Tennis": (-23.8, -8.3), "TimePilot": (3568.0, 5229.2), "Tutankham": (11.4, 167.6),
    "UpNDown": (533.4, 11693.2), "Venture": (0.0, 1187.5),
    # The random agent's Video Pinball (16,256.9) is close to the human's: a small gain in score is a
    # large one in HNS.
    "VideoPinball": (16256.9, 17667.9), "WizardOfWor": (563.5, 4756.5), "YarsRevenge": (3092.9, 54576.9),
    "Zaxxon": (32.5, 9173.3),
}
"""Each game of the ALE's 57, by the ALE's own name: (the random agent's score, the human's)."""

SUITES = {"atari3": ("Pong", "BeamRider", "Breakout"), "atari57": tuple(ATARI_SCORES)}
SUITE_SCHEDULE, SUITE_SEEDS = 10_000_000, (1, 2, 3)

CLEANRL_HNS = {"median": 1.04117, "mean": 7.1795}
"""CleanRL's `ppo_atari_envpool_xla_jax.py` (PPO in JAX, 10M steps, 3 seeds) over the 57 games: the
median and mean of the per-game HNS its docs list (docs/rl-algorithms/ppo/ppo_atari_envpool_xla_jax/
atari_hns.md, github.com/vwxyzjn/cleanrl, commit 42d21bd). openai/baselines' PPO2 there: 0.909 and 5.35."""


def ale_games() -> set[str]:
    """The games of the installed ale-py, by their short names (`Breakout` for `ALE/Breakout-v5`)."""
    try:
        import ale_py
        import gymnasium
    except ImportError:
        raise UsageError("the Atari suites need ale-py and gymnasium: pip install -r requirements/ppo_atari.txt") \
            from None
    gymnasium.register_envs(ale_py)
    return {env_id[4:-3] for env_id in gymnasium.registry if env_id.startswith("ALE/") and env_id.endswith("-v5")}


def suite_tasks(suite: str, script: str, available: set[str]) -> tuple[list[Task], list[str]]:
    """The tasks of a suite for `script`, one per game the installed ale-py has; and the games it lacks."""
    stem = Path(script).stem
    tasks = [Task(f"{stem}-{game}", script, game, schedule=SUITE_SCHEDULE, budget=SUITE_SCHEDULE, seeds=SUITE_SEEDS,
                  score="score", unit="games") for game in SUITES[suite] if game in available]
    return tasks, [game for game in SUITES[suite] if game not in available]


def human_normalised(game: str, score: float) -> float:
    random_score, human_score = ATARI_SCORES[game]
    return (score - random_score) / (human_score - random_score)


@dataclass
class GameScore:
    game: str
    score: float | None
    """The mean over the seeds of the curve's last point; None where the runs have not reached it."""
    step: int
    seeds: int

    @property
    def normalised(self) -> float | None:
        return None if self.score is None else human_normalised(self.game, self.score)


def game_score(game: str, curve: Curve) -> GameScore:
    """A game's score from its curve: the mean over the seeds at the last step of the grid."""
    return GameScore(game, curve.mean[-1] if curve.steps else None, curve.steps[-1] if curve.steps else 0,
                     len(curve.scores))


def summarise(scores: list[GameScore]) -> dict[str, float] | None:
    """The median and the mean HNS over the games that have a score."""
    values = [score.normalised for score in scores if score.normalised is not None]
    return {"median": statistics.median(values), "mean": statistics.fmean(values)} if values else None


def hns_table(suite: str, script: str, scores: list[GameScore], skipped: list[str]) -> str:
    """The suite's table in Markdown: each game's score and HNS, then the median and the mean beside CleanRL's."""
    lines = [f"{suite}, {script}: human-normalised scores (HNS) at the end of each game's curve", "",
             "| game | step | seeds | score | random | human | HNS |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for score in scores:
        random_score, human_score = ATARI_SCORES[score.game]
        shown = ("no score yet", "") if score.score is None else (f"{score.score:.1f}", f"{score.normalised:.3f}")
        lines.append(f"| {score.game} | {format_steps(score.step) if score.step else ''} | {score.seeds} | {shown[0]} "
                     f"| {random_score:g} | {human_score:g} | {shown[1]} |")
    summary = summarise(scores)
    counted = sum(score.score is not None for score in scores)
    lines.append("")
    if summary:
        lines.append(f"| over {counted} of the 57 games | median HNS | mean HNS |")
        lines.append("| --- | --- | --- |")
        lines.append(f"| this project's {script} | {summary['median']:.3f} | {summary['mean']:.3f} |")
    else:
        lines.append("| no game has a score yet | median HNS | mean HNS |")
        lines.append("| --- | --- | --- |")
    lines.append(f"| CleanRL ppo_atari_envpool_xla_jax.py, 10M steps, 3 seeds, all 57 | {CLEANRL_HNS['median']:.2f} "
                 f"| {CLEANRL_HNS['mean']:.2f} |")
    if counted != len(ATARI_SCORES):
        lines.append(f"\nOver {counted} games the median and mean are not those of the 57: they do not compare with "
                     "CleanRL's.")
    if skipped:
        lines.append(f"\nNot in the installed ale-py, skipped: {', '.join(skipped)}.")
    return "\n".join(lines) + "\n"


def write_hns_csv(scores: list[GameScore], path: Path) -> None:
    with path.open("w", newline="") as file:
        writer = csv.writer(file, lineterminator="\n")
        writer.writerow(["game", "step", "seeds", "score", "random", "human", "hns"])
        for score in scores:
            writer.writerow([score.game, score.step, score.seeds, cell(score.score, 3), *ATARI_SCORES[score.game],
                             cell(score.normalised, 4)])


# ## The plots


def curve_arrays(curve: Curve) -> tuple[list[float], list[float], list[float]]:
    """Mean, minimum and maximum over the curves at each step (NaN where the mean is empty)."""
    mean, low, high = [], [], []
    for i, value in enumerate(curve.mean):
        present = [scores[i] for scores in curve.scores.values() if scores[i] is not None]
        defined = value is not None and present
        mean.append(value if defined else math.nan)
        low.append(min(present) if defined else math.nan)
        high.append(max(present) if defined else math.nan)
    return mean, low, high


def describe_curves(names: list[str]) -> str:
    """`seeds 1, 2`, or `16 agents of seed 1`."""
    seeds = sorted({int(name.split("_")[1]) for name in names})
    listed = ", ".join(map(str, seeds))
    plural = "s" if len(seeds) > 1 else ""
    if any("_agent_" in name for name in names):
        return f"{len(names)} agents of seed{plural} {listed}"
    return f"seed{plural} {listed}"


def title_of(task: Task, curve: Curve) -> str:
    stopped = (f"stopped at {format_steps(task.budget)}" if task.budget < task.schedule else "run to its end")
    return (f"{task.script} on {task.env} ({task.name})\n"
            f"{format_steps(task.schedule)}-step schedule, {stopped}; {describe_curves(list(curve.scores))}")


def draw_curve(axes, x: list[float], curve: Curve) -> None:
    mean, low, high = curve_arrays(curve)
    count = len(curve.scores)
    kind = "agents" if any("_agent_" in name for name in curve.scores) else "seeds"
    if count > 1:
        axes.fill_between(x, low, high, alpha=0.25, linewidth=0, label=f"min to max over the {kind}")
    label = f"mean over {count} {kind}" if count > 1 else describe_curves(list(curve.scores))
    axes.plot(x, mean, linewidth=2, label=label)
    if all(math.isnan(value) for value in mean):
        axes.text(0.5, 0.5, "no point yet", transform=axes.transAxes, ha="center", va="center", color="grey")


def y_label(task: Task, window: int) -> str:
    if task.unit == "updates":
        return f"{task.score} (mean of the last {window} updates' episode means)"
    if task.script == "ppo_jax.py":
        return f"{task.score} (mean of the last 100 {task.unit})"
    return f"{task.score} (mean of the last {window} {task.unit})"


def peer_label(name: str, peer: Curve) -> str:
    task = TASKS.get(name)
    script = f"{task.script} ({' '.join((name, *task.flags))})" if task else name
    count, kind = len(peer.scores), "agents" if any("_agent_" in name for name in peer.scores) else "seeds"
    return f"{script}, mean over {count} {kind}" if count > 1 else f"{script}, {describe_curves(list(peer.scores))}"


def plot_steps(curve: Curve, task: Task, window: int, path: Path, peers: dict[str, Curve] | None = None) -> None:
    """The score against steps, with the task's anchors and the mean curves of the tasks beside it."""
    figure, axes = plt.subplots(figsize=(8, 5))
    draw_curve(axes, curve.steps, curve)
    for name, peer in (peers or {}).items():
        shown = [(step, value) for step, value in zip(peer.steps, curve_arrays(peer)[0]) if step <= task.budget]
        if shown:
            axes.plot(*zip(*shown), linewidth=1.5, linestyle=":", label=peer_label(name, peer))
    for anchor in task.anchors:
        if anchor.level:
            axes.axhline(anchor.points[0][1], color="black", linestyle="--", linewidth=1, label=anchor.source)
            continue
        shown = [(step, score) for step, score in anchor.points if step <= task.budget]
        if shown:
            axes.plot(*zip(*shown), "o--", color="black", linewidth=1, label=anchor.source)
    axes.set_xlim(0, task.budget * 1.02)
    axes.xaxis.set_major_formatter(FuncFormatter(lambda value, _: axis_steps(value)))
    axes.set_xlabel("steps")
    finish(figure, axes, title_of(task, curve), y_label(task, window), path)


def axis_steps(value: float) -> str:
    """A tick of the steps axis: `0`, `500k`, `1.5M`."""
    if value >= 1_000_000:
        return f"{value / 1_000_000:g}M"
    return f"{value / 1_000:g}k" if value >= 1_000 else f"{value:g}"


def plot_time(curve: Curve, task: Task, window: int, path: Path) -> None:
    """The same curve against training time, each point at the mean time the runs took to reach its step."""
    times = [sum(values) / len(values) if all(value is not None for value in values) else math.nan
             for values in zip(*curve.seconds.values())] if curve.seconds else [math.nan] * len(curve.steps)
    longest = max((value for value in times if not math.isnan(value)), default=0.0)
    unit, scale = ("hours", 3600) if longest > 7200 else ("minutes", 60) if longest > 120 else ("seconds", 1)
    figure, axes = plt.subplots(figsize=(8, 5))
    draw_curve(axes, [value / scale for value in times], curve)
    axes.set_xlim(left=0)
    axes.set_xlabel(f"training time ({unit}; sittings laid end to end)")
    finish(figure, axes, title_of(task, curve), y_label(task, window), path)


def finish(figure, axes, title: str, y_label: str, path: Path) -> None:
    axes.set_title(title, fontsize=10)
    axes.set_ylabel(y_label)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8, loc="best")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


# ## The command line


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a mistake is one line on stderr and exit status 2, without the usage block."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog=PROG, description=__doc__.strip().splitlines()[0],
                           epilog="Anything after `--` is passed on to the script. See the module docstring.")
    flag = parser.add_argument
    flag("task", nargs="?", help="a task (see --list); or leave it out and give --script, --env, --schedule")
    flag("--list", action="store_true", help="print the tasks, their settings and anchors, and exit")
    flag("--script", help="a task of your own: the script to run (ppo_atari.py, vpg_continuous.py, ppo_jax.py)")
    flag("--env", help="a task of your own: the environment, as the script's --env takes it")
    flag("--schedule", type=parse_steps, help="the --total-timesteps of the full run, which the annealing follows")
    flag("--name", help="a task of your own: its name, for its runs and files (default: <script>-<env>)")
    flag("--budget", type=parse_steps, help="stop each run at this step (default: the task's; at most the schedule)")
    flag("--seeds", type=int, nargs="+", help="the seeds to run, one process each (default: the task's)")
    flag("--window", type=int, default=100,
         help="scores averaged at each point of the curve (default: 100; ppo_jax.py's runs average their last 100 "
              "themselves)")
    flag("--points", type=int, default=100, help="points of the curve, evenly spaced up to the budget (default: 100)")
    flag("--runs", type=Path, default=ROOT / "runs" / "curves", help="where the runs go (default: runs/curves)")
    flag("--results", type=Path, default=ROOT / "benchmarks" / "results",
         help="where the CSV and the plots go (default: benchmarks/results)")
    flag("--plot-only", action="store_true", help="redraw from the runs (without runs, from the CSV); train nothing")
    flag("--suite", choices=sorted(SUITES),
         help="a set of tasks: atari3 (CleanRL's Pong, BeamRider, Breakout) or atari57 (the ALE's 57 games), with "
              "--script (default ppo_atari.py); writes their table of human-normalised scores")
    cluster = parser.add_argument_group("on a cluster (through submitit; --runs on a file system the nodes share)")
    option = cluster.add_argument
    option("--cluster", choices=["slurm", "local"],
           help="submit each run (a task and a seed) as a job: to SLURM, or to submitit's local executor")
    option("--partition", help="the SLURM partition of the jobs")
    option("--time-limit", type=int, default=240,
           help="minutes a job may run (default: 240); a job stopped by it is requeued and resumes its run")
    option("--cpus-per-job", type=int, default=4, help="CPUs of each job (default: 4)")
    option("--gpus-per-job", type=int, default=0, help="GPUs of each job (default: 0)")
    option("--slurm-arg", action="append", default=[], type=slurm_arg, metavar="KEY=VALUE",
           help="an sbatch option passed on as #SBATCH --KEY=VALUE (account=..., qos=..., mem=...); repeat it for more")
    option("--status", action="store_true",
           help="say which runs are done, running, queued or failed (with a failed job's last lines); submit nothing")
    option("--no-wait", action="store_true", help="submit, say where the runs stand, and exit without waiting")
    option("--retry-failed", action="store_true", help="submit failed runs again (once)")
    option("--poll", type=float, default=60.0, help="seconds between two looks at the jobs while waiting (default: 60)")
    return parser


def check_writable(path: Path, flag: str) -> None:
    """Refuse, before anything runs, a directory this could not make or write in: its nearest part that
    exists must be a directory open to writing."""
    existing = next(part for part in [path, *path.parents] if part.exists())
    if not existing.is_dir():
        raise UsageError(f"{flag} {path}: cannot write there, {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: cannot write there, {existing} is not writable")


def slurm_arg(text: str) -> tuple[str, str]:
    """`--slurm-arg account=rl` as ("account", "rl")."""
    key, equals, value = text.partition("=")
    if not equals or not key.strip() or key.startswith("-"):
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (an sbatch option without its dashes), not {text!r}")
    return key.strip(), value.strip()


def resolve_task(args: argparse.Namespace, extra: list[str]) -> Task:
    """The task asked for: a preset, or one of the user's own; with the budget, seeds and flags given."""
    own = [flag for flag, value in [("--script", args.script), ("--env", args.env), ("--name", args.name)] if value]
    if args.suite is not None:
        raise UsageError("internal: a suite is resolved by resolve_tasks")
    if args.task is not None:
        if args.task not in TASKS:
            close = difflib.get_close_matches(args.task, TASKS, n=2)
            hint = f" (did you mean {' or '.join(close)}?)" if close else ""
            raise UsageError(f"unknown task {args.task!r}{hint}; the tasks are {', '.join(TASKS)}")
        if own:
            raise UsageError(f"a task name ({args.task!r}) and {' '.join(own)} cannot be used together: "
                             "those flags describe a task of your own")
        task = TASKS[args.task]
    else:
        missing = [flag for flag, value in [("--script", args.script), ("--env", args.env),
                                            ("--schedule", args.schedule)] if value is None]
        if missing:
            raise UsageError(f"name a task (see --list) or give {', '.join(missing)}")
        if not (ROOT / args.script).is_file():
            raise UsageError(f"no script {args.script!r} in {ROOT}")
        # The name is a directory of the runs and the stem of the results' files: one name, no path.
        if args.name is not None and (args.name in ("", ".", "..") or "/" in args.name or "\0" in args.name):
            raise UsageError(f"--name {args.name!r}: a task's name names a directory and files, so it cannot "
                             "hold a / or be empty, . or ..")
        name = args.name or f"{Path(args.script).stem}-{args.env.replace('/', '-')}"
        task = Task(name, args.script, args.env, schedule=args.schedule, budget=args.budget or args.schedule,
                    seeds=(1,), unit=UNITS.get(Path(args.script).name, "logged scores"))
    return adjusted(task, args, extra)


AGENT_EVENTS = 16
"""The agents of a ppo_jax.py run with event files of their own (its `AGENT_WRITERS`): the curves read them."""


def adjusted(task: Task, args: argparse.Namespace, extra: list[str]) -> Task:
    """A task with the schedule, budget, seeds and flags given on the command line, checked."""
    schedule = args.schedule or task.schedule
    budget = args.budget or min(task.budget, schedule)
    seeds = tuple(args.seeds) if args.seeds else task.seeds
    task = replace(task, schedule=schedule, budget=budget, seeds=seeds, flags=task.flags + tuple(extra))
    if budget > schedule:
        raise UsageError(f"--budget {budget:,} is past the schedule of {schedule:,} steps; "
                         "raise --schedule (the annealing then stretches over it) or lower the budget")
    if len(set(seeds)) != len(seeds) or any(seed < 0 for seed in seeds):
        raise UsageError(f"--seeds must be distinct and not negative, not {' '.join(map(str, seeds))}")
    if args.window < 1 or args.points < 1:
        raise UsageError(f"--window and --points must be positive, not {args.window} and {args.points}")
    agents = [value for flag, value in zip(task.flags, task.flags[1:]) if flag == "--num-seeds"][-1:]
    if task.script == "ppo_jax.py" and agents and agents[0].isdigit() and int(agents[0]) > AGENT_EVENTS:
        raise UsageError(f"--num-seeds {agents[0]}: ppo_jax.py writes the events of its first {AGENT_EVENTS} "
                         f"agents alone, the curves' source; use at most {AGENT_EVENTS} and more --seeds")
    return task


def resolve_tasks(args: argparse.Namespace, extra: list[str]) -> tuple[list[Task], list[str]]:
    """The tasks asked for: one, or a suite's (with the games the installed ale-py lacks)."""
    if args.suite is None:
        return [resolve_task(args, extra)], []
    clash = [flag for flag, value in [("a task name", args.task), ("--env", args.env), ("--name", args.name)] if value]
    if clash:
        raise UsageError(f"--suite and {' and '.join(clash)} cannot be used together: a suite names its own tasks")
    script = args.script or "ppo_atari.py"
    if script not in ("ppo_atari.py", "ppo_jax.py"):
        raise UsageError(f"--suite {args.suite} runs ppo_atari.py or ppo_jax.py, not {script!r}")
    tasks, skipped = suite_tasks(args.suite, script, ale_games())
    if skipped:
        print(f"{args.suite}: the installed ale-py lacks {len(skipped)} of its games, skipped: {', '.join(skipped)}",
              file=sys.stderr)
    if not tasks:
        raise UsageError(f"the installed ale-py has none of the games of {args.suite}")
    return [adjusted(task, args, extra) for task in tasks], skipped


def list_tasks() -> None:
    for task in TASKS.values():
        flags = f" {' '.join(task.flags)}" if task.flags else ""
        print(f"{task.name}: {task.script} --env {task.env}{flags}; schedule {format_steps(task.schedule)}, "
              f"budget {format_steps(task.budget)}, seeds {' '.join(map(str, task.seeds))}")
        for anchor in task.anchors:
            points = ", ".join(f"{format_steps(step)}: {score:g}" for step, score in anchor.points)
            print(f"    anchor: {anchor.source} [{points}]")
        for name in task.beside:
            print(f"    beside: {name}")
    for suite, games in SUITES.items():
        print(f"--suite {suite}: <script>-<Game> for {len(games)} games, schedule {format_steps(SUITE_SCHEDULE)}, "
              f"seeds {' '.join(map(str, SUITE_SEEDS))}: {' '.join(games)}")


def report(task: Task, curve: Curve, peers: dict[str, Curve] | None = None) -> None:
    """The last point of the curve, beside the anchors' points up to the budget and the curves beside it there."""
    last = next((i for i in reversed(range(len(curve.steps))) if curve.mean[i] is not None), None)
    if last is None:
        print(f"{task.name}: no point of the curve yet")
        return
    scores = ", ".join(f"{name.removeprefix('seed_')}: {values[last]:.1f}"
                       for name, values in curve.scores.items() if values[last] is not None)
    print(f"{task.name} at step {curve.steps[last]:,}: mean {curve.mean[last]:.1f} ({scores})")
    for anchor in task.anchors:
        points = [f"{score:g} at {format_steps(step)}" for step, score in anchor.points if step <= task.budget]
        print(f"    {anchor.source}" + (": " + ", ".join(points) if points and not anchor.level else ""))
    for name, peer in (peers or {}).items():
        reached = [i for i, step in enumerate(peer.steps) if step <= curve.steps[last] and peer.mean[i] is not None]
        if reached:
            print(f"    {peer_label(name, peer)}: {peer.mean[reached[-1]]:.1f} at step {peer.steps[reached[-1]]:,}")


def kept_columns(curve: Curve, csv_path: Path) -> Curve:
    """`curve` with the columns of the CSV already there that it has no run of: a seed trained on
    another machine, or whose runs are gone, keeps its curve when another seed's is added. Only on
    the same grid of steps (the same `--budget` and `--points`); otherwise the CSV is replaced, as
    it always is for the curves read from runs."""
    try:
        old = read_csv(csv_path)
    except UsageError as error:
        print(f"{error}; it is replaced", file=sys.stderr)
        return curve
    missing = [name for name in old.scores if name not in curve.scores]
    if not missing:
        return curve
    if old.steps != curve.steps:
        print(f"{csv_path}: its steps are not this curve's (another --budget or --points); its "
              f"{', '.join(missing)} not kept", file=sys.stderr)
        return curve
    print(f"{csv_path}: no runs of {', '.join(missing)} here; kept from the CSV", file=sys.stderr)
    names = sorted([*curve.scores, *missing], key=lambda name: [int(n) for n in re.findall(r"\d+", name)])
    scores = {name: curve.scores[name] if name in curve.scores else old.scores[name] for name in names}
    seconds = {name: curve.seconds[name] if name in curve.seconds else old.seconds[name] for name in names}
    mean = [mean_of([scores[name][i] for name in names], [seconds[name][i] for name in names])
            for i in range(len(curve.steps))]
    return Curve(curve.steps, scores, seconds, mean)


def draw(task: Task, args: argparse.Namespace, runs: Path, results: Path, suite: bool) -> Curve | None:
    """The CSV of a task from its runs (or, without runs, the CSV already there), its plots, and its
    report. None for a suite's game that has neither."""
    records = records_of(task, runs, task.seeds)
    if any(record.scores and not record.averaged for record in records.values()) and task.script == "ppo_jax.py":
        print(f"{task.name}: these runs predate ppo_jax.py's mean of its last 100 episodes; "
              f"each point is the mean of the last {args.window} updates' episode means", file=sys.stderr)
        task = replace(task, unit="updates")
    csv_path = results / f"{task.name}.csv"
    if records:
        curve = make_curve(records, task.budget, args.points, args.window)
        if csv_path.exists():
            curve = kept_columns(curve, csv_path)
        results.mkdir(parents=True, exist_ok=True)
        write_csv(curve, csv_path)
    elif csv_path.exists():
        print(f"no runs of {task.name} in {runs}; drawing {csv_path}", file=sys.stderr)
        curve = read_csv(csv_path)
        if args.budget is None and curve.steps:
            task = replace(task, budget=curve.steps[-1])
    elif suite:
        print(f"{task.name}: no runs in {runs} and no {csv_path}: left out", file=sys.stderr)
        return None
    else:
        raise UsageError(f"nothing to draw: no runs of {task.name} in {runs} and no {csv_path}")
    peers = {name: read_csv(results / f"{name}.csv") for name in task.beside if (results / f"{name}.csv").exists()}
    plots = [results / f"{task.name}.png", results / f"{task.name}_time.png"]
    plot_steps(curve, task, args.window, plots[0], peers)
    plot_time(curve, task, args.window, plots[1])
    report(task, curve, peers)
    print("wrote " + ", ".join(map(str, ([csv_path] if records else []) + plots)))
    return curve


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    own, extra = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args = build_parser().parse_args(own)
    if args.list:
        list_tasks()
        return 0
    try:
        if args.cluster is None and (args.partition or args.slurm_arg or args.no_wait or args.retry_failed):
            raise UsageError("--partition, --slurm-arg, --no-wait and --retry-failed need --cluster")
        if args.cluster == "local" and (args.partition or args.slurm_arg):
            raise UsageError("--partition and --slurm-arg are SLURM's: they need --cluster slurm")
        if min(args.time_limit, args.cpus_per_job) < 1 or args.gpus_per_job < 0:
            raise UsageError("--time-limit and --cpus-per-job must be positive, --gpus-per-job not negative")
        if not 0 < args.poll <= 86_400:  # NaN too fails both comparisons
            raise UsageError(f"--poll is the seconds between two looks at the jobs: above 0 and at most a day "
                             f"(86400), not {args.poll:g}")
        if args.plot_only and (args.cluster or args.status):
            raise UsageError("--plot-only trains nothing: it cannot be used with --cluster or --status")
        tasks, skipped = resolve_tasks(args, extra)
        runs, results = args.runs.resolve(), args.results.resolve()
        check_writable(results, "--results")
        if not (args.plot_only or args.status):
            check_writable(runs, "--runs")
        if args.cluster or args.status:
            if not run_on_cluster(tasks, args, runs):
                return 0
        elif not args.plot_only:
            for task in tasks:
                for seed in task.seeds:
                    train_seed(task, seed, runs)
        curves = {task.name: draw(task, args, runs, results, args.suite is not None) for task in tasks}
        if args.suite is not None:
            script = tasks[0].script
            scores = [game_score(task.env, curve) for task in tasks if (curve := curves[task.name]) is not None]
            table = hns_table(args.suite, script, scores, skipped)
            stem = f"{args.suite}-{Path(script).stem}-hns"
            results.mkdir(parents=True, exist_ok=True)
            write_hns_csv(scores, results / f"{stem}.csv")
            (results / f"{stem}.md").write_text(table)
            print(table, end="")
            print(f"wrote {results / (stem + '.csv')}, {results / (stem + '.md')}")
        return 0
    except UsageError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    except RunError as error:
        print(f"{PROG}: {error}", file=sys.stderr)
        return 1
    except Interrupted as error:
        print(f"{PROG}: interrupted ({error}); the same command resumes the runs", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        if args.cluster or args.status:
            print(f"{PROG}: stopped waiting; the jobs go on (on SLURM), and the same command or --status picks "
                  "them up again", file=sys.stderr)
        else:
            print(f"{PROG}: interrupted between two sittings; the same command resumes the runs", file=sys.stderr)
        return 130


if __name__ == "__main__":
    # The libraries are loaded: Ctrl-C is Python's KeyboardInterrupt again, which `main` turns into
    # exit status 130 and a line that says where the runs stand.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.exit(main())
