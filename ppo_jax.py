r"""
# Proximal Policy Optimization in JAX: the whole run compiled, many seeds at once

This page trains agents with Proximal Policy Optimization (PPO) in JAX, and is written to be read
top to bottom beside `ppo_atari.py`, its PyTorch twin. The algorithm is the same; what changes is
how the program is written. JAX traces a *pure* Python function (no side effects, every input an
argument, every result a return value) into one program that XLA compiles for the CPU or GPU. If
the environment is written in JAX too, as the gymnax environments are, nothing stops us from
tracing the *whole training run*: the rollout, the advantages and the epochs of minibatch updates
are each a `jax.lax.scan`, the updates follow each other in one more scan, and `jax.vmap` turns the
training of one agent into the training of many, with different seeds, in the same program
(PureJaxRL, Lu et al., 2022). Python runs once, to trace; after that the run is compiled code.

```
pip install -r requirements.txt
python ppo_jax.py                                      # CartPole-v1, one agent
python ppo_jax.py --num-seeds 16                       # sixteen agents in one program, over the devices
python ppo_jax.py --env Breakout-MinAtar               # MinAtar, a small CNN
python ppo_jax.py --env Pendulum-v1                    # continuous actions, a Gaussian policy
python ppo_jax.py --env Breakout                       # real Atari, its games stepped inside the program
python ppo_jax.py --eval runs/<run>/checkpoint.msgpack
```

What JAX changes about writing RL, as this page meets it:

* **Purity.** A traced function runs once, at trace time: a `print`, a global counter or
  `np.random` inside it would act once, not at every step. All that changes is carried explicitly
  (the `Runner`), and randomness comes from keys split and passed along: a run is a function of its
  key, and resuming it is restoring a pytree.
* **Loops are scans.** A Python loop is unrolled by the tracer; `jax.lax.scan` compiles its body
  once. A scan has no `break`: an update stopped early is a flag that turns the remaining steps
  into no-ops.
* **`vmap` batches anything.** One gymnax environment becomes `num_envs` of them, and one training
  run becomes `num_seeds` of them, by the same transformation.
* **Compile once, for one shape.** A new shape compiles again, so shapes are fixed everywhere:
  evaluation steps every game, finished or not; the last, shorter chunk of a run skips its extra
  updates with `lax.cond` instead of compiling a shorter program; and since each update ends a
  different number of episodes, the returns of the last 100, the run's score, are kept in a ring of
  100 slots rather than in a list.
* **The host is far away.** A compiled run cannot write a TensorBoard event or a checkpoint, and
  a Ctrl-C cannot reach it: the command line runs it a chunk (two seconds' worth of updates or so)
  at a time and does those between, taking back from the device one flag a chunk while a thread
  of its own logs the last chunk as the next one computes.

What to expect, measured on this project's 2-core CPU (an AMD EPYC; `python
benchmarks/ppo_jax_speed.py --part overhead --seeds 1 16 --repeats 2`, whose results are in
`benchmarks/results/ppo_jax-cartpole-epyc-avx512.json`): CartPole-v1's default run, 500,000 steps
of 4 environments x 128 steps, traces and compiles in about 5 s and runs in 2.5 s (200,000 steps a
second); the whole `python ppo_jax.py` process takes about 9 s, and the agent ends at the maximum
return of 500. On a CPU, agents side by side gain little from `vmap` (sixteen ran at 290,000 steps
a second in all, against 200,000 for one): PureJaxRL's thousands of agents at once are a GPU's
game.

![ppo_jax.py on CartPole-v1: the mean return of the last 100 episodes of 16 agents, trained side by side in one compiled program, rises from about 30 to 500 by 365k steps and stays there to 500k; the spread across agents is shaded, and PureJaxRL's 500 is drawn as a dashed line](benchmarks/results/cartpole-jax.png)

`python benchmarks/learning_curves.py cartpole-jax` made the curve: sixteen agents of seed 1, the
mean return of each one's last 100 episodes at 500 from 365k steps on.
Pendulum-v1 with its preset, observations and rewards normalised: twelve agents between -128 and
-166 after 1M steps each, each past -250 within 94,000 steps (`benchmarks/README.md` has the table).

![ppo_jax.py on Breakout-MinAtar: the mean return of the last 100 episodes of 4 agents, trained side by side in one compiled program, climbs to 35 at 2M steps, passes 40 at 5.3M and reaches 50.2 at 10M, the agents ending between 28.8 and 75.2; PureJaxRL's end, about 40, is drawn as a dashed line](benchmarks/results/minatar-breakout-jax.png)

`python benchmarks/learning_curves.py minatar-breakout-jax` made the Breakout-MinAtar curve: four
agents of seed 1, 10M steps each with the MinAtar preset, end at a mean return of 50.2 over their
last 100 episodes (28.8 to 75.2), against about 40 at the end of PureJaxRL's run; 47 minutes for
the four together on 2 CPU cores. With the preset's former learning rate, 5e-4, three of the same
four stalled at about 7 (Part 3, beside the presets).

![ppo_jax.py on Atari Breakout, seeds 1 and 2 with the 10M-step schedule to 2M steps: the mean score of the last 100 games climbs from about 1 to 15.9 at 500k, 24.0 at 1M and 56.9 at 2M, the two seeds shaded between them; ppo_atari.py's mean over its seeds 1 and 2, 46.5 at 2M, is drawn dotted beside it, and CleanRL's 20 at 1M and about 47.5 at 2M as points](benchmarks/results/breakout-jax.png)

`python benchmarks/learning_curves.py breakout-jax` made the Atari curve: Breakout with every
default, the 10M-step schedule stopped at 2M steps, seeds 1 and 2. It learns at least as well as
`ppo_atari.py`: the real scores of the last 100 whole games average 15.9 at 500k steps, 24.0 at
1M and 56.9 at 2M (57.3 and 56.6), against 14.1, 21.5 and 46.5 for `ppo_atari.py`'s two seeds
and about 20 at 1M and 47.5 at 2M for CleanRL. `python benchmarks/ppo_jax_speed.py --part
atari`: 233 steps a second, `ppo_atari.py` 328 to 350 (2 AVX2 cores).

Papers and projects: PPO (Schulman et al., 2017, arXiv:1707.06347); GAE (Schulman et al., 2016,
arXiv:1506.02438); PureJaxRL, the whole run as one JAX program (Lu et al., 2022, "Discovered Policy
Optimisation", NeurIPS 35); gymnax, classic control and MinAtar in JAX (Lange, 2022,
github.com/RobertTLange/gymnax); MinAtar (Young and Tian, 2019, arXiv:1903.03176); the Atari
protocol and network of DQN (Mnih et al., 2015, Nature 518) and Machado et al. (2018, JAIR 61); time
limits as truncation (Pardo et al., 2018, arXiv:1712.00378); the implementation details catalogued
by Huang et al. (2022, "The 37 implementation details of PPO", ICLR blog track).

Licence: MIT (see LICENSE in the repository this file comes from); copy it freely, keeping this line.

The page in order:

1. **The algorithm**, for one agent: `Config` and where its defaults come from; the environment
   (`BatchedEnv`); the policy distributions and the actor-critics (`make_network`); `compute_gae`
   and `normalize_advantages`; `ppo_loss`; for continuous actions, the running statistics that
   normalise observations and scale rewards (`Normalizer`); the update (`make_update_agent`, two
   nested scans); the loop of training (`make_train`: `train(key)` is a whole run, `train_chunk` a
   part of one).
2. **Sampling at speed**: Atari, its games stepped from inside the compiled program by ale-py's
   vector environment (`AtariEnv`), and the reset step that is no transition.
3. **Running it for real**: the command line, the CPU's convolution, checkpoints, logging, Ctrl-C,
   the training runs, evaluation, `main()`.
4. **More than one device**: the agents of `--num-seeds` spread over devices (`jax.sharding`).
"""

from __future__ import annotations

import argparse
import ast
import collections
import concurrent.futures
import contextlib
import dataclasses
import fcntl
import functools
import difflib
import fractions
import importlib
import inspect
import io
import math
import os
import shlex
import signal
import sys
import tempfile
import textwrap
import threading
import time
import types
import typing
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, NamedTuple

if __name__ == "__main__":  # a Ctrl-C while the libraries below load: exit status 130 at once, not a traceback
    signal.signal(signal.SIGINT, lambda signum, frame: os._exit(128 + signum))

import flax.linen as nn
import flax.serialization
import gymnasium as gym
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.plugins.text.summary_v2 import text_pb
from tensorboard.summary.writer import event_file_writer


# ## Part 1: The algorithm
#
# PPO for one agent, as pure functions that JAX compiles, in the order they run. A reader who stops
# at the end of this part has seen all of PPO; the parts after it run the same functions on Atari
# (Part 2), from a command line (Part 3) and with many agents spread out (Part 4).
#
# ### Hyperparameters
#
# One dataclass holds the settings of the algorithm, each documented by the string under it, which
# is also its `--help` text. The defaults are CartPole-v1's; other kinds of environment start from
# presets of their own (Part 3). Where each default comes from, beside PureJaxRL's CartPole settings
# (`purejaxrl/ppo.py`), CleanRL's (`cleanrl/ppo.py`) and the PPO paper's for Atari (its Table 5):
#
# | setting | ours | PureJaxRL | CleanRL | PPO paper | why ours |
# |---|---|---|---|---|---|
# | `total_timesteps` | 500,000 | 500,000 | 500,000 | 10M (Atari) | the learning test's four agents all end at 475 or more |
# | `num_envs` x `num_steps` | 4 x 128 | 4 x 128 | 4 x 128 | 8 x 128 | PureJaxRL's and CleanRL's |
# | `learning_rate` | 2.5e-4, annealed | 2.5e-4, annealed | 2.5e-4, annealed | 2.5e-4 x $\alpha$ | theirs |
# | `clip_range` $\epsilon$ | 0.2, annealed | 0.2, constant | 0.2, constant | 0.1 x $\alpha$ | annealed as the paper's $\epsilon$ and `ppo_atari.py`'s are (and baselines' for Atari until 2019); PureJaxRL, CleanRL and baselines' last version keep it constant |
# | `update_epochs` | 4 | 4 | 4 | 3 | PureJaxRL's and CleanRL's |
# | `num_minibatches` | 4 (of 128) | 4 | 4 | 4 (of 32 x 8 = 256) | theirs |
# | `gamma`, `gae_lambda`, `ent_coef` | 0.99, 0.95, 0.01 | the same | the same | the same | all agree |
# | `vf_coef` | 0.5 | 0.5 | 0.5 | 1 | theirs; with the $\frac12$ inside the value loss, the squared error weighs 0.25 (the paper's: 1) |
# | `max_grad_norm`, Adam's $\epsilon$ | 0.5, 1e-5 | 0.5, 1e-5 | 0.5, 1e-5 | none, not given | baselines', kept by all three |
# | value clipping (`clip_value_loss`) | at $\epsilon$; off in continuous control's preset | at 0.2 | at 0.2 | none | baselines', and so annealed with $\epsilon$ here; off where it measured worse (Pendulum: Part 3's presets, the runs in `benchmarks/README.md`) |
#
# "Annealed" means multiplied by $1 - k/N$ at update $k = 0, 1, \dots, N-1$ of $N$: the full value at
# the first update, falling linearly to $1/N$ of it at the last (not to 0), in PureJaxRL, CleanRL and
# baselines alike; the paper's $\alpha$ falls from 1 to 0 over the course of learning.


@dataclass
class Config:
    env: str = "CartPole-v1"
    """Environment: a gymnax id (CartPole-v1, Acrobot-v1, Pendulum-v1, Breakout-MinAtar, ...) or an Atari
    game (Breakout, ALE/Breakout-v5), whose games ale-py's vector environment steps from inside the program."""
    num_seeds: int = 1
    """Agents trained side by side in one compiled program, each from its own seed (gymnax only)."""
    total_timesteps: int = 500_000
    """Environment steps to train each agent for, summed over its environments."""
    num_envs: int = 4
    """Environments each agent plays at once."""
    num_steps: int = 128
    """Steps each environment plays per update; a batch is `num_envs * num_steps` transitions."""
    learning_rate: float = 2.5e-4
    """Adam's learning rate at the first update; annealed linearly, to 1/N of it at the last of N updates."""
    clip_range: float = 0.2
    """PPO's clip range epsilon (of the ratio and of the value) at the first update; annealed as the learning rate."""
    gamma: float = 0.99
    """Discount factor."""
    gae_lambda: float = 0.95
    """GAE's lambda: 0 is one-step TD, 1 is the Monte Carlo return."""
    num_minibatches: int = 4
    """Minibatches the batch is split into for each epoch."""
    update_epochs: int = 4
    """Passes over the batch per update."""
    ent_coef: float = 0.01
    """Weight of the entropy bonus."""
    vf_coef: float = 0.5
    """Weight of the value loss."""
    max_grad_norm: float = 0.5
    """Clip the global norm of the gradient to this."""
    clip_value_loss: bool = True
    """Clip the value prediction's move around the old one at the clip range, as the ratio is clipped."""
    target_kl: float | None = None
    """Skip an update's remaining epochs once an epoch's last minibatch has an approximate KL divergence to the old
    policy above this (CleanRL's rule)."""
    seed: int = 1
    """Seeds everything: the agents' keys are split from it, and each Atari game gets a seed derived from it."""

    @property
    def batch_size(self) -> int:
        return self.num_envs * self.num_steps

    @property
    def minibatch_size(self) -> int:
        return self.batch_size // self.num_minibatches

    @property
    def num_updates(self) -> int:
        return self.total_timesteps // self.batch_size


# ### The environment
#
# A gymnax environment is a pair of pure functions, `reset(key, params) -> (obs, state)` and
# `step(key, state, action, params) -> (obs, state, reward, terminated, truncated, info)`. The state is
# a pytree of arrays that we carry ourselves, so `jax.vmap` turns one environment into `num_envs` of
# them, and the step can be traced into the training program like any other function. gymnax 1.x
# resets an environment within the step in which it ended (the returned observation is already
# the first of the next episode) and hands the last observation of the ended one back in
# `info["final_observation"]`: we need it to bootstrap a truncated episode.
#
# Besides the observation, the reward and the two ways an episode ends, a step reports a
# `StepInfo`. For gymnax most of it is trivial: every step is a transition of the agent's, and the
# return we log is the sum of the environment's rewards (which the agent learns from as they are,
# but for continuous control's preset, which scales them: Part 3). Atari (Part 2) is where it is
# not: its vector environment spends a step on each reset, which is no transition, and the score we
# log is the game's real one over a whole game, not the clipped reward of one life.


class StepInfo(NamedTuple):
    """What a step of `num_envs` environments reports besides `(obs, state, rewards, terminated, truncated)`."""

    final_obs: jax.Array
    """The observation the step led to, before any reset: where an episode was truncated, its last one."""
    valid: jax.Array
    """Whether the step is a transition of the agent's (Atari's reset steps are not); only those are learned from."""
    score: jax.Array
    """The points the step scored, unclipped: what the logged return (`charts/episodic_return`) adds up."""
    length: jax.Array
    """What the step adds to the logged episode's length: 1 step (Atari: its emulator frames)."""
    episode_over: jax.Array
    """Whether the logged episode ended (Atari: the whole game, not a life)."""


class ImportedOnFirstUse(types.ModuleType):
    """A stand-in for the module of its name, which imports the real one when an attribute is first read."""

    def __getattr__(self, attribute: str) -> Any:
        if sys.modules.get(self.__name__) is self:  # used while it stands in: make way for the real one
            del sys.modules[self.__name__]
        return getattr(importlib.import_module(self.__name__), attribute)


def import_gymnax() -> types.ModuleType:
    """gymnax, imported here rather than at the top: an Atari run need not spend the time.

    Importing gymnax imports every one of its environments, and five of them import seaborn or
    matplotlib's pyplot at their top, to draw frames that training never asks for. On a 2-core Xeon
    gymnax added 2.7 s to `import jax, flax, optax` (4.6 s against 1.9), about 1.7 of them for those
    modules and the scipy and pandas they bring (`benchmarks/README.md`). While
    gymnax is imported, those two names are stand-ins that import the real module on first use; after
    it, an import of either finds the real module again.
    """
    stand_ins = [name for name in ("seaborn", "matplotlib.pyplot") if name not in sys.modules]
    sys.modules.update({name: ImportedOnFirstUse(name) for name in stand_ins})
    try:
        import gymnax
    finally:
        for name in stand_ins:
            if isinstance(sys.modules.get(name), ImportedOnFirstUse):
                del sys.modules[name]
    return gymnax


class BatchedEnv:
    """`num_envs` copies of a gymnax environment, stepped together, with the facts the agent needs.

    The shape of an observation and the number of actions (or, for continuous actions, their
    dimension) are read from the environment's spaces here, and nowhere written out again.
    Continuous actions are clipped to the action space's bounds on their way to the environment;
    the agent keeps the unclipped sample, whose log-probability is the one its policy assigned.
    """

    resets_within_step = True
    """gymnax resets an environment in the step that ends its episode (Atari's vector env, in the next: Part 2)."""
    frames = False
    """Whether observations are stacks of screen frames, channels first (Atari's, Part 2): the Nature CNN's input."""

    def __init__(self, env_id: str, num_envs: int):
        gymnax = import_gymnax()
        self.env, self.params = gymnax.make(env_id)
        self.num_envs = num_envs
        self.obs_shape = tuple(self.env.observation_space(self.params).shape)
        space = self.env.action_space(self.params)
        self.continuous = isinstance(space, gymnax.environments.spaces.Box)
        self.action_dim = int(np.prod(space.shape)) if self.continuous else int(space.n)
        self.low, self.high = (space.low, space.high) if self.continuous else (None, None)
        self.max_steps = int(self.params.max_steps_in_episode)

    def reset(self, key: jax.Array) -> tuple[jax.Array, Any]:
        keys = jax.random.split(key, self.num_envs)
        return jax.vmap(self.env.reset, in_axes=(0, None))(keys, self.params)

    def step(self, key: jax.Array, state: Any, actions: jax.Array):
        """`(obs, state, rewards, terminated, truncated, info)`, each with a leading `num_envs` axis; `info` a `StepInfo`."""
        if self.continuous:
            actions = jnp.clip(actions, self.low, self.high)
        keys = jax.random.split(key, self.num_envs)
        obs, state, rewards, terminated, truncated, info = jax.vmap(
            self.env.step, in_axes=(0, 0, 0, None))(keys, state, actions, self.params)
        done = terminated | truncated
        return obs, state, rewards, terminated, truncated, StepInfo(
            info["final_observation"], jnp.ones_like(done), rewards, jnp.ones(self.num_envs, jnp.int32), done)


