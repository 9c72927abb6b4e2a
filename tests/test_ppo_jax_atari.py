"""ppo_jax.py on Atari: the protocol set on ale-py's vector environment (frames as ppo_atari.py's `Game`
makes them), the reset step and the FIRE steps kept out of learning, truncation bootstrapped, the real
score logged, and a short run through the command line that trains, resumes and evaluates."""

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ppo_atari
import ppo_jax
from ppo_jax_runs import environment, read_checkpoint, run, scalars  # noqa: F401 (fixtures)
from videos import assert_plays

BREAKOUT = "ALE/Breakout-v5"


def atari_config(**changes) -> ppo_jax.RunConfig:
    """The Atari preset, with no no-ops (so that games can be compared with `Game`'s and checked by hand)."""
    return ppo_jax.RunConfig(**{**ppo_jax.PRESETS["Atari"], "env": BREAKOUT, "noop_max": 0, **changes})


def play(env: ppo_jax.AtariEnv, actions: np.ndarray, seed: int = 0):
    """Reset `env` and step it with `actions[t]` at step t; every step's outputs, and the state before it."""
    step = jax.jit(env.step)
    obs, state = jax.jit(env.reset)(jax.random.key(seed))
    steps = []
    for t in range(len(actions)):
        before = state
        obs, state, rewards, terminated, truncated, info = step(jax.random.key(0), state, jnp.asarray(actions[t]))
        steps.append(jax.device_get(dict(obs=obs, rewards=rewards, terminated=terminated, truncated=truncated,
                                         info=info, next_step=before.next_step, lives=state.lives)))
    return jax.device_get(obs), steps


def test_the_frames_are_those_of_ppo_atari_game_until_a_life_is_lost():
    # With no no-ops, both start the game alike: FIRE for four frames, the last two max-pooled, grey,
    # shrunk to 84 x 84 by area averaging, and the first frame four times in the stack. Every agent
    # step then repeats its action for four frames, and the stacks agree to the pixel.
    config = atari_config()
    env = ppo_jax.AtariEnv(BREAKOUT, 1, config)
    game = ppo_atari.Game(BREAKOUT, 7, noop_max=0)
    assert env.obs_shape == (4, 84, 84) and env.action_dim == game.n_actions == 4 and env.fire
    rng = np.random.default_rng(0)
    actions = rng.integers(0, 4, (60, 1))
    _, steps = play(env, actions)
    # The first step is the wrapper's FIRE, no transition: its observation is the agent's first.
    assert steps[0]["next_step"][0] == ppo_jax.FIRE and not steps[0]["info"].valid[0]
    np.testing.assert_array_equal(steps[0]["obs"][0], game.reset())
    for t in range(1, 60):
        assert steps[t]["next_step"][0] == ppo_jax.PLAY and steps[t]["info"].valid[0]
        transition = game.step(int(actions[t, 0]))
        if transition.terminated:  # the first lost life: Game serves within the step, we in the next
            assert steps[t]["terminated"][0] and not steps[t]["info"].episode_over[0] and steps[t]["lives"][0] == 4
            fire = steps[t + 1]
            assert fire["next_step"][0] == ppo_jax.FIRE and not fire["info"].valid[0]
            # After the serve the same frame, which starts the next learning episode's stack.
            np.testing.assert_array_equal(fire["obs"][0, -1], game.obs[-1])
            np.testing.assert_array_equal(fire["obs"][0], np.repeat(game.obs[-1:], 4, axis=0))
            break
        np.testing.assert_array_equal(steps[t]["obs"][0], game.obs, err_msg=f"step {t}")
        assert steps[t]["rewards"][0] == transition.reward and not steps[t]["terminated"][0]
    else:
        raise AssertionError("no life was lost in 60 steps")


def test_a_game_without_fire_starts_with_the_agent_and_its_no_ops_vary():
    # Freeway has no FIRE: the agent plays from the first step. With no-ops, games start apart.
    env = ppo_jax.AtariEnv("ALE/Freeway-v5", 4, atari_config(env="ALE/Freeway-v5", noop_max=30))
    assert not env.fire
    obs, state = jax.jit(env.reset)(jax.random.key(1))
    assert (np.asarray(state.next_step) == ppo_jax.PLAY).all()
    frames = np.asarray(state.frame)
    assert (0 <= frames).all() and (frames <= 30).all() and len(set(frames.tolist())) > 1
    assert (np.asarray(obs) == np.asarray(obs)[:, -1:]).all()  # the first frame, four times


