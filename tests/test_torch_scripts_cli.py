"""The command lines of ppo_atari.py and vpg_continuous.py where they behave alike, written once and
run for both (each script's own, with its trained run, are in its own file)."""

import copy
import dataclasses
import math
import os
import re
import signal

import pytest
import torch

from torch_scripts import IDS, SCRIPTS, Script


@pytest.fixture(params=SCRIPTS, ids=IDS)
def script(request) -> Script:
    return request.param


def test_config_holds_the_agent_and_run_config_adds_the_invocation(script):
    module, invocation = script.module, script.invocation
    agent = {field.name for field in dataclasses.fields(module.Config)}
    assert not agent & invocation.keys()
    assert issubclass(module.RunConfig, module.Config)
    added = {field.name: field.default for field in dataclasses.fields(module.RunConfig) if field.name not in agent}
    assert added == invocation
    # Every field of both is a flag, with its documentation as the help text (argparse's `%` doubled).
    helps = {action.dest: action.help for action in module.build_parser()._actions}
    docs = module.field_docs(module.RunConfig)
    for field in dataclasses.fields(module.RunConfig):
        assert docs[field.name] and helps[field.name].startswith(docs[field.name].replace("%", "%%")), field.name


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_exits_2(script, tmp_path, capsys):
    script.one_line_error(*script.run_main(capsys, *script.tiny, "--total-timesteps", 1024, "--device", "cuda",
                                           "--run-dir", tmp_path)[::2], "no CUDA device")


def test_a_rollout_larger_than_the_memory_exits_2_before_any_process_starts(script, tmp_path, capsys):
    # A trillion steps a rollout, petabytes of observations: numpy refused them in a traceback.
    status, _, stderr = script.run_main(capsys, *script.tiny, "--num-envs", 8, "--num-steps", "1e12",
                                        "--total-timesteps", "1e13", "--run-dir", tmp_path / "run")
    script.one_line_error(status, stderr, "the observations of a rollout of 8 envs x 1,000,000,000,000 steps need ")
    assert "GiB of memory, more than this machine's" in stderr and not (tmp_path / "run").exists()


def test_the_rollouts_of_every_rank_on_the_machine_count_against_its_memory(script, monkeypatch):
    module, config = script.module, script.module.Config(num_envs=8, num_steps=128)
    monkeypatch.setattr(module.os, "sysconf", {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 2**18}.get)  # 1 GiB
    module.check_rollout_fits(config, 600_000, module.Ranks(size=2, local_size=1))  # 0.57 GiB for 1 rank here
    with pytest.raises(module.ConfigError, match=r"of 8 envs x 128 steps \(x 2 ranks on this machine\) need 1.1 GiB "
                                                 r"of memory, more than this machine's 1.0 GiB"):
        module.check_rollout_fits(config, 600_000, module.Ranks(size=2, local_size=2))


def test_integer_flags_take_powers_of_ten_and_underscores_and_keep_every_digit(script):
    integer = script.module.integer
    assert integer("1e7") == integer("10_000_000") == integer("+10000000") == 10_000_000
    assert integer("9007199254740993") == 2**53 + 1  # past the integers a float holds exactly
    with pytest.raises(ValueError):
        integer("2.5")


def test_a_resumed_run_trains_on_from_its_checkpoints_random_state_and_adams_moments(script, tmp_path, monkeypatch,
                                                                                      capsys):
    first = tmp_path / "first" / "checkpoint.pt"
    assert script.run_main(capsys, *script.tiny, "--total-timesteps", 256, "--run-dir", first.parent)[0] == 0
    saved, seen = torch.load(first, weights_only=True), {}
    train = script.module.RunTrainer.train

    def train_and_look(trainer, *args, **kwargs):  # what the resumed run's first update starts from
        seen.update(rng=torch.get_rng_state(), optimizer=copy.deepcopy(trainer.optimizer.state_dict()))
        return train(trainer, *args, **kwargs)

    monkeypatch.setattr(script.module.RunTrainer, "train", train_and_look)
    status, _, stderr = script.run_main(capsys, "--resume", first, "--total-timesteps", 384,
                                        "--run-dir", tmp_path / "resumed")
    assert status == 0, stderr
    assert torch.equal(seen["rng"], saved["torch_rng"][0])
    assert seen["optimizer"]["state"].keys() == saved["optimizer"]["state"].keys()
    for index, moments in saved["optimizer"]["state"].items():
        for name, value in moments.items():  # the step count, and each moment
            torch.testing.assert_close(seen["optimizer"]["state"][index][name], value, rtol=0, atol=0)


def test_one_process_stops_within_a_rollout_and_learns_nothing_from_its_part(script, tmp_path, monkeypatch, capsys):
    # A Ctrl-C at the tenth step of the second rollout (64 steps each): the next step stops the run,
    # without waiting for the rollout's last 54, and the checkpoint is the first update's.
    steps, step = [], script.module.RunWorkers.step

    def step_and_interrupt(workers, actions):
        steps.append(actions)
        if len(steps) == 64 + 10:
            os.kill(os.getpid(), signal.SIGINT)
        return step(workers, actions)

    monkeypatch.setattr(script.module.RunWorkers, "step", step_and_interrupt)
    status, _, stderr = script.run_main(capsys, *script.tiny, "--total-timesteps", 1024, "--run-dir", tmp_path)
    assert status == 130 and len(steps) == 64 + 10, stderr
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["update"] == 1
    assert "stopped at update 1; resume with --resume" in stderr


def test_ctrl_c_saves_a_checkpoint_and_leaves_no_process(script, tmp_path):
    script.ctrl_c_saves_a_checkpoint_and_leaves_no_process(tmp_path, "cpu")


