"""Learning: four agents trained side by side on CartPole-v1 in one compiled program all solve it.

CartPole-v1 pays 1 per step and ends at 500 steps, so a return of 475 or more means the pole stays
up nearly the whole time. A random policy lasts about 22 steps. The control below runs the same
program with the advantages' sign flipped, for the first two of the four agents (an agent is the
same with others beside it or alone, so these are the first test's agents 0 and 1): they must not
learn, or the first test would not show that the gradient is what does the learning.
"""

import jax
import numpy as np

import ppo_jax

SEEDS = 4


def train_cartpole(monkeypatch, advantage_sign: float, seeds: int = SEEDS) -> tuple[np.ndarray, np.ndarray]:
    """`seeds` agents, 500,000 steps each: the returns over training `[agents, updates]`, and of 20 test episodes each."""
    if advantage_sign < 0:
        original = ppo_jax.compute_gae

        def flipped(*args, **kwargs):
            advantages, returns = original(*args, **kwargs)
            return -advantages, returns

        monkeypatch.setattr(ppo_jax, "compute_gae", flipped)
    config = ppo_jax.Config(env="CartPole-v1", total_timesteps=500_000, num_seeds=seeds, seed=1)
    keys = ppo_jax.agent_keys(config)
    training = ppo_jax.make_train(config)
    runners, metrics = jax.jit(jax.vmap(training.train))(keys)
    evaluate = ppo_jax.make_evaluate(training.network, ppo_jax.BatchedEnv("CartPole-v1", 20))
    test_returns = jax.jit(jax.vmap(evaluate))(runners.agent.params, runners.normalizer,
                                              jax.random.split(jax.random.key(7), seeds))
    return np.asarray(metrics["episodic_return"]), np.asarray(test_returns)


def final_training_return(returns: np.ndarray) -> np.ndarray:
    """Each agent's mean episodic return over its last 10 updates (about 10 episodes of 500 steps)."""
    return np.nanmean(returns[:, -10:], axis=1)


def test_every_agent_solves_cartpole(monkeypatch):
    returns, test_returns = train_cartpole(monkeypatch, +1.0)
    assert returns.shape == (SEEDS, 976)
    assert np.all(final_training_return(returns) >= 475), final_training_return(returns)
    assert np.all(test_returns.mean(axis=1) >= 475), test_returns.mean(axis=1)
    # The agents are independent: they learned along different paths.
    assert len({tuple(np.nan_to_num(r[:50]).round(3)) for r in returns}) == SEEDS


def test_does_not_learn_with_the_advantage_sign_flipped(monkeypatch):
    returns, test_returns = train_cartpole(monkeypatch, -1.0, seeds=2)
    assert returns.shape == (2, 976)
    assert np.all(final_training_return(returns) < 50), final_training_return(returns)
    assert np.all(test_returns.mean(axis=1) < 50), test_returns.mean(axis=1)
