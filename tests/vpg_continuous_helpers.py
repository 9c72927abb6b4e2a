"""Vector envs for the tests of vpg_continuous.py: the reference for `Workers`, a scripted one, and
one of drifting noise for the ranks of a data-parallel test; and a task whose steps never return."""

import io
import time

import numpy as np
import torch

import vpg_continuous as vpg


class InProcessEnvs:
    """The envs of `vpg.Workers` with the same seeds, stepped one after the other in this process.

    It follows the workers' contract (same-step auto-reset, `final_obs` for truncations, the
    finished episodes), so the trainer can run on it and the workers can be compared with it.
    """

    def __init__(self, env_id: str, num_envs: int, seed: int, max_episode_steps: int | None = None):
        self.spaces = vpg.describe_env(env_id)
        self.num_envs = num_envs
        self.tasks = [vpg.Task(env_id, s, max_episode_steps) for s in vpg.env_seeds(seed, num_envs)]
        self.final_obs = np.zeros((num_envs, self.spaces.obs_dim))

    def reset(self) -> np.ndarray:
        return np.stack([task.reset().copy() for task in self.tasks])

    def step(self, actions: np.ndarray) -> vpg.VecStep:
        rewards = np.zeros(self.num_envs)
        terminated = np.zeros(self.num_envs, bool)
        truncated = np.zeros(self.num_envs, bool)
        finished = []
        for env, (task, action) in enumerate(zip(self.tasks, actions)):
            step = task.step(np.asarray(action, np.float64))
            rewards[env], terminated[env], truncated[env] = step.reward, step.terminated, step.truncated
            if step.terminated or step.truncated:
                finished.append((env, step.episode_return, step.episode_length))
                if step.truncated:
                    self.final_obs[env] = task.obs
                task.reset()
        obs = np.stack([task.obs.copy() for task in self.tasks])
        return vpg.VecStep(obs, rewards, terminated, truncated, self.final_obs.copy(), finished)

    def close(self) -> None:
        for task in self.tasks:
            task.close()


class ScriptedEnvs:
    """A vector env whose episodes end where the test says, and which records the actions it is sent.

    The observation after step `t` (counting from 1) is `t` in every entry; at reset it is 0. A
    truncated episode's final observation is 100 in every entry, unlike any other. Every step pays
    a reward of 1.
    """

    def __init__(self, num_envs=2, obs_dim=3, action_low=(-1.0,), action_high=(1.0,), truncate_at=None,
                 terminate_at=None):
        self.num_envs = num_envs
        self.spaces = vpg.EnvSpaces(obs_dim, np.array(action_low, np.float64), np.array(action_high, np.float64))
        self.truncate_at = truncate_at or {}
        self.terminate_at = terminate_at or {}
        self.t = 0
        self.received: list[np.ndarray] = []

    def reset(self) -> np.ndarray:
        return np.zeros((self.num_envs, self.spaces.obs_dim))

    def step(self, actions: np.ndarray) -> vpg.VecStep:
        self.received.append(np.array(actions))
        self.t += 1
        obs = np.full((self.num_envs, self.spaces.obs_dim), float(self.t))
        final_obs = np.zeros_like(obs)
        terminated = np.zeros(self.num_envs, bool)
        truncated = np.zeros(self.num_envs, bool)
        finished = []
        for env in range(self.num_envs):
            if self.t in self.terminate_at.get(env, ()):
                terminated[env] = True
            if self.t in self.truncate_at.get(env, ()):
                truncated[env] = True
                final_obs[env] = 100.0
            if terminated[env] or truncated[env]:
                finished.append((env, 1.0, 1))
        return vpg.VecStep(obs, np.ones(self.num_envs), terminated, truncated, final_obs, finished)


def saved_and_loaded(state: dict) -> dict:
    """`state` after a trip through `torch.save` and `torch.load(weights_only=True)`, as a checkpoint makes it."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def pendulum_checkpoint() -> dict:
    """The checkpoint of one short update on Pendulum-v1, loaded back as `--eval` would load it."""
    envs = InProcessEnvs("Pendulum-v1", num_envs=2, seed=0)
    config = vpg.Config(env="Pendulum-v1", num_envs=2, num_steps=8, total_timesteps=16, num_minibatches=2)
    trainer = vpg.Trainer(config, envs, torch.device("cpu"))
    trainer.update_policy(trainer.collect_rollout())
    envs.close()
    return saved_and_loaded(vpg.checkpoint_state(trainer, "Pendulum-v1", vpg.Ranks()))


def statistics_with_the_prior(returns) -> tuple[float, float]:
    """The mean and variance of `returns` and the reward scaler's prior, one return of mean 0 and
    variance 1: as if the returns 1 and -1 had each been seen half a time."""
    values = np.concatenate([[1.0, -1.0], returns])
    weights = np.concatenate([[0.5, 0.5], np.ones(len(returns))])
    mean = np.average(values, weights=weights)
    return mean, np.average((values - mean) ** 2, weights=weights)


class DriftingTask:
    """A vector env from its own seed: observations on scales from 1 to 100 that drift away from 0,
    random rewards and episode ends. It records what the trainer's running statistics should see."""

    def __init__(self, num_envs: int, seed: int):
        self.num_envs = num_envs
        self.spaces = vpg.EnvSpaces(3, np.array([-1.0]), np.array([1.0]))
        self.rng = np.random.default_rng(seed)
        self.t = 0
        self.observations, self.rewards, self.done = [], [], []

    def _observe(self) -> np.ndarray:
        obs = (self.rng.normal(size=(self.num_envs, 3)) + 0.1 * self.t) * np.array([1.0, 10.0, 100.0])
        self.observations.append(obs.copy())
        return obs

    def reset(self) -> np.ndarray:
        return self._observe()

    def step(self, actions: np.ndarray) -> vpg.VecStep:
        self.t += 1
        obs = self._observe()
        rewards = self.rng.normal(size=self.num_envs) + actions[:, 0]
        terminated = self.rng.random(self.num_envs) < 0.1
        truncated = ~terminated & (self.rng.random(self.num_envs) < 0.1)
        final_obs = self.rng.normal(size=(self.num_envs, 3))
        self.rewards.append(rewards)
        self.done.append(terminated | truncated)
        finished = [(int(env), 1.0, 1) for env in np.flatnonzero(terminated | truncated)]
        return vpg.VecStep(obs, rewards, terminated, truncated, final_obs, finished)


class StuckTask(vpg.Task):
    """A `Task` whose steps never return, like a simulator stuck in a loop."""

    def step(self, action: np.ndarray) -> vpg.Transition:
        time.sleep(3600)
