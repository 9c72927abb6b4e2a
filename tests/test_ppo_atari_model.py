"""The network and the trainer's plumbing in ppo_atari.py."""

import math
import io

import numpy as np
import pytest
import torch

import ppo_atari


SHAPE = ppo_atari.Game.observation_shape


def test_initialisation_gains():
    model = ppo_atari.make_model(SHAPE, n_actions=6)
    layers = [m for m in model.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))]
    gains = {id(model.policy): 0.01, id(model.value): 1.0}
    assert len(layers) == 6
    for layer in layers:
        gain = gains.get(id(layer), math.sqrt(2))
        weight = layer.weight.detach().flatten(1)
        # An orthogonal matrix times the gain: its rows (or columns, if fewer) are orthogonal with norm `gain`.
        gram = weight @ weight.T if weight.shape[0] <= weight.shape[1] else weight.T @ weight
        torch.testing.assert_close(gram, gain ** 2 * torch.eye(gram.shape[0]), atol=1e-5, rtol=1e-4)
        assert torch.count_nonzero(layer.bias) == 0


def test_the_network_is_sized_by_the_observation_and_saved_under_fixed_names():
    assert ppo_atari.Game.observation_shape == (4, 84, 84)
    # Part 1's network, as checkpoints name its weights (a checkpoint of the code before the
    # network was built by `make_model` loads into it).
    names = {name: tuple(tensor.shape) for name, tensor in ppo_atari.make_model(SHAPE, 6).state_dict().items()}
    assert names == {"torso.0.weight": (32, 4, 8, 8), "torso.0.bias": (32,), "torso.2.weight": (64, 32, 4, 4),
                     "torso.2.bias": (64,), "torso.4.weight": (64, 64, 3, 3), "torso.4.bias": (64,),
                     "torso.7.weight": (512, 3136), "torso.7.bias": (512,), "policy.weight": (6, 512),
                     "policy.bias": (6,), "value.weight": (1, 512), "value.bias": (1,)}
    # Frames of another shape: 3 colour channels of 48 x 48 leave 64 x 2 x 2 features.
    model = ppo_atari.make_model((3, 48, 48), 5)
    logits, values = model(torch.zeros((2, 3, 48, 48), dtype=torch.uint8))
    assert model.torso[7].in_features == 256 and logits.shape == (2, 5) and values.shape == (2,)


def tuned_or_not(precision: str | None, n_actions: int = 4):
    """Part 1's network, or Part 3's tuned copy of it in `precision`."""
    model = ppo_atari.make_model(SHAPE, n_actions)
    return model if precision is None else ppo_atari.TunedActorCritic(model, bf16=precision == "bf16")


@pytest.mark.parametrize("precision", [None, "fp32", "bf16"])
def test_forward_takes_bytes_and_gives_float_heads(precision):
    model = tuned_or_not(precision)
    frames = torch.randint(0, 256, (3, 4, 84, 84), dtype=torch.uint8)
    logits, values = model(frames)
    assert logits.shape == (3, 4) and values.shape == (3,)
    assert logits.dtype == values.dtype == torch.float32
    # The first policy is nearly uniform: gain 0.01 on the policy head.
    probabilities = torch.softmax(logits, -1)
    torch.testing.assert_close(probabilities, torch.full_like(probabilities, 0.25), atol=0.02, rtol=0)


@pytest.mark.parametrize("precision, tolerance", [("fp32", 1e-5), ("bf16", 0.05)])
def test_the_tuned_network_computes_what_the_plain_one_does(precision, tolerance):
    # The hardware choices change the layout and the arithmetic, not the function: the same
    # weights give the same logits and values, to float32 rounding or to bfloat16's 8 bits.
    torch.manual_seed(0)
    plain = ppo_atari.make_model(SHAPE, 4)
    tuned = ppo_atari.TunedActorCritic(ppo_atari.make_model(SHAPE, 4), bf16=precision == "bf16")
    tuned.load_state_dict(plain.state_dict())
    frames = torch.randint(0, 256, (5, *SHAPE), dtype=torch.uint8)
    with torch.no_grad():
        for ours, theirs in zip(tuned(frames), plain(frames)):
            scale = theirs.abs().max()
            torch.testing.assert_close(ours, theirs, rtol=0, atol=tolerance * scale)



