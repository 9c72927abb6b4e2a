"""What the tests of ppo_atari.py share: `RandomFrames`, a vector env of noise; and a small gymnasium task
with RGB frames and discrete actions, with what a fork of ppo_atari.py writes to train on it (the
wrapper that plays it as the workers play a game, and the `make_env` that makes it); and a game whose steps
never return (`make_stuck_env`).

They are in a module of their own so that workers started by `spawn` can import `make_env` by its name.
"""

import time

import gymnasium as gym
import numpy as np

import ppo_atari



class RandomFrames:
    """A vector env of random frames, rewards and episode ends from its own seed, as Part 1's trainer
    wants one: enough for updates that move the policy, and for each rank of a test its own games."""

    def __init__(self, num_envs: int, seed: int):
        self.num_envs, self.n_actions, self.observation_shape = num_envs, 4, ppo_atari.Game.observation_shape
        self.rng = np.random.default_rng(seed)
        self.obs = np.zeros((num_envs, *self.observation_shape), np.uint8)
        self.final_obs = np.zeros_like(self.obs)

    def reset(self):
        self.obs[:] = self.rng.integers(0, 256, self.obs.shape)
        return self.obs

    def step(self, actions):
        self.obs[:] = self.rng.integers(0, 256, self.obs.shape)
        rewards = self.rng.normal(size=self.num_envs).astype(np.float32)
        terminated = self.rng.random(self.num_envs) < 0.1
        truncated = ~terminated & (self.rng.random(self.num_envs) < 0.05)
        self.final_obs[truncated] = self.rng.integers(0, 256, self.final_obs[truncated].shape)
        return ppo_atari.VecStep(self.obs, rewards, terminated, truncated, self.final_obs, [])


ENV_ID = "ShowsWhichActionPays-v0"


class ShowsWhichActionPays(gym.Env):
    """Each frame is dark but for a bright bar in one of `n_actions` columns, in the colour channel of
    the column's index; the action with the bar's index earns 1 and the others 0, and each episode
    is one step. A random policy earns 1 / n_actions a step; a policy that reads the frame earns 1."""

    metadata = {"render_modes": ["rgb_array"]}

    def __init__(self, size: int = 48, n_actions: int = 3, render_mode: str = "rgb_array"):
        self.size, self.n_actions, self.render_mode = size, n_actions, render_mode
        self.observation_space = gym.spaces.Box(0, 255, (size, size, 3), np.uint8)
        self.action_space = gym.spaces.Discrete(n_actions)
        self.target, self.frame = 0, np.zeros((size, size, 3), np.uint8)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.target = int(self.np_random.integers(self.n_actions))
        self.frame = self.np_random.integers(0, 40, (self.size, self.size, 3), dtype=np.uint8)  # a little noise
        width = self.size // self.n_actions
        self.frame[:, self.target * width:(self.target + 1) * width, self.target % 3] = 255
        return self.frame, {}

    def step(self, action):
        return self.frame, float(action == self.target), True, False, {}

    def render(self):
        return self.frame


if ENV_ID not in gym.registry:
    gym.register(ENV_ID, entry_point=ShowsWhichActionPays)


class PixelGame:
    """A gymnasium task with RGB frames and discrete actions, played as ppo_atari's `Game` is: the
    observation channels first, written in place; a `Transition` per step; the whole episode's score."""

    def __init__(self, env_id: str, seed: int, obs: np.ndarray | None = None):
        self.env = gym.make(env_id)
        self.n_actions = int(self.env.action_space.n)
        height, width, channels = self.env.observation_space.shape
        self.obs = np.zeros((channels, height, width), np.uint8) if obs is None else obs
        self.seed: int | None = int(seed)
        self.score, self.length = 0.0, 0

    def reset(self) -> np.ndarray:
        frame, _ = self.env.reset(seed=self.seed)
        self.seed = None  # seeded once; later episodes go on from the task's own random state
        self.obs[:] = frame.transpose(2, 0, 1)
        self.score, self.length = 0.0, 0
        return self.obs

    def step(self, action: int) -> ppo_atari.Transition:
        frame, reward, terminated, truncated, _ = self.env.step(action)
        self.obs[:] = frame.transpose(2, 0, 1)
        self.score += reward
        self.length += 1
        return ppo_atari.Transition(reward=float(reward), terminated=bool(terminated), truncated=bool(truncated),
                                    game_over=bool(terminated or truncated), score=self.score, length=self.length)

    def render(self) -> np.ndarray:
        return self.env.render()

    def close(self) -> None:
        self.env.close()


def make_env(env_id: str, seed: int, options: dict, obs: np.ndarray | None = None) -> PixelGame:
    """ppo_atari's `make_env`, for this task: the Atari options have nothing to set here."""
    return PixelGame(env_id, seed, obs=obs)


def make_stuck_env(env_id: str, seed: int, options: dict, obs: np.ndarray | None = None) -> PixelGame:
    """`make_env` for a game whose steps never return, like an emulator stuck in a loop."""
    game = PixelGame(env_id, seed, obs=obs)
    game.step = lambda action: time.sleep(3600)
    return game
