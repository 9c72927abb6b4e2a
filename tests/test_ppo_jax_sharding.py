"""ppo_jax.py with its agents spread over several devices: the same runs as on one device, really spread.

JAX counts its devices once, as it starts, so every test here runs the script in a new process
whose `XLA_FLAGS` make the CPU look like several devices (`--xla_force_host_platform_device_count`).
"""

import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT
from ppo_jax_runs import SCRIPT, environment, read_checkpoint, scalars  # noqa: F401 (fixtures)


def assert_same_to_rounding(actual, expected, scale_tolerance=1e-3):
    """`actual` is `expected` computed with the agents laid out otherwise: integers (keys, counters)
    exactly, floats to rounding relative to the array's scale, `max |actual - expected| <=
    scale_tolerance * max |expected|`.

    Not elementwise: a quantity near zero differs between layouts by much more than float32's
    epsilon of itself (an approximate KL of 2e-4 by 0.5% here, after 8 updates), and by how much
    depends on the CPU. An agent trained on another's data, or metrics laid out the wrong way
    round, miss by the whole scale.
    """
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    if expected.dtype.kind != "f":
        np.testing.assert_array_equal(actual, expected)
        return
    np.testing.assert_array_equal(np.isnan(actual), np.isnan(expected))
    scale = np.nanmax(np.abs(expected), initial=0.0)
    assert np.nanmax(np.abs(actual - expected), initial=0.0) <= scale_tolerance * scale, (actual, expected)


def on_devices(environment: dict, count: int) -> dict:
    """The environment of a process that sees `count` CPU devices (and no GPU, were there one)."""
    flags = f"{environment.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={count}".strip()
    return {**environment, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}


# Run in a process that sees four devices: four agents trained for 4 + 4 updates, once spread over
# the four and once on the first device alone, the spread run also through a checkpoint halfway.
SPREAD = r"""
import json, sys
import flax.serialization, jax, jax.numpy as jnp, numpy as np
import ppo_jax

config = ppo_jax.Config(num_seeds=4, num_steps=32, total_timesteps=1024)
training = ppo_jax.make_train(config)
first = jax.jit(jax.vmap(training.init))(ppo_jax.agent_keys(config))


def train(devices, through_checkpoint=False):
    mesh = ppo_jax.seed_mesh(config.num_seeds, devices)
    runners = jax.device_put(first, ppo_jax.split_over_seeds(mesh))
    train_chunk = ppo_jax.compile_train_chunk(training, 4, runners, mesh)
    runners, metrics = train_chunk(runners, jnp.int32(4))
    if through_checkpoint:
        state = ppo_jax.checkpoint_state(config, "CartPole-v1", 4, runners=ppo_jax.storable(runners))
        stored = flax.serialization.msgpack_restore(flax.serialization.msgpack_serialize(state))
        template = jax.eval_shape(lambda keys: ppo_jax.storable(jax.vmap(training.init)(keys)),
                                  ppo_jax.agent_keys(config))
        restored = ppo_jax.restore_tree(template, stored["runners"], "memory")
        restored = restored._replace(key=jax.random.wrap_key_data(restored.key))
        runners = jax.device_put(restored, ppo_jax.split_over_seeds(mesh))
    runners, more = train_chunk(runners, jnp.int32(4))
    return ppo_jax.storable(runners), jax.tree.map(lambda *chunks: jnp.concatenate(chunks), metrics, more), train_chunk


def shards(array, axis):
    # (device, first agent, agents) of each piece of `array`, cut along its agent axis.
    return sorted((shard.device.id, shard.index[axis].start or 0, shard.data.shape[axis])
                  for shard in array.addressable_shards)


spread, spread_metrics, train_chunk = train(jax.devices())
alone, alone_metrics, _ = train(jax.devices()[:1])
resumed, _, _ = train(jax.devices(), through_checkpoint=True)
np.savez(sys.argv[1], **{f"{name}/{i}": np.asarray(leaf) for name, tree in
                         [("spread", spread), ("spread_metrics", spread_metrics), ("alone", alone),
                          ("alone_metrics", alone_metrics), ("resumed", resumed)]
                         for i, leaf in enumerate(jax.tree.leaves(tree))})
hlo = train_chunk.as_text()
print(json.dumps({
    "devices": len(jax.devices()),
    "mesh_sizes": {n: ppo_jax.seed_mesh(n).size for n in range(1, 9)},
    "lines": {n: ppo_jax.describe_devices(ppo_jax.seed_mesh(n), n) for n in [1, 4, 6, 7]},
    "shards": {"runners": sorted({str(shards(leaf, 0)) for leaf in jax.tree.leaves(spread)}),
               "metrics": sorted({str(shards(leaf, 1)) for leaf in jax.tree.leaves(spread_metrics)})},
    "collectives": [op for op in ["all-reduce", "all-gather", "all-to-all", "reduce-scatter", "collective-permute"]
                    if op in hlo],
}))
"""


