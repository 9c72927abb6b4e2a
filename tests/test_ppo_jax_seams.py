"""ppo_jax.py's seams for a fork: a new loss term needs a field of `Config` and the loss, nothing else.

The test plays a researcher who adds a KL penalty, $c_{KL} \\mathrm{KL}(\\pi_\\text{old} \\| \\pi_\\theta)$,
to PPO's loss: a `kl_coef` field, and `ppo_loss` returning one more term. Nothing else of the
script is touched, and the term is applied by the update, logged under `losses/kl_penalty`,
and set from the command line as `--kl-coef`.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import ppo_jax
from ppo_jax_runs import read_checkpoint, scalars

PPO_LOSS = ppo_jax.ppo_loss


def ppo_loss_with_kl_penalty(log_probs, old_log_probs, advantages, values, old_values, returns, entropy,
                             clip_range, config, valid=None):
    """The fork's loss: PPO's, plus `kl_coef` times the estimate of KL(old || new) that `approx_kl` reports."""
    terms = PPO_LOSS(log_probs, old_log_probs, advantages, values, old_values, returns, entropy, clip_range, config,
                     valid)
    log_ratio = log_probs - old_log_probs
    kl_penalty = ppo_jax.masked_mean((jnp.exp(log_ratio) - 1.0) - log_ratio, valid)
    return {**terms, "loss": terms["loss"] + config.kl_coef * kl_penalty, "kl_penalty": kl_penalty}


@dataclasses.dataclass
class KLConfig(ppo_jax.Config):
    kl_coef: float = 0.0
    """Weight of the KL penalty."""


@dataclasses.dataclass
class KLRunConfig(ppo_jax.RunConfig):
    kl_coef: float = 0.0
    """Weight of the KL penalty."""


SMALL = dict(num_envs=2, num_steps=16, num_minibatches=2, update_epochs=4, total_timesteps=64, learning_rate=0.01)


def one_update(kl_coef):
    """The parameters and metrics after one update of a small CartPole run with the forked loss."""
    training = ppo_jax.make_train(KLConfig(kl_coef=kl_coef, **SMALL))
    runner, metrics = jax.jit(training.update)(jax.jit(training.init)(jax.random.key(0)))
    return runner.agent.params, metrics


def test_a_kl_penalty_is_applied_and_reported_by_the_update(monkeypatch):
    stock_params, stock_metrics = one_update(kl_coef=0.0)
    monkeypatch.setattr(ppo_jax, "ppo_loss", ppo_loss_with_kl_penalty)
    unpenalised, metrics = one_update(kl_coef=0.0)
    penalised, penalised_metrics = one_update(kl_coef=10.0)
    # The new term reaches the metrics: the same estimate as approx_kl, averaged over the same steps.
    assert "kl_penalty" not in stock_metrics["losses"]
    assert float(metrics["losses"]["kl_penalty"]) == float(metrics["losses"]["approx_kl"]) > 0
    # With a weight of 0 the fork is PPO; with a weight of 10 the penalty changes the steps taken.
    for a, b in zip(jax.tree.leaves(unpenalised), jax.tree.leaves(stock_params)):
        np.testing.assert_array_equal(a, b)
    moved = [float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(penalised), jax.tree.leaves(unpenalised))]
    assert max(moved) > 1e-4
    # ... and pulls the new policy towards the old one.
    assert float(penalised_metrics["losses"]["approx_kl"]) < float(metrics["losses"]["approx_kl"])


def test_a_kl_penalty_is_set_from_the_command_line_and_logged(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(ppo_jax, "ppo_loss", ppo_loss_with_kl_penalty)
    monkeypatch.setattr(ppo_jax, "RunConfig", KLRunConfig)
    help_text = ppo_jax.build_parser().format_help()
    assert "--kl-coef KL_COEF" in help_text and "Weight of the KL penalty." in help_text
    status = ppo_jax.main(["--kl-coef", "0.5", "--num-steps", "64", "--total-timesteps", "512",
                           "--run-dir", str(tmp_path)])
    assert status == 0, capsys.readouterr().err
    logged = scalars(tmp_path)
    assert [step for step, _ in logged["losses/kl_penalty"]] == [256, 512]
    assert logged["losses/kl_penalty"] == logged["losses/approx_kl"]
    assert read_checkpoint(tmp_path / "checkpoint.msgpack")["config"]["kl_coef"] == 0.5


def test_in_a_log_the_progress_line_of_a_step_is_written_once(capsys):
    # A run whose last chunk's line was just written does not write it again as the final one.
    progress = ppo_jax.Progress(2048, 0, agents=2, unit="episodes")
    progress.last_print -= 11
    progress.show(1024)
    progress.show(2048, final=True)
    progress.show(2048, final=True)
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(" |")[0] for line in lines] == ["step 1,024/2,048 x 2 agents (50.0%)",
                                                       "step 2,048/2,048 x 2 agents (100.0%)"]
