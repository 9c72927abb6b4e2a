"""The seams of vpg_continuous.py for a fork: a new loss term needs a field of `Config` and the loss, nothing else.

A fork that penalises the distance from the policy that sampled the batch (a KL penalty) adds a
`kl_coef` field to `Config` and a term to `vpg_loss`. Here a subclass of `Config` and a wrapped
`vpg_loss`, put in the module's place, stand for those two edits (and, for the command line,
`RunConfig` on that subclass, as the script's `class RunConfig(Config)` is once `Config` has the
field); the trainer, the command line, the logs and the checkpoints must take them with no other change.
"""

import dataclasses

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import vpg_continuous as vpg
from vpg_continuous_helpers import ScriptedEnvs

ORIGINAL_LOSS = vpg.vpg_loss


@dataclasses.dataclass
class KLConfig(vpg.Config):
    kl_coef: float = 0.0
    """Weight of the penalty on the KL divergence from the policy that sampled the batch."""


@dataclasses.dataclass
class KLRunConfig(vpg.RunConfig, KLConfig):
    """`RunConfig` on the fork's `Config`: its fields, then the invocation's."""


def kl_penalized_loss(log_probs, old_log_probs, advantages, values, returns, entropy, config) -> vpg.LossTerms:
    r"""`vpg_loss` plus $c_{KL}\, \widehat{\mathrm{KL}}(\pi_\text{old} \| \pi_\theta)$, estimated as $\mathbb E[\log \pi_\text{old} - \log \pi_\theta]$."""
    terms = ORIGINAL_LOSS(log_probs, old_log_probs, advantages, values, returns, entropy, config)
    kl_penalty = (old_log_probs - log_probs).mean()
    return {**terms, "loss": terms["loss"] + config.kl_coef * kl_penalty, "kl_penalty": kl_penalty}


def one_update(config: vpg.Config) -> tuple[dict, list[torch.Tensor]]:
    """The statistics of one update from a fixed start, and the policy's parameters after it."""
    torch.manual_seed(0)
    trainer = vpg.Trainer(config, ScriptedEnvs(), torch.device("cpu"))
    stats = trainer.update_policy(trainer.collect_rollout())
    return stats, [p.detach().clone() for p in trainer.policy.parameters()]


def test_a_kl_penalty_is_applied_and_reported(monkeypatch):
    small = dict(num_envs=2, num_steps=8, num_minibatches=2, value_epochs=2, total_timesteps=64)
    plain_stats, plain = one_update(vpg.Config(**small))
    monkeypatch.setattr(vpg, "vpg_loss", kl_penalized_loss)
    off_stats, off = one_update(KLConfig(**small, kl_coef=0.0))
    on_stats, on = one_update(KLConfig(**small, kl_coef=5.0))
    # At weight 0 the fork is VPG, step for step.
    assert all(torch.equal(a, b) for a, b in zip(off, plain))
    assert {name: off_stats[name] for name in plain_stats} == plain_stats
    # The term is computed at the start of the step, where the policy is still the old one: its
    # value is 0 to rounding, but its gradient, -E[grad log pi], is not, and moves the policy.
    assert "kl_penalty" in off_stats and on_stats["kl_penalty"] == pytest.approx(0.0, abs=1e-5)
    assert not all(torch.equal(a, b) for a, b in zip(on, off))


def test_the_new_setting_and_term_reach_the_command_line_logs_and_checkpoint(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(vpg, "vpg_loss", kl_penalized_loss)
    monkeypatch.setattr(vpg, "Config", KLConfig)
    monkeypatch.setattr(vpg, "RunConfig", KLRunConfig)
    status = vpg.main(["--env", "Pendulum-v1", "--total-timesteps", "256", "--num-envs", "2", "--num-steps", "64",
                       "--num-workers", "1", "--value-epochs", "1", "--num-minibatches", "1", "--kl-coef", "0.5",
                       "--run-dir", str(tmp_path)])
    assert status == 0, capsys.readouterr().err
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [e.step for e in events.Scalars("losses/kl_penalty")] == [128, 256]
    assert "losses/loss" not in events.Tags()["scalars"]  # the total is not a term
    checkpoint = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert checkpoint["config"]["kl_coef"] == 0.5
