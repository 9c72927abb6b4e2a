r"""
# Proximal Policy Optimization on Atari

This page trains an agent to play an Atari 2600 game from pixels with Proximal Policy
Optimization (PPO), and is written to be read top to bottom. It shows the algorithm first, for one
process: the wrapper that turns the emulator into frames a network can learn from, the
convolutional actor-critic, generalized advantage estimation, the clipped objective and the loop of
training. The engineering follows: the processes that play many games at once, the command line,
checkpoints and logs, data-parallel training. Everything it needs is in this one file.

```
pip install -r requirements.txt
python ppo_atari.py --env Breakout              # train; TensorBoard events in runs/
python ppo_atari.py --eval runs/<run>/checkpoint.pt --capture-video
torchrun --nproc_per_node 4 ppo_atari.py --env Breakout    # data-parallel: see Part 4
```

**What to expect.** The defaults train for 10M agent steps (40M frames) on 8 games at once, 128
steps each per update, with 4 epochs of 4 minibatches, a learning rate of $2.5 \cdot 10^{-4}$ and a
clip range of $0.1$, both annealed linearly until the last update, which uses $1/N$ of each ($N$
updates in all). These are the Atari settings of OpenAI baselines' PPO, which CleanRL's
`ppo_atari.py` also uses (with a constant clip range); the PPO paper's own (its Table 5) differ in 3
epochs and a value coefficient of 1. The table under `Config` gives the source of every default.
At that budget the PPO paper reports a Breakout score of 274.8 (Schulman et al., 2017, table 6),
and CleanRL's documentation reports 414.66 ± 28.09 for its `ppo_atari.py` and 406.57 ± 31.55 for
OpenAI baselines' PPO (Huang et al., 2022). The README gives the speed of this script, measured
with `benchmarks/throughput.py`. No run of it has reached 10M steps yet; the first 2M, on this
project's 2-core CPU, follow CleanRL's curve:

![ppo_atari.py on Breakout, seeds 1 to 3 with the 10M-step schedule to 2M steps: the mean score of the last 100 games climbs from about 1 to 24.2 at 1M and 51.3 at 2M, the seeds shaded between the lowest and the highest; CleanRL's curve, 20 at 1M and about 47.5 at 2M, is drawn as points](benchmarks/results/breakout.png)

`python benchmarks/learning_curves.py breakout` made the curve: seeds 1 to 3 with the bfloat16
torso (`--precision bf16`, which `auto` takes on the AMD CPU where seeds 1 and 2 ran) and every
other default, the 10M-step schedule stopped at 2M steps. The mean real score of the last 100
games: 16.3, 26.7 and 29.6 at 1M (CleanRL: about 20), 40.4, 52.6 and 60.9 at 2M (CleanRL: 45 to
50).

Papers: PPO (Schulman et al., 2017, arXiv:1707.06347); GAE (Schulman et al., 2016,
arXiv:1506.02438); the Atari preprocessing and network of DQN (Mnih et al., 2015, Nature 518);
sticky actions and the evaluation protocol of Machado et al. (2018, JAIR 61); time limits as
truncation (Pardo et al., 2018, arXiv:1712.00378); the implementation details catalogued by Huang
et al. (2022, "The 37 implementation details of PPO", ICLR blog track).

The page in order:

1. **The algorithm**, for one process: the hyperparameters (`Config`, and where each default comes
   from); the game (`Game`, made by `make_env`); the model (`ActorCritic`, built by `make_model`);
   the advantages (`compute_gae`, `normalize_advantages`); the clipped objective (`ppo_loss`); the
   rollout, kept on the host and crossing to the device once each way per step, the update and the
   loop of training (`Trainer`). Every run, on every device, plays this rollout and makes this update.
2. **Sampling at speed**: `Workers`, many games in other processes, frames in shared memory;
   `FastSamplingTrainer`, the network's side of a step on one thread, from pinned memory and a CUDA
   graph, with the network in the layout and precision this machine runs fastest (`TunedActorCritic`).
3. **Running it for real**: the command line (`RunConfig`: `Config` and the settings of one
   invocation), the device, checkpoints, logging and progress, signals
   (`Signals`), the run (`train`, with `RunWorkers` and `RunTrainer`, the trainer that runs), a
   trained policy in Python (`load_policy`) and its evaluation, videos, `main()`.
4. **More than one device**: data-parallel training under torchrun (`DataParallelTrainer`, `Ranks`;
   each rank trains with a `DataParallelRunTrainer`).

Licence: MIT (see LICENSE in the repository this file comes from); copy it freely, keeping this line.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import copy
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

import ale_py
import cv2
import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributions import Categorical


# ## Part 1: The algorithm
#
# Everything PPO does, in the order it runs, for one process: the settings, the game as the learner
# sees it, the network, the advantages and the loss, then sampling, updating and the loop that
# repeats them. A reader who stops at the end of this part has seen all of PPO. The later parts
# make it fast, usable and wider by extending what is here, never by reaching into it.
#
# ### The hyperparameters
#
# One dataclass holds every setting of the agent and its training. The string under each field is
# its documentation and its `--help` text: the command line (Part 3) is derived from it and from
# Part 3's `RunConfig`, which adds the settings of one invocation (`num_envs` is `--num-envs`).


@dataclass
class Config:
    r"""Every setting of the agent and its training, and where each default of the algorithm comes from.

    | setting | ours | PPO paper, Atari (Table 5) | CleanRL `ppo_atari.py` | why ours |
    |-|-|-|-|-|
    | `num_envs` x `num_steps` | 8 x 128 | 8 actors x horizon 128 | 8 x 128 | Everyone's |
    | `learning_rate` | $2.5 \cdot 10^{-4}$, annealed linearly: update $k$ of $N$ uses $(1 - k/N)$ of it, the last $1/N$ | $\alpha \cdot 2.5 \cdot 10^{-4}$, with $\alpha$ annealed from 1 to 0 over the run | $2.5 \cdot 10^{-4}$, annealed as ours | Everyone's; "to 0" is where the line would reach after the last update |
    | `clip_range` | 0.1, annealed as the learning rate | $\alpha \cdot 0.1$ | 0.1, constant | The paper's, and OpenAI baselines' until 2019 (`cliprange=lambda f : f * 0.1` in `ppo2/defaults.py`; its last version, of February 2019, keeps 0.1 constant) |
    | `update_epochs` | 4 | 3 | 4 | baselines' and CleanRL's |
    | `num_minibatches` | 4, of 256 transitions | minibatches of 32 x 8 = 256 | 4, of 256 | The same size everywhere |
    | `gamma` | 0.99 | 0.99 | 0.99 | Everyone's |
    | `gae_lambda` | 0.95 | 0.95 | 0.95 | Everyone's |
    | `vf_coef` | 0.5, on a value loss that holds a $\tfrac12$ (see `ppo_loss`): 0.25 on the squared error | $c_1 = 1$ on the squared error | 0.5 on the same $\tfrac12$ | baselines' and CleanRL's; the value loss is also clipped as theirs, where the paper's is not |
    | `ent_coef` | 0.01 | $c_2 = 0.01$ | 0.01 | Everyone's |
    | `max_grad_norm` | 0.5 | not given | 0.5 | baselines' and CleanRL's |
    | `target_kl` | none | none | none | Everyone's |
    | `total_timesteps` | 10M agent steps (40M frames) | 40M frames | 10M | Everyone's |

    Not settings but fixed in the code, each explained where it is: the Nature CNN with orthogonal
    initialisation, advantages normalised per minibatch, and Adam's $\epsilon = 10^{-5}$ (baselines'
    and CleanRL's; the paper gives none). The Atari protocol (`sticky_actions` to
    `max_episode_frames`) is the DQN preprocessing that CleanRL and baselines also use; `Game`
    explains each piece. The settings of one invocation rather than of the agent (workers, device,
    run directory, checkpoints, evaluation) are not here: they live in `RunConfig`, in Part 3.
    """

    env: str = "Breakout"
    """Atari game: a short name (`Breakout`) or a full id (`BreakoutNoFrameskip-v4`, `ALE/Breakout-v5`).
    A full id only names the game; the protocol comes from the flags below."""
    total_timesteps: int = 10_000_000
    """Agent steps to train for, summed over all games (one agent step is `frame_skip` frames)."""
    num_envs: int = 8
    """Games played at once."""
    num_steps: int = 128
    """Steps each game plays per update; a batch is `num_envs * num_steps` transitions."""
    learning_rate: float = 2.5e-4
    """Adam's learning rate at the start, annealed linearly: 1/N of it at the last of N updates."""
    clip_range: float = 0.1
    """PPO's clip range epsilon at the start, annealed like the learning rate."""
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
    """Weight of the value loss (which holds a factor 1/2 of its own)."""
    max_grad_norm: float = 0.5
    """Clip the global norm of the gradient to this."""
    target_kl: float | None = None
    """Skip the update's remaining epochs once an epoch's last minibatch finds the approximate KL
    divergence to the old policy above this (CleanRL's rule)."""
    sticky_actions: float = 0.0
    """Probability that the emulator repeats the previous action on a frame (Machado et al. recommend 0.25)."""
    life_loss: bool = True
    """End the learning episode when a life is lost (the game goes on), and serve the next ball for the agent."""
    noop_max: int = 30
    """Up to this many no-op frames at the start of each game, a random number of them."""
    frame_skip: int = 4
    """Frames each action is repeated for."""
    max_episode_frames: int = 108_000
    """Frames after which a game is cut (a truncation): 30 minutes of play at 60 frames a second."""
    seed: int = 1
    """Seeds torch and every game (each game gets its own seed derived from this)."""

    @property
    def batch_size(self) -> int:
        return self.num_envs * self.num_steps

    @property
    def minibatch_size(self) -> int:
        return self.batch_size // self.num_minibatches


# ### The game
#
# The emulator shows 210 x 160 colour frames at 60 per second and knows nothing of learning. The
# `Game` class turns it into what the DQN paper (Mnih et al., 2015) fed its network, the protocol
# PPO, CleanRL and rl-zoo all report on: the agent picks an action every 4th frame, sees a stack of
# the last 4 of its observations, grey and shrunk to 84 x 84, and learns from rewards clipped to
# their sign. Our wrapper does the frame skipping itself and asks the ALE to step one frame at a
# time, with no sticky actions unless `--sticky-actions` sets them and the minimal action set.
#
# `--sticky-actions 0.25` gives the emulator the randomness Machado et al. (2018) recommend, but not
# their whole protocol: they also end an episode only at game over (`--no-life-loss` here) and give
# the agent no game-specific help, while `Game` still presses FIRE at the start of every game.


class Transition(NamedTuple):
    """What one agent step of a `Game` reports besides the new observation."""

    reward: float      # the reward for learning: the sign of the points scored in the step
    terminated: bool   # the learning episode ended with no future: game over, or a life lost (with life loss on)
    truncated: bool    # the game was cut at the frame cap: its future exists but we stop watching; bootstrap it
    game_over: bool    # the whole game ended (by either cause): it must be reset before the next step
    score: float       # the game's real, unclipped score so far
    length: int        # emulator frames of this game so far, no-op and FIRE frames included


