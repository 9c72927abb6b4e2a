"""What replaying `ppo_atari.py`'s minibatch step from a CUDA graph would save, measured before the
script does it.

On an NVIDIA H200 an update of 8 games' 1,024 steps took 0.079 s (`throughput.py`), about 5 ms of
the host's time for each of its 16 minibatch steps: a few hundred small kernels launched one by one
(forward, loss, backward, clip, Adam). The host waits for none of them until the update's end
(Part 1's `minibatch_step` reads nothing back), so the whole step can be captured once and replayed
with one launch, as Part 2 replays `sample_actions`. This script measures that on a GPU before a
later part of the script holds it: the update of the trainer a run uses (`RunTrainer`), and the same
trainer with each minibatch step replayed from one graph (`GraphedUpdate`, here), in turns, on the
same rollouts of Breakout, each update from the same weights, moments and shuffles; and how far
apart each update leaves the weights, against how far it moved them.

    python benchmarks/graph_update.py --num-envs 8 32 --updates 12 --json graph-update.json

With `--device cpu` nothing is captured: `GraphedUpdate` runs Part 1's step on its fixed tensors as
it does before the capture, which checks the copies into them where there is no GPU (the tests do).
Nothing here is asserted in a test but the agreement of the weights.
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


class GraphedUpdate(ppo_atari.RunTrainer):
    """`RunTrainer` whose `minibatch_step` is Part 1's, replayed from a CUDA graph once captured.

    A graph reads and writes fixed memory, so the step is run on fixed tensors (`fixed_step`): the
    batch, the clip range and the learning rate, copied in once an update, and the minibatch's
    indices, at every step (Adam takes its learning rate as a tensor, and is made capturable). The
    first `WARMUP` steps run as they are, on a side stream, so that cuDNN chooses its algorithms and
    Adam makes its state before the capture; the outputs of a replay are valid until the next one,
    which Part 1's update allows (it stacks them at once).
    """

    WARMUP = 3

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.graph, self.fixed, self.outputs, self.steps = None, None, None, 0
        self.capture = self.device.type == "cuda"
        for group in self.optimizer.param_groups:
            group["capturable"] = self.capture

    def minibatch_step(self, batch, indices, clip_range):
        step = self.fixed_step(batch, indices, clip_range)
        if not self.capture:  # no GPU: Part 1's step on the fixed tensors, as before a capture
            return super().minibatch_step(*step)
        if self.graph is None and self.steps < self.WARMUP:
            self.steps += 1
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                terms = super().minibatch_step(*step)
            torch.cuda.current_stream().wait_stream(side)
            return type(terms)(*(term.clone() for term in terms))
        if self.graph is None:
            self.graph = torch.cuda.CUDAGraph()
            self.optimizer.zero_grad(set_to_none=True)  # the gradients made in the capture come from the graph's memory
            with torch.cuda.graph(self.graph):
                self.outputs = super().minibatch_step(*step)
        self.graph.replay()  # a capture records the step without running it: the first replay runs it
        return self.outputs

    def fixed_step(self, batch, indices, clip_range) -> tuple:
        """The step's arguments in the fixed tensors: the batch, clip range and learning rate copied in once an
        update (Part 1 sets the learning rate, a number, before its first step), the minibatch at every step."""
        if self.fixed is None:
            scalar = torch.zeros((), device=self.device)
            self.fixed = dict(batch=ppo_atari.Batch(*(torch.empty_like(x) for x in batch)),
                              indices=torch.empty_like(indices), clip_range=scalar.clone(),
                              learning_rate=scalar.clone(), source=None)
        fixed = self.fixed
        if batch is not fixed["source"]:  # a new update
            for target, source in zip(fixed["batch"], batch):
                target.copy_(source)
            fixed["clip_range"].fill_(clip_range)
            for group in self.optimizer.param_groups:
                fixed["learning_rate"].fill_(group["lr"])
                group["lr"] = fixed["learning_rate"]
            fixed["source"] = batch
        fixed["indices"].copy_(indices)
        return fixed["batch"], fixed["indices"], fixed["clip_range"]


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
    for kind in (ppo_atari.RunTrainer, GraphedUpdate):
        torch.manual_seed(1)  # the same first weights
        trainers[kind.__name__] = kind(config, games, device)
    if device.type == "cuda":  # true float32 (the trainers allow TF32), so that the weights differ by rounding alone
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    seconds, differences = {name: [] for name in trainers}, []
    for update in range(updates):
        start = [weights.detach().clone() for weights in trainers["RunTrainer"].model.parameters()]
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
            "seconds": seconds, "captured": trainers["GraphedUpdate"].graph is not None,
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
              f"{run['RunTrainer_seconds'] * 1e3:.1f} ms an update as it runs, "
              f"{run['GraphedUpdate_seconds'] * 1e3:.1f} ms with each step replayed from a CUDA graph"
              f"{'' if run['captured'] else ' (not captured: no GPU)'}; an update from the same weights left them "
              f"apart by {max(run['relative_weight_difference']):.1e} of how far it moved them, at most")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