@pytest.fixture(scope="module")
def spread(environment, tmp_path_factory):
    arrays = tmp_path_factory.mktemp("spread") / "runs.npz"
    result = subprocess.run([sys.executable, "-c", SPREAD, str(arrays)], capture_output=True, text=True,
                            timeout=300, cwd=ROOT, env={**on_devices(environment, 4), "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr
    with np.load(arrays) as stored:
        runs = {}
        for key in stored.files:
            name, index = key.split("/")
            runs.setdefault(name, {})[int(index)] = stored[key]
    return json.loads(result.stdout), {name: [leaves[i] for i in sorted(leaves)] for name, leaves in runs.items()}


def test_the_agents_use_the_most_devices_they_split_evenly_over(spread):
    facts, _ = spread
    assert facts["devices"] == 4
    assert facts["mesh_sizes"] == {"1": 1, "2": 2, "3": 3, "4": 4, "5": 1, "6": 3, "7": 1, "8": 4}
    assert facts["lines"] == {
        "1": "devices: 1 × cpu (1 agent per device; 3 of the 4 left idle: 1 agent split evenly over no more)",
        "4": "devices: 4 × cpu (1 agent per device)",
        "6": "devices: 3 × cpu (2 agents per device; 1 of the 4 left idle: 6 agents split evenly over no more)",
        "7": "devices: 1 × cpu (7 agents per device; 3 of the 4 left idle: 7 agents split evenly over no more)"}


def test_every_array_of_the_run_is_split_over_the_four_devices_one_agent_each(spread):
    facts, _ = spread
    one_agent_each = str([(device, device, 1) for device in range(4)])
    assert facts["shards"] == {"runners": [one_agent_each], "metrics": [one_agent_each]}
    # The agents share nothing: the compiled program moves no array between devices.
    assert facts["collectives"] == []


def test_four_devices_train_the_agents_one_device_trains(spread):
    # To rounding: a device runs the program on one agent instead of four.
    _, runs = spread
    for name, agent_axis in [("", 0), ("_metrics", 1)]:
        for on_four, on_one in zip(runs[f"spread{name}"], runs[f"alone{name}"]):
            assert_same_to_rounding(on_four, on_one)
        # The comparison has teeth: the same runs with the agents shifted by one fail it.
        varied = [(a, b) for a, b in zip(runs[f"spread{name}"], runs[f"alone{name}"])
                  if a.dtype.kind == "f" and np.ptp(np.nan_to_num(b), axis=agent_axis).max() > 0]
        assert varied
        with pytest.raises(AssertionError):
            for on_four, on_one in varied:
                assert_same_to_rounding(np.roll(on_four, 1, axis=agent_axis), on_one)


def test_spread_runs_resume_from_their_checkpoints_exactly(spread):
    _, runs = spread
    for straight, resumed in zip(runs["spread"], runs["resumed"]):
        np.testing.assert_array_equal(straight, resumed)


# Through the command line: two CartPole agents, 8 updates of 4 envs x 64 steps, on one device and on two.
SMALL = ["--num-seeds", 2, "--num-steps", 64, "--total-timesteps", 2048, "--checkpoint-every", 4, "--seed", 5]


@pytest.fixture(scope="module")
def run_on(environment):
    """`run_on(devices, *args)`: `python ppo_jax.py ARGS` in a process that sees `devices` CPU devices."""

    def run_on(devices, *args):
        return subprocess.run([sys.executable, SCRIPT, *map(str, args)], capture_output=True, text=True,
                              timeout=300, cwd=ROOT, env=on_devices(environment, devices))

    return run_on


@pytest.fixture(scope="module")
def trained(run_on, tmp_path_factory):
    """The run directories of SMALL on one device and on two."""
    run_dirs = {}
    for devices in [1, 2]:
        run_dirs[devices] = tmp_path_factory.mktemp("runs") / f"on-{devices}"
        result = run_on(devices, *SMALL, "--run-dir", run_dirs[devices])
        assert result.returncode == 0, result.stderr
        per_device = "2 agents" if devices == 1 else "1 agent"
        assert f"devices: {devices} × cpu ({per_device} per device)\n" in result.stderr
    return run_dirs


def test_the_command_line_on_two_devices_trains_as_on_one(trained):
    one, two = (read_checkpoint(trained[devices] / "checkpoint.msgpack") for devices in [1, 2])
    assert two["update"] == one["update"] == 8
    assert two["runners"]["update"].tolist() == [8, 8]
    flat = [(np.asarray(a), np.asarray(b)) for a, b in zip(leaves(one["runners"]), leaves(two["runners"]))]
    assert len(flat) > 10
    for on_one, on_two in flat:
        assert_same_to_rounding(on_two, on_one)
    for agent in [0, 1]:
        logged = [scalars(trained[devices] / f"agent-{agent}") for devices in [1, 2]]
        for tag in ["losses/policy_loss", "losses/value_loss", "losses/approx_kl", "charts/episodic_return"]:
            (steps_one, values_one), (steps_two, values_two) = (zip(*curves[tag]) for curves in logged)
            assert steps_one == steps_two
            assert_same_to_rounding(np.array(values_two), np.array(values_one))


def test_a_checkpoint_of_two_devices_resumes_on_one_and_evaluates_on_either(trained, run_on, tmp_path):
    checkpoint = trained[2] / "checkpoint.msgpack"
    result = run_on(1, "--resume", checkpoint, "--total-timesteps", 3072, "--run-dir", tmp_path)
    assert result.returncode == 0, result.stderr
    assert read_checkpoint(tmp_path / "checkpoint.msgpack")["runners"]["update"].tolist() == [12, 12]
    evaluations = [run_on(devices, "--eval", checkpoint, "--eval-episodes", 3) for devices in [1, 2]]
    for result in evaluations:
        assert result.returncode == 0, result.stderr
    lines = evaluations[1].stdout.strip().splitlines()
    assert lines[0].startswith("agent 0: return ") and lines[2].startswith("CartPole-v1: 2 agents x 3 episodes")
    assert evaluations[1].stdout == evaluations[0].stdout


def leaves(tree) -> list:
    """The arrays of a checkpoint's nested dictionaries, in a fixed order."""
    if isinstance(tree, dict):
        return [leaf for key in sorted(tree) for leaf in leaves(tree[key])]
    return [tree]