class Game:
    r"""One Atari game as the learner sees it.

    The pieces, each a known trick (Mnih et al., 2015; Machado et al., 2018; Huang et al., 2022):

    * **No-op starts.** A deterministic emulator starts every game the same way, so after a reset a
      random number (1 to `noop_max`) of frames pass with no action, and games differ from the start.
    * **FIRE to start.** Games whose second action is FIRE (Breakout, Pong, ...) wait for it before
      play begins, after a reset and, with life loss on, after each lost life. Pressing it for the
      agent saves it thousands of wasted steps learning to serve. baselines and CleanRL press it at
      every reset, and with life loss on a lost life is a reset for them (their `FireResetEnv` wraps
      `EpisodicLifeEnv`); with `--no-life-loss` nobody serves the next ball but the agent.
    * **Frame skip and max-pool.** Each action is repeated for `frame_skip` frames and the rewards
      summed. The observation is the pixel-wise maximum of the last two frames, because the Atari
      draws some sprites only on every other frame and one frame alone can miss them. A step of one
      frame (`--frame-skip 1`) is that frame alone, as in gymnasium's `AtariPreprocessing` and
      ale-py's vector env.
    * **Grey, small, stacked.** The pooled frame is converted to luminance (the ALE's own palette
      conversion), shrunk to 84 x 84 with area averaging, and stacked with the three before it, so
      the network can see motion. Frames stay `uint8`, channels first; the newest is last.
    * **Reward clipping.** Learning sees $\mathrm{sign}(r)$, so one learning rate fits games whose
      points come in ones and games whose points come in thousands. The real score is kept apart and
      is what we report.
    * **Life loss.** Losing a life ends the episode *for learning*: the advantage stops there, which
      teaches the agent that a life is worth keeping. The game is not reset; it goes on with the
      next life, and the score runs on. A life counts as lost only if some are left after it:
      baselines' `lives > 0` guard, written because Q*bert's counter could sit at 0 for a few frames
      before its game ended. (In ALE 0.12.1 the last life and the game over of Q*bert, and of the
      seven other games with lives we tried, fall on the same frame: the guard changes nothing there.)
    * **Two ends.** Game over is a *termination*: there is no future to value. The frame cap is a
      *truncation*: the game could go on, we just stopped it, and the value of where it was cut is
      real. The two are reported apart so the advantage computation can treat them apart.
    * **What is reported.** A whole game's real score and its length in emulator frames, no-op and
      FIRE frames included: what CleanRL logs under the same tags (`charts/episodic_return`,
      `charts/episodic_length`), since its `RecordEpisodeStatistics` wraps the emulator itself,
      below the frame skip and the life loss. A length in agent steps is about a quarter of it.

    `obs` is the current stack of frames, updated in place; copy it to keep it. A worker passes a
    view of shared memory as `obs`, so the frames land where the main process reads them.
    """

    observation_shape = (4, 84, 84)
    """A stack of the last 4 observations, each grey and 84 x 84: the only place this shape is
    written; the workers and the network take it from the game."""

    def __init__(self, env_id: str, seed: int, *, sticky_actions: float = 0.0, life_loss: bool = True,
                 noop_max: int = 30, frame_skip: int = 4, max_episode_frames: int = 108_000,
                 obs: np.ndarray | None = None):
        gym.register_envs(ale_py)
        ale_py.ALEInterface.setLoggerMode(ale_py.LoggerMode.Error)  # no banner from every emulator
        # The ALE steps one frame at a time (`frameskip=1`) and cuts the game at the frame cap, which
        # it then reports through `game_truncated()` rather than as a game over.
        env = gym.make(env_id, frameskip=1, repeat_action_probability=sticky_actions,
                       full_action_space=False, max_num_frames_per_episode=max_episode_frames)
        self.env = env.unwrapped
        self.env.reset(seed=int(seed))
        self.ale = self.env.ale
        self.actions = self.ale.getMinimalActionSet()
        self.n_actions = len(self.actions)
        meanings = self.env.get_action_meanings()
        self.fire = self.actions[1] if len(meanings) >= 3 and meanings[1] == "FIRE" else None
        self.life_loss = life_loss
        self.noop_max = noop_max
        self.frame_skip = frame_skip
        self.rng = np.random.default_rng(int(seed))
        height, width = self.ale.getScreenDims()
        self.screens = np.zeros((2, height, width), np.uint8)
        self.pooled = np.zeros((height, width), np.uint8)
        self.obs = np.zeros(self.observation_shape, np.uint8) if obs is None else obs
        self.score = 0.0
        self.length = 0
        self.lives = 0

    def reset(self) -> np.ndarray:
        """Start a new game: no-ops, FIRE if the game needs it, and a stack of the first frame."""
        self.ale.reset_game()
        for _ in range(self.rng.integers(1, self.noop_max + 1) if self.noop_max > 0 else 0):
            self.ale.act(ale_py.Action.NOOP)
            if self.ale.game_over():
                self.ale.reset_game()
        self.score = 0.0
        self.ale.getScreenGrayscale(self.screens[1])  # the game's first frame: both screens, until it moves on
        self.screens[0] = self.screens[1]
        if self.fire is not None:
            self.score += self._play(self.fire)
            if self.ale.game_over():
                return self.reset()
        self.lives = self.ale.lives()
        self.length = self.ale.getEpisodeFrameNumber()
        self._observe(new_game=True)
        return self.obs

    def step(self, action: int) -> Transition:
        """Play `action` (an index into the minimal action set) for `frame_skip` frames."""
        points = self._play(self.actions[action])
        self.score += points
        lives = self.ale.lives()
        life_lost = 0 < lives < self.lives and not self.ale.game_over()
        self.lives = lives
        # After a lost life that ends the learning episode, serve again for the agent. The frames of
        # the serve belong to the next life, so its points (none, in the games we know) count for
        # the score but not as a reward.
        if life_lost and self.life_loss and self.fire is not None:
            self.score += self._play(self.fire)
        self.length = self.ale.getEpisodeFrameNumber()
        game_over = self.ale.game_over(with_truncation=False)
        truncated = self.ale.game_truncated()
        self._observe(new_game=False)
        return Transition(reward=float((points > 0) - (points < 0)),
                          terminated=game_over or (self.life_loss and life_lost),
                          truncated=truncated,
                          game_over=game_over or truncated,
                          score=self.score, length=self.length)

    def render(self) -> np.ndarray:
        """The current frame in colour, 210 x 160 x 3 RGB, for videos."""
        return self.ale.getScreenRGB()

    def close(self) -> None:
        self.env.close()

    def _play(self, action: ale_py.Action) -> float:
        """Repeat `action` for `frame_skip` frames; leave the step's last two frames in `screens`."""
        points = 0.0
        for frame in range(self.frame_skip):
            points += self.ale.act(action)
            if frame >= self.frame_skip - 2:
                self.ale.getScreenGrayscale(self.screens[frame - self.frame_skip + 2])
            if self.ale.game_over():
                break
        # A screen this step did not grab would be stale, and the final frame stands in for it: the
        # game ended before the step's last frames, or a step of one frame has no second to pool.
        if frame < self.frame_skip - 1:
            self.ale.getScreenGrayscale(self.screens[1])
        if frame < self.frame_skip - 2 or self.frame_skip == 1:
            self.screens[0] = self.screens[1]
        return points

    def _observe(self, new_game: bool) -> None:
        """Pool the last two screens, shrink the result into the newest slot of the stack."""
        np.maximum(self.screens[0], self.screens[1], out=self.pooled)
        if not new_game:
            self.obs[:-1] = self.obs[1:]
        height, width = self.observation_shape[1:]
        cv2.resize(self.pooled, (width, height), dst=self.obs[-1], interpolation=cv2.INTER_AREA)
        if new_game:
            self.obs[:-1] = self.obs[-1]  # a new game has no past: its first frame fills the stack


def make_env(env_id: str, seed: int, options: dict, obs: np.ndarray | None = None) -> Game:
    """One game, made here and nowhere else: the workers (Part 2) and the evaluation (Part 3) call this.

    The rest of the page asks of a game what `Game` offers: `obs` (`uint8`, channels first, updated
    in place, in the array `obs` when one is given), `n_actions`, `reset()`, `step(action)` returning
    a `Transition`, `render()` and `close()`. The shapes of the frames and of the network follow from
    it, so a fork that trains on another task with pixels and discrete actions changes this function
    and the wrapper it returns, and nothing else in Parts 1 and 2 (the tests train a small gymnasium
    task this way); Part 3's command line knows Atari's names, and sizes its memory check by `Game`'s
    frames.
    """
    return Game(env_id, seed, obs=obs, **options)


# ### The model
#
# The network of the DQN paper ("Nature CNN"): three convolutions and a 512-unit layer, shared by
# two linear heads, one for the logits of the policy $\pi_\theta(a|s)$ and one for the value
# $V_\theta(s)$. Sharing the torso halves the compute; the price is that the value loss and the
# policy loss pull on the same features, which `vf_coef` balances.


def layer_init(layer: nn.Module, gain: float = math.sqrt(2)) -> nn.Module:
    r"""Orthogonal weights scaled by `gain`, zero biases.

    Orthogonal matrices keep the norm of what passes through them, so activations neither explode
    nor vanish with depth; $\sqrt 2$ makes up for the half of each ReLU's input that is cut to 0.
    The policy head starts at gain 0.01, so the first policy is almost uniform and every action is
    tried; the value head starts at gain 1.
    """
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.zeros_(layer.bias)
    return layer


