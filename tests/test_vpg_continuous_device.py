"""vpg_continuous.py's `--device auto` is the CPU, also where CUDA is available: its networks are
too small for a GPU to pay off (`choose_device`), and `--help` and the README say so. They run on
one thread."""

import torch

import vpg_continuous as vpg
from conftest import ROOT


def test_auto_is_the_cpu_even_where_cuda_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert vpg.choose_device("auto") == torch.device("cpu")
    assert vpg.choose_device("cpu") == torch.device("cpu")


def test_the_networks_run_on_one_thread():
    # Too small to share out; idle threads of a parallel section would spin on the workers' cores.
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        vpg.choose_device("cpu")
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)


def test_help_and_readme_say_auto_is_the_cpu(capsys):
    help_text = " ".join(vpg.build_parser().format_help().split())
    assert "(`auto`: the CPU" in help_text
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "`vpg_continuous.py` keeps the CPU with `--device auto`" in readme
    assert "HalfCheetah-v5: training on cuda:0" not in readme
