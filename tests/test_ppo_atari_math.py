"""GAE, the clipped loss and the schedules of ppo_atari.py, against numbers worked out by hand."""

import math

import numpy as np
import pytest
import torch

import ppo_atari


def test_gae_on_hand_checked_numbers():
    # Two games, four steps, gamma 0.9, lambda 0.5. Game 0 is truncated at step 1 (the value of its
    # final observation is 3.0) and terminated at step 2; game 1 runs through.
    rewards = torch.tensor([[1.0, 0.0], [0.0, 0.0], [2.0, 0.0], [1.0, 1.0]])
    values = torch.tensor([[0.5, 0.0], [1.0, 0.0], [0.2, 0.0], [0.4, 0.0]])
    next_values = torch.tensor([[1.0, 0.0], [3.0, 0.0], [0.4, 0.0], [2.0, 0.0]])
    terminated = torch.tensor([[0, 0], [0, 0], [1, 0], [0, 0]], dtype=torch.bool)
    truncated = torch.tensor([[0, 0], [1, 0], [0, 0], [0, 0]], dtype=torch.bool)
    advantages, returns = ppo_atari.compute_gae(rewards, values, next_values, terminated, truncated, 0.9, 0.5)
    # Game 0, by hand:
    #   delta_3 = 1 + 0.9 * 2.0 - 0.4 = 2.4                     A_3 = 2.4
    #   delta_2 = 2 + 0 (terminated: no bootstrap) - 0.2 = 1.8   A_2 = 1.8 (the episode ends here)
    #   delta_1 = 0 + 0.9 * 3.0 (final obs) - 1.0 = 1.7          A_1 = 1.7 (truncated: the sum stops)
    #   delta_0 = 1 + 0.9 * 1.0 - 0.5 = 1.4                      A_0 = 1.4 + 0.45 * 1.7 = 2.165
    # Game 1: a single reward at the end, discounted by 0.45 per step back.
    expected = torch.tensor([[2.165, 0.091125], [1.7, 0.2025], [1.8, 0.45], [2.4, 1.0]])
    torch.testing.assert_close(advantages, expected)
    torch.testing.assert_close(returns, expected + values)


def slow_gae(rewards, values, next_values, terminated, truncated, gamma, gae_lambda):
    """GAE from its definition: A_t = sum_k (gamma lambda)^k delta_{t+k}, up to the episode's end."""
    num_steps, num_envs = rewards.shape
    advantages = np.zeros((num_steps, num_envs))
    for env in range(num_envs):
        for t in range(num_steps):
            total, weight = 0.0, 1.0
            for k in range(t, num_steps):
                bootstrap = 0.0 if terminated[k, env] else gamma * next_values[k, env]
                total += weight * (rewards[k, env] + bootstrap - values[k, env])
                if terminated[k, env] or truncated[k, env]:
                    break
                weight *= gamma * gae_lambda
            advantages[t, env] = total
    return advantages


