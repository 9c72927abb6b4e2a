"""The math of ppo_jax.py against references: GAE, the distributions, the loss, the schedules, the layers."""

import functools
import math
import re
import typing

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import ppo_jax


def as_jax(*arrays):
    return [jnp.asarray(a) for a in arrays]


def test_gae_on_hand_checked_numbers():
    # The numbers of ppo_atari's test: two games, four steps, gamma 0.9, lambda 0.5. Game 0 is
    # truncated at step 1 (its final observation is worth 3.0) and terminated at step 2.
    rewards = [[1.0, 0.0], [0.0, 0.0], [2.0, 0.0], [1.0, 1.0]]
    values = [[0.5, 0.0], [1.0, 0.0], [0.2, 0.0], [0.4, 0.0]]
    next_values = [[1.0, 0.0], [3.0, 0.0], [0.4, 0.0], [2.0, 0.0]]
    terminated = np.array([[0, 0], [0, 0], [1, 0], [0, 0]], bool)
    truncated = np.array([[0, 0], [1, 0], [0, 0], [0, 0]], bool)
    advantages, returns = ppo_jax.compute_gae(*as_jax(rewards, values, next_values, terminated, truncated), 0.9, 0.5)
    # A_3 = 1 + 0.9 * 2.0 - 0.4; A_2 = 2 - 0.2 (no bootstrap); A_1 = 0.9 * 3.0 - 1.0 (bootstrapped, cut);
    # A_0 = 1 + 0.9 - 0.5 + 0.45 * A_1. Game 1: one reward at the end, 0.45 per step back.
    expected = np.array([[2.165, 0.091125], [1.7, 0.2025], [1.8, 0.45], [2.4, 1.0]])
    np.testing.assert_allclose(advantages, expected, rtol=1e-6)
    np.testing.assert_allclose(returns, expected + np.array(values), rtol=1e-6)


def gae_by_loop(rewards, values, next_values, terminated, truncated, gamma, gae_lambda):
    """GAE the plain way: a Python loop backwards over time, one environment and one step at a time."""
    num_steps, num_envs = rewards.shape
    advantages = np.zeros((num_steps, num_envs))
    for env in range(num_envs):
        following = 0.0
        for t in reversed(range(num_steps)):
            bootstrap = 0.0 if terminated[t, env] else gamma * next_values[t, env]
            delta = rewards[t, env] + bootstrap - values[t, env]
            if terminated[t, env] or truncated[t, env]:
                following = 0.0  # what follows belongs to the next episode
            following = delta + gamma * gae_lambda * following
            advantages[t, env] = following
    return advantages