def test_a_run_trains_with_run_trainer_and_a_nan_keeps_the_last_good_checkpoint(script, tmp_path, monkeypatch,
                                                                                 capsys):
    module, trainers = script.module, []
    real_update = module.Trainer.update_policy

    def update_that_fails_third(self, rollout):
        trainers.append(self)
        if self.update == 2:
            raise module.NonFiniteError("the loss or its gradient became nan at update 3; no step was taken")
        return real_update(self, rollout)

    monkeypatch.setattr(module.Trainer, "update_policy", update_that_fails_third)
    status, _, stderr = script.run_main(capsys, *script.tiny, "--total-timesteps", 1024, "--checkpoint-every", 2,
                                        "--run-dir", tmp_path)
    assert status == 1
    assert "nan at update 3" in stderr and "the last good checkpoint is" in stderr
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["update"] == 2
    # Parts 2, 3 and 4 extend Part 1 by subclass: what a run adds (the stop between steps, the
    # timing, the machine's choices) is in `RunWorkers` and `RunTrainer`, never a function
    # assigned to an object in place of its method, which a fork's rename would silently bypass.
    trainer = trainers[0]
    assert all(other is trainer for other in trainers)
    assert type(trainer) is module.RunTrainer and type(trainer.envs) is module.RunWorkers
    for owner in (trainer, trainer.envs):
        assert not [name for name in vars(owner) if callable(getattr(type(owner), name, None))], owner
    # Each phase was counted, for the log's split of each update's time.
    assert trainer.envs.seconds["env"] > 0 and trainer.seconds["sampling"] > trainer.envs.seconds["env"]
    assert trainer.seconds["update"] > 0


def test_a_step_out_of_gpu_memory_is_one_line_and_keeps_the_last_checkpoint(script, tmp_path, monkeypatch, capsys):
    # torch's own words for it, as a GPU gives them (two sentences, a URL), raised in the third update.
    module, real_update = script.module, script.module.Trainer.update_policy

    def update_out_of_memory(self, rollout):
        if self.update == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity "
                                         "of 7.79 GiB.  See documentation for Memory Management\n(https://...)")
        return real_update(self, rollout)

    monkeypatch.setattr(module.Trainer, "update_policy", update_out_of_memory)
    status, _, stderr = script.run_main(capsys, *script.tiny, "--total-timesteps", 1024, "--checkpoint-every", 2,
                                        "--run-dir", tmp_path)
    assert status == 1 and "Traceback" not in stderr, stderr
    assert stderr.strip().splitlines()[-1] == ("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total "
                                               "capacity of 7.79 GiB. See documentation for Memory Management "
                                               f"(https://...); the last checkpoint is {tmp_path / 'checkpoint.pt'}")
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["update"] == 2


def test_in_a_log_the_progress_line_of_a_step_is_written_once(script, capsys):
    # Into a file, a line every 10 seconds and the final one: a run whose last update's line was
    # just written does not write it again as the final one.
    progress = script.module.Progress(2048, 0)
    progress.last_print -= 11
    progress.show(1024)
    progress.show(1280)  # within 10 seconds of the last line: not written
    progress.last_print -= 11
    progress.show(1536)
    progress.show(1536, final=True)
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(" |")[0] for line in lines] == ["step 1,024/2,048 (50.0%)", "step 1,536/2,048 (75.0%)"]


def test_the_time_left_is_in_minutes_and_seconds_and_past_an_hour_in_hours_and_minutes(script):
    assert [script.module.format_duration(seconds) for seconds in (0, 125.7, 3599, 3600, 37 * 3600 + 5 * 60 + 59)] == [
        "0m00s", "2m05s", "59m59s", "1h00m", "37h05m"]
    assert script.module.format_duration(math.inf) == "?"  # no speed measured yet


def test_the_progress_line_counts_one_game_or_episode_in_the_singular(script, capsys):
    progress = script.module.Progress(2048, 0)
    # ppo_atari.py counts the scores of games, vpg_continuous.py the returns of episodes.
    scores, unit = (progress.scores, "game") if hasattr(progress, "scores") else (progress.returns, "episode")
    for score in (1.0, 3.0):
        scores.append(score)
        progress.show(2048, final=True)
        progress.printed = None
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].endswith(f"1.0 (last 1 {unit})") and lines[1].endswith(f"2.0 (last 2 {unit}s)"), lines


def test_without_run_dir_a_run_goes_to_runs_named_by_env_seed_and_time(script, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert script.run_main(capsys, *script.tiny, "--total-timesteps", 128)[0] == 0
    env = script.tiny[script.tiny.index("--env") + 1].split("-v")[0]
    [run_dir] = (tmp_path / "runs").iterdir()
    assert re.fullmatch(rf"{env}__5__\d{{8}}-\d{{6}}", run_dir.name), run_dir.name
    assert (run_dir / "checkpoint.pt").is_file()


def test_the_progress_line_counts_the_steps_the_run_will_take(script, tmp_path, capsys):
    # --total-timesteps 300 with updates of 128 steps is 2 whole updates: the run takes 256 steps, and
    # its last line says so, at 100%, rather than stopping at 85% of a total it never meant to reach.
    status, _, stderr = script.run_main(capsys, *script.tiny, "--total-timesteps", 300, "--run-dir", tmp_path)
    assert status == 0, stderr
    assert "step 256/256 (100.0%)" in stderr and "done: 256 steps" in stderr and "/300" not in stderr
    assert " in 1 worker; " in stderr  # the tiny run's one worker, in the singular
