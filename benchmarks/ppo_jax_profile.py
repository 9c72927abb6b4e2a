"""Where the time of ppo_jax.py's Atari update goes: one update profiled, its time split by kind of work.

The update of one iteration (Breakout, the default settings: 8 games x 128 steps, 4 epochs of 4
minibatches of 256 frames; the torso in `--precision`, by default bfloat16 on a CPU that
multiplies in it, as ppo_jax.py's) is compiled, run twice to warm up, and run once more under
`jax.profiler`. The profile names each operation of the compiled program as it runs, and the
program's own text says what each one computes: a product of the forward pass, a product of the
backward pass, a copy that builds the windows of a convolution (`patches` in ppo_jax.py), and so on.
The operations run one after another, each spread over the cores, so their times add up to the
update's. A product of the backward pass whose result has the shape of one of the network's
weights is a weight gradient; the others are input gradients. One kind needs care: a product that
XLA's CPU backend gives to Eigen rather than to YNNPACK runs asynchronously, its event ending as
soon as it starts, and its work fills the gap up to the next operation's event; each gap is counted
to the Eigen product launched last before it. The table ends with how much of the products' time
each library took (which products go where: ppo_jax.py's Hardware choices, Part 3).

    python benchmarks/ppo_jax_profile.py
    python benchmarks/ppo_jax_profile.py --precision fp32 --json split.json

With `--convolutions`, it measures instead why ppo_jax.py's convolutions are matrix products: one
gradient step of the Nature CNN on 256 frames, with flax's `nn.Conv` and with ppo_jax.py's
`Convolution`, each compiled alone and inside a scan (as the update runs it), medians of 3.

Timings are never asserted in tests; this script is where they are measured. The event names it
reads are those of jaxlib 0.10.2's CPU runtime, not an API: another version may need this script
changed.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flax.linen as nn  # noqa: E402  (after the path, as ppo_jax is imported below)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import ppo_jax  # noqa: E402

# What each kind of operation computes; the table lists them in this order.
FORWARD = "products, forward"
INPUT_GRADIENTS = "products, backward: input gradients"
WEIGHT_GRADIENTS = "products, backward: weight gradients"
FIRST_WINDOWS = "building the windows: the first layer's"
OTHER_WINDOWS = "building the windows: the other layers'"
BACKWARD_COPIES = "backward: the windows' gradients folded back, ReLU masks, copies"
REST = "everything else"
KINDS = [FORWARD, INPUT_GRADIENTS, WEIGHT_GRADIENTS, FIRST_WINDOWS, OTHER_WINDOWS, BACKWARD_COPIES, REST]


def library_of(name: str, text: str) -> str | None:
    """Which library computes the operation `name` if it is one of the network's products, else None."""
    op_name = re.search(r'op_name="([^"]*)"', text)
    if not op_name or "ActorCritic" not in op_name.group(1):
        return None
    if name.startswith("dot."):
        return "Eigen"
    return "YNNPACK" if name.startswith("ynn_fusion") and "dot_general" in op_name.group(1) else None


def kind_of(name: str, text: str, weight_shapes: set[str]) -> str:
    """The kind of work of the operation `name`, from its line `text` in the compiled program.

    `weight_shapes` holds the shapes of the network's weights as the program writes them
    (`f32[256,32]`): a product of the backward pass with one of them is a weight gradient.
    """
    op_name = re.search(r'op_name="([^"]*)"', text)
    op_name = op_name.group(1) if op_name else ""
    backward = "transpose(" in op_name  # autodiff's transposed (backward) pass
    if library_of(name, text):
        if not backward:
            return FORWARD
        return WEIGHT_GRADIENTS if text.split(" = ")[1].split("{")[0] in weight_shapes else INPUT_GRADIENTS
    # A layer's windows: slices put together, converted to the products' precision on the way (the
    # 512-unit layer's input is copied whole, as rows and as columns, and its kernel converted).
    if not backward and re.search(r"ActorCritic\)/(Convolution_\d+/)?Dense_0/"
                                  r"(concatenate|slice|transpose|convert_element_type|bitcast_convert_type)$", op_name):
        return FIRST_WINDOWS if "Convolution_0/" in op_name else OTHER_WINDOWS
    if backward and op_name.endswith("ActorCritic))/select_n"):  # the network's own, not the optimizer's
        return BACKWARD_COPIES
    return REST