@pytest.mark.parametrize("vendor, flags, native", [
    ("AuthenticAMD", "fpu sse avx2 avx512f avx512_bf16", True),  # AMD Zen 4
    ("GenuineIntel", "avx2 avx512f avx512_bf16 amx_bf16 amx_tile", True),  # Xeon, AMX
    ("GenuineIntel", "avx2 avx512f avx512_bf16 avx512_fp16", False),  # Xeon, AVX-512 BF16 without AMX
    ("AuthenticAMD", "fpu sse avx2 fma", False), ("GenuineIntel", "avx2 avx512f avx512bw", False)])
def test_auto_precision_takes_bfloat16_where_the_cpu_trains_faster_in_it(vendor, flags, native):
    # Measured on Breakout (`use_bf16`'s docstring): bfloat16 trains 1.6x faster with AMX, 1.8x with
    # AVX-512 BF16 on an AMD EPYC, and 0.81x to 0.92x with AVX-512 BF16 on an Intel Xeon without
    # AMX; elsewhere float32. Three seeds of each learned alike (the same docstring).
    cpuinfo = f"processor\t: 0\nvendor_id\t: {vendor}\nflags\t\t: {flags}\n"
    assert ppo_atari.cpu_has_fast_bf16(cpuinfo) is native


@pytest.mark.parametrize("fast_bf16", [True, False])
def test_auto_precision_keeps_float32_on_a_gpu_whatever_the_cpu(fast_bf16, monkeypatch):
    monkeypatch.setattr(ppo_atari, "cpu_has_fast_bf16", lambda: fast_bf16)
    assert ppo_atari.use_bf16("auto", torch.device("cpu")) is fast_bf16
    assert not ppo_atari.use_bf16("auto", torch.device("cuda", 0))  # float32, with TF32
    for device in (torch.device("cpu"), torch.device("cuda", 0)):  # as asked, anywhere
        assert ppo_atari.use_bf16("bf16", device) and not ppo_atari.use_bf16("fp32", device)


def test_bytes_are_scaled_to_unit_range():
    model = ppo_atari.make_model(SHAPE, n_actions=4)
    frames = torch.randint(0, 256, (2, 4, 84, 84), dtype=torch.uint8)
    first_conv = model.torso[0]
    expected = first_conv(frames.float() / 255.0)
    seen = {}

    def keep(module, inputs, output):
        seen["out"] = output.clone()  # a copy: the ReLU after the convolution works in place

    first_conv.register_forward_hook(keep)
    model(frames)
    torch.testing.assert_close(seen["out"], expected, atol=1e-5, rtol=1e-5)


class ScriptedEnv:
    """A vector env whose episodes end where the test says, with recognisable frames."""

    def __init__(self, num_envs=2, truncate_at=None, n_actions=3):
        self.num_envs, self.n_actions, self.observation_shape = num_envs, n_actions, SHAPE
        self.t = 0
        self.truncate_at = truncate_at or {}
        self.obs = np.zeros((num_envs, 4, 84, 84), np.uint8)
        self.final_obs = np.zeros_like(self.obs)

    def reset(self):
        self.obs[:] = 0
        return self.obs

    def step(self, actions):
        self.t += 1
        self.obs[:] = self.t  # each step's frames are filled with the step number
        truncated = np.zeros(self.num_envs, bool)
        finished = []
        for env, when in self.truncate_at.items():
            if self.t == when:
                truncated[env] = True
                self.final_obs[env] = 200  # the final frame, unlike any other
                finished.append((env, 0.0, when))
        return ppo_atari.VecStep(self.obs, np.ones(self.num_envs, np.float32), np.zeros(self.num_envs, bool),
                                 truncated, self.final_obs, finished)


def small_config(**overrides):
    return ppo_atari.Config(**{**dict(num_envs=2, num_steps=6, num_minibatches=2, update_epochs=2,
                                      total_timesteps=120), **overrides})


