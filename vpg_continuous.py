r"""
# Vanilla policy gradient for continuous control

This page trains a robot to run, hop or balance with the simplest policy-gradient method done
right: vanilla policy gradient (VPG) with a learned value function as its baseline and generalized
advantage estimation. It is written to be read top to bottom, and everything it needs is in this
one file. It shows the algorithm first, for one process: the Gaussian policy and the value
network, GAE, the policy gradient itself, the running normalisation of observations and rewards,
and the loop of training. The engineering follows: the processes that step many copies of
the task at once, the command line, checkpoints and logs, and data-parallel training.

```
pip install -r requirements.txt
python vpg_continuous.py                          # HalfCheetah-v5; TensorBoard events in runs/
python vpg_continuous.py --env Hopper-v5 --seed 2
python vpg_continuous.py --eval runs/<run>/checkpoint.pt --capture-video
torchrun --nproc_per_node 4 vpg_continuous.py      # data-parallel: see Part 4
```

Any gymnasium task whose actions are a vector of reals works: the MuJoCo v5 tasks (HalfCheetah,
Hopper, Walker2d, Ant, InvertedPendulum, ...) and Pendulum-v1 among them.

**What makes it vanilla.** Each batch of fresh experience buys exactly **one** gradient step of the
policy, because the policy gradient is only an unbiased estimate at the parameters that collected
the batch. That single step is what separates it from PPO, whose clipped ratio makes many steps on
one batch safe; everything else here (GAE, normalised observations, separate value fitting,
orthogonal initialisation, annealed Adam) is the usual craft of on-policy methods, and it is what
lifts VPG well above the textbook version.

**What to expect.** With the defaults, HalfCheetah-v5 reaches a return of 3,049 after 1M steps, the
mean over seeds 1, 2 and 3 of each seed's last 100 episodes (3,570, 2,484 and 3,093): level with
rl-baselines3-zoo's A2C (3,041 at 1M, one run), a policy gradient with a learned baseline like this
one. Spinning Up's VPG, with batches of 4,000 steps and neither normalisation, reaches about 630
after 3M steps (read off its benchmark plot for PyTorch, on HalfCheetah-v3). On Hopper-v5, with the
same defaults, it reaches 1,776 (1,749, 1,372 and 2,208), between rl-zoo's A2C (733) and its PPO
(2,410), each at 1M steps and one run.

![vpg_continuous.py on HalfCheetah-v5: the mean return of seeds 1 to 3 climbs from about -200 to 3,049 at 1M steps, with the seeds between 2,484 and 3,570; rl-zoo's A2C, 3,041 at 1M steps, and Spinning Up's VPG, about 630 at 3M steps, are drawn as dashed lines](benchmarks/results/halfcheetah.png)

![vpg_continuous.py on Hopper-v5: the mean return of seeds 1 to 3 climbs to about 1,000 at 200k steps and 1,776 at 1M, with the seeds between 1,372 and 2,208; rl-zoo's A2C, 733, and its PPO, 2,410, both at 1M steps, are drawn as dashed lines](benchmarks/results/hopper.png)

`python benchmarks/learning_curves.py halfcheetah` and `hopper` made the curves. What spreads the
seeds is when each finds its first gait: on HalfCheetah seeds 1 and 3 first average 500 at 180k
steps and seed 2 at 250k. On an otherwise idle 2-core x86-64 CPU (an AMD EPYC) a run steps about
6,000 times a second, so 1M steps take about 3 minutes; more than half of that is the update (see
`choose_device` on why the CPU runs it; the README has the command and the figures). What mattered
most were small batches, since one step per batch means the batch size decides how many times the
policy moves, then reward scaling, then how the gradient is clipped: the table under `Config` has
the numbers beside each default and where it comes from. The batch size and the scaling were
measured on seed 1 alone, on an earlier version of this file (it reached 3,954, 2,352 and 1,777 on
seeds 1 to 3, the last 20 episodes of each); the clip and the scaler's prior were chosen on three
whole runs of each candidate. `python benchmarks/vpg_halfcheetah.py` measures a seed again.

Papers: REINFORCE (Williams, 1992, Machine Learning 8); the policy gradient theorem (Sutton et al.,
2000, NIPS 12); GAE (Schulman et al., 2016, arXiv:1506.02438); time limits as truncation (Pardo et
al., 2018, arXiv:1712.00378); the on-policy design choices studied by Andrychowicz et al. (2021,
"What matters in on-policy reinforcement learning?", ICLR); VPG as OpenAI's Spinning Up teaches it
(Achiam, 2018).

The page in order:

1. **The algorithm**, for one process: the hyperparameters (`Config`, with where each default
   comes from); the environment (`Task`); the model (`GaussianPolicy`, `ValueFunction`, built by
   `make_networks`); the advantages (`compute_gae`, `normalize_advantages`); the policy gradient
   (`vpg_loss`); what the learner sees (`RunningMeanStd`, `ObservationNormalizer`,
   `RewardScaler`); the rollout, kept on the host and crossing to the device once each way per step,
   the update and the loop of training (`Trainer`).
2. **Sampling at speed**: `Workers`, many envs in other processes, observations in shared memory.
3. **Running it for real**: the command line (`RunConfig`: `Config` and the settings of one
   invocation) and its validation, the hardware choices, checkpoints, logging and progress, signals
   (`Signals`), the run (`train`, with `RunWorkers` and `RunTrainer`, the trainer that runs), a
   trained policy in Python (`load_policy`) and its evaluation, videos, and `main()`.
4. **More than one device** (optional): data-parallel training under torchrun
   (`DataParallelTrainer`, `Ranks`; each rank trains with a `DataParallelRunTrainer`).

Licence: MIT (see LICENSE in the repository this file comes from); copy it freely, keeping this line.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import ctypes
import dataclasses
import difflib
import fcntl
import fractions
import functools
import inspect
import io
import math
import multiprocessing as mp
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import traceback
import typing
import warnings
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for_any
from pathlib import Path
from typing import Literal, NamedTuple

if __name__ == "__main__":  # a Ctrl-C while the libraries below load: exit status 130 at once, not a traceback
    signal.signal(signal.SIGINT, lambda signum, frame: os._exit(128 + signum))

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn


# ## Part 1: The algorithm
#
# Everything VPG does, in the order it runs, for one process: the settings, the task as the learner
# sees it, the networks, the advantages and the loss, then sampling, updating and the loop that
# repeats them. A reader who stops at the end of this part has seen all of VPG. The later parts
# make it fast, usable and wider by extending what is here, never by reaching into it.


# ### The hyperparameters
#
# One dataclass holds every setting of the agent and its training. The string under each field is
# its documentation and also its `--help` text: the command line (Part 3) is derived from this
# class and from Part 3's `RunConfig`, which adds the settings of one invocation. `num_envs` is
# spelled `--num-envs`, and booleans are `--flag` / `--no-flag`.


@dataclass
class Config:
    r"""Every setting of the agent and its training, and where each default of the algorithm comes from.

    | setting | ours | Spinning Up's VPG | PPO paper, MuJoCo (Table 3) | CleanRL `ppo_continuous_action` | why ours |
    |-|-|-|-|-|-|
    | `num_envs` x `num_steps` | 8 x 32 = 256 | 4,000 | 2,048 (horizon $T$) | 1 x 2,048 | One policy step per batch, so the batch size decides how often the policy moves. HalfCheetah-v5, seed 1, after 300k steps: batches of 2,048 reached 368, of 512 1,875, of 256 2,950; after 1M, 512 reached 3,161 and 256 3,954 (the tuning runs of c219e2d, `benchmarks/README.md`) |
    | `learning_rate` (policy) | $10^{-3}$, annealed linearly: $1/N$ of it at the last of $N$ updates | $3 \cdot 10^{-4}$, constant | $3 \cdot 10^{-4}$ | $3 \cdot 10^{-4}$, annealed the same way | With batches of 2,048, $3 \cdot 10^{-3}$ reached 621 at 300k where $10^{-3}$ reached 368: a larger step helps a little, more steps (smaller batches) far more |
    | `value_learning_rate` | $10^{-3}$, annealed the same way | $10^{-3}$, constant | one Adam for both | one Adam for both | Spinning Up's; a network of its own gets a rate of its own |
    | `gamma` | 0.99 | 0.99 | 0.99 | 0.99 | Everyone's |
    | `gae_lambda` | 0.97 | 0.97 | 0.95 | 0.95 | Spinning Up's VPG: longer, less biased estimates for a policy that takes one step per batch |
    | `value_epochs` x `num_minibatches` | 10 x 4 (40 steps on 64 transitions) | 80 steps on the whole batch | 10 epochs, minibatches of 64, shared with the policy | 10 x 32, shared with the policy | Ours, not tuned: enough for the value function to catch up with the policy before the next batch's advantages rest on it |
    | `vf_coef` | 0.5, on the mean squared error | none (an optimiser of its own) | irrelevant (no shared parameters) | 0.5, on half the squared error | CleanRL's number. Under Adam a constant factor on a loss hardly changes its step; it decides how soon the value's clip at `max_grad_norm` bites |
    | `ent_coef` | 0 | none | 0 (no entropy bonus) | 0 | Everyone's for these tasks |
    | `max_grad_norm`, `clip_each_network` | 0.5, on the joint gradient of policy and value | none | none | 0.5, on the joint gradient of actor and critic | Chosen on whole runs, HalfCheetah-v5 to 1M steps on seeds 1 to 3 (`benchmarks/results/halfcheetah-defaults.csv`): the joint clip with the plain reward scaler reached 2,871 (2,707, 2,673, 3,234); each network clipped apart, with the scaler's prior and clip, 2,267 (1,650, 2,811, 2,339); no clip, with the prior and clip, 1,824 (1,556, 2,884, 1,031). The first ran the script of commit 40422bc, the other two that of 30d4d64; with this page's code (fused Adam, which rounds a little differently) the chosen pair reached 3,049 (3,570, 2,484, 3,093). Clipped jointly, a value function far off its targets shrinks the policy's step (see `Trainer.gradient_step`), yet it learned best |
    | `normalize_observations` | on, clipped to $\pm 10$ | off | not said | on, clipped to $\pm 10$ | Without it, HalfCheetah-v5 (seed 1) reached 3,014 instead of 3,954 |
    | `normalize_rewards`, `reward_prior_and_clip` | on (divided by the return's running spread), with no prior and no clip | off | not said | on, clipped to $\pm 10$ | Without it, 1,133 instead of 3,954 on seed 1 (an earlier version): it mattered more than the observations (see `RewardScaler`). Its prior and clip were chosen off on the whole runs of the row above; give them to a run of one env, whose first returns have no spread |
    | `state_dependent_std` | off: one learned $\log \sigma$, starting at $\sigma \approx 0.69$ | off, $\log \sigma = -0.5$ at the start | off | off, $\log \sigma = 0$ at the start | Level with a $\sigma(s)$ head in return, and far steadier (see `GaussianPolicy`) |
    | `total_timesteps` | 1M | 200k (50 epochs of 4,000) | 1M | 1M | The usual budget for these tasks |

    Not settings but fixed in the code, each explained where it is: two separate networks of two
    128-unit tanh layers (Spinning Up, the paper and CleanRL use 64 units), orthogonal
    initialisation, and Adam's $\epsilon = 10^{-5}$ (CleanRL's; Spinning Up keeps torch's $10^{-8}$).
    The settings of one invocation rather than of the agent (workers, device, run directory,
    checkpoints, evaluation) are not here: they live in `RunConfig`, in Part 3.
    """

    env: str = "HalfCheetah-v5"
    """Gymnasium task with continuous (Box) actions: a full id (`Hopper-v5`) or a name alone (`Hopper`: its newest version)."""
    max_episode_steps: int | None = None
    """Cut each episode after this many steps, a truncation (default: the task's own limit, 1,000 for MuJoCo)."""
    total_timesteps: int = 1_000_000
    """Environment steps to train for, summed over every env of the run."""
    num_envs: int = 8
    """Environments played at once by each learning process."""
    num_steps: int = 32
    """Steps each env plays per update; a batch is `num_envs * num_steps` transitions."""
    learning_rate: float = 1e-3
    """Adam's learning rate for the policy at the start, annealed linearly: 1/N of it at the last of N updates."""
    value_learning_rate: float = 1e-3
    """Adam's learning rate for the value function at the start, annealed like `learning_rate`."""
    gamma: float = 0.99
    """Discount factor."""
    gae_lambda: float = 0.97
    """GAE's lambda: 0 is one-step TD, 1 is the Monte Carlo return."""
    value_epochs: int = 10
    """Passes over the batch that fit the value function after each policy step."""
    num_minibatches: int = 4
    """Minibatches the batch is split into for each pass of value fitting."""
    ent_coef: float = 0.0
    """Weight of the entropy bonus."""
    vf_coef: float = 0.5
    """Weight of the value loss."""
    max_grad_norm: float = 0.5
    """Clip the gradient's norm to this: the joint norm of the networks a step updates (each apart with `clip_each_network`)."""
    state_dependent_std: bool = False
    """Compute the policy's standard deviation from the state (a second head) rather than learn one per action."""
    normalize_observations: bool = True
    """Standardise observations with their running mean and variance, then clip them to +-10."""
    normalize_rewards: bool = True
    """Divide rewards by the running standard deviation of the discounted return."""
    clip_each_network: bool = False
    """Clip the policy's and the value function's gradients each on its own, rather than their joint norm."""
    reward_prior_and_clip: bool = False
    """Start the reward scaler's statistics from one return of variance 1, and clip scaled rewards to +-10."""
    seed: int = 1
    """Seeds torch and every env (each env gets its own seed derived from this)."""

    @property
    def batch_size(self) -> int:
        return self.num_envs * self.num_steps

    @property
    def minibatch_size(self) -> int:
        return self.batch_size // self.num_minibatches


class ConfigError(Exception):
    """A mistake in what the user asked for: reported in one line, exit status 2."""


# ### The environment
#
# Any gymnasium task whose actions are a box of real numbers will do: a torque per joint for the
# MuJoCo robots, one torque for the pendulum. Gymnasium's own `TimeLimit` wrapper (which `gym.make`
# adds) ends each episode after the task's step limit, 1,000 steps for MuJoCo and 200 for
# Pendulum-v1, and reports it as a *truncation*, apart from a *termination* (the hopper fell). The
# two are treated differently in the advantages below. `make_env` is the one place an env is made,
# and `describe_env` reads from it the sizes the learner needs, so no shape is written out anywhere.


class EnvSpaces(NamedTuple):
    """What the learner needs to know of a task: the size of an observation and the action bounds."""

    obs_dim: int
    action_low: np.ndarray
    action_high: np.ndarray

    @property
    def action_dim(self) -> int:
        return len(self.action_low)


def make_env(env_id: str, max_episode_steps: int | None = None, render: bool = False) -> gym.Env:
    """`gym.make`, with a failure to build the env (a missing package, say) as a `ConfigError`."""
    options = {"render_mode": "rgb_array"} if render else {}  # some third-party envs take no render_mode
    try:
        return gym.make(env_id, max_episode_steps=max_episode_steps, **options)
    except Exception as error:  # gymnasium and the simulators raise many kinds
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ConfigError(f"cannot make {env_id}: {reason}") from None


def describe_env(env_id: str) -> EnvSpaces:
    """Build the env once to read its spaces; refuse what this script cannot learn."""
    env = make_env(env_id)
    try:
        actions, observations = env.action_space, env.observation_space
    finally:
        env.close()
    if not isinstance(actions, gym.spaces.Box):
        raise ConfigError(f"{env_id} has {type(actions).__name__} actions ({actions}); vpg_continuous.py "
                          "learns continuous (Box) actions, such as HalfCheetah-v5's or Pendulum-v1's")
    if len(actions.shape) != 1:
        raise ConfigError(f"{env_id}'s actions have shape {actions.shape}; vpg_continuous.py needs a vector")
    if not isinstance(observations, gym.spaces.Box) or len(observations.shape) != 1:
        raise ConfigError(f"{env_id}'s observations are {observations}; vpg_continuous.py needs a vector (a 1-D Box)")
    return EnvSpaces(observations.shape[0], actions.low.astype(np.float64), actions.high.astype(np.float64))


class Transition(NamedTuple):
    """What one step of a `Task` reports besides the new observation."""

    reward: float
    """The env's reward, as it gave it."""
    terminated: bool
    """The episode reached an end with no future (the robot fell): nothing to bootstrap."""
    truncated: bool
    """The time limit cut the episode: its future exists but we stop watching; bootstrap it."""
    episode_return: float
    """The sum of the episode's rewards so far."""
    episode_length: int
    """Steps taken in this episode so far."""


class Task:
    """One gymnasium env as the learner sees it: seeded once, the return of its episode counted.

    `obs` holds the current observation, updated in place; a worker passes a view of shared memory
    as `obs`, so observations land where the main process reads them. The env is seeded at its
    first reset only: later resets draw from the generator that seed started, so each episode
    begins differently.
    """

    def __init__(self, env_id: str, seed: int, max_episode_steps: int | None = None, obs: np.ndarray | None = None,
                 render: bool = False):
        self.env = make_env(env_id, max_episode_steps, render)
        self.seed: int | None = int(seed)
        self.obs = np.zeros(self.env.observation_space.shape, np.float64) if obs is None else obs
        self.action_dtype = self.env.action_space.dtype
        self.episode_return = 0.0
        self.episode_length = 0

    def reset(self) -> np.ndarray:
        obs, _ = self.env.reset(seed=self.seed)
        self.seed = None
        self.obs[:] = obs
        self.episode_return, self.episode_length = 0.0, 0
        return self.obs

    def step(self, action: np.ndarray) -> Transition:
        """Take `action`, already inside the action bounds (the trainer clips it)."""
        obs, reward, terminated, truncated, _ = self.env.step(action.astype(self.action_dtype))
        self.obs[:] = obs
        self.episode_return += float(reward)
        self.episode_length += 1
        return Transition(float(reward), bool(terminated), bool(truncated), self.episode_return, self.episode_length)

    def render(self) -> np.ndarray:
        """The current frame, height x width x 3 RGB, for videos."""
        return self.env.render()

    def close(self) -> None:
        self.env.close()


# ### The model
#
# Two separate networks, as in Spinning Up's VPG (Achiam, 2018): a Gaussian policy
# $\pi_\theta(a|s)$ and a value function $V_\phi(s)$, each a multilayer perceptron of two 128-unit
# tanh layers. Keeping them apart means the value loss cannot disturb the features of the policy,
# and each gets a learning rate of its own. Tanh rather than ReLU is the choice Andrychowicz et al.
# (2021) found to work best for on-policy methods on these tasks.


def layer_init(layer: nn.Linear, gain: float = math.sqrt(2)) -> nn.Linear:
    r"""Orthogonal weights scaled by `gain`, zero biases.

    Orthogonal matrices keep the norm of what passes through them, so activations neither explode
    nor vanish with depth. Hidden layers use $\sqrt 2$ as the PPO reference implementation does
    for its tanh layers; the mean head starts at 0.01, so the first policy's mean action is near 0
    whatever the state; the value head starts at 1.
    """
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.zeros_(layer.bias)
    return layer


def mlp_torso(input_dim: int, hidden: int = 128) -> nn.Sequential:
    """Two tanh layers of `hidden` units: the body of both networks."""
    return nn.Sequential(layer_init(nn.Linear(input_dim, hidden)), nn.Tanh(),
                         layer_init(nn.Linear(hidden, hidden)), nn.Tanh())


# The standard deviation of the first policy: softplus(0) + 0.001, the scale head's output while
# its weights are near 0, and the starting value of the learned log-std, so both kinds start alike.
INITIAL_STD = math.log(2.0) + 1e-3


class GaussianPolicy(nn.Module):
    r"""A diagonal Gaussian over actions: $\pi_\theta(a|s) = \mathcal N(a;\, \mu_\theta(s),\, \mathrm{diag}\, \sigma_\theta(s)^2)$.

    The mean is a linear head on the torso. The standard deviation comes one of two ways:

    * `state_dependent_std=True`: a second head, $\sigma = \mathrm{softplus}(x) + 10^{-3}$, in the
      style of DeepMind Acme's Gaussian heads. Softplus keeps it positive and smooth; the floor
      keeps the log-probability finite.
    * `state_dependent_std=False` (the default): one learned $\log \sigma$ per action dimension,
      the same in every state, as in Spinning Up, OpenAI baselines and CleanRL.

    **Which one, and why.** The returns do not pick a winner. After 1M steps (the mean return of the
    last 20 episodes, with the code of c219e2d; `benchmarks/README.md`), HalfCheetah-v5 reached
    3,954, 2,352 and 1,777 on seeds 1 to 3 with the learned log-std and 2,651, 1,553 and 2,966 with
    the head; Hopper-v5 reached 1,158 and 1,608 on seeds 1 and 2 with the learned log-std and 1,867
    and 1,038 with the head. Seeds differ more than the two designs do. What differs is how steadily
    the policy learns. With the head, single updates moved the policy by up to 0.16 to 0.35 in KL
    divergence on HalfCheetah (0.05 on Hopper) against at most 0.011 (0.019) with the learned
    log-std, and on HalfCheetah the entropy fell from 6.3 nats at the start to 0.7, 4.0 and -1.3 by
    the end, where the learned log-std kept 5.1 to 5.4. With batches of 512 (HalfCheetah, seed 1)
    that collapse cost the head the run: 1,143 against 3,161. So the default is the learned log-std,
    the steadier of two equals; `--state-dependent-std` switches.

    Why a head collapses: the gradient of $\log \pi$ with respect to $\log \sigma_j$ is
    $z_j^2 - 1$, with $z_j = (a_j - \mu_j) / \sigma_j$, so wherever samples near the mean happened
    to do better than average the policy gradient shrinks $\sigma$. Adam moves each parameter by
    about the learning rate per step: a free $\log \sigma$ changes by at most about $10^{-3}$
    per update, while the head's output, a sum over 128 weights, can move tens of times further,
    state by state, long before the mean has found a good gait.
    """

    def __init__(self, obs_dim: int, action_dim: int, state_dependent_std: bool = False):
        super().__init__()
        self.torso = mlp_torso(obs_dim)
        self.mean = layer_init(nn.Linear(128, action_dim), gain=0.01)
        if state_dependent_std:
            self.scale = layer_init(nn.Linear(128, action_dim), gain=0.01)
        else:
            self.log_std = nn.Parameter(torch.full((action_dim,), math.log(INITIAL_STD)))

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The mean and standard deviation, each `[batch, action_dim]`, for observations `[batch, obs_dim]`."""
        hidden = self.torso(obs)
        mean = self.mean(hidden)
        if hasattr(self, "scale"):
            std = nn.functional.softplus(self.scale(hidden)) + 1e-3
        else:
            std = self.log_std.exp().expand_as(mean)
        return mean, std


class ValueFunction(nn.Module):
    r"""$V_\phi(s)$: the expected discounted return from $s$ under the current policy."""

    def __init__(self, obs_dim: int):
        super().__init__()
        self.torso = mlp_torso(obs_dim)
        self.head = layer_init(nn.Linear(128, 1), gain=1.0)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.head(self.torso(obs)).squeeze(-1)


def make_networks(spaces: EnvSpaces, config: Config) -> tuple[GaussianPolicy, ValueFunction]:
    """The policy and the value function for a task: the one place where the networks are built."""
    return GaussianPolicy(spaces.obs_dim, spaces.action_dim, config.state_dependent_std), ValueFunction(spaces.obs_dim)


def gaussian_sample(mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    r"""$a = \mu + \sigma \odot \varepsilon$, $\varepsilon \sim \mathcal N(0, I)$: unbounded, never clipped here."""
    return mean + std * torch.randn_like(mean)


def gaussian_log_prob(mean: torch.Tensor, std: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    r"""$\log \pi(a|s)$ of a diagonal Gaussian, `[batch]`.

    The action dimensions are independent given the state, so the density is a product over them
    and its logarithm a sum:

    $$\log \pi(a|s) = \sum_{j=1}^{d} \left[ -\frac{(a_j - \mu_j)^2}{2 \sigma_j^2} - \log \sigma_j
      - \tfrac12 \log 2\pi \right].$$

    Summed, not averaged: the mean over dimensions is the log-density of no distribution. It
    divides the policy gradient by $d$ against the value and entropy terms, and makes the
    reported KL divergence and entropy wrong by the same factor. It is a common slip when the
    per-dimension log-probabilities of `torch.distributions.Normal` are reduced with `.mean()`.
    """
    z = (actions - mean) / std
    return (-0.5 * z.pow(2) - std.log() - 0.5 * math.log(2 * math.pi)).sum(-1)


def gaussian_entropy(std: torch.Tensor) -> torch.Tensor:
    r"""$H[\pi(\cdot|s)] = \sum_j \left[\log \sigma_j + \tfrac12 (1 + \log 2\pi)\right]$, `[batch]`."""
    return (std.log() + 0.5 * (1.0 + math.log(2 * math.pi))).sum(-1)


# ### Generalized advantage estimation
#
# The policy gradient needs to know how much better an action was than the policy's average at
# that state: the advantage $A_t$. GAE (Schulman et al., 2016) blends estimates of it from one step
# to the whole rollout; $\lambda = 0.97$ leans towards the long ones, as VPG references do. The
# estimates are then standardised over the batch.


def compute_gae(rewards: torch.Tensor, values: torch.Tensor, next_values: torch.Tensor,
                terminated: torch.Tensor, truncated: torch.Tensor, gamma: float,
                gae_lambda: float) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Advantages and returns for a rollout; every argument is `[num_steps, num_envs]`.

    With the TD error of step $t$

    $$\delta_t = r_t + \gamma (1 - \mathrm{terminated}_t) V(s_{t+1}) - V(s_t),$$

    the advantage is the exponentially weighted sum of the TD errors that follow, cut where the
    episode ends:

    $$\hat A_t = \delta_t + \gamma \lambda (1 - \mathrm{done}_t) \hat A_{t+1},$$

    where $\mathrm{done}_t = \mathrm{terminated}_t \lor \mathrm{truncated}_t$.

    The returns that the value function regresses to are $\hat A_t + V(s_t)$, the
    $\lambda$-return.

    `next_values[t]` is $V(s_{t+1})$, the value of the observation that step $t$ led to. Where the
    episode went on, that is `values[t + 1]` (or the value of the observation after the rollout).
    Where step $t$ ended an episode, the observation the workers returned is already the first of
    the next one: where it was truncated, the caller supplies the value of the episode's *final*
    observation instead; where it terminated, the value there is multiplied by 0 (below).

    **Why termination and truncation stay apart.** A termination (the hopper fell, the inverted
    pendulum toppled) means there is no future: the value after it is 0 and is not bootstrapped. A
    truncation (the 1,000-step limit of MuJoCo tasks) means only that we stopped watching: the
    cheetah would have gone on running, so $\delta_t$ bootstraps from $V$ of the final
    observation, while the sum over later TD errors is still cut, since those belong to the next
    episode. Folding the two into one `done` flag teaches the value function that the world ends
    at step 1,000, a fact the agent cannot see in its observation (Pardo et al., 2018). On
    HalfCheetah, which never terminates, *every* episode ends by truncation, so the difference
    touches the last steps of every episode.
    """
    num_steps = rewards.shape[0]
    advantages = torch.zeros_like(rewards)
    not_terminated = 1.0 - terminated.float()
    not_done = 1.0 - torch.maximum(terminated.float(), truncated.float())
    deltas = rewards + gamma * not_terminated * next_values - values
    advantage = torch.zeros_like(rewards[0])
    for t in reversed(range(num_steps)):
        advantage = deltas[t] + gamma * gae_lambda * not_done[t] * advantage
        advantages[t] = advantage
    return advantages, advantages + values


def normalize_advantages(advantages: torch.Tensor, mean: torch.Tensor | None = None,
                         std: torch.Tensor | None = None) -> torch.Tensor:
    r"""The advantages of a batch, standardised: $\hat A_i \leftarrow (\hat A_i - \mu) / (\sigma + 10^{-8})$.

    $\mu$ is their mean over the batch and $\sigma$ their (unbiased) standard deviation. The size of
    the policy's step then no longer depends on the scale of the rewards, and about half the actions
    are pushed up, half down. The $10^{-8}$ keeps a batch of equal advantages finite. Part 4 passes
    `mean` and `std` of the batches of all ranks together (a fork that standardises by other
    statistics computes them there too).
    """
    mean = advantages.mean() if mean is None else mean
    std = advantages.std() if std is None else std
    return (advantages - mean) / (std + 1e-8)


# ### The policy gradient
#
# This is the heart of the page: the one equation that every policy-gradient method, PPO included,
# starts from.


# What a loss returns: the loss to minimise under `"loss"`, then each of its terms by name. Every
# entry but `"loss"` is logged as `losses/<name>`, so a new term is one more entry of the result and
# needs no other edit.
LossTerms = dict[str, torch.Tensor]


def vpg_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, values: torch.Tensor,
             returns: torch.Tensor, entropy: torch.Tensor, config: Config) -> LossTerms:
    r"""The loss whose gradient is the (negated) policy gradient, plus the value and entropy terms.

    **The policy gradient theorem.** We want the parameters $\theta$ that maximise the expected
    return $J(\theta) = \mathbb E_{\tau \sim \pi_\theta}[R(\tau)]$ of trajectories
    $\tau = (s_0, a_0, s_1, a_1, \dots)$. The probability of a trajectory is a product of the
    policy's choices and the environment's transitions,
    $p_\theta(\tau) = p(s_0) \prod_t \pi_\theta(a_t|s_t)\, p(s_{t+1}|s_t, a_t)$, and only the
    policy's factors depend on $\theta$. With $\nabla p = p \nabla \log p$ (the log-derivative
    trick) the gradient becomes an expectation we can sample, with no model of the environment:

    $$\nabla_\theta J(\theta) = \mathbb E_{\tau \sim \pi_\theta}\left[\sum_t
      \nabla_\theta \log \pi_\theta(a_t|s_t)\; R(\tau)\right].$$

    It holds as well with the advantage of each action in place of the whole return (Williams,
    1992; Sutton et al., 2000),

    $$\nabla_\theta J(\theta) = \mathbb E_{\tau \sim \pi_\theta}\left[\sum_t
      \nabla_\theta \log \pi_\theta(a_t|s_t)\; A^{\pi_\theta}(s_t, a_t)\right],$$

    because an action cannot change the rewards that came before it, and because any baseline
    $b(s_t)$ may be subtracted from what follows it, since its term has expectation zero:

    $$\mathbb E_{a \sim \pi}[\nabla_\theta \log \pi_\theta(a|s)\, b(s)]
      = b(s)\, \nabla_\theta \int \pi_\theta(a|s)\, da = b(s)\, \nabla_\theta 1 = 0.$$

    Taking the baseline $V(s_t)$ leaves the advantage, whose variance is far smaller than the
    return's. It reads: make actions that did better than usual more likely, and those that did
    worse less likely, in proportion to how much better or worse.

    **In code.** With $N$ samples and the GAE estimate $\hat A$ in place of $A$ (a constant here,
    computed before the step), the surrogate

    $$L^\pi(\theta) = -\frac1N \sum_i \log \pi_\theta(a_i|s_i)\, \hat A_i$$

    has the negated policy gradient as its gradient, so minimising it with Adam ascends $J$. Like
    nearly every implementation we drop the $\gamma^t$ that the discounted theorem puts on each
    term (Thomas, 2014), and the advantages are normalised over the batch. The estimate is only
    right at the $\theta$ that collected the samples: after one step the batch is stale, which is
    why vanilla policy gradient takes **one** step per batch. (PPO's ratio and clip are what make
    more steps on one batch safe.)

    The value term is the mean squared error to the $\lambda$-returns, and the entropy bonus
    $H$ (weight 0 by default) can slow the collapse of $\sigma$:
    $L = L^\pi + c_V\, \mathbb E[(V_\phi(s) - \hat R)^2] - c_H\, \mathbb E[H]$, with $c_V$ and
    $c_H$ the `vf_coef` and `ent_coef` of `config`.

    `old_log_probs` are those of the policy that sampled the batch. VPG's one step starts from that
    policy, so its loss has no use for them; a variant that keeps the new policy near the old one
    (a KL penalty, say) needs them, and a setting of its own, read from `config`.
    """
    policy_loss = -(log_probs * advantages).mean()
    value_loss = (values - returns).pow(2).mean()
    entropy = entropy.mean()
    loss = policy_loss + config.vf_coef * value_loss - config.ent_coef * entropy
    return {"loss": loss, "policy_loss": policy_loss, "value_loss": value_loss, "entropy": entropy}


def linear_schedule(initial: float, update: int, num_updates: int) -> float:
    """`initial` annealed linearly: the full value at update 0, `initial / num_updates` at the last."""
    return initial * (1.0 - update / num_updates)


def explained_variance(predictions: torch.Tensor, targets: torch.Tensor) -> float:
    r"""$1 - \mathrm{Var}[y - \hat y] / \mathrm{Var}[y]$: 1 for a perfect value function, 0 for a constant one."""
    variance = targets.var()
    return float("nan") if variance == 0 else float(1.0 - (targets - predictions).var() / variance)


# ### What the learner sees: normalised observations and rewards
#
# MuJoCo's observations mix joint angles (a fraction of a radian) with joint velocities (tens of
# radians a second), and they drift as the policy improves and the robot moves faster. A network
# learns poorly from inputs whose scales differ by orders of magnitude, so each observation is
# standardised with the running mean and variance of all observations seen so far. Rewards are
# divided by a running estimate of the scale of the return, so that the value function regresses to
# targets of about unit size whatever the task's reward scale. Both statistics are saved in the
# checkpoint with the weights. The observations' belong to the policy as much as its weights do and
# are used, frozen, at evaluation; the rewards' serve only the training.


class RunningMeanStd:
    r"""The mean and variance of every array seen so far, kept without keeping the arrays.

    Two sets of $n_A$ and $n_B$ samples with means $\mu_A, \mu_B$ and variances $\sigma^2_A,
    \sigma^2_B$ combine exactly (Chan, Golub and LeVeque, 1979, the parallel form of Welford's
    algorithm):

    $$\delta = \mu_B - \mu_A, \qquad n = n_A + n_B, \qquad \mu = \mu_A + \delta \frac{n_B}{n},$$

    $$\sigma^2 = \frac{n_A \sigma^2_A + n_B \sigma^2_B + \delta^2 n_A n_B / n}{n}.$$

    `merge` applies it to the statistics of another stream (kept by another process, say); `update`
    merges in the statistics of one batch, which at each step holds an observation from every env
    of every worker. The variance is that of the whole population seen (numpy's `var` with
    `ddof=0`), computed in float64.

    They start from nothing (a count of 0: the first merge replaces the mean and variance), or with
    `prior_count` > 0 as if that many samples of mean 0 and variance 1 had been seen already.
    """

    def __init__(self, shape: tuple[int, ...] = (), prior_count: int = 0):
        self.mean = np.zeros(shape, np.float64)
        self.var = np.ones(shape, np.float64)
        self.count = prior_count

    @classmethod
    def of(cls, batch: np.ndarray) -> RunningMeanStd:
        """The statistics of `batch` alone, over its first axis."""
        batch = np.asarray(batch, np.float64)
        stats = cls(batch.shape[1:])
        stats.mean, stats.var, stats.count = np.asarray(batch.mean(0)), np.asarray(batch.var(0)), batch.shape[0]
        return stats

    def update(self, batch: np.ndarray) -> None:
        self.merge(RunningMeanStd.of(batch))

    def merge(self, other: RunningMeanStd) -> None:
        if other.count == 0:
            return
        total = self.count + other.count
        delta = other.mean - self.mean
        squares = self.var * self.count + other.var * other.count + delta ** 2 * self.count * other.count / total
        self.mean = self.mean + delta * (other.count / total)
        self.var = squares / total
        self.count = total

    def state_dict(self) -> dict:
        return {"mean": torch.tensor(self.mean), "var": torch.tensor(self.var), "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.mean = state["mean"].numpy().astype(np.float64)
        self.var = state["var"].numpy().astype(np.float64)
        self.count = int(state["count"])


class ObservationNormalizer:
    r"""Observations standardised by running statistics: $\mathrm{clip}((o - \mu) / \sqrt{\sigma^2 + 10^{-8}}, -10, 10)$.

    The clip keeps one freak observation (a robot flung at great speed) from producing an input far
    outside anything the network was trained on. With `enabled=False` observations pass unchanged.

    The statistics start from nothing, and need no prior (unlike `RewardScaler`'s): each
    observation is folded in before it is normalised, and a sample lies within $\sqrt{n - 1}$
    standard deviations of the mean of $n$ that include it: the first observation of one env comes
    out 0, the second $\pm 1$.
    """

    def __init__(self, obs_dim: int, enabled: bool = True, clip: float = 10.0):
        self.stats = RunningMeanStd((obs_dim,))
        self.enabled = enabled
        self.clip = clip

    def update(self, obs: np.ndarray) -> None:
        if self.enabled:
            self.stats.update(obs)

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        """`obs` normalised with the statistics as they are now, as float32."""
        if not self.enabled:
            return np.asarray(obs, np.float32)
        normalized = (obs - self.stats.mean) / np.sqrt(self.stats.var + 1e-8)
        return np.clip(normalized, -self.clip, self.clip).astype(np.float32)

    def state_dict(self) -> dict:
        return self.stats.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.stats.load_state_dict(state)


class RewardScaler:
    r"""Rewards divided by the running standard deviation of the discounted return.

    Each env keeps $G_t = \gamma G_{t-1} + r_t$, restarted at every episode's end, and the reward
    becomes $r_t / \sqrt{\mathrm{Var}[G] + 10^{-8}}$, the variance over all $G_t$ seen so far.
    Dividing (not centring) keeps the sign of every reward, so the task stays the same task; only
    the value function's targets change scale. The episodic returns we log are the env's own,
    unscaled.

    **A prior and a clip**, with `prior_and_clip` (the trainer passes `reward_prior_and_clip`,
    off by default: over whole HalfCheetah-v5 runs, with the joint clip of the gradient, the plain
    scaler learned as well or better; the table under `Config`). The clip at $\pm 10$, as in
    baselines' `VecNormalize` and CleanRL's `ppo_continuous_action`, keeps one freak reward from
    becoming a target far out of the value function's reach. The statistics then start as if one
    return of mean 0 and variance 1 had been seen (`prior_count=1`). From no returns at all, the
    first step's variance is that of the first returns alone: with one env (one per rank under
    torchrun, say) it is 0, and the first reward is multiplied by $1/\sqrt{10^{-8}} = 10^4$; give
    a run of one env `--reward-prior-and-clip`. With the prior, one env's first reward $r$
    is divided by $\sqrt{1/2 + r^2/4}$, which keeps it within $\pm 2$, and the prior weighs as one
    return among all those that follow. baselines and gymnasium (whose `NormalizeReward` CleanRL
    uses, one per env) also start at mean 0 and variance 1, but with a count of $10^{-4}$: one env's
    first $r$ is then divided by about $0.01\sqrt{1 + r^2}$ (multiplied by 70 for $r = 1$), and only
    their clip at 10 holds it.

    On HalfCheetah it mattered more than observation normalisation (the table under `Config`): a
    cheetah that runs earns several points a step, so discounted returns reach the hundreds, and a
    value function that starts near 0 and whose weights Adam moves about $10^{-3}$ a step lags far
    behind such targets, leaving the advantages to its errors.
    """

    def __init__(self, num_envs: int, gamma: float, prior_and_clip: bool = True, clip: float = 10.0):
        self.gamma = gamma
        self.returns = np.zeros(num_envs, np.float64)
        self.stats = RunningMeanStd(prior_count=1 if prior_and_clip else 0)
        self.clip = clip if prior_and_clip else math.inf

    def __call__(self, rewards: np.ndarray, done: np.ndarray) -> np.ndarray:
        self.returns = self.returns * self.gamma + rewards
        self.stats.update(self.returns)
        self.returns[done] = 0.0
        scaled = rewards / np.sqrt(self.stats.var + 1e-8)
        return np.clip(scaled, -self.clip, self.clip).astype(np.float32)


# ### The rollout and the update
#
# Each update has two phases. **Sampling**: every env plays `num_steps` steps with the current
# policy while we store the normalised observations, the actions sampled, their log-probabilities,
# the values, the (scaled) rewards and the episode ends. **Updating**: GAE turns the rollout into
# advantages and returns; the policy takes one gradient step on the whole batch; then the value
# function is fitted to the returns with `value_epochs` passes of minibatches, so that the next
# batch's advantages rest on a value function that has caught up with the policy. Batches are
# small (8 envs x 32 steps) because the policy moves once per batch: the table under `Config` has
# the measurements.
#
# **Where the rollout lives.** The envs and the running statistics are on the CPU, the networks
# wherever `device` says, and on a GPU every crossing between the two costs a wait. So the rollout
# is kept on the host while it is played, and each step crosses the boundary once each way: the
# normalised observations go to the networks, and the actions come back together with their
# log-probabilities and values. Rewards and episode ends never leave the host during the rollout.
# The advantages are computed there too, a loop of `num_steps` small steps that costs microseconds
# on a CPU, and then the whole batch moves to the device once, for the update. On a CPU every one of
# these moves is free: the tensors are already where they are needed.
#
# The trainer steps many envs at once. What it needs of them is little: `num_envs`, `spaces` (an
# `EnvSpaces`), `reset()`, which returns the first observations, and `step(actions)`, which returns
# a `VecStep`. Part 2's `Workers` provide them at speed; the tests use small scripted ones.


class VecStep(NamedTuple):
    """One step of all envs at once. Where an episode ended the env was reset in the same step."""

    obs: np.ndarray
    """`[num_envs, obs_dim]` float64: the observation after the step (the first of a new episode where one ended)."""
    rewards: np.ndarray
    """`[num_envs]` float64: the env's own rewards."""
    terminated: np.ndarray
    """`[num_envs]` bool."""
    truncated: np.ndarray
    """`[num_envs]` bool."""
    final_obs: np.ndarray
    """`[num_envs, obs_dim]` float64: the last observation of each episode truncated in this step."""
    finished_episodes: list[tuple[int, float, int]]
    """`(env index, return, length)` of each episode that ended in this step."""


class NonFiniteError(RuntimeError):
    """The loss, a gradient or the weights became NaN or infinite."""


class Rollout(NamedTuple):
    """One rollout as `update_policy` reads it: tensors on the host, indexed `[step, env]`; episode
    ends are 0 or 1, as floats, for the arithmetic of `compute_gae`."""

    obs: torch.Tensor             # [num_steps, num_envs, obs_dim], normalised as the policy saw them
    actions: torch.Tensor         # [num_steps, num_envs, action_dim], the samples themselves (unclipped)
    log_probs: torch.Tensor       # [num_steps, num_envs], of the samples
    values: torch.Tensor
    next_values: torch.Tensor
    rewards: torch.Tensor
    terminated: torch.Tensor
    truncated: torch.Tensor


class Trainer:
    """VPG: the networks, the optimizer, the running statistics, the rollout storage and the update.

    `envs` are the envs it samples from (`num_envs`, `spaces`, `reset()` and `step()`, as the
    comment above says); `device` is where the networks run.
    """

    def __init__(self, config: Config, envs, device: torch.device):
        self.config = config
        self.envs = envs
        self.device = device
        self.num_updates = config.total_timesteps // self.steps_per_update
        spaces = envs.spaces
        self.action_low, self.action_high = spaces.action_low, spaces.action_high
        self.policy, self.value = (network.to(device) for network in make_networks(spaces, config))
        # One Adam over both networks, a parameter group (and learning rate) each. A step on the
        # value loss alone leaves the policy's parameters without gradients, and Adam skips them.
        # eps 1e-5 rather than 1e-8, as in the PPO reference implementation.
        self.optimizer = torch.optim.Adam([{"params": self.policy.parameters(), "lr": config.learning_rate},
                                           {"params": self.value.parameters(), "lr": config.value_learning_rate}],
                                          eps=1e-5, fused=True)
        self.obs_normalizer = ObservationNormalizer(spaces.obs_dim, enabled=config.normalize_observations)
        self.reward_scaler = (RewardScaler(envs.num_envs, config.gamma, config.reward_prior_and_clip)
                              if config.normalize_rewards else None)
        self.update = 0
        self.global_step = 0
        # The rollout's storage, on the host: numpy arrays, which the envs' arrays are copied into
        # without a call to torch, and which `torch.from_numpy` shows to torch without a copy.
        shape = (config.num_steps, envs.num_envs)
        self.storage = Rollout(np.zeros(shape + (spaces.obs_dim,), np.float32),
                               np.zeros(shape + (spaces.action_dim,), np.float32),
                               *(np.zeros(shape, np.float32) for _ in range(6)))
        self.rollout = Rollout(*(torch.from_numpy(array) for array in self.storage))  # torch's view of it
        self.next_obs = np.zeros((envs.num_envs, spaces.obs_dim), np.float32)
        # Where each step's actions, log-probabilities and values land together, on the host: an
        # array, and torch's view of it.
        self.chosen = np.zeros((envs.num_envs, spaces.action_dim + 2), np.float32)
        self.chosen_tensor = torch.from_numpy(self.chosen)
        self.needs_reset = True
        self.finished_episodes: list[tuple[int, float, int]] = []

    @property
    def steps_per_update(self) -> int:
        """The env steps that one update consumes: its batch."""
        return self.config.batch_size

    def _observe(self, raw_obs: np.ndarray) -> None:
        """Fold the new observations into the running statistics, then normalise them for the policy."""
        self.obs_normalizer.update(raw_obs)
        self.next_obs[:] = self.obs_normalizer(raw_obs)

    def sample_actions(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        r"""$a \sim \pi_\theta(\cdot|s)$ for each observation, with $\log \pi_\theta(a|s)$ and $V(s)$.

        Everything here runs on the device, and nothing waits for it."""
        mean, std = self.policy(obs)
        actions = gaussian_sample(mean, std)
        return actions, gaussian_log_prob(mean, std, actions), self.value(obs)

    def values_of(self, obs: np.ndarray) -> np.ndarray:
        """$V(s)$ of a batch of normalised observations on the host."""
        return self.value(torch.from_numpy(obs).to(self.device)).cpu().numpy()

    @torch.inference_mode()
    def collect_rollout(self) -> Rollout:
        """Play `num_steps` steps in every env with the current policy."""
        storage = self.storage
        if self.needs_reset:
            self._observe(self.envs.reset())
            self.needs_reset = False
        self.finished_episodes = []
        truncations = []
        for t in range(self.config.num_steps):
            # Step $t$: store $s_t$, sample $a_t$, and keep $\log \pi_\theta(a_t|s_t)$ and $V(s_t)$.
            # The observations cross to the device, and the three come back in one copy.
            storage.obs[t] = self.next_obs
            obs = torch.from_numpy(storage.obs[t]).to(self.device, non_blocking=True)
            actions, log_probs, values = self.sample_actions(obs)
            self.chosen_tensor.copy_(torch.cat([actions, log_probs.unsqueeze(-1), values.unsqueeze(-1)], -1))
            storage.actions[t], storage.log_probs[t], storage.values[t] = (
                self.chosen[:, :-2], self.chosen[:, -2], self.chosen[:, -1])
            # The env gets the action clipped to its bounds; we keep the sample itself, since its
            # log-probability is the one the gradient needs. Seen this way the clip is part of the
            # environment and the estimate stays unbiased; storing the clipped action instead would
            # take the gradient of the log-density of a point the policy did not sample.
            # (Fujita and Maeda, 2018, "Clipped action policy gradient", lower its variance further.)
            step = self.envs.step(np.clip(storage.actions[t].astype(np.float64), self.action_low, self.action_high))
            rewards = step.rewards
            if self.reward_scaler is not None:
                rewards = self.reward_scaler(rewards, step.terminated | step.truncated)
            storage.rewards[t], storage.terminated[t], storage.truncated[t] = rewards, step.terminated, step.truncated
            # A truncated episode's final observation is normalised with the statistics as they
            # stand, before this step's observations join them; it never joins them itself.
            truncations += [(t, env, self.obs_normalizer(step.final_obs[env])) for env in np.flatnonzero(step.truncated)]
            self.finished_episodes += step.finished_episodes
            self._observe(step.obs)
        self.global_step += self.steps_per_update

        # $V(s_{t+1})$ for every step: the next stored value, the value after the rollout for the
        # last step, and the value of the final observation where an episode was truncated.
        storage.next_values[:-1] = storage.values[1:]
        storage.next_values[-1] = self.values_of(self.next_obs)
        if truncations:
            final_values = self.values_of(np.stack([obs for _, _, obs in truncations]))
            for (t, env, _), value in zip(truncations, final_values):
                storage.next_values[t, env] = value
        return self.rollout

    def normalize_advantages(self, advantages: torch.Tensor) -> torch.Tensor:
        """The batch's advantages, standardised by `normalize_advantages` (Part 4 widens the batch)."""
        return normalize_advantages(advantages)

    def compute_gradients(self, loss: torch.Tensor, parameters: list[nn.Parameter]) -> None:
        """The gradient of `loss` in the `.grad` of each of `parameters`, all that `loss` depends on."""
        loss.backward()

    def gradient_step(self, loss: torch.Tensor, networks: list[nn.Module]) -> None:
        """One Adam step on `loss` for the parameters of `networks`, their joint gradient clipped to
        `max_grad_norm` (each network's on its own with `clip_each_network`); refused when a gradient
        is NaN or infinite.

        The joint clip (CleanRL's, whose actor and critic share an optimizer) lets a value function
        far off its targets shrink the policy's gradient with its own: in
        `tests/test_vpg_continuous_trainer.py`, a value 300 off its targets shrank the policy's
        gradient to about 1/100 of its norm and its step, after Adam, to about a quarter, where a
        clip of each network apart left it as it was. Yet over whole runs the joint clip learned
        better: HalfCheetah-v5 at 1M steps, 2,871 against 2,267 (seeds 1 to 3; the table under
        `Config`). Early in a run the joint clip damps the policy's first, noisiest steps too, which
        may be what pays.

        The refusal waits for nothing: fused Adam takes no step while its `found_inf` is 1 (the
        hook that `torch.amp.GradScaler` uses to skip steps), and the flag, once raised, stays
        raised for the rest of the update, which reads it once, at its end.
        """
        self.optimizer.zero_grad(set_to_none=True)
        parameters = [parameter for network in networks for parameter in network.parameters()]
        self.compute_gradients(loss, parameters)
        clipped = [list(network.parameters()) for network in networks] if self.config.clip_each_network else [parameters]
        for group in clipped:
            grad_norm = nn.utils.clip_grad_norm_(group, self.config.max_grad_norm)
            self.optimizer.found_inf.logical_or_(~grad_norm.isfinite())
        self.optimizer.step()

    def update_policy(self, rollout: Rollout) -> dict[str, float]:
        """One VPG update on `rollout`: a policy-gradient step, then the value function's fit."""
        config = self.config
        learning_rate = linear_schedule(config.learning_rate, self.update, self.num_updates)
        value_learning_rate = linear_schedule(config.value_learning_rate, self.update, self.num_updates)
        self.optimizer.param_groups[0]["lr"] = learning_rate
        self.optimizer.param_groups[1]["lr"] = value_learning_rate
        self.optimizer.found_inf = torch.zeros((), device=self.device)  # see `gradient_step`

        # The advantages, on the host where the rollout is; then the batch, flattened from
        # [steps, envs] into one batch of transitions, crosses to the device in one go.
        with torch.no_grad():
            advantages, returns = compute_gae(rollout.rewards, rollout.values, rollout.next_values,
                                              rollout.terminated, rollout.truncated, config.gamma, config.gae_lambda)
        explained = explained_variance(rollout.values.flatten(), returns.flatten())
        obs, actions, old_log_probs, advantages, returns = (
            x.flatten(0, 1).to(self.device, non_blocking=True)
            for x in (rollout.obs, rollout.actions, rollout.log_probs, advantages, returns))
        advantages = self.normalize_advantages(advantages)

        # The policy-gradient step: one, on the whole batch. The value term of the loss reaches only
        # the value network's parameters (the networks share none); by default their gradients are
        # clipped together, so a value far off its targets shrinks the policy's step too (with
        # `clip_each_network` it cannot): the value term is the first step of the value function's
        # fit, which the minibatch passes below finish.
        mean, std = self.policy(obs)
        log_probs = gaussian_log_prob(mean, std, actions)
        terms = vpg_loss(log_probs, old_log_probs, advantages, self.value(obs), returns, gaussian_entropy(std), config)
        self.gradient_step(terms["loss"], [self.policy, self.value])
        with torch.no_grad():
            # How far the step moved the policy on this batch: $\mathrm{KL}(\pi_\text{old} \| \pi_\theta)$
            # estimated with $\mathbb E[(r - 1) - \log r]$, where $r = \pi_\theta / \pi_\text{old}$.
            log_ratio = gaussian_log_prob(*self.policy(obs), actions) - old_log_probs
            approx_kl = ((log_ratio.exp() - 1.0) - log_ratio).mean()

        # Fitting the value function: regression to the returns, in shuffled minibatches.
        for epoch in range(config.value_epochs):
            order = torch.randperm(config.batch_size, device=self.device)
            for start in range(0, config.batch_size, config.minibatch_size):
                batch = order[start:start + config.minibatch_size]
                value_loss = (self.value(obs[batch]) - returns[batch]).pow(2).mean()
                self.gradient_step(config.vf_coef * value_loss, [self.value])
        # The update's one wait for the device: every term of the loss (whatever entries its result
        # has), how far the step moved the policy, and whether the gradients and the weights stayed
        # finite. A loss can stay finite while a step sends a weight to infinity, hence the weights.
        measured = {**terms, "approx_kl": approx_kl}
        weights = nn.utils.get_total_norm([*self.policy.parameters(), *self.value.parameters()])
        gradients_finite, weights_finite, *values = torch.stack(
            [self.optimizer.found_inf == 0, weights.isfinite(), *(value.detach().float() for value in measured.values())]
        ).tolist()
        if not (gradients_finite and weights_finite):
            raise NonFiniteError(f"{'the loss or its gradient' if not gradients_finite else 'the weights'} became NaN "
                                 f"or infinite in update {self.update + 1}; "
                                 f"{'no step was taken from then on' if not gradients_finite else 'the run stops'}")
        self.update += 1
        return {**dict(zip(measured, values)), "explained_variance": explained,
                "learning_rate": learning_rate, "value_learning_rate": value_learning_rate}

    # ### The loop of training
    #
    # Sample a rollout, update on it (the advantages are computed there), report, and again, until
    # the budget of steps is spent. What a real run adds after each update, its logs and
    # checkpoints, comes in through `after_update` from Part 3; a student's own run can be as short
    # as `Trainer(config, envs, device).train(print)`.
    # A real run also times the two calls of the loop, in Part 3's `RunTrainer`, which wraps
    # `collect_rollout` and `update_policy` by name: a fork that renames them renames them there too.

    def train(self, after_update: typing.Callable[[dict], None] = lambda stats: None) -> None:
        """Update until `total_timesteps` env steps are played, handing each update's statistics to `after_update`."""
        while self.update < self.num_updates:
            stats = self.update_policy(self.collect_rollout())
            after_update(stats)


# ## Part 2: Sampling at speed
#
# ### The workers
#
# The learner wants a batch of observations from many envs at every step. `Workers` steps the envs
# in other processes, several per process, and drives them over `Pipe`s. Three choices make it fast
# and safe:
#
# * **Everything travels through shared memory.** Each worker writes its envs' observations,
#   rewards and episode ends straight into arrays the main process reads, and reads its actions
#   from one; the pipe carries only a one-word command and a one-word answer. A MuJoCo step takes
#   tens of microseconds, so the cost of pickling arrays at every step would show.
# * **Same-step auto-reset.** When an episode ends, the worker resets its env at once and the
#   observation it writes is the first of the next episode, so every step returns a usable
#   observation for every env. The last observation of a truncated episode is written apart
#   (`final_obs`), since its value is needed to bootstrap.
# * **Failures are loud.** An exception in a worker is sent back with its traceback and raised in
#   the main process as a `WorkerError`; a worker that dies (killed by the kernel, say) closes its
#   pipe, which the main process notices at once instead of waiting forever. Workers ignore Ctrl-C,
#   which is the main process's to handle, and exit by themselves if the main process dies.


def env_seeds(seed: int, count: int, first_update: int = 0) -> np.ndarray:
    """`count` distinct, independent seeds for the envs of a run seeded with `seed`.

    A run resumed at a later update draws new ones, so it does not replay the episodes the first
    part of the run began with.
    """
    entropy = seed if first_update == 0 else [seed, first_update]
    return np.random.SeedSequence(entropy).generate_state(count)


class WorkerError(RuntimeError):
    """A worker process failed: the message carries its traceback, or how it died."""


def shared_arrays(context, num_envs: int, spaces: EnvSpaces) -> dict[str, tuple]:
    """The blocks of shared memory behind `VecStep`, one row per env, as `(block, shape, dtype)`.

    The blocks are passed to each worker when it starts (this works under `fork` and `spawn`
    alike), and each side makes its own numpy views of them with `numpy_views`. Observations stay
    float64, as MuJoCo computes them, so that the running statistics see them unrounded.
    """
    rows = (num_envs,)
    layout = {"obs": ((num_envs, spaces.obs_dim), np.float64), "final_obs": ((num_envs, spaces.obs_dim), np.float64),
              "actions": ((num_envs, spaces.action_dim), np.float64), "rewards": (rows, np.float64),
              "terminated": (rows, np.bool_), "truncated": (rows, np.bool_), "done": (rows, np.bool_),
              "episode_return": (rows, np.float64), "episode_length": (rows, np.int64)}
    return {name: (context.RawArray(ctypes.c_uint8, math.prod(shape) * np.dtype(dtype).itemsize), shape, dtype)
            for name, (shape, dtype) in layout.items()}


def numpy_views(blocks: dict[str, tuple]) -> dict[str, np.ndarray]:
    return {name: np.frombuffer(block, dtype=dtype, count=math.prod(shape)).reshape(shape)
            for name, (block, shape, dtype) in blocks.items()}


# The signals that stop a run: Ctrl-C, `kill` (and SLURM's `scancel`), a terminal that hangs up. Sent to the
# whole process group, as a terminal and `kill -- -PGID` send them, they reach the workers too, which ignore them.
STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


def run_worker(connection: Connection, env_id: str, seeds: np.ndarray, first_env: int,
               blocks: dict[str, tuple], max_episode_steps: int | None, make_task=Task) -> None:
    """The loop of one worker process: it steps envs `first_env, first_env + 1, ...`.

    It answers the main process's `reset` and `step` with `ok` once the arrays of its envs are
    written, or with `error` and its traceback; on `close` it returns, closing its envs.
    """
    for signum in STOP_SIGNALS:  # the main process's to answer, even when sent to the whole process group
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # `Workers` starts it with them blocked
    parent = mp.parent_process()
    tasks: list[Task] = []
    try:
        rows = slice(first_env, first_env + len(seeds))
        arrays = {name: array[rows] for name, array in numpy_views(blocks).items()}
        for i, seed in enumerate(seeds):
            tasks.append(make_task(env_id, seed, max_episode_steps, obs=arrays["obs"][i]))
        connection.send_bytes(b"ok")
        while True:
            ready = wait_for_any([connection] + ([parent.sentinel] if parent is not None else []))
            if connection not in ready:
                return  # the main process is gone: leave no orphan behind
            command = connection.recv_bytes()
            if command == b"close":
                return
            for i, task in enumerate(tasks):
                if command == b"reset":
                    task.reset()
                    continue
                step = task.step(arrays["actions"][i])
                arrays["rewards"][i] = step.reward
                arrays["terminated"][i] = step.terminated
                arrays["truncated"][i] = step.truncated
                arrays["done"][i] = step.terminated or step.truncated
                if arrays["done"][i]:
                    arrays["episode_return"][i], arrays["episode_length"][i] = step.episode_return, step.episode_length
                    if step.truncated:
                        arrays["final_obs"][i] = task.obs
                    task.reset()
            connection.send_bytes(b"ok")
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return
    except BaseException:
        try:
            connection.send_bytes(b"error " + traceback.format_exc().encode())
        except (OSError, ValueError):
            pass
    finally:
        for task in tasks:
            task.close()


# `ppo_atari.py` holds a near copy of `Workers`, `run_worker` and `shared_arrays`. They differ where
# the environments do: here each env is a `Task` whose spaces the caller gives, observations travel
# as `float64` and the envs are seeded anew from the update a run resumes at; there the games come
# from `make_env`, one of which tells the shape of the frames and the number of actions, frames
# travel as `uint8`, and an episode's result is the game's score.


class Workers:
    """`num_envs` envs stepped by `num_workers` processes; the vector environment of the trainer.

    `reset()` starts every env and returns the observations; `step(actions)` plays one step of
    every env and returns a `VecStep`, whose arrays are views of shared memory, valid until the
    next step. Use it as a context manager, or call `close()`. Each env is made by `make_task`
    (`Task`, unless Part 3 records one; under `spawn` it must be importable by the workers).
    """

    def __init__(self, env_id: str, num_envs: int, num_workers: int, seed: int, spaces: EnvSpaces,
                 max_episode_steps: int | None = None, start_method: str | None = None, first_update: int = 0,
                 first_env: int = 0, make_task=Task):
        context = mp.get_context(start_method)
        self.num_envs = num_envs
        self.spaces = spaces
        blocks = shared_arrays(context, num_envs, spaces)
        self.arrays = numpy_views(blocks)
        self.processes: list[mp.process.BaseProcess] = []
        self.connections: list[Connection] = []
        # Envs `first_env, first_env + 1, ...` of the run: each rank of a distributed run steps its own.
        seeds = env_seeds(seed, first_env + num_envs, first_update)[first_env:]
        # Started with the stop signals blocked in this thread (the mask survives fork and exec): one sent while
        # they start reaches neither them, before they ignore it, nor this process until they have started. If
        # another thread of the process takes it meanwhile, it is heard at once, and those started are closed.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            for index, envs in enumerate(np.array_split(np.arange(num_envs), num_workers)):
                ours, theirs = context.Pipe()
                process = context.Process(target=run_worker, name=f"vpg_continuous-worker-{index}", daemon=True,
                                          args=(theirs, env_id, seeds[envs], int(envs[0]), blocks, max_episode_steps,
                                                make_task))
                self.processes.append(process)  # first: a signal heard as it starts finds it here, to close
                self.connections.append(ours)
                process.start()
                theirs.close()
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            self._receive()
        except BaseException:
            self.close()
            raise
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    def reset(self) -> np.ndarray:
        self._send(b"reset")
        self._receive()
        return self.arrays["obs"]

    def step(self, actions: np.ndarray) -> VecStep:
        a = self.arrays
        a["actions"][:] = actions
        self._send(b"step")
        self._receive()
        finished = [(int(env), float(a["episode_return"][env]), int(a["episode_length"][env]))
                    for env in np.flatnonzero(a["done"])]
        return VecStep(a["obs"], a["rewards"], a["terminated"], a["truncated"], a["final_obs"], finished)

    def _send(self, command: bytes) -> None:
        for index, connection in enumerate(self.connections):
            try:
                connection.send_bytes(command)
            except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
                raise self._death(index) from None

    def _receive(self) -> None:
        """Wait for every worker's answer."""
        for index, connection in enumerate(self.connections):
            try:
                answer = connection.recv_bytes()
            except (EOFError, ConnectionResetError, OSError):
                raise self._death(index) from None
            if answer.startswith(b"error"):
                raise WorkerError(f"worker {index} failed; its traceback:\n{answer[6:].decode().rstrip()}")

    def _death(self, index: int) -> WorkerError:
        process = self.processes[index]
        process.join(timeout=5)
        code = process.exitcode
        if code is not None and code < 0:
            how = f"killed by signal {signal.Signals(-code).name}"
        else:
            how = f"exit code {code}"
        return WorkerError(f"worker {index} (pid {process.pid}) died unexpectedly ({how})")

    def close(self) -> None:
        """Stop every worker; those that do not stop in time are killed (they ignore SIGTERM)."""
        for connection in self.connections:
            try:
                connection.send_bytes(b"close")
            except (OSError, ValueError):
                pass
        for process in self.processes:
            if process.pid is None:  # never started: a signal came first
                continue
            process.join(timeout=3)
            if process.is_alive():
                process.kill()
                process.join()
        for connection in self.connections:
            connection.close()
        self.processes, self.connections = [], []

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


# ## Part 3: Running it for real
#
# What turns the algorithm into a program a researcher runs for days: the command line and its
# checks, the choices that make it fast on the machine at hand, checkpoints, logs and a progress
# line, clean stops on Ctrl-C, evaluation with videos, and `main`. Nothing here changes what Part 1
# computes: each piece wraps it or feeds it.


# ### The command line
#
# The command line sets the fields of Part 1's `Config` and those of one invocation: how many
# processes step the envs and how they start, where the networks run, where the run's files go, how
# often it writes a checkpoint, which checkpoint to resume or evaluate and how, and where the run is
# tracked. `RunConfig` adds the second kind to the first; every flag is one of its
# fields, with its documentation as the help text. A resumed run takes its hyperparameters from the
# checkpoint, but the settings of its invocation from the command line (or their defaults). A
# mistake in what the user asked for is one line on stderr and exit status 2, before any process
# starts.


@dataclass
class RunConfig(Config):
    """The settings of one invocation, added to those of the agent and its training (`Config`)."""

    num_workers: int = 0
    """Processes that step the envs (0: one per CPU core, at most one per env)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the networks run (`auto`: the CPU, which is faster for these small networks; see `choose_device`)."""
    start_method: Literal["default", "fork", "spawn", "forkserver"] = "default"
    """How worker processes are started (`default`: the platform's own)."""
    run_dir: str | None = None
    """Where TensorBoard events and checkpoints go (default: runs/<env>__<seed>__<time>)."""
    checkpoint_every: int = 100
    """Write checkpoint.pt every this many updates (and always at the end and on Ctrl-C)."""
    resume: str | None = None
    """Continue training from this checkpoint; flags given override its settings (a larger --total-timesteps extends it)."""
    eval: str | None = None
    """Play `eval_episodes` whole episodes with the policy in this checkpoint and print their return."""
    eval_episodes: int = 10
    """Episodes to play with `--eval`."""
    eval_deterministic: bool = False
    """With `--eval`, act with the policy's mean action instead of sampling as in training."""
    capture_video: bool = False
    """Write H.264 mp4s to <run dir>/videos: in training, episodes 0, 1, 8, 27, ... of the first env; in --eval, all."""
    track: bool = False
    """Send the run to Weights & Biases, as CleanRL does: its scalars and videos (needs `pip install wandb`)."""
    wandb_project_name: str = "policy-gradients"
    """The Weights & Biases project that `--track` sends the run to."""
    wandb_entity: str | None = None
    """The Weights & Biases team or user that `--track` sends the run to (default: your own)."""


def field_docs(cls: type) -> dict[str, str]:
    """The string literal under each field of a dataclass and of the dataclasses it extends, read from their source."""
    docs = {}
    for klass in reversed([klass for klass in cls.__mro__ if dataclasses.is_dataclass(klass)]):
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for node, following in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant):
                docs[node.target.id] = " ".join(str(following.value.value).split())
    return docs


def integer(text: str) -> int:
    """An integer, also written as `10_000_000` or `1e7`. argparse names the type in its message by this
    name: "invalid integer value"."""
    value = float(text)
    if not value.is_integer():
        raise ValueError(text)
    return int(text) if text.lstrip("+-").replace("_", "").isdigit() else int(value)


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a mistake is one line on stderr and exit status 2, without the usage block."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def flag(name: str) -> str:
    """The flag of a field: `num_envs` is `--num-envs`."""
    return "--" + name.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    """The command line, one flag per field of `RunConfig` (and so of `Config`).

    Flags the user did not type are absent from the parsed namespace (`argparse.SUPPRESS`), so a
    resumed run can tell an explicit `--total-timesteps` from the default.
    """
    parser = OneLineParser(prog="vpg_continuous.py", argument_default=argparse.SUPPRESS,
                           description="Vanilla policy gradient for continuous control, annotated. See the module docstring.")
    docs, hints = field_docs(RunConfig), typing.get_type_hints(RunConfig)
    for field in dataclasses.fields(RunConfig):
        kind, help_text = hints[field.name], f"{docs.get(field.name, '')} (default: {field.default})"
        if kind is bool:
            parser.add_argument(flag(field.name), action=argparse.BooleanOptionalAction, help=help_text)
        elif typing.get_origin(kind) is Literal:
            parser.add_argument(flag(field.name), choices=typing.get_args(kind), help=help_text)
        else:
            kind = next(t for t in typing.get_args(kind) or [kind] if t is not type(None))
            parser.add_argument(flag(field.name), type=integer if kind is int else kind,
                                metavar=field.name.upper(), help=help_text)
    return parser


# What each number of the command line must be, as (fields, the test, its words).
NUMBER_RULES = [
    (("total_timesteps", "num_envs", "num_steps", "value_epochs", "num_minibatches", "checkpoint_every",
      "eval_episodes", "learning_rate", "value_learning_rate", "max_grad_norm", "max_episode_steps"),
     lambda value: value is None or value > 0, "positive"),
    (("ent_coef", "vf_coef", "num_workers"), lambda value: value >= 0, "not negative"),
    (("gamma", "gae_lambda"), lambda value: 0 <= value <= 1, "in [0, 1]"),
    (("seed",), lambda value: 0 <= value <= 2**32 - 1, "in [0, 2**32 - 1]"),
]


def check_config(config: RunConfig) -> None:
    """Refuse settings that cannot work, before any process starts."""
    # Every number first: a NaN fails the rules below only as a number out of range would ("must be
    # positive, not nan"), and an inf, or a number past float32's largest (the network computes in
    # float32), may pass them and fail only at the first update.
    for name, value in vars(config).items():
        if isinstance(value, float) and not abs(value) <= torch.finfo(torch.float32).max:
            raise ConfigError(f"{flag(name)} must be a finite number in float32's range (to 3.4e38), not {value}")
    for names, holds, words in NUMBER_RULES:
        for name in names:
            if not holds(getattr(config, name)):
                raise ConfigError(f"{flag(name)} must be {words}, not {getattr(config, name)}")
    problems = [
        (config.run_dir is not None and Path(config.run_dir).exists() and not Path(config.run_dir).is_dir(),
         f"--run-dir {config.run_dir} is a file, not a directory"),
        (config.batch_size % config.num_minibatches, f"the batch of {config.num_envs} envs x {config.num_steps} "
         f"steps = {config.batch_size} does not split into {config.num_minibatches} minibatches"),
        (config.batch_size < 2, "a batch needs at least 2 transitions (--num-envs x --num-steps) to normalise advantages"),
        (config.num_workers > config.num_envs, f"--num-workers {config.num_workers} is more than --num-envs "
         f"{config.num_envs}"),
        (config.eval is not None and config.resume is not None, "--eval and --resume cannot be used together"),
    ]
    for problem, words in problems:
        if problem:
            raise ConfigError(words)


def resolve_env_id(name: str) -> str:
    """The gymnasium id that `name` stands for, or a `ConfigError` suggesting close names.

    A full id stands for itself; a name without its version (`HalfCheetah`, any case) for its
    newest version (`HalfCheetah-v5`).
    """
    if name in gym.registry:
        return name
    # Each id and each name without its version, in lower case; in order of version, so that a name
    # is written last for its newest version.
    known = {key.lower(): env_id for env_id, spec in sorted(gym.registry.items(), key=lambda item: item[1].version or 0)
             for key in (env_id, gym.envs.registration.get_env_id(spec.namespace, spec.name, None))}
    if found := known.get(name.lower()):
        return found
    close = difflib.get_close_matches(name, sorted(gym.registry), n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(close)}?" if close else "; ids look like HalfCheetah-v5 or Pendulum-v1"
    raise ConfigError(f"unknown environment {name!r}{hint}")


def parse_config(argv: list[str] | None) -> tuple[RunConfig, dict | None]:
    """The configuration of this invocation and the checkpoint it names, if any.

    A resumed or evaluated run starts from the checkpoint's hyperparameters; flags given on the
    command line override them (to extend `--total-timesteps`, say).
    """
    given = vars(build_parser().parse_args(argv))
    resume, evaluated = given.get("resume"), given.get("eval")  # either may be "", a path that is no file
    checkpoint = load_checkpoint(resume if evaluated is None else evaluated) if (resume is None) != (evaluated is None) else None
    fields = {field.name for field in dataclasses.fields(Config)}
    base = {name: value for name, value in checkpoint["config"].items() if name in fields} if checkpoint else {}
    config = RunConfig(**{**base, **given})
    try:
        check_config(config)
    except TypeError:  # a setting of the wrong kind: only an edited checkpoint holds one, the command line's are parsed
        raise ConfigError(f"checkpoint {config.resume or config.eval} holds settings of the wrong kind") from None
    if config.resume is not None and base["num_envs"] * base["num_steps"] != config.batch_size:
        raise ConfigError(f"a resumed run keeps its batch of {base['num_envs'] * base['num_steps']} "
                          f"transitions (--num-envs x --num-steps)")
    return config, checkpoint


# ### Hardware choices
#
# The only choices in this script that depend on the machine rather than on the algorithm, made
# once, here, before the trainer is built: where the networks run, and on how many threads.


def choose_device(requested: str, local_rank: int = 0) -> torch.device:
    r"""The device the networks run on; and one thread for torch, for the whole process.

    `auto` is the CPU even where CUDA exists. At each sampling step the two networks see a batch of
    `num_envs` observations while the envs wait for the actions; on the 2-core CPU the first version
    of this page was measured on, that forward pass took 0.13 to 0.3 ms on one thread. It is a dozen
    small operations, each of which would be a kernel launch of several microseconds on a GPU. An
    update is 41 gradient steps (one on the batch of 256, forty on minibatches of 64), about 23 ms
    in all on an AMD EPYC, and the updates are half of a run's time (89 s of the 2.8 minutes of 1M
    steps; the README has the command), again bound by the overhead per operation rather than by
    arithmetic. So there is little for a GPU to win at these sizes; `--device cuda` is for forks
    with much larger batches or networks, and there the rollout crosses to the GPU once each way per
    step and an update waits for it once (Part 1). (No GPU was at hand to time the crossover for
    this page.) Under torchrun, `cuda` gives each rank the GPU of its `LOCAL_RANK`.

    One thread, because the networks are too small to share out, and the idle threads of a parallel
    section spin on cores the workers need. On the first version of this page, a step of value
    fitting (a minibatch of 64) took 1.5 ms on one thread and 11 to 22 ms on two, on a 2-core machine
    with other work running (today's update takes about 0.6 ms a step on an idle one). On a GPU the
    host's share is launching kernels and GAE.
    """
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for, but torch finds no CUDA device")
    torch.set_num_threads(1)
    if requested != "cuda":
        return torch.device("cpu")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


@contextlib.contextmanager
def timer(seconds: dict[str, float], key: str):
    """Add the seconds that the block takes to `seconds[key]`: the split of each update's time that
    the log shows, counted by `RunWorkers` and `RunTrainer`, so that the code they time holds no timer."""
    started = time.perf_counter()
    try:
        yield
    finally:
        seconds[key] += time.perf_counter() - started


class RunTrainer(Trainer):
    """The trainer of a run on one process: Part 1's `Trainer`, its two phases timed for the log
    (`seconds`). Part 4's `DataParallelRunTrainer` is this class on several ranks."""

    def __init__(self, config: RunConfig, envs, device: torch.device):
        self.seconds = {"sampling": 0.0, "update": 0.0}
        super().__init__(config, envs, device)

    def collect_rollout(self) -> Rollout:
        with timer(self.seconds, "sampling"):
            return super().collect_rollout()

    def update_policy(self, rollout: Rollout) -> dict[str, float]:
        with timer(self.seconds, "update"):
            return super().update_policy(rollout)


# ### Checkpoints
#
# A checkpoint holds all the state of training: both networks, Adam's moments, the running
# statistics of observations and rewards, the counters, the random state of every rank and the
# configuration. The envs themselves restart on resume; their simulator state is not saved. It is
# written to a temporary file of this process's own, then renamed over the last one, so a crash
# never leaves half a file; a write that fails (on a full disk, say) is one line naming the
# checkpoint that is still whole. It is read with `weights_only=True`: tensors and plain data.


CHECKPOINT_FORMAT = "vpg_continuous/1"
CHECKPOINT_FIELDS = {"config": dict, "env_id": str, "update": int, "global_step": int, "ranks": int, "policy": dict,
                     "value": dict, "optimizer": dict, "obs_normalizer": dict, "reward_scaler": (dict, type(None)),
                     "torch_rng": list, "cuda_rng": list}  # each field, and the kind of its value


def checkpoint_state(trainer: Trainer, env_id: str, ranks: Ranks) -> dict:
    """The trainer's state as a checkpoint holds it, marked with the env it learned, so that another
    env's run refuses it. With several ranks every rank must call it: it gathers their random states."""
    cuda = trainer.device.type == "cuda"
    return {"format": CHECKPOINT_FORMAT, "config": dataclasses.asdict(trainer.config), "env_id": env_id,
            "update": trainer.update, "global_step": trainer.global_step, "ranks": ranks.size,
            "policy": trainer.policy.state_dict(), "value": trainer.value.state_dict(),
            "optimizer": trainer.optimizer.state_dict(), "obs_normalizer": trainer.obs_normalizer.state_dict(),
            "reward_scaler": trainer.reward_scaler.stats.state_dict() if trainer.reward_scaler else None,
            "torch_rng": ranks.gather(torch.get_rng_state()),
            "cuda_rng": ranks.gather(torch.cuda.get_rng_state(trainer.device) if cuda else torch.zeros(0, dtype=torch.uint8))}


def restore_checkpoint(trainer: Trainer, checkpoint: dict, path: str, ranks: Ranks) -> None:
    """Put `trainer` back in the state `checkpoint_state` saved; each rank takes its own random state."""
    restore_networks({"policy": trainer.policy, "value": trainer.value}, checkpoint, path)
    # Adam's settings come with its moments; the update needs the fused kernel, which checkpoints
    # written before it used name as the default one.
    saved = checkpoint["optimizer"]
    trainer.optimizer.load_state_dict({**saved, "param_groups": [{**group, "fused": True} for group in saved["param_groups"]]})
    trainer.obs_normalizer.load_state_dict(checkpoint["obs_normalizer"])
    if trainer.reward_scaler is not None and checkpoint["reward_scaler"] is not None:
        trainer.reward_scaler.stats.load_state_dict(checkpoint["reward_scaler"])
    trainer.update, trainer.global_step = checkpoint["update"], checkpoint["global_step"]
    torch.set_rng_state(checkpoint["torch_rng"][ranks.rank])
    if trainer.device.type == "cuda" and len(checkpoint["cuda_rng"][ranks.rank]):
        torch.cuda.set_rng_state(checkpoint["cuda_rng"][ranks.rank], trainer.device)


class WriteFailed(Exception):
    """A file of the run could not be written (a full disk, say); the last checkpoint is whole."""


@contextlib.contextmanager
def written(path: Path, *checkpoints: Path | str | None):
    """Raise an `OSError` of the block again as `WriteFailed`, in one line: the system's words ("no space left on
    device", "disk quota exceeded"), `path`, what could not be written, and the last of `checkpoints` there is."""
    try:
        yield
    except OSError as error:
        reason = error.strerror or str(error)
        last = last_checkpoint(*checkpoints)
        raise WriteFailed(f"{reason[:1].lower()}{reason[1:]} while writing {path}; "
                          + (f"the last checkpoint is {last}" if last else "none was written")) from None


def save_checkpoint(state: dict, path: Path) -> None:
    """Write `state` to `path` atomically: to a temporary file, removed if the write fails, then renamed over it."""
    serialized = io.BytesIO()  # in memory first: written by torch, a full disk is a RuntimeError of its zip writer
    torch.save(state, serialized)
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with written(path, path):
            with open(temporary, "wb") as file:
                file.write(serialized.getbuffer())
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)  # what a failure left behind; after the rename, there is none


def last_checkpoint(*paths: Path | str | None) -> Path | None:
    """The first of `paths` that is a file: the checkpoint a message may name."""
    return next((Path(path) for path in paths if path is not None and Path(path).is_file()), None)


def writable_dir(path: Path) -> Path:
    """`path`, a directory made if need be, in which this process can make a file; a `ConfigError`
    naming the reason if not (no permission, a file on its path, a read-only file system)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as error:
        raise ConfigError(f"cannot write in {path}: {error.strerror}") from None
    return path


@contextlib.contextmanager
def run_dir_lock(run_dir: Path):
    """Hold the run directory for this process: a second run in it is a `ConfigError` naming the first.

    The lock is `flock` on a file inside the directory; the kernel drops it when the process ends,
    however it ends, so a crashed run never leaves a stale lock behind.
    """
    with open(writable_dir(run_dir) / "run.lock", "a+") as file:
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            raise ConfigError(f"{run_dir} is in use by another run (process {file.read().strip() or '?'})") from None
        file.truncate(0)
        file.write(f"{os.getpid()}\n")
        file.flush()
        yield


def load_checkpoint(path: str) -> dict:
    """Read a checkpoint of this script (tensors and plain data only), or raise a `ConfigError`."""
    if not Path(path).is_file():
        inside = Path(path) / "checkpoint.pt"  # a run's directory, given for its checkpoint
        hint = f"; the run's checkpoint in it is {inside}" if inside.is_file() else ""
        raise ConfigError(f"checkpoint {path or repr(path)} {'is not a file' if Path(path).exists() else 'does not exist'}{hint}")
    try:
        with warnings.catch_warnings(action="ignore"):  # torch warns of a pickle of another protocol, then refuses it
            checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # torch raises many kinds for a damaged file
        raise ConfigError(f"cannot read checkpoint {path}: the file is damaged or not a checkpoint of "
                          "vpg_continuous.py") from None
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != CHECKPOINT_FORMAT:
        raise ConfigError(f"{path} is not a vpg_continuous.py checkpoint")
    missing = [field for field in CHECKPOINT_FIELDS if field not in checkpoint]
    if missing:
        raise ConfigError(f"checkpoint {path} lacks {', '.join(missing)}: another version of vpg_continuous.py wrote it")
    wrong = [field for field, kind in CHECKPOINT_FIELDS.items() if not isinstance(checkpoint[field], kind)]
    if wrong:
        raise ConfigError(f"checkpoint {path} holds {', '.join(wrong)} of another kind: it was edited, or another "
                          f"program wrote it")
    return checkpoint


def restore_networks(networks: dict[str, nn.Module], checkpoint: dict, path: str) -> None:
    """Load each network's weights from the checkpoint entry of the same name, or raise a `ConfigError`."""
    for name, network in networks.items():
        try:
            network.load_state_dict(checkpoint[name])
        except RuntimeError as error:
            lines = str(error).strip().splitlines()  # torch's heading, then a line (a tab first) per difference
            raise ConfigError(f"checkpoint {path} holds a different {name} network: "
                              f"{(lines[1:2] or lines)[0].strip()}") from None
        if not all(torch.isfinite(parameter).all() for parameter in network.parameters()):
            raise ConfigError(f"checkpoint {path} holds non-finite {name} weights: it was written after "
                              f"its run diverged")


# ### Logging and progress


class Progress:
    """One line on the terminal: steps done, speed, time left, recent returns.

    The same text as `ppo_atari.py`'s but for the words: the returns of episodes here, the scores
    of games there. On a terminal it is redrawn in place after every update; into a file, a new
    line at most every 10 seconds, and the final one (once), so that the log of a long run stays short.
    """

    def __init__(self, total: int, start_step: int):
        self.total, self.start_step = total, start_step
        self.started = self.last_print = time.perf_counter()
        self.returns: deque[float] = deque(maxlen=20)
        self.interactive, self.printed = sys.stderr.isatty(), None

    def steps_per_second(self, step: int) -> float:
        return (step - self.start_step) / max(time.perf_counter() - self.started, 1e-9)

    def show(self, step: int, final: bool = False) -> None:
        now = time.perf_counter()
        if not self.interactive and (step == self.printed or not (final or now - self.last_print >= 10.0)):
            return  # into a file, a step's line is written once: the final one may be written already
        self.last_print, self.printed, sps = now, step, self.steps_per_second(step)
        left = format_duration((self.total - step) / sps if sps > 0 else math.inf)
        recent = f"{np.mean(self.returns):.1f} (last {how_many(len(self.returns), 'episode')})" if self.returns else "-"
        line = f"step {step:,}/{self.total:,} ({100 * step / self.total:.1f}%) | {sps:,.0f} SPS | {left} left | return {recent}"
        print(("\r\033[K" if self.interactive else "") + line, end="\n" if final or not self.interactive else "",
              file=sys.stderr, flush=True)


def format_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    hours, minutes, seconds = int(seconds) // 3600, int(seconds) // 60 % 60, int(seconds) % 60
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{seconds:02d}s"


def how_many(number: int, noun: str) -> str:
    """A count and its noun, in the plural unless the count is one: `1 game`, `8 games`."""
    return f"{number:,} {noun}{'s' * (number != 1)}"


def hyperparameter_table(config: Config, env_id: str, ranks: int = 1) -> str:
    """The run's settings as a Markdown table, the first text event of the run (as CleanRL writes it)."""
    rows = [f"|{key}|{value}|" for key, value in dataclasses.asdict(config).items()]
    first = [f"|env_id|{env_id}|"] + ([f"|ranks|{ranks}|"] if ranks > 1 else [])
    return "|parameter|value|\n|-|-|\n" + "\n".join(first + rows)


def default_run_dir(config: Config, env_id: str) -> Path:
    return Path("runs") / f"{gym.spec(env_id).name}__{config.seed}__{time.strftime('%Y%m%d-%H%M%S')}"


# What `Trainer.update_policy` reports besides what it measured: the learning rates of the update.
SCHEDULED = ("learning_rate", "value_learning_rate")


def log_update(writer, step: int, stats: dict[str, float], finished_episodes: list, progress: Progress,
               seconds: dict[str, float]) -> None:
    """Write one update to TensorBoard under CleanRL's tag names, so that curves compare across projects.

    Every entry of `stats` that the update measured is logged as `losses/<name>`, all but the total
    loss: each term of the loss's result (`LossTerms`), so a new term needs no edit here, then
    `approx_kl`, how far the one step moved the policy, and `explained_variance`. VPG has no clip
    range, so no `charts/clip_range` or `losses/clipfrac`. `finished_episodes` are those of every
    rank; `seconds` are the phases' times in this update, as `perf/<phase>_seconds`.
    """
    for _, episode_return, length in finished_episodes:
        writer.add_scalar("charts/episodic_return", episode_return, step)
        writer.add_scalar("charts/episodic_length", length, step)
        progress.returns.append(episode_return)
    scalars = {"charts/learning_rate": stats["learning_rate"],
               **{f"losses/{name}": value for name, value in stats.items() if name not in ("loss", *SCHEDULED)},
               "charts/SPS": progress.steps_per_second(step),
               **{f"perf/{phase}_seconds": value for phase, value in seconds.items()}}
    for tag, value in scalars.items():
        writer.add_scalar(tag, value, step)
    progress.show(step)


# ### Signals
#
# Ctrl-C (SIGINT), SIGTERM and SIGHUP reach one handler, `Signals.handle`, which decides by the
# phase of the run. While the workers start, before training begins, a signal aborts at once:
# nothing is trained yet. During training the first asks for a stop at the next safe point, between
# two steps of the envs (the unfinished rollout is dropped) or after an update: the checkpoint is
# written, the resume line printed, and the exit status is 128 plus the signal's number. A second
# one aborts at once, with no new checkpoint, naming the last one there is. While a checkpoint is
# written, signals wait until it is whole (`held`); once the last one is written, they cannot cut
# the closing short.
#
# SIGHUP is what a run gets when its terminal goes (the window closed, the ssh connection dropped):
# it stops the run as SIGTERM does. A run started to outlive its terminal, under `nohup`, which
# ignores SIGHUP, keeps it ignored. Either way a line printed on a terminal that is gone fails
# ("input/output error"), which would end the run in a traceback; the run then prints to /dev/null
# instead (`Terminal`), so that a stop still writes its checkpoint, and a run left behind with
# `& disown`, which never hears the SIGHUP, trains on.


class Aborted(KeyboardInterrupt):
    """A signal that ends the run at once: its words say why, its `status` is the exit status it gives."""

    def __init__(self, why: str, signum: int):
        super().__init__(why)
        self.status = 128 + signum


class Stopped(Exception):
    """Ends the loop of training at a safe point once a stop is requested; its one argument is the signal's number."""


class Signals:
    """Ctrl-C, SIGTERM and SIGHUP for the life of a run, a context manager that installs `handle`.

    `requested` is the number of training's first signal, the request to stop. A second signal
    within `same_within` seconds of it is the same request: under torchrun in a SLURM job, `scancel`
    or the time limit reaches each rank twice, from SLURM and passed on by torchrun (a terminal's
    Ctrl-C reaches torchrun alone, whose ranks each have a session of their own, and comes once).
    `closed` is set when a run that was closing lets go of the signals: the script's own handler (at
    the end of the file) then drops those that come after, as the process's last objects are freed.
    """

    closed = False

    def __init__(self, announce: bool = True, same_within: float = 0.0):
        self.requested: int | None = None
        self.training = self.closing = False
        self.received, self.waiting = 0.0, None
        self.announce, self.same_within = announce, same_within

    def handle(self, signum: int, frame: object = None) -> None:
        if self.closing:
            return
        if self.waiting is not None:
            self.waiting.append(signum)
        elif self.training and self.requested is None:
            self.requested, self.received = signum, time.monotonic()
            if self.announce:
                print(f"\n{signal.Signals(signum).name}: stopping at the next safe point and saving a checkpoint "
                      "(Ctrl-C again to abort at once)", file=sys.stderr, flush=True)
        elif not self.training or time.monotonic() - self.received >= self.same_within:
            raise Aborted("aborted by a second interrupt" if self.training else "interrupted before training began",
                          signum)

    @contextlib.contextmanager
    def held(self):
        """Hold signals back until the block is done, then handle them as they came.

        Python runs a handler between two bytecodes of the main thread, wherever it is. An exception
        raised there from inside `torch.save` leaves its C++ writer half-closed, and closing it can
        then end the process outright (`terminate called ... c10::Error`), with no message, no
        cleanup and the temporary file left behind. TensorBoard's writer hands its events to a thread
        through a queue: after an abort, closing it once waited forever on that thread (1 in about
        235 aborts of the test that presses Ctrl-C again and again), so its writes are held too.
        """
        self.waiting = []
        try:
            yield
        finally:
            waiting, self.waiting = self.waiting, None
            for signum in waiting:
                self.handle(signum)

    def __enter__(self) -> Signals:
        hangup = [signal.SIGHUP] if signal.getsignal(signal.SIGHUP) != signal.SIG_IGN else []  # `nohup` ignores it
        self.previous = {sig: signal.signal(sig, self.handle) for sig in [signal.SIGINT, signal.SIGTERM, *hangup]}
        return self

    def __exit__(self, *exc_info) -> None:
        Signals.closed = self.closing  # first: the handler given back may run as soon as it is
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


class Terminal:
    """stdout or stderr on a terminal: once writing there fails, the terminal being gone, `/dev/null` instead."""

    def __init__(self, stream: typing.TextIO):
        self.stream = stream

    def write(self, text: str) -> int:
        return self.guarded(self.stream.write, text)

    def flush(self) -> None:
        self.guarded(self.stream.flush)

    def guarded(self, call: typing.Callable, *args):
        try:
            return call(*args)
        except OSError:  # what is still in the stream's buffer goes to /dev/null too
            os.dup2(os.open(os.devnull, os.O_WRONLY), self.stream.fileno())
            return call(*args)

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


class RunWorkers(Workers):
    """Part 2's `Workers` as a run steps them: the seconds spent waiting for the envs are added to
    `seconds["env"]`, and, given `signals`, a step raises `Stopped` instead of stepping once a stop
    is requested, so that one process stops within a rollout rather than after it. (`train` gives
    several ranks no `signals`: each finishes its rollout, and they stop together after the update.)"""

    def __init__(self, *args, signals: Signals | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.signals, self.seconds = signals, {"env": 0.0}

    def step(self, actions: np.ndarray) -> VecStep:
        if self.signals is not None and self.signals.requested:
            raise Stopped(self.signals.requested)
        with timer(self.seconds, "env"):
            return super().step(actions)


# ### The run
#
# `train` makes the run's directory, the workers (`RunWorkers`), the device and the trainer, then
# runs Part 1's loop with what a real run adds after each update: logs, progress, checkpoints, and a
# stop when asked. The trainer is `RunTrainer`; with several ranks (Part 4) each rank runs `train`
# with a `DataParallelRunTrainer`, and rank 0 alone writes (and locks the directory). A worker that
# fails while the envs are stepped leaves the weights whole, so one process saves them before it
# reports; an update that diverged (`NonFiniteError`) writes nothing, and the last good checkpoint stays.
# So does a step that ran out of GPU memory, reported in one line of torch's words, which give the sizes.


def check_rollout_fits(config: Config, observation_bytes: int, ranks: Ranks) -> None:
    """Refuse a rollout whose observations alone, `observation_bytes` for each step of each env,
    outgrow this machine's memory, every rank on it holding one. Allocated, such a rollout would end
    the run in a traceback or, as Linux lends more memory than it has, get it killed as it fills."""
    needed = config.batch_size * observation_bytes * ranks.local_size
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if needed > memory:
        ranks_here = f" (x {ranks.local_size} ranks on this machine)" if ranks.local_size > 1 else ""
        raise ConfigError(f"the observations of a rollout of {config.num_envs:,} envs x {config.num_steps:,} steps"
                          f"{ranks_here} need {needed / 2**30:,.1f} GiB of memory, more than this machine's "
                          f"{memory / 2**30:,.1f} GiB; use fewer --num-envs or --num-steps")


def train(config: RunConfig, env_id: str, spaces: EnvSpaces, checkpoint: dict | None = None) -> int:
    """Train, log and checkpoint; the exit status of the run."""
    from torch.utils.tensorboard import SummaryWriter

    ranks = Ranks.from_environment()
    if checkpoint is not None and checkpoint["ranks"] != ranks.size:
        raise ConfigError(f"checkpoint {config.resume} was written by a run of {how_many(checkpoint['ranks'], 'rank')}; "
                          f"resume it with as many, not {ranks.size}")
    if config.total_timesteps < config.batch_size * ranks.size:
        raise ConfigError(f"--total-timesteps {config.total_timesteps} is less than one batch ({config.batch_size * ranks.size}"
                          f" = {how_many(ranks.size, 'rank')} x {config.num_envs} envs x {config.num_steps} steps)")
    if checkpoint is not None and checkpoint["update"] >= config.total_timesteps // (config.batch_size * ranks.size):
        raise ConfigError(f"checkpoint {config.resume} has trained {checkpoint['global_step']:,} steps, all that "
                          f"--total-timesteps {config.total_timesteps:,} allows; to train on, resume with a larger one")
    check_rollout_fits(config, spaces.obs_dim * 4, ranks)  # float32s
    run_dir = Path(config.run_dir or (Path(config.resume).parent if checkpoint else default_run_dir(config, env_id)))
    checkpoint_path = run_dir / "checkpoint.pt"
    signals = Signals(announce=ranks.is_main, same_within=1.0 if ranks.size > 1 else 0.0)
    with run_dir_lock(run_dir) if ranks.is_main else contextlib.nullcontext(), signals, contextlib.ExitStack() as opened:
        if ranks.is_main and checkpoint_path.exists() and not (checkpoint and checkpoint_path.samefile(config.resume)):
            raise ConfigError(f"{run_dir} already holds another run's checkpoint; resume that one, or choose another "
                              f"--run-dir for this one" if checkpoint else f"{run_dir} already holds a checkpoint; "
                              f"resume it with --resume {shlex.quote(str(checkpoint_path))} or choose another --run-dir")
        if ranks.is_main and checkpoint is None and (run_dir / "checkpoint.msgpack").exists():  # one run a directory
            raise ConfigError(f"{run_dir} already holds a run of ppo_jax.py (checkpoint.msgpack); choose another --run-dir")
        torch.manual_seed(config.seed + ranks.rank)
        first_update = checkpoint["update"] if checkpoint is not None else 0
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        num_workers = config.num_workers or max(1, min(config.num_envs, cores // ranks.local_size))
        opened.callback(ranks.close)
        trainer = writer = tracking = None
        try:
            # The workers start before anything touches CUDA or starts a thread (TensorBoard's
            # writer does), so that forking them is safe. A JAX env (gymnasium's `phys2d/Pendulum-v0`)
            # started JAX's threads as `describe_env` made it: its workers are spawned instead.
            default = "spawn" if "jax" in str(gym.spec(env_id).entry_point).lower() else None
            envs = opened.enter_context(RunWorkers(
                env_id, config.num_envs, num_workers, config.seed, spaces, config.max_episode_steps,
                default if config.start_method == "default" else config.start_method, first_update,
                first_env=ranks.rank * config.num_envs, signals=signals if ranks.size == 1 else None,
                make_task=task_maker(config, env_id, run_dir, first_update)))
            device = choose_device(config.device, ranks.local_rank)
            ranks.start(device)
            # The trainer that runs: `RunTrainer` in one process, Part 4's `DataParallelRunTrainer` on each rank.
            trainer = RunTrainer(config, envs, device) if ranks.size == 1 else DataParallelRunTrainer(config, envs, device, ranks)
            if checkpoint is not None:
                restore_checkpoint(trainer, checkpoint, config.resume, ranks)
            progress = Progress(trainer.num_updates * trainer.steps_per_update, trainer.global_step)
            progress.returns.extend(checkpoint.get("recent_returns", []) if checkpoint else [])
            if ranks.is_main:  # wandb first, so that it syncs the writer's events
                tracking = opened.enter_context(start_tracking(config, run_dir.name)) if config.track else None
                # TensorBoard's writer writes from a thread. What it cannot write (on a full disk, say), it raises
                # again at its next event and as it closes; the run then ends in one line (`written`), and Python's
                # traceback of the thread's death is left out.
                opened.callback(setattr, threading, "excepthook", threading.excepthook)
                threading.excepthook = lambda args, hook=threading.excepthook: None if issubclass(args.exc_type, OSError) else hook(args)
                opened.enter_context(written(run_dir, checkpoint_path, config.resume))
                writer = opened.enter_context(SummaryWriter(str(run_dir)))
                if checkpoint is None:
                    with signals.held():
                        writer.add_text("hyperparameters", hyperparameter_table(config, env_id, ranks.size))
                print(f"{env_id}: training on {device}, "
                      f"{how_many(config.num_envs, 'env')} in {how_many(num_workers, 'worker')}"
                      f"{f' on each of {ranks.size} ranks' * (ranks.size > 1)}; "
                      f"logs and checkpoints in {run_dir}" + (f"\nresumed at step {trainer.global_step:,} (update "
                      f"{trainer.update}) from {config.resume}" if checkpoint else ""), file=sys.stderr)
            opened.callback(setattr, signals, "closing", True)  # the first thing done on the way out: from then on, closing is not interrupted

            def write_checkpoint() -> None:
                state = checkpoint_state(trainer, env_id, ranks)  # every rank takes part: it gathers their random states
                if ranks.is_main:  # with the progress line's recent returns, so that a resumed line goes on from them
                    with signals.held():
                        save_checkpoint({**state, "recent_returns": list(progress.returns)}, checkpoint_path)

            before, sent_videos = {**envs.seconds, **trainer.seconds}, set()

            def after_update(stats: dict[str, float]) -> None:
                """Log the update, stop if asked, and write a checkpoint every `checkpoint_every` updates."""
                finished_episodes = [episode for episodes in ranks.gather(trainer.finished_episodes) for episode in episodes]
                spent = {phase: seconds - before[phase] for phase, seconds in {**envs.seconds, **trainer.seconds}.items()}
                before.update({**envs.seconds, **trainer.seconds})
                if ranks.is_main:  # the rollout's time outside the workers' steps is inference, with the copies around it
                    with signals.held():
                        log_update(writer, trainer.global_step, stats, finished_episodes, progress, {
                            "env": spent["env"], "inference": spent["sampling"] - spent["env"],
                            "update": spent["update"]})
                if tracking is not None and config.capture_video:
                    send_new_videos(tracking, run_dir / "videos", sent_videos)
                # A stop asked for in the last update finds nothing left to stop: the run ends as done, so that a
                # job its scheduler stopped then (and requeues to resume) is not refused for having trained it all.
                if (requested := ranks.largest(signals.requested or 0, device)) and trainer.update < trainer.num_updates:
                    raise Stopped(requested)
                if trainer.update % config.checkpoint_every == 0 and trainer.update < trainer.num_updates:
                    write_checkpoint()  # the last one, or the one after a stop, is written below

            signals.training = True  # from here a first signal asks for a stop with a checkpoint, rather than aborting
            try:
                trainer.train(after_update)
                stopped_by = 0
            except Stopped as stopped:
                stopped_by = stopped.args[0]
            write_checkpoint()
            signals.closing = True
            if ranks.is_main:
                progress.show(trainer.global_step, final=True)
                print(f"stopped at update {trainer.update}; resume with --resume {shlex.quote(str(checkpoint_path))}" if stopped_by
                      else f"done: {trainer.global_step:,} steps; checkpoint in {checkpoint_path}", file=sys.stderr)
            return 128 + stopped_by if stopped_by else 0
        except WorkerError as error:
            if trainer is None:
                print(f"{error}\nthe workers did not start; no training was done", file=sys.stderr)
            elif ranks.size == 1:  # the weights are whole: the update had not begun
                write_checkpoint()
                print(f"\n{error}\ncheckpoint of update {trainer.update} saved in {checkpoint_path}", file=sys.stderr)
            else:  # the other ranks cannot join in writing it: torchrun stops them, and the last checkpoint stays
                print(f"\nrank {ranks.rank}: {error}", file=sys.stderr)
            return 1
        except (Aborted, NonFiniteError, RankFailure, torch.OutOfMemoryError) as error:
            signals.closing = True
            last = last_checkpoint(checkpoint_path, config.resume)
            good = "good " if isinstance(error, NonFiniteError) else ""
            print(f"\n{' '.join(str(error).split())}; " + (f"the last {good}checkpoint is {last}" if last else
                                                          "no checkpoint was written"), file=sys.stderr)
            return error.status if isinstance(error, Aborted) else 1


# ### Experiment tracking
#
# `--track` sends the run to Weights & Biases, as CleanRL does. wandb mirrors every TensorBoard
# event the run writes from `wandb.init` on (`sync_tensorboard`), so the tags are the same in both;
# with `--capture-video`, training sends each video at the end of the update that finished it, and
# `--eval` its own. wandb is optional, imported only for `--track`, and `WANDB_MODE=offline` keeps a
# run on disk for a later `wandb sync`.


def import_wandb():
    """The `wandb` module, or a `ConfigError` that says how to install it."""
    try:
        import wandb
    except ImportError:
        raise ConfigError("--track needs wandb: pip install wandb==0.31.0") from None
    return wandb


def start_tracking(config, name: str, job_type: str = "train"):
    """A Weights & Biases run named `name` that syncs the TensorBoard events written after it starts;
    one that wandb refuses to start (no API key, say) is a `ConfigError` in its words."""
    wandb = import_wandb()
    try:
        return wandb.init(project=config.wandb_project_name, entity=config.wandb_entity, name=name, job_type=job_type,
                          config=vars(config), sync_tensorboard=True, monitor_gym=False, save_code=True)
    except wandb.errors.UsageError as error:
        raise ConfigError(f"--track: {' '.join(str(error).split())}") from None


def send_new_videos(tracking, video_dir: Path, sent: set[Path]) -> None:
    """Send each whole video of training to Weights & Biases once; those still under their hidden names wait."""
    for path in sorted(set(video_dir.glob("train-*.mp4")) - sent):
        tracking.log({"videos": import_wandb().Video(str(path), format="mp4")})
        sent.add(path)


# ### A trained policy, and its evaluation
#
# `load_policy` hands a checkpoint's agent to a program of your own: a notebook that watches it,
# a fork's evaluation, a controller. The network learned on normalised observations, so the policy
# carries the statistics its checkpoint froze: statistics that kept moving would change the policy
# under test. `--eval` plays whole episodes with it, several at once in this process, sampling its
# actions as in training or, with `--eval-deterministic`, taking the mean action.


class Policy:
    """A trained agent, ready to act: a checkpoint's policy network, its observation statistics
    (frozen) and its task's action bounds.

    `act` takes an observation as the task's env gives it (a vector, or a batch of them) and returns
    an action inside the bounds, ready for `env.step`: sampled from the Gaussian, as in training and
    `--eval`, or its mean with `deterministic=True`. `make_env` makes the checkpoint's task.
    """

    def __init__(self, checkpoint: dict, path: str, device: torch.device):
        self.config = Config(**{field.name: checkpoint["config"][field.name] for field in dataclasses.fields(Config)})
        self.env_id, self.device, self.spaces = checkpoint["env_id"], device, describe_env(checkpoint["env_id"])
        self.network = make_networks(self.spaces, self.config)[0].to(device).eval()
        restore_networks({"policy": self.network}, checkpoint, path)
        self.normalizer = ObservationNormalizer(self.spaces.obs_dim, enabled=self.config.normalize_observations)
        self.normalizer.load_state_dict(checkpoint["obs_normalizer"])

    def make_env(self, **kwargs) -> gym.Env:
        """The checkpoint's task with its time limit, made by `gym.make` with `kwargs` (`render_mode="human"`, say)."""
        return gym.make(self.env_id, max_episode_steps=self.config.max_episode_steps, **kwargs)

    @torch.inference_mode()
    def act(self, observation: np.ndarray, deterministic: bool = False) -> np.ndarray:
        """The action `[action_dim]` for one observation, or `[batch, action_dim]` for a batch."""
        batch = np.atleast_2d(np.asarray(observation, np.float64))
        mean, std = self.network(torch.from_numpy(self.normalizer(batch)).to(self.device))
        actions = mean if deterministic else gaussian_sample(mean, std)
        actions = np.clip(actions.cpu().numpy().astype(np.float64), self.spaces.action_low, self.spaces.action_high)
        return actions[0] if np.ndim(observation) == 1 else actions


def load_policy(path: str | Path, device: str | torch.device = "cpu", checkpoint: dict | None = None) -> Policy:
    """The policy in a `checkpoint.pt` of this script, on `device`, ready to act (see `Policy`).
    `checkpoint` is the file's content, if it was read already.

    A path that is not such a checkpoint, or holds a diverged network, is a `ConfigError`.
    """
    return Policy(checkpoint or load_checkpoint(str(path)), str(path), torch.device(device))


def evaluate(config: RunConfig, env_id: str, checkpoint: dict) -> list[float]:
    """Play `eval_episodes` episodes with the checkpoint's policy; their returns."""
    policy = load_policy(config.eval, choose_device(config.device), checkpoint)
    torch.manual_seed(config.seed)
    seeds = env_seeds(config.seed + 1_000_003, config.eval_episodes)  # episodes unlike the training ones
    video_dir = Path(config.run_dir or Path(config.eval).parent) / "videos"
    if config.capture_video:
        writable_dir(video_dir)
    tasks = [RecordedTask(env_id, seed, config.max_episode_steps, None, video_dir,  # each records its one episode
                          f"eval-{gym.spec(env_id).name}-episode{index:02d}.mp4") if config.capture_video
             else Task(env_id, seed, config.max_episode_steps) for index, seed in enumerate(seeds)]
    returns, started = {}, time.perf_counter()
    with written(video_dir, config.eval):  # a video that cannot be written (on a full disk, say) is one line
        try:
            for task in tasks:
                task.reset()
            while len(returns) < len(tasks):
                playing = [index for index in range(len(tasks)) if index not in returns]
                actions = policy.act(np.stack([tasks[index].obs for index in playing]), config.eval_deterministic)
                for index, action in zip(playing, actions):
                    step = tasks[index].step(action)
                    if step.terminated or step.truncated:
                        returns[index] = step.episode_return
                        print(f"episode {len(returns)}/{len(tasks)}: return {step.episode_return:.1f} "
                              f"({time.perf_counter() - started:.1f} s)", file=sys.stderr, flush=True)
        finally:
            for task in tasks:
                task.close()
    videos = [video_dir / task.name for task in tasks] if config.capture_video else []
    if videos:
        print(f"videos in {video_dir}", file=sys.stderr)
    returns = [returns[index] for index in range(len(tasks))]
    if config.track:  # each episode's return, their mean, and the videos
        with start_tracking(config, f"eval-{Path(config.eval).parent.name}", job_type="eval") as tracking:
            for index, episode_return in enumerate(returns):
                tracking.log({"eval/episodic_return": episode_return}, step=index)
            tracking.summary["eval/mean_return"] = float(np.mean(returns))
            tracking.log({"videos": [import_wandb().Video(str(video), format="mp4") for video in videos]})
    return returns


# ### Videos
#
# Videos need a renderer: pygame for the classic-control tasks, OpenGL for MuJoCo's, whose platform
# (`MUJOCO_GL`) must be chosen before MuJoCo is imported (`choose_mujoco_gl`, called by `main`).
# With `--capture-video`, a run records some whole episodes of its first env as it trains, as
# CleanRL does: episodes 0, 1, 8, 27, ... (the cubes) up to 1,000, then every 1,000th (gymnasium's
# `capped_cubic_video_schedule`), so the early episodes that change fastest are seen, and a long run
# leaves a few dozen videos rather than thousands. The episode is recorded where it is played, in
# its worker: `make_recorded_task` stands in for `Task` and makes that one env a `RecordedTask`. A
# video is written under a hidden name and renamed when its episode ends, so the main process sees
# only whole videos, and sends each new one to Weights & Biases with `--track`; `--eval` records each
# of its episodes with a `RecordedTask` too. Rendering costs: a
# MuJoCo frame drawn in software takes tens of milliseconds, so a recorded HalfCheetah episode adds
# about a minute to the run.


# A MuJoCo render context built and used once: what `choose_mujoco_gl` runs in a fresh interpreter.
GL_PROBE = ("import mujoco; context = mujoco.GLContext(16, 16); context.make_current(); "
            "mujoco.MjrContext(mujoco.MjModel.from_xml_string('<mujoco/>'), mujoco.mjtFontScale.mjFONTSCALE_100); "
            "context.free()")

GL_PACKAGES = {"egl": "EGL (Debian/Ubuntu: apt install libegl1 libgl1-mesa-dri)",
               "osmesa": "OSMesa (Debian/Ubuntu: apt install libosmesa6)",
               "glfw": "a display for GLFW"}


def choose_mujoco_gl(env_id: str) -> str:
    """The OpenGL platform MuJoCo renders videos with (`MUJOCO_GL`), set before MuJoCo is imported.

    MuJoCo picks its platform once, when it is imported: `glfw` (the default) needs a display,
    `egl` renders off-screen on a GPU or with Mesa's software renderer, `osmesa` in software. Which
    one works depends on the machine, and a failed attempt cannot be undone in the same process, so
    each candidate is tried in a fresh interpreter, in that order, unless `MUJOCO_GL` names one.
    """
    requested = os.environ.get("MUJOCO_GL")
    for backend in [requested] if requested else ["egl", "osmesa", "glfw"]:
        with contextlib.suppress(subprocess.TimeoutExpired):
            if subprocess.run([sys.executable, "-c", GL_PROBE], env={**os.environ, "MUJOCO_GL": backend},
                              capture_output=True, timeout=120).returncode == 0:
                os.environ["MUJOCO_GL"] = backend
                return backend
    if requested and requested.lower() not in GL_PACKAGES:
        raise ConfigError(f"cannot record {env_id}: MUJOCO_GL={requested} is none of {', '.join(GL_PACKAGES)}")
    if requested:
        raise ConfigError(f"cannot record {env_id}: MuJoCo cannot render with MUJOCO_GL={requested} here; "
                          f"install {GL_PACKAGES[requested.lower()]}, or unset MUJOCO_GL to try the others")
    raise ConfigError(f"cannot record {env_id}: MuJoCo found no OpenGL to render with (tried MUJOCO_GL=egl, osmesa, "
                      f"glfw); install {GL_PACKAGES['egl']} or {GL_PACKAGES['osmesa']}")


def uses_mujoco(env_id: str) -> bool:
    entry_point = gym.spec(env_id).entry_point
    return isinstance(entry_point, str) and entry_point.startswith("gymnasium.envs.mujoco")


class Video:
    """An mp4 file of H.264 video, written one RGB frame at a time.

    H.264 in yuv420p is the video that browsers, TensorBoard and Weights & Biases play (OpenCV's
    mp4 writer makes MPEG-4 Part 2, which Chromium refuses). PyAV (`av`) carries the x264 encoder
    in its wheel. yuv420p keeps the colour at half resolution, so both sides must be even: an odd
    side is padded by repeating its last row or column. `+faststart` puts the file's index first,
    so that a browser starts playing before the whole file has arrived. The directory is made if need be.
    """

    def __init__(self, path: Path, fps: float):
        import av  # imported here: only a run that records video needs it

        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.make_frame = path, av.VideoFrame.from_ndarray
        self.file = av.open(str(path), "w", options={"movflags": "+faststart"})
        self.stream = self.file.add_stream("libx264", rate=fractions.Fraction(fps).limit_denominator(1001))
        self.stream.pix_fmt, self.shape = "yuv420p", None

    def write(self, frame: np.ndarray) -> None:
        if self.shape is None:  # the first frame sets the size, each side rounded up to an even number
            self.shape = self.stream.height, self.stream.width = frame.shape[0] + frame.shape[0] % 2, frame.shape[1] + frame.shape[1] % 2
        frame = np.pad(frame, ((0, self.shape[0] - frame.shape[0]), (0, self.shape[1] - frame.shape[1]), (0, 0)), mode="edge")
        self.file.mux(self.stream.encode(self.make_frame(frame, format="rgb24")))

    def close(self) -> None:
        """Encode the frames x264 still holds and finish the file; a second call does nothing."""
        if self.file is not None:
            file, self.file = self.file, None  # first: a close that failed (on a full disk, say) is not tried again
            if self.shape is not None:
                file.mux(self.stream.encode())
            file.close()


def records_episode(index: int) -> bool:
    """Whether episode `index` (from 0) of the recorded env is recorded: the cubes below 1,000, then every 1,000th."""
    return round(index ** (1 / 3)) ** 3 == index if index < 1000 else index % 1000 == 0


class RecordedTask(Task):
    """A `Task` that renders, and writes the episodes `records_episode` picks to `<video_dir>/<name>`,
    where `{}` in `name` stands for the episode's index, from 0."""

    def __init__(self, env_id: str, seed: int, max_episode_steps: int | None, obs: np.ndarray | None,
                 video_dir: Path, name: str):
        super().__init__(env_id, seed, max_episode_steps, obs=obs, render=True)
        # Ready to render in this process: pygame (the classic-control tasks) with no display or sound
        # card, and MuJoCo's shadows drawn into a 1024 x 1024 map rather than 4096 x 4096, which with
        # no GPU (EGL on Mesa's software renderer) halves a frame's cost (HalfCheetah, 480 x 480: 126
        # to 66 ms on one CPU core), and the shadows still show.
        os.environ.setdefault("SDL_VIDEODRIVER", "dummy")
        os.environ.setdefault("SDL_AUDIODRIVER", "dummy")
        if uses_mujoco(env_id):
            self.env.unwrapped.model.vis.quality.shadowsize = 1024
        self.env_id, self.video_dir, self.name_format = env_id, video_dir, name
        self.episodes, self.video = 0, None

    def render(self) -> np.ndarray:
        """The task's RGB frame, or a `ConfigError` naming what rendering lacks."""
        try:
            return super().render()
        except gym.error.DependencyNotInstalled as error:
            raise ConfigError(f"cannot record {self.env_id}: {str(error).strip().splitlines()[0]}") from None

    def reset(self) -> np.ndarray:
        obs = super().reset()
        if records_episode(self.episodes):
            self.name = self.name_format.format(self.episodes)
            self.video = Video(self.video_dir / f".{self.name}", self.env.metadata.get("render_fps") or 30)
            self.video.write(self.render())
        self.episodes += 1
        return obs

    def step(self, action: np.ndarray) -> Transition:
        step = super().step(action)
        if self.video is not None:
            self.video.write(self.render())
            if step.terminated or step.truncated:
                self.video.close()
                os.replace(self.video.path, self.video_dir / self.name)
                self.video = None
        return step

    def close(self) -> None:
        """Close the env; the video of an episode cut short by the end of the run is dropped."""
        if self.video is not None:
            with contextlib.suppress(OSError):  # the file goes all the same, if closing it fails (on a full disk, say)
                self.video.close()
            self.video.path.unlink(missing_ok=True)
        super().close()


def make_recorded_task(env_id: str, seed: int, max_episode_steps: int | None = None, obs: np.ndarray | None = None,
                       *, recorded_seed: int, video_dir: Path, name: str) -> Task:
    """`Task` for the workers of a recorded run: the env whose seed is `recorded_seed` is a `RecordedTask`."""
    if int(seed) == recorded_seed:
        return RecordedTask(env_id, seed, max_episode_steps, obs, video_dir, name)
    return Task(env_id, seed, max_episode_steps, obs=obs)


def task_maker(config: RunConfig, env_id: str, run_dir: Path, first_update: int) -> typing.Callable:
    """What the workers make their envs with: `Task`, or with `--capture-video` `make_recorded_task` for
    the run's first env (the first of rank 0, whose seed is the first of `env_seeds`). The videos'
    names hold the update their stretch of training started at, so a resumed run adds its own."""
    if not config.capture_video:
        return Task
    return functools.partial(make_recorded_task, recorded_seed=int(env_seeds(config.seed, 1, first_update)[0]),
                             video_dir=run_dir / "videos",
                             name=f"train-{gym.spec(env_id).name}-from-update{first_update}-episode{{:04d}}.mp4")


# ### main


def main(argv: list[str] | None = None) -> int:
    """Do what the command line asks: evaluate a checkpoint, or train, afresh or resumed. A mistake
    in the input is one line on stderr and exit status 2; the other statuses are `train`'s."""
    prog = "vpg_continuous.py"
    try:
        config, checkpoint = parse_config(argv)
        if config.track:
            import_wandb()  # here, so that a missing wandb stops the run before it starts
        env_id = resolve_env_id(config.env)
        if checkpoint is not None and checkpoint["env_id"] != env_id:
            raise ConfigError(f"checkpoint {config.resume or config.eval} was trained on {checkpoint['env_id']}, "
                              f"not {env_id}")
        for name in ("state_dependent_std", "normalize_observations"):  # what the network is, and what it sees
            if config.resume is not None and getattr(config, name) != checkpoint["config"].get(name, getattr(config, name)):
                raise ConfigError(f"a resumed run keeps {flag(name)} as it was trained ("
                                  f"{'on' if checkpoint['config'][name] else 'off'})")
        if config.capture_video and uses_mujoco(env_id):
            choose_mujoco_gl(env_id)  # before `describe_env` imports MuJoCo
        os.environ.setdefault("SDL_NO_SIGNAL_HANDLERS", "1")  # or pygame's SDL takes SIGTERM as it first renders
        spaces = describe_env(env_id)
        if config.eval is None:
            return train(config, env_id, spaces, checkpoint)
        with Signals():  # SIGTERM and SIGHUP end it as Ctrl-C does, once its unfinished videos are deleted
            returns = evaluate(config, env_id, checkpoint)
        print(f"{env_id}: {how_many(len(returns), 'episode')}, return {np.mean(returns):.1f} ± {np.std(returns):.1f} "
              f"(min {min(returns):.1f}, max {max(returns):.1f})")
        return 0
    except ConfigError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2
    except WriteFailed as error:
        print(f"\n{prog}: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as interrupt:  # before the run began (reading the checkpoint, say), or while evaluating
        print(f"\n{prog}: interrupted", file=sys.stderr)
        return getattr(interrupt, "status", 130)  # `Aborted`'s: 143 after SIGTERM


# ## Part 4: More than one device
#
# ### Data-parallel training with torchrun
#
# This part is optional: without torchrun there is one rank, `train` builds Part 3's `RunTrainer`,
# every method of `Ranks` returns at once, and the script runs exactly as the parts above describe.
#
# `torchrun --nproc_per_node N vpg_continuous.py --env HalfCheetah-v5` starts N copies of this
# script, the *ranks*; `torchrun --nnodes M --nproc_per_node N --rdzv-endpoint HOST:PORT ...`
# spreads them over M machines. Each rank steps its own `num_envs` envs, seeded with the next
# seeds of the run after those of the rank before it, and collects its own rollout: a batch holds N
# times as many transitions, and `--total-timesteps` counts the steps of all ranks. All keep the
# same networks, which start from rank 0's initialisation. Rank 0 alone writes the logs and the
# checkpoints. `DataParallelTrainer` is Part 1's `Trainer` with a few of its textbook methods
# overridden; three things make its update the single-process update on the combined batch:
#
# * **Gradients are averaged** over the ranks after each backward pass. The mean of the ranks'
#   gradients of means over equal batches is the gradient of the mean over the combined batch, so
#   every rank takes the same clipped Adam step and the parameters never drift apart.
# * **Advantages are normalised** with the mean and standard deviation of the combined batch, from
#   the sums $\sum_i \hat A_i$, $\sum_i \hat A_i^2$ and the count, added over the ranks.
# * **The running statistics are pooled** after every rollout, those of the observations and those
#   of the returns that scale the rewards. During a rollout each rank folds in what its own envs
#   show, as one process does; then the ranks exchange the statistics of what each saw in that
#   rollout and merge them, in rank order, into those they agreed on after the previous rollout
#   (`SharedRunningMeanStd`). Every rank then holds the same mean, variance and count: those of
#   every observation of every rank. Pooling at every step instead would make the ranks wait for
#   each other 32 times an update, for statistics that one rollout moves little once the first few
#   are in.
#
# **An explicit all-reduce, not DDP.** We average the gradients with one all-reduce of all of them
# rather than wrap the networks in `DistributedDataParallel`. DDP's gain is to overlap the
# communication with the backward pass, bucket by bucket, which pays for large models on fast
# links; these two networks hold 39k parameters on HalfCheetah, 150 KB, one message. And VPG's
# update does not fit DDP's mould: the policy-gradient step reaches both networks and value fitting
# only one, and both are also called outside any update, to sample. The explicit version is the
# math above, line for line. The backend is NCCL between GPUs and gloo between CPUs (the default device).
#
# **What more ranks buy.** Steps per second, not learning per sample. VPG takes one policy step
# per batch and N ranks make the batch N times larger, so at a fixed `--total-timesteps` the policy
# moves N times fewer times, and the table under `Config` shows small batches learning more from
# each step of experience. To keep a single process's batch, give each rank `--num-envs` divided by N:
# the sampling is then shared out, but an update costs a rank about what it cost one process
# (overhead per operation, see `choose_device`), so ranks pay off best in forks with larger
# batches or networks.
#
# A checkpoint holds the random state of every rank; resume it with as many ranks. Ctrl-C stops
# every rank after the current update, with a checkpoint written. A rank that fails breaks the
# connections of the next collective operation, and the others stop with a one-line `RankFailure`
# rather than wait for it. (NCCL does not notice; torchrun ends the others when it sees one fail.)


class RankFailure(RuntimeError):
    """A collective operation failed: another rank died or left."""


# A failed operation's tensors need care. gloo runs each operation on a thread of its own, and that
# thread drops its hold on the tensors a moment *after* the error reaches us. If its hold were the
# last, the thread would need the GIL to free them; once the interpreter has begun to shut down it
# cannot have it, and the whole process aborts ("terminate called without an active exception").
# The error's traceback holds the tensors (its frames are those of the call), so keeping the error
# until the process ends leaves the last hold, and the freeing, to the main thread.
FAILED_COLLECTIVES: list[RuntimeError] = []


class Ranks:
    """The processes of a data-parallel run and the few collective operations that VPG needs.

    `Ranks()` is a run of one process; `Ranks.from_environment()` reads what torchrun sets
    (`WORLD_SIZE`, `RANK`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`).
    """

    def __init__(self, size: int = 1, rank: int = 0, local_rank: int = 0, local_size: int = 1):
        self.size, self.rank, self.local_rank, self.local_size = size, rank, local_rank, local_size

    @classmethod
    def from_environment(cls) -> Ranks:
        env = os.environ
        return cls(int(env.get("WORLD_SIZE", 1)), int(env.get("RANK", 0)), int(env.get("LOCAL_RANK", 0)),
                   int(env.get("LOCAL_WORLD_SIZE", 1)))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def start(self, device: torch.device) -> None:
        """Join the process group: NCCL between GPUs, gloo between CPUs. A rank that hangs without
        dying holds the others for at most 10 minutes (the timeout of every collective)."""
        if self.size > 1:
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(minutes=10))

    def close(self) -> None:
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()

    def _collective(self, operation, *args, **kwargs):
        """Run a collective operation of `torch.distributed`; a rank that died or left is a `RankFailure`."""
        try:
            return operation(*args, **kwargs)
        except RuntimeError as error:  # gloo: the connection to the rank that died was closed or reset
            FAILED_COLLECTIVES.append(error)
            # gloo says where in its source the connection broke, then why: keep the why.
            reason = str(error).strip().splitlines()[0].split("] ")[-1].split(". ")[0]
            raise RankFailure(f"rank {self.rank}: another rank failed or left ({reason})") from None

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum of `tensor` over the ranks."""
        if self.size == 1:
            return tensor
        total = tensor.clone()
        self._collective(dist.all_reduce, total)
        return total

    def mean(self, tensor: torch.Tensor) -> torch.Tensor:
        """The mean of `tensor` over the ranks."""
        return tensor if self.size == 1 else self.sum(tensor) / self.size

    def average_gradients(self, parameters: list[nn.Parameter]) -> None:
        """Replace each gradient by its mean over the ranks, in one message for all of them."""
        if self.size == 1:
            return
        gradients = [p.grad for p in parameters]
        flat = self.mean(torch.cat([g.flatten() for g in gradients]))
        for gradient, average in zip(gradients, flat.split([g.numel() for g in gradients])):
            gradient.copy_(average.view_as(gradient))

    def broadcast_parameters(self, *networks: nn.Module) -> None:
        """Start every rank from rank 0's initialisation."""
        if self.size > 1:
            for network in networks:
                for tensor in network.state_dict().values():
                    self._collective(dist.broadcast, tensor, src=0)

    def share_statistics(self, statistics: list[SharedRunningMeanStd], device: torch.device) -> None:
        """Pool what every rank's `statistics` saw since they were last pooled, in one message."""
        if self.size == 1 or not statistics:
            return
        vectors = [stats.fresh_vector() for stats in statistics]
        mine = torch.from_numpy(np.concatenate(vectors)).to(device)
        everyone = [torch.empty_like(mine) for _ in range(self.size)]
        self._collective(dist.all_gather, everyone, mine)
        everyone = [vector.cpu().numpy() for vector in everyone]
        ends = np.cumsum([len(vector) for vector in vectors])
        for stats, start, end in zip(statistics, [0, *ends[:-1]], ends):
            stats.agree([vector[start:end] for vector in everyone])

    def largest(self, value: int, device: torch.device) -> int:
        """The largest of the ranks' values: the signal that stops them all, or 0 if none came."""
        if self.size == 1:
            return value
        tensor = torch.tensor([value], device=device)
        self._collective(dist.all_reduce, tensor, op=dist.ReduceOp.MAX)
        return int(tensor.item())

    def gather(self, value) -> list:
        """Every rank's `value`, in rank order (for checkpoints and logs)."""
        if self.size == 1:
            return [value]
        values = [None] * self.size
        self._collective(dist.all_gather_object, values, value)
        return values


def exit_process(code: int, ranks: int) -> typing.NoReturn:
    """End the process with status `code`, once everything is written and closed.

    A rank of a run of several leaves with `os._exit`, skipping the interpreter's shutdown. gloo's
    threads outlive `destroy_process_group`: modules that torch imports on first use (the first
    optimizer brings in `torch._dynamo`) keep references to the group. One of those threads that
    frees a tensor while the interpreter shuts down needs the GIL, which it can no longer have, and
    the process aborts; torchrun would then report a finished run as failed. It happened once in
    our test runs. A single process has no such threads and exits normally.
    """
    if ranks > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


class SharedRunningMeanStd(RunningMeanStd):
    """Running statistics that the ranks pool after every rollout, to hold the same ones.

    Between two poolings a rank folds its own batches in at every step, as `RunningMeanStd` does,
    and also keeps their statistics apart in `fresh`. Pooling (`Ranks.share_statistics`) gathers
    every rank's `fresh` and `agree` merges them, in rank order, into `agreed`, the statistics all
    ranks held after the last pooling. Every rank does the same merges in the same order, so all
    end with the same numbers, to the last bit: the statistics of every batch of every rank, as
    one process that saw them all would hold them (up to rounding).
    """

    def __init__(self, shape: tuple[int, ...] = ()):
        super().__init__(shape)
        self.agreed = RunningMeanStd(shape)
        self.fresh = RunningMeanStd(shape)

    @classmethod
    def starting_from(cls, stats: RunningMeanStd) -> SharedRunningMeanStd:
        """Shared statistics that start where `stats` stand, a prior included. Every rank starts
        from the same ones, and only what is seen afterwards is pooled, so the prior counts once."""
        shared = cls(np.shape(stats.mean))
        shared.load_state_dict(stats.state_dict())
        return shared

    def update(self, batch: np.ndarray) -> None:
        super().update(batch)
        self.fresh.update(batch)

    def fresh_vector(self) -> np.ndarray:
        """`fresh` as one float64 vector (count, mean, variance), to send to the other ranks."""
        return np.concatenate([[self.fresh.count], np.ravel(self.fresh.mean), np.ravel(self.fresh.var)])

    def agree(self, vectors: list[np.ndarray]) -> None:
        """Merge every rank's `fresh_vector`, in rank order, into `agreed`, and hold the result."""
        shape, size = np.shape(self.agreed.mean), np.size(self.agreed.mean)
        for vector in vectors:
            theirs = RunningMeanStd(shape)
            theirs.count = int(vector[0])
            theirs.mean, theirs.var = vector[1:1 + size].reshape(shape), vector[1 + size:].reshape(shape)
            self.agreed.merge(theirs)
        self.mean, self.var, self.count = np.copy(self.agreed.mean), np.copy(self.agreed.var), self.agreed.count
        self.fresh = RunningMeanStd(shape)

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.agreed.load_state_dict(state)
        self.fresh = RunningMeanStd(np.shape(self.mean))


class DataParallelTrainer(Trainer):
    """Part 1's `Trainer` as one of several ranks: every rank takes the update that one process
    would take on the combined batch of all of them.

    It overrides the textbook methods where ranks differ from one process, and adds nothing else:
    `__init__` starts every rank from rank 0's networks and makes the running statistics ones the
    ranks pool; `steps_per_update` counts the steps of every rank; `collect_rollout` pools the
    statistics after each rollout; `normalize_advantages` standardises over the combined batch;
    `compute_gradients` averages the gradients; `update_policy` reports means over the ranks.
    """

    def __init__(self, config: Config, envs, device: torch.device, ranks: Ranks):
        self.ranks = ranks
        super().__init__(config, envs, device)
        ranks.broadcast_parameters(self.policy, self.value)
        # Each rank sees only its own envs; after every rollout they pool the statistics of what
        # they saw, so that all of them normalise alike.
        self.obs_normalizer.stats = SharedRunningMeanStd.starting_from(self.obs_normalizer.stats)
        self.shared_statistics = [self.obs_normalizer.stats]
        if self.reward_scaler is not None:
            self.reward_scaler.stats = SharedRunningMeanStd.starting_from(self.reward_scaler.stats)
            self.shared_statistics.append(self.reward_scaler.stats)

    @property
    def steps_per_update(self) -> int:
        return super().steps_per_update * self.ranks.size

    def collect_rollout(self) -> Rollout:
        rollout = super().collect_rollout()
        self.ranks.share_statistics(self.shared_statistics, self.device)
        return rollout

    def normalize_advantages(self, advantages: torch.Tensor) -> torch.Tensor:
        r"""`normalize_advantages` with the mean and standard deviation of the combined batch.

        The mean $\mu = S_1 / n$ and the unbiased variance $(S_2 - n \mu^2) / (n - 1)$ come from
        $S_1 = \sum_i \hat A_i$, $S_2 = \sum_i \hat A_i^2$ and the count $n$, each added over the ranks.
        """
        sums = torch.stack([advantages.sum(), advantages.pow(2).sum(),
                            torch.tensor(float(advantages.numel()), device=advantages.device)])
        total, squares, count = self.ranks.sum(sums)
        mean = total / count
        variance = (squares - count * mean ** 2) / (count - 1)
        return normalize_advantages(advantages, mean, variance.clamp(min=0).sqrt())

    def compute_gradients(self, loss: torch.Tensor, parameters: list[nn.Parameter]) -> None:
        super().compute_gradients(loss, parameters)
        self.ranks.average_gradients(parameters)

    def update_policy(self, rollout: Rollout) -> dict[str, float]:
        """Part 1's update. What it measured is reported as means over the ranks: for the losses and
        the KL, means over equal batches, that is the means over the combined batch; for the
        explained variance, an average. The learning rates are every rank's own and the same."""
        stats = super().update_policy(rollout)
        measured = [name for name in stats if name not in SCHEDULED]
        means = self.ranks.mean(torch.tensor([stats[name] for name in measured], device=self.device))
        return {**stats, **dict(zip(measured, means.tolist()))}


class DataParallelRunTrainer(DataParallelTrainer, RunTrainer):
    """What each rank of a real run trains with: the ranks of this part on Part 3's `RunTrainer`.

    Its methods are looked up in this order: `DataParallelTrainer`, `RunTrainer`, Part 1's
    `Trainer`. So the ranks pool their statistics after `RunTrainer` has timed the rollout, and
    average what an update measured after it has timed the update; a diverged update is refused on
    every rank alike, since their gradients and weights are the same.
    """


if __name__ == "__main__":
    # Ctrl-C is Python's KeyboardInterrupt until the run is over (the run's `Signals` decide in
    # between), then nothing: a late Ctrl-C could only turn the exit into a traceback. The run is
    # over once its `Signals` let go while closing, or once `main` returns. Then a Python function
    # drops it (raised inside one of multiprocessing's finalizers, which run as the run's objects are
    # freed, it would print "Exception ignored" and a traceback), then `SIG_IGN`, which the
    # interpreter's shutdown keeps (at once, a signal on its way would be reported as a race).
    run_over = False

    def interrupt_until_the_run_is_over(signum: int, frame: object) -> None:
        if not (run_over or Signals.closed):
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt_until_the_run_is_over)
    sys.stdout, sys.stderr = (Terminal(stream) if stream.isatty() else stream for stream in (sys.stdout, sys.stderr))
    status = main()
    run_over = True
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, interrupt_until_the_run_is_over)
        signal.signal(sig, signal.SIG_IGN)
    exit_process(status, ranks=int(os.environ.get("WORLD_SIZE", "1")))