class ActorCritic(nn.Module):
    """A torso shared by a policy head and a value head; `make_model` below builds the one we use.

    Frames arrive as `uint8`, four times fewer bytes to move than float32, and are scaled to [0, 1]
    on the device, where the network runs, in `frames_dtype`: float32 here, bfloat16 where Part 2's
    `TunedActorCritic` runs the torso in it.
    """

    frames_dtype = torch.float32

    def __init__(self, torso: nn.Module, policy: nn.Module, value: nn.Module):
        super().__init__()
        self.torso, self.policy, self.value = torso, policy, value

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits `[batch, n_actions]` and values `[batch]` for `uint8` frames `[batch, *observation_shape]`."""
        hidden = self.features(obs)
        return self.policy(hidden), self.value(hidden).squeeze(-1)

    def features(self, obs: torch.Tensor) -> torch.Tensor:
        """What the torso makes of the frames, scaled from bytes to [0, 1] first."""
        return self.torso(obs.to(self.frames_dtype) * (1.0 / 255.0))


def make_model(observation_shape: tuple[int, ...], n_actions: int) -> ActorCritic:
    """The network, built here and nowhere else: the Nature CNN for frames of `observation_shape`
    (channels first), with a policy head of `n_actions` logits and a value head."""
    channels = observation_shape[0]
    convolutions = nn.Sequential(
        layer_init(nn.Conv2d(channels, 32, kernel_size=8, stride=4)), nn.ReLU(inplace=True),  # 84 x 84 -> 20 x 20
        layer_init(nn.Conv2d(32, 64, kernel_size=4, stride=2)), nn.ReLU(inplace=True),        # -> 9 x 9
        layer_init(nn.Conv2d(64, 64, kernel_size=3, stride=1)), nn.ReLU(inplace=True),        # -> 7 x 7
    )
    # What the convolutions leave of a frame of this shape: a blank one passed through tells.
    with torch.no_grad():
        features = convolutions(torch.zeros((1,) + tuple(observation_shape))).numel()
    torso = nn.Sequential(*convolutions, nn.Flatten(), layer_init(nn.Linear(features, 512)), nn.ReLU(inplace=True))
    policy = layer_init(nn.Linear(512, n_actions), gain=0.01)
    value = layer_init(nn.Linear(512, 1), gain=1.0)
    return ActorCritic(torso, policy, value)


# ### Generalized advantage estimation
#
# The policy gradient needs to know how much better an action was than the policy's average at
# that state: the advantage $A_t$. GAE (Schulman et al., 2016) blends estimates of it from one step
# to the whole rollout.


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

    The returns that the value function regresses to are $\hat A_t + V(s_t)$, an estimate of the
    $\lambda$-return.

    `next_values[t]` is $V(s_{t+1})$, the value of the observation that step $t$ led to. Where the
    game went on, that is simply `values[t + 1]` (or the value of the observation after the rollout).
    Where step $t$ ended a game, the observation the workers returned is already the first of the
    next game: where it was truncated, the caller supplies the value of the game's *final*
    observation instead; where it terminated, the value there is multiplied by 0 (below).

    **Why termination and truncation stay apart.** A termination (game over, a lost life) means
    there is no future: the value after it is 0 and is not bootstrapped. A truncation (the frame cap)
    means only that we stopped watching: the game would have gone on scoring, so $\delta_t$
    bootstraps from $V$ of the final observation, while the sum over later TD errors is still cut,
    since those belong to the next game. Folding the two into one `done` flag, as most reference
    implementations do, teaches the value function that the world ends at the frame cap, a fact the
    agent cannot see in its observation; Pardo et al. (2018) show the bias this causes. On Atari the
    cap is rarely reached, but the code is forked into tasks where time limits are everywhere.
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
    r"""The advantages of a minibatch, standardised: $\hat A_i \leftarrow (\hat A_i - \mu) / (\sigma + 10^{-8})$.

    $\mu$ is their mean over the minibatch and $\sigma$ their (unbiased) standard deviation. The size
    of the step then no longer depends on the scale of the rewards, and about half the actions are
    pushed up, half down. The $10^{-8}$ keeps a minibatch of equal advantages finite. Part 4 passes
    `mean` and `std` of the minibatches of all ranks together (a fork that standardises by other
    statistics computes them there too).
    """
    mean = advantages.mean() if mean is None else mean
    std = advantages.std() if std is None else std
    return (advantages - mean) / (std + 1e-8)


# ### The clipped objective
#
# A policy gradient step is only accurate near the policy that collected the data. PPO takes many
# minibatch steps on one batch, and keeps the new policy near the old one by taking away any gain
# from moving the probability ratio $r_t(\theta) = \pi_\theta(a_t|s_t) / \pi_{\theta_\text{old}}(a_t|s_t)$
# outside $[1 - \epsilon, 1 + \epsilon]$.


class LossTerms(NamedTuple):
    """What the loss returns: the total to minimise, then its terms and two diagnostics, each a
    scalar tensor. Every field but `loss` is logged as `losses/<name>`, so a term added here is
    logged with no other edit."""

    loss: torch.Tensor
    policy_loss: torch.Tensor
    value_loss: torch.Tensor
    entropy: torch.Tensor
    approx_kl: torch.Tensor
    clipfrac: torch.Tensor


def ppo_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
             values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, entropy: torch.Tensor,
             clip_range: float, config: Config) -> LossTerms:
    r"""PPO's loss on a minibatch (advantages already normalised), to be minimised.

    The policy term is the negated clipped surrogate of Schulman et al. (2017, eq. 7):

    $$L^\text{CLIP} = -\mathbb{E}_t\left[\min\left(r_t \hat A_t,\;
      \mathrm{clip}(r_t, 1 - \epsilon, 1 + \epsilon)\, \hat A_t\right)\right].$$

    The minimum makes it a pessimistic bound: when the ratio has already moved past the clip in
    the direction the advantage favours, the clipped term is the smaller, it is constant in
    $\theta$, and its gradient is zero. When the ratio moved the wrong way, the unclipped term is
    the smaller and the gradient pulls it back, however far it went.

    The value term clips the same way around the old prediction, as the reference implementation
    of the paper does (OpenAI baselines), and takes the larger error:

    $$L^V = \tfrac12 \mathbb{E}_t \max\left((V - R)^2,\;
      (V_\text{old} + \mathrm{clip}(V - V_\text{old}, -\epsilon, \epsilon) - R)^2\right).$$

    The entropy bonus $S$ keeps the policy from collapsing early. In all,
    $L = L^\text{CLIP} + c_V L^V - c_S S$, with $c_V$ and $c_S$ the `vf_coef` and `ent_coef` of
    `config`; $\epsilon$ is `clip_range`, this update's point on its schedule. With the $\tfrac12$
    inside $L^V$, $c_V = 0.5$ weighs the squared error by 0.25, where the paper's $c_1 = 1$ weighs it by 1.

    `approx_kl` estimates $\mathrm{KL}(\pi_\text{old} \,\|\, \pi_\theta)$ with
    $\mathbb{E}[(r - 1) - \log r]$, unbiased and never negative (Schulman, "Approximating KL
    divergence", 2020); `clipfrac` is the share of samples whose ratio is outside the clip. A
    variant of the loss (a KL penalty, say) reads its own settings from `config` and returns its
    own terms: nothing else needs to change.
    """
    log_ratio = log_probs - old_log_probs
    ratio = log_ratio.exp()
    # Clip the ratio so one update cannot move the policy far: $\mathrm{clip}(r_t, 1-\epsilon, 1+\epsilon)$.
    clipped_ratio = ratio.clamp(1.0 - clip_range, 1.0 + clip_range)
    policy_loss = torch.max(-advantages * ratio, -advantages * clipped_ratio).mean()

    clipped_values = old_values + (values - old_values).clamp(-clip_range, clip_range)
    value_loss = 0.5 * torch.max((values - returns) ** 2, (clipped_values - returns) ** 2).mean()

    entropy = entropy.mean()
    loss = policy_loss + config.vf_coef * value_loss - config.ent_coef * entropy
    with torch.no_grad():
        approx_kl = ((ratio - 1.0) - log_ratio).mean()
        clipfrac = ((ratio - 1.0).abs() > clip_range).float().mean()
    return LossTerms(loss, policy_loss, value_loss, entropy, approx_kl, clipfrac)


def linear_schedule(initial: float, update: int, num_updates: int) -> float:
    """`initial` annealed linearly: the full value at update 0, `initial / num_updates` at the last."""
    return initial * (1.0 - update / num_updates)


def explained_variance(predictions: torch.Tensor, targets: torch.Tensor) -> float:
    r"""$1 - \mathrm{Var}[y - \hat y] / \mathrm{Var}[y]$: 1 for a perfect value function, 0 for a constant one."""
    variance = targets.var()
    return float("nan") if variance == 0 else float(1.0 - (targets - predictions).var() / variance)


# ### The rollout and the update
#
# Each update has two phases. **Sampling**: every game plays `num_steps` steps with the current
# policy while we store observations, actions, their log-probabilities under the policy that chose
# them, the values, rewards and episode ends. **Updating**: GAE turns the rollout into advantages
# and returns, then `update_epochs` passes over the batch in shuffled minibatches minimise
# `ppo_loss`.
#
# **Where the rollout lives.** The games run on the CPU and the network wherever `device` says, and
# on a GPU every crossing between the two costs a wait. So the rollout is kept on the host while it
# is played, and each step crosses the boundary once each way: the frames go to the network, and
# the actions chosen come back together with their log-probabilities and values. Rewards and
# episode ends never leave the host during the rollout. The advantages are computed there too, a
# loop of `num_steps` small steps that costs microseconds on a CPU (and would be hundreds of kernel
# launches on a GPU), and then the whole batch moves to the device once, for the update. On a CPU
# every one of these moves is free: the tensors are already where they are needed.
#
# The trainer plays many games at once. What it needs of them is little: `num_envs`,
# `observation_shape`, `n_actions`, `reset()`, which returns the first observations, and
# `step(actions)`, which returns a `VecStep`. Part 2's `Workers` provide them at speed; the tests
# use small synthetic ones.


class VecStep(NamedTuple):
    """One step of all games at once. Where a game ended it was reset in the same step. The arrays
    may be overwritten by the next step (the workers' are views of shared memory)."""

    obs: np.ndarray
    """`[num_envs, *observation_shape]` uint8: the observation after the step (the first of a new game where one ended)."""
    rewards: np.ndarray
    """`[num_envs]` float32: clipped rewards."""
    terminated: np.ndarray
    """`[num_envs]` bool."""
    truncated: np.ndarray
    """`[num_envs]` bool."""
    final_obs: np.ndarray
    """`[num_envs, *observation_shape]` uint8: the last observation of each game that was truncated in this step."""
    finished_games: list[tuple[int, float, int]]
    """`(env index, score, length in frames)` of each whole game that ended in this step."""


class NonFiniteError(RuntimeError):
    """The loss, a gradient or the weights became NaN or infinite."""


class Rollout(NamedTuple):
    r"""One rollout as `update_policy` reads it: tensors on the host, indexed `[step, game]`.

    `log_probs` and `values` are those of the policy that chose the actions, which the update
    compares against; `next_values[t]` is $V(s_{t+1})$ as `compute_gae` defines it. Episode ends
    are 0 or 1, as floats, for the arithmetic of `compute_gae`.
    """

    obs: torch.Tensor             # [num_steps, num_envs, *observation_shape] uint8
    actions: torch.Tensor         # [num_steps, num_envs] int64
    log_probs: torch.Tensor
    values: torch.Tensor
    next_values: torch.Tensor
    rewards: torch.Tensor
    terminated: torch.Tensor
    truncated: torch.Tensor


class Batch(NamedTuple):
    """A rollout flattened into one batch of transitions, on the device, with its advantages and
    returns: what the update draws its minibatches from."""

    obs: torch.Tensor
    actions: torch.Tensor
    log_probs: torch.Tensor
    values: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor


# What `Trainer.update_policy` reports besides what it measured: the points of the schedules, and
# how many epochs ran. Everything else in its result is a measurement, logged under `losses/`.
NOT_MEASURED = ("learning_rate", "clip_range", "epochs", "stopped_early")


class Trainer:
    """PPO: the model, the optimizer, the rollout storage and the update.

    `envs` are the games it samples from (see above); `device` is where the model runs.
    """

    def __init__(self, config: Config, envs, device: torch.device):
        self.config = config
        self.envs = envs
        self.device = device
        self.num_updates = config.total_timesteps // self.steps_per_update
        self.model = self.build_model().to(device)
        # Adam with eps 1e-5 rather than its default 1e-8, as in the PPO reference implementation;
        # the fused kernel updates all parameters in one pass instead of a dozen small ops each.
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=config.learning_rate, eps=1e-5, fused=True)
        self.optimizer.found_inf = torch.zeros((), device=device)  # see `minibatch_step`
        self.update = 0
        self.global_step = 0
        # The rollout's storage, on the host: numpy arrays, which the games' arrays are copied into
        # without a call to torch, and which `torch.from_numpy` shows to torch without a copy.
        shape = (config.num_steps, envs.num_envs)
        self.storage = Rollout(self.frame_array(shape), self.host_array(shape, np.int64),
                               *(self.host_array(shape, np.float32) for _ in range(6)))
        self.rollout = Rollout(*(torch.from_numpy(array) for array in self.storage))  # torch's view of it
        self.next_obs = self.frame_array((envs.num_envs,))
        # Where each step's actions, log-probabilities and values land together, on the host: an
        # array, and torch's view of it.
        self.chosen = self.host_array((3, envs.num_envs), np.float32)
        self.chosen_tensor = torch.from_numpy(self.chosen)
        self.needs_reset = True
        self.finished_games: list[tuple[int, float, int]] = []

    @property
    def steps_per_update(self) -> int:
        """The agent steps that one update consumes: its batch."""
        return self.config.batch_size

    def build_model(self) -> nn.Module:
        """The network for these games (`make_model`)."""
        return make_model(self.envs.observation_shape, self.envs.n_actions)

    def host_array(self, shape: tuple[int, ...], dtype: type) -> np.ndarray:
        """Room on the host for part of the rollout."""
        return np.zeros(shape, dtype)

    def frame_array(self, leading: tuple[int, ...]) -> np.ndarray:
        """Room on the host for `leading` observations: `uint8` frames, as the games give them."""
        return self.host_array(leading + tuple(self.envs.observation_shape), np.uint8)

    def sample_actions(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        r"""$a \sim \pi_\theta(\cdot|s)$ for each observation, with $\log \pi_\theta(a|s)$ and $V(s)$.

        The draw is written out as the exponential race: the action with the largest
        $\pi_\theta(a|s) / E_a$, each $E_a \sim \mathrm{Exp}(1)$, is a sample of $\pi_\theta(\cdot|s)$.
        It is the draw `Categorical.sample()` makes (PyTorch's one-sample `multinomial`), number for
        number on the CPU, without the check of the probabilities that makes `multinomial` wait
        for the device. Everything here runs on the device, and nothing waits: Part 2 replays this
        method as one CUDA graph.
        """
        logits, values = self.model(obs)
        policy = Categorical(logits=logits, validate_args=False)
        actions = policy.probs.div(torch.empty_like(policy.probs).exponential_()).argmax(-1)
        # $\log \pi_\theta(a|s)$: the normalised logit of the action drawn (`policy.log_prob`, in fewer steps).
        log_probs = policy.logits.gather(-1, actions.unsqueeze(-1)).squeeze(-1)
        return actions, log_probs, values

    def values_of(self, frames: np.ndarray) -> np.ndarray:
        """$V(s)$ of a batch of observations on the host."""
        return self.model(torch.from_numpy(frames).to(self.device))[1].cpu().numpy()

    @torch.inference_mode()
    def collect_rollout(self) -> Rollout:
        """Play `num_steps` steps in every game with the current policy."""
        storage = self.storage
        if self.needs_reset:
            self.next_obs[:] = self.envs.reset()
            self.needs_reset = False
        self.finished_games = []
        truncations = []
        for t in range(self.config.num_steps):
            # Step $t$: store $s_t$, sample $a_t \sim \pi_\theta(\cdot|s_t)$, and keep
            # $\log \pi_\theta(a_t|s_t)$ and $V(s_t)$, the old policy's numbers that the update
            # compares against. The frames cross to the device, and the three come back in one copy
            # (stacked as floats: an action's index is exact in float32).
            storage.obs[t] = self.next_obs
            obs = torch.from_numpy(storage.obs[t]).to(self.device, non_blocking=True)
            self.chosen_tensor.copy_(torch.stack(self.sample_actions(obs)))
            storage.actions[t], storage.log_probs[t], storage.values[t] = self.chosen
            # The games play $a_t$. One that ended was reset by its worker, so the frames that come
            # back start the next game; a truncated game's last frames come apart, to be valued below.
            step = self.envs.step(storage.actions[t])
            storage.rewards[t], storage.terminated[t], storage.truncated[t] = (
                step.rewards, step.terminated, step.truncated)
            truncations += [(t, env, step.final_obs[env].copy()) for env in np.flatnonzero(step.truncated)]
            self.finished_games += step.finished_games
            self.next_obs[:] = step.obs
        # $V(s_{t+1})$ for every step: the next stored value, the value after the rollout for the
        # last step, and the value of the final observation where a game was truncated.
        storage.next_values[:-1] = storage.values[1:]
        storage.next_values[-1] = self.values_of(self.next_obs)
        if truncations:
            final_values = self.values_of(np.stack([obs for _, _, obs in truncations]))
            for (t, env, _), value in zip(truncations, final_values):
                storage.next_values[t, env] = value
        self.global_step += self.steps_per_update
        return self.rollout

    def normalize_advantages(self, advantages: torch.Tensor) -> torch.Tensor:
        """The minibatch's advantages, standardised by `normalize_advantages` (Part 4 widens the minibatch)."""
        return normalize_advantages(advantages)

    def compute_gradients(self, loss: torch.Tensor) -> None:
        """The gradient of `loss` in the `.grad` of every parameter of the model."""
        loss.backward()

    def beyond_target_kl(self, approx_kl: torch.Tensor) -> bool:
        """Whether the policy has moved further than `target_kl` from the one that sampled the batch
        (never, without a `target_kl`)."""
        return self.config.target_kl is not None and approx_kl.item() > self.config.target_kl

    def minibatch_step(self, batch: Batch, indices: torch.Tensor, clip_range: float) -> LossTerms:
        """One step of Adam on the transitions `indices` of `batch`; the terms of the loss, detached.

        A NaN or infinite gradient refuses its step and every later one of the update, without
        waiting for the device: fused Adam takes no step while its `found_inf` is 1 (the hook that
        `torch.amp.GradScaler` uses to skip steps), and the update reads the flag once, at its end.
        Nothing here waits for the device, so on CUDA Part 2 replays the whole step from a CUDA
        graph, as it replays `sample_actions`.
        """
        logits, values = self.model(batch.obs[indices])
        policy = Categorical(logits=logits, validate_args=False)
        terms = ppo_loss(policy.log_prob(batch.actions[indices]), batch.log_probs[indices],
                         self.normalize_advantages(batch.advantages[indices]), values, batch.values[indices],
                         batch.returns[indices], policy.entropy(), clip_range, self.config)
        self.optimizer.zero_grad(set_to_none=True)
        self.compute_gradients(terms.loss)
        grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
        self.optimizer.found_inf.logical_or_(~grad_norm.isfinite())
        self.optimizer.step()
        return type(terms)(*(term.detach() for term in terms))

    def update_policy(self, rollout: Rollout) -> dict[str, float]:
        """One PPO update on `rollout`, with the learning rate and clip range of `self.update`."""
        config = self.config
        learning_rate = linear_schedule(config.learning_rate, self.update, self.num_updates)
        clip_range = linear_schedule(config.clip_range, self.update, self.num_updates)
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate

        # The advantages, on the host where the rollout is; then the batch, flattened from
        # [steps, envs] into one batch of transitions, crosses to the device in one go.
        with torch.no_grad():
            advantages, returns = compute_gae(rollout.rewards, rollout.values, rollout.next_values,
                                              rollout.terminated, rollout.truncated, config.gamma, config.gae_lambda)
        explained = explained_variance(rollout.values.flatten(), returns.flatten())
        batch = Batch(*(x.flatten(0, 1).to(self.device, non_blocking=True)
                        for x in (rollout.obs, rollout.actions, rollout.log_probs, rollout.values, advantages, returns)))
        self.optimizer.found_inf.zero_()  # no non-finite gradient yet (see `minibatch_step`)

        # `update_epochs` passes over the batch, each in a new random order, one step of Adam per
        # minibatch. With `target_kl` set, the update ends after the first epoch whose last
        # minibatch found the policy further than that from the one that sampled the data (CleanRL's
        # rule: the epoch is finished, and the epochs after it are skipped).
        history = []
        stopped_early = False
        for epoch in range(config.update_epochs):
            order = torch.randperm(config.batch_size, device=self.device)
            for start in range(0, config.batch_size, config.minibatch_size):
                terms = self.minibatch_step(batch, order[start:start + config.minibatch_size], clip_range)
                history.append(torch.stack(list(terms)))
            if self.beyond_target_kl(terms.approx_kl):
                stopped_early = True
                break
        # The update's one wait for the device: the means of every term of the loss over the steps
        # taken, and whether the gradients and the weights stayed finite. A loss can stay finite
        # while a step sends a weight to infinity (a huge learning rate does it), hence the weights.
        means = torch.stack(history).mean(0)  # never empty: target_kl ends an update only after a whole epoch
        weights = nn.utils.get_total_norm(self.model.parameters())
        gradients_finite, weights_finite, *means = torch.cat(
            [(self.optimizer.found_inf == 0).view(1), weights.isfinite().view(1), means]).tolist()
        if not (gradients_finite and weights_finite):
            what = "the loss or its gradient" if not gradients_finite else "the weights"
            raise NonFiniteError(f"{what} became NaN or infinite in update {self.update + 1}; "
                                 f"{'no step was taken from then on' if not gradients_finite else 'the run stops'}")
        self.update += 1
        # What the update measured (whatever fields the loss's result has) and how much of the
        # returns' variance the values explained.
        return {**dict(zip(terms._fields, means)), "explained_variance": explained,
                "learning_rate": learning_rate, "clip_range": clip_range, "epochs": epoch + 1,
                "stopped_early": float(stopped_early)}

    # ### The loop of training
    #
    # Sample a rollout, update on it (the advantages are computed there), report, and again, until
    # the budget of steps is spent. What a real run does after each update (logs, progress,
    # checkpoints) is Part 3's `after_update`; a loop of a student's own can be as short as
    # `Trainer(config, envs, device).train(print)`. A real run also times the two calls of the loop
    # and runs on the machine's fastest settings, in Part 2's `FastSamplingTrainer` (which wraps
    # `collect_rollout`, `sample_actions` and `minibatch_step`, and overrides `build_model`,
    # `host_array` and `frame_array`; its network wraps `ActorCritic.features`) and Part 3's
    # `RunTrainer` (`collect_rollout` and `update_policy`), by name: a fork that renames them renames
    # them there too. `--eval` and `load_policy` draw with `sample_actions`.

    def train(self, after_update: typing.Callable[[dict[str, float]], None] = lambda stats: None) -> None:
        """Update until `total_timesteps` agent steps are played, handing each update's statistics to `after_update`."""
        while self.update < self.num_updates:
            stats = self.update_policy(self.collect_rollout())
            after_update(stats)


# ## Part 2: Sampling at speed
#
# ### The workers
#
# One emulator plays about 2,600 agent steps a second on one core (5,288 on 2 cores of an AMD EPYC,
# the README's throughput table), and the network wants a batch from many games at every step.
# `Workers` runs the games in other processes, several per process, and drives them over `Pipe`s as
# in labml's original design. Three choices make it fast and safe:
#
# * **Everything travels through shared memory.** Each worker writes its games' observations,
#   rewards and episode ends straight into arrays the main process reads; the pipe carries only a
#   one-word command and a one-word answer. A batch of 8 frame stacks is 225 kB; pickling it at every
#   step would cost more than the step itself.
# * **Same-step auto-reset.** When a game ends, the worker resets it at once and the observation
#   it writes is the first of the next game, so every step returns a usable observation for every
#   game. The last observation of a truncated game is written apart (`final_obs`), since its value
#   is needed to bootstrap.
# * **Failures are loud.** An exception in a worker is sent back with its traceback and raised in
#   the main process as a `WorkerError`; a worker that dies (killed by the kernel, say) closes its
#   pipe, which the main process notices at once instead of waiting forever. Workers ignore Ctrl-C,
#   which is the main process's to handle, and exit by themselves if the main process dies.


class WorkerError(RuntimeError):
    """A worker process failed: the message carries its traceback, or how it died."""


def game_seeds(seed: int, count: int, first_update: int = 0) -> np.ndarray:
    """`count` distinct, independent seeds for the games of a run seeded with `seed`.

    A run resumed at a later update draws new ones, so it does not replay the games the first part
    of the run began with.
    """
    entropy = seed if first_update == 0 else [seed, first_update]
    return np.random.SeedSequence(entropy).generate_state(count)


def shared_arrays(context, num_envs: int, observation_shape: tuple[int, ...]) -> dict[str, tuple]:
    """The blocks of shared memory behind `VecStep`, one row per game, as `(block, shape, dtype)`.

    The blocks are passed to each worker when it starts (this works under `fork` and `spawn`
    alike), and each side makes its own numpy views of them with `numpy_views`.
    """
    frames = (num_envs,) + tuple(observation_shape)
    layout = {"obs": (frames, np.uint8), "final_obs": (frames, np.uint8), "actions": ((num_envs,), np.int64),
              "rewards": ((num_envs,), np.float32), "terminated": ((num_envs,), np.bool_),
              "truncated": ((num_envs,), np.bool_), "game_over": ((num_envs,), np.bool_),
              "score": ((num_envs,), np.float64), "length": ((num_envs,), np.int64)}
    return {name: (context.RawArray(ctypes.c_uint8, math.prod(shape) * np.dtype(dtype).itemsize), shape, dtype)
            for name, (shape, dtype) in layout.items()}


def numpy_views(blocks: dict[str, tuple]) -> dict[str, np.ndarray]:
    return {name: np.frombuffer(block, dtype=dtype, count=math.prod(shape)).reshape(shape)
            for name, (block, shape, dtype) in blocks.items()}


# The signals that stop a run: Ctrl-C, `kill` (and SLURM's `scancel`), a terminal that hangs up. Sent to the
# whole process group, as a terminal and `kill -- -PGID` send them, they reach the workers too, which ignore them.
STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


def run_worker(connection: Connection, make_env, env_id: str, seeds: np.ndarray, first_env: int,
               blocks: dict[str, tuple], game_options: dict) -> None:
    """The loop of one worker process: it plays games `first_env, first_env + 1, ...`, made by `make_env`.

    It answers the main process's `reset` and `step` with `ok` once the arrays of its games are
    written, or with `error` and its traceback; on `close` it returns, closing its games.
    """
    for signum in STOP_SIGNALS:  # the main process's to answer, even when sent to the whole process group
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # `Workers` starts it with them blocked
    cv2.setNumThreads(1)
    parent = mp.parent_process()
    games: list[Game] = []
    try:
        rows = slice(first_env, first_env + len(seeds))
        arrays = {name: array[rows] for name, array in numpy_views(blocks).items()}
        for i, seed in enumerate(seeds):
            games.append(make_env(env_id, seed, game_options, obs=arrays["obs"][i]))
        connection.send_bytes(b"ok")
        while True:
            ready = wait_for_any([connection] + ([parent.sentinel] if parent is not None else []))
            if connection not in ready:
                return  # the main process is gone: leave no orphan behind
            command = connection.recv_bytes()
            if command == b"close":
                return
            for i, game in enumerate(games):
                if command == b"reset":
                    game.reset()
                    continue
                step = game.step(int(arrays["actions"][i]))
                arrays["rewards"][i] = step.reward
                arrays["terminated"][i] = step.terminated
                arrays["truncated"][i] = step.truncated
                arrays["game_over"][i] = step.game_over
                if step.game_over:
                    arrays["score"][i], arrays["length"][i] = step.score, step.length
                    if step.truncated:
                        arrays["final_obs"][i] = game.obs
                    game.reset()
            connection.send_bytes(b"ok")
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return
    except BaseException:
        try:
            connection.send_bytes(b"error " + traceback.format_exc().encode())
        except (OSError, ValueError):
            pass
    finally:
        for game in games:
            game.close()


# `vpg_continuous.py` holds a near copy of `Workers`, `run_worker` and `shared_arrays`. They differ
# where the environments do: here the games come from `make_env`, one of which tells the shape of
# the frames and the number of actions, the observations travel as `uint8` and an episode's result
# is the game's score; there each env is a `Task` whose spaces the caller gives, observations travel
# as `float64`, and the envs are seeded anew from the update a run resumes at.


class Workers:
    """`num_envs` games played by `num_workers` processes; the vector env of the trainer.

    `reset()` starts every game and returns the observations; `step(actions)` plays one step of
    every game and returns a `VecStep`. Use it as a context manager, or call `close()`.

    The games are made by `make_env` (Part 1's, unless another is given; under `spawn` it must be a
    function of a module the workers can import). One game made here first tells the shape of the
    observations, which sizes the shared memory, and the number of actions.
    """

    def __init__(self, env_id: str, num_envs: int, num_workers: int, seed: int, game_options: dict,
                 start_method: str | None = None, first_update: int = 0, first_game: int = 0, make_env=make_env):
        context = mp.get_context(start_method)
        self.num_envs = num_envs
        # Games `first_game, first_game + 1, ...` of the run: each rank of a distributed run plays its own.
        seeds = game_seeds(seed, first_game + num_envs, first_update)[first_game:]
        first = make_env(env_id, int(seeds[0]), game_options)
        self.observation_shape, self.n_actions = tuple(first.obs.shape), first.n_actions
        del first
        blocks = shared_arrays(context, num_envs, self.observation_shape)
        self.arrays = numpy_views(blocks)
        self.processes: list[mp.process.BaseProcess] = []
        self.connections: list[Connection] = []
        # Started with the stop signals blocked in this thread (the mask survives fork and exec): one sent while
        # they start reaches neither them, before they ignore it, nor this process until they have started. If
        # another thread of the process takes it meanwhile, it is heard at once, and those started are closed.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            for index, envs in enumerate(np.array_split(np.arange(num_envs), num_workers)):
                ours, theirs = context.Pipe()
                process = context.Process(target=run_worker, name=f"ppo_atari-worker-{index}", daemon=True,
                                          args=(theirs, make_env, env_id, seeds[envs], int(envs[0]), blocks,
                                                game_options))
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
        self.arrays["actions"][:] = actions
        self._send(b"step")
        self._receive()
        a = self.arrays
        finished = [(int(env), float(a["score"][env]), int(a["length"][env])) for env in np.flatnonzero(a["game_over"])]
        return VecStep(a["obs"], a["rewards"], a["terminated"], a["truncated"], a["final_obs"], finished)

    def _send(self, command: bytes) -> None:
        for index in range(len(self.connections)):
            try:
                self.connections[index].send_bytes(command)
            except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
                raise self._death(index) from None

    def _receive(self) -> None:
        """Wait for the `ok` of every worker."""
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


# ### The network's side
#
# With the games in other processes, what is left of a step here is the network's: the frames go to
# the device, the actions come back. `FastSamplingTrainer` is Part 1's `Trainer` with what makes
# that side fast on the machine at hand; it changes nothing that Part 1 computes beyond the rounding
# of floating point.
#
# * The network is `TunedActorCritic`: Part 1's layers and `features` in the `channels_last` layout
#   that the convolution libraries prefer, and its torso in bfloat16 where `use_bf16` finds it pays
#   (Part 3's `--precision` decides). On a CPU the rollout stores its frames in that layout too, so
#   that the update's minibatches need no transposing. On CUDA the frames stay as the games give
#   them, channels first, and the GPU changes their layout: on the host, the transposing copy took
#   most of the main process's own time in a step (201 microseconds for 8 games, against 30 without
#   it, on a 2-core EPYC, the network's call aside; `benchmarks/throughput.py --part host`).
# * While the games are sampled, torch computes on one thread. A batch of 8 observations gains
#   little from more, and the threads of a parallel section keep spinning for a while after it ends,
#   on the very cores the workers need to step their games: on an H200 the games took 0.44 s instead
#   of 0.23 s per 1,024 steps (`benchmarks/README.md`). The update keeps every thread.
# * On CUDA, the rollout's host arrays are pinned (page-locked), so that the GPU's copy engine reads
#   them by itself; cuDNN and cuBLAS may use TF32; and `sample_actions` is replayed from a CUDA
#   graph: one launch for its few dozen small kernels, whose launches cost more than their work
#   (0.12 ms a step for 8 games instead of 0.68 ms, on an H200). Each minibatch step of the update
#   is replayed from another graph, for the same reason (an update of 8 games took 30 ms instead of
#   about 96 ms on an H200). With both graphs, training on an H200 ran at 0.78 of the workers' speed
#   alone at 8 games and 0.89 at 32 (0.62 and 0.82 with the update's steps launched one by one; the
#   README's run of 950627f).
#   A graph replays the kernels it recorded, with the numbers they read then: a fork whose
#   `sample_actions` or `minibatch_step` reads a Python number that changes from update to update
#   (an entropy coefficient scheduled from `self.update`, say) passes it as a tensor, as `fixed_step`
#   does the clip range and the learning rate, or sets `cuda_graph` or `cuda_graph_update` to False.
#
# Double-buffered sampling, half of the games stepping while the network chooses for the other
# half, was tried and measured slower on both kinds of machine: 1,047 steps/s against 1,307 in turns
# on an H200, and 2 to 3% on 2 CPU cores (`benchmarks/README.md` has the runs).


def cpu_has_fast_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU trains faster in bfloat16, read from /proc/cpuinfo: where it has Intel's AMX
    (`amx_bf16`), or AVX-512 BF16 (`avx512_bf16`) on an AMD CPU (Zen 4 and later). An Intel CPU
    with AVX-512 BF16 but no AMX trained slower in bfloat16 (`use_bf16`), so it keeps float32."""
    with contextlib.suppress(OSError):
        cpuinfo = Path("/proc/cpuinfo").read_text() if cpuinfo is None else cpuinfo
    words = set((cpuinfo or "").split())
    return "amx_bf16" in words or {"avx512_bf16", "AuthenticAMD"} <= words


def use_bf16(precision: str, device: torch.device) -> bool:
    r"""Whether the torso runs in bfloat16.

    The update dominates training on a CPU, and bfloat16 shortens it where the CPU's bfloat16
    products are fast: the whole training step ran 1.6 times faster with AMX (an Intel Xeon) and
    1.8 times with AVX-512 BF16 on an AMD EPYC, `python benchmarks/throughput.py --part train
    --precision both` (the runs are in the README). Having the instructions is not enough: on an
    Intel Xeon with AVX-512 BF16 and no AMX, oneDNN ran its bfloat16 kernels and training was
    slower, 0.92 times float32's speed at 8 games and 0.81 at 32. There, and on a CPU with neither,
    `auto` keeps float32; on CUDA, `auto` keeps float32 and lets cuDNN and cuBLAS use TF32.
    The heads stay in float32, and the log-probabilities a rollout stores are those its update first
    computes (to 1e-6, a test checks), so the ratio PPO clips is not disturbed. On Breakout, at 2M
    steps (the mean of the last 100 games), seeds 1 to 3 scored 40.4, 52.6 and 60.9 with the
    bfloat16 torso, 55.8, 50.3 and 58.0 in float32 (`benchmarks/results/breakout.csv`,
    `breakout-fp32.csv`): means of 51.3 and 54.7, a difference far smaller than the spread of the
    seeds. `--precision fp32` trains in float32 on any CPU.
    """
    return device.type == "cpu" and cpu_has_fast_bf16() if precision == "auto" else precision == "bf16"


class TunedActorCritic(ActorCritic):
    """Part 1's network, made of the same layers, run the way this machine runs it fastest.

    Its parameters and the frames it reads are in `channels_last` layout, which the convolution
    libraries of both CPUs (oneDNN) and GPUs (cuDNN) prefer. With `bf16` the torso runs in bfloat16
    autocast while the heads stay in float32, so the log-probabilities that PPO compares are
    computed in full precision.
    """

    def __init__(self, model: ActorCritic, bf16: bool):
        super().__init__(model.torso, model.policy, model.value)
        self.bf16, self.frames_dtype = bf16, torch.bfloat16 if bf16 else torch.float32
        self.to(memory_format=torch.channels_last)

    def features(self, obs: torch.Tensor) -> torch.Tensor:
        # Part 1's, with the layout changed on the bytes, the fewest to move, and a bfloat16 torso
        # under autocast; the heads read float32.
        x = obs.contiguous(memory_format=torch.channels_last)
        if not self.bf16:
            return super().features(x)
        with torch.autocast(device_type=x.device.type, dtype=torch.bfloat16):
            return super().features(x).float()


def on_side_stream(call: typing.Callable[[], typing.Any]) -> typing.Any:
    """`call()` run on a CUDA stream of its own, as the calls before a CUDA graph's capture must be."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        result = call()
    torch.cuda.current_stream().wait_stream(side)
    return result


class FastSamplingTrainer(Trainer):
    """Part 1's `Trainer` with `TunedActorCritic` (its torso in bfloat16 if `bf16`), sampling on one
    thread, on a CPU its frames stored in the network's layout (and a bfloat16 torso's weights cast
    once a rollout), and on CUDA from pinned memory and a CUDA graph (`cuda_graph`), with each
    minibatch step of the update replayed from another (`cuda_graph_update`)."""

    cuda_graph = True
    cuda_graph_update = True

    def __init__(self, config: Config, envs, device: torch.device, bf16: bool = False):
        self.graph, self.bf16, self.bf16_torso = None, bf16, None
        self.update_graph, self.update_outputs, self.fixed, self.eager_steps = None, None, None, 0
        if device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
            torch.backends.cudnn.benchmark = True
        super().__init__(config, envs, device)

    def build_model(self) -> nn.Module:
        return TunedActorCritic(super().build_model(), self.bf16)

    def frame_array(self, leading: tuple[int, ...]) -> np.ndarray:
        # On a CPU, frames stored channels-last, the network's layout, seen channels first: each step's
        # copy into the store transposes them, so that a minibatch gathered from it needs no
        # transposition. On CUDA, Part 1's: the GPU transposes, in the graph and in each minibatch.
        if self.device.type == "cuda":
            return super().frame_array(leading)
        channels, *pixels = self.envs.observation_shape
        return np.moveaxis(self.host_array(leading + tuple(pixels) + (channels,), np.uint8), -1, len(leading))

    def host_array(self, shape: tuple[int, ...], dtype: type) -> np.ndarray:
        if self.device.type != "cuda":
            return super().host_array(shape, dtype)
        pinned = torch.zeros(math.prod(shape) * np.dtype(dtype).itemsize, dtype=torch.uint8, pin_memory=True)
        return pinned.numpy().view(dtype).reshape(shape)

    def sample_actions(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Part 1's `sample_actions`; on CUDA (with `cuda_graph`) replayed from a CUDA graph.

        The graph records Part 1's method once and replays it with one launch: the observations are
        copied into its input, and its outputs, valid until the next replay, are returned. It reads
        the model's parameters where they are, so it follows every update; its random draws advance
        the CUDA generator as the eager ones do.
        """
        if not (self.cuda_graph and self.device.type == "cuda"):
            return super().sample_actions(obs)
        if self.graph is None:
            static_obs, sample = obs.clone(), super().sample_actions
            on_side_stream(lambda: [sample(static_obs) for _ in range(3)])  # cuDNN picks its algorithms first
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.graph = (graph, static_obs, super().sample_actions(static_obs))
        graph, static_obs, outputs = self.graph
        static_obs.copy_(obs)
        graph.replay()
        return outputs

    def minibatch_step(self, batch: Batch, indices: torch.Tensor, clip_range: float) -> LossTerms:
        """Part 1's `minibatch_step`; on CUDA (with `cuda_graph_update`) replayed from a CUDA graph.

        A step launches a few hundred small kernels one by one (forward, loss, backward, clip,
        Adam): on an NVIDIA H200 an update of 8 games' 1,024 steps, 16 minibatch steps, took 96 ms
        launched so, and 30 ms with each step replayed from a graph (89 and 78 ms at 32 games;
        `benchmarks/graph_update.py`, the README's run). Part 1's step waits for nothing, so all of
        it is captured. A graph reads and writes fixed memory, so the step runs on fixed tensors
        (`fixed_step`). The first three steps run as they are, on a side stream, so that cuDNN picks
        its algorithms and Adam makes its state before the capture. The outputs of a replay are
        valid until the next one, which Part 1's update allows: it stacks them at once.
        """
        if not (self.cuda_graph_update and self.device.type == "cuda"):
            return super().minibatch_step(batch, indices, clip_range)
        step = self.fixed_step(batch, indices, clip_range)
        if self.update_graph is None and self.eager_steps < 3:
            self.eager_steps += 1
            take_step = super().minibatch_step
            terms = on_side_stream(lambda: take_step(*step))
            return type(terms)(*(term.clone() for term in terms))
        if self.update_graph is None:
            self.update_graph = torch.cuda.CUDAGraph()
            self.optimizer.zero_grad(set_to_none=True)  # the gradients are made in the graph's memory
            with torch.cuda.graph(self.update_graph):
                self.update_outputs = super().minibatch_step(*step)
        self.update_graph.replay()  # a capture records the step without running it: the first replay runs it
        return self.update_outputs

    def fixed_step(self, batch: Batch, indices: torch.Tensor, clip_range: float) -> tuple:
        """The step's arguments in the graph's fixed tensors: the batch, the clip range and the learning
        rate copied in once an update (Part 1 sets the rate, a number, before its first step; Adam
        reads it as a tensor, and is made capturable), the minibatch's indices at every step."""
        if self.fixed is None:
            scalar = torch.zeros((), device=self.device)
            self.fixed = dict(batch=Batch(*(torch.empty_like(x) for x in batch)), indices=torch.empty_like(indices),
                              clip_range=scalar.clone(), learning_rate=scalar.clone(), update=None)
        fixed = self.fixed
        if fixed["update"] != self.update:  # the first step of an update
            for target, source in zip(fixed["batch"], batch):
                target.copy_(source)
            fixed["clip_range"].fill_(clip_range)
            for group in self.optimizer.param_groups:
                fixed["learning_rate"].fill_(group["lr"])
                group.update(lr=fixed["learning_rate"], capturable=True)
            fixed["update"] = self.update
        fixed["indices"].copy_(indices)
        return fixed["batch"], fixed["indices"], fixed["clip_range"]

    def collect_rollout(self) -> Rollout:
        threads, torso = torch.get_num_threads(), self.model.torso
        torch.set_num_threads(1)
        try:
            if self.bf16 and self.device.type == "cpu":
                self.model.torso = self.cast_torso(torso)
            return super().collect_rollout()
        finally:
            self.model.torso = torso
            torch.set_num_threads(threads)

    def cast_torso(self, torso: nn.Module) -> nn.Module:
        """A copy of `torso` with its weights in bfloat16, what a rollout on a CPU samples with.

        Autocast casts the float32 weights again at every step: 8 of a step's 37 ATen calls. Cast
        once a rollout, choosing actions for 8 games took 0.178 s per 1,024 steps instead of 0.222,
        and training ran at 1,012 steps/s instead of 971, on 2 cores of an AMD EPYC
        (`benchmarks/throughput.py --precision bf16 --baseline COPY`; `benchmarks/README.md` has the
        runs). The weights are the same numbers, and autocast leaves them as they are: the rollout
        computes what it did, bit for bit.
        """
        if self.bf16_torso is None:
            self.bf16_torso = copy.deepcopy(torso).to(torch.bfloat16)
        with torch.no_grad():
            for ours, theirs in zip(self.bf16_torso.parameters(), torso.parameters()):
                ours.copy_(theirs)
        return self.bf16_torso


# ## Part 3: Running it for real
#
# What turns the algorithm into a program a researcher runs for days: the command line and its
# checks, the choices that make it fast on the machine at hand, checkpoints, logs and a progress
# line, clean stops on Ctrl-C, evaluation with videos, and `main`. Nothing here changes what Part 1
# computes: each piece wraps it or feeds it.


# ### The command line
#
# The command line sets the fields of Part 1's `Config` and those of one invocation: how many
# processes play the games and how they start, where the network runs and in what precision, where
# the run's files go, how often it writes a checkpoint, which checkpoint to resume or evaluate, and
# where the run is tracked. `RunConfig` adds the second kind to the first; every flag is one of its
# fields, with its documentation as the help text. A resumed run takes its hyperparameters from the
# checkpoint, but the settings of its invocation from the command line (or their defaults). A
# mistake in what the user asked for is one line on stderr and exit status 2, before any process
# starts.


@dataclass
class RunConfig(Config):
    """The settings of one invocation, added to those of the agent and its training (`Config`)."""

    num_workers: int = 0
    """Processes that play the games (0: one per CPU core, at most one per game)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the network runs (`auto`: CUDA when there is one)."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """Arithmetic of the torso (`auto`: bfloat16 with AMX or AMD's AVX-512 BF16, else float32; TF32 on CUDA)."""
    start_method: Literal["default", "fork", "spawn", "forkserver"] = "default"
    """How worker processes are started (`default`: the platform's own)."""
    run_dir: str | None = None
    """Where TensorBoard events and checkpoints go (default: runs/<env>__<seed>__<time>)."""
    checkpoint_every: int = 100
    """Write checkpoint.pt every this many updates (and always at the end and on Ctrl-C)."""
    resume: str | None = None
    """Continue training from this checkpoint; flags given override its settings (a larger --total-timesteps extends it)."""
    eval: str | None = None
    """Play `eval_episodes` whole games with the policy in this checkpoint and print the score."""
    eval_episodes: int = 10
    """Games to play with `--eval`."""
    capture_video: bool = False
    """Write H.264 mp4s to <run dir>/videos: in training, games 0, 1, 8, 27, ... of the first slot; in --eval, all."""
    track: bool = False
    """Send the run to Weights & Biases, as CleanRL does: its scalars and videos (needs `pip install wandb`)."""
    wandb_project_name: str = "policy-gradients"
    """The Weights & Biases project that `--track` sends the run to."""
    wandb_entity: str | None = None
    """The Weights & Biases team or user that `--track` sends the run to (default: your own)."""


class ConfigError(Exception):
    """A mistake in what the user asked for: reported in one line, exit status 2."""


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
    parser = OneLineParser(prog="ppo_atari.py", argument_default=argparse.SUPPRESS,
                           description="PPO on Atari, annotated. See the module docstring.")
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
    (("total_timesteps", "num_envs", "num_steps", "num_minibatches", "update_epochs", "frame_skip",
      "max_episode_frames", "checkpoint_every", "eval_episodes", "learning_rate", "clip_range", "max_grad_norm",
      "target_kl"), lambda value: value is None or value > 0, "positive"),
    (("ent_coef", "vf_coef", "noop_max", "num_workers"), lambda value: value >= 0, "not negative"),
    (("gamma", "gae_lambda", "sticky_actions"), lambda value: 0 <= value <= 1, "in [0, 1]"),
    (("seed",), lambda value: 0 <= value <= 2**32 - 1, "in [0, 2**32 - 1]"),
    (("max_episode_frames",), lambda value: value <= 2**31 - 1, "at most 2**31 - 1 (the emulator's int)"),
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
        (config.eval is None and config.total_timesteps < config.batch_size, f"--total-timesteps "
         f"{config.total_timesteps} is less than one batch ({config.batch_size} = num envs x num steps)"),
        (config.num_workers > config.num_envs, f"--num-workers {config.num_workers} is more than --num-envs "
         f"{config.num_envs}"),
        (config.max_episode_frames <= config.noop_max + 2 * config.frame_skip, f"--max-episode-frames "
         f"{config.max_episode_frames} leaves no room to play after {config.noop_max} no-ops and two steps of "
         f"--frame-skip {config.frame_skip}"),
        (config.eval is not None and config.resume is not None, "--eval and --resume cannot be used together"),
    ]
    for problem, words in problems:
        if problem:
            raise ConfigError(words)


def resolve_env_id(name: str) -> str:
    """The gymnasium id of an Atari game named `name`, or a `ConfigError` suggesting close names."""
    gym.register_envs(ale_py)
    atari_ids = sorted(env_id for env_id, spec in gym.registry.items() if spec.entry_point == "ale_py.env:AtariEnv")
    short_names = {env_id[4:-3].lower(): env_id for env_id in atari_ids
                   if env_id.startswith("ALE/") and env_id.endswith("-v5") and "-ram" not in env_id}
    if name in atari_ids or name.lower() in short_names:
        return name if name in atari_ids else short_names[name.lower()]
    close = difflib.get_close_matches(name, [env_id[4:-3] for env_id in short_names.values()] + atari_ids, n=3,
                                      cutoff=0.6)
    hint = f"; did you mean {', '.join(close)}?" if close else "; names look like Breakout or ALE/Breakout-v5"
    raise ConfigError(f"unknown Atari game {name!r}{hint}")


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


# ### The device, and the timing of a run
#
# Where the network runs, chosen once per process (Part 2's `FastSamplingTrainer` makes the
# choices of precision and memory layout), and the clock that splits each update's time for the log.


def choose_device(requested: str, local_rank: int = 0) -> torch.device:
    """The device of this process: CUDA when asked for or available (one GPU per rank), else the CPU."""
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for, but torch finds no CUDA device")
    if requested == "cpu" or not torch.cuda.is_available():
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


class RunTrainer(FastSamplingTrainer):
    """The trainer of a run on one process: Part 2's `FastSamplingTrainer`, its torso in the precision
    `config.precision` asks for, and its two phases timed for the log (`seconds`). Part 4's
    `DataParallelRunTrainer` is this class on several ranks."""

    def __init__(self, config: RunConfig, envs, device: torch.device):
        self.seconds = {"sampling": 0.0, "update": 0.0}
        super().__init__(config, envs, device, bf16=use_bf16(config.precision, device))

    def collect_rollout(self) -> Rollout:
        with timer(self.seconds, "sampling"):
            return super().collect_rollout()

    def update_policy(self, rollout: Rollout) -> dict[str, float]:
        with timer(self.seconds, "update"):
            return super().update_policy(rollout)


# ### Checkpoints
#
# A checkpoint holds all the state of training: the model, Adam's moments, the counters, the random
# state of every rank and the configuration. The games themselves restart on resume, new games from
# new seeds (`game_seeds`); their emulator state is not saved. It is written to a temporary file of
# this process's own, then renamed over the last one, so a crash never leaves half a file; a write
# that fails (on a full disk, say) is one line naming the checkpoint that is still whole. It is read
# with `weights_only=True`: tensors and plain data.


CHECKPOINT_FORMAT = "ppo_atari/1"
CHECKPOINT_FIELDS = {"config": dict, "update": int, "global_step": int, "ranks": int, "model": dict, "optimizer": dict,
                     "torch_rng": list, "cuda_rng": list, "game": str}  # each field, and the kind of its value


def game_name(env_id: str) -> str:
    """The ROM behind an id: `ALE/Breakout-v5` and `BreakoutNoFrameskip-v4` are both `breakout`."""
    return gym.spec(env_id).kwargs["game"]


def checkpoint_state(trainer: Trainer, env_id: str, ranks: Ranks) -> dict:
    """The state to save, marked with the game it plays, so that another game's run refuses it.
    With several ranks, every rank must call it: it gathers their random states."""
    cuda = trainer.device.type == "cuda"
    return {"format": CHECKPOINT_FORMAT, "config": dataclasses.asdict(trainer.config),
            "n_actions": trainer.envs.n_actions, "update": trainer.update, "global_step": trainer.global_step,
            "ranks": ranks.size, "model": trainer.model.state_dict(), "optimizer": trainer.optimizer.state_dict(),
            "torch_rng": ranks.gather(torch.get_rng_state()), "game": game_name(env_id),
            "cuda_rng": ranks.gather(torch.cuda.get_rng_state(trainer.device) if cuda else torch.zeros(0, dtype=torch.uint8))}


def restore_checkpoint(trainer: Trainer, checkpoint: dict, path: str, ranks: Ranks) -> None:
    """Continue from `checkpoint`: the weights, Adam's moments, the counters and this rank's random state."""
    restore_model(trainer.model, checkpoint, path)
    trainer.optimizer.load_state_dict(checkpoint["optimizer"])
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
                          "ppo_atari.py") from None
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != CHECKPOINT_FORMAT:
        raise ConfigError(f"{path} is not a ppo_atari.py checkpoint")
    missing = [field for field in CHECKPOINT_FIELDS if field not in checkpoint]
    if missing:
        raise ConfigError(f"checkpoint {path} lacks {', '.join(missing)}: another version of ppo_atari.py wrote it")
    wrong = [field for field, kind in CHECKPOINT_FIELDS.items() if not isinstance(checkpoint[field], kind)]
    if wrong:
        raise ConfigError(f"checkpoint {path} holds {', '.join(wrong)} of another kind: it was edited, or another "
                          f"program wrote it")
    return checkpoint


def restore_model(model: nn.Module, checkpoint: dict, path: str) -> None:
    """Load the checkpoint's weights into `model`. A checkpoint of another network (one for a game
    with another number of actions, say) is a `ConfigError`, one line rather than a traceback."""
    try:
        model.load_state_dict(checkpoint["model"])
    except RuntimeError as error:
        lines = str(error).strip().splitlines()  # torch's heading, then a line (a tab first) per difference
        raise ConfigError(f"checkpoint {path} holds a different network: {(lines[1:2] or lines)[0].strip()}") from None
    if not all(torch.isfinite(parameter).all() for parameter in model.parameters()):
        raise ConfigError(f"checkpoint {path} holds non-finite weights: it was written after its run diverged")


# ### Logging and progress


class Progress:
    """One line on the terminal: steps done, speed, time left, recent scores.

    The same text as `vpg_continuous.py`'s but for the words: the scores of games here, the returns
    of episodes there. On a terminal it is redrawn in place after every update; into a file, a new
    line at most every 10 seconds, and the final one (once), so that the log of a long run stays short.
    """

    def __init__(self, total: int, start_step: int):
        self.total, self.start_step = total, start_step
        self.started = self.last_print = time.perf_counter()
        self.scores: deque[float] = deque(maxlen=20)
        self.interactive, self.printed = sys.stderr.isatty(), None

    def steps_per_second(self, step: int) -> float:
        return (step - self.start_step) / max(time.perf_counter() - self.started, 1e-9)

    def show(self, step: int, final: bool = False) -> None:
        now = time.perf_counter()
        if not self.interactive and (step == self.printed or not (final or now - self.last_print >= 10.0)):
            return  # into a file, a step's line is written once: the final one may be written already
        self.last_print, self.printed, sps = now, step, self.steps_per_second(step)
        left = format_duration((self.total - step) / sps if sps > 0 else math.inf)
        recent = f"{np.mean(self.scores):.1f} (last {how_many(len(self.scores), 'game')})" if self.scores else "-"
        line = f"step {step:,}/{self.total:,} ({100 * step / self.total:.1f}%) | {sps:,.0f} SPS | {left} left | score {recent}"
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


def hyperparameter_table(config: Config, env_id: str) -> str:
    """The run's settings as a Markdown table, the first text event of the run (as CleanRL writes it)."""
    rows = [f"|{key}|{value}|" for key, value in dataclasses.asdict(config).items()]
    return "|parameter|value|\n|-|-|\n" + "\n".join([f"|env_id|{env_id}|"] + rows)


def default_run_dir(config: Config, env_id: str) -> Path:
    return Path("runs") / f"{gym.spec(env_id).name}__{config.seed}__{time.strftime('%Y%m%d-%H%M%S')}"


def log_update(writer, step: int, stats: dict[str, float], finished_games: list, progress: Progress,
               seconds: dict[str, float]) -> None:
    """Write one update to TensorBoard under CleanRL's tag names, so that curves compare across projects.

    The real scores of the games that ended (`finished_games`, those of every rank), the schedules,
    and every measurement of the update under `losses/<name>` but the total loss: each term of the
    loss's result (`LossTerms`), so a new term needs no edit here, and `explained_variance`. Then
    the speed, and under `perf/<phase>_seconds` the seconds this update spent stepping games
    (`env`), choosing actions and storing the rollout (`inference`) and learning (`update`).
    """
    for _, score, length in finished_games:
        writer.add_scalar("charts/episodic_return", score, step)
        writer.add_scalar("charts/episodic_length", length, step)
        progress.scores.append(score)
    scalars = {"charts/learning_rate": stats["learning_rate"], "charts/clip_range": stats["clip_range"],
               **{f"losses/{name}": value for name, value in stats.items() if name not in ("loss", *NOT_MEASURED)},
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
# two steps of the games (the unfinished rollout is dropped) or after an update: the checkpoint is
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
    """Part 2's `Workers` as a run steps them: the seconds spent waiting for the games are added to
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
# fails while the games are stepped leaves the weights whole, so one process saves them before it
# reports; an update that diverged (`NonFiniteError`) writes nothing, and the last good checkpoint stays.
# So does a step that ran out of GPU memory, reported in one line of torch's words, which give the sizes.


def game_options(config: Config) -> dict:
    """The settings of `config` that shape a game, as `make_env` takes them."""
    return dict(sticky_actions=config.sticky_actions, life_loss=config.life_loss, noop_max=config.noop_max,
                frame_skip=config.frame_skip, max_episode_frames=config.max_episode_frames)


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


def train(config: RunConfig, env_id: str, checkpoint: dict | None = None) -> int:
    """Train, log and checkpoint; the exit status of the run."""
    from torch.utils.tensorboard import SummaryWriter

    ranks = Ranks.from_environment()
    if checkpoint is not None and checkpoint["ranks"] != ranks.size:
        raise ConfigError(f"checkpoint {config.resume} was written by a run of {how_many(checkpoint['ranks'], 'rank')}; "
                          f"resume it with as many, not {ranks.size}")
    if checkpoint is not None and checkpoint["update"] >= config.total_timesteps // (config.batch_size * ranks.size):
        raise ConfigError(f"checkpoint {config.resume} has trained {checkpoint['global_step']:,} steps, all that "
                          f"--total-timesteps {config.total_timesteps:,} allows; to train on, resume with a larger one")
    check_rollout_fits(config, math.prod(Game.observation_shape), ranks)
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
            # writer does), so that forking them is safe.
            envs = opened.enter_context(RunWorkers(
                env_id, config.num_envs, num_workers, config.seed, game_options(config),
                None if config.start_method == "default" else config.start_method,
                first_update=first_update, first_game=ranks.rank * config.num_envs,
                signals=signals if ranks.size == 1 else None, make_env=game_maker(config, env_id, run_dir, first_update)))
            device = choose_device(config.device, ranks.local_rank)
            ranks.start(device)
            # The trainer that runs: `RunTrainer` in one process, Part 4's `DataParallelRunTrainer` on each rank.
            trainer = RunTrainer(config, envs, device) if ranks.size == 1 else DataParallelRunTrainer(config, envs, device, ranks)
            if checkpoint is not None:
                restore_checkpoint(trainer, checkpoint, config.resume, ranks)
            progress = Progress(trainer.num_updates * trainer.steps_per_update, trainer.global_step)
            progress.scores.extend(checkpoint.get("recent_scores", []) if checkpoint else [])
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
                        writer.add_text("hyperparameters", hyperparameter_table(config, env_id))
                print(f"{env_id}: training on {device} ({'bfloat16' if trainer.model.bf16 else 'float32'} torso), "
                      f"{how_many(config.num_envs, 'game')} in {how_many(num_workers, 'worker')}"
                      f"{f' on each of {ranks.size} ranks' * (ranks.size > 1)}; "
                      f"logs and checkpoints in {run_dir}" + (f"\nresumed at step {trainer.global_step:,} (update "
                      f"{trainer.update}) from {config.resume}" if checkpoint else ""), file=sys.stderr)
            opened.callback(setattr, signals, "closing", True)  # the first thing done on the way out: from then on, closing is not interrupted

            def write_checkpoint() -> None:
                state = checkpoint_state(trainer, env_id, ranks)  # every rank takes part: it gathers their random states
                if ranks.is_main:  # with the progress line's recent scores, so that a resumed line goes on from them
                    with signals.held():
                        save_checkpoint({**state, "recent_scores": list(progress.scores)}, checkpoint_path)

            before, sent_videos = {**envs.seconds, **trainer.seconds}, set()

            def after_update(stats: dict[str, float]) -> None:
                """Log the update, stop if asked, and write a checkpoint every `checkpoint_every` updates."""
                finished_games = [game for games in ranks.gather(trainer.finished_games) for game in games]
                spent = {phase: seconds - before[phase] for phase, seconds in {**envs.seconds, **trainer.seconds}.items()}
                before.update({**envs.seconds, **trainer.seconds})
                if ranks.is_main:  # the rollout's time outside the workers' steps is inference, with the copies around it
                    with signals.held():
                        log_update(writer, trainer.global_step, stats, finished_games, progress, {
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
# `load_policy` hands a checkpoint's agent to a program of your own: a notebook that watches it
# play, a study of what its network attends to, a fork's evaluation. It carries the preprocessing
# the agent learned with, so what it acts on is what it was trained on. `--eval` plays whole games
# with it, several at once in this process, sampling its actions as in training, and reports the
# real score of each game (all lives, unclipped).


class Policy:
    """A trained agent, ready to act: a checkpoint's network and the game protocol it learned with.

    `act` takes the observation `Game` gives (a stack of 4 grey 84 x 84 `uint8` frames), or a batch
    of them, and returns an action, or an array of actions; `make_env` makes a game that plays by
    the checkpoint's protocol (no-ops, FIRE, frame skip, life loss, ...), which produces exactly
    those observations from the raw emulator. Actions are sampled from the policy, as in training
    and `--eval`; `deterministic=True` takes the likeliest one instead.
    """

    def __init__(self, model: ActorCritic, config: Config, env_id: str, observation_shape: tuple[int, ...],
                 device: torch.device):
        self.model, self.config, self.env_id, self.device = model, config, env_id, device
        self.observation_shape = observation_shape

    def make_env(self, seed: int = 0) -> Game:
        """A game of the checkpoint's Atari game, preprocessed as in training; `reset()` it first."""
        return make_env(self.env_id, seed, game_options(self.config))

    sample_actions = Trainer.sample_actions  # Part 1's draw, which reads only `self.model`: an edit of it reaches here

    @torch.inference_mode()
    def act(self, observation: np.ndarray, deterministic: bool = False) -> int | np.ndarray:
        """The action for one observation (an `int`), or for a batch of them (an array)."""
        frames = torch.as_tensor(np.asarray(observation), device=self.device)
        one = frames.shape == self.observation_shape
        frames = frames.unsqueeze(0) if one else frames
        actions = self.model(frames)[0].argmax(-1) if deterministic else self.sample_actions(frames)[0]
        actions = actions.cpu().numpy()
        return int(actions[0]) if one else actions


def load_policy(path: str | Path, device: str | torch.device = "cpu", precision: str = "fp32",
                checkpoint: dict | None = None) -> Policy:
    """The policy in a `checkpoint.pt` of this script, on `device`, ready to act (see `Policy`); its
    torso in `precision` (as `--precision` says). `checkpoint` is the file's content, if it was read already.

    A path that is not such a checkpoint, or holds a diverged network, is a `ConfigError`.
    """
    checkpoint = checkpoint or load_checkpoint(str(path))
    config = Config(**{field.name: checkpoint["config"][field.name] for field in dataclasses.fields(Config)})
    env_id, device = resolve_env_id(config.env), torch.device(device)
    probe = make_env(env_id, 0, game_options(config))
    model = TunedActorCritic(make_model(probe.obs.shape, probe.n_actions), use_bf16(precision, device))
    restore_model(model, checkpoint, str(path))
    return Policy(model.to(device).eval(), config, env_id, tuple(probe.obs.shape), device)


def evaluate(config: RunConfig, env_id: str, checkpoint: dict) -> list[float]:
    """Play `eval_episodes` games with the checkpoint's policy; their scores."""
    policy = load_policy(config.eval, choose_device(config.device), config.precision, checkpoint)
    # Games seeded unlike the training ones; the policy's draws seeded by the run's seed.
    games = [make_env(env_id, seed, game_options(config)) for seed in game_seeds(config.seed + 1_000_003,
                                                                                 config.eval_episodes)]
    torch.manual_seed(config.seed)
    video_dir = Path(config.run_dir or Path(config.eval).parent) / "videos"
    if config.capture_video:  # each records its one game, in real time: 60 frames a second over the frame skip
        writable_dir(video_dir)
        games = [RecordedGame(game, video_dir, f"eval-{gym.spec(env_id).name}-game{index:02d}.mp4",
                              60 / config.frame_skip) for index, game in enumerate(games)]
    scores: list[float | None] = [None] * len(games)  # each game's, once it is over
    with written(video_dir, config.eval):  # a video that cannot be written (on a full disk, say) is one line
        try:
            for game in games:
                game.reset()
            while None in scores:
                playing = [index for index, score in enumerate(scores) if score is None]
                for index, action in zip(playing, policy.act(np.stack([games[index].obs for index in playing]))):
                    step = games[index].step(int(action))
                    if step.game_over:
                        scores[index] = step.score
        finally:  # a stopped evaluation leaves no unfinished video behind
            for game in games:
                game.close()
    videos = [video_dir / game.name for game in games] if config.capture_video else []
    if videos:
        print(f"videos in {video_dir}", file=sys.stderr)
    if config.track:  # each game's score, their mean, and the videos
        with start_tracking(config, f"eval-{Path(config.eval).parent.name}", job_type="eval") as tracking:
            for index, score in enumerate(scores):
                tracking.log({"eval/episodic_return": score}, step=index)
            tracking.summary["eval/mean_return"] = float(np.mean(scores))
            tracking.log({"videos": [import_wandb().Video(str(video), format="mp4") for video in videos]})
    return scores


# ### Videos
#
# With `--capture-video`, a run records some whole games of its first game slot as it trains, as
# CleanRL does: games 0, 1, 8, 27, ... (the cubes) up to 1,000, then every 1,000th (gymnasium's
# `capped_cubic_video_schedule`), so the early games that change fastest are seen, and a long run
# leaves a few dozen videos rather than thousands. The game is recorded where it is played, in its
# worker: `make_recorded_env` stands in for `make_env` and wraps that one game in a `RecordedGame`. A
# video is written under a hidden name and renamed when its game ends, so the main process sees only
# whole videos, and sends each new one to Weights & Biases with `--track`; the video of a game that
# the end of the run cuts short is deleted as its worker closes it. `--eval` records each of
# its games with a `RecordedGame` too.


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


def records_game(index: int) -> bool:
    """Whether game `index` (from 0) of the recorded slot is recorded: the cubes below 1,000, then every 1,000th."""
    return round(index ** (1 / 3)) ** 3 == index if index < 1000 else index % 1000 == 0


def video_frame(game: Game) -> np.ndarray:
    """The game's screen in colour at twice its size (420 x 320), for a video."""
    return cv2.resize(game.render(), None, fx=2, fy=2, interpolation=cv2.INTER_NEAREST)


class RecordedGame:
    """A game (as `make_env` makes it) that writes the games `records_game` picks to
    `<video_dir>/<name>`, where `{}` in `name` stands for the game's index, from 0."""

    def __init__(self, game: Game, video_dir: Path, name: str, fps: float):
        self.game, self.video_dir, self.name_format, self.fps = game, video_dir, name, fps
        self.obs, self.n_actions, self.render = game.obs, game.n_actions, game.render
        self.games, self.video = 0, None

    def reset(self) -> np.ndarray:
        obs = self.game.reset()
        if records_game(self.games):
            self.name = self.name_format.format(self.games)
            self.video = Video(self.video_dir / f".{self.name}", self.fps)
            self.video.write(video_frame(self.game))
        self.games += 1
        return obs

    def step(self, action: int) -> Transition:
        step = self.game.step(action)
        if self.video is not None:
            self.video.write(video_frame(self.game))
            if step.game_over:
                self.video.close()
                os.replace(self.video.path, self.video_dir / self.name)
                self.video = None
        return step

    def close(self) -> None:
        """Close the game; the video of a game cut short by the end of the run is dropped."""
        if self.video is not None:
            with contextlib.suppress(OSError):  # the file goes all the same, if closing it fails (on a full disk, say)
                self.video.close()
            self.video.path.unlink(missing_ok=True)
        self.game.close()


def make_recorded_env(env_id: str, seed: int, options: dict, obs: np.ndarray | None = None, *, recorded_seed: int,
                      video_dir: Path, name: str, fps: float) -> Game | RecordedGame:
    """`make_env` for the workers of a recorded run: the game whose seed is `recorded_seed` is a `RecordedGame`."""
    game = make_env(env_id, seed, options, obs=obs)
    return RecordedGame(game, video_dir, name, fps) if int(seed) == recorded_seed else game


def game_maker(config: RunConfig, env_id: str, run_dir: Path, first_update: int) -> typing.Callable:
    """What the workers make their games with: `make_env`, or with `--capture-video` `make_recorded_env`
    for the run's first game (the first of rank 0, whose seed is the first of `game_seeds`). The
    videos' names hold the update their stretch of training started at, so a resumed run adds its own."""
    if not config.capture_video:
        return make_env
    return functools.partial(make_recorded_env, recorded_seed=int(game_seeds(config.seed, 1, first_update)[0]),
                             video_dir=run_dir / "videos", fps=60 / config.frame_skip,
                             name=f"train-{gym.spec(env_id).name}-from-update{first_update}-game{{:04d}}.mp4")


# ### main


def main(argv: list[str] | None = None) -> int:
    """Do what the command line asks: evaluate a checkpoint, or train, afresh or resumed. A mistake
    in the input is one line on stderr and exit status 2; the other statuses are `train`'s."""
    prog = "ppo_atari.py"
    try:
        config, checkpoint = parse_config(argv)
        if config.track:
            import_wandb()  # here, so that a missing wandb stops the run before it starts
        env_id = resolve_env_id(config.env)
        if checkpoint is not None and checkpoint["game"] != game_name(env_id):
            raise ConfigError(f"checkpoint {config.resume or config.eval} was trained on {checkpoint['game']}, "
                              f"not {game_name(env_id)}")
        if config.eval is None:
            return train(config, env_id, checkpoint)
        with Signals():  # SIGTERM and SIGHUP end it as Ctrl-C does, once its unfinished videos are deleted
            scores = evaluate(config, env_id, checkpoint)
        print(f"{env_id}: {how_many(len(scores), 'game')}, score {np.mean(scores):.1f} ± {np.std(scores):.1f} "
              f"(min {min(scores):g}, max {max(scores):g})")
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
# This part is optional: without torchrun there is one rank, `train` builds Part 3's
# `RunTrainer`, and the script runs exactly as the parts above describe.
#
# `torchrun --nproc_per_node N ppo_atari.py --env Breakout` starts N copies of this script, the
# *ranks*; `torchrun --nnodes M --nproc_per_node N --rdzv-endpoint HOST:PORT ...` spreads them over
# M machines. Each rank plays its own `num_envs` games, seeded with the next seeds of the run after
# those of the rank before it, and collects its own rollout: a batch holds N times as many
# transitions, and `--total-timesteps` counts the steps of all ranks. All keep the same network,
# which starts from rank 0's initialisation. Rank 0 alone writes the logs and the checkpoints.
# `DataParallelTrainer` is Part 1's `Trainer` with a few of its textbook methods overridden; two
# things make its update the single-process update on the combined batch:
#
# * **Gradients are averaged** over the ranks after each backward pass. The mean of the ranks'
#   gradients of means over equal minibatches is the gradient of the mean over the combined
#   minibatch, so every rank takes the same clipped Adam step and the parameters never drift apart.
# * **Advantages are normalised** with the mean and standard deviation of the combined minibatch,
#   from the sums $\sum_i \hat A_i$, $\sum_i \hat A_i^2$ and the count, added over the ranks.
#
# The decision to end an update early (`target_kl`) is taken on the KL of the combined minibatch,
# so that all ranks take it together, and what the update measured is reported as means over the
# ranks.
#
# **An explicit all-reduce, not DDP.** We average the gradients with one all-reduce rather than
# wrap the model in `DistributedDataParallel`. DDP's gain is to overlap communication with the
# backward pass, bucket by bucket, which pays for large models on fast links; ours has 1.7M
# parameters (7 MB, one message), and DDP would wrap the module that sampling also calls. The
# explicit version is the math above, line for line. The backend is NCCL between GPUs and gloo
# between CPUs.
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
    """The processes of a data-parallel run and the few collective operations that PPO needs.

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
        """Join the process group: NCCL between GPUs, gloo between CPUs."""
        if self.size > 1:
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(minutes=10))

    def close(self) -> None:
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()

    def _collective(self, operation, *args, **kwargs):
        """Run a collective operation of `torch.distributed`; a rank that died or left is a `RankFailure`."""
        try:
            return operation(*args, **kwargs)
        except RuntimeError as error:  # gloo: the connection to a rank that died was closed or reset
            FAILED_COLLECTIVES.append(error)
            # gloo says where in its source the connection broke, then why: keep the why.
            reason = str(error).strip().splitlines()[0].split("] ")[-1].split(". ")[0]
            raise RankFailure(f"rank {self.rank}: another rank failed or left ({reason})") from None

    def _all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        self._collective(dist.all_reduce, tensor, op=op)
        return tensor

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum of `tensor` over the ranks."""
        return tensor if self.size == 1 else self._all_reduce(tensor.clone())

    def mean(self, tensor: torch.Tensor) -> torch.Tensor:
        """The mean of `tensor` over the ranks."""
        return tensor if self.size == 1 else self.sum(tensor) / self.size

    def average_gradients(self, parameters) -> None:
        """Replace each gradient by its mean over the ranks, in one message for all of them."""
        if self.size == 1:
            return
        gradients = [p.grad for p in parameters]
        flat = self._all_reduce(torch.cat([g.flatten() for g in gradients])) / self.size
        for gradient, average in zip(gradients, flat.split([g.numel() for g in gradients])):
            gradient.copy_(average.view_as(gradient))

    def broadcast_parameters(self, model: nn.Module) -> None:
        """Start every rank from rank 0's initialisation."""
        if self.size > 1:
            for tensor in model.state_dict().values():
                self._collective(dist.broadcast, tensor, src=0)

    def largest(self, value: int, device: torch.device) -> int:
        """The largest of the ranks' values: the signal that stops them all, or 0 if none came."""
        if self.size == 1:
            return value
        return int(self._all_reduce(torch.tensor([value], device=device), op=dist.ReduceOp.MAX).item())

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


class DataParallelTrainer(Trainer):
    """Part 1's `Trainer` as one of several ranks: every rank takes the update that one process
    would take on the combined batch of all of them.

    It overrides the textbook methods where ranks differ from one process, and adds nothing else:
    `__init__` starts every rank from rank 0's network; `steps_per_update` counts the steps of every
    rank; `normalize_advantages` standardises over the combined minibatch; `compute_gradients`
    averages the gradients; `beyond_target_kl` decides on the combined minibatch; `update_policy`
    reports means over the ranks.
    """

    def __init__(self, config: Config, envs, device: torch.device, ranks: Ranks):
        self.ranks = ranks
        super().__init__(config, envs, device)
        ranks.broadcast_parameters(self.model)

    @property
    def steps_per_update(self) -> int:
        return super().steps_per_update * self.ranks.size

    def normalize_advantages(self, advantages: torch.Tensor) -> torch.Tensor:
        r"""`normalize_advantages` with the mean and standard deviation of the combined minibatch.

        The mean $\mu = S_1 / n$ and the unbiased variance $(S_2 - n \mu^2) / (n - 1)$ come from
        $S_1 = \sum_i \hat A_i$, $S_2 = \sum_i \hat A_i^2$ and the count $n$, each added over the ranks.
        """
        sums = torch.stack([advantages.sum(), (advantages ** 2).sum(),
                            torch.tensor(float(advantages.numel()), device=advantages.device)])
        total, squares, count = self.ranks.sum(sums)
        mean = total / count
        variance = (squares - count * mean ** 2) / (count - 1)
        return normalize_advantages(advantages, mean, variance.clamp(min=0).sqrt())

    def compute_gradients(self, loss: torch.Tensor) -> None:
        super().compute_gradients(loss)
        self.ranks.average_gradients(self.model.parameters())

    def beyond_target_kl(self, approx_kl: torch.Tensor) -> bool:
        # Without a target no rank asks, so none waits for the others.
        return self.config.target_kl is not None and super().beyond_target_kl(self.ranks.mean(approx_kl))

    def update_policy(self, rollout: Rollout) -> dict[str, float]:
        """Part 1's update. What it measured is reported as means over the ranks: for the loss's
        terms, means over equal minibatches, that is the means over the combined minibatches; for the
        explained variance, an average. The schedules and the epochs run are the same on every rank."""
        stats = super().update_policy(rollout)
        measured = [name for name in stats if name not in NOT_MEASURED]
        means = self.ranks.mean(torch.tensor([stats[name] for name in measured], device=self.device))
        return {**stats, **dict(zip(measured, means.tolist()))}


class DataParallelRunTrainer(DataParallelTrainer, RunTrainer):
    """What each rank of a real run trains with: the ranks of this part on Part 3's `RunTrainer`.

    Its methods are looked up in this order: `DataParallelTrainer`, `RunTrainer`, Part 2's
    `FastSamplingTrainer`, Part 1's `Trainer`. So the ranks' means of what an update measured are
    taken after `RunTrainer` has timed the update; a diverged update is refused on every rank alike,
    since their gradients and weights are the same.
    """

    cuda_graph_update = False  # a step's exchanges between the ranks are not captured


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
