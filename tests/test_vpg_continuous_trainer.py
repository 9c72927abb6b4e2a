"""The networks and the trainer's plumbing in vpg_continuous.py, on scripted envs."""

import copy
import math

import numpy as np
import pytest
import torch

import vpg_continuous as vpg
from vpg_continuous_helpers import ScriptedEnvs, pendulum_checkpoint, saved_and_loaded


def small_config(**overrides) -> vpg.Config:
    return vpg.Config(**{**dict(num_envs=2, num_steps=6, num_minibatches=2, value_epochs=3, total_timesteps=120),
                         **overrides})


def assert_orthogonal(layer: torch.nn.Linear, gain: float) -> None:
    """The rows (or columns, if fewer) of the weight are orthogonal with norm `gain`; the bias is 0."""
    weight = layer.weight.detach()
    gram = weight @ weight.T if weight.shape[0] <= weight.shape[1] else weight.T @ weight
    torch.testing.assert_close(gram, gain ** 2 * torch.eye(gram.shape[0]), atol=1e-5, rtol=1e-4)
    assert torch.count_nonzero(layer.bias) == 0


@pytest.mark.parametrize("state_dependent_std", [False, True])
def test_initialisation(state_dependent_std):
    torch.manual_seed(0)
    policy = vpg.GaussianPolicy(17, 6, state_dependent_std)
    value = vpg.ValueFunction(17)
    for network in (policy, value):
        hidden = [m for m in network.torso if isinstance(m, torch.nn.Linear)]
        assert [(m.in_features, m.out_features) for m in hidden] == [(17, 128), (128, 128)]
        for layer in hidden:
            assert_orthogonal(layer, math.sqrt(2))
    assert_orthogonal(policy.mean, 0.01)
    assert_orthogonal(value.head, 1.0)
    # The first policy: mean actions near 0 and the same spread in every state, either way.
    mean, std = policy(torch.randn(256, 17))
    assert mean.shape == std.shape == (256, 6)
    assert mean.abs().max() < 0.1
    torch.testing.assert_close(std, torch.full_like(std, vpg.INITIAL_STD), atol=0.02, rtol=0)
    assert value(torch.randn(5, 17)).shape == (5,)


def test_a_state_dependent_scale_follows_the_state():
    torch.manual_seed(0)
    policy = vpg.GaussianPolicy(4, 2, state_dependent_std=True)
    with torch.no_grad():
        policy.scale.weight.normal_()
    _, std = policy(torch.randn(8, 4))
    assert std.min() > 1e-3 and std.std(0).min() > 0.01
    with torch.no_grad():  # however far the head pushes it down, the floor keeps sigma, and log pi, finite
        policy.scale.weight.zero_()
        policy.scale.bias.fill_(-200.0)
    mean, std = policy(torch.randn(8, 4))
    torch.testing.assert_close(std, torch.full_like(std, 1e-3))
    assert vpg.gaussian_log_prob(mean, std, mean + 1.0).isfinite().all()
    free = vpg.GaussianPolicy(4, 2, state_dependent_std=False)
    _, std = free(torch.randn(8, 4))
    assert std.std(0).max() == 0


def test_actions_are_stored_unclipped_and_sent_clipped():
    torch.manual_seed(0)
    envs = ScriptedEnvs(num_envs=4, action_low=(-0.1, -2.0), action_high=(0.1, 0.5))
    trainer = vpg.Trainer(small_config(num_envs=4, num_steps=16, total_timesteps=64), envs, torch.device("cpu"))
    rollout = trainer.collect_rollout()
    stored = rollout.actions.numpy().astype(np.float64)
    received = np.stack(envs.received)
    np.testing.assert_allclose(received, np.clip(stored, envs.spaces.action_low, envs.spaces.action_high), rtol=1e-6)
    outside = (stored < envs.spaces.action_low) | (stored > envs.spaces.action_high)
    assert outside[..., 0].mean() > 0.5 and outside[..., 1].any()  # the bounds are tighter than the policy
    # The stored log-probabilities are those of the stored (unclipped) samples.
    with torch.no_grad():
        mean, std = trainer.policy(rollout.obs)
        torch.testing.assert_close(rollout.log_probs, vpg.gaussian_log_prob(mean, std, rollout.actions))