@pytest.mark.parametrize("seed", range(3))
def test_scanned_gae_equals_a_python_loop(seed):
    rng = np.random.default_rng(seed)
    shape = (64, 6)
    rewards, values, next_values = (rng.normal(size=shape) for _ in range(3))
    terminated = rng.random(shape) < 0.06
    truncated = rng.random(shape) < 0.06
    assert terminated.sum() > 5 and truncated.sum() > 5 and (terminated & truncated).any()
    advantages, returns = ppo_jax.compute_gae(*as_jax(rewards, values, next_values, terminated, truncated), 0.97, 0.9)
    expected = gae_by_loop(rewards, values, next_values, terminated, truncated, 0.97, 0.9)
    np.testing.assert_allclose(advantages, expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(returns, expected + values, rtol=1e-4, atol=1e-5)


def test_truncation_bootstraps_and_termination_does_not():
    one = jnp.ones((1, 1))
    yes, no = jnp.ones((1, 1), bool), jnp.zeros((1, 1), bool)
    truncated, _ = ppo_jax.compute_gae(one, one * 0, one * 5, no, yes, 0.9, 0.95)
    terminated, _ = ppo_jax.compute_gae(one, one * 0, one * 5, yes, no, 0.9, 0.95)
    assert float(truncated[0, 0]) == pytest.approx(1 + 0.9 * 5) and float(terminated[0, 0]) == pytest.approx(1.0)


def test_categorical_against_torch():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(200, 5)) * 3
    logits[0] = [80.0, -80.0, 0.0, 1.0, 2.0]  # large logits: no overflow
    actions = rng.integers(0, 5, 200)
    policy = ppo_jax.Categorical(jnp.asarray(logits, jnp.float32))
    reference = torch.distributions.Categorical(logits=torch.tensor(logits, dtype=torch.float64))
    np.testing.assert_allclose(policy.log_prob(jnp.asarray(actions)), reference.log_prob(torch.tensor(actions)),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(policy.entropy(), reference.entropy(), rtol=1e-5, atol=1e-6)


def test_categorical_samples_follow_the_probabilities():
    logits = jnp.log(jnp.array([0.1, 0.2, 0.7]))
    samples = ppo_jax.Categorical(jnp.broadcast_to(logits, (40_000, 3))).sample(jax.random.key(0))
    frequencies = np.bincount(np.asarray(samples), minlength=3) / 40_000
    np.testing.assert_allclose(frequencies, [0.1, 0.2, 0.7], atol=0.01)


def test_gaussian_against_torch():
    rng = np.random.default_rng(1)
    mean, log_std, actions = rng.normal(size=(100, 3)), rng.normal(size=(100, 3)) * 0.5, rng.normal(size=(100, 3)) * 2
    policy = ppo_jax.Gaussian(*as_jax(mean, log_std))
    reference = torch.distributions.Normal(torch.tensor(mean), torch.tensor(log_std).exp())
    np.testing.assert_allclose(policy.log_prob(jnp.asarray(actions)),
                               reference.log_prob(torch.tensor(actions)).sum(-1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(policy.entropy(), reference.entropy().sum(-1), rtol=1e-5, atol=1e-5)
    samples = ppo_jax.Gaussian(jnp.full((50_000, 1), 2.0), jnp.full((50_000, 1), math.log(0.5))).sample(jax.random.key(1))
    assert float(samples.mean()) == pytest.approx(2.0, abs=0.01) and float(samples.std()) == pytest.approx(0.5, abs=0.01)


def loss_on(ratios, advantages, clip_range=0.2, values=None, old_values=None, returns=None, clip_value_loss=True):
    n = len(ratios)
    values = jnp.zeros(n) if values is None else jnp.asarray(values)
    old_values = jnp.zeros(n) if old_values is None else jnp.asarray(old_values)
    returns = jnp.zeros(n) if returns is None else jnp.asarray(returns)

    config = ppo_jax.Config(vf_coef=0.5, ent_coef=0.01, clip_value_loss=clip_value_loss)

    def loss(log_probs, values):
        return ppo_jax.ppo_loss(log_probs, jnp.zeros(n), jnp.asarray(advantages), values, old_values, returns,
                                jnp.zeros(n), clip_range, config)

    log_probs = jnp.log(jnp.asarray(ratios))
    terms = jax.jit(loss)(log_probs, values)
    policy_gradient = jax.jit(jax.grad(lambda log_probs: loss(log_probs, values)["policy_loss"]))(log_probs)
    value_gradient = jax.jit(jax.grad(lambda values: loss(jnp.zeros(n), values)["value_loss"]))(values)
    return terms, policy_gradient, value_gradient


def test_policy_loss_is_clipped_exactly_where_it_should_be():
    ratios = [0.5, 0.9, 1.1, 1.5, 0.5, 0.9, 1.1, 1.5]
    advantages = [1.0, 1.0, 1.0, 1.0, -1.0, -1.0, -1.0, -1.0]
    terms, gradient, _ = loss_on(ratios, advantages, clip_range=0.2)
    # -min(r A, clip(r) A) per sample: the clip binds at r = 1.5 for A > 0 and at r = 0.5 for A < 0.
    assert float(terms["policy_loss"]) == pytest.approx(np.mean([-0.5, -0.9, -1.1, -1.2, 0.8, 0.9, 1.1, 1.5]), rel=1e-5)
    # d/d log pi of -(r A) is -r A, and 0 where the clipped term is the one taken.
    np.testing.assert_allclose(gradient, np.array([-0.5, -0.9, -1.1, 0, 0, 0.9, 1.1, 1.5]) / 8, rtol=1e-5, atol=1e-7)
    assert float(terms["clipfrac"]) == pytest.approx(4 / 8)


def test_value_loss_is_clipped_around_the_old_prediction():
    # Old prediction 0, target 1, clip 0.2: 0.1 is inside (plain error); 0.5 and 1.5 left the range
    # and the clipped prediction 0.2 has the larger error (gradient 0); -0.5 moved away, its own error wins.
    terms, _, gradient = loss_on([1.0] * 4, [0.0] * 4, values=[0.1, 0.5, 1.5, -0.5], old_values=[0.0] * 4,
                                 returns=[1.0] * 4)
    assert float(terms["value_loss"]) == pytest.approx(0.5 * np.mean([0.81, 0.64, 0.64, 2.25]), rel=1e-5)
    np.testing.assert_allclose(gradient, [0.5 * 2 * (0.1 - 1) / 4, 0, 0, 0.5 * 2 * (-0.5 - 1) / 4], rtol=1e-5)


def test_value_loss_unclipped_when_switched_off():
    # The same predictions with `clip_value_loss` off: the plain squared error of each, and its gradient, everywhere.
    values = [0.1, 0.5, 1.5, -0.5]
    terms, _, gradient = loss_on([1.0] * 4, [0.0] * 4, values=values, old_values=[0.0] * 4, returns=[1.0] * 4,
                                 clip_value_loss=False)
    assert float(terms["value_loss"]) == pytest.approx(0.5 * np.mean([0.81, 0.25, 0.25, 2.25]), rel=1e-5)
    np.testing.assert_allclose(gradient, [0.5 * 2 * (v - 1) / 4 for v in values], rtol=1e-5)


def test_total_loss_and_kl_estimate():
    terms, _, _ = loss_on([0.8, 1.25], [1.0, -2.0], clip_range=0.3, values=[1.0, 2.0], returns=[0.0, 0.0])
    assert float(terms["loss"]) == pytest.approx(float(terms["policy_loss"]) + 0.5 * float(terms["value_loss"]), rel=1e-6)
    assert float(terms["approx_kl"]) == pytest.approx(np.mean([(r - 1) - math.log(r) for r in [0.8, 1.25]]), rel=1e-4)
    zeros = jnp.zeros(2)
    bonus = ppo_jax.ppo_loss(zeros, zeros, zeros, zeros, zeros, zeros, jnp.array([1.0, 2.0]), 0.1,
                             ppo_jax.Config(vf_coef=0.5, ent_coef=0.01))
    assert float(bonus["loss"]) == pytest.approx(-0.01 * 1.5)


@pytest.mark.parametrize("update, fraction", [(0, 1.0), (50, 0.5), (99, 0.01)])
def test_linear_schedule_at_start_middle_and_end(update, fraction):
    assert float(ppo_jax.linear_schedule(2.5e-4, update, 100)) == pytest.approx(2.5e-4 * fraction)
    assert float(ppo_jax.linear_schedule(0.2, jnp.int32(update), 100)) == pytest.approx(0.2 * fraction)


def test_explained_variance():
    targets = jnp.array([1.0, 2.0, 3.0, 4.0])
    assert float(ppo_jax.explained_variance(targets, targets)) == pytest.approx(1.0)
    assert float(ppo_jax.explained_variance(jnp.full(4, 2.5), targets)) == pytest.approx(0.0)
    assert math.isnan(float(ppo_jax.explained_variance(targets, jnp.ones(4))))


@pytest.fixture(scope="module")
def one_update():
    """`run(k)`: the parameters before and after update `k` of 10 of a CartPole run (one epoch, one minibatch)."""
    config = ppo_jax.Config(num_envs=2, num_steps=8, num_minibatches=1, update_epochs=1, total_timesteps=160,
                            learning_rate=1e-3, clip_range=0.3)
    training = ppo_jax.make_train(config)
    runner = jax.jit(training.init)(jax.random.key(0))
    update = jax.jit(training.update)

    def run(k: int):
        after, metrics = update(runner._replace(update=jnp.int32(k)))
        return runner.agent.params, after.agent.params, metrics

    return run


@pytest.mark.parametrize("update, fraction", [(0, 1.0), (5, 0.5), (9, 0.1)])
def test_the_annealed_learning_rate_is_the_one_applied(one_update, update, fraction):
    before, after, metrics = one_update(update)
    assert float(metrics["learning_rate"]) == pytest.approx(1e-3 * fraction)
    assert float(metrics["clip_range"]) == pytest.approx(0.3 * fraction)
    # Adam's first step moves every weight with a gradient by the learning rate (its direction is
    # m / sqrt(v) = g / |g|), so the largest change of any weight is the rate of this update.
    largest = max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before)))
    assert largest == pytest.approx(1e-3 * fraction, rel=1e-3)