def profile_update(precision: str = "auto") -> tuple[dict, dict, float, float, int]:
    """Profile one update in `precision` (ppo_jax.py's `--precision`): the milliseconds of each kind of
    work and of each library's products, the update's seconds, the overlap, and its minibatches."""
    ppo_jax.choose_device("cpu")
    config = ppo_jax.RunConfig(env=ppo_jax.resolve_env("Breakout")[0], **ppo_jax.PRESETS["Atari"])
    training = ppo_jax.make_train(config, torso_dtype=ppo_jax.atari_dtype(precision))
    runner = jax.jit(training.init)(jax.random.key(1))
    rollout = jax.jit(training.collect)(runner)[1]
    update = jax.jit(ppo_jax.make_update_agent(training.network, ppo_jax.make_optimizer(config), config))
    arguments = (runner.agent, rollout, runner.key, config.learning_rate, config.clip_range)
    weight_shapes = {f"f32[{','.join(map(str, leaf.shape))}]"
                     for leaf in jax.tree.leaves(runner.agent.params) if leaf.ndim == 2}
    program = {}
    for line in update.lower(*arguments).compile().as_text().splitlines():
        match = re.match(r"\s*(?:ROOT )?%(\S+) = ", line)
        if match:
            program[match.group(1)] = line
    for _ in range(2):
        jax.block_until_ready(update(*arguments))
    with tempfile.TemporaryDirectory() as directory:
        jax.profiler.start_trace(directory)
        started = time.perf_counter()
        jax.block_until_ready(update(*arguments))
        seconds = time.perf_counter() - started
        jax.profiler.stop_trace()
        (trace,) = Path(directory).rglob("*.xplane.pb")
        profile = jax.profiler.ProfileData.from_file(str(trace))

    events = sorted((event.start_ns, event.start_ns + event.duration_ns, event.name)
                    for plane in profile.planes for line in plane.lines if line.name.startswith("tf_XLAEigen")
                    for event in line.events if event.name in program)
    split, libraries = collections.Counter(), collections.Counter()

    def count(name: str | None, nanoseconds: int) -> None:
        split[kind_of(name, program[name], weight_shapes) if name else REST] += nanoseconds
        library = library_of(name, program[name]) if name else None
        if library:
            libraries[library] += nanoseconds

    end, last_eigen_product, overlap = events[0][0], None, 0
    for start, stop, name in events:
        if start > end:  # nothing recorded: an asynchronous Eigen product at work
            count(last_eigen_product, start - end)
        overlap += max(0, min(stop, end) - start)
        if name.startswith("dot."):
            last_eigen_product = name
        if stop > max(start, end):
            count(name, stop - max(start, end))
        end = max(end, stop)
    minibatches = config.update_epochs * config.num_minibatches
    return ({kind: split[kind] / 1e6 for kind in KINDS}, {library: libraries[library] / 1e6 for library in ["YNNPACK", "Eigen"]},
            seconds, overlap / 1e6, minibatches)


class FlaxConvolution(nn.Module):
    """flax's own convolution, in place of ppo_jax.py's `Convolution` (same fields, same function).

    `nn.Conv` takes the channels last and the batch first, so they are moved there and back: `Convolution`
    takes the channels first and the batch last.
    """

    features: int
    kernel: int
    stride: int = 1
    dtype: Any = jnp.float32
    scale: float = 1.0

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        convolution = nn.Conv(self.features, (self.kernel, self.kernel), strides=self.stride, padding="VALID",
                              dtype=self.dtype)
        x = jnp.moveaxis(x, (0, 1, 2), (-1, -3, -2)).astype(jnp.float32) * self.scale  # an input scaled, a product scaled
        return jnp.moveaxis(convolution(x), (-1, -3, -2), (0, 1, 2)).astype(jnp.float32)


