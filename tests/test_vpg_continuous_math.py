"""The Gaussian policy's densities, GAE, the loss and the schedules of vpg_continuous.py."""

import math

import numpy as np
import pytest
import torch
from torch.distributions import Independent, Normal

import vpg_continuous as vpg


@pytest.mark.parametrize("action_dim", [1, 6, 17])
def test_log_prob_and_entropy_match_torch_distributions(action_dim):
    generator = torch.Generator().manual_seed(action_dim)
    mean = torch.randn(64, action_dim, generator=generator, dtype=torch.float64) * 2
    std = (torch.randn(64, action_dim, generator=generator, dtype=torch.float64) * 0.7).exp()
    actions = mean + std * torch.randn(64, action_dim, generator=generator, dtype=torch.float64) * 1.5
    mean.requires_grad_()
    std.requires_grad_()
    reference = Independent(Normal(mean, std), 1)
    ours = vpg.gaussian_log_prob(mean, std, actions)
    torch.testing.assert_close(ours, reference.log_prob(actions))
    # Summed over the action dimensions, not averaged.
    torch.testing.assert_close(ours, Normal(mean, std).log_prob(actions).sum(-1))
    torch.testing.assert_close(vpg.gaussian_entropy(std), reference.entropy())
    # The gradients the policy step uses agree too.
    ours_grad = torch.autograd.grad(ours.sum() + vpg.gaussian_entropy(std).sum(), (mean, std))
    reference_grad = torch.autograd.grad(reference.log_prob(actions).sum() + reference.entropy().sum(), (mean, std))
    for a, b in zip(ours_grad, reference_grad):
        torch.testing.assert_close(a, b)


def test_samples_follow_the_policy():
    torch.manual_seed(0)
    mean = torch.tensor([[0.5, -2.0, 0.0]]).expand(200_000, 3)
    std = torch.tensor([[0.1, 1.0, 3.0]]).expand(200_000, 3)
    samples = vpg.gaussian_sample(mean, std)
    torch.testing.assert_close(samples.mean(0), mean[0], atol=0.02, rtol=0)
    torch.testing.assert_close(samples.std(0), std[0], atol=0.0, rtol=0.01)


def test_the_loss_ascends_the_policy_gradient_of_a_known_objective():
    # One step, one action, reward r(a) = -(a - 3)^2 for a ~ N(mu, sigma^2). In closed form
    # J = E[r] = -((mu - 3)^2 + sigma^2), so dJ/dmu = -2 (mu - 3) and dJ/dsigma = -2 sigma. The
    # negated gradient of the loss, estimated from samples with the mean reward as the baseline,
    # must match both.
    # (In float64: a float32 mean of 400,000 terms is off by more than the sampling error.)
    torch.manual_seed(0)
    mu = torch.tensor([1.0], requires_grad=True, dtype=torch.float64)
    sigma = torch.tensor([0.5], requires_grad=True, dtype=torch.float64)
    n = 400_000
    mean, std = mu.expand(n, 1), sigma.expand(n, 1)
    with torch.no_grad():
        actions = vpg.gaussian_sample(mean, std)
        rewards = -(actions[:, 0] - 3.0) ** 2
        advantages = rewards - rewards.mean()
    log_probs = vpg.gaussian_log_prob(mean, std, actions)
    terms = vpg.vpg_loss(log_probs, log_probs.detach(), advantages, torch.zeros(n), torch.zeros(n),
                         vpg.gaussian_entropy(std), vpg.Config(vf_coef=0.5, ent_coef=0.0))
    terms["loss"].backward()
    # Tolerances of about two standard errors of the estimates (measured over seeds: 0.01 and 0.025).
    assert -mu.grad.item() == pytest.approx(-2 * (1.0 - 3.0), rel=0.01)
    assert -sigma.grad.item() == pytest.approx(-2 * 0.5, rel=0.05)


def test_loss_terms():
    log_probs = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    advantages = torch.tensor([1.0, -1.0, 2.0])
    values = torch.tensor([0.0, 1.0, 2.0], requires_grad=True)
    returns = torch.tensor([1.0, 1.0, 0.0])
    entropy = torch.tensor([1.0, 2.0, 3.0])
    terms = vpg.vpg_loss(log_probs, log_probs.detach(), advantages, values, returns, entropy,
                         vpg.Config(vf_coef=0.5, ent_coef=0.1))
    assert terms["policy_loss"].item() == pytest.approx(-(-1.0 * 1 + -2.0 * -1 + -0.5 * 2) / 3)
    assert terms["value_loss"].item() == pytest.approx((1 + 0 + 4) / 3)
    assert terms["entropy"].item() == pytest.approx(2.0)
    assert terms["loss"].item() == pytest.approx(terms["policy_loss"].item() + 0.5 * (5 / 3) - 0.1 * 2.0)
    terms["loss"].backward()
    # d/d log pi_i of -(1/N) sum log pi A is -A_i / N: likelier where the advantage is positive.
    torch.testing.assert_close(log_probs.grad, -advantages / 3)
    torch.testing.assert_close(values.grad, 0.5 * 2 * (values.detach() - returns) / 3)