def adam_steps(agent: ppo_jax.Agent) -> int:
    """How many steps Adam has taken: its step count, which moves only with a step that is kept."""
    return int(next(state.count for state in agent.opt_state if isinstance(state, optax.ScaleByAdamState)))


@pytest.mark.parametrize("target_kl, steps", [(None, 8), (1e-12, 2), (1e9, 8)])
def test_target_kl_skips_the_epochs_after_the_one_that_went_too_far(target_kl, steps):
    # CleanRL's rule: the whole epoch runs, and if its last minibatch's KL exceeded the target, the
    # epochs after it are skipped. 4 epochs of 2 minibatches: 8 steps, or 2 with a tiny target.
    config = ppo_jax.Config(num_envs=2, num_steps=8, num_minibatches=2, update_epochs=4, total_timesteps=160,
                            target_kl=target_kl, learning_rate=0.05)
    network = ppo_jax.MLPActorCritic(2)
    params = network.init(jax.random.key(0), jnp.zeros((1, 4)))
    optimizer = ppo_jax.make_optimizer(config)
    update_agent = ppo_jax.make_update_agent(network, optimizer, config)
    shape = (8, 2)
    rollout = ppo_jax.Rollout(jnp.ones(shape + (4,)), jnp.zeros(shape, jnp.int32), jnp.full(shape, -0.1),
                              jnp.zeros(shape), jnp.zeros(shape), jnp.ones(shape), jnp.zeros(shape, bool),
                              jnp.zeros(shape, bool))
    agent, metrics = jax.jit(update_agent)(ppo_jax.Agent(params, optimizer.init(params)), rollout,
                                           jax.random.key(1), 0.05, 0.2)
    assert adam_steps(agent) == steps
    assert bool(metrics["stopped_early"]) == (steps < 8)
    assert math.isfinite(float(metrics["losses"]["policy_loss"]))