def test_a_truncated_step_bootstraps_from_its_final_observation():
    torch.manual_seed(0)
    env = ScriptedEnv(truncate_at={1: 3})
    trainer = ppo_atari.Trainer(small_config(), env, torch.device("cpu"))
    rollout = trainer.collect_rollout()
    model = trainer.model
    with torch.no_grad():
        final_value = model(torch.full((1, 4, 84, 84), 200, dtype=torch.uint8))[1].item()
        after_value = model(torch.full((1, 4, 84, 84), 6, dtype=torch.uint8))[1].item()
    # The values here are of order 0.1, some near 0; computed in batches of another size and with
    # another number of threads, their float32 sums round differently, by about 1e-8 on the CPUs
    # we know. The tolerance is relative to that scale, not to each value.
    close = dict(rel=0, abs=1e-6)
    # Step index 2 (the third step) truncated game 1: its next value is V(final obs), not V of the
    # observation the env returned (the start of the next game).
    assert rollout.next_values[2, 1].item() == pytest.approx(final_value, **close)
    assert rollout.next_values[2, 0].item() == pytest.approx(rollout.values[3, 0].item(), **close)
    # The last step bootstraps from the observation after the rollout.
    assert rollout.next_values[-1, 0].item() == pytest.approx(after_value, **close)
    assert rollout.truncated[2, 1] == 1 and rollout.truncated.sum() == 1
    assert trainer.finished_games == [(1, 0.0, 3)]
    # Observations are stored as the frames the env returned before each step.
    assert [int(rollout.obs[t, 0, 0, 0, 0]) for t in range(6)] == [0, 1, 2, 3, 4, 5]


def test_update_follows_the_schedule_and_resumes_on_it(breakout_id):
    torch.manual_seed(0)
    config = small_config(learning_rate=1e-3, clip_range=0.2)  # 10 updates in all
    trainer = ppo_atari.Trainer(config, ScriptedEnv(), torch.device("cpu"))
    first = trainer.update_policy(trainer.collect_rollout())
    assert first["learning_rate"] == pytest.approx(1e-3) and first["clip_range"] == pytest.approx(0.2)
    for _ in range(4):
        stats = trainer.update_policy(trainer.collect_rollout())
    assert stats["learning_rate"] == pytest.approx(1e-3 * (1 - 4 / 10))  # the fifth update, halfway less one

    buffer, random_state = io.BytesIO(), torch.get_rng_state()
    torch.save(ppo_atari.checkpoint_state(trainer, breakout_id, ppo_atari.Ranks()), buffer)
    buffer.seek(0)
    resumed = ppo_atari.Trainer(config, ScriptedEnv(), torch.device("cpu"))  # its initialisation draws numbers
    ppo_atari.restore_checkpoint(resumed, torch.load(buffer, weights_only=True), "(in memory)", ppo_atari.Ranks())
    assert resumed.update == 5 and resumed.global_step == 5 * config.batch_size
    assert torch.equal(torch.get_rng_state(), random_state)  # the draws go on from where the run left them
    for name, tensor in trainer.model.state_dict().items():
        torch.testing.assert_close(resumed.model.state_dict()[name], tensor, rtol=0, atol=0)
    for ours, theirs in zip(resumed.optimizer.state.values(), trainer.optimizer.state.values(), strict=True):
        for name in ("step", "exp_avg", "exp_avg_sq"):  # Adam's moments
            torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=0)
    stats = resumed.update_policy(resumed.collect_rollout())
    assert stats["learning_rate"] == pytest.approx(1e-3 * 0.5) and stats["clip_range"] == pytest.approx(0.1)
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * 0.5)
    for _ in range(4):
        stats = resumed.update_policy(resumed.collect_rollout())
    assert stats["learning_rate"] == pytest.approx(1e-3 / 10)  # the last update


class FixedTensorsTrainer(ppo_atari.RunTrainer):
    """Part 1's step on the fixed tensors that Part 2's graphed update reads on CUDA, run eagerly: what
    a replay computes, where there is no GPU to capture."""

    def minibatch_step(self, batch, indices, clip_range):
        return ppo_atari.Trainer.minibatch_step(self, *self.fixed_step(batch, indices, clip_range))


def test_a_checkpoint_of_a_graphed_update_resumes_on_the_cpu(breakout_id):
    # On CUDA the optimizer is made capturable and reads its learning rate from a tensor; saved so,
    # a checkpoint still resumes on a CPU, which sets the rate as a number before each update.
    torch.manual_seed(0)
    config = ppo_atari.RunConfig(**vars(small_config(learning_rate=1e-3)), precision="fp32")
    trainer = FixedTensorsTrainer(config, ScriptedEnv(), torch.device("cpu"))
    trainer.update_policy(trainer.collect_rollout())
    state = ppo_atari.checkpoint_state(trainer, breakout_id, ppo_atari.Ranks())
    group = state["optimizer"]["param_groups"][0]
    assert group["capturable"] and isinstance(group["lr"], torch.Tensor)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    resumed = ppo_atari.RunTrainer(config, ScriptedEnv(), torch.device("cpu"))
    ppo_atari.restore_checkpoint(resumed, torch.load(buffer, weights_only=True), "(in memory)", ppo_atari.Ranks())
    stats = resumed.update_policy(resumed.collect_rollout())
    assert stats["learning_rate"] == pytest.approx(1e-3 * (1 - 1 / 10))
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * (1 - 1 / 10))
    assert all(torch.isfinite(w).all() for w in resumed.model.parameters())


