"""The running statistics of vpg_continuous.py: exact against numpy, merged across workers, saved, frozen in eval."""

import numpy as np
import pytest
import torch

import vpg_continuous as vpg
from vpg_continuous_helpers import ScriptedEnvs, pendulum_checkpoint, saved_and_loaded, statistics_with_the_prior


def drifting_stream(seed: int, batches: int, width: int = 5):
    """Batches of 1 to 16 rows whose mean and scale drift, as observations do while a policy learns."""
    rng = np.random.default_rng(seed)
    for i in range(batches):
        rows = rng.integers(1, 17)
        yield rng.normal(loc=0.1 * i, scale=1.0 + 0.05 * i, size=(rows, width)) * np.arange(1, width + 1) * 10.0


def test_running_statistics_match_numpy_over_the_same_stream():
    stats = vpg.RunningMeanStd((5,))
    seen = []
    for batch in drifting_stream(0, 200):
        stats.update(batch)
        seen.append(batch)
        everything = np.concatenate(seen)
        assert stats.count == len(everything)
        np.testing.assert_allclose(stats.mean, everything.mean(0), rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(stats.var, everything.var(0), rtol=1e-9)


def test_merging_the_statistics_of_several_workers_matches_numpy_over_all_of_them():
    # Three workers each see their own part of the stream and keep their own statistics.
    parts = {worker: [] for worker in range(3)}
    workers = {worker: vpg.RunningMeanStd((5,)) for worker in range(3)}
    for i, batch in enumerate(drifting_stream(1, 150)):
        parts[i % 3].append(batch)
        workers[i % 3].update(batch)
    everything = np.concatenate([np.concatenate(batches) for batches in parts.values()])

    merged = vpg.RunningMeanStd((5,))
    for worker in workers.values():
        merged.merge(worker)
    assert merged.count == len(everything)
    np.testing.assert_allclose(merged.mean, everything.mean(0), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(merged.var, everything.var(0), rtol=1e-9)

    # The order of merging does not matter, and merging nothing changes nothing.
    other_order = vpg.RunningMeanStd((5,))
    for worker in [workers[2], workers[0], vpg.RunningMeanStd((5,)), workers[1]]:
        other_order.merge(worker)
    np.testing.assert_allclose(other_order.mean, merged.mean, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(other_order.var, merged.var, rtol=1e-12)


def test_observations_are_standardised_and_clipped():
    normalizer = vpg.ObservationNormalizer(3)
    batch = np.array([[1.0, 10.0, -5.0], [3.0, 30.0, 5.0], [2.0, 20.0, 0.0]])
    normalizer.update(batch)
    mean, std = batch.mean(0), np.sqrt(batch.var(0) + 1e-8)
    np.testing.assert_allclose(normalizer(batch), (batch - mean) / std, rtol=1e-6)
    assert normalizer(batch).dtype == np.float32
    # An observation far outside what was seen is clipped to +-10.
    outlier = np.array([[1000.0, -1000.0, 2.0]])
    np.testing.assert_allclose(normalizer(outlier), [[10.0, -10.0, 2.0 / std[2]]], rtol=1e-6)
    disabled = vpg.ObservationNormalizer(3, enabled=False)
    disabled.update(batch)
    assert disabled.stats.count == 0
    np.testing.assert_array_equal(disabled(outlier), outlier.astype(np.float32))


def test_the_trainer_normalises_with_the_statistics_of_every_env_so_far():
    # Three envs whose observations are all t after step t (0 at reset). The policy's input at step
    # t is t standardised with the statistics of 0, 1, ..., t, each seen by all three envs.
    config = vpg.Config(num_envs=3, num_steps=5, total_timesteps=15, normalize_rewards=False)
    trainer = vpg.Trainer(config, ScriptedEnvs(num_envs=3), torch.device("cpu"))
    rollout = trainer.collect_rollout()
    for t in range(5):
        seen = np.repeat(np.arange(t + 1.0), 3)
        expected = (t - seen.mean()) / np.sqrt(seen.var() + 1e-8)
        torch.testing.assert_close(rollout.obs[t], torch.full((3, 3), expected, dtype=torch.float32))
    assert trainer.obs_normalizer.stats.count == 3 * 6  # the reset and five steps
    np.testing.assert_allclose(trainer.obs_normalizer.stats.mean, np.full(3, 2.5))


def test_rewards_are_divided_by_the_spread_of_the_discounted_return():
    scaler = vpg.RewardScaler(num_envs=2, gamma=0.5)
    rewards = [np.array([1.0, 2.0]), np.array([3.0, -1.0]), np.array([0.0, 4.0])]
    done = [np.array([False, False]), np.array([True, False]), np.array([False, False])]
    # Discounted returns by hand: step 1 (1, 2); step 2 (0.5 + 3, 1 - 1) = (3.5, 0), after which
    # env 0's episode ends and its return restarts; step 3 (0 + 0, 0 + 4) = (0, 4).
    returns_so_far = [[1.0, 2.0], [1.0, 2.0, 3.5, 0.0], [1.0, 2.0, 3.5, 0.0, 0.0, 4.0]]
    for step in range(3):
        scaled = scaler(rewards[step], done[step])
        expected = rewards[step] / np.sqrt(statistics_with_the_prior(returns_so_far[step])[1] + 1e-8)
        np.testing.assert_allclose(scaled, expected, rtol=1e-6)
    assert scaler.stats.count == 1 + 6


def test_the_plain_scaler_the_default_has_no_prior_and_no_clip():
    # Returns 1 and 3 in two envs: mean 2, variance 1, so the rewards come out as they went in; one
    # env's first return alone has variance 0, and its reward is multiplied by 1/sqrt(1e-8), unclipped.
    assert not vpg.Config.reward_prior_and_clip
    scaler = vpg.RewardScaler(num_envs=2, gamma=0.9, prior_and_clip=False)
    np.testing.assert_allclose(scaler(np.array([1.0, 3.0]), np.zeros(2, bool)), [1.0, 3.0], rtol=1e-6)
    assert scaler.stats.count == 2
    alone = vpg.RewardScaler(num_envs=1, gamma=0.9, prior_and_clip=False)
    assert alone(np.array([1.0]), np.zeros(1, bool))[0] == pytest.approx(1e4)


def test_a_truncated_episode_restarts_the_return_of_the_trainers_scaler():
    # HalfCheetah's episodes only ever end truncated: the discounted return must restart there too.
    # One env paying 1 a step, truncated at step 3 of 6: the return is that of the last three steps.
    trainer = vpg.Trainer(vpg.Config(num_envs=1, num_steps=6, total_timesteps=6), ScriptedEnvs(num_envs=1,
                          truncate_at={0: [3]}), torch.device("cpu"))
    trainer.collect_rollout()
    assert trainer.reward_scaler.returns[0] == pytest.approx(1 + 0.99 + 0.99 ** 2)


@pytest.mark.parametrize("reward", [1.0, -0.3, 7.0, 1e6])
def test_the_first_reward_of_one_env_is_not_blown_up(reward):
    # One env's first return alone has variance 0: without the prior its reward would be divided
    # by sqrt(1e-8), multiplied by 10,000. With it, by sqrt(1/2 + r^2 / 4): within +-2 for any r.
    scaler = vpg.RewardScaler(num_envs=1, gamma=0.99)
    scaled = scaler(np.array([reward]), np.array([False]))
    np.testing.assert_allclose(scaled, [reward / np.sqrt(0.5 + reward ** 2 / 4)], rtol=1e-6)
    assert abs(scaled[0]) <= 2


def test_the_trainer_with_one_env_scales_its_first_rewards_by_the_spread_of_the_returns():
    # The scripted env pays 1 a step: the returns grow 1, 1.99, 2.97, ..., and each scaled reward is
    # 1 over their spread so far, with the prior: 1.15 at the first step (10,000 without the prior).
    trainer = vpg.Trainer(vpg.Config(num_envs=1, num_steps=8, total_timesteps=8, reward_prior_and_clip=True),
                          ScriptedEnvs(num_envs=1), torch.device("cpu"))
    rewards = trainer.collect_rollout().rewards[:, 0].numpy()
    returns = np.array([sum(0.99 ** k for k in range(t + 1)) for t in range(8)])
    expected = [1 / np.sqrt(statistics_with_the_prior(returns[:t + 1])[1] + 1e-8) for t in range(8)]
    np.testing.assert_allclose(rewards, expected, rtol=1e-6)
    assert rewards[0] == pytest.approx(1 / np.sqrt(0.75), rel=1e-6)


def test_a_freak_reward_is_clipped_to_ten():
    # After 500 steps of rewards of spread 1 in 4 envs, the returns' standard deviation is about 7.
    # Rewards of +-1e5 in two envs then move it to about 3,000, which leaves them at about +-30
    # before the clip: they come out at +-10, while the others are scaled as before.
    rng = np.random.default_rng(0)
    scaler = vpg.RewardScaler(num_envs=4, gamma=0.99)
    for _ in range(500):
        scaler(rng.normal(size=4), np.zeros(4, bool))
    rewards = np.array([1e5, -1e5, 0.5, -0.5])
    scaled = scaler(rewards, np.zeros(4, bool))
    assert scaled[0] == 10.0 and scaled[1] == -10.0
    np.testing.assert_allclose(scaled[2:], rewards[2:] / np.sqrt(scaler.stats.var + 1e-8), rtol=1e-6)


def test_the_statistics_survive_a_checkpoint_round_trip():
    config = vpg.Config(num_envs=2, num_steps=7, total_timesteps=14, num_minibatches=2)
    trainer = vpg.Trainer(config, ScriptedEnvs(truncate_at={0: [3]}), torch.device("cpu"))
    trainer.update_policy(trainer.collect_rollout())
    resumed = vpg.Trainer(config, ScriptedEnvs(), torch.device("cpu"))
    saved = saved_and_loaded(vpg.checkpoint_state(trainer, "Scripted", vpg.Ranks()))
    vpg.restore_checkpoint(resumed, saved, "(in memory)", vpg.Ranks())
    for ours, theirs in [(trainer.obs_normalizer.stats, resumed.obs_normalizer.stats),
                         (trainer.reward_scaler.stats, resumed.reward_scaler.stats)]:
        assert theirs.count == ours.count > 0
        np.testing.assert_array_equal(theirs.mean, ours.mean)
        np.testing.assert_array_equal(theirs.var, ours.var)
    raw = np.array([[1.5, -2.0, 30.0]])
    np.testing.assert_array_equal(resumed.obs_normalizer(raw), trainer.obs_normalizer(raw))


@pytest.mark.parametrize("variance", [0.25, 1.0])
def test_evaluation_uses_the_saved_statistics_frozen(variance, monkeypatch):
    # Pendulum's observation starts with (cos theta, sin theta), a point on the unit circle. With
    # saved statistics of mean 0 and variance v, the policy must see that point scaled by
    # 1 / sqrt(v), every step of every episode; statistics re-estimated during evaluation would
    # not keep it on that circle.
    checkpoint = pendulum_checkpoint()
    checkpoint["obs_normalizer"] = {"mean": torch.zeros(3, dtype=torch.float64),
                                    "var": torch.full((3,), variance, dtype=torch.float64), "count": 1000}
    inputs = []
    real_forward = vpg.GaussianPolicy.forward

    def recording_forward(self, obs):
        inputs.append(obs.clone())
        return real_forward(self, obs)

    monkeypatch.setattr(vpg.GaussianPolicy, "forward", recording_forward)
    eval_config = vpg.RunConfig(env="Pendulum-v1", eval="checkpoint.pt", eval_episodes=3, max_episode_steps=25)
    returns = vpg.evaluate(eval_config, "Pendulum-v1", checkpoint)
    assert len(returns) == 3 and all(r < 0 for r in returns)  # Pendulum's rewards are costs
    seen = torch.cat(inputs)
    assert len(seen) == 3 * 25
    radius = (seen[:, 0] ** 2 + seen[:, 1] ** 2).sqrt()
    torch.testing.assert_close(radius, torch.full_like(radius, 1 / variance ** 0.5), rtol=1e-5, atol=1e-5)
    assert checkpoint["obs_normalizer"]["count"] == 1000