def small_update(config, rollout):
    """One `update_agent` of a CartPole-sized MLP on `rollout`: the agent after it and its metrics."""
    network = ppo_jax.MLPActorCritic(2)
    params = network.init(jax.random.key(0), jnp.zeros((1, 4)))
    optimizer = ppo_jax.make_optimizer(config)
    update_agent = jax.jit(ppo_jax.make_update_agent(network, optimizer, config))
    return update_agent(ppo_jax.Agent(params, optimizer.init(params)), rollout, jax.random.key(1), 1e-3, 0.2)


def random_rollout(old_log_probs=None, shape=(8, 2)):
    rng = np.random.default_rng(0)
    return ppo_jax.Rollout(jnp.asarray(rng.normal(size=shape + (4,)), jnp.float32),
                           jnp.asarray(rng.integers(0, 2, shape), jnp.int32),
                           jnp.full(shape, -0.69) if old_log_probs is None else old_log_probs,
                           jnp.zeros(shape), jnp.zeros(shape), jnp.asarray(rng.normal(size=shape) * 3 + 1, jnp.float32),
                           jnp.zeros(shape, bool), jnp.zeros(shape, bool))


def test_advantages_are_standardised_within_each_minibatch(monkeypatch):
    # The loss reports the mean and the spread of the advantages it was given: 0 and 1 in each of
    # four minibatches (standardised over the whole batch instead, a minibatch's mean is not 0).
    ppo_loss = ppo_jax.ppo_loss

    def reporting(*args, **kwargs):
        terms, advantages, valid = ppo_loss(*args, **kwargs), args[2], (args[9:] or [kwargs.get("valid")])[0]
        return {**terms, "mean": jnp.abs(ppo_jax.masked_mean(advantages, valid)),
                "spread": jnp.abs(jnp.sqrt(ppo_jax.masked_mean(advantages ** 2, valid)) - 1.0)}

    monkeypatch.setattr(ppo_jax, "ppo_loss", reporting)
    config = ppo_jax.Config(num_envs=2, num_steps=8, num_minibatches=4, update_epochs=1, total_timesteps=160)
    _, metrics = small_update(config, random_rollout())
    assert float(metrics["losses"]["mean"]) < 1e-5 and float(metrics["losses"]["spread"]) < 1e-4


