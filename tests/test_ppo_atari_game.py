"""The `Game` wrapper of ppo_atari.py, checked against a bare emulator stepped by hand."""

import cv2
import gymnasium as gym
import numpy as np
import pytest

import ppo_atari


def bare_ale(env_id: str, seed: int, max_frames: int = 108_000):
    """An emulator in the same state as a `Game` with the same seed, for computing frames another way."""
    env = gym.make(env_id, frameskip=1, repeat_action_probability=0.0, full_action_space=False,
                   max_num_frames_per_episode=max_frames).unwrapped
    env.reset(seed=seed)
    return env.ale


def reference_frame(screens: list[np.ndarray]) -> np.ndarray:
    """Max of a step's last two grey screens (its one, with a frame skip of 1), shrunk with area
    averaging: the DQN preprocessing."""
    pooled = np.max(screens[-2:], axis=0)
    return cv2.resize(pooled, (84, 84), interpolation=cv2.INTER_AREA)


def play_by_hand(ale, action, frames: int = 4) -> list[np.ndarray]:
    screens = []
    for _ in range(frames):
        ale.act(action)
        screens.append(ale.getScreenGrayscale())
    return screens


@pytest.mark.parametrize("frame_skip", [4, 1])
def test_observation_is_max_of_last_two_frames_stacked_newest_last(breakout_id, frame_skip):
    game = ppo_atari.Game(breakout_id, seed=11, noop_max=0, frame_skip=frame_skip)
    ale = bare_ale(breakout_id, seed=11)
    game.reset()
    ale.reset_game()
    # Breakout needs FIRE to start, and the wrapper presses it as one step of `frame_skip` frames.
    first = reference_frame(play_by_hand(ale, game.actions[1], frame_skip))
    expected = np.stack([first] * 4)
    np.testing.assert_array_equal(game.obs, expected)

    rng = np.random.default_rng(0)
    pooling_mattered = lives_lost = False
    for _ in range(480 // frame_skip):  # 480 frames, in which a life is lost
        action = int(rng.integers(game.n_actions))
        previous = game.obs.copy()
        step = game.step(action)
        screens = play_by_hand(ale, game.actions[action], frame_skip)
        if step.terminated and not step.game_over:
            # A lost life: the wrapper serves the next ball (FIRE, one step's frames) within the same step.
            screens = play_by_hand(ale, game.actions[1], frame_skip)
            lives_lost = True
        frame = reference_frame(screens)
        expected = np.concatenate([expected[1:], frame[None]])
        np.testing.assert_array_equal(game.obs, expected)
        # The stack shifts by one: the three older frames are the previous step's three newest.
        np.testing.assert_array_equal(game.obs[:-1], previous[1:])
        pooling_mattered |= not np.array_equal(frame, cv2.resize(screens[-1], (84, 84), interpolation=cv2.INTER_AREA))
        if step.game_over:
            break
    # The moving ball makes the max of two frames differ from the last one alone, so the test
    # above would catch a wrapper that did not pool (or, with one frame a step, one that did).
    assert pooling_mattered == (frame_skip > 1) and lives_lost


def test_with_one_frame_a_step_a_game_without_fire_sees_each_frame_alone():
    # Ms. Pac-Man starts without FIRE, from the frame `reset` grabs; with one frame a step, no
    # screen of an earlier step may linger in the pool (one did: the first frame, in every step).
    env_id = "ALE/MsPacman-v5"
    game = ppo_atari.Game(env_id, seed=3, noop_max=0, frame_skip=1)
    ale = bare_ale(env_id, seed=3)
    game.reset()
    ale.reset_game()
    assert game.fire is None
    rng = np.random.default_rng(0)
    for t in range(300):
        action = int(rng.integers(game.n_actions))
        game.step(action)
        np.testing.assert_array_equal(game.obs[-1], reference_frame(play_by_hand(ale, game.actions[action], 1)),
                                      err_msg=f"step {t}")


def test_obs_dtype_and_shape(breakout_id):
    game = ppo_atari.Game(breakout_id, seed=0)
    obs = game.reset()
    assert obs.dtype == np.uint8 and obs.shape == (4, 84, 84) and obs.flags.c_contiguous


def test_noops_then_fire_after_reset(breakout_id):
    for seed in [1, 2, 3]:
        game = ppo_atari.Game(breakout_id, seed=seed, noop_max=30)
        game.reset()
        noops = np.random.default_rng(seed).integers(1, 31)
        # The no-op frames, then one FIRE step of 4 frames, then play.
        assert game.ale.getEpisodeFrameNumber() == noops + 4
    counts = set()
    for seed in range(8):
        game = ppo_atari.Game(breakout_id, seed=seed)
        game.reset()
        counts.add(game.ale.getEpisodeFrameNumber())
    assert len(counts) > 2  # games start differently


def test_no_fire_in_a_game_without_it():
    freeway = ppo_atari.resolve_env_id("Freeway")
    game = ppo_atari.Game(freeway, seed=5, noop_max=30)
    assert game.fire is None
    game.reset()
    assert game.ale.getEpisodeFrameNumber() == np.random.default_rng(5).integers(1, 31)


def play_until(game, predicate, action=0, limit=20_000):
    for _ in range(limit):
        step = game.step(action)
        if predicate(step):
            return step
    raise AssertionError("never happened")


def test_life_loss_ends_learning_episode_but_not_the_game(breakout_id):
    game = ppo_atari.Game(breakout_id, seed=3, life_loss=True)
    game.reset()
    lives = game.ale.lives()
    score_before, length_before = game.score, game.length
    frames_before = game.ale.getEpisodeFrameNumber()
    previous = game.obs.copy()
    # Standing still (NOOP) misses the ball: the first episode end is a lost life.
    steps = 0
    while True:
        previous = game.obs.copy()
        frames_before = game.ale.getEpisodeFrameNumber()
        step = game.step(0)
        steps += 1
        if step.terminated:
            break
    assert game.ale.lives() == lives - 1
    assert step.terminated and not step.truncated and not step.game_over
    assert step.score >= score_before
    assert step.length == game.ale.getEpisodeFrameNumber() == length_before + 4 * steps + 4  # with the serve
    # The game went on: the stack shifted by one frame instead of restarting, and FIRE served the
    # next ball in the same step (4 frames played, then 4 of FIRE).
    np.testing.assert_array_equal(game.obs[:-1], previous[1:])
    assert game.ale.getEpisodeFrameNumber() - frames_before == 8


def test_without_life_loss_the_agent_serves_for_itself(breakout_id):
    # baselines and CleanRL press FIRE after a lost life only because, with life loss on, a lost
    # life is a reset for them; without it, only the agent can serve the next ball.
    game = ppo_atari.Game(breakout_id, seed=3, life_loss=False)
    game.reset()
    lives = game.ale.lives()
    while True:
        frames_before = game.ale.getEpisodeFrameNumber()
        step = game.step(0)
        if game.ale.lives() < lives:
            break
    assert not step.terminated
    assert game.ale.getEpisodeFrameNumber() - frames_before == 4  # the step's 4 frames, no FIRE after them
    for _ in range(300):  # standing still, no ball comes: no life is lost
        game.step(0)
    assert game.ale.lives() == lives - 1


class ScriptedLives:
    """An emulator whose life counter follows a script, with no game over: the rule for a lost life
    checked apart from any game's quirks."""

    def __init__(self, ale, lives: list[int]):
        self.ale, self.script = ale, iter(lives)

    def lives(self):
        return self.value

    def act(self, action):
        self.value = next(self.script, 0)
        return self.ale.act(action)

    def __getattr__(self, name):
        return getattr(self.ale, name)


def test_a_life_is_lost_only_while_lives_remain(breakout_id):
    # baselines' guard: a counter that drops to 0 before the game ends (Q*bert's did, on older
    # emulators) is no lost life; the game over that follows ends the last episode.
    game = ppo_atari.Game(breakout_id, seed=0, noop_max=0, life_loss=True)
    game.reset()
    game.lives = 2
    # Each step plays 4 frames (8 with a serve); the counter reads 2, then 1, then 0.
    game.ale = ScriptedLives(game.ale, [2] * 4 + [1] * 8 + [0] * 4)
    assert not game.step(0).terminated
    assert game.step(0).terminated           # 2 -> 1: a lost life
    assert not game.step(0).terminated       # 1 -> 0 and no game over: not a lost life


def test_without_life_loss_only_game_over_terminates(breakout_id):
    game = ppo_atari.Game(breakout_id, seed=3, life_loss=False)
    game.reset()
    step = play_until(game, lambda s: s.terminated, action=1)  # FIRE: the agent serves each ball itself
    assert step.game_over and game.ale.lives() == 0


def test_game_over_is_a_termination_with_the_whole_score(breakout_id):
    game = ppo_atari.Game(breakout_id, seed=4, life_loss=True)
    game.reset()
    terminations, points = 0, 0.0
    rng = np.random.default_rng(1)
    while True:
        score = game.score
        step = game.step(int(rng.integers(game.n_actions)))
        points += step.score - score
        terminations += step.terminated
        if step.game_over:
            break
    assert step.terminated and not step.truncated
    assert terminations == 5  # four lost lives and the game over, in Breakout's five lives
    assert step.score == points == game.score and step.length == game.length


def test_reward_is_clipped_and_score_is_real():
    invaders = ppo_atari.resolve_env_id("SpaceInvaders")
    game = ppo_atari.Game(invaders, seed=0)
    game.reset()
    rng = np.random.default_rng(0)
    big = 0
    for _ in range(400):
        score = game.score
        step = game.step(int(rng.integers(game.n_actions)))
        points = step.score - score
        assert step.reward == np.sign(points)
        big += points > 1
        if step.game_over:
            break
    assert big > 0  # invaders are worth 5 to 30 points: clipping changed something


def test_frame_cap_is_a_truncation(breakout_id):
    game = ppo_atari.Game(breakout_id, seed=2, life_loss=False, max_episode_frames=300)
    game.reset()
    step = play_until(game, lambda s: s.game_over, action=1)
    assert step.truncated and not step.terminated
    assert game.ale.getEpisodeFrameNumber() == 300
    game.reset()
    assert game.ale.getEpisodeFrameNumber() < 40  # a new game


def test_same_seed_same_game(breakout_id):
    a, b = ppo_atari.Game(breakout_id, seed=9), ppo_atari.Game(breakout_id, seed=9)
    np.testing.assert_array_equal(a.reset(), b.reset())
    for action in [1, 2, 3, 2, 2, 3, 0, 1] * 10:
        assert a.step(action) == b.step(action)
        np.testing.assert_array_equal(a.obs, b.obs)


def test_sticky_actions_change_play(breakout_id):
    runs = []
    for sticky in [0.0, 0.25]:
        game = ppo_atari.Game(breakout_id, seed=9, sticky_actions=sticky)
        game.reset()
        for action in [2, 3] * 40:
            game.step(action)
        runs.append(game.obs.copy())
    assert not np.array_equal(*runs)


@pytest.mark.parametrize("name, expected", [("Breakout", "ALE/Breakout-v5"), ("breakout", "ALE/Breakout-v5"),
                                            ("BreakoutNoFrameskip-v4", "BreakoutNoFrameskip-v4"),
                                            ("ALE/Pong-v5", "ALE/Pong-v5")])
def test_resolve_env_id(name, expected):
    assert ppo_atari.resolve_env_id(name) == expected


def test_unknown_game_suggests_close_names():
    with pytest.raises(ppo_atari.ConfigError, match="Breakout"):
        ppo_atari.resolve_env_id("Breakot")


def test_full_ids_name_the_game_only():
    assert ppo_atari.game_name("ALE/Breakout-v5") == ppo_atari.game_name("BreakoutNoFrameskip-v4") == "breakout"


def test_a_game_cut_mid_skip_observes_its_last_frame(breakout_id):
    # FIRE (4 frames), ten steps (40 frames), then the cap one frame into the eleventh step: the
    # two screens to pool are not both from this step, so the final frame stands for both.
    cap = 4 + 40 + 1
    game = ppo_atari.Game(breakout_id, seed=6, noop_max=0, life_loss=False, max_episode_frames=cap)
    ale = bare_ale(breakout_id, seed=6, max_frames=cap)
    game.reset()
    ale.reset_game()
    play_by_hand(ale, game.actions[1])
    for _ in range(10):
        assert not game.step(2).game_over
        play_by_hand(ale, game.actions[2])
    step = game.step(2)
    assert step.truncated and step.game_over and step.length == cap  # a game's length is in frames
    last = play_by_hand(ale, game.actions[2], frames=1)[-1]
    np.testing.assert_array_equal(game.obs[-1], cv2.resize(last, (84, 84), interpolation=cv2.INTER_AREA))
