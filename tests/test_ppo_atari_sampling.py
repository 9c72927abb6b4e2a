"""Double-buffered sampling (Part 2's `DoubleBufferedTrainer`): the rollout of Part 1, bit for bit on
the CPU, from games stepped by halves; and a Ctrl-C still stops it between two steps."""

import signal

import numpy as np
import pytest
import torch

import ppo_atari
from processes import deadline, living

# A small frame cap, so that games are truncated within a rollout and bootstrapped from their final frames.
OPTIONS = dict(sticky_actions=0.0, life_loss=True, noop_max=30, frame_skip=4, max_episode_frames=160)


class CountedWorkers(ppo_atari.Workers):
    """`Workers` that count how they were stepped: all at once, or by halves."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = {"step": 0, "step_async": 0}

    def step(self, actions):
        self.calls["step"] += 1
        return super().step(actions)

    def step_async(self, actions, games):
        self.calls["step_async"] += 1
        return super().step_async(actions, games)


def two_rollouts(trainer) -> list:
    """Two rollouts with an update between them: what each held, as CPU tensors, and the games that ended."""
    played = []
    for _ in range(2):
        rollout = trainer.collect_rollout()
        played.append(([tensor.clone() for tensor in rollout], trainer.next_obs.clone(), list(trainer.finished_games)))
        trainer.update_policy(rollout)
    return played


@pytest.fixture
def one_thread():
    """The network on one thread, as a run samples on a CPU: the threads of a parallel section
    spin after it ends, on the cores the workers need, and would slow the test down many times."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def play(make_trainer, env_id: str, num_envs: int, num_workers: int, double_buffered: bool):
    config = ppo_atari.RunConfig(env=env_id, num_envs=num_envs, num_steps=32, num_minibatches=2, update_epochs=1,
                                 total_timesteps=num_envs * 32 * 4, precision="fp32")
    with CountedWorkers(env_id, num_envs, num_workers, 7, OPTIONS, "fork") as workers:
        torch.manual_seed(1)
        trainer = make_trainer(config, workers, torch.device("cpu"))
        trainer.double_buffered = double_buffered
        return two_rollouts(trainer), dict(workers.calls)


@pytest.mark.parametrize("kind, num_envs, num_workers", [
    ("plain", 8, 2),   # Part 1's trainer against Part 2's: the halves are the workers
    ("plain", 8, 1),   # one worker holds both halves, and answers them in turn
    ("plain", 8, 3),   # the middle worker's games fall in both halves
    ("tuned", 8, 2),   # the trainer of a run (channels-last frames, one thread) with and without double buffering
])
def test_double_buffered_sampling_is_the_serial_rollout_bit_for_bit(breakout_id, kind, num_envs, num_workers,
                                                                     one_thread):
    if not halves_get_the_whole_batchs_bits():
        pytest.skip("on this CPU the network's numbers for half a batch differ in the last bit from the whole batch's")
    if kind == "plain":
        serial_kind, double_kind = ppo_atari.Trainer, ppo_atari.DoubleBufferedTrainer
    else:
        serial_kind = double_kind = ppo_atari.TunedTrainer
    with deadline(240):
        (serial, serial_calls) = play(serial_kind, breakout_id, num_envs, num_workers, double_buffered=False)
        (double, double_calls) = play(double_kind, breakout_id, num_envs, num_workers, double_buffered=True)
    assert serial_calls == {"step": 2 * 32, "step_async": 0}
    assert double_calls == {"step": 0, "step_async": 2 * 2 * 32}
    truncated = 0
    for (ours, our_next_obs, our_games), (theirs, their_next_obs, their_games) in zip(double, serial):
        for name, mine, reference in zip(ppo_atari.Rollout._fields, ours, theirs):
            assert mine.dtype == reference.dtype and torch.equal(mine, reference), name
        assert torch.equal(our_next_obs, their_next_obs)
        assert our_games == their_games
        truncated += int(theirs[ppo_atari.Rollout._fields.index("truncated")].sum())
    assert truncated > 0  # the values bootstrapped from final frames were compared too