def test_target_kl_reads_the_kl_of_the_epochs_last_minibatch(monkeypatch):
    # A stand-in KL: the mean of -old_log_prob over the minibatch, whose entries are 0 and 1 half and
    # half. Over an epoch it averages exactly 0.5, under the target of 0.5005; the last minibatch
    # of some epoch is above it, and the update stops there (an epoch's mean would never stop it).
    ppo_loss = ppo_jax.ppo_loss

    def stand_in_kl(*args, **kwargs):
        valid = (args[9:] or [kwargs.get("valid")])[0]
        return {**ppo_loss(*args, **kwargs), "approx_kl": ppo_jax.masked_mean(-args[1], valid)}

    monkeypatch.setattr(ppo_jax, "ppo_loss", stand_in_kl)
    config = ppo_jax.Config(num_envs=2, num_steps=8, num_minibatches=2, update_epochs=4, total_timesteps=160,
                            target_kl=0.5005)
    old_log_probs = jnp.asarray(np.arange(16).reshape(8, 2) % 2, jnp.float32) * -1.0
    _, metrics = small_update(config, random_rollout(old_log_probs))
    assert bool(metrics["stopped_early"])


def test_the_loss_clips_at_the_clip_range_it_is_given_not_the_configs():
    # The clip range is annealed, and the loss is given the one of its update: 0.1 here, where the
    # config says 0.2. A ratio of 1.15 is clipped at 1.1, a value 0.15 from the old one at 0.1.
    config = ppo_jax.Config(clip_range=0.2)
    one = jnp.ones(1)
    terms = ppo_jax.ppo_loss(jnp.log(one * 1.15), one * 0, one, one * 0.15, one * 0, one, one * 0, 0.1, config)
    assert float(terms["policy_loss"]) == pytest.approx(-1.1, rel=1e-5)
    assert float(terms["value_loss"]) == pytest.approx(0.5 * 0.9 ** 2, rel=1e-5)


class Flattened(typing.NamedTuple):
    """A network that takes each image flattened into a vector, and reshapes it for `network`."""

    network: typing.Any
    shape: tuple

    def apply(self, params, obs):
        return self.network.apply(params, obs.reshape(*obs.shape[:-1], *self.shape))