def test_lives_game_over_and_the_reset_step_by_hand():
    # A whole game of Breakout with random actions, no no-ops, no frame cap within reach. Each lost
    # life with lives left ends the learning episode and is followed by a FIRE step; the game over
    # (no lives left) ends the logged episode and is followed by the reset step, whose action is
    # ignored and which brings the first frame of a new game with five lives.
    env = ppo_jax.AtariEnv(BREAKOUT, 2, atari_config())
    actions = np.random.default_rng(1).integers(0, 4, (260, 2))
    _, steps = play(env, actions)
    for game in range(2):
        lives = [5] + [int(s["lives"][game]) for s in steps]
        kinds = [int(s["next_step"][game]) for s in steps]
        over = [t for t, s in enumerate(steps) if s["info"].episode_over[game]]
        assert over, "no game ended in 260 steps"
        end = over[0]
        assert lives[end + 1] == 0 and steps[end]["terminated"][game]
        assert kinds[0] == ppo_jax.FIRE
        for t in range(end):
            lost = lives[t + 1] < lives[t]
            assert bool(steps[t]["terminated"][game]) == lost, t
            assert kinds[t + 1] == (ppo_jax.FIRE if lost else ppo_jax.PLAY), t
            assert bool(steps[t]["info"].valid[game]) == (kinds[t] == ppo_jax.PLAY)
        # The reset step: no transition, five lives, the frame count from 0, then the serve.
        reset = steps[end + 1]
        assert kinds[end + 1] == ppo_jax.RESET and not reset["info"].valid[game] and reset["lives"][game] == 5
        assert not reset["terminated"][game] and not reset["truncated"][game] and reset["info"].length[game] == 0
        assert kinds[end + 2] == ppo_jax.FIRE
        assert (reset["obs"][game] == reset["obs"][game, -1:]).all()
        # The logged length of the game is its frames, the serves included: 4 a step, but the last
        # step, which ends at the game over, maybe within its 4 frames.
        frames = sum(int(s["info"].length[game]) for s in steps[:end + 1])
        assert 4 * end < frames <= 4 * (end + 1)
        assert sum(1 for t in range(end + 1) if kinds[t] == ppo_jax.FIRE) == 5  # the start and four lost lives


SHORT_CAP = dict(max_episode_frames=40, num_envs=2, num_steps=24, num_minibatches=2, update_epochs=1,
                 total_timesteps=48)


def test_a_short_frame_cap_truncates_and_the_reset_step_is_no_transition():
    # 40 frames from the reset: the serve (4 frames), then 9 agent steps, the 9th truncated. By hand:
    # steps F P P P P P P P P P(truncated) R F P ... for each game, 11 steps a game.
    training = ppo_jax.make_train(atari_config(**SHORT_CAP))
    runner = jax.jit(training.init)(jax.random.key(0))
    runner, rollout, (ended, returns, lengths) = jax.jit(training.collect)(runner)
    rollout, ended, lengths = jax.device_get((rollout, ended, lengths))
    kinds = "FPPPPPPPPPR" * 3
    for game in range(2):
        assert "".join("P" if v else "-" for v in rollout.valid[:, game]) == "".join(
            "P" if k == "P" else "-" for k in kinds[:24])
        assert np.flatnonzero(rollout.truncated[:, game]).tolist() == [9, 20]
        assert not rollout.terminated[:, game].any()
        assert np.flatnonzero(ended[:, game]).tolist() == [9, 20] and (lengths[[9, 20], game] == 40).all()
    # A truncated game bootstraps from the value of its last observation, which is what the reset
    # step starts from; everywhere the next value is the next step's value.
    np.testing.assert_allclose(rollout.next_values[:-1], rollout.values[1:], rtol=1e-6)
    # The reset step starts from the truncated game's last observation, and brings the next game's first.
    assert not np.array_equal(rollout.obs[10], rollout.obs[11])
    np.testing.assert_array_equal(rollout.obs[11], rollout.obs[11][:, -1:].repeat(4, axis=1))
    advantages, _ = ppo_jax.compute_gae(rollout.rewards, rollout.values, rollout.next_values, rollout.terminated,
                                        rollout.truncated, 0.99, 0.95)
    np.testing.assert_allclose(advantages[9], rollout.rewards[9] + 0.99 * rollout.values[10] - rollout.values[9],
                               rtol=1e-5, atol=1e-6)