def test_a_truncated_step_bootstraps_from_its_final_observation():
    torch.manual_seed(0)
    envs = ScriptedEnvs(num_envs=2, truncate_at={1: [3]}, terminate_at={0: [5]})
    trainer = vpg.Trainer(small_config(normalize_observations=False), envs, torch.device("cpu"))
    rollout = trainer.collect_rollout()
    with torch.no_grad():
        final_value = trainer.value(torch.full((1, 3), 100.0)).item()
        after_value = trainer.value(torch.full((1, 3), 6.0)).item()
    # The values are of order 1, some maybe near 0; computed in batches of another size, their
    # float32 sums round differently (by about 1e-8 on the CPUs we know), so the tolerance is
    # absolute, relative to that scale rather than to each value.
    close = dict(rel=0, abs=1e-6)
    # Step index 2 (the third step) truncated env 1: its next value is V(final obs), not V of the
    # observation the env returned after it (the start of the next episode).
    assert rollout.next_values[2, 1].item() == pytest.approx(final_value, **close)
    assert rollout.next_values[2, 0].item() == pytest.approx(rollout.values[3, 0].item(), **close)
    assert rollout.next_values[-1, 0].item() == pytest.approx(after_value, **close)
    assert rollout.truncated[2, 1] == 1 and rollout.truncated.sum() == 1
    assert rollout.terminated[4, 0] == 1 and rollout.terminated.sum() == 1
    assert trainer.finished_episodes == [(1, 1.0, 1), (0, 1.0, 1)]
    # Observations are stored as the env returned them before each step.
    assert [rollout.obs[t, 0, 0].item() for t in range(6)] == [0, 1, 2, 3, 4, 5]


def test_the_final_observation_is_normalised_like_the_others():
    torch.manual_seed(0)
    trainer = vpg.Trainer(small_config(), ScriptedEnvs(num_envs=2, truncate_at={1: [3]}), torch.device("cpu"))
    rollout = trainer.collect_rollout()
    # By step 3 the statistics have seen 0, 1, 2 from both envs; 100 is far outside and clipped to 10.
    with torch.no_grad():
        expected = trainer.value(torch.full((1, 3), 10.0)).item()
    assert rollout.next_values[2, 1].item() == pytest.approx(expected, rel=0, abs=1e-6)  # as above


def adam_steps(optimizer: torch.optim.Optimizer, parameters) -> set[int]:
    return {int(optimizer.state[p]["step"]) for p in parameters}


def test_an_update_takes_one_policy_step_and_fits_the_value_in_minibatches():
    torch.manual_seed(0)
    config = small_config(value_epochs=3, num_minibatches=4, num_steps=8)
    trainer = vpg.Trainer(config, ScriptedEnvs(), torch.device("cpu"))
    before = [p.detach().clone() for p in trainer.policy.parameters()]
    stats = trainer.update_policy(trainer.collect_rollout())
    assert adam_steps(trainer.optimizer, trainer.policy.parameters()) == {1}
    assert adam_steps(trainer.optimizer, trainer.value.parameters()) == {1 + 3 * 4}
    assert all(not torch.equal(a, b) for a, b in zip(before, trainer.policy.parameters()))
    assert stats["approx_kl"] > 0 and math.isfinite(stats["value_loss"])
    trainer.update_policy(trainer.collect_rollout())
    assert adam_steps(trainer.optimizer, trainer.policy.parameters()) == {2}


def test_the_logged_explained_variance_is_of_the_rollouts_values_against_its_returns():
    # The rollout's values predict the returns; the other way round the measure divides by the
    # values' variance instead and reads differently on any batch whose two variances differ.
    torch.manual_seed(0)
    config = small_config(num_steps=8)
    trainer = vpg.Trainer(config, ScriptedEnvs(), torch.device("cpu"))
    rollout = trainer.collect_rollout()
    _, returns = vpg.compute_gae(rollout.rewards, rollout.values, rollout.next_values, rollout.terminated,
                                 rollout.truncated, config.gamma, config.gae_lambda)
    values, returns = rollout.values.flatten(), returns.flatten()
    assert values.var().item() != pytest.approx(returns.var().item(), rel=0.1)
    expected = 1 - ((returns - values).var() / returns.var()).item()
    assert trainer.update_policy(rollout)["explained_variance"] == pytest.approx(expected, rel=1e-5)


def test_a_large_value_error_leaves_the_policy_step_unchanged():
    # The same trainer and rollout twice, once with the value network's output shifted by 300 after
    # the rollout, so that the advantages (from the rollout's values) are the same and only the
    # value loss of the policy-gradient step grows. With `clip_each_network` each network's gradient
    # is clipped on its own, so the policy must take the same step (under the default joint clip it
    # does not: the next test).
    policies, value_losses, value_gradients = [], [], []
    for shift in [0.0, 300.0]:
        torch.manual_seed(0)
        trainer = vpg.Trainer(small_config(normalize_rewards=False, clip_each_network=True), ScriptedEnvs(),
                              torch.device("cpu"))
        rollout = trainer.collect_rollout()
        with torch.no_grad():
            trainer.value.head.bias += shift
        norms = []
        trainer.optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: norms.append(
            torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in trainer.value.parameters()]))))
        value_losses.append(trainer.update_policy(rollout)["value_loss"])
        value_gradients.append(norms[0])
        policies.append(trainer.policy.state_dict())
    assert value_losses[1] > 1000 * value_losses[0]
    for name, tensor in policies[0].items():
        torch.testing.assert_close(policies[1][name], tensor, rtol=1e-6, atol=1e-7)
    assert value_gradients[1] == pytest.approx(vpg.Config.max_grad_norm)  # the value's own clip