def test_the_update_takes_the_same_minibatches_from_images_as_from_vectors():
    # The update has one path for every observation: the same rollout, its images given flattened to a
    # network that reshapes them, must give the same update. 2 epochs of 4 minibatches from 16 MinAtar-sized grids.
    config = ppo_jax.Config(num_envs=2, num_steps=8, num_minibatches=4, update_epochs=2, total_timesteps=160,
                            learning_rate=1e-2)
    network = ppo_jax.MinAtarActorCritic(3)
    params = network.init(jax.random.key(0), jnp.zeros((1, 10, 10, 4)))
    optimizer = ppo_jax.make_optimizer(config)
    rng = np.random.default_rng(3)
    shape = (8, 2)
    rollout = ppo_jax.Rollout(jnp.asarray(rng.integers(0, 2, shape + (10, 10, 4)), jnp.float32),
                              jnp.asarray(rng.integers(0, 3, shape), jnp.int32), jnp.full(shape, -1.1),
                              *(jnp.asarray(rng.normal(size=shape), jnp.float32) for _ in range(3)),
                              jnp.asarray(rng.random(shape) < 0.2), jnp.zeros(shape, bool))
    agent = ppo_jax.Agent(params, optimizer.init(params))
    updated = {}
    for name, net, obs in [("images", network, rollout.obs),
                           ("vectors", Flattened(network, (10, 10, 4)), rollout.obs.reshape(*shape, -1))]:
        update_agent = jax.jit(ppo_jax.make_update_agent(net, optimizer, config))
        updated[name] = update_agent(agent, rollout._replace(obs=obs), jax.random.key(1), 1e-2, 0.2)
    (images, image_metrics), (vectors, vector_metrics) = updated["images"], updated["vectors"]
    assert adam_steps(images) == 8
    for a, b in zip(jax.tree.leaves(images.params), jax.tree.leaves(vectors.params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for name, value in image_metrics["losses"].items():
        np.testing.assert_allclose(value, vector_metrics["losses"][name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_steps_that_are_no_transition_weigh_nothing():
    # The loss, the advantages' normalisation and the explained variance over 8 samples of which 3
    # are not transitions are those over the 5 others alone.
    rng = np.random.default_rng(4)
    arrays = [jnp.asarray(rng.normal(size=8), jnp.float32) for _ in range(7)]
    valid = jnp.array([True, False, True, True, False, True, False, True])
    config = ppo_jax.Config(vf_coef=0.5, ent_coef=0.01)
    masked = ppo_jax.ppo_loss(*arrays, 0.2, config, valid=valid)
    alone = ppo_jax.ppo_loss(*[x[valid] for x in arrays], 0.2, config)
    assert masked.keys() == alone.keys()
    for name in masked:
        assert float(masked[name]) == pytest.approx(float(alone[name]), rel=1e-5, abs=1e-7), name
    np.testing.assert_allclose(ppo_jax.normalize_advantages(arrays[0], valid)[valid],
                               ppo_jax.normalize_advantages(arrays[0][valid]), rtol=1e-5)
    assert float(ppo_jax.explained_variance(arrays[1], arrays[2], valid)) == pytest.approx(
        float(ppo_jax.explained_variance(arrays[1][valid], arrays[2][valid])), rel=1e-5)


@pytest.mark.parametrize("kernel, stride, size", [(3, 1, 10), (8, 4, 84), (4, 2, 20), (3, 1, 9), (7, 1, 7),
                                                (4, 2, 9), (3, 2, 8)])
def test_patch_conv_is_nn_conv(kernel, stride, size):
    # Part 3's convolution for the CPU: nn.Conv's parameters (names, shapes, initial values), its
    # outputs and its gradients, on inputs with two batch axes (agents and environments).
    rng = np.random.default_rng(kernel + size)
    x = jnp.asarray(rng.normal(size=(2, 3, size, size, 5)), jnp.float32)
    fields = dict(features=7, kernel_size=(kernel, kernel), strides=(stride, stride), padding="VALID",
                  kernel_init=nn.initializers.orthogonal(math.sqrt(2)))
    theirs, ours = nn.Conv(**fields), ppo_jax.PatchConv(**fields)
    params = jax.jit(theirs.init)(jax.random.key(0), x)  # compiled, each in one program: op by op takes seconds
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(jax.jit(ours.init)(jax.random.key(0), x)), strict=True):
        np.testing.assert_array_equal(a, b)
    params = jax.tree.map(lambda w: w + jnp.asarray(rng.normal(size=w.shape), jnp.float32) * 0.1, params)
    weights = jnp.asarray(rng.normal(size=theirs.apply(params, x).shape), jnp.float32)

    def loss(layer, params, x):
        return jnp.sum(layer.apply(params, x) * weights)

    np.testing.assert_allclose(jax.jit(ours.apply)(params, x), jax.jit(theirs.apply)(params, x), rtol=1e-4, atol=1e-4)
    for a, b in zip(jax.tree.leaves(jax.jit(jax.grad(functools.partial(loss, ours), argnums=(0, 1)))(params, x)),
                    jax.tree.leaves(jax.jit(jax.grad(functools.partial(loss, theirs), argnums=(0, 1)))(params, x)),
                    strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("network, obs", [(ppo_jax.MinAtarActorCritic, (10, 10, 4)),
                                          (ppo_jax.NatureActorCritic, (4, 84, 84))])
def test_cnns_with_patch_conv_are_the_cnns_with_nn_conv(network, obs):
    # The CPU's networks and everyone else's: the same parameters, so that a checkpoint moves between
    # them, and the same function. On this CPU the command line takes `PatchConv`.
    assert ppo_jax.convolution_layer() is ppo_jax.PatchConv
    dtype = jnp.uint8 if obs[0] == 4 else jnp.float32
    frames = jnp.asarray(np.random.default_rng(1).integers(0, 256 if obs[0] == 4 else 2, (2, 3) + obs), dtype)
    theirs, ours = network(6), network(6, ppo_jax.PatchConv)
    params = jax.jit(theirs.init)(jax.random.key(0), frames)
    assert jax.tree.structure(params) == jax.tree.structure(jax.eval_shape(ours.init, jax.random.key(0), frames))
    assert "Conv_0" in params["params"]
    params = jax.tree.map(lambda w: w + 0.01 * jnp.sign(w), params)  # non-zero biases, a less uniform policy
    their_policy, their_values = jax.jit(theirs.apply)(params, frames)
    our_policy, our_values = jax.jit(ours.apply)(params, frames)
    np.testing.assert_allclose(our_policy.logits, their_policy.logits, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(our_values, their_values, rtol=1e-4, atol=1e-5)

def orthogonal_with_gain(matrix: np.ndarray, gain: float) -> bool:
    gram = matrix.T @ matrix if matrix.shape[0] >= matrix.shape[1] else matrix @ matrix.T
    return np.allclose(gram, gain ** 2 * np.eye(len(gram)), atol=1e-5)


@pytest.mark.parametrize("network, obs", [(ppo_jax.MLPActorCritic(3), (4,)), (ppo_jax.MinAtarActorCritic(6), (10, 10, 4))])
def test_every_kernel_but_the_heads_has_gain_sqrt_2(network, obs):
    # The test below finds each layer's gain among three; here each hidden layer's must be sqrt(2).
    params = jax.jit(network.init)(jax.random.key(0), jnp.zeros((1,) + obs))
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        name = jax.tree_util.keystr(path)
        if "kernel" in name and "'policy'" not in name and "'value'" not in name:
            assert orthogonal_with_gain(np.asarray(leaf).reshape(-1, leaf.shape[-1]), math.sqrt(2)), name


@pytest.mark.parametrize("network, obs", [(ppo_jax.MLPActorCritic(3), (4,)),
                                          (ppo_jax.MLPActorCritic(2, continuous=True), (3,)),
                                          (ppo_jax.MinAtarActorCritic(6), (10, 10, 4)),
                                          (ppo_jax.NatureActorCritic(4), (4, 84, 84))])
def test_initialisation_gains_and_first_policy(network, obs):
    dtype = jnp.uint8 if len(obs) == 3 and obs[0] == 4 else jnp.float32
    params = jax.jit(network.init)(jax.random.key(0), jnp.zeros((1,) + obs, dtype))
    layers = jax.tree_util.tree_leaves_with_path(params)
    # A convolution's kernel is a matrix with a column per output channel (see `convolution`).
    kernels = [(jax.tree_util.keystr(path), np.asarray(leaf).reshape(-1, leaf.shape[-1])) for path, leaf in layers
               if "kernel" in jax.tree_util.keystr(path)]
    output_gains = {0.01: 0, 1.0: 0}
    for name, kernel in kernels:
        gain = next((g for g in (math.sqrt(2), 0.01, 1.0) if orthogonal_with_gain(kernel, g)), None)
        assert gain is not None, name
        if kernel.shape[1] in (1, getattr(network, "n_actions", getattr(network, "action_dim", None))) and gain != math.sqrt(2):
            output_gains[gain] += 1
    assert output_gains == {0.01: 1, 1.0: 1}  # one policy head at 0.01, one value head at 1
    for path, leaf in layers:
        if "bias" in jax.tree_util.keystr(path) or "log_std" in jax.tree_util.keystr(path):
            assert not np.any(leaf)
    policy, values = jax.jit(network.apply)(params, jnp.asarray(np.random.default_rng(0).integers(0, 2, (3,) + obs), dtype))
    assert values.shape == (3,)
    if isinstance(policy, ppo_jax.Categorical):
        probabilities = jax.nn.softmax(policy.logits)
        np.testing.assert_allclose(probabilities, 1 / probabilities.shape[-1], atol=0.02)  # nearly uniform
    else:
        np.testing.assert_allclose(policy.log_std, 0.0)


@pytest.mark.parametrize("env", ["CartPole-v1", "Breakout-MinAtar"])
def test_agents_side_by_side_initialise_one_matrix_at_a_time(env):
    # jaxlib 0.10.2's batched QR can deadlock on the CPU, so the orthogonal initialisation of
    # several seeds must factorise unbatched (2-D) matrices, in a loop over the seeds.
    training = ppo_jax.make_train(ppo_jax.Config(env=env, num_seeds=4))
    jaxpr = str(jax.make_jaxpr(jax.vmap(training.init))(jax.random.split(jax.random.key(0), 4)))
    outputs = re.findall(r"=\s*qr\[", jaxpr)
    shapes = [re.findall(r"f32\[([\d,]*)\]", line.split("=")[0]) for line in jaxpr.splitlines()
              if re.search(r"=\s*qr\[", line)]
    assert outputs and len(shapes) == len(outputs)
    assert all(len(shape.split(",")) == 2 for line in shapes for shape in line), shapes


@pytest.mark.parametrize("env", ["CartPole-v1", "Breakout-MinAtar"])
def test_an_agent_among_others_starts_from_the_weights_it_has_alone(env):
    training = ppo_jax.make_train(ppo_jax.Config(env=env, num_seeds=4))
    keys = jax.random.split(jax.random.key(3), 4)
    together = jax.jit(jax.vmap(training.init))(keys).agent.params
    for agent in [0, 3]:
        alone = jax.jit(training.init)(keys[agent]).agent.params
        for a, b in zip(jax.tree.leaves(together), jax.tree.leaves(alone)):
            np.testing.assert_array_equal(a[agent], b)


def test_the_ring_holds_the_returns_of_the_last_100_episodes():
    # Batches of steps in which some episodes end, one batch of more than 100 among them, against a
    # plain list of every episode's return: after each batch the ring holds the last 100 of them.
    rng = np.random.default_rng(0)
    ring, count, everything = jnp.zeros(ppo_jax.SCORE_WINDOW), jnp.array(0, jnp.int32), []
    assert np.isnan(ppo_jax.mean_of_ring(ring, count))
    for size, chance in [(8, 0.3), (40, 0.5), (300, 0.8), (16, 0.0), (64, 0.2), (5, 1.0)]:
        ended, returns = rng.random(size) < chance, rng.normal(size=size).astype(np.float32)
        ring, count = ppo_jax.remember_episodes(ring, count, *as_jax(ended, returns))
        everything += list(returns[ended])
        last = everything[-ppo_jax.SCORE_WINDOW:]
        assert int(count) == len(everything)
        assert sorted(np.asarray(ring)[:len(last)].tolist()) == sorted(last)
        # The n-th episode is at n % 100: the newest just before the slot the next one takes.
        if last:
            assert np.asarray(ring)[(len(everything) - 1) % ppo_jax.SCORE_WINDOW] == last[-1]
        np.testing.assert_allclose(ppo_jax.mean_of_ring(ring, count), np.mean(last), rtol=1e-6)