def halves_get_the_whole_batchs_bits() -> bool:
    """What the test above rests on: whether the network gives a game the same bits in a batch of 8
    as in one of its two halves of 4. It does on the CPUs we know; a CPU whose kernels block the batch
    otherwise may differ in the last bit, and there the rollouts agree only to rounding."""
    torch.manual_seed(0)
    model = ppo_atari.make_model(ppo_atari.Game.observation_shape, 4)
    obs = torch.randint(0, 256, (8, *ppo_atari.Game.observation_shape), dtype=torch.uint8)
    with torch.inference_mode():
        whole = model(obs)
        halves = [model(obs[:4]), model(obs[4:])]
    return all(torch.equal(whole[index], torch.cat([half[index] for half in halves])) for index in range(2))


def test_choosing_actions_draws_what_a_categorical_draws():
    # The exponential race written out in `choose_actions` is `Categorical.sample()`, number for
    # number, and its log-probabilities and values are the model's.
    torch.manual_seed(0)
    trainer = ppo_atari.DoubleBufferedTrainer(ppo_atari.Config(num_envs=2, num_steps=4, num_minibatches=1,
                                                               total_timesteps=8), FakeGames(2), torch.device("cpu"))
    obs = torch.randint(0, 256, (6, *ppo_atari.Game.observation_shape), dtype=torch.uint8)
    with torch.inference_mode():
        logits, values = trainer.model(obs)
        policy = torch.distributions.Categorical(logits=logits)
        torch.manual_seed(5)
        expected = torch.stack([policy.sample() for _ in range(50)])
        torch.manual_seed(5)
        chosen = [trainer.choose_actions(obs) for _ in range(50)]
    assert torch.equal(torch.stack([actions for actions, _, _ in chosen]), expected)
    assert len(set(expected.flatten().tolist())) == 4  # every action was drawn somewhere
    for actions, log_probs, chosen_values in chosen:
        assert torch.equal(log_probs, policy.log_prob(actions)) and torch.equal(chosen_values, values)


class FakeGames:
    """Games with `step` only: the double-buffered trainer samples from them as Part 1 does."""

    def __init__(self, num_envs):
        self.num_envs, self.n_actions, self.observation_shape = num_envs, 4, ppo_atari.Game.observation_shape
        self.obs = np.zeros((num_envs, *self.observation_shape), np.uint8)
        self.steps = 0

    def reset(self):
        return self.obs

    def step(self, actions):
        self.steps += 1
        self.obs[:] = self.steps
        zeros = np.zeros(self.num_envs, bool)
        return ppo_atari.VecStep(self.obs, np.ones(self.num_envs, np.float32), zeros, zeros, self.obs, [])


def test_games_without_step_async_are_sampled_as_part_one_samples_them():
    torch.manual_seed(0)
    games = FakeGames(2)
    trainer = ppo_atari.DoubleBufferedTrainer(ppo_atari.Config(num_envs=2, num_steps=4, num_minibatches=1,
                                                               total_timesteps=8), games, torch.device("cpu"))
    rollout = trainer.collect_rollout()
    assert games.steps == 4 and [int(rollout.obs[t, 1, 0, 0, 0]) for t in range(4)] == [0, 1, 2, 3]


def test_a_stop_request_ends_double_buffered_sampling_between_two_steps(breakout_id):
    # A Ctrl-C during a rollout stops a run's workers (Part 3's `RunWorkers`) at the next half-step,
    # with the other half's step still under way in its worker; closing the workers then leaves no process behind.
    stop = ppo_atari.StopRequest(announce=False)

    class StoppedAfterTen(ppo_atari.RunWorkers):
        waited = 0

        def step_wait(self, games):
            self.waited += 1
            if self.waited == 10:
                stop.signal = signal.SIGINT
            return super().step_wait(games)

    config = ppo_atari.RunConfig(env=breakout_id, num_envs=4, num_steps=32, num_minibatches=2, total_timesteps=128)
    with deadline(60):
        workers = StoppedAfterTen(breakout_id, 4, 2, 0, OPTIONS, stop=stop)
        pids = [process.pid for process in workers.processes]
        try:
            trainer = ppo_atari.TunedTrainer(config, workers, torch.device("cpu"))
            trainer.double_buffered = True  # on a CPU a run samples in turns (see `TunedTrainer`)
            with pytest.raises(ppo_atari.Stopped) as stopped:
                trainer.collect_rollout()
            assert stopped.value.signal == signal.SIGINT
            assert workers.waited == 10 and trainer.global_step == 0
        finally:
            workers.close()
    assert living(pids) == []