@contextlib.contextmanager
def convolutions_as(convolution: type[nn.Module]):
    """Inside the block, ppo_jax.py's networks are built with `convolution` for their convolutions.

    A flax network builds its layers each time it runs, looking `Convolution` up by name, so
    swapping the name is enough, for as long as the block lasts: keep initialising and tracing the
    network inside it. The name is put back on the way out, whatever happens.
    """
    ours = ppo_jax.Convolution
    ppo_jax.Convolution = convolution
    try:
        yield
    finally:
        ppo_jax.Convolution = ours


def time_convolutions(num_frames: int = 256, repeats: int = 3) -> dict:
    """Seconds of one gradient step of the Nature CNN on `num_frames` frames: `{(convolution, where): seconds}`."""
    import statistics

    import numpy as np

    ppo_jax.choose_device("cpu")
    frames = jax.numpy.asarray(np.random.default_rng(0).integers(0, 256, (num_frames, 4, 84, 84), dtype=np.uint8))
    seconds = {}
    for name, convolution in [("nn.Conv", FlaxConvolution), ("Convolution", ppo_jax.Convolution)]:
        with convolutions_as(convolution):
            network = ppo_jax.NatureActorCritic(4)
            params = network.init(jax.random.key(0), frames)

            def step(params, frames):
                def loss(params):
                    policy, values = network.apply(params, frames)
                    return policy.logits.sum() + values.sum()
                return jax.tree.map(lambda p, g: p - 1e-6 * g, params, jax.grad(loss)(params))

            steps_in_scan = 2
            programs = {"alone": (jax.jit(step), 1),
                        "in a scan": (jax.jit(lambda params, frames: jax.lax.scan(
                            lambda params, _: (step(params, frames), None), params, length=steps_in_scan)[0]),
                            steps_in_scan)}
            for where, (program, steps) in programs.items():
                jax.block_until_ready(program(params, frames))
                timed = []
                for _ in range(repeats):
                    started = time.perf_counter()
                    jax.block_until_ready(program(params, frames))
                    timed.append((time.perf_counter() - started) / steps)
                seconds[(name, where)] = statistics.median(timed)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the split here")
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto",
                        help="the torso's, as ppo_jax.py's flag (auto: bfloat16 on a CPU that multiplies in it)")
    parser.add_argument("--convolutions", action="store_true",
                        help="time a gradient step with flax's nn.Conv and with Convolution instead")
    args = parser.parse_args()
    if args.convolutions:
        for (name, where), seconds in time_convolutions().items():
            print(f"one gradient step of the Nature CNN on 256 frames, {name}, {where}: {seconds:.2f} s")
        return
    split, libraries, seconds, overlap, minibatches = profile_update(args.precision)
    profiled = sum(split.values())
    precision = "bfloat16" if ppo_jax.atari_dtype(args.precision) == jnp.bfloat16 else "float32"
    print(f"ppo_jax.py's update on Breakout, 8 games x 128 steps ({minibatches} minibatches, the torso in {precision}): "
          f"{seconds:.2f} s under the profiler, {profiled / 1e3:.2f} s of it in the profiled operations "
          f"(operations overlapping: {overlap:.0f} ms)")
    print("| kind of work | ms per update | ms per minibatch | share |\n|---|---|---|---|")
    for kind, milliseconds in split.items():
        print(f"| {kind} | {milliseconds:.0f} | {milliseconds / minibatches:.1f} | {100 * milliseconds / profiled:.0f}% |")
    print("The products' time by library: " + ", ".join(
        f"{library} {milliseconds:.0f} ms ({milliseconds / minibatches:.1f} ms per minibatch)"
        for library, milliseconds in libraries.items()))
    if args.json:
        args.json.write_text(json.dumps({"seconds": seconds, "overlap_ms": overlap, "split_ms": split,
                                         "products_by_library_ms": libraries}, indent=2))


if __name__ == "__main__":
    main()