# Environments that gymnax does not have join through this list: each entry is a test of an id and
# what makes `num_envs` of them with `BatchedEnv`'s interface and facts. Part 2 adds Atari's games.
OTHER_ENVS: list[tuple[Callable[[str], bool], Callable[[str, int, Config], BatchedEnv]]] = []


def make_env(env_id: str, num_envs: int, config: Config) -> BatchedEnv:
    """`num_envs` environments of `env_id`: gymnax's, unless a kind in `OTHER_ENVS` (Part 2: Atari) claims the id."""
    for claims, kind in OTHER_ENVS:
        if claims(env_id):
            return kind(env_id, num_envs, config)
    return BatchedEnv(env_id, num_envs)


# ### The policy, written out
#
# A policy network outputs the parameters of a distribution over actions; PPO needs three things of
# it: a sample, the log-probability of an action, and the entropy. Both distributions are a few
# lines of `jax.numpy`. They are `NamedTuple`s, and so pytrees: a network can return one from a
# jitted function and `vmap` can batch it like any array.


class Categorical(NamedTuple):
    r"""A distribution over `n` discrete actions, $\pi(a) = \mathrm{softmax}(\ell)_a$, given by its logits $\ell$.

    $$\log \pi(a) = \ell_a - \log \textstyle\sum_b e^{\ell_b}, \qquad
      H = -\textstyle\sum_a \pi(a) \log \pi(a).$$

    `log_softmax` computes the first without overflow (it subtracts the largest logit first).
    """

    logits: jax.Array

    def sample(self, key: jax.Array) -> jax.Array:
        return jax.random.categorical(key, self.logits)

    def log_prob(self, actions: jax.Array) -> jax.Array:
        log_probs = jax.nn.log_softmax(self.logits)
        return jnp.take_along_axis(log_probs, actions[..., None].astype(jnp.int32), axis=-1)[..., 0]

    def entropy(self) -> jax.Array:
        log_probs = jax.nn.log_softmax(self.logits)
        return -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)


class Gaussian(NamedTuple):
    r"""A diagonal Gaussian over continuous actions, $a \sim \mathcal N(\mu, \mathrm{diag}\,\sigma^2)$, with $\log\sigma$ given.

    $$\log \pi(a) = \sum_i \left[ -\frac{(a_i - \mu_i)^2}{2\sigma_i^2} - \log\sigma_i - \tfrac12 \log 2\pi \right],
      \qquad H = \sum_i \left[ \tfrac12 + \tfrac12 \log 2\pi + \log\sigma_i \right].$$

    The entropy does not depend on the mean: only a wider policy explores more.
    """

    mean: jax.Array
    log_std: jax.Array

    def sample(self, key: jax.Array) -> jax.Array:
        return self.mean + jnp.exp(self.log_std) * jax.random.normal(key, self.mean.shape)

    def log_prob(self, actions: jax.Array) -> jax.Array:
        z = (actions - self.mean) * jnp.exp(-self.log_std)
        return jnp.sum(-0.5 * z**2 - self.log_std - 0.5 * math.log(2 * math.pi), axis=-1)

    def entropy(self) -> jax.Array:
        return jnp.sum(0.5 + 0.5 * math.log(2 * math.pi) + self.log_std, axis=-1)


# ### The actor-critics
#
# A flax module is a description of a network: `init(key, obs)` returns its parameters as a
# pytree, and `apply(params, obs)` runs it. The parameters live outside the module, which is what
# lets them be carried through `scan`, differentiated by `jax.grad` and batched by `vmap`. Which
# network an environment gets is decided in one place, `make_network`, from the environment's
# observations and actions. The layers are flax's `nn.Dense` and `nn.Conv`, the batch first, as
# PureJaxRL and CleanRL write them. The convolutional networks take their convolution layer as a
# field, `nn.Conv` unless told otherwise: a layer with the same fields and parameters may compute
# it another way where a backend needs it (Part 3 does, on a CPU).


def dense(features: int, gain: float = math.sqrt(2), name: str | None = None) -> nn.Dense:
    r"""A linear layer with orthogonal weights scaled by `gain` and zero biases.

    Orthogonal matrices keep the norm of what passes through, so activations neither explode nor
    vanish with depth; $\sqrt 2$ makes up for the half of a ReLU's input cut to 0, and PureJaxRL and
    CleanRL keep it for their tanh layers too, as `MLPActorCritic` does. The policy head
    starts at gain 0.01, so the first policy is almost uniform; the value head at gain 1.
    """
    return nn.Dense(features, kernel_init=nn.initializers.orthogonal(gain), bias_init=nn.initializers.zeros, name=name)


def convolution(layer: Callable[..., nn.Module], features: int, size: int, stride: int, name: str) -> nn.Module:
    """A `size x size` convolution without padding, `layer` (`nn.Conv` or one like it), initialised as `dense`."""
    return layer(features, (size, size), strides=(stride, stride), padding="VALID",
                 kernel_init=nn.initializers.orthogonal(math.sqrt(2)), bias_init=nn.initializers.zeros, name=name)


class MLPActorCritic(nn.Module):
    r"""For vector observations: a policy network and a value network, each two 64-unit tanh layers.

    The two share nothing, as in PPO's MuJoCo experiments: networks this small gain nothing from
    sharing, and the value loss cannot disturb the policy's features. For continuous actions the
    policy outputs the Gaussian's mean; its log standard deviation is a parameter of its own, the
    same in every state, starting at 0 ($\sigma = 1$).
    """

    action_dim: int
    continuous: bool = False

    @nn.compact
    def __call__(self, obs: jax.Array) -> tuple[Categorical | Gaussian, jax.Array]:
        def tower(name: str, outputs: int, gain: float) -> jax.Array:
            hidden = nn.tanh(dense(64, name=f"{name}_hidden_0")(obs))
            hidden = nn.tanh(dense(64, name=f"{name}_hidden_1")(hidden))
            return dense(outputs, gain, name=name)(hidden)

        policy_output = tower("policy", self.action_dim, gain=0.01)
        values = tower("value", 1, gain=1.0)[..., 0]
        if not self.continuous:
            return Categorical(policy_output), values
        log_std = self.param("log_std", nn.initializers.zeros, (self.action_dim,))
        return Gaussian(policy_output, jnp.broadcast_to(log_std, policy_output.shape)), values


class MinAtarActorCritic(nn.Module):
    """For MinAtar's 10 x 10 grids of 0/1 channels (channels last): the MinAtar paper's network, shared by two heads.

    One 3 x 3 convolution of 16 filters and a 128-unit layer (Young and Tian, 2019).
    """

    n_actions: int
    conv: Callable[..., nn.Module] = nn.Conv

    @nn.compact
    def __call__(self, obs: jax.Array) -> tuple[Categorical, jax.Array]:
        hidden = nn.relu(convolution(self.conv, 16, 3, 1, "Conv_0")(obs))     # batch x 8 x 8 x 16
        hidden = nn.relu(dense(128, name="Dense_0")(hidden.reshape(*hidden.shape[:-3], -1)))
        return Categorical(dense(self.n_actions, 0.01, name="policy")(hidden)), dense(1, 1.0, name="value")(hidden)[..., 0]


class NatureActorCritic(nn.Module):
    """For Atari's frames: the DQN paper's "Nature CNN" torso (Mnih et al., 2015), shared by a policy head and a value head.

    Frames arrive as `uint8` stacks of 4, channels first as the emulator's vector env writes them
    (Part 2); they are scaled to [0, 1] and their channels moved last, where `nn.Conv` takes them.
    """

    n_actions: int
    conv: Callable[..., nn.Module] = nn.Conv

    @nn.compact
    def __call__(self, obs: jax.Array) -> tuple[Categorical, jax.Array]:
        x = jnp.moveaxis(obs, -3, -1).astype(jnp.float32) / 255.0               # batch x 84 x 84 x 4
        x = nn.relu(convolution(self.conv, 32, 8, 4, "Conv_0")(x))              # -> 20 x 20 x 32
        x = nn.relu(convolution(self.conv, 64, 4, 2, "Conv_1")(x))              # -> 9 x 9 x 64
        x = nn.relu(convolution(self.conv, 64, 3, 1, "Conv_2")(x))              # -> 7 x 7 x 64
        hidden = nn.relu(dense(512, name="Dense_0")(x.reshape(*x.shape[:-3], -1)))
        return Categorical(dense(self.n_actions, 0.01, name="policy")(hidden)), dense(1, 1.0, name="value")(hidden)[..., 0]


def make_network(env: BatchedEnv, conv: Callable[..., nn.Module] = nn.Conv) -> nn.Module:
    """The actor-critic for `env`: the Nature CNN for stacks of screen frames, the MinAtar CNN for grids of
    channels (both with `conv` as their convolution layer), the MLP for vectors."""
    if env.frames:
        return NatureActorCritic(env.action_dim, conv)
    if len(env.obs_shape) == 3:
        return MinAtarActorCritic(env.action_dim, conv)
    return MLPActorCritic(env.action_dim, continuous=env.continuous)


# ### Generalized advantage estimation
#
# The policy gradient needs to know how much better an action was than the policy's average at
# that state: the advantage $A_t$. GAE (Schulman et al., 2016) blends estimates of it from one step
# to the whole rollout. A Python loop over time steps would be unrolled by the tracer into
# `num_steps` copies of its body; `jax.lax.scan` compiles the body once and loops over it.