def test_the_update_does_not_read_the_steps_that_are_no_transition():
    # Whatever the reset and FIRE steps hold (their observation, action, reward, value), the update
    # comes out the same: they weigh nothing in the loss, the advantages' normalisation and the
    # advantages of real transitions.
    config = atari_config(**SHORT_CAP)
    training = ppo_jax.make_train(config)
    runner = jax.jit(training.init)(jax.random.key(0))
    _, rollout, _ = jax.jit(training.collect)(runner)
    update_agent = jax.jit(ppo_jax.make_update_agent(training.network, ppo_jax.make_optimizer(config), config))
    invalid = ~rollout.valid
    rng = np.random.default_rng(0)
    scrambled = rollout._replace(
        obs=jnp.where(invalid[..., None, None, None], jnp.asarray(rng.integers(0, 255, rollout.obs.shape), jnp.uint8),
                      rollout.obs),
        actions=jnp.where(invalid, 3 - rollout.actions, rollout.actions),
        log_probs=jnp.where(invalid, -5.0, rollout.log_probs),
        rewards=jnp.where(invalid, 7.0, rollout.rewards),
        values=jnp.where(invalid, 3.0, rollout.values))
    assert invalid.sum() == 2 * 5  # F at step 0, R and F at 10 and 11, 21 and 22
    agent, metrics = update_agent(runner.agent, rollout, jax.random.key(1), 1e-3, 0.1)
    other, other_metrics = update_agent(runner.agent, scrambled, jax.random.key(1), 1e-3, 0.1)
    for a, b in zip(jax.tree.leaves(agent.params), jax.tree.leaves(other.params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    for name, value in metrics["losses"].items():
        np.testing.assert_allclose(value, other_metrics["losses"][name], rtol=1e-4, atol=1e-6, err_msg=name)


def test_the_logged_return_is_the_real_score_and_learning_sees_its_sign():
    # Space Invaders scores 5 to 30 points an alien: the logged return is the score of the game,
    # the rewards learned from are the signs of the points.
    config = atari_config(env="ALE/SpaceInvaders-v5", max_episode_frames=600, num_envs=2, num_steps=160,
                          num_minibatches=2, update_epochs=1, total_timesteps=320)
    training = ppo_jax.make_train(config)
    runner = jax.jit(training.init)(jax.random.key(2))
    _, rollout, (ended, returns, lengths) = jax.device_get(jax.jit(training.collect)(runner))
    assert set(np.unique(rollout.rewards).tolist()) <= {-1.0, 0.0, 1.0}
    for game in range(2):
        end = int(np.flatnonzero(ended[:, game])[0])
        clipped = rollout.rewards[:end + 1, game][rollout.valid[:end + 1, game]].sum()
        assert clipped > 0 and returns[end, game] >= 5 * clipped
        assert lengths[end, game] == 600


# Two updates of 4 games x 32 steps; games are cut at 200 frames (49 agent steps after the serve),
# so that some end, by truncation, within the run.
SHORT = ["--env", "Breakout", "--num-envs", 4, "--num-steps", 32, "--num-minibatches", 2, "--update-epochs", 1,
         "--total-timesteps", 256, "--max-episode-frames", 200, "--noop-max", 0, "--checkpoint-every", 1,
         "--seed", 2]


@pytest.fixture(scope="module")
def trained(run, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("runs") / "breakout"
    result = run(*SHORT, "--run-dir", run_dir)
    assert result.returncode == 0, result.stderr
    return run_dir, result


def test_a_short_breakout_run(trained):
    run_dir, result = trained
    logged = scalars(run_dir)
    for tag in ["charts/episodic_return", "charts/episodic_length", "charts/SPS", "charts/learning_rate",
                "charts/clip_range", "losses/policy_loss", "losses/value_loss", "losses/entropy", "losses/approx_kl",
                "losses/clipfrac", "losses/explained_variance"]:
        assert tag in logged, tag
    assert [step for step, _ in logged["losses/policy_loss"]] == [128, 256]
    assert dict(logged["charts/clip_range"])[128] == pytest.approx(0.1)  # the Atari preset
    # Whole games cut at 200 frames, no no-ops: 200 frames each.
    assert [length for _, length in logged["charts/episodic_length"]] == [200.0]
    # Four games so far, one per env, all ended in one step: the mean of the last 100 is theirs, and
    # the progress line shows it.
    assert logged["charts/episodic_return_last_100"] == logged["charts/episodic_return"]
    assert "(mean of last 4 games)" in result.stderr
    checkpoint = read_checkpoint(run_dir / "checkpoint.msgpack")
    assert checkpoint["update"] == 2 and checkpoint["global_step"] == 256 and checkpoint["env_id"] == BREAKOUT
    assert checkpoint["runners"]["agent"]["params"]["params"]["policy"]["kernel"].shape == (1, 512, 4)
    assert checkpoint["runners"]["env_state"] == {}  # the games are not saved
    assert "ALE/Breakout-v5: 1 agent, compiled in" in result.stderr
    assert "step 256/256" in result.stderr


def test_resume_starts_new_games_and_a_foreign_game_is_refused(trained, run, tmp_path):
    run_dir, _ = trained
    result = run("--resume", run_dir / "checkpoint.msgpack", "--total-timesteps", 384, "--run-dir", tmp_path)
    assert result.returncode == 0, result.stderr
    rates = dict(scalars(tmp_path)["charts/learning_rate"])
    assert list(rates) == [384] and rates[384] == pytest.approx(2.5e-4 * (1 - 2 / 3))
    assert f"resumed at step 256 (update 2) from {run_dir / 'checkpoint.msgpack'}" in result.stderr
    first, resumed = (read_checkpoint(path / "checkpoint.msgpack")["runners"] for path in (run_dir, tmp_path))
    assert not np.array_equal(first["agent"]["params"]["params"]["policy"]["kernel"],
                              resumed["agent"]["params"]["params"]["policy"]["kernel"])
    result = run("--eval", run_dir / "checkpoint.msgpack", "--env", "Pong")
    assert result.returncode == 2 and "was trained on breakout, not pong" in result.stderr
    old = read_checkpoint(run_dir / "checkpoint.msgpack")
    del old["runners"]
    (tmp_path / "old.msgpack").write_bytes(flax.serialization.msgpack_serialize(old))
    result = run("--eval", tmp_path / "old.msgpack")
    assert result.returncode == 2 and "has no runners.agent.params" in result.stderr


def test_a_resumed_run_draws_new_games_from_its_update(trained, tmp_path, monkeypatch):
    # Atari's games are not in a checkpoint: a resumed run starts new ones, from keys with its update
    # folded in, so that a run resumed again and again does not open each stretch with the first games.
    config, data = atari_config(num_seeds=1), jax.random.key_data
    np.testing.assert_array_equal(data(ppo_jax.agent_keys(config, 0)), data(ppo_jax.agent_keys(config)))
    assert not np.array_equal(data(ppo_jax.agent_keys(config, 2)), data(ppo_jax.agent_keys(config)))
    asked = []

    class Enough(Exception):
        """Ends the resumed run once it has asked for its keys: the run itself is the test above's."""

    def agent_keys(config, first_update=0):
        asked.append(first_update)
        raise Enough

    monkeypatch.setattr(ppo_jax, "agent_keys", agent_keys)
    with pytest.raises(Enough):
        ppo_jax.main(["--resume", str(trained[0] / "checkpoint.msgpack"), "--total-timesteps", "384",
                      "--run-dir", str(tmp_path)])
    assert asked == [2]


def test_eval_plays_whole_games_and_writes_videos(trained, run, tmp_path):
    run_dir, _ = trained
    result = run("--eval", run_dir / "checkpoint.msgpack", "--eval-episodes", 2, "--capture-video",
                 "--run-dir", tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ALE/Breakout-v5: 2 games, score ") and "±" in result.stdout
    videos = sorted((tmp_path / "videos").glob("*.mp4"))
    assert len(videos) == 2
    # Twice the screen's size; a game cut at 200 frames is 49 agent steps after its serve.
    assert assert_plays(videos[0], 320, 420) >= 49


def test_a_trained_atari_policy_loads_and_acts_on_its_preprocessed_frames(trained):
    run_dir, _ = trained
    act, make_env = ppo_jax.load_policy(run_dir / "checkpoint.msgpack")
    env = make_env(2)
    obs, state = env.reset(jax.random.key(0))
    assert obs.shape == (2, 4, 84, 84) and obs.dtype == jnp.uint8  # the frames as in training
    actions = act(obs, jax.random.key(1))
    assert actions.shape == (2,) and set(np.asarray(actions).tolist()) <= set(range(env.action_dim))
    obs, *_ = env.step(jax.random.key(2), state, actions)
    assert obs.shape == (2, 4, 84, 84)