@pytest.mark.parametrize("seed", range(3))
def test_gae_matches_its_definition_on_random_data(seed):
    rng = np.random.default_rng(seed)
    shape = (33, 5)
    rewards, values, next_values = (rng.normal(size=shape) for _ in range(3))
    terminated = rng.random(shape) < 0.08
    truncated = rng.random(shape) < 0.08
    gamma, gae_lambda = 0.97, 0.9
    advantages, returns = ppo_atari.compute_gae(
        *(torch.tensor(x, dtype=torch.float32) for x in (rewards, values, next_values)),
        torch.tensor(terminated), torch.tensor(truncated), gamma, gae_lambda)
    expected = slow_gae(rewards, values, next_values, terminated, truncated, gamma, gae_lambda)
    np.testing.assert_allclose(advantages.numpy(), expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(returns.numpy(), expected + values, rtol=1e-4, atol=1e-5)


def test_truncation_and_termination_differ_only_in_the_bootstrap():
    ones = torch.ones(1, 1)
    end = torch.ones(1, 1, dtype=torch.bool)
    no = torch.zeros(1, 1, dtype=torch.bool)
    truncated, _ = ppo_atari.compute_gae(ones, ones * 0, ones * 5, no, end, 0.9, 0.95)
    terminated, _ = ppo_atari.compute_gae(ones, ones * 0, ones * 5, end, no, 0.9, 0.95)
    assert truncated.item() == pytest.approx(1 + 0.9 * 5) and terminated.item() == pytest.approx(1.0)


COEFFICIENTS = ppo_atari.Config(vf_coef=0.5, ent_coef=0.01)


def loss_on(ratios, advantages, clip_range=0.2, values=None, old_values=None, returns=None):
    old_log_probs = torch.zeros(len(ratios))
    log_probs = torch.tensor(ratios, dtype=torch.float64).log().float().requires_grad_()
    n = len(ratios)
    values = torch.zeros(n, requires_grad=True) if values is None else torch.tensor(values, requires_grad=True)
    old_values = torch.zeros(n) if old_values is None else torch.tensor(old_values)
    returns = torch.zeros(n) if returns is None else torch.tensor(returns)
    terms = ppo_atari.ppo_loss(log_probs, old_log_probs, torch.tensor(advantages), values, old_values, returns,
                               entropy=torch.zeros(n), clip_range=clip_range, config=COEFFICIENTS)
    return terms, log_probs, values


def test_policy_loss_is_clipped_exactly_where_it_should_be():
    ratios = [0.5, 0.9, 1.1, 1.5, 0.5, 0.9, 1.1, 1.5]
    advantages = [1.0, 1.0, 1.0, 1.0, -1.0, -1.0, -1.0, -1.0]
    terms, log_probs, _ = loss_on(ratios, advantages, clip_range=0.2)
    # Per sample, -min(r A, clip(r) A):
    #   A = +1: r = 0.5 -> -0.5 (unclipped: the ratio fell, the objective pulls it back up)
    #           r = 0.9, 1.1 -> -r (inside the range)
    #           r = 1.5 -> -1.2 (clipped: no more gain from raising it)
    #   A = -1: r = 0.5 -> 0.8 (clipped: no more gain from lowering it)
    #           r = 0.9, 1.1 -> r
    #           r = 1.5 -> 1.5 (unclipped: the ratio rose against the advantage, pull it back down)
    per_sample = [-0.5, -0.9, -1.1, -1.2, 0.8, 0.9, 1.1, 1.5]
    assert terms.policy_loss.item() == pytest.approx(np.mean(per_sample), rel=1e-5)
    terms.policy_loss.backward()
    # d/d log pi of -(r A) is -r A; zero where the clipped term is the one taken.
    expected_gradient = [-0.5, -0.9, -1.1, 0.0, 0.0, 0.9, 1.1, 1.5]
    np.testing.assert_allclose(log_probs.grad.numpy(), np.array(expected_gradient) / len(ratios), rtol=1e-5)
    assert terms.clipfrac.item() == pytest.approx(4 / 8)


def test_value_loss_is_clipped_around_the_old_prediction():
    # Old prediction 0, target 1, clip 0.2. A new value of 0.1 is inside the range: plain squared
    # error. A new value of 0.5 left the range: the clipped prediction 0.2 has the larger error,
    # (0.2 - 1)^2 = 0.64 > 0.25, so it is taken and its gradient in the new value is 0.
    # A new value of 1.5 overshot: its own error 0.25 < clipped (0.2 - 1)^2 = 0.64, again clipped.
    # A new value of -0.5 moved away from the target: its own error 2.25 is larger, gradient flows.
    terms, _, values = loss_on([1.0] * 4, [0.0] * 4, clip_range=0.2, values=[0.1, 0.5, 1.5, -0.5],
                               old_values=[0.0] * 4, returns=[1.0] * 4)
    expected = 0.5 * np.mean([0.81, 0.64, 0.64, 2.25])
    assert terms.value_loss.item() == pytest.approx(expected, rel=1e-5)
    terms.value_loss.backward()
    np.testing.assert_allclose(values.grad.numpy(), [0.5 * 2 * (0.1 - 1) / 4, 0, 0, 0.5 * 2 * (-0.5 - 1) / 4], rtol=1e-5)


def test_total_loss_and_kl_estimate():
    ratios, advantages = [0.8, 1.25], [1.0, -2.0]
    terms, _, _ = loss_on(ratios, advantages, clip_range=0.3, values=[1.0, 2.0], returns=[0.0, 0.0])
    assert terms.loss.item() == pytest.approx(terms.policy_loss.item() + 0.5 * terms.value_loss.item(), rel=1e-6)
    # The k3 estimator: mean of (r - 1) - log r, never negative.
    expected_kl = np.mean([(r - 1) - math.log(r) for r in ratios])
    assert terms.approx_kl.item() == pytest.approx(expected_kl, rel=1e-5)
    n = 2
    entropy_terms = ppo_atari.ppo_loss(torch.zeros(n), torch.zeros(n), torch.zeros(n), torch.zeros(n), torch.zeros(n),
                                       torch.zeros(n), entropy=torch.tensor([1.0, 2.0]), clip_range=0.1,
                                       config=COEFFICIENTS)
    assert entropy_terms.loss.item() == pytest.approx(-0.01 * 1.5)  # the entropy is a bonus


def test_linear_schedule():
    assert ppo_atari.linear_schedule(2.5e-4, 0, 100) == 2.5e-4
    assert ppo_atari.linear_schedule(2.5e-4, 50, 100) == pytest.approx(1.25e-4)
    assert ppo_atari.linear_schedule(0.1, 99, 100) == pytest.approx(0.001)  # the last update: not zero


def test_explained_variance():
    targets = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert ppo_atari.explained_variance(targets, targets) == pytest.approx(1.0)
    assert ppo_atari.explained_variance(torch.full((4,), 2.5), targets) == pytest.approx(0.0)
    assert math.isnan(ppo_atari.explained_variance(targets, torch.ones(4)))
