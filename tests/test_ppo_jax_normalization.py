"""ppo_jax.py's normalised observations and scaled rewards for continuous actions: the math against numpy
references, one set of statistics per agent, checkpoints, evaluation, and discrete actions left as they were."""

import flax.linen as nn
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gymnasium.wrappers.utils import RunningMeanStd

import ppo_jax

# Pendulum, two agents of 4 envs x 32 steps, 4 updates of 2 epochs of 2 minibatches.
TINY = dict(env="Pendulum-v1", num_seeds=2, num_envs=4, num_steps=32, num_minibatches=2, update_epochs=2,
            total_timesteps=512, gamma=0.9)


def test_running_moments_are_the_mean_and_variance_of_everything_seen():
    # Batches of different sizes and scales; the statistics after them are those of all the samples
    # pooled with the starting ones (mean 0, variance 1, worth 1e-4 samples), computed in one go.
    rng = np.random.default_rng(0)
    batches = [rng.normal(loc, scale, size=(n, 3)) for n, loc, scale in [(4, 5.0, 2.0), (1, -3.0, 1.0),
                                                                          (16, 0.5, 10.0), (7, 100.0, 0.1)]]
    moments = ppo_jax.RunningMoments.start((3,))
    for count, batch in enumerate(batches, start=1):
        moments = moments.update(jnp.asarray(batch, jnp.float32))
        seen = np.concatenate(batches[:count])
        n, prior = len(seen), 1e-4
        total = n + prior
        mean = n * seen.mean(axis=0) / total
        var = (prior * 1.0 + n * seen.var(axis=0) + prior * n / total * seen.mean(axis=0) ** 2) / total
        np.testing.assert_allclose(moments.mean, mean, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(moments.var, var, rtol=1e-4)
        assert float(moments.count) == pytest.approx(total)


def reference_normalizer(obs_batches, final_obs, rewards, dones, gamma):
    """baselines' `VecNormalize` step by step, in numpy with gymnasium's `RunningMeanStd` (CleanRL's): the observations,
    final observations and rewards the agent sees, the statistics at the end, and all it saw before the clip."""
    obs_rms, return_rms = RunningMeanStd(shape=obs_batches[0].shape[1:]), RunningMeanStd(shape=())
    obs_rms.update(obs_batches[0])
    seen = [np.clip((obs_batches[0] - obs_rms.mean) / np.sqrt(obs_rms.var + 1e-8), -10, 10)]
    scaled, finals, unclipped = [], [], []
    discounted = np.zeros(len(rewards[0]))
    for obs, final, reward, done in zip(obs_batches[1:], final_obs, rewards, dones):
        discounted = discounted * gamma + reward
        return_rms.update(discounted)
        unclipped.append(reward / np.sqrt(return_rms.var + 1e-8))
        scaled.append(np.clip(unclipped[-1], -10, 10))
        discounted[done] = 0.0
        obs_rms.update(obs)
        unclipped.append((obs - obs_rms.mean) / np.sqrt(obs_rms.var + 1e-8))
        seen.append(np.clip(unclipped[-1], -10, 10))
        finals.append(np.clip((final - obs_rms.mean) / np.sqrt(obs_rms.var + 1e-8), -10, 10))
    return seen, finals, scaled, obs_rms, return_rms, discounted, np.concatenate([u.ravel() for u in unclipped])


def test_normalizer_against_numpy_over_several_steps():
    # Forty steps of four envs, episodes ending at random, and an outlying observation and reward late
    # in the run, which land beyond 10 standard deviations of all seen before and are clipped.
    rng = np.random.default_rng(1)
    steps = 40
    obs = [rng.normal([0.0, 5.0], [1.0, 3.0], size=(4, 2)) for _ in range(steps + 1)]
    obs[35][1, 0] = 1e3
    rewards = [rng.uniform(-16, 0, size=4) for _ in range(steps)]
    rewards[36][2] = -1e5
    dones = [rng.random(4) < 0.1 for _ in range(steps)]
    gamma = 0.95
    # The last observation of an ended episode, where one ended (elsewhere, gymnax gives the observation again).
    final_obs = [np.where(done[:, None], obs[t + 1] + 1.0, obs[t + 1]) for t, done in enumerate(dones)]
    seen, finals, scaled, obs_rms, return_rms, discounted, unclipped = reference_normalizer(obs, final_obs, rewards,
                                                                                           dones, gamma)
    assert (np.abs(unclipped) > 10).sum() >= 2 and any(done.any() for done in dones)  # the clip binds

    normalizer, first = ppo_jax.Normalizer.start(jnp.asarray(obs[0], jnp.float32))
    np.testing.assert_allclose(first, seen[0], rtol=1e-5, atol=1e-5)
    step = jax.jit(ppo_jax.Normalizer.step, static_argnums=5)
    for t in range(steps):
        normalizer, observed, final, learned = step(normalizer, jnp.asarray(obs[t + 1], jnp.float32),
                                                    jnp.asarray(final_obs[t], jnp.float32),
                                                    jnp.asarray(rewards[t], jnp.float32), jnp.asarray(dones[t]),
                                                    gamma)
        np.testing.assert_allclose(observed, seen[t + 1], rtol=1e-4, atol=1e-5)
        # The last observation of an ended episode: normalised by the same statistics, not counted in them.
        np.testing.assert_allclose(final, finals[t], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(learned, scaled[t], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(normalizer.obs.mean, obs_rms.mean, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(normalizer.obs.var, obs_rms.var, rtol=1e-4)
    np.testing.assert_allclose(normalizer.returns.mean, return_rms.mean, rtol=1e-5)
    np.testing.assert_allclose(normalizer.returns.var, return_rms.var, rtol=1e-4)
    assert float(normalizer.obs.count) == pytest.approx(obs_rms.count)
    np.testing.assert_allclose(normalizer.discounted_returns, discounted, rtol=1e-5)


def test_the_discounted_return_is_reset_after_the_step_that_ends_an_episode():
    # One env, rewards of 1, gamma 0.5, an episode ending at the third step: R = 1, 1.5, 1.75, then 1 again.
    normalizer, _ = ppo_jax.Normalizer.start(jnp.zeros((1, 1)))
    accumulated = []
    for done in [False, False, True, False]:
        normalizer, _, _, _ = normalizer.step(jnp.zeros((1, 1)), jnp.zeros((1, 1)), jnp.ones(1), jnp.array([done]), 0.5)
        accumulated.append(float(normalizer.discounted_returns[0]))
    assert accumulated == [1.0, 1.5, 0.0, 1.0]
    # The running statistics saw 1, 1.5, 1.75 and 1 (the ended episode's return before its reset).
    assert float(normalizer.returns.mean) == pytest.approx(5.25 / (4 + 1e-4), rel=1e-5)


@pytest.fixture(scope="module")
def pendulum():
    """Two Pendulum agents side by side: what they train with, their first state, a compiled chunk of 2
    updates, and the agents after 4 updates."""
    config = ppo_jax.Config(**TINY)
    training = ppo_jax.make_train(config)
    keys = ppo_jax.agent_keys(config)
    first = jax.jit(jax.vmap(training.init))(keys)
    chunk = jax.jit(jax.vmap(lambda runner: training.train_chunk(runner, 2, 2)))
    runners, _ = chunk(chunk(first)[0])
    return config, training, keys, first, chunk, runners


def test_each_agent_keeps_its_own_statistics(pendulum):
    config, training, keys, _, _, runners = pendulum
    normalizer = runners.normalizer
    # 4 envs, the first observations and one more per step of 4 updates of 32 steps; the returns one fewer.
    np.testing.assert_allclose(normalizer.obs.count, [4 * (1 + 4 * 32) + 1e-4] * 2, rtol=1e-6)
    np.testing.assert_allclose(normalizer.returns.count, [4 * 4 * 32 + 1e-4] * 2, rtol=1e-6)
    assert normalizer.obs.mean.shape == (2, 3) and normalizer.discounted_returns.shape == (2, 4)
    assert not np.allclose(normalizer.obs.mean[0], normalizer.obs.mean[1], rtol=1e-3)
    assert not np.isclose(normalizer.returns.var[0], normalizer.returns.var[1], rtol=1e-3)
    # Each agent's statistics are those it has when trained alone.
    alone, _ = jax.jit(training.train)(keys[1])
    for side_by_side, single in zip(jax.tree.leaves(normalizer), jax.tree.leaves(alone.normalizer)):
        np.testing.assert_allclose(side_by_side[1], single, rtol=1e-4, atol=1e-4)


def test_statistics_are_saved_and_a_resumed_run_goes_on_with_them(pendulum):
    # Two updates, a trip through the checkpoint format, two more: the same statistics (and the same
    # run) as four updates straight.
    config, training, keys, first, chunk, runners = pendulum
    halfway, _ = chunk(first)
    state = ppo_jax.checkpoint_state(config, "Pendulum-v1", 2, runners=ppo_jax.storable(halfway))
    stored = flax.serialization.msgpack_restore(flax.serialization.msgpack_serialize(state))
    assert stored["runners"]["normalizer"]["obs"]["mean"].shape == (2, 3)
    np.testing.assert_array_equal(stored["runners"]["normalizer"]["returns"]["var"], halfway.normalizer.returns.var)
    template = jax.eval_shape(lambda keys: ppo_jax.storable(jax.vmap(training.init)(keys)), keys)
    restored = ppo_jax.restore_tree(template, stored["runners"], "memory")
    resumed, _ = chunk(restored._replace(key=jax.random.wrap_key_data(restored.key)))
    for a, b in zip(jax.tree.leaves(ppo_jax.storable(resumed)), jax.tree.leaves(ppo_jax.storable(runners))):
        np.testing.assert_array_equal(a, b)


class NormalizedNetwork(nn.Module):
    """The trained network behind statistics held apart from it, in the collection `statistics`: what the policy must
    see in evaluation."""

    network: nn.Module

    @nn.compact
    def __call__(self, obs):
        mean = self.variable("statistics", "mean", jnp.zeros, obs.shape[-1:]).value
        std = self.variable("statistics", "std", jnp.ones, obs.shape[-1:]).value
        return self.network(jnp.clip((obs - mean) / std, -10, 10))


def test_evaluation_normalises_with_the_statistics_of_the_checkpoint_frozen(pendulum, tmp_path):
    config, training, keys, _, _, runners = pendulum
    state = ppo_jax.checkpoint_state(config, "Pendulum-v1", 4, runners=ppo_jax.storable(runners))
    stored = flax.serialization.msgpack_restore(flax.serialization.msgpack_serialize(state))
    eval_config = ppo_jax.RunConfig(**{**TINY, "eval": str(tmp_path / "checkpoint.msgpack"), "eval_episodes": 3})
    returns = ppo_jax.evaluate_compiled(eval_config, "Pendulum-v1", stored)
    # The same episodes, played by a network that normalises every observation with the checkpoint's
    # statistics as they were: the evaluation read the statistics, and never updated them.
    evaluate = jax.jit(jax.vmap(ppo_jax.make_evaluate(NormalizedNetwork(training.network),
                                                      ppo_jax.BatchedEnv("Pendulum-v1", 3))))
    eval_keys = jax.random.split(jax.random.fold_in(jax.random.key(config.seed), 1), config.num_seeds)
    moments = runners.normalizer.obs
    frozen = {"params": {"network": runners.agent.params["params"]},
              "statistics": {"mean": moments.mean, "std": jax.vmap(ppo_jax.RunningMoments.std)(moments)}}
    np.testing.assert_allclose(returns, evaluate(frozen, None, eval_keys), rtol=1e-4)
    # Without them, the same policies play other episodes.
    raw = {**frozen, "statistics": {"mean": jnp.zeros_like(moments.mean), "std": jnp.ones_like(moments.mean)}}
    assert not np.allclose(returns, evaluate(raw, None, eval_keys), rtol=1e-3)


# CartPole's first three updates (4 envs x 32 steps, 2 minibatches, 2 epochs, key 7) as ppo_jax.py computed them
# before continuous actions were normalised: discrete actions' environments are untouched by it.
CARTPOLE_LOSSES = {
    "policy_loss": [2.0475126802921295e-05, -8.835922926664352e-08, -0.00012171908747404814],
    "value_loss": [32.86283874511719, 20.872615814208984, 19.512630462646484],
    "entropy": [0.693146824836731, 0.6931463479995728, 0.6931390166282654],
    "approx_kl": [7.527414709329605e-07, 5.105976015329361e-07, 5.960464477539062e-07],
    "explained_variance": [0.006583869457244873, -0.0473933219909668, -0.004591464996337891],
}


def short_episodes(env: str, max_steps: int, num_steps: int = 8):
    """One rollout of 4 envs whose episodes are cut at `max_steps`: the config, runner, rollout and episodes."""
    config = ppo_jax.Config(env=env, num_envs=4, num_steps=num_steps)
    training = ppo_jax.make_train(config)
    training.env.params = training.env.params.replace(max_steps_in_episode=max_steps)
    runner = jax.jit(training.init)(jax.random.key(0))
    runner, rollout, episodes = jax.jit(training.collect)(runner)
    return config, runner, rollout, episodes


@pytest.mark.parametrize("env", ["CartPole-v1", "Pendulum-v1"])
def test_next_values_are_the_values_of_the_observation_each_step_led_to(env):
    # Episodes of 5 steps, all truncated at step 5: elsewhere a step's next value is the next step's
    # value; there it is the value of the final observation (normalised, on Pendulum), not that of
    # the next episode's first.
    _, _, rollout, _ = short_episodes(env, max_steps=5)
    done = np.asarray(rollout.terminated | rollout.truncated)[:-1]
    assert rollout.truncated[4].all() and not done[:4].any()
    next_values, following = np.asarray(rollout.next_values[:-1]), np.asarray(rollout.values[1:])
    np.testing.assert_allclose(next_values[~done], following[~done], rtol=1e-5, atol=1e-5)
    assert np.all(np.abs(next_values[done] - following[done]) > 1e-4)


def test_the_normaliser_sees_the_raw_rewards_restarts_at_truncation_and_scales_the_learned_ones():
    # Pendulum's episodes only ever end truncated: its discounted return must restart there. The
    # raw rewards come back from the episodes' returns; the learned ones are scaled and clipped.
    config, runner, rollout, (ended, returns, _) = short_episodes("Pendulum-v1", max_steps=5)
    ended, returns = np.asarray(ended), np.asarray(returns)
    previous = np.vstack([np.zeros((1, 4)), np.where(ended[:-1], 0.0, returns[:-1])])
    raw = returns - previous
    discounted = np.zeros(4)
    for t in range(len(raw)):
        discounted = config.gamma * discounted + raw[t]
        discounted[ended[t]] = 0.0
    np.testing.assert_allclose(runner.normalizer.discounted_returns, discounted, rtol=1e-4, atol=1e-5)
    scaled = np.clip(raw[-1] / float(runner.normalizer.returns.std()), -10, 10)
    np.testing.assert_allclose(rollout.rewards[-1], scaled, rtol=1e-4, atol=1e-5)


def test_discrete_actions_are_learned_from_raw_observations_and_rewards_as_before():
    config = ppo_jax.Config(num_envs=4, num_steps=32, num_minibatches=2, update_epochs=2, total_timesteps=3 * 128)
    training = ppo_jax.make_train(config)
    runner, metrics = jax.jit(training.train)(jax.random.key(7))
    assert runner.normalizer is None
    # Recorded on an AVX-512 CPU, where they agree to the bit. Another CPU's XLA rounds apart: on an AVX2 one
    # the policy loss, a near-cancelling mean of terms near 1, moved by 5e-8. Scaling these rewards would move
    # the value loss (about 30 here) by far more than these tolerances.
    for name, expected in CARTPOLE_LOSSES.items():
        np.testing.assert_allclose(metrics["losses"][name], np.float32(expected), rtol=1e-4, atol=1e-6, err_msg=name)