def compute_gae(rewards: jax.Array, values: jax.Array, next_values: jax.Array, terminated: jax.Array,
                truncated: jax.Array, gamma: float, gae_lambda: float) -> tuple[jax.Array, jax.Array]:
    r"""Advantages and returns for a rollout; every argument is `[num_steps, num_envs]`.

    With the TD error of step $t$

    $$\delta_t = r_t + \gamma (1 - \mathrm{terminated}_t) V(s_{t+1}) - V(s_t),$$

    the advantage is the exponentially weighted sum of the TD errors that follow, cut where the
    episode ends:

    $$\hat A_t = \delta_t + \gamma \lambda (1 - \mathrm{done}_t) \hat A_{t+1},
      \qquad \mathrm{done}_t = \mathrm{terminated}_t \lor \mathrm{truncated}_t ,$$

    computed backwards from the last step with `scan(..., reverse=True)`, the carry being
    $\hat A_{t+1}$. The returns the value function regresses to are $\hat A_t + V(s_t)$.

    `next_values[t]` is $V(s_{t+1})$ of the observation step $t$ led to, *before* any reset: where
    an episode ended, the environment has already moved on to the next one, and the caller
    supplies the value of the ended episode's final observation.

    **Why termination and truncation stay apart.** A termination (the pole fell, the game is over)
    has no future: the value after it is 0. A truncation (CartPole's 500-step limit, Atari's frame
    cap) only means we stopped watching: the episode would have gone on earning reward, so
    $\delta_t$ bootstraps from $V$ of the final observation, while the sum over later TD errors is
    still cut, since those belong to the next episode. PureJaxRL folds both into one `done` that
    zeroes the bootstrap: on CartPole-v1 every perfect episode ends by truncation at step 500, and
    folding teaches the critic that a balanced pole is worth nothing after 500 steps, a fact it
    cannot see in its observation (there is no clock in it). That biases the value of every state
    near the limit towards 0, and the advantages of the actions taken there with it; Pardo et al.
    (2018) measure the harm.

    A step that is no transition of the agent's (Atari's reset steps, Part 2) needs nothing here: it
    always follows the end of an episode, which cuts the sum before it, so no advantage of a real
    transition reads its TD error. Its own advantage is garbage, and the loss leaves it out.
    """
    not_terminated = 1.0 - terminated.astype(jnp.float32)
    not_done = 1.0 - (terminated | truncated).astype(jnp.float32)
    deltas = rewards + gamma * not_terminated * next_values - values

    def backwards(next_advantage: jax.Array, step: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        delta, not_done = step
        advantage = delta + gamma * gae_lambda * not_done * next_advantage
        return advantage, advantage

    _, advantages = jax.lax.scan(backwards, jnp.zeros_like(deltas[0]), (deltas, not_done), reverse=True)
    return advantages, advantages + values


def normalize_advantages(advantages: jax.Array, valid: jax.Array | None = None) -> jax.Array:
    r"""The advantages of a minibatch, shifted and scaled to mean 0 and standard deviation 1:

    $$\hat A_t \leftarrow \frac{\hat A_t - \mathrm{mean}(\hat A)}{\mathrm{std}(\hat A) + 10^{-8}}.$$

    The gradient's scale then no longer depends on the rewards', and about half the actions of a
    minibatch are pushed up, half down. Per minibatch, as in baselines, CleanRL and PureJaxRL. The
    mean and deviation are those of the `valid` transitions (all, if not given).
    """
    mean = masked_mean(advantages, valid)
    return (advantages - mean) / (jnp.sqrt(masked_mean((advantages - mean) ** 2, valid)) + 1e-8)


def masked_mean(values: jax.Array, valid: jax.Array | None = None) -> jax.Array:
    """The mean of `values` where `valid` (everywhere, if not given); 0 if none is."""
    if valid is None:
        return values.mean()
    return jnp.where(valid, values, 0.0).sum() / jnp.maximum(valid.sum(), 1)


# ### The clipped objective
#
# A policy gradient step is only accurate near the policy that collected the data. PPO takes many
# minibatch steps on one batch and keeps the new policy near the old one by taking away any gain
# from moving the probability ratio $r_t(\theta) = \pi_\theta(a_t|s_t) / \pi_{\theta_\text{old}}(a_t|s_t)$
# outside $[1 - \epsilon, 1 + \epsilon]$.


def ppo_loss(log_probs: jax.Array, old_log_probs: jax.Array, advantages: jax.Array, values: jax.Array,
             old_values: jax.Array, returns: jax.Array, entropy: jax.Array, clip_range: float | jax.Array,
             config: Config, valid: jax.Array | None = None) -> dict[str, jax.Array]:
    r"""PPO's loss on a minibatch (advantages already normalised): its terms by name, the total under `loss`.

    The policy term is the negated clipped surrogate of Schulman et al. (2017, eq. 7):

    $$L^\text{CLIP} = -\mathbb{E}_t\left[\min\left(r_t \hat A_t,\;
      \mathrm{clip}(r_t, 1 - \epsilon, 1 + \epsilon)\, \hat A_t\right)\right].$$

    The minimum makes it pessimistic: once the ratio has moved past the clip in the direction the
    advantage favours, the clipped term is the smaller and constant in $\theta$, and its gradient
    is zero; if the ratio moved the wrong way, the unclipped term is taken and pulls it back.

    The value term clips the same way around the old prediction, as the paper's reference code
    does, and takes the larger error:

    $$L^V = \tfrac12 \mathbb{E}_t \max\left((V - R)^2,\;
      (V_\text{old} + \mathrm{clip}(V - V_\text{old}, -\epsilon, \epsilon) - R)^2\right),$$

    or, with `clip_value_loss` off (CleanRL's `--no-clip-vloss`), $\tfrac12 \mathbb{E}_t (V - R)^2$.

    The entropy bonus $S$ keeps the policy from collapsing early. In all, with the coefficients
    $c_V$ and $c_S$ of `config`, $L = L^\text{CLIP} + c_V L^V - c_S S$.

    `approx_kl` estimates $\mathrm{KL}(\pi_\text{old} \,\|\, \pi_\theta)$ with
    $\mathbb{E}[(r - 1) - \log r]$, unbiased and never negative (Schulman, "Approximating KL
    divergence", 2020); `clipfrac` is the share of samples whose ratio is outside the clip. Both are
    diagnostics: `stop_gradient` keeps them out of the derivative.

    The terms come back by name: the update averages each over its minibatch steps and the command
    line logs each but the total as `losses/<name>`. A new term (a KL penalty, say) is one more entry
    here, its coefficient one more field of `Config`, and nothing else changes.

    $\mathbb{E}_t$ is the mean over the minibatch's transitions: where `valid` is given, over those
    it marks, so that a step which is no transition of the agent's (Atari's resets) weighs nothing.
    """
    mean = functools.partial(masked_mean, valid=valid)
    log_ratio = log_probs - old_log_probs
    ratio = jnp.exp(log_ratio)
    # Clip the ratio so one update cannot move the policy far: $\mathrm{clip}(r_t, 1-\epsilon, 1+\epsilon)$.
    clipped_ratio = jnp.clip(ratio, 1.0 - clip_range, 1.0 + clip_range)
    policy_loss = mean(jnp.maximum(-advantages * ratio, -advantages * clipped_ratio))

    value_errors = (values - returns) ** 2
    if config.clip_value_loss:
        clipped_values = old_values + jnp.clip(values - old_values, -clip_range, clip_range)
        value_errors = jnp.maximum(value_errors, (clipped_values - returns) ** 2)
    value_loss = 0.5 * mean(value_errors)

    entropy = mean(entropy)
    loss = policy_loss + config.vf_coef * value_loss - config.ent_coef * entropy
    ratio, log_ratio = jax.lax.stop_gradient((ratio, log_ratio))
    approx_kl = mean((ratio - 1.0) - log_ratio)
    clipfrac = mean((jnp.abs(ratio - 1.0) > clip_range).astype(jnp.float32))
    return dict(loss=loss, policy_loss=policy_loss, value_loss=value_loss, entropy=entropy, approx_kl=approx_kl,
                clipfrac=clipfrac)


def linear_schedule(initial: float, update: int | jax.Array, num_updates: int) -> jax.Array:
    """`initial` annealed linearly: the full value at update 0, `initial / num_updates` at the last."""
    return initial * (1.0 - update / num_updates)


def explained_variance(predictions: jax.Array, targets: jax.Array, valid: jax.Array | None = None) -> jax.Array:
    r"""$1 - \mathrm{Var}[y - \hat y] / \mathrm{Var}[y]$: 1 for a perfect value function, 0 for a constant one
    (over the `valid` transitions, if given)."""
    def variance(x: jax.Array) -> jax.Array:
        return masked_mean((x - masked_mean(x, valid)) ** 2, valid)

    return jnp.where(variance(targets) == 0, jnp.nan, 1.0 - variance(targets - predictions) / variance(targets))


# ### Normalised observations and scaled rewards, for continuous actions
#
# Continuous control is trained on what the environment gives, rescaled twice (details 6 to 9 of
# the continuous-action list of Huang et al., 2022): each observation is standardised by the
# running mean and variance of all observations seen so far, and each reward divided by the
# running standard deviation of the discounted return, each result clipped to $\pm 10$. Pendulum's
# angular velocity runs to 8 while its sine and cosine stay within 1; its rewards are $-16$ to 0,
# its returns in the hundreds. Rescaled, the network's inputs and the value function's targets
# are of order 1 whatever the task, and the same learning rate serves them all. PPO's reference code
# for MuJoCo does this (baselines' `VecNormalize`), and so do CleanRL's `ppo_continuous_action.py`
# (gym's `NormalizeObservation` and `NormalizeReward`, then a clip) and PureJaxRL's continuous PPO
# (its `NormalizeVecObservation` and `NormalizeVecReward` wrappers, which do not clip).
#
# Which environments get it is decided by the action space: those with continuous actions (the
# `Gaussian` policy), as in all three; CartPole and MinAtar, like baselines' and CleanRL's Atari
# and PureJaxRL's discrete PPO, see their observations and rewards as they are.
#
# The statistics are part of the training state, a `Normalizer` in the `Runner`: each agent under
# `vmap` keeps its own, a checkpoint saves them, and evaluation reads them without updating them
# (the policy learned on observations scaled so, and only so).


class RunningMoments(NamedTuple):
    r"""The running mean and variance of every sample seen so far (over a batch's first axis), and their count.

    A batch of $n_B$ samples with mean $\mu_B$ and variance $\sigma_B^2$ joins the $n$ seen before
    by the parallel formula of Chan et al. (1979):

    $$\delta = \mu_B - \mu, \qquad n' = n + n_B, \qquad \mu' = \mu + \delta \frac{n_B}{n'}, \qquad
      \sigma'^2 = \frac{n \sigma^2 + n_B \sigma_B^2 + \delta^2 n n_B / n'}{n'}.$$

    The statistics start at a mean of 0 and a variance of 1 worth $10^{-4}$ samples, as baselines'
    `RunningMeanStd`, CleanRL's and PureJaxRL's do: the first batch all but replaces them, and nothing
    is divided by 0.
    """

    mean: jax.Array
    var: jax.Array
    count: jax.Array

    @classmethod
    def start(cls, shape: tuple[int, ...] = ()) -> RunningMoments:
        return cls(jnp.zeros(shape), jnp.ones(shape), jnp.array(1e-4, jnp.float32))

    def update(self, batch: jax.Array) -> RunningMoments:
        batch_mean, batch_var, batch_count = batch.mean(axis=0), batch.var(axis=0), batch.shape[0]
        delta = batch_mean - self.mean
        count = self.count + batch_count
        var = (self.var * self.count + batch_var * batch_count + delta**2 * self.count * batch_count / count) / count
        return RunningMoments(self.mean + delta * batch_count / count, var, count)

    def std(self) -> jax.Array:
        r"""$\sqrt{\sigma^2 + 10^{-8}}$: the $10^{-8}$ of baselines, CleanRL and PureJaxRL, so that a constant input divides by no 0."""
        return jnp.sqrt(self.var + 1e-8)


class Normalizer(NamedTuple):
    r"""What an agent on continuous actions sees: observations standardised, rewards scaled, both clipped to $\pm 10$.

    At every step, each environment's discounted return so far is accumulated,
    $R_t = r_t + \gamma R_{t-1}$, reset to 0 after the step that ends an episode (by termination
    or by truncation: the next one starts from nothing), with the $\gamma$ of `Config`. The reward
    the agent learns from is $\mathrm{clip}(r_t / \sigma_R, -10, 10)$, where $\sigma_R$ is the
    running standard deviation of those $R_t$ (not centred: a shift would change which states are
    worth ending). The observation it sees is $\mathrm{clip}((o_t - \mu_o) / \sigma_o, -10, 10)$,
    with the running statistics of every observation so far, this step's included. This is
    baselines' `VecNormalize` step for step. (PureJaxRL multiplies the return by $1 - \mathrm{done}$
    of the step itself, so an episode's last reward starts the next episode's return, not its own.)
    """

    obs: RunningMoments
    returns: RunningMoments
    """Of the discounted returns $R_t$ of all environments (a scalar mean and variance)."""
    discounted_returns: jax.Array
    """`[num_envs]`: each environment's $R_t$, from the start of its episode."""

    @classmethod
    def start(cls, obs: jax.Array) -> tuple[Normalizer, jax.Array]:
        """The statistics of the first observations (`[num_envs, ...]`, from `reset`), and those observations normalised."""
        normalizer = cls(RunningMoments.start(obs.shape[1:]).update(obs), RunningMoments.start(),
                         jnp.zeros(obs.shape[0]))
        return normalizer, normalizer.observe(obs)

    def observe(self, obs: jax.Array) -> jax.Array:
        """`obs` standardised by the statistics as they are, and clipped; the statistics do not change."""
        return jnp.clip((obs - self.obs.mean) / self.obs.std(), -10.0, 10.0)

    def step(self, obs: jax.Array, final_obs: jax.Array, rewards: jax.Array, done: jax.Array,
             gamma: float) -> tuple[Normalizer, jax.Array, jax.Array, jax.Array]:
        """Take in one step of `BatchedEnv.step`: the statistics updated, then `obs` and `final_obs` normalised and `rewards` scaled.

        The statistics take in `obs`, the observations the agent goes on from (the first of a new
        episode where one ended); `final_obs`, the last of an ended episode, only read for its
        value, is normalised with them but not counted.
        """
        discounted_returns = gamma * self.discounted_returns + rewards
        returns = self.returns.update(discounted_returns)
        normalizer = Normalizer(self.obs.update(obs), returns, jnp.where(done, 0.0, discounted_returns))
        rewards = jnp.clip(rewards / returns.std(), -10.0, 10.0)
        return normalizer, normalizer.observe(obs), normalizer.observe(final_obs), rewards


# ### The update
#
# Every rollout, on gymnax or on Atari, ends in the same function: `update_agent` turns a rollout
# into advantages and runs `update_epochs` passes of shuffled minibatches over it. In PyTorch these
# are two `for` loops; here they are two nested scans, the outer over epochs (each with its own
# shuffle), the inner over minibatches. A scan has no
# `break`, so the two ways an update can end early, a KL divergence past `--target-kl` (checked
# after each epoch, as CleanRL checks it) and a step that has diverged (`diverged`, below), become
# flags in the carry that turn the remaining steps into no-ops.


class Agent(NamedTuple):
    """Everything that learns: the network's parameters and the optimizer's state (Adam's moments)."""

    params: Any
    opt_state: Any


class Rollout(NamedTuple):
    """`num_steps` steps of `num_envs` environments; every field has leading axes `[num_steps, num_envs]`."""

    obs: jax.Array
    actions: jax.Array
    log_probs: jax.Array
    values: jax.Array
    next_values: jax.Array
    rewards: jax.Array
    terminated: jax.Array
    truncated: jax.Array
    valid: jax.Array | None = None
    """Which steps are transitions of the agent's (`StepInfo.valid`); none given: all of them."""


class Batch(NamedTuple):
    """A rollout flattened into `batch_size` transitions, with their advantages and returns."""

    obs: jax.Array
    actions: jax.Array
    log_probs: jax.Array
    values: jax.Array
    advantages: jax.Array
    returns: jax.Array
    valid: jax.Array


def make_optimizer(config: Config) -> optax.GradientTransformation:
    r"""Clip the gradient's global norm, then Adam's direction with $\epsilon = 10^{-5}$ (PPO's reference code).

    The learning rate is not part of it: `update_agent` multiplies Adam's direction by the annealed
    rate of each update, so the schedule lives in one visible line, not in the optimizer's step count.
    """
    return optax.chain(optax.clip_by_global_norm(config.max_grad_norm), optax.scale_by_adam(eps=1e-5))


# The largest step a minibatch step may take, in root mean square over the weights (see `diverged`).
MAX_STEP_RMS = 1.0


def diverged(loss: jax.Array, agent: Agent, step_rms: jax.Array) -> jax.Array:
    r"""Whether a minibatch step has broken the agent, so that it must not be kept: the run has diverged.

    Two things count. A loss, parameter or moment of Adam that is NaN or infinite: no step recovers
    from one. And a step that moves the weights by more than `MAX_STEP_RMS` = 1 in root mean square,
    $\lVert\Delta\theta\rVert / \sqrt n > 1$ over the $n$ weights. Adam moves each weight by about the
    learning rate (2.5e-4 here), and the weights start at a tenth or so each: a rate that trains
    moves them by far less than 1. The second rule is for the run that breaks with every number
    finite: at a learning rate of 1e10 the first step throws the weights to 1e10, the values to
    1e11 and the policy to certainty, and the run would go on to its end that way, learning nothing.
    A run that only learns badly (a policy that collapses slowly, say) is not flagged: its curves show that.
    """
    finite = jnp.isfinite(loss) & jnp.all(jnp.array([jnp.isfinite(x).all() for x in jax.tree.leaves(agent)]))
    return ~finite | (step_rms > MAX_STEP_RMS)


def make_update_agent(network: nn.Module, optimizer: optax.GradientTransformation, config: Config) -> Callable:
    """`update_agent(agent, rollout, key, learning_rate, clip_range) -> (agent, metrics)`: one PPO update, pure.

    The learning rate and the clip range are arguments, computed by the caller from its schedule
    (`update` in `make_train` anneals them over the run's updates), so that the update itself knows
    nothing of the run's length. `metrics["losses"]` holds each term of `ppo_loss` but the
    total, averaged over the minibatch steps taken, and the value function's explained variance.
    """

    def loss_fn(params: Any, minibatch: Batch, clip_range: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        policy, values = network.apply(params, minibatch.obs)
        terms = ppo_loss(policy.log_prob(minibatch.actions), minibatch.log_probs,
                         normalize_advantages(minibatch.advantages, minibatch.valid), values, minibatch.values,
                         minibatch.returns, policy.entropy(), clip_range, config, minibatch.valid)
        return terms["loss"], terms

    def update_agent(agent: Agent, rollout: Rollout, key: jax.Array, learning_rate: jax.Array,
                     clip_range: jax.Array) -> tuple[Agent, dict]:
        advantages, returns = compute_gae(rollout.rewards, rollout.values, rollout.next_values, rollout.terminated,
                                          rollout.truncated, config.gamma, config.gae_lambda)
        valid = jnp.ones_like(rollout.terminated) if rollout.valid is None else rollout.valid
        batch = jax.tree.map(lambda x: x.reshape(config.batch_size, *x.shape[2:]),
                             Batch(rollout.obs, rollout.actions, rollout.log_probs, rollout.values, advantages, returns,
                                   valid))

        def minibatch_step(carry: tuple, minibatch: Batch) -> tuple[tuple, tuple]:
            agent, stopped, broken = carry
            (loss, terms), grads = jax.value_and_grad(loss_fn, has_aux=True)(agent.params, minibatch, clip_range)
            direction, opt_state = optimizer.update(grads, agent.opt_state)
            # Adam's step: $\theta \leftarrow \theta - \alpha_k \cdot \mathrm{direction}$, with this update's rate $\alpha_k$.
            step = jax.tree.map(lambda d: -learning_rate * d, direction)
            stepped = Agent(optax.apply_updates(agent.params, step), opt_state)
            step_rms = optax.tree.norm(step) / math.sqrt(sum(x.size for x in jax.tree.leaves(step)))
            broken = broken | (~stopped & diverged(loss, stepped, step_rms))
            take = ~(stopped | broken)
            agent = jax.tree.map(lambda new, old: jnp.where(take, new, old), stepped, agent)
            return (agent, stopped, broken), (terms, take, step_rms)

        def epoch(carry: tuple, key: jax.Array) -> tuple[tuple, tuple]:
            # The batch shuffled, then cut into minibatches: each a slice of one copy.
            order = jax.random.permutation(key, config.batch_size)
            minibatches = jax.tree.map(lambda x: x[order].reshape(config.num_minibatches, config.minibatch_size,
                                                                  *x.shape[1:]), batch)
            (agent, stopped, broken), (terms, take, step_rms) = jax.lax.scan(minibatch_step, carry, minibatches)
            if config.target_kl is not None:
                # `--target-kl` ends the update after a whole epoch whose last minibatch strayed too
                # far from the old policy, as CleanRL's `break` does: the epochs left do nothing.
                stopped = stopped | (take[-1] & (terms["approx_kl"][-1] > config.target_kl))
            return (agent, stopped, broken), (terms, take, step_rms)

        carry = (agent, jnp.array(False), jnp.array(False))
        (agent, stopped, broken), (terms, taken, step_rms) = jax.lax.scan(epoch, carry,
                                                                           jax.random.split(key, config.update_epochs))
        # Means over the minibatch steps taken, as the PyTorch loop averages the steps it ran.
        count = taken.sum()
        losses = {name: jnp.where(count > 0, jnp.where(taken, value, 0.0).sum() / count, jnp.nan)
                  for name, value in terms.items() if name != "loss"}
        losses["explained_variance"] = explained_variance(batch.values, batch.returns, batch.valid)
        return agent, dict(losses=losses, learning_rate=learning_rate, clip_range=clip_range, stopped_early=stopped,
                           diverged=broken, largest_step=step_rms.max())

    return update_agent


# ### The loop of training
#
# `make_train` returns the pure functions of one agent's run: `init(key)` resets the environments
# and initialises the network; `collect(runner)` plays the rollout, a scan over `num_steps`;
# `update(runner)` is one whole iteration of PPO, the rollout, then `update_agent`;
# `train_chunk(runner, ...)` runs updates one after another, a scan of `update`. `train(key)` is
# `init`, then `train_chunk` over every update of the run: the entire training of an agent, which
# `jax.jit(jax.vmap(train))` compiles once into a program that trains one agent per key. The
# command line runs the same `train_chunk` a part of the run at a time, and between the parts it
# writes logs and checkpoints.
#
# Everything that changes during the run is in the `Runner` that the scans carry; nothing is
# mutated and nothing is random except through keys that are split and passed along. That is the
# price of tracing (a `print` or a global counter would run once, at trace time), and also the
# gift: a run is a function of its key, resuming is restoring a pytree, and `vmap` needs nothing
# more to batch a run over seeds.


class Runner(NamedTuple):
    """The whole state of one agent's training run, carried from update to update."""

    agent: Agent
    env_state: Any
    obs: jax.Array
    """`[num_envs, ...]`: the observations the policy acts on next (normalised, for continuous actions)."""
    normalizer: Normalizer | None
    """The running statistics of observations and returns, for continuous actions; `None` for discrete ones."""
    episode_returns: jax.Array
    """`[num_envs]`: the return of each environment's episode so far, the environment's own rewards, for logging."""
    episode_lengths: jax.Array
    recent_returns: jax.Array
    """`[SCORE_WINDOW]`: the returns of the last 100 episodes that ended, in a ring (see `remember_episodes`)."""
    episodes: jax.Array
    """Episodes ended so far."""
    key: jax.Array
    update: jax.Array
    """Updates done; the schedules read it."""


class Training(NamedTuple):
    """The pure functions of one agent's training run (see `make_train`), and what they train with."""

    init: Callable[[jax.Array], Runner]
    collect: Callable[[Runner], tuple[Runner, Rollout, tuple]]
    update: Callable[[Runner], tuple[Runner, dict]]
    train_chunk: Callable[..., tuple[Runner, dict]]
    train: Callable[[jax.Array], tuple[Runner, dict]]
    network: nn.Module
    env: BatchedEnv


# The score of a run is the mean return of its last 100 episodes (on Atari: the real scores of its
# last 100 whole games), as this project's learning curves and the published ones score it.
# `ppo_atari.py` logs each game's score as the game ends, and the mean is taken afterwards. A
# compiled update cannot hand out a list whose length changes from one update to the next, so the
# program keeps the last 100 returns itself, in a fixed array used as a ring: the `n`-th episode to
# end is written at `n % 100`, over the one that ended 100 episodes before it. Every update in
# which an episode ended then logs the ring's mean (`charts/episodic_return_last_100`) beside the
# mean of its own episodes (`charts/episodic_return`).

SCORE_WINDOW = 100


def remember_episodes(ring: jax.Array, count: jax.Array, ended: jax.Array,
                      returns: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`(ring, count)` after the episodes flagged in `ended` (in order) were written into the ring of `count` so far."""
    size = ring.shape[0]
    order = jnp.cumsum(ended) - 1  # each ended episode's place among those ending now
    total = ended.sum()
    # When more episodes end at once than the ring holds, only the last `size` are written: the
    # others would be overwritten anyway, and two writes to one slot in one scatter have no order.
    write = ended & (order >= total - size)
    slots = jnp.where(write, (count + order) % size, size)  # `size` is past the end: dropped
    return ring.at[slots].set(returns.astype(ring.dtype), mode="drop"), count + total


def mean_of_ring(ring: jax.Array, count: jax.Array) -> jax.Array:
    """The mean of the `min(count, size)` returns written into `ring` so far; NaN (0 / 0) before the first."""
    filled = jnp.arange(ring.shape[0]) < count
    return jnp.where(filled, ring, 0.0).sum() / filled.sum()


def make_train(config: Config, env_id: str | None = None, conv: Callable[..., nn.Module] = nn.Conv) -> Training:
    """The training run of one agent on the environment `env_id` (default: `config.env`), as pure functions.

    `train(key) -> (runner, metrics)` is the whole run, its metrics with a leading `[num_updates]`
    axis; `jax.jit(jax.vmap(train))(jax.random.split(key, n))` trains `n` agents, one per key, in one
    compiled program. `train_chunk(runner, count, length)` is a part of it, `count` updates. The
    convolutional networks are built with `conv` as their convolution layer (see `make_network`).
    """
    env = make_env(env_id or config.env, config.num_envs, config)
    network = make_network(env, conv)
    optimizer = make_optimizer(config)
    update_agent = make_update_agent(network, optimizer, config)
    # Under `vmap` over agents, each agent's network is initialised on its own, one after another,
    # from the weights it would have alone, rather than all in one batched computation (why: see
    # Hardware choices, Part 3).
    init_params = jax.custom_batching.sequential_vmap(network.init)

    def init(key: jax.Array) -> Runner:
        key, network_key, env_key = jax.random.split(key, 3)
        obs, env_state = env.reset(env_key)
        # Gymnax starts some fields as Python numbers (`time=0`), weakly typed; typed as a checkpoint
        # restores them, a resumed run compiles the very programs of the run it resumes.
        env_state = jax.tree.map(lambda field: field.astype(field.dtype), env_state)
        # Continuous actions: observations normalised and rewards scaled from the first step (see `Normalizer`).
        normalizer, obs = Normalizer.start(obs) if env.continuous else (None, obs)
        params = init_params(network_key, obs)
        zeros = jnp.zeros(config.num_envs)
        return Runner(Agent(params, optimizer.init(params)), env_state, obs, normalizer, zeros,
                      zeros.astype(jnp.int32), jnp.zeros(SCORE_WINDOW), jnp.array(0, jnp.int32), key,
                      jnp.array(0, jnp.int32))

    def env_step(runner: Runner, _) -> tuple[Runner, tuple[Rollout, tuple]]:
        """One step of every environment with the current policy: the body of the rollout's scan."""
        key, action_key, env_key = jax.random.split(runner.key, 3)
        params = runner.agent.params
        policy, values = network.apply(params, runner.obs)
        actions = policy.sample(action_key)
        obs, env_state, rewards, terminated, truncated, info = env.step(env_key, runner.env_state, actions)
        # The agent learns from the rewards scaled, the episode's return (logged) sums the environment's own.
        normalizer, learned_rewards = runner.normalizer, rewards
        if normalizer is not None:
            normalizer, obs, final_obs, learned_rewards = normalizer.step(obs, info.final_obs, rewards,
                                                                          terminated | truncated, config.gamma)
            info = info._replace(final_obs=final_obs)
        # $V(s_{t+1})$ of the observation the step led to. Where nothing ended, `final_obs` is `obs`
        # and this is the value the next step computes again; where an episode ended, it is the
        # value of its last observation, which the reset has replaced in `obs`. (XLA drops the
        # policy head of this second pass, whose result is unused; the MLP's policy tower goes with
        # it, while the MinAtar CNN's torso, shared by both heads, runs twice.) An environment that
        # resets in the next step, as Atari's does, needs no second pass: `collect` takes the next
        # step's value instead.
        next_values = network.apply(params, info.final_obs)[1] if env.resets_within_step else values
        episode_returns = runner.episode_returns + info.score
        episode_lengths = runner.episode_lengths + info.length
        step = Rollout(runner.obs, actions, policy.log_prob(actions), values, next_values, learned_rewards,
                       terminated, truncated, info.valid)
        episodes = (info.episode_over, episode_returns, episode_lengths)
        runner = runner._replace(env_state=env_state, obs=obs, normalizer=normalizer, key=key,
                                 episode_returns=jnp.where(info.episode_over, 0.0, episode_returns),
                                 episode_lengths=jnp.where(info.episode_over, 0, episode_lengths))
        return runner, (step, episodes)

    def collect(runner: Runner) -> tuple[Runner, Rollout, tuple]:
        """`num_steps` steps of every environment: the rollout, and `(ended, returns, lengths)` of its episodes."""
        runner, (rollout, episodes) = jax.lax.scan(env_step, runner, length=config.num_steps)
        if not env.resets_within_step:
            # Each step led to the observation the next step starts from; the last, to the one after the rollout.
            last_values = network.apply(runner.agent.params, runner.obs)[1]
            rollout = rollout._replace(next_values=jnp.concatenate([rollout.values[1:], last_values[None]]))
        return runner, rollout, episodes

    def update(runner: Runner) -> tuple[Runner, dict]:
        """One iteration of PPO: a rollout, then `update_agent` on it, at this update's learning rate and clip range."""
        runner, rollout, (ended, returns, lengths) = collect(runner)
        key, update_key = jax.random.split(runner.key)
        agent, metrics = update_agent(runner.agent, rollout, update_key,
                                      linear_schedule(config.learning_rate, runner.update, config.num_updates),
                                      linear_schedule(config.clip_range, runner.update, config.num_updates))
        # The episodes that ended in this rollout: their mean return and length (NaN if none ended),
        # and the mean return of the last 100 episodes, these included.
        episodes = ended.sum()
        recent_returns, count = remember_episodes(runner.recent_returns, runner.episodes, ended.reshape(-1),
                                                  returns.reshape(-1))
        metrics.update(episodic_return=jnp.where(episodes > 0, (returns * ended).sum() / episodes, jnp.nan),
                       episodic_length=jnp.where(episodes > 0, (lengths * ended).sum() / episodes, jnp.nan),
                       episodes=episodes, recent_return=mean_of_ring(recent_returns, count))
        return runner._replace(agent=agent, recent_returns=recent_returns, episodes=count, key=key,
                               update=runner.update + 1), metrics

    def skip(runner: Runner) -> tuple[Runner, dict]:
        """No update: the runner as it was, and metrics of zeros shaped as `update`'s."""
        metrics = jax.eval_shape(update, runner)[1]
        return runner, jax.tree.map(lambda shape: jnp.zeros(shape.shape, shape.dtype), metrics)

    def train_chunk(runner: Runner, count: jax.Array | int, length: int) -> tuple[Runner, dict]:
        """`count` more updates (`count <= length`), as one scan of `length` steps; metrics `[length]`.

        A compiled program has fixed shapes, a scan a fixed length. So that a run cut into chunks
        of `length` updates compiles one program, its last, shorter chunk included, the steps past
        `count` are skipped with `lax.cond`: they leave the runner as it was and report zeros. Under
        `vmap` over agents, `count` is the same for all (`in_axes=None`): a condition that differed
        between agents would be batched into a `select`, which computes both branches.
        """

        def step(runner: Runner, index: jax.Array) -> tuple[Runner, dict]:
            return jax.lax.cond(index < count, update, skip, runner)

        return jax.lax.scan(step, runner, jnp.arange(length))

    def train(key: jax.Array) -> tuple[Runner, dict]:
        """The whole training run of one agent: `init`, then every update, as one chunk."""
        return train_chunk(init(key), config.num_updates, config.num_updates)

    return Training(init, collect, update, train_chunk, train, network, env)


# ## Part 2: Sampling at speed
#
# The gymnax environments of Part 1 need nothing here: they are JAX functions, compiled into the
# training program with the rest, and `vmap` steps as many of them as the batch asks for. Atari's
# emulator is C++ and cannot be traced; but a compiled program can call C++, through XLA's foreign
# function interface, and ale-py's vector environment offers exactly that (`AtariVectorEnv.xla()`,
# the design of CleanRL's fastest Atari script, which uses envpool's). Its games run in a pool of
# C++ threads; its `step` is an XLA custom call that hands them the actions and waits for the
# frames, and it sits in the rollout's `lax.scan` like gymnax's step. The whole iteration of PPO
# on Atari, rollout, advantages and update, is then one compiled program, as it is on CartPole, and
# the command line runs it a chunk of updates at a time with the same code (Part 3).
#
# Worker processes, which PyTorch's eager loop needs, are taught on [`ppo_atari.py`'s page](ppo_atari.py);
# here the vector environment's threads do that work, and what that page's `Game` does by hand (the
# frame skip, the max-pool, grey 84 x 84 frames, no-op starts, lives) is set on it below, checked by
# tests against `Game`.
#
# ### Atari: the protocol
#
# The emulator shows 210 x 160 colour frames at 60 per second and knows nothing of learning. What
# the DQN paper (Mnih et al., 2015) fed its network, and what baselines' and CleanRL's wrappers
# (whose scores are the published ones) feed it still: an action every 4th frame, the last 4
# observations stacked, each grey and shrunk to 84 x 84, rewards clipped to their sign. The settings
# of that protocol extend `Config`.


@dataclass
class AtariConfig(Config):
    sticky_actions: float = 0.0
    """Atari: probability that the emulator repeats the previous action on a frame (0.25: Machado et al.)."""
    life_loss: bool = True
    """Atari: end the learning episode when a life is lost (the game goes on, and FIRE serves the next life)."""
    noop_max: int = 30
    """Atari: up to this many no-op frames at the start of each game, a random number of them (0 to this)."""
    frame_skip: int = 4
    """Atari: frames each action is repeated for."""
    max_episode_frames: int = 108_000
    """Atari: frames after which a game is cut (a truncation): 30 minutes of play at 60 frames a second."""


def game_name(env_id: str) -> str:
    """The ROM behind an id: `ALE/Breakout-v5` and `BreakoutNoFrameskip-v4` are both `breakout`."""
    return gym.spec(env_id).kwargs["game"]


# ### Atari: the vector environment
#
# `AtariEnv` puts ale-py's `AtariVectorEnv` behind Part 1's interface, `reset(key)` and
# `step(key, state, actions)`, so that `make_train` runs Atari as it runs gymnax. Most of the
# protocol is the vector environment's own, set here explicitly rather than left to its defaults:
# frame skip 4, the max of the last two frames, grey frames (the ALE's own luminance) shrunk to
# 84 x 84 by area averaging (`cv2.INTER_AREA`, as `Game` does), no sticky actions, the frame cap
# counted apart from the game's end and reported as `truncated`, rewards unclipped (we clip them,
# and keep the real score). A lost life comes back as `terminated` (`life_loss_info`) while the game
# goes on, counted only if lives remain after it (baselines' `EpisodicLifeEnv` has the same guard).
#
# Three things we do ourselves, where the library differs from the protocol of the published
# scores (baselines' and CleanRL's wrappers) and from `ppo_atari.py`'s `Game`; a test checks that,
# with no no-ops, the frames the agent sees are `Game`'s, to the pixel, until the first lost life:
#
# * **FIRE.** Breakout, and other games whose second action is FIRE, wait for it after a reset and
#   after a lost life. The library presses it for one frame at a reset only, *before* its no-ops,
#   and never after a lost life: the agent would have to learn to serve. We turn that off and
#   press FIRE ourselves, for a whole step (4 frames), after the no-ops of every new game and,
#   when a lost life ends the learning episode, after each lost life, as `Game` does (it serves
#   within the step that lost the life; here the serve is a step of its own, and the frame after
#   it is `Game`'s, to the pixel).
# * **No-ops.** The library draws 0 to `noop_max - 1` no-op frames; we ask it for `noop_max + 1`,
#   so that a game starts after 0 to `noop_max` of them (baselines: 1 to 30).
# * **The stack.** The library's stack starts a game with three black frames. We take its newest
#   frame only (`stack_num=1`) and stack ourselves, starting each learning episode with its first
#   frame four times, as baselines' `FrameStack` does at every reset.
#
# **The reset step.** The vector environment resets a game on the step *after* the one that ended
# it (gymnasium's "next step" autoreset): that step returns `terminated` or `truncated` with the
# game's true last observation (which a truncated episode bootstraps from), and on the next call
# the action is ignored, and the first observation of the next game comes back, with a reward of 0.
# That call is no transition of the agent's: no action of its led from the last observation of
# one game to the first of another. Learning from it would credit a random action with a game's
# restart, as implementations that feed such a step to their loss as an ordinary one do. Our FIRE
# steps are of the same kind: played by the wrapper, not chosen by the agent. Such steps are marked
# `valid = False` in `StepInfo`; the loss leaves them out (Part 1), and the advantages need no
# change, since such a step always follows an episode's end. They cost a little: a game of Breakout
# spends two steps on its reset and its first serve, and one on each of the four serves after a
# lost life: six steps in a game, about 3% of a random agent's (20 games of `ppo_atari.Game`, seed 1,
# averaged 181 agent steps), and far less of a good agent's, which last thousands of steps.

PLAY, RESET, FIRE = 0, 1, 2
"""What a game's next step is: the agent's action, the vector env's reset (any action is ignored), or FIRE."""


class AtariState(NamedTuple):
    """The state of the games, as far as it lives in JAX; the rest is in the vector env's C++ threads."""

    handle: jax.Array
    """`uint8[8]`: the vector env's address, passed from call to call so that XLA keeps them in order."""
    frames: jax.Array
    """`[num_envs, 4, 84, 84]` uint8: each game's last four frames, oldest first: the observation."""
    lives: jax.Array
    """`[num_envs]`: each game's lives after the last step."""
    next_step: jax.Array
    """`[num_envs]`: `PLAY`, `RESET` or `FIRE`."""
    frame: jax.Array
    """`[num_envs]`: frames each game has run, no-ops and FIRE included (its length, as CleanRL counts it)."""
    start_frame: jax.Array
    """`[num_envs]`: `frame` when the game began, after its no-ops: the frame cap counts from there."""


class AtariEnv:
    """`num_envs` Atari games in ale-py's C++ vector environment, stepped from inside a compiled program."""

    continuous = False
    resets_within_step = False
    frames = True

    def __init__(self, env_id: str, num_envs: int, config: AtariConfig):
        import ale_py
        from ale_py.vector_env import AtariVectorEnv

        self.num_envs, self.life_loss, self.max_frames = num_envs, config.life_loss, config.max_episode_frames
        self.settings = dict(frameskip=config.frame_skip, repeat_action_probability=config.sticky_actions,
                             noop_max=config.noop_max + 1, use_fire_reset=False, episodic_life=False,
                             life_loss_info=config.life_loss, reward_clipping=False,
                             max_num_frames_per_episode=config.max_episode_frames, full_action_space=False)
        self.game = game_name(env_id)
        # The agent sees a stack of 4 grey frames of 84 x 84; the vector env gives the newest only.
        self.obs_shape = (4, 84, 84)
        self.vector_env = AtariVectorEnv(self.game, num_envs, stack_num=1, grayscale=True,
                                         img_height=self.obs_shape[1], img_width=self.obs_shape[2], maxpool=True,
                                         **self.settings)
        self.handle, self.xla_reset, self.xla_step = self.vector_env.xla()
        actions = self.vector_env.ale.get_action_set()
        self.action_dim = len(actions)
        self.fire = len(actions) >= 3 and actions[1] == ale_py.Action.FIRE

    def seeds(self, key: jax.Array) -> jax.Array:
        """A seed for each game, from `key`: the games of a run are a function of its key."""
        return jax.random.randint(key, (self.num_envs,), 0, 2**31 - 1)

    def reset(self, key: jax.Array) -> tuple[jax.Array, AtariState]:
        handle, (frame, info) = self.xla_reset(self.handle, self.seeds(key))
        frames = jnp.repeat(frame, self.obs_shape[0], axis=1)
        first = jnp.full(self.num_envs, FIRE if self.fire else PLAY, jnp.int32)
        state = AtariState(handle, frames, info["lives"], first, info["episode_frame_number"],
                           info["episode_frame_number"])
        return frames, state

    def actions_played(self, state: AtariState, actions: jax.Array) -> jax.Array:
        """The agent's actions, but FIRE (index 1) where the wrapper serves; at a reset, the action is ignored."""
        return jnp.where(state.next_step == FIRE, 1, actions).astype(jnp.int32)

    def step(self, key: jax.Array, state: AtariState, actions: jax.Array):
        """`(obs, state, rewards, terminated, truncated, info)` as `BatchedEnv.step`'s; `info.score` is the real score."""
        handle, (frame, points, terminated, truncated, info) = self.xla_step(state.handle,
                                                                             self.actions_played(state, actions))
        # A step of the wrapper's (a reset, a FIRE) starts the stack afresh, with its frame four times.
        fresh = (state.next_step != PLAY)[:, None, None, None]
        frames = jnp.where(fresh, jnp.repeat(frame, self.obs_shape[0], axis=1),
                           jnp.concatenate([state.frames[:, 1:], frame], axis=1))
        lives, frame_number = info["lives"], info["episode_frame_number"]
        resetting = state.next_step == RESET
        start_frame = jnp.where(resetting, frame_number, state.start_frame)
        life_lost = (lives < state.lives) & (lives > 0)
        # The vector env restarts a game on the step after a game over or the frame cap (which
        # `truncated` reports only when no life was lost in the same step).
        game_over = ~resetting & ((terminated & ~(self.life_loss & life_lost))
                                  | (frame_number - start_frame >= self.max_frames))
        serve = self.fire & (resetting | (self.life_loss & life_lost)) & ~game_over
        next_step = jnp.where(game_over, RESET, jnp.where(serve, FIRE, PLAY)).astype(jnp.int32)
        length = jnp.where(resetting, frame_number, frame_number - state.frame)
        info = StepInfo(frames, state.next_step == PLAY, points.astype(jnp.float32), length, game_over)
        state = AtariState(handle, frames, lives, next_step, frame_number, start_frame)
        # Learning sees the sign of the points: $r_t \in \{-1, 0, 1\}$, whatever the game's scale.
        return frames, state, jnp.sign(points).astype(jnp.float32), terminated, truncated, info


def atari_ids() -> list[str]:
    """Every Atari id gymnasium knows once ale-py has registered its games; none without ale-py."""
    try:
        import ale_py  # imported here, not at the top: only Atari needs it
    except ImportError:
        return []
    gym.register_envs(ale_py)
    return sorted(env_id for env_id, spec in gym.registry.items() if spec.entry_point == "ale_py.env:AtariEnv")


OTHER_ENVS.append((lambda env_id: env_id in atari_ids(), AtariEnv))


# ## Part 3: Running it for real
#
# Part 1's functions, run as a program: a command line derived from `Config`, which refuses what
# cannot work before anything compiles or starts; the CPU's convolution; checkpoints; TensorBoard
# events and a progress line, written by a thread of their own while the next chunk computes;
# Ctrl-C; the training run (the program of `make_train`, run a chunk at a time, on gymnax and Atari
# alike); evaluation and video; and `main()`.
#
# ### The command line
#
# The command line sets the fields of `Config` (and of Part 2's `AtariConfig`) and those of one
# invocation: where the run's files go, how often it writes a checkpoint, which checkpoint to resume
# or evaluate, and where JAX runs. `RunConfig` adds the second kind to the first. A resumed run
# takes its hyperparameters from the checkpoint, but these from the command line (or their defaults).


@dataclass
class RunConfig(AtariConfig):
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where JAX runs (`auto`: a GPU when JAX finds one)."""
    run_dir: str | None = None
    """Where TensorBoard events and checkpoints go (default: runs/<env>__<seed>__<time>)."""
    checkpoint_every: int = 100
    """Write checkpoint.msgpack every this many updates (and always at the end and on Ctrl-C)."""
    resume: str | None = None
    """Continue training from this checkpoint with its settings; flags given override them (a larger
    `--total-timesteps` extends the run, and the annealing stretches over the new length)."""
    eval: str | None = None
    """Play `eval_episodes` episodes with the policy in this checkpoint (each agent's) and print the return."""
    eval_episodes: int = 10
    """Episodes to play with `--eval`."""
    capture_video: bool = False
    """Record episodes to mp4s in <run dir>/videos: in training, one of agent 0 at each checkpoint but a stop's (and to
    W&B with `--track`); with `--eval`, each evaluation episode (on gymnax, the first agent's)."""
    track: bool = False
    """Send the run to Weights & Biases, as CleanRL does: its TensorBoard scalars, and with `--capture-video` its
    videos (needs `pip install wandb`)."""
    wandb_project_name: str = "policy-gradients"
    """The Weights & Biases project that `--track` sends the run to."""
    wandb_entity: str | None = None
    """The Weights & Biases team or user that `--track` sends the run to (default: your own)."""


# Each kind of environment starts from its own settings; classic control's are the defaults above.
# Atari's are baselines' (`ppo2`) Atari defaults as they stood until 2019, which are also
# `ppo_atari.py`'s: 8 games, a clip range of 0.1 annealed (baselines' last version, of February
# 2019, keeps it constant), 10M steps, and otherwise the defaults above. CleanRL's `ppo_atari.py` has
# the same numbers but keeps its clip range constant; the PPO paper's Table 5 has 3 epochs and a
# value coefficient of 1. MinAtar's are the settings of PureJaxRL's MinAtar example
# (`examples/brax_minatar.ipynb`, which says they were briefly tuned for gymnax's MinAtar games): 64
# environments x 128 steps, 8 minibatches, and a learning rate of 5e-3, twenty times CartPole's; the
# rest are the defaults above, which are also that notebook's (its clip range is not annealed, and
# its networks are two separate MLPs of 64 units on the flattened grid, where ours is the MinAtar
# paper's CNN). The learning rate is what matters: with 5e-4, three of four Breakout-MinAtar agents
# stalled at about 7 from 2M steps on; with 5e-3 the same four were at 24.4 to 47.5 by 2M and ended
# at 28.8 to 75.2 after 10M (`minatar-lr5e-4` and `minatar-breakout-jax` in `benchmarks/results/`).
#
# Pendulum's were found here, in the style of rl-zoo's (a short discount, large batches, ten epochs,
# no entropy bonus): observations and rewards normalised, a rate of 3e-4 (the PPO paper's and
# CleanRL's for MuJoCo) and an unclipped value loss measured best. At 1e-3, some normalised agents
# swung the pendulum round and round or lost what they had learned; at 3e-4 all twenty agents of
# five runs learned and ended where agents without the `Normalizer` end (about -150 after 1M steps);
# unclipped, they passed -250 in about a third of those agents' steps, and the clip, which changed
# little else, is left off. `benchmarks/README.md` has the table of those runs.
#
# MountainCarContinuous-v0 learns nothing, raw or normalised (four runs of four agents, with the code
# of 3c97e96; no results file holds them): every agent learned within 131,000 steps to push as
# little as it can (a return above -1, from about -40). Only a policy that explores far enough to
# reach the flag now and then learns that it is there, and this preset, tuned on Pendulum, has no
# entropy bonus.
PRESETS: dict[str, dict[str, Any]] = {
    "classic control": {},
    "continuous control": dict(total_timesteps=1_000_000, num_envs=16, num_steps=256, num_minibatches=32,
                               update_epochs=10, learning_rate=3e-4, gamma=0.95, ent_coef=0.0,
                               clip_value_loss=False),
    "MinAtar": dict(total_timesteps=10_000_000, num_envs=64, num_minibatches=8, learning_rate=5e-3),
    "Atari": dict(total_timesteps=10_000_000, num_envs=8, clip_range=0.1),
}


class ConfigError(Exception):
    """A mistake in what the user asked for: reported in one line, exit status 2."""


PROG = Path(__file__).name


def field_docs(cls: type) -> dict[str, str]:
    """The string literal under each field of a dataclass and of the dataclasses it extends, read from their source."""
    docs = {}
    for klass in reversed([klass for klass in cls.__mro__ if dataclasses.is_dataclass(klass)]):
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for node, following in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(following, ast.Expr):
                docs[node.target.id] = " ".join(str(following.value.value).split())
    return docs


def integer(text: str) -> int:
    """An integer, also written as `10_000_000` or `1e7` (every count the command line takes is exact as a float)."""
    value = float(text)
    if not value.is_integer():
        raise ValueError(text)
    return int(value)


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a mistake is one line on stderr and exit status 2, without the usage block."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """The command line, one flag per field of `RunConfig` (and so of `Config`).

    Flags the user did not type are absent from the parsed namespace (`argparse.SUPPRESS`), so the
    presets and a resumed run's checkpoint can tell an explicit `--total-timesteps` from the default.
    """
    parser = OneLineParser(prog=PROG, description="PPO in JAX, annotated. See the module docstring.",
                           argument_default=argparse.SUPPRESS)
    docs, hints = field_docs(RunConfig), typing.get_type_hints(RunConfig)
    for field in dataclasses.fields(RunConfig):
        kind = hints[field.name]
        presets = "".join(f"; {family}: {preset[field.name]}" for family, preset in PRESETS.items() if field.name in preset)
        options: dict[str, Any] = dict(help=f"{docs.get(field.name, '')} (default: {field.default}{presets})")
        if kind is bool:
            options.update(action=argparse.BooleanOptionalAction)
        elif typing.get_origin(kind) is Literal:
            options.update(choices=typing.get_args(kind))
        else:
            kind = next(t for t in typing.get_args(kind) or [kind] if t is not type(None))  # `int | None` is an int
            options.update(type=integer if kind is int else kind, metavar=field.name.upper())
        parser.add_argument("--" + field.name.replace("_", "-"), **options)
    return parser


# Every number on the command line must be finite and in its range, (smallest, largest), both allowed
# (`POSITIVE`: anything above 0); a count must fit the 32-bit integers that JAX counts in.
POSITIVE, LARGEST_COUNT = math.ulp(0.0), 2**31 - 1
NUMBER_RANGES: dict[str, tuple[float, float]] = {
    **dict.fromkeys(["num_seeds", "num_envs", "num_steps", "num_minibatches", "update_epochs", "frame_skip",
                     "max_episode_frames", "checkpoint_every", "eval_episodes"], (1, LARGEST_COUNT)),
    "total_timesteps": (1, math.inf), "noop_max": (0, LARGEST_COUNT), "seed": (0, 2**32 - 1),
    **dict.fromkeys(["learning_rate", "clip_range", "max_grad_norm", "target_kl"], (POSITIVE, math.inf)),
    **dict.fromkeys(["gamma", "gae_lambda", "sticky_actions"], (0, 1)), **dict.fromkeys(["ent_coef", "vf_coef"], (0, math.inf)),
}


def check_config(config: RunConfig, family: str) -> None:
    """Refuse settings that cannot work, before anything compiles or starts."""
    for name, (smallest, largest) in NUMBER_RANGES.items():
        value, flag = getattr(config, name), "--" + name.replace("_", "-")
        if value is not None and not math.isfinite(value):
            raise ConfigError(f"{flag} must be a finite number, not {value}")
        if value is not None and not smallest <= value <= largest:
            must = (f"be in [{smallest}, {largest}]" if largest not in (math.inf, LARGEST_COUNT) else
                    f"be at most {largest:,}" if value > largest else "not be negative" if smallest == 0 else "be positive")
            raise ConfigError(f"{flag} must {must}, not {value}")
    if config.num_updates > LARGEST_COUNT:
        raise ConfigError(f"--total-timesteps {config.total_timesteps:,} makes {config.num_updates:,} updates, more "
                          f"than the {LARGEST_COUNT:,} that the run can count")
    if config.batch_size > LARGEST_COUNT:  # its steps are counted too, as the minibatches are drawn
        raise ConfigError(f"the batch of {config.num_envs:,} envs x {config.num_steps:,} steps = {config.batch_size:,} "
                          f"is more than the {LARGEST_COUNT:,} steps that the run can count")
    if config.run_dir is not None and Path(config.run_dir).exists() and not Path(config.run_dir).is_dir():
        raise ConfigError(f"--run-dir {config.run_dir} is a file, not a directory")
    if config.batch_size % config.num_minibatches:
        raise ConfigError(f"the batch of {config.num_envs} envs x {config.num_steps} steps = {config.batch_size} "
                          f"does not split into {config.num_minibatches} minibatches")
    if config.eval is None and config.total_timesteps < config.batch_size:
        raise ConfigError(f"--total-timesteps {config.total_timesteps} is less than one batch "
                          f"({config.batch_size} = num envs x num steps)")
    if config.max_episode_frames <= config.noop_max + 2 * config.frame_skip:
        raise ConfigError(f"--max-episode-frames {config.max_episode_frames} leaves no room to play "
                          f"after {config.noop_max} no-ops and two steps of --frame-skip {config.frame_skip}")
    if config.eval is not None and config.resume is not None:
        raise ConfigError("--eval and --resume cannot be used together")
    if family == "Atari" and config.num_seeds > 1:
        raise ConfigError("--num-seeds is for gymnax environments: an Atari run's games are one C++ vector "
                          "environment, which vmap cannot copy for each agent; train one agent per process")


# The environments this page trains on, by kind; each kind starts from its preset above. Any other
# name is tried as an Atari game.
GYMNAX_FAMILIES = {
    "CartPole-v1": "classic control", "Acrobot-v1": "classic control", "MountainCar-v0": "classic control",
    "Pendulum-v1": "continuous control", "MountainCarContinuous-v0": "continuous control",
    "Asterix-MinAtar": "MinAtar", "Breakout-MinAtar": "MinAtar", "Freeway-MinAtar": "MinAtar",
    "Seaquest-MinAtar": "MinAtar", "SpaceInvaders-MinAtar": "MinAtar",
}


def resolve_env(name: str) -> tuple[str, str]:
    """The id and family of the environment named `name`, or a `ConfigError` suggesting close names.

    gymnax ids are matched ignoring case, with or without their version (`cartpole` is CartPole-v1),
    then Atari games, by full id or by short name (`Breakout` is Atari's Breakout; MinAtar's is
    `Breakout-MinAtar`).
    """
    ids = atari_ids()
    short_names = {env_id[4:-3]: env_id for env_id in ids
                   if env_id.startswith("ALE/") and env_id.endswith("-v5") and "-ram" not in env_id}
    known = {**{env_id.lower().rsplit("-v", 1)[0]: (env_id, family) for env_id, family in GYMNAX_FAMILIES.items()},
             **{short.lower(): (env_id, "Atari") for short, env_id in short_names.items()},
             **{env_id.lower(): (env_id, family) for env_id, family in GYMNAX_FAMILIES.items()}}
    if name in ids or name.lower() in known:
        return (name, "Atari") if name in ids else known[name.lower()]
    close = difflib.get_close_matches(name, list(GYMNAX_FAMILIES) + list(short_names) + ids, n=3, cutoff=0.6)
    hint = (f"; did you mean {', '.join(close)}?" if close
            else "; names look like CartPole-v1, Breakout-MinAtar or Breakout (Atari)")
    raise ConfigError(f"unknown environment {name!r}{hint}" + ("" if ids else " (Atari games need ale-py, which is not installed)"))


def parse_config(argv: list[str] | None) -> tuple[RunConfig, dict | None, str, str]:
    """The configuration of this invocation, the checkpoint it names (if any), and the environment's id and family.

    A new run starts from its environment's preset; a resumed or evaluated run from the
    checkpoint's hyperparameters. Flags given on the command line override either.
    """
    given = vars(build_parser().parse_args(argv))
    resume, evaluated = given.get("resume"), given.get("eval")  # either may be "", a path that is no file
    checkpoint, path = None, resume if evaluated is None else evaluated
    if (resume is None) != (evaluated is None):
        checkpoint = load_checkpoint(path)
    # The checkpoint's hyperparameters, `AtariConfig`'s: a resumed run's own options (`RunConfig`'s) are its command line's.
    saved = {k: v for k, v in checkpoint["config"].items() if k in AtariConfig.__dataclass_fields__} if checkpoint else {}
    env_id, family = resolve_env(given.get("env", saved.get("env", RunConfig.env)))
    config = RunConfig(**{**(saved if checkpoint else PRESETS[family]), **given})
    check_config(config, family)
    if checkpoint is not None:
        trained_on, asked = checkpoint["env_id"], env_id
        if family == "Atari" and trained_on not in GYMNAX_FAMILIES:
            trained_on, asked = game_name(trained_on), game_name(env_id)
        if trained_on != asked:
            raise ConfigError(f"checkpoint {path} was trained on {trained_on}, not {asked}")
    for name in ["num_seeds", "num_envs", "num_steps"] if config.resume is not None else []:
        if saved[name] != getattr(config, name):
            raise ConfigError(f"a resumed run keeps its --{name.replace('_', '-')} ({saved[name]}): the checkpoint "
                              "holds the state of exactly that many")
    if config.eval is not None and saved["num_seeds"] != config.num_seeds:
        raise ConfigError(f"checkpoint {path} holds {how_many(saved['num_seeds'], 'agent')}, and --eval plays them all: "
                          f"leave out --num-seeds, or give {saved['num_seeds']}")
    if config.resume is not None and checkpoint["update"] >= config.num_updates:
        raise ConfigError(f"checkpoint {config.resume} has trained {checkpoint['global_step']:,} steps, all that "
                          f"--total-timesteps {config.total_timesteps:,} allows; to train on, resume with a larger one")
    return config, checkpoint, env_id, family


# ### Hardware choices
#
# Part 1 is written for every backend alike. Two things are chosen for XLA's CPU backend, the first
# here and the second in Part 1 (for every backend, since it costs nothing):
#
# * **Convolutions as products of windows, on a CPU: the one override.** Inside a scan, XLA's CPU
#   backend computes `nn.Conv`'s gradient with a generic, unoptimised kernel (jax-ml/jax issue
#   12868). Measured with jaxlib 0.10.2 on 2 cores of an AMD EPYC (issue 42), one iteration of PPO
#   on Breakout (8 games x 128 steps, the default update) took 3.5 to 4.7 s with `PatchConv`; with
#   `nn.Conv`, five of them had not ended after 17 minutes. So on a CPU the networks' convolution is
#   `PatchConv`: `nn.Conv` computed as one matrix product over its input's windows, with the same
#   parameters, so that a checkpoint moves between the two (a test holds them to the same function).
# * **Agents initialised one at a time** (`sequential_vmap` in `make_train`): under `vmap`, jaxlib
#   0.10.2's batched QR for the orthogonal initialisation can deadlock on the CPU (16 CartPole agents
#   hung here). Each agent starts from the very weights it would start from alone (a test checks it).


class PatchConv(nn.Conv):
    """`nn.Conv` without padding, the same parameters, computed as a matrix product over the windows of its input:
    one strided slice of the input per position in the kernel, in the order of the kernel `[height, width, in, out]`."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        (height, width), (row_stride, column_stride) = self.kernel_size, self.strides
        kernel = self.param("kernel", self.kernel_init, (height, width, x.shape[-1], self.features), self.param_dtype)
        bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype)
        rows, columns = (x.shape[-3] - height) // row_stride + 1, (x.shape[-2] - width) // column_stride + 1
        windows = jnp.concatenate([x[..., i:i + row_stride * (rows - 1) + 1:row_stride,
                                     j:j + column_stride * (columns - 1) + 1:column_stride, :]
                                   for i in range(height) for j in range(width)], axis=-1)
        return windows @ kernel.reshape(-1, self.features) + bias


def convolution_layer() -> Callable[..., nn.Module]:
    """The networks' convolution layer on the backend JAX now uses: `PatchConv` on a CPU, `nn.Conv` elsewhere."""
    return PatchConv if jax.default_backend() == "cpu" else nn.Conv


def choose_device(requested: str) -> None:
    """Point JAX at the device asked for. Call it before JAX computes anything: the CPU can only be chosen then."""
    if requested == "cpu":
        jax.config.update("jax_platforms", "cpu")
    elif requested == "cuda":
        try:
            jax.config.update("jax_default_device", jax.devices("cuda")[0])
        except RuntimeError:
            raise ConfigError("--device cuda was asked for, but JAX finds no CUDA device") from None


def check_memory(what: str, per_device: int, mesh: Mesh, fewer: str = "--num-seeds, --num-envs or --num-steps") -> None:
    """Refuse a run whose arrays outgrow a device, `per_device` bytes of them on each, in one line
    that says what to ask `fewer` of: XLA would fail to allocate them with a traceback."""
    device = mesh.devices.flat[0]
    if device.platform == "cpu":  # the CPU's devices share the machine's memory
        limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // mesh.size
    else:  # an accelerator's own, as XLA's allocator has it (unknown under another allocator)
        limit = (device.memory_stats() or {}).get("bytes_limit", math.inf)
    if per_device > limit:
        raise ConfigError(f"{what} need {per_device / 2**30:,.1f} GiB of memory on each {device.platform} device, "
                          f"more than its {limit / 2**30:,.1f} GiB; use fewer {fewer}")


def compiled_memory(program: jax.stages.Compiled) -> int:
    """The bytes a compiled program holds at once on each device, as XLA sizes it (0 where XLA does not say)."""
    memory = program.memory_analysis()
    return 0 if memory is None else (memory.argument_size_in_bytes + memory.output_size_in_bytes
                                     + memory.temp_size_in_bytes - memory.alias_size_in_bytes)


# ### Checkpoints
#
# A checkpoint holds all the state of training as a pytree of arrays, written with flax's msgpack
# serialization: no pickle, so loading one runs no code from the file. For a gymnax run that is the
# whole `Runner` of every agent, environment states included, so a resumed run continues exactly
# where the first stopped, bit for bit. For Atari it is the same but for the games, which live in
# C++ and restart, as in `ppo_atari.py`. Keys are stored as their raw `uint32` words
# (`jax.random.key_data`), and arrays split over devices are gathered into one on the host first
# (`jax.device_get`). A checkpoint is written to a temporary file of its writer's own (two writers
# never meet in one), then renamed over the last: a crash or a full disk never leaves half a file.

CHECKPOINT_FORMAT = "ppo_jax/1"


def storable(runners: Runner) -> Runner:
    """`runners` as a checkpoint holds them: keys as their words, and no Atari games, which live in the vector
    env's C++ threads: a resumed Atari run starts new games (as `ppo_atari.py`'s does)."""
    env_state = () if isinstance(runners.env_state, AtariState) else runners.env_state
    return runners._replace(key=jax.random.key_data(runners.key), env_state=env_state)


def checkpoint_state(config: Config, env_id: str, update: int, **trees) -> dict:
    """A checkpoint's contents: what it is, its configuration, its counters after `update` updates (and the steps
    those took), and the pytrees in `trees`."""
    return {"format": CHECKPOINT_FORMAT, "config": dataclasses.asdict(config), "env_id": env_id,
            "update": update, "global_step": update * config.batch_size,
            **{name: flax.serialization.to_state_dict(jax.device_get(tree)) for name, tree in trees.items()}}


def save_checkpoint(state: dict, path: Path) -> None:
    """Write `state` to `path` atomically; an `OSError` names `path`, and leaves whatever was there as it was."""
    temporary = path.with_name(f"{path.name}.{os.getpid()}-{os.urandom(4).hex()}.tmp")
    try:
        with naming(path):
            with open(temporary, "xb") as file:
                file.write(flax.serialization.msgpack_serialize(state))
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)  # what a failure left behind; after the rename, there is none


def unwritten(error: OSError) -> str:
    """An `OSError` of a file the run writes (`naming` names it), in the words of the run's last line."""
    reason = error.strerror or str(error)
    return f"{reason[:1].lower()}{reason[1:]} while writing {error.filename}"


@contextlib.contextmanager
def naming(path: Path) -> typing.Iterator[None]:
    """Raise an `OSError` of the block again, naming `path`: the file (or directory) that could not be written,
    for the run's one line."""
    try:
        yield
    except OSError as error:
        raise OSError(error.errno, error.strerror, str(path)) from error


def load_checkpoint(path: str) -> dict:
    """Read a checkpoint of this script, or raise a `ConfigError`.

    Besides its format, it must hold every field that the command line reads from it: the settings
    of `AtariConfig`, the counters and the agent's parameters. (The rest of its trees is checked as
    they are restored, by `restore_tree`.)
    """
    if not Path(path).is_file():
        inside = Path(path) / "checkpoint.msgpack"  # a run's directory, given for its checkpoint
        hint = f"; the run's checkpoint in it is {inside}" if inside.is_file() else ""
        raise ConfigError(f"checkpoint {path or repr(path)} {'is not a file' if Path(path).exists() else 'does not exist'}{hint}")
    try:
        checkpoint = flax.serialization.msgpack_restore(Path(path).read_bytes())
    except Exception:  # msgpack raises many kinds for a damaged file
        raise ConfigError(f"cannot read checkpoint {path}: the file is damaged or not a checkpoint of "
                          "ppo_jax.py") from None
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != CHECKPOINT_FORMAT:
        raise ConfigError(f"{path} is not a ppo_jax.py checkpoint")
    for names in [("env_id",), ("update",), ("global_step",), *[("config", field.name) for field in
                                                                  dataclasses.fields(AtariConfig)], ("runners", "agent", "params")]:
        try:
            functools.reduce(lambda node, name: node[name], names, checkpoint)
        except (KeyError, TypeError, IndexError):  # a name missing, or a node that holds no names
            raise ConfigError(f"checkpoint {path} has no {'.'.join(names)}: it is damaged, or from another "
                              f"version of {PROG}") from None
    if not all(np.isfinite(weights).all() for weights in jax.tree.leaves(checkpoint["runners"]["agent"]["params"])):
        raise ConfigError(f"checkpoint {path} holds non-finite weights: it was written after its run diverged")
    # One written before the ring of the last 100 returns existed resumes with an empty ring.
    agents = checkpoint["config"]["num_seeds"]
    checkpoint["runners"] = {"recent_returns": np.zeros((agents, SCORE_WINDOW), np.float32),
                             "episodes": np.zeros(agents, np.int32), **checkpoint["runners"]}
    return checkpoint


def restore_tree(template: Any, state: Any, path: str) -> Any:
    """The arrays of `state` (from a checkpoint) in the structure, shapes and types of `template`.

    A checkpoint of another network, or of this one laid out as an earlier version laid it out, is a `ConfigError`.
    """
    try:
        restored = flax.serialization.from_state_dict(template, state)
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ConfigError(f"checkpoint {path} holds a different network: {str(error).splitlines()[0]}") from None
    for (where, value), expected in zip(jax.tree_util.tree_leaves_with_path(restored), jax.tree.leaves(template)):
        if np.shape(value) != expected.shape:
            raise ConfigError(f"checkpoint {path} holds a different network: {jax.tree_util.keystr(where)} is "
                              f"{np.shape(value)}, not {expected.shape}")
    return jax.tree.map(lambda value, expected: jnp.asarray(value, expected.dtype), restored, template)


# ### Logging and progress
#
# TensorBoard events are written with tensorboard's own event-file writer and protocol buffers, so
# that this page needs neither TensorFlow nor PyTorch. The tags are CleanRL's; the `losses/` tags
# are the terms `ppo_loss` returns, whatever they are. With many agents (`--num-seeds`), the run's
# writer gets each tag's mean over them and their spread (`<tag>/min`, `<tag>/max`), every agent's
# series go to one file, `agents.npys` (a `.npy` record a chunk, appended; `read_agent_series` reads
# it), and the first 16 agents have writers of their own, in `agent-<i>/`.
#
# None of that may slow the run as the agents grow. Between two chunks the main thread takes a
# single number from the device, whether the last chunk diverged, and hands that chunk's metrics,
# still on the device, to a thread of their own, which copies them to the host, writes them and
# shows the progress line while the next chunk computes (`log_chunk`). It logs one chunk at a time,
# in order, and may fall one chunk behind: the main thread waits for it only when two chunks are
# left to write, so that the writing of a chunk and its checkpoint has the time of the next two
# chunks, not of one, before the device is kept waiting. What the thread could not write (an
# `OSError`: a full disk) is raised in the main thread when a later chunk is handed to it, and
# nothing is written after it. It writes the checkpoints too, once the chunk's logs are on disk,
# so that a checkpoint never holds more of the run than its logs; the main thread only takes the
# runners to save (`storable`) before it dispatches the next chunk. (Written by the main thread,
# the checkpoints of 2,048 agents left an H100 idle for 7.3 s between the chunks of a 400-update
# run, against 3.1 s written here: `benchmarks/README.md`.)


class EventWriter:
    """Summaries in a TensorBoard event file in `directory`.

    tensorboard's writer writes from a thread of its own. A write that fails there (on a full disk,
    say) comes back at the next event, or at `close`, as an `OSError` that names `directory`.
    """

    def __init__(self, directory: Path):
        # tensorboard's writer makes the directory if need be. It is looked up when used, not imported by name:
        # `--track` replaces it with a writer that wandb watches.
        self.directory, self.writer = directory, event_file_writer.EventFileWriter(str(directory))

    def add(self, step: int, *values: Summary.Value) -> None:
        """One event of `values` at `step`: `add(step, Summary.Value(tag=..., simple_value=...))` is a scalar."""
        with naming(self.directory):
            self.writer.add_event(Event(summary=Summary(value=values), step=int(step), wall_time=time.time()))

    def flush(self) -> None:
        with naming(self.directory):
            self.writer.flush()  # raises what the thread could not write

    def close(self) -> None:
        with contextlib.closing(self.writer):  # closed whatever the flush raises
            self.flush()


def how_many(number: int, noun: str) -> str:
    """A count and its noun, in the plural unless the count is one: `1 game`, `8 games`."""
    return f"{number:,} {noun}{'s' * (number != 1)}"


class Progress:
    """One line on the terminal: steps done, speed, time left, the agents' mean return of their last 100 episodes.

    On a terminal the line is redrawn at every `show`. In a log (stderr not a terminal) a new line
    is written when waiting for the next `show`, as long as since the last one, would leave more
    than 10 seconds since the last line: lines come at most 10 seconds apart, and not much more often,
    and the final line is not written twice.
    """

    def __init__(self, total: int, start_step: int, agents: int, unit: str):
        self.total, self.start_step, self.agents, self.unit = total, start_step, agents, unit
        self.score, self.interactive, self.printed = "-", sys.stderr.isatty(), None
        self.started = self.last_print = self.last_show = time.perf_counter()

    def show(self, step: int, final: bool = False) -> None:
        now = time.perf_counter()
        next_show, self.last_show = now + (now - self.last_show), now
        if not self.interactive and (step == self.printed or not (final or next_show - self.last_print > 10)):
            return  # in a log, a step's line is written once: the final one may be written already
        self.last_print, self.printed = now, step
        sps = (step - self.start_step) * self.agents / max(now - self.started, 1e-9)
        left = (self.total - step) * self.agents / sps if sps > 0 else math.inf
        left = "?" if not math.isfinite(left) else (f"{int(left) // 3600}h{int(left) % 3600 // 60:02d}m" if left >= 3600
                                                    else f"{int(left) // 60}m{int(left) % 60:02d}s")
        agents = f" x {self.agents} agents" if self.agents > 1 else ""
        print(("\r\033[K" if self.interactive else "") + f"step {step:,}/{self.total:,}{agents} "
              f"({100 * step / self.total:.1f}%) | {sps:,.0f} SPS | {left} left | return {self.score}",
              end="\n" if final or not self.interactive else "", file=sys.stderr, flush=True)


AGENT_WRITERS = 16
AGENTS_FILE = "agents.npys"


def log_chunk(run: Run, metrics: dict, episodes: jax.Array, count: int, first_update: int, sps: float) -> None:
    """Log the first `count` updates of a chunk's `metrics`, `[length, agents]` and still on the device, and show the
    progress line; `episodes`, `[agents]`, is how many each agent has finished. An episode's tags are written where
    an episode ended, the others at every update."""
    metrics, episodes = jax.tree.map(lambda value: value[:count], jax.device_get(metrics)), np.asarray(episodes)
    steps = (first_update + 1 + np.arange(count, dtype=np.int64)) * run.config.batch_size
    ended = metrics["episodes"] > 0
    tags = {"charts/learning_rate": metrics["learning_rate"], "charts/clip_range": metrics["clip_range"],
            **{f"losses/{name}": value for name, value in metrics["losses"].items()},
            "charts/episodic_return": metrics["episodic_return"], "charts/episodic_length": metrics["episodic_length"],
            "charts/episodic_return_last_100": metrics["recent_return"]}
    # Each writer's scalars of an update go in one event: TensorBoard reads every value of an event as
    # a point of its tag, and tensorboard's writer checksums each event in Python, so that one event
    # an update, rather than one a scalar, takes the writers less than half the time.
    updates = [[[] for _ in range(count)] for _ in [run.writer, *run.writers]]  # [writer][update]: its values
    for tag, values in tags.items():
        every = not tag.startswith("charts/episodic")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # no agent with a value (no episode yet): NaN
            spread = {"": np.nanmean(values, axis=1), "/min": np.nanmin(values, axis=1), "/max": np.nanmax(values, axis=1)}
        for index in range(count) if every else np.flatnonzero(ended.any(axis=1)):
            for suffix, value in list(spread.items())[:1 if values.shape[1] == 1 else 3]:
                updates[0][index].append(Summary.Value(tag=tag + suffix, simple_value=value[index]))
        for agent, own in enumerate(updates[1:]):
            for index in range(count) if every else np.flatnonzero(ended[:, agent]):
                own[index].append(Summary.Value(tag=tag, simple_value=values[index, agent]))
    updates[0][-1].append(Summary.Value(tag="charts/SPS", simple_value=sps))
    for writer, values in zip([run.writer, *run.writers], updates):
        for step, update in zip(steps, values):
            writer.add(step, *update)
    if run.config.num_seeds > 1:
        leaves = {"step": steps, **{jax.tree_util.keystr(where, simple=True, separator="/"): value
                                    for where, value in jax.tree_util.tree_leaves_with_path(metrics)}}
        records = np.rec.fromarrays(list(leaves.values()),
                                    dtype=[(name, value.dtype, value.shape[1:]) for name, value in leaves.items()])
        record = io.BytesIO()
        np.save(record, records)
        with naming(run.dir / AGENTS_FILE), open(run.dir / AGENTS_FILE, "ab") as file:
            file.write(record.getvalue())  # in one piece: a crash leaves whole records, at worst a torn last one
    counted = np.minimum(episodes, SCORE_WINDOW)[episodes > 0]
    if counted.size:
        low, high = counted.min(), counted.max()
        run.progress.score = (f"{np.nanmean(metrics['recent_return'][-1][episodes > 0]):.1f} (mean of last "
                              f"{low if low == high else f'{low}-{high}'} {run.progress.unit})")
    with run.signals.held():
        run.progress.show(int(steps[-1]))


def read_agent_series(path: str | Path) -> dict[str, np.ndarray]:
    """Every agent's series from a run's `AGENTS_FILE`: `{"step": [updates], "losses/policy_loss": [updates, agents],
    "episodic_return": ..., ...}`; a step written twice (a resumed run's) is read as last written."""
    data = Path(path).read_bytes()
    stream, chunks = io.BytesIO(data), []
    while stream.tell() < len(data):
        try:
            chunks.append(np.load(stream))
        except (ValueError, EOFError):
            break  # a last record torn by a crash
    records = np.concatenate(chunks)
    _, last = np.unique(records["step"][::-1], return_index=True)
    return {name: records[len(records) - 1 - last][name] for name in records.dtype.names}


# ### Ctrl-C, SIGTERM and SIGHUP
#
# Before training begins there is nothing to save, and Ctrl-C (or SIGTERM) exits at once. During
# training, the first asks the run to stop at the next safe point, the end of the chunk being
# computed (two seconds or so away: see `train_compiled`), where it writes a checkpoint and exits; a
# second aborts at once and writes none, once a checkpoint being written is whole. The exit status
# is 128 plus the signal's number, 130 for Ctrl-C and 143 for SIGTERM, and the message names the
# last checkpoint, one that exists, or says that none was written, as `ppo_atari.py`'s and
# `vpg_continuous.py`'s do. One that comes in the last chunk finds nothing left to stop: the run ends
# as done, with status 0, so that a job stopped then and requeued to resume is not refused for having
# trained all its steps. SIGHUP, what a run gets when its terminal goes (the window closed, the ssh
# connection dropped), does what SIGTERM does, status 129. A run started to outlive its terminal,
# under `nohup`, which ignores SIGHUP, keeps it ignored. Either way a line printed on a terminal
# that is gone fails ("input/output error"), which would end the run in a traceback; the run then
# prints to /dev/null instead (`Terminal`), so that a stop still writes its checkpoint, and a run
# left behind with `& disown`, which never hears the SIGHUP, trains on.
#
# Python runs a signal's handler between two steps of the main thread's bytecode, and this script's
# main thread spends its time inside XLA, compiling for many seconds or waiting for a chunk of the
# run, where no bytecode runs: a handler would wait for XLA to be done. So the handlers here do
# nothing, and a thread does the work. Python writes the number of every signal it receives to a
# pipe (`signal.set_wakeup_fd`); the thread waits on the pipe and is woken at once, since XLA lets
# go of Python's lock while it works. To exit at once the thread calls `os._exit`, which raises
# nothing: an exception from a handler (`KeyboardInterrupt`) lands wherever the main thread happens
# to be, and inside a finalizer Python can only print it as "Exception ignored" and go on.
#
# The other threads go on until `os._exit`, and must say nothing once the thread has said the run
# is aborted: the main thread, just done with the checkpoint the abort waited for, would otherwise
# print "stopped at update K" after it, while the thread waits for Python's lock to exit. So one
# lock, `writing`, is held for a checkpoint's write and for every line the run prints after
# training begins, and the thread takes it to abort and never lets go. A lock is no queue: the main
# thread, letting go of it after a checkpoint, could take it again for its last line before the
# thread waiting on it woke (a loaded CI machine did). So a signal heard waits in `heard`, and
# whichever thread takes the lock next answers it first, the main thread too.


class Signals:
    """Ctrl-C (SIGINT), SIGTERM and SIGHUP, heard by a thread of their own while the `with` block runs.

    Once `training` is set, the first signal becomes `requested`: the run stops at its next safe
    point. Any other ends the process at once, naming `last_checkpoint()`, once `writing` is free: a
    checkpoint being written is whole, and a line being printed ends before the abort's, the last.
    Whichever thread takes `writing` next (through `held`) answers the signals heard meanwhile.
    """

    def __init__(self):
        self.requested, self.training, self.closing, self.writing = None, False, False, threading.Lock()
        self.last_checkpoint: Callable[[], Path | None] = lambda: None
        self.heard: collections.deque[int] = collections.deque()

    def __enter__(self) -> Signals:
        hangup = [signal.SIGHUP] if signal.getsignal(signal.SIGHUP) != signal.SIG_IGN else []  # `nohup` ignores it
        self.handlers = {sig: signal.signal(sig, lambda signum, frame: None) for sig in [signal.SIGINT, signal.SIGTERM, *hangup]}
        self.pipe = os.pipe()
        os.set_blocking(self.pipe[1], False)
        self.wakeup = signal.set_wakeup_fd(self.pipe[1])
        self.listener = threading.Thread(target=self.listen, name="signals", daemon=True)
        self.listener.start()
        return self

    def listen(self) -> None:
        while (signum := os.read(self.pipe[0], 1)[0]) != 0:  # a zero byte: `__exit__` asks the thread to end
            self.heard.append(signum)
            with self.held():
                pass

    @contextlib.contextmanager
    def held(self):
        """`writing`, between two lines of the run, once the signals heard are answered."""
        with self.writing:
            while self.heard:  # to abort, never let go: nothing is printed after the abort's line
                signum = self.heard.popleft()
                if self.closing:  # the run has printed its last line: nothing is left to stop
                    continue
                if self.training and self.requested is None:
                    print(f"\n{signal.Signals(signum).name}: stopping at the next safe point and saving a checkpoint "
                          "(Ctrl-C again to abort at once)", file=sys.stderr, flush=True)
                    self.requested = signum
                    continue
                last = self.last_checkpoint()
                print(f"\n{'aborted by a second interrupt' if self.training else 'interrupted before training began'}"
                      f"; {f'the last checkpoint is {last}' if last else 'no checkpoint was written'}",
                      file=sys.stderr, flush=True)
                os._exit(128 + signum)
            yield

    def __exit__(self, *exc_info) -> None:
        signal.set_wakeup_fd(self.wakeup)
        for sig, handler in self.handlers.items():
            signal.signal(sig, handler)
        os.write(self.pipe[1], b"\0")
        self.listener.join()
        for end in self.pipe:
            os.close(end)


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


# ### The training runs
#
# A run has a directory and its lock, TensorBoard's first event (a table of the hyperparameters), a
# checkpoint file, and an end, good or not. Every way a run can end is one line on stderr and an exit status:
#
# | how it ends | status | the line |
# |---|---|---|
# | all its updates done | 0 | `done: N steps; checkpoint in PATH` |
# | Ctrl-C, SIGTERM or SIGHUP | 130, 143 or 129 | `stopped at update K; resume with --resume PATH` |
# | the update diverged (`diverged`, Part 1) | 1 | `diverged at update K ...; the last good checkpoint is PATH` |
# | a file could not be written (a full disk) | 1 | `ppo_jax.py: error: no space left on device while writing PATH; ...` |
#
# Two runs must not share a directory: they would write over each other's checkpoint. Each run
# holds a lock on its directory (`run.lock`, `flock`'s, which the system lets go of however its
# holder exits) for as long as it lives, and a second run there is refused, naming the first's
# process; so is a run resumed from one checkpoint into a directory that holds another.


def writable_dir(path: Path) -> Path:
    """`path`, a directory made if need be, in which this process can make a file; a `ConfigError`
    naming the reason if not (no permission, a file on its path, a read-only file system)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as error:
        raise ConfigError(f"cannot write in {path}: {error.strerror}") from None
    return path


class Run:
    """A training run's directory and its lock, its writers and the thread that logs, its checkpoint and tracking.

    All it opens is entered on `opened`, a `contextlib.ExitStack`, which closes them in the reverse
    order however the run ends, each whatever the others raise: the compiling thread and the logging
    thread done first, then the writers, the thread hook, the tracking and last the lock. What one
    of them could not write (an `OSError`) is raised once all are closed.
    """

    def __init__(self, config: RunConfig, env_id: str, checkpoint: dict | None, signals: Signals):
        name = env_id if env_id in GYMNAX_FAMILIES else gym.spec(env_id).name
        self.dir = Path(config.run_dir or (Path(config.resume).parent if checkpoint else
                                           Path("runs") / f"{name}__{config.seed}__{time.strftime('%Y%m%d-%H%M%S')}"))
        self.config, self.env_id, self.resumed, self.signals = config, env_id, checkpoint is not None, signals
        self.checkpoint_path, self.tracking, self.logging = self.dir / "checkpoint.msgpack", None, []
        if self.checkpoint_path.exists() and not (checkpoint and self.checkpoint_path.samefile(config.resume)):
            raise ConfigError(f"{self.dir} already holds a checkpoint{f' of another run than {config.resume}' if checkpoint else ''}; "
                              f"resume it with --resume {shlex.quote(str(self.checkpoint_path))} or choose another --run-dir")
        if checkpoint is None and (self.dir / "checkpoint.pt").exists():  # one run a directory, whatever the script
            raise ConfigError(f"{self.dir} already holds a run of ppo_atari.py or vpg_continuous.py (checkpoint.pt); "
                              "choose another --run-dir")
        self.opened = contextlib.ExitStack()
        self.lock = self.opened.enter_context(open(writable_dir(self.dir) / "run.lock", "a+"))
        try:
            fcntl.flock(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = Path(self.lock.name).read_text().strip()
            self.opened.close()
            raise ConfigError(f"{self.dir} is in use by another run (process {holder})") from None
        self.lock.truncate(0)
        print(os.getpid(), file=self.lock, flush=True)
        signals.last_checkpoint = self.last_checkpoint
        # The run ends after its last whole batch, as CleanRL's and PureJaxRL's do: say so if that is short.
        if config.num_updates * config.batch_size != config.total_timesteps:
            print(f"--total-timesteps {config.total_timesteps:,} is not a whole number of batches of "
                  f"{config.batch_size:,} steps: the run ends after {how_many(config.num_updates, 'update')}, at "
                  f"{config.num_updates * config.batch_size:,} steps", file=sys.stderr)

    def open_writers(self, progress: Progress) -> None:
        """The run's writer and, for several agents, the first `AGENT_WRITERS`' own; the logging thread."""
        if self.config.track:  # before the writers, so that wandb sees their events
            self.tracking = start_tracking(self.config, self.dir.name)
            self.opened.callback(self.tracking.finish)
        # A writer's thread that cannot write dies of it, and its writer raises the error again at its next event,
        # where the run reports it in one line: Python's traceback of the thread's death is left out.
        self.opened.callback(setattr, threading, "excepthook", threading.excepthook)
        threading.excepthook = lambda args, hook=threading.excepthook: None if issubclass(args.exc_type, OSError) else hook(args)
        self.progress, self.writer = progress, self.opened.enter_context(contextlib.closing(EventWriter(self.dir)))
        self.writers = [self.opened.enter_context(contextlib.closing(EventWriter(self.dir / f"agent-{i}")))
                        for i in range(min(self.config.num_seeds, AGENT_WRITERS)) if self.config.num_seeds > 1]
        if not self.resumed:  # the first event: the hyperparameters, as a table in TensorBoard's text tab
            table = "\n".join(["|parameter|value|", "|-|-|", f"|env_id|{self.env_id}|",
                               *(f"|{key}|{value}|" for key, value in dataclasses.asdict(self.config).items())])
            self.writer.add(0, *text_pb("hyperparameters/text_summary", table).value)  # tensorboard's own text summary
        self.logger = self.opened.enter_context(concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="logging"))
        self.opened.callback(self.logged)  # the first to run at the end: the logging thread writes with the writers

    def log(self, *chunk, checkpoint: tuple[int, Runner] | None = None) -> None:
        """Hand a chunk to the logging thread (`log_chunk`) once it has at most one other left to write; raise what
        those before it raised. With `checkpoint`, `(update, storable runners)`, the thread then writes it, once the
        chunk's logs are written."""
        self.logged(keep=1)
        before = self.logging[-1] if self.logging else None

        def log_and_save() -> None:
            if before is not None:
                before.result()  # what the chunk before could not write ends this one too: nothing is written after it
            log_chunk(self, *chunk)
            if checkpoint is not None:
                for writer in [self.writer, *self.writers]:
                    writer.flush()  # so that a checkpoint never holds more of the run than its logs
                update, runners = checkpoint
                self.write_checkpoint(checkpoint_state(self.config, self.env_id, update, runners=runners))

        self.logging.append(self.logger.submit(log_and_save))

    def logged(self, keep: int = 0) -> None:
        """Wait until the logging thread has at most `keep` chunks left to write; raise what those written raised."""
        while len(self.logging) > keep:
            self.logging.pop(0).result()

    def last_checkpoint(self) -> Path | None:
        """The newest checkpoint of this run that exists: its own, else the one it resumed from, else none."""
        return next((Path(path) for path in [self.checkpoint_path, self.config.resume]
                     if path is not None and Path(path).is_file()), None)

    def write_checkpoint(self, state: dict) -> None:
        """Write `state` as the run's checkpoint, if every number in it is finite; else raise a `DivergedError`."""
        arrays = [leaf for leaf in jax.tree.leaves(state) if isinstance(leaf, np.ndarray)]
        if not all(np.isfinite(array).all() for array in arrays if np.issubdtype(array.dtype, np.inexact)):
            raise DivergedError(f"the state of update {state['update']} holds NaN or infinite numbers, and was not saved")
        with self.signals.held():  # a second Ctrl-C meanwhile takes effect once the checkpoint is whole
            save_checkpoint(state, self.checkpoint_path)


class DivergedError(RuntimeError):
    """The run diverged (see `diverged`, Part 1): nothing from that point on was kept."""


def agent_keys(config: Config, first_update: int = 0) -> jax.Array:
    """One key per agent, split from `--seed`, with `first_update` folded in where a resumed run asks for new
    games: Atari's, which a checkpoint does not hold (see `storable`), so that they are not the first run's."""
    keys = jax.random.split(jax.random.key(config.seed), config.num_seeds)
    return keys if first_update == 0 else jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, first_update)


# The compiled chunks of a run: about this long each, and never more updates than this.
CHUNK_SECONDS = 2.0
LONGEST_CHUNK = 1000


def train_compiled(config: RunConfig, env_id: str, checkpoint: dict | None, signals: Signals) -> int:
    """Train `num_seeds` agents (on Atari, one): `make_train`'s program, a chunk of the run at a time; the exit status.

    A chunk is some updates of every agent, `train_chunk` under `vmap`. JAX dispatches a compiled
    program asynchronously: on the CPU the call returns before the program has run, so the next chunk
    starts as soon as the last one is known not to have diverged, and the last one is logged while
    the next computes (on the H200 measured in `benchmarks/README.md` the call returned only once its
    chunk had nearly run). Between chunks the
    run saves a checkpoint every `--checkpoint-every` updates and at the end (and records an episode,
    with `--capture-video`) and looks for a stop request. Chunks are sized by time, so that the progress
    line moves and Ctrl-C is answered within `CHUNK_SECONDS` or so, whatever an update costs (on a
    2-core CPU an update of one CartPole agent takes about 3 ms, of four MinAtar agents about 2 s):
    the first is one update,
    each next one as many as fit in `CHUNK_SECONDS` at the fastest speed a chunk has shown. (A chunk
    is timed from its dispatch to the moment the main thread learns it is done, which comes later if
    the main thread was kept waiting meanwhile, by the logging thread writing a checkpoint, say.
    Sized by the last chunk alone, on an H100 with 2,048 agents, the chunks after a 1-update chunk
    that waited for a checkpoint had 2, 4 and 7 updates where 50 fit.) One program, compiled for
    `length` updates, serves them all: a shorter chunk skips the rest of its scan (see
    `train_chunk`). (Not `jax.debug.callback` after every update: JAX's persistent compilation cache
    refuses a program with a host callback.)
    """
    run = Run(config, env_id, checkpoint, signals)
    try:
        with run.opened:  # whatever the end, what the run opened is closed here (see `Run`)
            training = make_train(config, env_id, convolution_layer())
            atari = isinstance(training.env, AtariEnv)
            keys = agent_keys(config, checkpoint["update"] if checkpoint and atari else 0)  # new games, see `storable`
            # The chunks' program needs only the runners' shapes: it compiles in a thread while this one makes
            # the agents (XLA lets go of Python's lock as it compiles), seconds each for thousands of agents.
            init, mesh = jax.jit(jax.vmap(training.init)), seed_mesh(config.num_seeds)
            shapes = init.eval_shape(keys)
            check_memory(f"the weights and environments of {how_many(config.num_seeds, 'agent')}",
                         sum(shape.size * shape.dtype.itemsize for shape in jax.tree.leaves(shapes)) // mesh.size, mesh)
            if checkpoint is not None:  # first, so that a checkpoint of another network is refused at once
                restored = restore_tree(jax.eval_shape(storable, shapes), checkpoint["runners"], config.resume)
            started, length = time.perf_counter(), min(config.checkpoint_every, config.num_updates, LONGEST_CHUNK)
            compiler = run.opened.enter_context(concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="compiling"))
            compiling = compiler.submit(compile_train_chunk, training, length, jax.tree.map(
                lambda shape: shape.update(sharding=split_over_seeds(mesh)), shapes), mesh)
            runners = init(keys)
            if checkpoint is not None:
                games = runners if atari else restored
                runners = restored._replace(key=jax.random.wrap_key_data(restored.key), env_state=games.env_state,
                                            obs=games.obs, episode_returns=games.episode_returns,
                                            episode_lengths=games.episode_lengths)
                print(f"resumed at step {checkpoint['global_step']:,} (update {checkpoint['update']}) from {config.resume}",
                      file=sys.stderr)
            # Place the agents over the devices; everything computed from them stays where they are.
            runners, update = jax.device_put(runners, split_over_seeds(mesh)), checkpoint["update"] if checkpoint else 0
            print(describe_devices(mesh, config.num_seeds), file=sys.stderr)
            train_chunk = compiling.result()
            print(f"{env_id}: {how_many(config.num_seeds, 'agent')}, compiled in {time.perf_counter() - started:.1f} s; "
                  f"logs and checkpoints in {run.dir}", file=sys.stderr)
            run.open_writers(Progress(config.num_updates * config.batch_size, update * config.batch_size,
                                      config.num_seeds, "games" if atari else "episodes"))

            def dispatch(count: int) -> tuple:
                """Start the next chunk, of at most `count` updates, and return at once: JAX computes it meanwhile."""
                count = min(count, config.checkpoint_every - update % config.checkpoint_every, config.num_updates - update)
                return count, time.perf_counter(), *train_chunk(runners, jnp.int32(count))

            signals.training = True
            chunk, fastest = dispatch(1), math.inf  # the first chunk: one update, to time it; seconds an update
            while chunk is not None:
                count, dispatched, new_runners, metrics = chunk
                if jnp.any(metrics["diverged"]):  # all that crosses to the host now, once the chunk is done: one flag
                    at, agent = np.argwhere(jax.device_get(metrics["diverged"]))[0]
                    largest_step = float(metrics["largest_step"][at, agent])
                    raise DivergedError(f"diverged at update {update + at + 1} (agent {agent}): " + (
                        f"a step would have moved the weights by {largest_step:.3g} in root mean square, more than "
                        f"{MAX_STEP_RMS:g}" if largest_step > MAX_STEP_RMS else
                        "the loss or the parameters became NaN or infinite") + "; no step was taken from there on")
                seconds = time.perf_counter() - dispatched
                runners, first_update, update = new_runners, update, update + count
                last = update >= config.num_updates or signals.requested is not None
                # A checkpoint's runners are taken before the next chunk is dispatched, so that their copy to the
                # host need not wait for it; the logging thread copies and writes them while it computes.
                saved = (update, storable(runners)) if update % config.checkpoint_every == 0 or last else None
                # The next chunk, as many updates as fit in `CHUNK_SECONDS` at the fastest speed seen.
                fastest = min(fastest, seconds / count)
                chunk = None if last else dispatch(max(1, min(length, int(CHUNK_SECONDS / fastest))))
                run.log(metrics, runners.episodes, count, first_update, count * config.batch_size * config.num_seeds / seconds,
                        checkpoint=saved)
                if config.capture_video and saved is not None and signals.requested is None:
                    # An episode of the first agent's policy now, as CleanRL records its first env's: at each
                    # checkpoint of the schedule and at the end, the policy the run leaves (not on a stop).
                    agent = jax.tree.map(lambda value: value[0], (runners.agent.params, runners.normalizer))
                    videos = record_videos(config, env_id, make_env(env_id, 1, config), training.network, agent,
                                           jax.random.fold_in(keys[0], update), run.dir / "videos", f"train-update{update}")
                    if run.tracking is not None:
                        run.tracking.log({"videos": [import_wandb().Video(str(path), format="mp4") for path in videos]})
    except (DivergedError, OSError) as error:  # the logging thread is done, so that this is the last line
        last = run.last_checkpoint()
        with signals.held():
            signals.closing = True  # the run's last line: a signal now finds nothing to stop
            if isinstance(error, DivergedError):
                print(f"\n{error}; " + (f"the last good checkpoint is {last}" if last else "no checkpoint was written"),
                      file=sys.stderr)
            else:  # a file of the run could not be written, on a full disk, say; what was written before is whole
                print(f"\n{PROG}: error: {unwritten(error)}; "
                      + (f"the last checkpoint is {last}" if last else "none was written"), file=sys.stderr)
        return 1
    with signals.held():  # the run's last lines: a signal that comes now, or after, finds nothing to stop
        signals.closing = True
        run.progress.show(update * config.batch_size, final=True)
        if signals.requested and update < config.num_updates:  # one heard in the last chunk found nothing to stop
            print(f"stopped at update {update}; resume with --resume {shlex.quote(str(run.checkpoint_path))}", file=sys.stderr)
            return 128 + signals.requested
        print(f"done: {update * config.batch_size:,} steps; checkpoint in {run.checkpoint_path}", file=sys.stderr)
        return 0


# ### Experiment tracking
#
# `--track` sends the run to Weights & Biases, as CleanRL does. wandb mirrors every TensorBoard
# event the run writes from `wandb.init` on (`sync_tensorboard`), so the tags are the same in both;
# `--capture-video` uploads its videos. wandb is optional, imported only for `--track`, and
# `WANDB_MODE=offline` keeps a run on disk for a later `wandb sync`.


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


def track_evaluation(config, returns: list[float], videos: list[Path]) -> None:
    """Send an evaluation to Weights & Biases: each episode's return, its mean, and the videos."""
    tracking = start_tracking(config, f"eval-{Path(config.eval).parent.name}", job_type="eval")
    try:
        for episode, episode_return in enumerate(returns):
            tracking.log({"eval/episodic_return": episode_return}, step=episode)
        tracking.summary["eval/mean_return"] = float(np.mean(returns))
        if videos:
            tracking.log({"videos": [import_wandb().Video(str(path), format="mp4") for path in videos]})
    finally:
        tracking.finish()


# ### Evaluation
#
# Evaluation plays whole episodes with the policy sampling its actions, as in training, and
# reports the real, unclipped return of each (on Atari, the score of a whole game, all its lives).
# It is one more compiled program: every agent plays `eval_episodes` episodes at once, until the
# last has ended. To record them (`--capture-video`, which also records an episode at each of a
# training run's checkpoints), the first agent's episodes are played again with the same key, a
# step at a time, and drawn: gymnax's states as gymnax draws them, Atari's games by a twin of the
# vector env in colour.


def evaluation_start(env: BatchedEnv, key: jax.Array) -> tuple:
    """The carry of an evaluation at its start: `(obs, state, returns, playing, key)`, every episode playing."""
    key, reset_key = jax.random.split(key)
    obs, state = env.reset(reset_key)
    return obs, state, jnp.zeros(env.num_envs), jnp.ones(env.num_envs, bool), key


def evaluation_step(network: nn.Module, env: BatchedEnv, params: Any, carry: tuple,
                    normalizer: Normalizer | None = None) -> tuple[tuple, jax.Array]:
    """One step of every environment with the policy, sampling its actions as in training; the carry, and the actions.

    The policy sees each observation as it saw them in training: through `normalizer`, the
    statistics the run ended with, frozen (`Normalizer.observe` only reads them), or as it is where
    `normalizer` is `None` (discrete actions, Atari)."""
    obs, state, returns, playing, key = carry
    key, action_key, env_key = jax.random.split(key, 3)
    policy, _ = network.apply(params, obs if normalizer is None else normalizer.observe(obs))
    actions = policy.sample(action_key)
    obs, state, _, _, _, info = env.step(env_key, state, actions)
    # An environment that finished its episode (Atari: its game) goes on, but no longer counts.
    returns = returns + jnp.where(playing, info.score, 0.0)
    return (obs, state, returns, playing & ~info.episode_over, key), actions


def make_evaluate(network: nn.Module, env: BatchedEnv) -> Callable[[Any, Any, jax.Array], jax.Array]:
    """`evaluate(params, normalizer, key)`: the returns of `env.num_envs` whole episodes played with `params` (and
    `normalizer`, see `evaluation_step`), every environment stepped until the last episode has ended."""

    def evaluate(params: Any, normalizer: Normalizer | None, key: jax.Array) -> jax.Array:
        return jax.lax.while_loop(lambda carry: carry[3].any(),
                                  lambda carry: evaluation_step(network, env, params, carry, normalizer)[0],
                                  evaluation_start(env, key))[2]

    return evaluate


def trained_agents(config: AtariConfig, env_id: str, checkpoint: dict, path: str) -> tuple[Training, tuple]:
    """`make_train`'s pieces for the checkpoint's settings, and its agents' `(params, normalizers)`: the parameters
    and, for continuous actions, the statistics each agent's observations were normalised by."""
    training = make_train(config, env_id, convolution_layer())
    template = jax.eval_shape(jax.vmap(training.init), agent_keys(config))
    return training, (restore_tree(template.agent.params, checkpoint["runners"]["agent"]["params"], path),
                      restore_tree(template.normalizer, checkpoint["runners"].get("normalizer"), path))


def evaluate_compiled(config: RunConfig, env_id: str, checkpoint: dict) -> np.ndarray:
    """`[agents, eval_episodes]` returns of the checkpoint's agents (on Atari, the scores of whole games)."""
    training, agents = trained_agents(config, env_id, checkpoint, config.eval)
    env = make_env(env_id, config.eval_episodes, config)
    # Episodes unlike the training ones: keys from another branch of the seed's key.
    keys = jax.random.split(jax.random.fold_in(jax.random.key(config.seed), 1), config.num_seeds)
    placed = jax.device_put((*agents, keys), split_over_seeds(mesh := seed_mesh(config.num_seeds)))
    evaluate = jax.jit(jax.vmap(make_evaluate(training.network, env))).lower(*placed).compile()
    check_memory(f"the episodes of {how_many(config.num_seeds, 'agent')} ({config.eval_episodes:,} each)",
                 compiled_memory(evaluate), mesh, fewer="--eval-episodes")
    videos = []
    if config.capture_video:
        # SIGTERM and SIGHUP end the recording as Ctrl-C does, its unfinished videos deleted (`main` exits 143 or
        # 129). Not the compiled evaluation below: a Python handler would run only once it returned.
        def end_recording(signum: int, frame: object) -> None:
            raise KeyboardInterrupt(128 + signum)

        ended = {sig: signal.signal(sig, end_recording) for sig in (signal.SIGTERM, signal.SIGHUP)
                 if signal.getsignal(sig) != signal.SIG_IGN}  # a SIGHUP that `nohup` ignores stays ignored
        try:
            videos = record_videos(config, env_id, env, training.network, jax.tree.map(lambda value: value[0], agents),
                                   keys[0], writable_dir(Path(config.run_dir or Path(config.eval).parent) / "videos"), "eval")
        finally:
            for sig, handler in ended.items():
                signal.signal(sig, handler)
        print(f"videos in {videos[0].parent}", file=sys.stderr)
    returns = np.asarray(evaluate(*placed))
    if config.track:
        track_evaluation(config, returns.ravel().tolist(), videos)
    return returns


def record_videos(config: AtariConfig, env_id: str, env: BatchedEnv, network: nn.Module, agent: tuple,
                  key: jax.Array, video_dir: Path, name: str) -> list[Path]:
    """Play the episodes `make_evaluate` plays with one agent's `(params, normalizer)` and `key`, a step at a time,
    into an mp4 each in `video_dir`, named `<name>-...`; their paths.

    gymnax resets an environment within the step that ends its episode, so its video shows the
    first state and every step's but the last. The frames an Atari agent sees are grey and small:
    a twin of the vector env in colour, at the screen's size, with the same settings and seeds,
    stepped with the same actions, plays the very same games (the emulator is deterministic), and
    its frames are the video's, played at 60 frames a second over the frame skip: in real time.
    """
    step = jax.jit(functools.partial(evaluation_step, network, env))
    carry, atari = jax.jit(functools.partial(evaluation_start, env))(key), isinstance(env, AtariEnv)
    with contextlib.ExitStack() as stack:
        if atari:
            import cv2
            from ale_py.vector_env import AtariVectorEnv

            twin = AtariVectorEnv(env.game, env.num_envs, stack_num=1, grayscale=False, img_height=210,
                                  img_width=160, maxpool=False, **env.settings)
            stack.callback(twin.close)
            twin.reset(seed=np.asarray(env.seeds(jax.random.split(key)[1])))
        # Classic control plays at gymnasium's own rate; MinAtar has none, and 15 steps a second reads well.
        fps = 60 / config.frame_skip if atari else 15 if "MinAtar" in env_id else gym.make(env_id).metadata["render_fps"]
        # Each is written under a hidden name and shown once whole: a recording stopped part way leaves no file.
        paths = [video_dir / (f"{name}-{env.game}-game{index:02d}.mp4" if atari else f"{name}-{env_id}-episode{index:02d}.mp4")
                 for index in range(env.num_envs)]
        hidden = [path.with_name(f".{path.name}") for path in paths]
        for path in hidden:
            stack.callback(path.unlink, missing_ok=True)  # run after the videos are closed
        videos = [stack.enter_context(contextlib.closing(Video(path, fps))) for path in hidden]

        while (playing := np.asarray(carry[3])).any():
            if not atari:  # each gymnax state a step starts from: the first, and every step's but the last
                state = jax.device_get(carry[1])
                for index in np.flatnonzero(playing):
                    videos[index].write(render_gymnax(env_id, env, jax.tree.map(lambda value: value[index], state)))
            before, (carry, actions) = carry, step(agent[0], carry, agent[1])
            if atari:  # the twin's screen after the step, the game's last included
                screens = twin.step(np.asarray(env.actions_played(before[1], actions)))[0][:, 0]
                for index in np.flatnonzero(playing):
                    videos[index].write(cv2.resize(screens[index], None, fx=2, fy=2, interpolation=cv2.INTER_NEAREST))
        for video, path in zip(videos, paths):
            video.close()
            os.replace(video.path, path)
    return paths


def render_gymnax(env_id: str, env: BatchedEnv, state: Any) -> np.ndarray:
    """One RGB frame of a gymnax state, drawn as gymnax's own visualiser draws it.

    Classic control through gymnasium's renderer with the state copied in (gymnax's
    `render_gym_frame`); MinAtar as its 10 x 10 grid, each cell in the colour of its highest
    channel from gymnax's palette (seaborn's cubehelix, black for an empty cell), 20 pixels a cell.
    """
    # pygame, which draws classic control, needs no display or sound card for this.
    os.environ.setdefault("SDL_VIDEODRIVER", "dummy")
    os.environ.setdefault("SDL_AUDIODRIVER", "dummy")
    from gymnax.visualize import vis_gym  # imported here: only a recording needs it (and matplotlib)

    if env_id in vis_gym.SUPPORTED_GYM_ENVS:
        return vis_gym.render_gym_frame(env_id, state, env.params)
    import seaborn

    grid = np.asarray(env.env.get_obs(state, env.params))  # [10, 10, channels] of 0 and 1
    palette = np.round(255 * np.array([(0.0, 0.0, 0.0), *seaborn.color_palette("cubehelix", grid.shape[-1])]))
    cells = np.amax(grid * np.arange(1, grid.shape[-1] + 1), axis=2).astype(int)
    return np.repeat(np.repeat(palette.astype(np.uint8)[cells], 20, axis=0), 20, axis=1)


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


def describe_returns(returns: np.ndarray) -> str:
    return f"{np.mean(returns):.1f} ± {np.std(returns):.1f} (min {np.min(returns):g}, max {np.max(returns):g})"


# ### A trained policy, in Python


class Policy(NamedTuple):
    """A trained agent: `act(obs, key)` samples actions for a batch of observations of `make_env(num_envs)`, its
    environment with the checkpoint's settings (Atari's frames, continuous observations' normalisation, as in training)."""
    act: Callable[[jax.Array, jax.Array], jax.Array]
    make_env: Callable[..., BatchedEnv]


def load_policy(path: str | Path, agent: int = 0) -> Policy:
    """The policy of agent `agent` of the checkpoint at `path`. The README shows a loop that plays with it."""
    checkpoint = load_checkpoint(str(path))
    config = AtariConfig(**{k: v for k, v in checkpoint["config"].items() if k in AtariConfig.__dataclass_fields__})
    if not 0 <= agent < config.num_seeds:  # an index past the end would be clamped to the last agent
        raise ConfigError(f"checkpoint {path} holds {how_many(config.num_seeds, 'agent')}; there is no agent {agent}")
    training, agents = trained_agents(config, checkpoint["env_id"], checkpoint, str(path))

    def act(params: Any, normalizer: Normalizer | None, obs: jax.Array, key: jax.Array) -> jax.Array:
        return training.network.apply(params, obs if normalizer is None else normalizer.observe(obs))[0].sample(key)

    return Policy(functools.partial(jax.jit(act), *jax.tree.map(lambda value: value[agent], agents)),
                  functools.partial(make_env, checkpoint["env_id"], config=config))


# ### main


def main(argv: list[str] | None = None) -> int:
    try:
        config, checkpoint, env_id, family = parse_config(argv)
        if config.track:
            import_wandb()  # here, so that a missing wandb stops the run before it starts
        choose_device(config.device)
        os.environ.setdefault("SDL_NO_SIGNAL_HANDLERS", "1")  # or pygame's SDL takes SIGTERM as it first renders
        if config.eval is None:
            with Signals() as signals:
                return train_compiled(config, env_id, checkpoint, signals)
        returns = evaluate_compiled(config, env_id, checkpoint)
        for agent, agent_returns in enumerate(returns if len(returns) > 1 else []):
            print(f"agent {agent}: return {describe_returns(agent_returns)}")
        what = (f"{len(returns)} agents x {how_many(returns.shape[1], 'episode')}, return" if len(returns) > 1 else
                f"{how_many(returns.shape[1], 'game')}, score" if family == "Atari" else f"{how_many(returns.shape[1], 'episode')}, return")
        print(f"{env_id}: {what} {describe_returns(returns)}")
        return 0
    except ConfigError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as interrupt:  # before training began (while compiling, say): nothing to save
        print(f"\n{PROG}: interrupted", file=sys.stderr)
        return interrupt.args[0] if interrupt.args else 130  # a recording's SIGTERM or SIGHUP gives its status
    except OSError as error:  # a video of --eval that could not be written, on a full disk, say (training reports its own)
        print(f"\n{PROG}: error: {unwritten(error)}", file=sys.stderr)
        return 1


# ## Part 4: More than one device
#
# The agents of `--num-seeds` share nothing, so with several devices (GPUs, say) each can train its
# share of them with no word to the others. The simplest way to say so in JAX is to say nothing new
# about the computation, only about where its data lies: the runners are placed with their first
# axis, the agents', split over a one-dimensional `Mesh` of the devices, by a `NamedSharding` of
# `PartitionSpec("seeds")`, and `jax.jit` compiles the same program for data laid out that way.
# XLA's partitioner follows the seed axis through the vmapped run, and as no operation mixes two
# agents, every device runs the whole program on its own agents and no array moves between devices
# (a test checks that the compiled program holds no collective operation); `shard_map` would say
# the same by hand, with a spec for every input and output. The layout
# of the outputs is stated too (`out_shardings`), so that a chunk's runners go into the next chunk
# laid out as the compiled program expects. Part 1's `jax.jit(jax.vmap(train))` spreads the same
# way when its keys are placed first; the command line initialises the agents on one device and
# places their runners instead, since their initialisation, a loop over them (Part 3), would first
# gather the keys onto every device.
#
# Every device runs the same program, on as many agents as each other one, so the agents must split
# evenly. Rather than refuse a run, we use the most devices they split over: 6 agents on 4 devices
# train on 3 of them, 2 each; 5 agents train on one. The run prints what it uses. On one device
# nothing changes. On several, the results agree with one device's to rounding, not bit for bit (XLA
# may order the sums of a smaller batch otherwise); over a long run a sampled action flips and the
# episodes part ways: equally good samples of training, not the same sample. The checkpoint does not
# depend on the devices (`jax.device_get` gathers a sharded array), so a run started on two devices
# can be resumed or evaluated on one.
#
# An Atari run is not spread. It trains one agent, so the devices would have to split its batch and
# add up their gradients at every minibatch; and its games run in the CPU's threads whatever the
# device (on a GPU, the vector env's custom call copies the frames over at each step).

SEED_AXIS = "seeds"


def seed_mesh(num_seeds: int, devices: list | None = None) -> Mesh:
    """A one-dimensional mesh of the most devices (of `devices`, default all) that split `num_seeds` agents evenly."""
    devices = devices or jax.devices()
    count = max(n for n in range(1, len(devices) + 1) if num_seeds % n == 0)
    return Mesh(np.array(devices[:count]), (SEED_AXIS,))


def split_over_seeds(mesh: Mesh, axis: int = 0) -> NamedSharding:
    """The layout of arrays whose agent axis is `axis`: that axis split over the devices of `mesh`."""
    return NamedSharding(mesh, PartitionSpec(*[None] * axis, SEED_AXIS))


def compile_train_chunk(training: Training, length: int, runners: Runner, mesh: Mesh) -> Callable:
    """`train_chunk(runners, count)`: `count <= length` more updates of every agent, compiled for `runners` on `mesh`.

    It is Part 1's `train_chunk` under `vmap`, with the same `count` for every agent; it returns the
    runners and the metrics, `[length, agents]`, both split over the devices as the runners are. A
    program that needs more memory than a device has is refused (`check_memory`), as XLA sizes it.
    """
    every_agent = jax.vmap(functools.partial(training.train_chunk, length=length), in_axes=(0, None),
                           out_axes=(0, 1))
    train_chunk = jax.jit(every_agent, out_shardings=(split_over_seeds(mesh), split_over_seeds(mesh, axis=1)))
    compiled = train_chunk.lower(runners, jnp.int32(0)).compile()
    check_memory(f"the updates of {how_many(jax.tree.leaves(runners)[0].shape[0], 'agent')}", compiled_memory(compiled),
                 mesh)
    return compiled


def describe_devices(mesh: Mesh, num_seeds: int) -> str:
    """One line: the devices used, how many agents each trains, and why some are left idle."""
    available = len(jax.devices())
    platform, per_device = mesh.devices.flat[0].platform, how_many(num_seeds // mesh.size, "agent")
    line = f"devices: {mesh.size} × {platform} ({per_device} per device"
    if mesh.size < available:
        idle = available - mesh.size
        line += f"; {idle} of the {available} left idle: {how_many(num_seeds, 'agent')} split evenly over no more"
    return line + ")"


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the libraries are loaded: Ctrl-C is Python's again
    sys.stdout, sys.stderr = (Terminal(stream) if stream.isatty() else stream for stream in (sys.stdout, sys.stderr))
    status = main()
    # Nothing is left to stop while Python and JAX shut down. A handler that does nothing first, so
    # that a Ctrl-C or a hang-up on its way is dropped (under `SIG_IGN` alone, one arriving as it is
    # set would print "ignored due to race condition"); then `SIG_IGN`, which the shutdown keeps.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: None)
        signal.signal(sig, signal.SIG_IGN)
    sys.exit(status)