def test_gae_on_hand_checked_numbers():
    # Two envs, four steps, gamma 0.5, lambda 0.5 (so gamma * lambda = 0.25).
    # Env 0 is truncated at step 1 (its final observation is worth 4), starts a new episode at
    # step 2 and is terminated at step 3 (its next value, 10, must be ignored). Env 1 runs through
    # and its observation after the rollout is worth 2.
    rewards = torch.tensor([[1.0, 0.0], [2.0, 0.0], [0.0, 0.0], [3.0, 1.0]])
    values = torch.tensor([[1.0, 0.0], [2.0, 0.0], [0.5, 0.0], [1.0, 0.0]])
    next_values = torch.tensor([[2.0, 0.0], [4.0, 0.0], [1.0, 0.0], [10.0, 2.0]])
    terminated = torch.tensor([[0, 0], [0, 0], [0, 0], [1, 0]], dtype=torch.bool)
    truncated = torch.tensor([[0, 0], [1, 0], [0, 0], [0, 0]], dtype=torch.bool)
    advantages, returns = vpg.compute_gae(rewards, values, next_values, terminated, truncated, 0.5, 0.5)
    # Env 0:
    #   delta_3 = 3 + 0 (terminated: no bootstrap) - 1 = 2           A_3 = 2
    #   delta_2 = 0 + 0.5 * 1 - 0.5 = 0                              A_2 = 0 + 0.25 * 2 = 0.5
    #   delta_1 = 2 + 0.5 * 4 (the final observation) - 2 = 2        A_1 = 2 (the episode ended: the sum stops)
    #   delta_0 = 1 + 0.5 * 2 - 1 = 1                                A_0 = 1 + 0.25 * 2 = 1.5
    # Env 1: delta_3 = 1 + 0.5 * 2 = 2, every other delta is 0, so A_t = 2 * 0.25^(3 - t).
    expected = torch.tensor([[1.5, 0.03125], [2.0, 0.125], [0.5, 0.5], [2.0, 2.0]])
    torch.testing.assert_close(advantages, expected)
    torch.testing.assert_close(returns, expected + values)


def gae_from_its_definition(rewards, values, next_values, terminated, truncated, gamma, gae_lambda):
    """A_t = sum over k from t to the episode's end of (gamma lambda)^(k - t) delta_k, one sum at a time."""
    num_steps, num_envs = rewards.shape
    deltas = rewards + gamma * np.where(terminated, 0.0, next_values) - values
    advantages = np.zeros((num_steps, num_envs))
    for env in range(num_envs):
        for t in range(num_steps):
            end = t
            while end < num_steps - 1 and not (terminated[end, env] or truncated[end, env]):
                end += 1
            weights = (gamma * gae_lambda) ** np.arange(end - t + 1)
            advantages[t, env] = np.dot(weights, deltas[t:end + 1, env])
    return advantages


@pytest.mark.parametrize("seed", range(3))
def test_gae_matches_its_definition_on_random_data(seed):
    rng = np.random.default_rng(seed)
    shape = (40, 3)
    rewards, values, next_values = (rng.normal(size=shape) for _ in range(3))
    terminated, truncated = rng.random(shape) < 0.07, rng.random(shape) < 0.07
    advantages, returns = vpg.compute_gae(*(torch.tensor(x, dtype=torch.float32) for x in (rewards, values, next_values)),
                                          torch.tensor(terminated), torch.tensor(truncated), 0.99, 0.97)
    expected = gae_from_its_definition(rewards, values, next_values, terminated, truncated, 0.99, 0.97)
    np.testing.assert_allclose(advantages.numpy(), expected, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(returns.numpy(), expected + values, rtol=1e-4, atol=1e-4)


def test_truncation_bootstraps_and_termination_does_not():
    one = torch.ones(1, 1)
    yes, no = torch.ones(1, 1, dtype=torch.bool), torch.zeros(1, 1, dtype=torch.bool)
    truncated, _ = vpg.compute_gae(one, one * 0, one * 5, no, yes, 0.99, 0.97)
    terminated, _ = vpg.compute_gae(one, one * 0, one * 5, yes, no, 0.99, 0.97)
    assert truncated.item() == pytest.approx(1 + 0.99 * 5) and terminated.item() == pytest.approx(1.0)


def test_linear_schedule():
    assert vpg.linear_schedule(3e-4, 0, 100) == 3e-4
    assert vpg.linear_schedule(3e-4, 50, 100) == pytest.approx(1.5e-4)
    assert vpg.linear_schedule(3e-4, 99, 100) == pytest.approx(3e-6)  # the last update: not zero


def test_explained_variance():
    targets = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert vpg.explained_variance(targets, targets) == pytest.approx(1.0)
    assert vpg.explained_variance(torch.full((4,), 2.5), targets) == pytest.approx(0.0)
    assert math.isnan(vpg.explained_variance(targets, torch.ones(4)))
