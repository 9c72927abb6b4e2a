"""Part 1's rollout, written the way a fast GPU rollout is written: its draw is a categorical's, each step
crosses the device boundary once each way and makes few ATen calls, the update reads the device once,
and a Ctrl-C stops a run's rollout between two steps."""

import signal
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ppo_atari
from ppo_atari_helpers import RandomFrames
from processes import deadline, living

# A small frame cap, so that games are truncated within a rollout and bootstrapped from their final frames.
OPTIONS = dict(sticky_actions=0.0, life_loss=True, noop_max=30, frame_skip=4, max_episode_frames=160)


class RecordedCalls(TorchDispatchMode):
    """The ATen calls made inside the block, by name, in order."""

    def __enter__(self):
        self.calls = []
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append(str(func))
        return func(*args, **(kwargs or {}))


def test_sampling_draws_what_a_categorical_draws():
    # The exponential race written out in `sample_actions` is `Categorical.sample()`, number for
    # number, and its log-probabilities and values are the model's.
    torch.manual_seed(0)
    trainer = ppo_atari.Trainer(ppo_atari.Config(num_envs=2, num_steps=4, num_minibatches=1, total_timesteps=8),
                                RandomFrames(2, 0), torch.device("cpu"))
    obs = torch.randint(0, 256, (6, *ppo_atari.Game.observation_shape), dtype=torch.uint8)
    with torch.inference_mode():
        logits, values = trainer.model(obs)
        policy = torch.distributions.Categorical(logits=logits)
        torch.manual_seed(5)
        expected = torch.stack([policy.sample() for _ in range(50)])
        torch.manual_seed(5)
        chosen = [trainer.sample_actions(obs) for _ in range(50)]
    assert torch.equal(torch.stack([actions for actions, _, _ in chosen]), expected)
    assert len(set(expected.flatten().tolist())) == 4  # every action was drawn somewhere
    for actions, log_probs, chosen_values in chosen:
        assert torch.equal(log_probs, policy.log_prob(actions)) and torch.equal(chosen_values, values)


@pytest.mark.parametrize("kind, precision", [(ppo_atari.Trainer, "fp32"), (ppo_atari.RunTrainer, "fp32"),
                                             (ppo_atari.RunTrainer, "bf16")])
def test_a_step_of_8_games_makes_at_most_30_aten_calls_and_crosses_the_device_boundary_once_each_way(kind, precision):
    # Each ATen call is a kernel launch or more on a GPU, a few microseconds of the host's time each.
    # `benchmarks/throughput.py` writes the same count into its JSON, beside the speed. (Part 1's
    # `Trainer` has no precision of its own: its network is float32.)
    config = ppo_atari.RunConfig(num_envs=8, num_steps=128, num_minibatches=4, total_timesteps=8 * 128 * 4,
                                 precision=precision)
    trainer = kind(config, RandomFrames(8, 0), torch.device("cpu"))
    trainer.collect_rollout()  # the first resets the games
    with RecordedCalls() as recorded:
        trainer.collect_rollout()
    calls = Counter(recorded.calls)
    assert len(recorded.calls) / config.num_steps <= 30, calls
    # Per step, the frames go to the device (`to`) and the actions, log-probabilities and values come
    # back in one copy (`copy_`). Once per rollout, the values after it and those of the truncated
    # games' final frames go there and back (`to`, `cpu` and numpy's view of the result, twice).
    assert calls["aten.to.dtype_layout"] <= config.num_steps + 6, calls
    # In bfloat16, the torso's 4 weights and 4 biases are cast once a rollout (`cast_torso`).
    assert calls["aten.copy_.default"] == config.num_steps + (8 if precision == "bf16" else 0), calls
    assert "aten._to_copy.default" not in calls and "aten._local_scalar_dense.default" not in calls, calls


def test_on_a_cpu_the_frames_are_stored_in_the_networks_layout_as_they_are_played():
    # Channels last, so that the update's minibatches reach the network without a transposition (on
    # CUDA the store keeps the games' layout and the GPU transposes: `test_ppo_atari_cuda.py`).
    config = ppo_atari.RunConfig(num_envs=4, num_steps=8, num_minibatches=1, total_timesteps=32, precision="fp32")
    envs = RandomFrames(4, 0)
    trainer = ppo_atari.RunTrainer(config, envs, torch.device("cpu"))
    played = []

    def step(actions, step=envs.step):
        result = step(actions)
        played.append(result.obs.copy())
        return result

    envs.step = step
    rollout = trainer.collect_rollout()
    assert rollout.obs.flatten(0, 1).is_contiguous(memory_format=torch.channels_last)
    for t in range(1, config.num_steps):
        assert (rollout.obs[t].numpy() == played[t - 1]).all(), f"step {t}"


