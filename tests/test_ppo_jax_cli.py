"""ppo_jax.py on gymnax environments, through its command line as a user runs it, and its checkpoints."""

import dataclasses
import io
import signal
import subprocess
import sys
import threading
import time
import types

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import ppo_jax
from conftest import ROOT, readme_example
from ppo_jax_runs import SCRIPT, Watched, environment, patched, read_checkpoint, run, scalars  # noqa: F401 (fixtures)
from ppo_jax_runs import note_dispatches
from videos import assert_plays

TAGS = ["charts/episodic_return", "charts/episodic_length", "charts/episodic_return_last_100", "charts/learning_rate", "charts/clip_range",
        "losses/policy_loss", "losses/value_loss", "losses/entropy", "losses/approx_kl", "losses/clipfrac",
        "losses/explained_variance"]


# CartPole with two agents, 16 updates of 4 envs x 64 steps, checkpoints every 8 updates.
SMALL = ["--num-seeds", 2, "--num-steps", 64, "--total-timesteps", 4096, "--checkpoint-every", 8, "--seed", 3]


@pytest.fixture(scope="module")
def trained(run, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("runs") / "cartpole"
    result = run(*SMALL, "--run-dir", run_dir)
    assert result.returncode == 0, result.stderr
    return run_dir, result


def test_training_leaves_events_per_agent_and_their_mean(trained):
    run_dir, result = trained
    mean, agents = scalars(run_dir), [scalars(run_dir / f"agent-{i}") for i in range(2)]
    for logged in [mean, *agents]:
        for tag in TAGS:
            assert tag in logged, tag
        assert [step for step, _ in logged["losses/policy_loss"]] == [256 * (u + 1) for u in range(16)]
    assert "charts/SPS" in mean
    # The run's curve is the mean of the agents' curves.
    for tag in ["losses/value_loss", "charts/learning_rate"]:
        expected = np.mean([[value for _, value in agent[tag]] for agent in agents], axis=0)
        np.testing.assert_allclose([value for _, value in mean[tag]], expected, rtol=1e-5)
    # Episodic returns are CartPole's real returns: one per step survived, so return == length.
    for step, value in agents[0]["charts/episodic_return"]:
        assert value == pytest.approx(dict(agents[0]["charts/episodic_length"])[step])
    events = EventAccumulator(str(run_dir))
    events.Reload()
    assert "hyperparameters/text_summary" in events.Tags()["tensors"]
    assert "step 4,096/4,096 x 2 agents" in result.stderr and "SPS" in result.stderr
    assert "compiled in" in result.stderr


def test_the_run_logs_the_agents_spread_and_every_agent_in_one_file(trained):
    run_dir, _ = trained
    mean, agents = scalars(run_dir), [scalars(run_dir / f"agent-{i}") for i in range(2)]
    # Beside each tag's mean, the smallest and largest agent's value.
    for tag in ["losses/value_loss", "losses/entropy"]:
        values = np.array([[value for _, value in agent[tag]] for agent in agents])
        np.testing.assert_allclose([value for _, value in mean[f"{tag}/min"]], values.min(axis=0), rtol=1e-6)
        np.testing.assert_allclose([value for _, value in mean[f"{tag}/max"]], values.max(axis=0), rtol=1e-6)
    # An episode's tags, over the agents that ended one in that update.
    returns = [dict(agent["charts/episodic_return"]) for agent in agents]
    for step, value in mean["charts/episodic_return/max"]:
        assert value == max(agent[step] for agent in returns if step in agent)
    # Every agent's series, in one file, as the agents' own writers have them.
    series = ppo_jax.read_agent_series(run_dir / ppo_jax.AGENTS_FILE)
    assert series["step"].tolist() == [256 * (u + 1) for u in range(16)]
    assert series["losses/policy_loss"].shape == (16, 2) and series["episodes"].shape == (16, 2)
    for agent in range(2):
        np.testing.assert_allclose(series["losses/policy_loss"][:, agent],
                                   [value for _, value in agents[agent]["losses/policy_loss"]], rtol=1e-6)
        ended = series["episodes"][:, agent] > 0
        np.testing.assert_allclose(series["episodic_return"][ended, agent],
                                   [value for _, value in agents[agent]["charts/episodic_return"]], rtol=1e-6)


def test_an_episodes_tags_are_written_at_the_updates_that_ended_one(tmp_path):
    # Two agents, three updates: agent 0 ends an episode in the second, agent 1 in none. Their writers
    # have the episode's tags there alone; the run's own, over the agents that ended one, there too.
    class Writer:
        def __init__(self):
            self.tags = {}

        def add(self, step, *values):
            for value in values:
                self.tags.setdefault(value.tag, []).append(step)

    ended = np.array([[0, 0], [1, 0], [0, 0]])
    episodic = np.where(ended > 0, 21.0, np.nan)
    metrics = {"episodes": ended, "learning_rate": np.ones((3, 2)), "clip_range": np.ones((3, 2)),
               "losses": {"policy_loss": np.zeros((3, 2))}, "episodic_return": episodic,
               "episodic_length": episodic, "recent_return": np.array([[np.nan, np.nan], [21, np.nan], [21, np.nan]])}
    config = ppo_jax.RunConfig(num_seeds=2, num_envs=2, num_steps=8)
    run = types.SimpleNamespace(config=config, writer=Writer(), writers=[Writer(), Writer()], dir=tmp_path,
                                progress=ppo_jax.Progress(48, 0, 2, "episodes"), signals=ppo_jax.Signals())
    ppo_jax.log_chunk(run, metrics, np.array([1, 0]), 3, 0, 100.0)
    for tag in ["charts/episodic_return", "charts/episodic_length", "charts/episodic_return_last_100"]:
        assert run.writers[0].tags[tag] == [32] and tag not in run.writers[1].tags
        assert run.writer.tags[tag] == run.writer.tags[f"{tag}/min"] == [32]
    assert run.writers[1].tags["losses/policy_loss"] == run.writer.tags["charts/learning_rate"] == [16, 32, 48]


def test_a_record_torn_by_a_crash_is_left_out_and_the_rest_read(trained, tmp_path):
    # Each chunk's record is written in one piece, so a crash tears at most the last: reading stops before it.
    whole = (trained[0] / ppo_jax.AGENTS_FILE).read_bytes()
    stream = io.BytesIO(whole)
    np.load(stream)
    record, torn = whole[:stream.tell()], tmp_path / ppo_jax.AGENTS_FILE  # a chunk's record, and a file to tear
    for cut in (10, len(record) // 2, len(record) - 1):
        torn.write_bytes(whole + record[:cut])
        series, expected = ppo_jax.read_agent_series(torn), ppo_jax.read_agent_series(trained[0] / ppo_jax.AGENTS_FILE)
        assert series.keys() == expected.keys()
        for name, values in expected.items():
            np.testing.assert_array_equal(series[name], values)


def test_a_step_written_again_by_a_resumed_run_is_read_as_last_written(tmp_path):
    # A run stopped after update 3, resumed from its checkpoint of update 2: update 3 is trained and written again.
    def record(steps, losses):
        records = np.rec.fromarrays([np.array(steps), np.array(losses, np.float32)],
                                    dtype=[("step", np.int64), ("losses/policy_loss", np.float32, (2,))])
        buffer = io.BytesIO()
        np.save(buffer, records)
        return buffer.getvalue()

    path = tmp_path / ppo_jax.AGENTS_FILE
    path.write_bytes(record([256, 512, 768], [[1, -1], [2, -2], [3, -3]]) + record([768, 1024], [[30, -30], [40, -40]]))
    series = ppo_jax.read_agent_series(path)
    assert series["step"].tolist() == [256, 512, 768, 1024]
    assert series["losses/policy_loss"].tolist() == [[1, -1], [2, -2], [30, -30], [40, -40]]


def test_only_the_first_agents_get_writers_of_their_own(environment, tmp_path):
    # Three agents, writers for the first only: the work between chunks does not grow with the agents.
    result = subprocess.run(patched("ppo_jax.AGENT_WRITERS = 1") + [*map(str, SMALL), "--num-seeds", "3",
                                                                   "--run-dir", str(tmp_path)],
                            capture_output=True, text=True, timeout=300, cwd=ROOT, env=environment)
    assert result.returncode == 0, result.stderr
    assert sorted(path.name for path in tmp_path.glob("agent-*")) == ["agent-0"]
    series = ppo_jax.read_agent_series(tmp_path / ppo_jax.AGENTS_FILE)
    assert series["losses/value_loss"].shape == (16, 3)
    np.testing.assert_allclose([value for _, value in scalars(tmp_path)["losses/value_loss"]],
                               series["losses/value_loss"].mean(axis=1), rtol=1e-5)


def test_the_next_chunk_is_computing_while_the_last_is_logged(monkeypatch, tmp_path):
    # Each chunk is dispatched before the one before it is handed to the logging thread, and the
    # chunks are logged one at a time, in order: the device works while the host writes.
    events = []
    note_dispatches(monkeypatch, ppo_jax, lambda count: events.append(("dispatch", count)))
    log_chunk = ppo_jax.log_chunk

    def logging(run, metrics, episodes, count, first_update, sps):
        events.append(("log", first_update))
        log_chunk(run, metrics, episodes, count, first_update, sps)
        events.append(("logged", first_update))

    monkeypatch.setattr(ppo_jax, "log_chunk", logging)
    monkeypatch.setattr(ppo_jax, "CHUNK_SECONDS", 0.0)  # chunks of one update each
    assert ppo_jax.main([*map(str, SMALL), "--run-dir", str(tmp_path), "--total-timesteps", "1024"]) == 0
    dispatches = [index for index, event in enumerate(events) if event[0] == "dispatch"]
    assert [events[index] for index in dispatches] == [("dispatch", 1)] * 4
    assert [event for event in events if event[0] != "dispatch"] == [
        (kind, update) for update in range(4) for kind in ("log", "logged")]
    for update in range(3):  # chunk `update + 1` was computing before chunk `update` was logged
        assert dispatches[update + 1] < events.index(("log", update))
    assert ppo_jax.read_agent_series(tmp_path / ppo_jax.AGENTS_FILE)["step"].tolist() == [256, 512, 768, 1024]


def test_the_main_thread_goes_on_while_the_logging_thread_is_a_chunk_behind(monkeypatch, tmp_path):
    # The logging thread may fall a chunk behind: while it writes chunk 0 (say, its checkpoint), the main thread
    # learns that chunks 1 and 2 are done and dispatches chunk 3, so that a slow write does not keep the device
    # waiting. Waited for after every chunk, the write of chunk 0 would hold the dispatch of chunk 3 back.
    dispatched, fourth, waited = [], threading.Event(), []

    def dispatching(count):
        dispatched.append(count)
        if len(dispatched) == 4:
            fourth.set()

    note_dispatches(monkeypatch, ppo_jax, dispatching)
    log_chunk = ppo_jax.log_chunk

    def logging(run, metrics, episodes, count, first_update, sps):
        if first_update == 0:
            waited.append(fourth.wait(timeout=60))
        log_chunk(run, metrics, episodes, count, first_update, sps)

    monkeypatch.setattr(ppo_jax, "log_chunk", logging)
    monkeypatch.setattr(ppo_jax, "CHUNK_SECONDS", 0.0)  # chunks of one update each
    assert ppo_jax.main([*map(str, SMALL), "--run-dir", str(tmp_path), "--total-timesteps", "2048"]) == 0
    assert waited == [True]
    assert ppo_jax.read_agent_series(tmp_path / ppo_jax.AGENTS_FILE)["step"].tolist() == [256 * u for u in range(1, 9)]


def test_a_chunk_that_waited_for_the_host_does_not_shrink_the_next(monkeypatch, tmp_path):
    # The main thread is kept waiting 0.5 s once, as a checkpoint being written keeps it: the chunk it then learns is
    # done looks slower than it ran. Chunks are sized by the fastest one seen, so none shrinks for it; sized by the
    # last one alone, the next would have had a tenth of its updates.
    counts, log_chunk = [], ppo_jax.log_chunk
    note_dispatches(monkeypatch, ppo_jax, counts.append)

    def logging(run, *chunk):
        if len(counts) == 4:
            time.sleep(0.5)
        log_chunk(run, *chunk)

    monkeypatch.setattr(ppo_jax, "log_chunk", logging)
    monkeypatch.setattr(ppo_jax, "CHUNK_SECONDS", 0.05)
    assert ppo_jax.main(["--num-steps", "32", "--total-timesteps", str(200 * 128), "--checkpoint-every", "200",
                         "--run-dir", str(tmp_path)]) == 0
    assert len(counts) > 5 and sum(counts) == 200
    assert counts[1:-1] == sorted(counts[1:-1]), counts  # the last is what was left


def test_a_checkpoint_of_the_former_convolutions_is_refused(trained, tmp_path, capsys, monkeypatch):
    run_dir, _ = trained
    compiled = []  # a resumed run checks the checkpoint before its chunks' program begins to compile (seconds)
    monkeypatch.setattr(ppo_jax, "compile_train_chunk", lambda *args: compiled.append(args))
    checkpoint = read_checkpoint(run_dir / "checkpoint.msgpack")
    # The MinAtar CNN's parameters as the version before nn.Conv named and shaped them.
    checkpoint["runners"]["agent"]["params"]["params"] = {
        "Convolution_0": {"Dense_0": {"kernel": np.zeros((2, 36, 16), np.float32), "bias": np.zeros((2, 16), np.float32)}},
        "Dense_0": {"kernel": np.zeros((2, 1024, 128), np.float32), "bias": np.zeros((2, 128), np.float32)}}
    checkpoint["env_id"] = checkpoint["config"]["env"] = "Breakout-MinAtar"
    old = tmp_path / "old.msgpack"
    old.write_bytes(flax.serialization.msgpack_serialize(checkpoint))
    for flags in [["--eval", str(old)],
                  ["--resume", str(old), "--total-timesteps", "8192", "--run-dir", str(tmp_path / "resumed")]]:
        assert ppo_jax.main(flags) == 2
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and f"checkpoint {old} holds a different network" in error
    assert not compiled


def test_checkpoint_holds_every_agent_and_its_environments(trained):
    run_dir, _ = trained
    checkpoint = read_checkpoint(run_dir / "checkpoint.msgpack")
    assert checkpoint["format"] == "ppo_jax/1" and checkpoint["env_id"] == "CartPole-v1"
    assert checkpoint["update"] == 16 and checkpoint["global_step"] == 4096
    assert checkpoint["config"]["seed"] == 3 and checkpoint["config"]["num_seeds"] == 2
    runners = checkpoint["runners"]
    assert runners["update"].tolist() == [16, 16]
    assert runners["obs"].shape == (2, 4, 4) and runners["key"].shape == (2, 2)  # agents x envs x obs; raw keys
    assert not list(run_dir.glob("*.tmp"))


def test_same_seed_same_run(trained, run, tmp_path):
    run_dir, _ = trained
    result = run(*SMALL, "--run-dir", tmp_path)
    assert result.returncode == 0, result.stderr
    assert "compiled in" in result.stderr
    first, second = scalars(run_dir / "agent-1"), scalars(tmp_path / "agent-1")
    for tag in ["losses/policy_loss", "losses/value_loss", "charts/episodic_return"]:
        assert first[tag] == second[tag], tag


def test_resume_continues_on_schedule(trained, run, tmp_path):
    run_dir, _ = trained
    result = run("--resume", run_dir / "checkpoint.msgpack", "--total-timesteps", 6144, "--run-dir", tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"resumed at step 4,096 (update 16) from {run_dir / 'checkpoint.msgpack'}" in result.stderr
    rates = dict(scalars(tmp_path / "agent-0")["charts/learning_rate"])
    assert sorted(rates) == [256 * (u + 1) for u in range(16, 24)]  # updates 17 to 24 of 24
    series = ppo_jax.read_agent_series(tmp_path / ppo_jax.AGENTS_FILE)
    assert series["step"].tolist() == sorted(rates)
    np.testing.assert_allclose(series["learning_rate"][:, 1], [rates[step] for step in sorted(rates)], rtol=1e-6)
    assert rates[256 * 17] == pytest.approx(2.5e-4 * (1 - 16 / 24))
    assert rates[256 * 24] == pytest.approx(2.5e-4 * (1 - 23 / 24))
    assert dict(scalars(tmp_path)["charts/clip_range"])[256 * 24] == pytest.approx(0.2 * (1 - 23 / 24))
    checkpoint = read_checkpoint(tmp_path / "checkpoint.msgpack")
    assert checkpoint["update"] == 24 and checkpoint["config"]["total_timesteps"] == 6144


@pytest.fixture(scope="module")
def chunks():
    """Two CartPole agents of 32-step rollouts, their first state, and the command line's `train_chunk`
    compiled for chunks of 4 updates on one device."""
    config = ppo_jax.Config(num_seeds=2, num_steps=32, total_timesteps=1024)
    training = ppo_jax.make_train(config)
    keys = ppo_jax.agent_keys(config)
    first = jax.jit(jax.vmap(training.init))(keys)
    mesh = ppo_jax.seed_mesh(config.num_seeds, jax.devices()[:1])
    return config, training, keys, first, ppo_jax.compile_train_chunk(training, 4, first, mesh)


def assert_same_runs(a, b):
    for x, y in zip(jax.tree.leaves(ppo_jax.storable(a)), jax.tree.leaves(ppo_jax.storable(b))):
        np.testing.assert_array_equal(x, y)


def test_a_run_resumed_from_its_checkpoint_is_the_same_run(chunks):
    # Eight updates straight, against four, a trip through the checkpoint format, and four more:
    # environment states, keys, Adam's moments and counters all come back, so the runs agree exactly.
    config, training, keys, first, train_chunk = chunks
    straight, _ = train_chunk(train_chunk(first, 4)[0], 4)
    halfway, _ = train_chunk(first, 4)
    state = ppo_jax.checkpoint_state(config, "CartPole-v1", 4, runners=ppo_jax.storable(halfway))
    stored = flax.serialization.msgpack_restore(flax.serialization.msgpack_serialize(state))
    template = jax.eval_shape(lambda keys: ppo_jax.storable(jax.vmap(training.init)(keys)), keys)
    restored = ppo_jax.restore_tree(template, stored["runners"], "memory")
    resumed, _ = train_chunk(restored._replace(key=jax.random.wrap_key_data(restored.key)), 4)
    assert_same_runs(straight, resumed)


def test_the_last_short_chunk_skips_what_is_past_the_end(chunks):
    # Three updates in a program of four: the fourth is skipped, and changes nothing.
    _, _, _, first, train_chunk = chunks
    after_three, metrics = train_chunk(first, 3)
    assert after_three.update.tolist() == [3, 3] and np.all(metrics["learning_rate"][3] == 0)
    one_by_one = first
    for _ in range(3):
        one_by_one, _ = train_chunk(one_by_one, 1)
    assert_same_runs(after_three, one_by_one)


def test_the_command_line_runs_the_program_of_train(chunks):
    # `train(key)` is the whole run as one chunk; the command line's chunks of it give the same run,
    # the same metrics update by update (here, the whole 8-update run as two chunks of 4).
    config, training, keys, first, train_chunk = chunks
    whole, whole_metrics = jax.jit(jax.vmap(training.train))(keys)
    halfway, first_metrics = train_chunk(first, 4)
    chunked, second_metrics = train_chunk(halfway, 4)
    assert_same_runs(whole, chunked)
    chunked_metrics = jax.tree.map(lambda a, b: np.concatenate([a, b]).T, first_metrics, second_metrics)
    for a, b in zip(jax.tree.leaves(whole_metrics), jax.tree.leaves(chunked_metrics)):
        np.testing.assert_array_equal(a, b)


def test_eval_plays_every_agent(trained, run):
    run_dir, _ = trained
    result = run("--eval", run_dir / "checkpoint.msgpack", "--eval-episodes", 3)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("agent 0: return ") and lines[1].startswith("agent 1: return ")
    assert lines[2].startswith("CartPole-v1: 2 agents x 3 episodes, return ") and "±" in lines[2]


def test_eval_records_the_first_agents_episodes(trained, run, tmp_path):
    run_dir, _ = trained
    result = run("--eval", run_dir / "checkpoint.msgpack", "--eval-episodes", 2, "--capture-video",
                 "--run-dir", tmp_path)
    assert result.returncode == 0, result.stderr
    videos = sorted((tmp_path / "videos").glob("*.mp4"))
    assert [video.name for video in videos] == ["eval-CartPole-v1-episode00.mp4", "eval-CartPole-v1-episode01.mp4"]
    # The episodes whose returns agent 0 reports: CartPole pays 1 a step, and a video shows the
    # first state and every step but the last (gymnax resets within it), one frame per point of return.
    mean_return = float(result.stdout.splitlines()[0].split("return ")[1].split(" ")[0])
    frames = [assert_plays(video, 600, 400) for video in videos]
    assert sum(frames) == round(2 * mean_return) and all(frame_count > 1 for frame_count in frames)


def test_a_minatar_frame_is_its_grid_a_colour_a_cell():
    # MinAtar is drawn as its 10 x 10 grid, 20 pixels a cell: black where no channel is set, else the colour of the
    # highest channel set, a different one for each.
    env = ppo_jax.make_env("Breakout-MinAtar", 1, ppo_jax.Config())
    state = jax.tree.map(lambda value: value[0], env.reset(jax.random.key(0))[1])
    grid = np.asarray(env.env.get_obs(state, env.params))
    frame = ppo_jax.render_gymnax("Breakout-MinAtar", env, state)
    assert frame.shape == (200, 200, 3) and frame.dtype == np.uint8
    cells = frame[::20, ::20]
    assert (frame.reshape(10, 20, 10, 20, 3) == cells[:, None, :, None]).all()
    np.testing.assert_array_equal(cells.any(axis=-1), grid.any(axis=-1))
    highest = np.where(grid.any(axis=-1), grid.shape[-1] - np.argmax(grid[..., ::-1], axis=-1), 0)
    colours = {channel: {tuple(cells[row, column]) for row, column in zip(*np.nonzero(highest == channel))}
               for channel in np.unique(highest)}
    assert len(colours) > 2 and all(len(seen) == 1 for seen in colours.values())
    assert len({seen.pop() for seen in colours.values()}) == len(colours)


def test_training_records_an_episode_of_the_first_agent_at_each_checkpoint(run, tmp_path):
    # 16 updates, a checkpoint every 6 and the last at the end: three videos, each a whole CartPole
    # episode of agent 0's policy as it was then (a frame per step, the first state included, the
    # last step's reset not). The last is the policy the run leaves, though 16 is off the schedule.
    result = run(*SMALL, "--checkpoint-every", 6, "--capture-video", "--run-dir", tmp_path)
    assert result.returncode == 0, result.stderr
    videos = list((tmp_path / "videos").glob("*.mp4"))
    assert {video.name for video in videos} == {f"train-update{update}-CartPole-v1-episode00.mp4" for update in (6, 12, 16)}
    assert all(assert_plays(video, 600, 400) > 1 for video in videos)
    assert "step 4,096/4,096 x 2 agents" in result.stderr


def test_a_truncated_episode_bootstraps_from_its_final_observation():
    # Pendulum never terminates; every episode is cut at 200 steps. In a rollout of 201 steps, step
    # 199 ends each episode: its next value must be V of the 200th state, not of the reset that
    # replaced it, and every other step's next value is the next step's value.
    config = ppo_jax.Config(env="Pendulum-v1", num_envs=2, num_steps=201, num_minibatches=1, total_timesteps=402)
    training = ppo_jax.make_train(config)
    runner = jax.jit(training.init)(jax.random.key(0))
    _, rollout, _ = jax.jit(training.collect)(runner)
    assert rollout.truncated[199].all() and not rollout.truncated[:199].any() and not rollout.terminated.any()
    np.testing.assert_allclose(rollout.next_values[:199], rollout.values[1:200], rtol=1e-5, atol=1e-5)
    # Replay the first episode of each environment without resets: its last observation, and its value.
    env = training.env

    def replay(state, actions):
        def step(state, action):
            _, state, _, _, _ = env.env.step_env(jax.random.key(0), state, jnp.clip(action, env.low, env.high),
                                                   env.params)
            return state, None

        state, _ = jax.lax.scan(step, state, actions)
        return env.env.get_obs(state)

    final_obs = jax.jit(jax.vmap(replay, in_axes=(0, 1)))(runner.env_state, rollout.actions[:200])
    # Seen as the policy sees it: normalised by the statistics as they were after that step, the 200th.
    after_200_steps, _, _ = jax.jit(ppo_jax.make_train(dataclasses.replace(config, num_steps=200)).collect)(runner)
    _, final_values = training.network.apply(runner.agent.params, after_200_steps.normalizer.observe(final_obs))
    np.testing.assert_allclose(rollout.next_values[199], final_values, rtol=1e-5, atol=1e-5)
    assert not np.allclose(rollout.next_values[199], rollout.values[200], atol=1e-3)


def test_gymnax_is_imported_without_the_plotting_libraries_until_they_are_used(environment):
    # gymnax's environment modules import seaborn and matplotlib's pyplot to draw; a run that draws
    # nothing must not load them (seconds of every start), and a module that draws still can.
    code = """import sys, ppo_jax
ppo_jax.BatchedEnv("CartPole-v1", 1)
print(sorted(name for name in ("seaborn", "matplotlib.pyplot", "scipy.stats", "pandas") if name in sys.modules))
from gymnax.environments.misc import pong
print(len(pong.sns.color_palette("cubehelix", 3)), type(sys.modules["seaborn"]).__name__, callable(pong.plt.subplots))
import seaborn, matplotlib.pyplot
print(seaborn is sys.modules["seaborn"], type(seaborn).__name__, type(matplotlib.pyplot).__name__)"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                            env=environment)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["[]", "3 module True", "True module module"]


def test_minatar_trains_and_evaluates(run, tmp_path):
    result = run("--env", "breakout-minatar", "--num-envs", 8, "--num-steps", 32, "--num-minibatches", 2,
                 "--total-timesteps", 512, "--run-dir", tmp_path)
    assert result.returncode == 0, result.stderr
    assert "Breakout-MinAtar: 1 agent, compiled in" in result.stderr
    checkpoint = read_checkpoint(tmp_path / "checkpoint.msgpack")
    # The MinAtar preset, but for the flags given; the small CNN's parameters.
    assert checkpoint["config"]["learning_rate"] == 5e-3 and checkpoint["config"]["num_envs"] == 8
    assert checkpoint["runners"]["obs"].shape == (1, 8, 10, 10, 4)
    assert checkpoint["runners"]["agent"]["params"]["params"]["Conv_0"]["kernel"].shape == (1, 3, 3, 4, 16)
    assert set(TAGS[2:]) <= set(scalars(tmp_path))
    result = run("--eval", tmp_path / "checkpoint.msgpack", "--eval-episodes", 1)  # one, in the singular
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Breakout-MinAtar: 1 episode, return ")


def test_pendulum_trains_a_gaussian_policy_and_evaluates(run, tmp_path):
    result = run("--env", "Pendulum-v1", "--num-envs", 4, "--num-steps", 64, "--num-minibatches", 4,
                 "--update-epochs", 2, "--total-timesteps", 1024, "--run-dir", tmp_path)
    assert result.returncode == 0, result.stderr
    checkpoint = read_checkpoint(tmp_path / "checkpoint.msgpack")
    assert checkpoint["config"]["gamma"] == 0.95  # the continuous-control preset
    assert checkpoint["config"]["clip_value_loss"] is False and checkpoint["config"]["learning_rate"] == 3e-4
    assert checkpoint["runners"]["agent"]["params"]["params"]["log_std"].shape == (1, 1)
    # The statistics of the observations normalised: the first ones and 256 steps' more of 4 envs.
    assert checkpoint["runners"]["normalizer"]["obs"]["count"][0] == pytest.approx(4 * (1 + 256) + 1e-4)
    # A resumed run goes on from them: 256 steps more.
    result = run("--resume", tmp_path / "checkpoint.msgpack", "--total-timesteps", 2048, "--run-dir", tmp_path / "more")
    assert result.returncode == 0, result.stderr
    resumed = read_checkpoint(tmp_path / "more" / "checkpoint.msgpack")["runners"]["normalizer"]
    assert resumed["obs"]["count"][0] == pytest.approx(4 * (1 + 512) + 1e-4)
    assert resumed["returns"]["count"][0] == pytest.approx(4 * 512 + 1e-4)
    result = run("--eval", tmp_path / "checkpoint.msgpack", "--eval-episodes", 2)
    assert result.returncode == 0 and result.stdout.startswith("Pendulum-v1: 2 episodes, return "), result.stderr
    returns = float(result.stdout.split("return ")[1].split(" ")[0])
    assert -2000 < returns < 0  # 200 steps of Pendulum's cost, between -16.3 and 0 each


def one_line_error(result, message):
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and lines[0].startswith("ppo_jax.py: error:"), result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("name, env", [
    ("CartPole-v1", ("CartPole-v1", "classic control")), ("acrobot", ("Acrobot-v1", "classic control")),
    ("MountainCarContinuous", ("MountainCarContinuous-v0", "continuous control")),
    ("breakout-minatar", ("Breakout-MinAtar", "MinAtar")), ("breakout", ("ALE/Breakout-v5", "Atari")),
    ("ALE/Pong-v5", ("ALE/Pong-v5", "Atari")),
])
def test_an_environment_is_named_by_its_id_or_its_name_in_any_case(name, env):
    # As vpg_continuous.py takes HalfCheetah for HalfCheetah-v5, and ppo_atari.py Breakout.
    assert ppo_jax.resolve_env(name) == env


@pytest.mark.parametrize("args, message", [
    (["--env", "CartPol"], "unknown environment 'CartPol'; did you mean CartPole-v1"),
    (["--total-timesteps", "lots"], "invalid integer value: 'lots'"),
    (["--num-minibatches", "3"], "does not split into 3 minibatches"),
])
def test_bad_input_through_the_command_line(run, args, message):
    one_line_error(run(*args, timeout=60), message)


@pytest.mark.parametrize("args, message", [
    (["--env", "Breakot"], "unknown environment 'Breakot'; did you mean Breakout"),
    (["--num-steps", "-5"], "--num-steps must be positive"),
    (["--num-seeds", "0"], "--num-seeds must be positive"),
    (["--gamma", "1.5"], "--gamma must be in [0, 1]"),
    (["--total-timesteps", "100"], "less than one batch"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--device", "tpu"], "invalid choice: 'tpu'"),
    (["--env", "Breakout", "--num-seeds", "4"], "--num-seeds is for gymnax environments: an Atari run's games"),
    (["--eval", "missing.msgpack"], "checkpoint missing.msgpack does not exist"),
    (["--resume", "."], "checkpoint . is not a file"),
    (["--eval", "a.msgpack", "--resume", "b.msgpack"], "cannot be used together"),
    (["--num-steps", "2.5"], "invalid integer value: '2.5'"),  # an integer's flag takes no fraction
    (["--env", "Breakout", "--max-episode-frames", "38"], "--max-episode-frames 38 leaves no room to play after 30 "
                                                           "no-ops and two steps of --frame-skip 4"),
])
def test_bad_input_exits_2_with_one_line(args, message, capsys):
    try:
        status = ppo_jax.main(args)
    except SystemExit as exit:  # argparse's own errors
        status = exit.code
    assert status == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and lines[0].startswith("ppo_jax.py: error:"), lines


def test_damaged_and_foreign_checkpoints_exit_2(trained, tmp_path, capsys):
    run_dir, _ = trained
    checkpoint_path = run_dir / "checkpoint.msgpack"

    def error(*args):
        assert ppo_jax.main([*map(str, args)]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1
        return lines[0]

    assert error("--resume", run_dir).endswith(  # the run's directory, not its checkpoint
        f"checkpoint {run_dir} is not a file; the run's checkpoint in it is {checkpoint_path}")
    damaged = tmp_path / "damaged.msgpack"
    damaged.write_bytes(checkpoint_path.read_bytes()[:5000])
    assert "the file is damaged or not a checkpoint of ppo_jax.py" in error("--eval", damaged)
    not_ours = tmp_path / "weights.msgpack"
    not_ours.write_bytes(flax.serialization.msgpack_serialize({"params": {"w": np.zeros(3)}}))
    assert f"{not_ours} is not a ppo_jax.py checkpoint" in error("--eval", not_ours)
    assert "was trained on CartPole-v1, not Acrobot-v1" in error("--eval", checkpoint_path, "--env", "Acrobot-v1")
    other = read_checkpoint(checkpoint_path)
    other["runners"]["agent"]["params"]["params"]["policy"]["kernel"] = np.zeros((2, 64, 3), np.float32)
    (tmp_path / "other.msgpack").write_bytes(flax.serialization.msgpack_serialize(other))
    assert "holds a different network: ['params']['policy']['kernel'] is (2, 64, 3)" in error(
        "--eval", tmp_path / "other.msgpack")
    assert "keeps its --num-envs (4)" in error("--resume", checkpoint_path, "--num-envs", 8)
    assert "already holds a checkpoint" in error("--run-dir", run_dir)


def test_cuda_without_cuda_exits_2(run, tmp_path):
    if any(device.platform == "gpu" for device in jax.devices()):
        pytest.skip("this machine has a GPU")
    one_line_error(run("--device", "cuda", "--run-dir", tmp_path), "no CUDA device")


def test_trains_on_the_gpu_where_there_is_one(run, tmp_path):
    if not any(device.platform == "gpu" for device in jax.devices()):
        pytest.skip("needs a GPU")
    result = run(*SMALL, "--device", "cuda", "--run-dir", tmp_path)
    assert result.returncode == 0, result.stderr
    assert "devices: 1 × gpu" in result.stderr and "step 4,096/4,096 x 2 agents" in result.stderr
    evaluated = run("--eval", tmp_path / "checkpoint.msgpack", "--eval-episodes", 2, "--device", "cpu")
    assert evaluated.returncode == 0, evaluated.stderr


def test_progress_every_10_seconds_and_ctrl_c_within_seconds_however_long_an_update(environment, tmp_path):
    # Updates of 64 envs x 256 steps, a fraction of a second each on a 2-core CPU, a checkpoint due every
    # 1000 of them: the chunks of the compiled run are sized by time, not by the checkpoints, so the
    # progress line (in a log, at most every 10 s) and Ctrl-C are not kept waiting for minutes. Idle, the
    # first line comes 2-3 s after compiling and the stop takes about 5 s; the limits allow a machine six
    # times slower (a stop took 15.9 s with two other test loads on the same 2 cores), and are still a
    # hundredth of what 1000 updates take.
    watched = Watched([sys.executable, SCRIPT, "--num-envs", "64", "--num-steps", "256", "--total-timesteps", "1e9",
                       "--checkpoint-every", "1000", "--run-dir", str(tmp_path)], environment)
    try:
        compiled = watched.wait_for("compiled in")
        first = watched.wait_for("step ", timeout=60)
        assert first - compiled < 30, watched.stderr
        watched.process.send_signal(signal.SIGINT)
        sent = time.monotonic()
        assert watched.finish() == 130, watched.stderr
        assert time.monotonic() - sent < 30, watched.stderr
    finally:
        watched.process.kill()
    assert "Traceback" not in watched.stderr
    checkpoint = read_checkpoint(tmp_path / "checkpoint.msgpack")
    # Saved where the run stopped, at the end of a chunk, which need not be a multiple of 1000.
    assert checkpoint["update"] > 0 and f"stopped at update {checkpoint['update']};" in watched.stderr
    assert checkpoint["global_step"] == checkpoint["update"] * 64 * 256


def test_a_nan_names_its_update_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch, capsys):
    real_loss = ppo_jax.ppo_loss

    def loss_that_breaks_from_update_3(*args):
        terms = real_loss(*args)
        clip_range = args[7]  # 0.2 * (1 - update / 8): below 0.151 from the third update (index 2) on
        return {**terms, "loss": terms["loss"] * jnp.where(clip_range < 0.151, jnp.nan, 1.0)}  # and its gradient

    monkeypatch.setattr(ppo_jax, "ppo_loss", loss_that_breaks_from_update_3)
    status = ppo_jax.main(["--total-timesteps", "2048", "--num-steps", "64", "--checkpoint-every", "2",
                           "--run-dir", str(tmp_path)])
    assert status == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "diverged at update 3 (agent 0): the loss or the parameters became NaN or infinite; no step was taken from "
        f"there on; the last good checkpoint is {tmp_path / 'checkpoint.msgpack'}")
    assert read_checkpoint(tmp_path / "checkpoint.msgpack")["update"] == 2
    monkeypatch.undo()
    assert ppo_jax.main(["--eval", str(tmp_path / "checkpoint.msgpack"), "--eval-episodes", "2"]) == 0
    assert float(capsys.readouterr().out.split("return ")[1].split(" ")[0]) > 0  # the good checkpoint plays


def test_the_progress_line_counts_the_steps_of_every_agent(capsys):
    progress = ppo_jax.Progress(1000, 0, 4, "episodes")
    progress.started -= 2.0
    progress.show(500, final=True)
    line = capsys.readouterr().err
    assert line.startswith("step 500/1,000 x 4 agents (50.0%) | "), line
    sps = int(line.split(" | ")[1].removesuffix(" SPS").replace(",", ""))
    assert 900 < sps <= 1000, line  # 500 steps of 4 agents in a little over 2 seconds


def test_each_update_reports_the_mean_return_of_the_last_100_episodes():
    # Updates of a CartPole agent, each rollout's episodes read beside it (`collect` of the same
    # runner plays the very rollout that `update` learns from), against a plain list of returns.
    config = ppo_jax.Config(num_envs=16, num_steps=32, total_timesteps=16 * 32 * 12)
    training = ppo_jax.make_train(config)
    collect, update = jax.jit(training.collect), jax.jit(training.update)
    runner = jax.jit(training.init)(jax.random.key(5))
    everything = []
    for _ in range(12):
        _, _, (ended, returns, lengths) = collect(runner)
        runner, metrics = update(runner)
        ended, returns = np.asarray(ended).reshape(-1), np.asarray(returns).reshape(-1)
        everything += list(returns[ended])
        assert int(runner.episodes) == len(everything)
        np.testing.assert_allclose(metrics["recent_return"], np.mean(everything[-100:]), rtol=1e-6)
    assert len(everything) > 100  # the ring has wrapped


def test_the_last_100_episodes_are_logged_and_resume_with_the_run(trained, run, tmp_path):
    run_dir, result = trained
    checkpoint = read_checkpoint(run_dir / "checkpoint.msgpack")
    runners = checkpoint["runners"]
    for agent in range(2):
        logged = scalars(run_dir / f"agent-{agent}")["charts/episodic_return_last_100"]
        count = min(int(runners["episodes"][agent]), 100)
        assert logged[-1][1] == pytest.approx(runners["recent_returns"][agent][:count].mean(), rel=1e-6)
    assert "(mean of last 100 episodes)" in result.stderr
    # A checkpoint written before the ring existed still resumes: its ring starts empty.
    del runners["recent_returns"], runners["episodes"]
    old = tmp_path / "old.msgpack"
    old.write_bytes(flax.serialization.msgpack_serialize(checkpoint))
    result = run("--resume", old, "--total-timesteps", 5120, "--run-dir", tmp_path / "resumed")
    assert result.returncode == 0, result.stderr
    resumed = read_checkpoint(tmp_path / "resumed" / "checkpoint.msgpack")["runners"]
    assert 0 < resumed["episodes"].min() < 100  # the episodes of four updates, counted from 0


def test_gymnax_needs_neither_ale_py_nor_opencv(environment, tmp_path):
    # With ale-py and OpenCV absent (their import raises), CartPole trains and a name that is no
    # gymnax environment says that Atari needs ale-py.
    def without_atari(*args):
        code = ("import runpy, sys\nsys.modules['ale_py'] = sys.modules['cv2'] = None\n"
                f"sys.argv = [{SCRIPT!r}, *{list(map(str, args))!r}]\nrunpy.run_path({SCRIPT!r}, run_name='__main__')")
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                              env=environment)

    result = without_atari(*SMALL, "--run-dir", tmp_path)  # the programs of `trained`, found in the cache
    assert result.returncode == 0, result.stderr
    assert "done: 4,096 steps" in result.stderr and (tmp_path / "checkpoint.msgpack").is_file()
    result = without_atari("--env", "Breakout")
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "unknown environment 'Breakout'" in result.stderr and "Atari games need ale-py" in result.stderr


README_CHECKPOINT = "runs/cartpole/checkpoint.msgpack"


def test_a_trained_policy_loads_and_acts_as_the_readme_shows(trained):
    run_dir, _ = trained
    path = run_dir / "checkpoint.msgpack"
    code = readme_example("ppo_jax")
    assert code.count(README_CHECKPOINT) == 1
    namespace = {"__name__": "readme"}
    exec(compile(code.replace(README_CHECKPOINT, str(path)), "README.md (ppo_jax)", "exec"), namespace)
    assert namespace["obs"].shape == (1, 4) and namespace["step"] == 199
    # Its actions are samples of the chosen agent's trained network, which another's would not all match.
    act, make_env = ppo_jax.load_policy(path, agent=1)
    obs, _ = make_env(1024).reset(jax.random.key(1))
    key, params = jax.random.key(2), read_checkpoint(path)["runners"]["agent"]["params"]
    expected = [jax.random.categorical(key, ppo_jax.MLPActorCritic(2).apply(
        jax.tree.map(lambda value: value[agent], params), obs)[0].logits) for agent in (0, 1)]
    np.testing.assert_array_equal(act(obs, key), expected[1])
    assert not np.array_equal(expected[0], expected[1])
    agents = read_checkpoint(path)["config"]["num_seeds"]
    for agent in (agents, -1):  # JAX clamps an index past the end: it was the last agent's policy
        with pytest.raises(ppo_jax.ConfigError, match=f"holds {agents} agents; there is no agent {agent}$"):
            ppo_jax.load_policy(path, agent=agent)


def test_ctrl_c_while_evaluating_is_one_line_and_exit_130(monkeypatch, capsys):
    # The evaluation has no `Signals`: Python's own Ctrl-C, a KeyboardInterrupt, reaches `main`.
    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(ppo_jax, "parse_config", lambda argv: (ppo_jax.RunConfig(eval="a.msgpack"), {}, "CartPole-v1",
                                                               "gymnax"))
    monkeypatch.setattr(ppo_jax, "evaluate_compiled", interrupted)
    assert ppo_jax.main(["--eval", "a.msgpack"]) == 130
    assert capsys.readouterr().err.strip().splitlines() == ["ppo_jax.py: interrupted"]