def test_a_nan_stops_the_update_on_the_graph_s_fixed_tensors():
    torch.manual_seed(0)
    config = ppo_atari.RunConfig(**vars(small_config()), precision="fp32")
    a_nan_stops_the_update(FixedTensorsTrainer(config, ScriptedEnv(), torch.device("cpu")))


def test_a_nan_stops_the_update_and_names_it():
    torch.manual_seed(0)
    a_nan_stops_the_update(ppo_atari.Trainer(small_config(), ScriptedEnv(), torch.device("cpu")))


def a_nan_stops_the_update(trainer: ppo_atari.Trainer) -> None:
    """After one good update, a NaN in a weight: the next update raises, naming it, and takes no step."""
    trainer.update_policy(trainer.collect_rollout())
    rollout = trainer.collect_rollout()
    with torch.no_grad():
        trainer.model.value.weight[0, 0] = float("nan")
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with pytest.raises(ppo_atari.NonFiniteError, match="update 2"):
        trainer.update_policy(rollout)
    for name, tensor in trainer.model.state_dict().items():
        torch.testing.assert_close(tensor, before[name], equal_nan=True, rtol=0, atol=0)  # no step was taken


def test_a_nan_in_one_minibatch_refuses_the_rest_of_the_update():
    # A NaN in the first minibatch's gradient only, the later ones finite: the flag it raised stays.
    class OneNaN(ppo_atari.Trainer):
        def compute_gradients(self, loss):
            super().compute_gradients(loss)
            self.calls = getattr(self, "calls", 0) + 1
            if self.calls == 1:
                self.model.value.weight.grad[0, 0] = float("nan")

    torch.manual_seed(0)
    trainer = OneNaN(small_config(), ScriptedEnv(), torch.device("cpu"))
    before = {name: tensor.clone() for name, tensor in trainer.model.state_dict().items()}
    with pytest.raises(ppo_atari.NonFiniteError, match="update 1"):
        trainer.update_policy(trainer.collect_rollout())
    assert trainer.calls == small_config().num_minibatches * small_config().update_epochs
    for name, tensor in trainer.model.state_dict().items():
        torch.testing.assert_close(tensor, before[name], rtol=0, atol=0)


def test_each_minibatch_sees_its_own_standardised_advantages_and_the_rollouts_values(monkeypatch):
    # The advantages are standardised within each minibatch, as CleanRL does; the value loss is
    # clipped around the values the rollout recorded, also in the second epoch, when the network
    # has moved. Adam's epsilon is CleanRL's 1e-5.
    seen = []
    ppo_loss = ppo_atari.ppo_loss
    monkeypatch.setattr(ppo_atari, "ppo_loss", lambda log_probs, old_log_probs, advantages, values, old_values, *rest:
                        seen.append((advantages, old_values)) or
                        ppo_loss(log_probs, old_log_probs, advantages, values, old_values, *rest))
    torch.manual_seed(0)
    config = small_config(num_steps=8, num_minibatches=4, learning_rate=1e-2)
    trainer = ppo_atari.Trainer(config, ScriptedEnv(truncate_at={1: 3}), torch.device("cpu"))
    assert trainer.optimizer.defaults["eps"] == 1e-5
    rollout = trainer.collect_rollout()
    recorded = rollout.values.flatten().sort().values
    trainer.update_policy(rollout)
    assert len(seen) == config.num_minibatches * config.update_epochs
    for advantages, _ in seen:
        assert advantages.numel() == config.minibatch_size
        assert abs(advantages.mean().item()) < 1e-5 and advantages.std().item() == pytest.approx(1.0, abs=1e-4)
    second_epoch = torch.cat([old_values for _, old_values in seen[config.num_minibatches:]])
    torch.testing.assert_close(second_epoch.sort().values, recorded)


