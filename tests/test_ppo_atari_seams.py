"""The seams of ppo_atari.py that a fork changes, each in one place: the task, and a term of the loss.

A task of one's own with pixels and discrete actions takes `make_env` and the wrapper it returns
(in `ppo_atari_helpers`); a KL penalty takes a field of `Config` and the loss. Nothing else of
the script changes: the shared memory, the network, the trainer and the logs follow.
"""

import dataclasses
from typing import NamedTuple

import numpy as np
import pytest
import torch

import ppo_atari
import ppo_atari_helpers as helpers
from processes import deadline


def test_a_gymnasium_task_with_pixels_trains_through_the_workers_and_the_trainer():
    config = ppo_atari.Config(num_envs=8, num_steps=32, total_timesteps=4096)
    rewards = []
    # Workers started by `spawn`, which import the task's `make_env` by its name.
    with deadline(600), ppo_atari.Workers(helpers.ENV_ID, config.num_envs, 2, config.seed, {}, "spawn",
                                          make_env=helpers.make_env) as envs:
        assert envs.observation_shape == (3, 48, 48) and envs.n_actions == 3
        torch.manual_seed(0)
        trainer = ppo_atari.Trainer(config, envs, torch.device("cpu"))
        trainer.train(lambda stats: rewards.extend(score for _, score, _ in trainer.finished_games))
    assert trainer.model.torso[0].in_channels == 3 and trainer.storage.obs.shape == (32, 8, 3, 48, 48)
    assert len(rewards) == 4096  # one-step episodes: every step ended one, with its reward as its score
    assert np.mean(rewards[:256]) < 0.5  # a random policy earns 1/3
    assert np.mean(rewards[-512:]) >= 0.9


@dataclasses.dataclass
class KLPenaltyConfig(ppo_atari.Config):
    kl_coef: float = 1.0
    """Weight of the penalty on the KL divergence from the policy that sampled the batch."""


class KLPenaltyTerms(NamedTuple):
    loss: torch.Tensor
    policy_loss: torch.Tensor
    value_loss: torch.Tensor
    entropy: torch.Tensor
    approx_kl: torch.Tensor
    clipfrac: torch.Tensor
    kl_penalty: torch.Tensor


PPO_LOSS = ppo_atari.ppo_loss


def ppo_loss_with_kl_penalty(log_probs, old_log_probs, advantages, values, old_values, returns, entropy,
                             clip_range, config) -> KLPenaltyTerms:
    r"""PPO's loss plus $\beta\, \mathbb E[(r - 1) - \log r]$, a penalty on the KL estimate, $\beta$ = `kl_coef`."""
    terms = PPO_LOSS(log_probs, old_log_probs, advantages, values, old_values, returns, entropy, clip_range, config)
    log_ratio = log_probs - old_log_probs
    kl_penalty = config.kl_coef * ((log_ratio.exp() - 1.0) - log_ratio).mean()
    return KLPenaltyTerms(terms.loss + kl_penalty, *terms[1:], kl_penalty)


class Recorder:
    """Stands in for TensorBoard's `SummaryWriter`: the tags written."""

    def __init__(self):
        self.scalars = {}

    def add_scalar(self, tag, value, step):
        self.scalars[tag] = value


def update_with(kl_coef: float) -> dict[str, float]:
    """One update of a fresh trainer with the KL penalty's loss and `kl_coef`, from the same start."""
    config = KLPenaltyConfig(num_envs=4, num_steps=32, num_minibatches=2, update_epochs=4, total_timesteps=1280,
                             learning_rate=1e-3, kl_coef=kl_coef)
    torch.manual_seed(0)
    trainer = ppo_atari.Trainer(config, helpers.RandomFrames(4, seed=0), torch.device("cpu"))
    return trainer.update_policy(trainer.collect_rollout())


def test_a_kl_penalty_takes_a_config_field_and_the_loss(monkeypatch):
    monkeypatch.setattr(ppo_atari, "ppo_loss", ppo_loss_with_kl_penalty)
    free, penalised = update_with(kl_coef=0.0), update_with(kl_coef=100.0)
    # The penalty is measured with the other terms, and it is part of the loss that was minimised.
    assert free["kl_penalty"] == 0.0
    assert penalised["kl_penalty"] == pytest.approx(100.0 * penalised["approx_kl"], rel=1e-5)
    config = KLPenaltyConfig()
    parts = [penalised["policy_loss"], config.vf_coef * penalised["value_loss"],
             -config.ent_coef * penalised["entropy"], penalised["kl_penalty"]]
    assert penalised["loss"] == pytest.approx(sum(parts), rel=0, abs=1e-5 * sum(map(abs, parts)))
    # It holds the policy near the one that sampled the batch.
    assert penalised["approx_kl"] < 0.75 * free["approx_kl"]  # measured: 0.59 of it
    # And it is logged under its own name, with no edit to the logger.
    writer = Recorder()
    ppo_atari.log_update(writer, 128, penalised, [], ppo_atari.Progress(1280, 0), {"update": 1.0})
    assert writer.scalars["losses/kl_penalty"] == penalised["kl_penalty"]
    assert {tag for tag in writer.scalars if tag.startswith("losses/")} == {
        f"losses/{name}" for name in KLPenaltyTerms._fields[1:] + ("explained_variance",)}