def test_under_the_joint_clip_a_large_value_error_shrinks_the_policy_step():
    # The same two updates with the default clip, of the policy's and the value's gradients together:
    # the value's large gradient takes most of the norm, and the policy's share shrinks with it.
    gradients, steps = [], []
    for shift in [0.0, 300.0]:
        torch.manual_seed(0)
        trainer = vpg.Trainer(small_config(normalize_rewards=False), ScriptedEnvs(), torch.device("cpu"))
        assert not trainer.config.clip_each_network
        rollout = trainer.collect_rollout()
        with torch.no_grad():
            trainer.value.head.bias += shift
        before = [p.detach().clone() for p in trainer.policy.parameters()]
        norms = []  # the policy's clipped gradient at the one step that moves it (the value's have none)
        trainer.optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: norms.extend(
            [torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in trainer.policy.parameters()]))]
            if trainer.policy.log_std.grad is not None else []))
        trainer.update_policy(rollout)
        assert len(norms) == 1
        gradients.append(norms[0].item())
        steps.append(torch.linalg.vector_norm(torch.cat([(p - b).flatten() for p, b in
                                                         zip(trainer.policy.parameters(), before)])).item())
    # On this rollout: the gradient to about 1/100 of its norm, the step (after Adam) to about 1/4.
    assert gradients[1] < gradients[0] / 50 and steps[1] < steps[0] / 2, (gradients, steps)


def test_update_follows_the_schedule_and_resumes_on_it():
    torch.manual_seed(0)
    config = small_config(learning_rate=1e-3, value_learning_rate=2e-3)  # 10 updates in all
    trainer = vpg.Trainer(config, ScriptedEnvs(), torch.device("cpu"))
    first = trainer.update_policy(trainer.collect_rollout())
    assert first["learning_rate"] == pytest.approx(1e-3) and first["value_learning_rate"] == pytest.approx(2e-3)
    for _ in range(4):
        stats = trainer.update_policy(trainer.collect_rollout())
    assert stats["learning_rate"] == pytest.approx(1e-3 * (1 - 4 / 10))

    resumed = vpg.Trainer(config, ScriptedEnvs(), torch.device("cpu"))
    random_state = torch.get_rng_state()
    saved = saved_and_loaded(vpg.checkpoint_state(trainer, "Scripted", vpg.Ranks()))
    torch.manual_seed(1)  # another state, which the checkpoint's replaces
    vpg.restore_checkpoint(resumed, saved, "(in memory)", vpg.Ranks())
    assert resumed.update == 5 and resumed.global_step == 5 * config.batch_size
    assert torch.equal(torch.get_rng_state(), random_state)  # the draws go on from where the run left them
    for network, original in [(resumed.policy, trainer.policy), (resumed.value, trainer.value)]:
        for name, tensor in original.state_dict().items():
            torch.testing.assert_close(network.state_dict()[name], tensor, rtol=0, atol=0)
    for ours, theirs in zip(resumed.optimizer.state.values(), trainer.optimizer.state.values(), strict=True):
        for name in ("step", "exp_avg", "exp_avg_sq"):  # Adam's moments
            torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=0)
    stats = resumed.update_policy(resumed.collect_rollout())
    assert stats["learning_rate"] == pytest.approx(1e-3 * 0.5)
    assert [group["lr"] for group in resumed.optimizer.param_groups] == pytest.approx([1e-3 * 0.5, 2e-3 * 0.5])
    for _ in range(4):
        stats = resumed.update_policy(resumed.collect_rollout())
    assert stats["learning_rate"] == pytest.approx(1e-3 / 10)  # the last update


def test_a_nan_stops_the_update_and_names_it():
    torch.manual_seed(0)
    trainer = vpg.Trainer(small_config(), ScriptedEnvs(), torch.device("cpu"))
    trainer.update_policy(trainer.collect_rollout())
    rollout = trainer.collect_rollout()
    with torch.no_grad():
        trainer.policy.mean.weight[0, 0] = float("nan")
    networks = {"policy": trainer.policy, "value": trainer.value}
    before = {(name, key): tensor.clone() for name, network in networks.items()
              for key, tensor in network.state_dict().items()}
    with pytest.raises(vpg.NonFiniteError, match="gradient became NaN or infinite in update 2; no step was taken"):
        trainer.update_policy(rollout)
    for (name, key), tensor in before.items():  # no step was taken
        torch.testing.assert_close(networks[name].state_dict()[key], tensor, equal_nan=True, rtol=0, atol=0)