def test_the_logged_explained_variance_is_of_the_rollouts_values_against_its_returns():
    # The rollout's values predict the returns; the other way round the measure divides by the
    # values' variance instead and reads differently on any batch whose two variances differ.
    torch.manual_seed(0)
    config = small_config(num_steps=8)
    trainer = ppo_atari.Trainer(config, ScriptedEnv(truncate_at={1: 3}), torch.device("cpu"))
    rollout = trainer.collect_rollout()
    _, returns = ppo_atari.compute_gae(rollout.rewards, rollout.values, rollout.next_values, rollout.terminated,
                                       rollout.truncated, config.gamma, config.gae_lambda)
    values, returns = rollout.values.flatten(), returns.flatten()
    assert values.var().item() != pytest.approx(returns.var().item(), rel=0.1)
    expected = 1 - ((returns - values).var() / returns.var()).item()
    assert trainer.update_policy(rollout)["explained_variance"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("max_grad_norm", [1e9, 1e-3])
def test_each_minibatch_step_starts_from_zero_gradients_and_clips_their_norm(max_grad_norm):
    # The same minibatch twice, at a learning rate of 0: the same gradients, not twice them; and
    # their norm at most `max_grad_norm`.
    torch.manual_seed(0)
    trainer = ppo_atari.Trainer(small_config(learning_rate=0.0, max_grad_norm=max_grad_norm), ScriptedEnv(),
                                torch.device("cpu"))
    rollout = trainer.collect_rollout()
    advantages, returns = ppo_atari.compute_gae(rollout.rewards, rollout.values, rollout.next_values,
                                                rollout.terminated, rollout.truncated, 0.99, 0.95)
    batch = ppo_atari.Batch(*(x.flatten(0, 1) for x in (rollout.obs, rollout.actions, rollout.log_probs,
                                                         rollout.values, advantages, returns)))
    gradients = []
    for _ in range(2):
        trainer.minibatch_step(batch, torch.arange(6), 0.1)
        gradients.append([parameter.grad.clone() for parameter in trainer.model.parameters()])
    for first, second in zip(*gradients):
        torch.testing.assert_close(second, first)
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in gradients[0]]))
    assert norm <= max_grad_norm * (1 + 1e-5) and (max_grad_norm < 1 or norm > 1e-3)


def test_target_kl_stops_the_update_early():
    torch.manual_seed(0)
    config = small_config(learning_rate=0.05, target_kl=1e-6, update_epochs=8)
    trainer = ppo_atari.Trainer(config, ScriptedEnv(), torch.device("cpu"))
    stats = trainer.update_policy(trainer.collect_rollout())
    assert stats["stopped_early"] == 1.0 and stats["epochs"] < 8


def test_target_kl_is_checked_after_each_epoch_as_cleanrl_does():
    # The first minibatch sees the policy that sampled the batch (KL 0); every later one a moved
    # policy, beyond a tiny target. CleanRL finishes the epoch and then stops: one step of Adam per
    # minibatch of the first epoch, and no more. (A check per minibatch would stop after the second
    # of the four.)
    torch.manual_seed(0)
    config = small_config(num_steps=8, num_minibatches=4, learning_rate=0.05, target_kl=1e-6, update_epochs=8)
    trainer = ppo_atari.Trainer(config, ScriptedEnv(), torch.device("cpu"))
    stats = trainer.update_policy(trainer.collect_rollout())
    steps = {int(state["step"]) for state in trainer.optimizer.state.values()}
    assert config.num_minibatches > 1 and steps == {config.num_minibatches}
    assert stats["epochs"] == 1 and stats["stopped_early"] == 1.0


def test_the_trainer_of_a_run_takes_the_update_of_part_one():
    # The choices of Parts 2 and 3 (the network channels-last, one thread while sampling, timers)
    # leave the algorithm as it is: from the same start, the same rollout and update.
    config = ppo_atari.RunConfig(**vars(small_config()), precision="fp32")
    trainers = []
    for kind in (ppo_atari.Trainer, ppo_atari.RunTrainer):
        torch.manual_seed(0)
        trainer = kind(config, ScriptedEnv(truncate_at={1: 3}), torch.device("cpu"))
        rollout = trainer.collect_rollout()
        trainers.append((rollout.actions.clone(), trainer.update_policy(rollout)))
    (plain_actions, ours), (run_actions, theirs) = trainers
    assert torch.equal(run_actions, plain_actions)
    for name in ["loss", "policy_loss", "value_loss", "entropy"]:
        assert ours[name] == pytest.approx(theirs[name], rel=0, abs=1e-5 * max(1.0, abs(theirs[name]))), name
