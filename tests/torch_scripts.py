"""What the tests written once for both PyTorch scripts, ppo_atari.py and vpg_continuous.py, need to
know of each: the module, a tiny run of it, and the few places where the two differ.

A test file of both defines the fixture `script`, parametrised over `SCRIPTS`, so that each of its
tests runs once for each script."""

import dataclasses
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

import ppo_atari
import vpg_continuous
from processes import alive, children_of

ROOT = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Script:
    module: ModuleType
    tiny: tuple
    """A tiny run: 2 envs in 1 worker, updates of 128 steps; add `--total-timesteps` and `--run-dir`."""
    network: str
    """The network the tests poison: the trainer's attribute and the checkpoint's entry of that name."""
    non_finite: str
    """What `--eval` says of a checkpoint with a non-finite weight."""
    numeric: str
    """A numeric field of this script's `RunConfig` alone."""
    missing: str
    """An entry of a checkpoint that `--eval` needs."""
    invocation: dict
    """The settings of one invocation (`RunConfig` less `Config`), with the defaults they had when
    they were fields of `Config`."""

    @property
    def name(self) -> str:
        return Path(self.module.__file__).name

    @property
    def path(self) -> str:
        return str(ROOT / self.name)

    @property
    def env_class(self) -> type:
        """The class of one env of the script: ppo_atari.py's `Game`, vpg_continuous.py's `Task`."""
        return ppo_atari.Game if self.module is ppo_atari else vpg_continuous.Task

    def run_main(self, capsys, *args) -> tuple[int, str, str]:
        """`main` of the script, in this process: its exit status, stdout and stderr."""
        try:
            status = self.module.main([str(a) for a in args])
        except SystemExit as exit:
            status = exit.code
        captured = capsys.readouterr()
        return status, captured.out, captured.err

    def start(self, *args) -> subprocess.Popen:
        """The script as a program of its own, its stderr a pipe."""
        return subprocess.Popen([sys.executable, self.path, *map(str, args)], stderr=subprocess.PIPE, text=True,
                                cwd=ROOT)

    def one_line_error(self, status: int, stderr: str, message: str) -> None:
        assert status == 2, stderr
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"{self.name}: error:") and message in lines[0], stderr

    def make_envs_fail(self, monkeypatch, failure) -> None:
        """Make every env a worker makes call `failure` instead (workers started by `fork` see it)."""
        if self.module is ppo_atari:
            real_worker = ppo_atari.run_worker
            monkeypatch.setattr(ppo_atari, "run_worker",
                                lambda connection, make_env, *rest: real_worker(connection, failure, *rest))
        else:
            monkeypatch.setattr(vpg_continuous.Task, "__init__", lambda self, *args, **kwargs: failure(*args))


    def ctrl_c_saves_a_checkpoint_and_leaves_no_process(self, tmp_path: Path, device: str) -> None:
        """A run of the script's defaults on `device`, stopped by one Ctrl-C once it trains: it exits 130
        with a checkpoint at the end of an update, and its workers are gone."""
        process = subprocess.Popen([sys.executable, self.path, "--total-timesteps", "10000000", "--device", device,
                                    "--run-dir", str(tmp_path)], stderr=subprocess.PIPE, text=True, cwd=ROOT)
        try:
            for line in process.stderr:
                if f"training on {device}" in line:
                    break
            time.sleep(3)
            workers = children_of(process.pid)
            assert len(workers) >= 1
            process.send_signal(signal.SIGINT)
            _, errors = process.communicate(timeout=60)
        finally:
            process.kill()
        assert process.returncode == 130, errors
        assert "stopped at update" in errors and "Traceback" not in errors
        checkpoint = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
        assert checkpoint["global_step"] == checkpoint["update"] * self.module.Config().batch_size
        time.sleep(0.5)
        assert not [pid for pid in workers if alive(pid)]


SCRIPTS = [
    Script(ppo_atari, ("--env", "Breakout", "--num-envs", 2, "--num-steps", 64, "--num-minibatches", 2,
                       "--update-epochs", 1, "--num-workers", 1, "--seed", 5),
           network="model", non_finite="holds non-finite weights", numeric="target_kl", missing="optimizer",
           invocation=dict(num_workers=0, device="auto", precision="auto", start_method="default", run_dir=None,
                           checkpoint_every=100, resume=None, eval=None, eval_episodes=10, capture_video=False,
                           track=False, wandb_project_name="policy-gradients", wandb_entity=None)),
    Script(vpg_continuous, ("--env", "Pendulum-v1", "--num-envs", 2, "--num-steps", 64, "--num-minibatches", 2,
                            "--value-epochs", 1, "--num-workers", 1, "--seed", 5),
           network="policy", non_finite="holds non-finite policy weights", numeric="gamma", missing="obs_normalizer",
           invocation=dict(num_workers=0, device="auto", start_method="default", run_dir=None, checkpoint_every=100,
                           resume=None, eval=None, eval_episodes=10, eval_deterministic=False, capture_video=False,
                           track=False, wandb_project_name="policy-gradients", wandb_entity=None)),
]
PPO_ATARI, VPG_CONTINUOUS = SCRIPTS
IDS = [script.name.removesuffix(".py") for script in SCRIPTS]