def test_an_infinite_gradient_stops_the_update_too(monkeypatch):
    # One infinite entry in the policy's gradient, with everything else finite: refused as a NaN is.
    compute_gradients = vpg.Trainer.compute_gradients

    def infinite_once(self, loss, parameters):
        compute_gradients(self, loss, parameters)
        if self.policy.log_std.grad is not None:  # the policy's step, the update's first
            self.policy.log_std.grad[0] = math.inf

    monkeypatch.setattr(vpg.Trainer, "compute_gradients", infinite_once)
    trainer = vpg.Trainer(small_config(), ScriptedEnvs(), torch.device("cpu"))
    before = copy.deepcopy(trainer.policy.state_dict())
    with pytest.raises(vpg.NonFiniteError, match="gradient became NaN or infinite in update 1"):
        trainer.update_policy(trainer.collect_rollout())
    for key, tensor in before.items():
        torch.testing.assert_close(trainer.policy.state_dict()[key], tensor, rtol=0, atol=0)


def test_the_policy_step_sees_standardised_advantages_and_the_value_fits_the_returns(monkeypatch):
    # What the update's two halves are given. The policy's loss: the advantages standardised over
    # the batch. Each of the value's minibatch steps: vf_coef x the mean squared error to the GAE
    # returns over its minibatch, the minibatches of an epoch splitting the batch between them (the
    # order of each epoch's shuffle is the test's).
    torch.manual_seed(0)
    config = small_config(value_epochs=2, num_minibatches=3, vf_coef=0.25)
    trainer = vpg.Trainer(config, ScriptedEnvs(truncate_at={1: [3]}), torch.device("cpu"))
    rollout = trainer.collect_rollout()
    advantages, returns = vpg.compute_gae(rollout.rewards, rollout.values, rollout.next_values, rollout.terminated,
                                          rollout.truncated, config.gamma, config.gae_lambda)
    obs, returns = rollout.obs.flatten(0, 1), returns.flatten()
    orders = [torch.randperm(config.batch_size) for _ in range(config.value_epochs)]
    monkeypatch.setattr(torch, "randperm", lambda n, **kwargs: orders[len(seen) // config.num_minibatches])
    given, seen = [], []
    vpg_loss = vpg.vpg_loss
    monkeypatch.setattr(vpg, "vpg_loss", lambda log_probs, old, advantages, *rest: given.append(advantages) or
                        vpg_loss(log_probs, old, advantages, *rest))
    gradient_step = vpg.Trainer.gradient_step

    def value_step(self, loss, networks):
        if networks == [self.value]:
            epoch, k = divmod(len(seen), config.num_minibatches)
            batch = orders[epoch][k * config.minibatch_size:(k + 1) * config.minibatch_size]
            with torch.no_grad():
                expected = 0.25 * (self.value(obs[batch]) - returns[batch]).pow(2).mean()
            seen.append((loss.item(), expected.item()))
        gradient_step(self, loss, networks)

    monkeypatch.setattr(vpg.Trainer, "gradient_step", value_step)
    trainer.update_policy(rollout)
    flat = advantages.flatten()
    torch.testing.assert_close(given[0], (flat - flat.mean()) / flat.std())
    assert len(seen) == config.value_epochs * config.num_minibatches
    for loss, expected in seen:
        assert loss == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("deterministic", [False, True])
def test_evaluation_samples_or_takes_the_mean_action(deterministic, monkeypatch):
    checkpoint = pendulum_checkpoint()
    with torch.no_grad():  # a mean of about 2.5, outside Pendulum's bounds of +-2, whatever the state
        checkpoint["policy"]["mean.bias"].fill_(2.5)
    sent = []
    real_step = vpg.Task.step

    def recording_step(self, action):
        sent.append(float(action[0]))
        return real_step(self, action)

    monkeypatch.setattr(vpg.Task, "step", recording_step)
    config = vpg.RunConfig(env="Pendulum-v1", eval="checkpoint.pt", eval_episodes=2, max_episode_steps=50,
                           eval_deterministic=deterministic)
    vpg.evaluate(config, "Pendulum-v1", checkpoint)
    assert len(sent) == 100 and all(-2.0 <= a <= 2.0 for a in sent)  # clipped to the bounds
    if deterministic:
        assert set(sent) == {2.0}  # the mean, clipped
    else:
        assert 2.0 in sent and min(sent) < 2.0  # samples around the mean, about a quarter inside the bounds
        vpg.evaluate(config, "Pendulum-v1", checkpoint)  # from draws seeded by --seed: played again, the same
        assert sent[100:] == sent[:100]