def test_a_bfloat16_rollout_on_a_cpu_casts_the_weights_once_and_computes_what_autocast_computes():
    # Two rollouts with an update between them, with the torso's weights cast once a rollout and with
    # autocast casting them at every step: the same actions, log-probabilities and values, bit for
    # bit; and after each rollout the model holds its own float32 torso again.
    class CastAtEveryStep(ppo_atari.FastSamplingTrainer):
        def cast_torso(self, torso):
            return torso

    played = []
    for kind in (ppo_atari.FastSamplingTrainer, CastAtEveryStep):
        torch.manual_seed(0)
        trainer = kind(ppo_atari.Config(num_envs=4, num_steps=16, num_minibatches=2, total_timesteps=4 * 16 * 4),
                       RandomFrames(4, 0), torch.device("cpu"), bf16=True)
        torso = trainer.model.torso
        rollouts = []
        for _ in range(2):
            rollout = trainer.collect_rollout()
            rollouts.append([tensor.clone() for tensor in rollout])
            assert trainer.model.torso is torso and all(p.dtype == torch.float32 for p in trainer.model.parameters())
            trainer.update_policy(rollout)
        played.append(rollouts)
    assert all(torch.equal(ours, theirs) for mine, other in zip(*played) for ours, theirs in zip(mine, other))
    # A rollout cut short (a stop requested, a worker that failed) gives the torso back too.
    envs = RandomFrames(4, 0)
    trainer = ppo_atari.FastSamplingTrainer(ppo_atari.Config(num_envs=4, num_steps=16), envs, torch.device("cpu"),
                                            bf16=True)
    torso = trainer.model.torso

    def stopped(actions):
        assert trainer.model.torso is trainer.bf16_torso  # the rollout samples with the cast copy
        raise ppo_atari.Stopped(2)

    envs.step = stopped
    with pytest.raises(ppo_atari.Stopped):
        trainer.collect_rollout()
    assert trainer.model.torso is torso and trainer.model.state_dict()["torso.0.weight"].dtype == torch.float32


def test_a_rollout_samples_on_one_thread_and_the_update_has_them_all(monkeypatch):
    # Spinning threads of the main process would take the cores the workers step their games on.
    trainer = ppo_atari.FastSamplingTrainer(ppo_atari.Config(num_envs=2, num_steps=4, num_minibatches=1,
                                                             total_timesteps=8), RandomFrames(2, 0), torch.device("cpu"))
    threads, seen = torch.get_num_threads(), []
    sample = trainer.sample_actions
    monkeypatch.setattr(trainer, "sample_actions", lambda obs: seen.append(torch.get_num_threads()) or sample(obs))
    torch.set_num_threads(2)
    try:
        trainer.collect_rollout()
        assert seen == [1] * 4 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("bf16", [False, True])
def test_the_update_starts_from_the_log_probabilities_the_rollout_stored(bf16):
    # PPO's ratio is 1 before the update's first step: the network, on the rollout's frames in
    # minibatches, gives back the log-probabilities and values that sampling stored, in bfloat16 too
    # (the rollout samples with a cast copy of the torso, the update under autocast).
    config = ppo_atari.Config(num_envs=8, num_steps=32, num_minibatches=4)
    torch.manual_seed(0)
    trainer = ppo_atari.FastSamplingTrainer(config, RandomFrames(8, 0), torch.device("cpu"), bf16=bf16)
    rollout = trainer.collect_rollout()
    obs, actions = rollout.obs.flatten(0, 1), rollout.actions.flatten()
    with torch.no_grad():
        for start in range(0, config.batch_size, config.minibatch_size):
            part = slice(start, start + config.minibatch_size)
            logits, values = trainer.model(obs[part])
            log_probs = torch.distributions.Categorical(logits=logits).log_prob(actions[part])
            torch.testing.assert_close(log_probs, rollout.log_probs.flatten()[part], rtol=0, atol=1e-6)
            torch.testing.assert_close(values, rollout.values.flatten()[part], rtol=0, atol=1e-5)


def test_the_update_reads_the_device_once_at_its_end():
    # The advantages and the explained variance are computed on the host, before the batch moves
    # to the device; from the first epoch on nothing reads a value back (`.item()`, the non-finite
    # check of each minibatch) until the one read of the update's statistics, at its end.
    config = ppo_atari.Config(num_envs=8, num_steps=16, num_minibatches=4, update_epochs=3, total_timesteps=8 * 16 * 4)
    trainer = ppo_atari.Trainer(config, RandomFrames(8, 0), torch.device("cpu"))
    rollout = trainer.collect_rollout()
    with RecordedCalls() as recorded:
        trainer.update_policy(rollout)
    first_epoch = recorded.calls.index("aten.randperm.default")
    assert "aten._local_scalar_dense.default" in recorded.calls[:first_epoch]  # the explained variance, on the host
    assert "aten._local_scalar_dense.default" not in recorded.calls[first_epoch:]
    assert recorded.calls.count("aten._fused_adam_.default") == config.update_epochs * config.num_minibatches


def test_a_stop_request_ends_a_runs_rollout_between_two_steps(breakout_id):
    # A Ctrl-C during a rollout stops a run's workers (Part 3's `RunWorkers`) before the next step:
    # the unfinished rollout is dropped, and closing the workers leaves no process behind.
    signals = ppo_atari.Signals(announce=False)

    class StoppedAfterTen(ppo_atari.RunWorkers):
        steps = 0

        def step(self, actions):
            played = super().step(actions)
            self.steps += 1
            if self.steps == 10:  # a Ctrl-C while the tenth step is played
                signals.requested = signal.SIGINT
            return played

    config = ppo_atari.RunConfig(env=breakout_id, num_envs=4, num_steps=32, num_minibatches=2, total_timesteps=128)
    with deadline(60):
        workers = StoppedAfterTen(breakout_id, 4, 2, 0, OPTIONS, signals=signals)
        pids = [process.pid for process in workers.processes]
        try:
            trainer = ppo_atari.RunTrainer(config, workers, torch.device("cpu"))
            with pytest.raises(ppo_atari.Stopped) as stopped:
                trainer.collect_rollout()
            assert stopped.value.args == (signal.SIGINT,)
            assert workers.steps == 10 and trainer.global_step == 0
        finally:
            workers.close()
    assert living(pids) == []
