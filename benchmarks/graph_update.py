"""What replaying `ppo_atari.py`'s minibatch steps from a CUDA graph saves, and that it computes the
update as it is computed without one.

On CUDA, Part 2 of the script replays each minibatch step of the update (Part 1's `minibatch_step`:
forward, loss, backward, clip, Adam, a few hundred small kernels) from one CUDA graph
(`FastSamplingTrainer.cuda_graph_update`). This script measures the update of the trainer a run
uses (`RunTrainer`) with its steps launched one by one ("eager") and replayed ("graphed"), in turns,
on the same rollouts of Breakout, each update from the same weights, moments and shuffles; and how
far apart each update leaves the weights, against how far it moved them.

    python benchmarks/graph_update.py --num-envs 8 32 --updates 12 --json graph-update.json

On an NVIDIA H200 (2026-11-26): 88.8 ms an update of 8 games eager, 30.0 ms graphed; 102.0 and
80.7 ms at 32 games (`benchmarks/results/graph-update-NVIDIA-H200.json`, measured when the graphed
trainer lived here). With `--device cpu` nothing is captured: the "graphed" trainer runs Part 1's
step eagerly on the graph's fixed tensors, which checks the copies into them where there is no GPU
(the tests do). Nothing here is asserted in a test but the agreement of the weights.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import ppo_atari  # noqa: E402  (the script is the thing measured)


class FixedTensors(ppo_atari.RunTrainer):
    """`RunTrainer` whose minibatch steps run Part 1's step on the fixed tensors of Part 2's graphed
    update (`fixed_step`), eagerly: what a replay reads, checked where there is no GPU to capture."""

    def minibatch_step(self, batch, indices, clip_range):
        return ppo_atari.Trainer.minibatch_step(self, *self.fixed_step(batch, indices, clip_range))


class PlayedGames:
    """What a trainer needs of the games to be made, once the rollout it updates on was played."""

    def __init__(self, envs):
        self.num_envs, self.n_actions, self.observation_shape = envs.num_envs, envs.n_actions, envs.observation_shape


def played_rollouts(env_id: str, num_envs: int, device: torch.device) -> tuple[list[ppo_atari.Rollout], PlayedGames]:
    """Two rollouts of `num_envs` games with a fresh policy, on the host, and what the games were. The
    updates take them in turns, so that a step that kept reading an earlier batch would show."""
    config = ppo_atari.RunConfig(env=env_id, num_envs=num_envs, precision="fp32")
    with ppo_atari.Workers(env_id, num_envs, min(num_envs, 8), seed=1,
                           game_options=ppo_atari.game_options(config)) as envs:
        trainer = ppo_atari.RunTrainer(config, envs, device)
        rollouts = [ppo_atari.Rollout(*(tensor.clone() for tensor in trainer.collect_rollout())) for _ in range(2)]
        return rollouts, PlayedGames(envs)


def apart(first: ppo_atari.Trainer, second: ppo_atari.Trainer, start: list[torch.Tensor]) -> float:
    """How far apart the two trainers' weights are, over how far the first's moved from `start`: the
    norms of all the weights together. (Per tensor it would mislead: Adam moves a weight whose gradient
    is near 0 by a whole step whichever way its sign falls, and a sample at the edge of PPO's clip can
    flip it.)"""
    with torch.no_grad():
        ours, theirs = list(first.model.parameters()), list(second.model.parameters())
        gap = torch.cat([(b - a).flatten() for a, b in zip(ours, theirs)]).norm()
        moved = torch.cat([(a - s).flatten() for a, s in zip(ours, start)]).norm()
        return float(gap / moved)


def copy_state(source: ppo_atari.Trainer, target: ppo_atari.Trainer) -> None:
    """The weights and Adam's moments of `source` copied into `target`'s own tensors (a graph reads those)."""
    with torch.no_grad():
        for ours, theirs in zip(source.model.parameters(), target.model.parameters()):
            theirs.copy_(ours)
            for key, value in source.optimizer.state[ours].items():
                target.optimizer.state[theirs][key].copy_(value)


def measure(env_id: str, num_envs: int, device: torch.device, updates: int) -> dict:
    """Seconds per update of each trainer, in turns, and how far apart their weights end."""
    rollouts, games = played_rollouts(env_id, num_envs, device)
    config = ppo_atari.RunConfig(env=env_id, num_envs=num_envs, precision="fp32")
    trainers = {}
    for name, kind in (("eager", ppo_atari.RunTrainer), ("graphed", FixedTensors if device.type == "cpu"
                                                          else ppo_atari.RunTrainer)):
        torch.manual_seed(1)  # the same first weights
        trainers[name] = kind(config, games, device)
        trainers[name].cuda_graph_update = name == "graphed"
    if device.type == "cuda":  # true float32 (the trainers allow TF32), so that the weights differ by rounding alone
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    seconds, differences = {name: [] for name in trainers}, []
    for update in range(updates):
        start = [weights.detach().clone() for weights in trainers["eager"].model.parameters()]
        for name, trainer in trainers.items():
            torch.manual_seed(100 + update)  # the same shuffles
            started = time.perf_counter()
            trainer.update_policy(rollouts[update % 2])
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds[name].append(time.perf_counter() - started)
        differences.append(apart(*trainers.values(), start))
        copy_state(*trainers.values())  # each update starts from the same weights and moments
    warm = slice(min(2, updates - 1), None)  # the first updates warm up and capture
    return {"device": str(device), "num_envs": num_envs, "updates": updates,
            "minibatch_steps_per_update": config.update_epochs * config.num_minibatches,
            **{f"{name}_seconds": statistics.median(times[warm]) for name, times in seconds.items()},
            "seconds": seconds, "captured": trainers["graphed"].update_graph is not None,
            "relative_weight_difference": differences}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", default="Breakout")
    parser.add_argument("--num-envs", type=int, nargs="+", default=[8, 32], help="games of the rollout; each is measured")
    parser.add_argument("--updates", type=int, default=12, help="updates of each trainer, in turns (the first 2 not timed)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if min(args.num_envs) < 1 or args.updates < 1:
        parser.error("--num-envs and --updates must be at least 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU, and torch finds none (--device cpu checks the copies alone)")
    try:
        env_id = ppo_atari.resolve_env_id(args.env)
    except ppo_atari.ConfigError as error:
        parser.error(str(error))
    device = torch.device(args.device)
    results = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
               "runs": []}
    for num_envs in args.num_envs:
        run = measure(env_id, num_envs, device, args.updates)
        results["runs"].append(run)
        print(f"{num_envs} games, {run['minibatch_steps_per_update']} minibatch steps an update, {device}: "
              f"{run['eager_seconds'] * 1e3:.1f} ms an update with its steps launched one by one, "
              f"{run['graphed_seconds'] * 1e3:.1f} ms with each replayed from a CUDA graph"
              f"{'' if run['captured'] else ' (not captured: no GPU)'}; an update from the same weights left them "
              f"apart by {max(run['relative_weight_difference']):.1e} of how far it moved them, at most")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
