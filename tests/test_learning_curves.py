"""benchmarks/learning_curves.py: the curve read from hand-made TensorBoard events (the mean of the
last scores, resumed sittings, ppo_jax.py's agents), its CSV, its plots, bad input, and one real run
stopped at its budget by SIGINT, then resumed past it."""

import importlib.util
import signal
import subprocess
import sys

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader
from torch.utils.tensorboard import SummaryWriter

from conftest import ROOT
from processes import interrupted_while_loading

SCRIPT = ROOT / "benchmarks" / "learning_curves.py"
spec = importlib.util.spec_from_file_location("learning_curves", SCRIPT)
curves = importlib.util.module_from_spec(spec)
sys.modules["learning_curves"] = curves  # dataclasses look their module up while the file is run
spec.loader.exec_module(curves)


def write_sitting(directory, updates, seconds_per_update=1.0, means=None):
    """One sitting of a run, as the scripts log it: a new event file in `directory`, and for each
    `(step, scores)` of `updates` the scores under charts/episodic_return and a loss, all at the
    update's step, and, as ppo_jax.py does, `means[step]` (where given) under
    charts/episodic_return_last_100. Update k is logged `k * seconds_per_update` seconds after the
    file's first event."""
    directory.mkdir(parents=True, exist_ok=True)
    before = set(directory.glob("events.out.tfevents.*"))
    writer = SummaryWriter(str(directory))
    (path,) = set(directory.glob("events.out.tfevents.*")) - before
    opened = next(iter(LegacyEventFileLoader(str(path)).Load())).wall_time
    for k, (step, scores) in enumerate(updates, start=1):
        for score in scores:
            writer.add_scalar("charts/episodic_return", score, step, walltime=opened + k * seconds_per_update)
        if means and step in means:
            writer.add_scalar("charts/episodic_return_last_100", means[step], step,
                              walltime=opened + k * seconds_per_update)
        writer.add_scalar("losses/value_loss", 0.5, step, walltime=opened + k * seconds_per_update)
    writer.close()


def counting_updates(first: int, last: int, value=None):
    """Updates `first`..`last` of 100 steps each; from update 3 on, each logs 12 scores, the running
    count of the scores logged before them (0, 1, 2, ...), or `value` if given."""
    return [(100 * u, [value if value is not None else 12 * (u - 3) + i for i in range(12)] if u >= 3 else [])
            for u in range(first, last + 1)]


def test_a_point_is_the_mean_of_the_last_100_scores_logged_up_to_it(tmp_path):
    write_sitting(tmp_path, counting_updates(1, 30))
    record = curves.read_record(tmp_path, schedule=10_000)
    assert record.end == 3000
    assert curves.score_at(record, 200, 100) is None  # no finished game yet
    assert curves.score_at(record, 300, 100) == 5.5  # scores 0..11
    assert curves.score_at(record, 399, 100) == 5.5  # nothing new until the next update's step
    assert curves.score_at(record, 1000, 100) == 47.5  # 96 scores: 0..95
    assert curves.score_at(record, 1100, 100) == 57.5  # 108 scores, the last 100: 8..107
    assert curves.score_at(record, 3000, 100) == 285.5  # 336 scores, the last 100: 236..335
    assert curves.score_at(record, 3000, 10) == 330.5  # 326..335
    assert curves.score_at(record, 3100, 100) is None  # past the run's end
    assert curves.seconds_at(record, 1000) == pytest.approx(10.0)
    assert curves.seconds_at(record, 950) == pytest.approx(10.0)  # the first update at or past the step
    curve = curves.make_curve({"seed_1": record}, budget=3000, points=3, window=100)
    assert curve.steps == [1000, 2000, 3000]
    assert curve.scores["seed_1"] == [47.5, 165.5, 285.5] == curve.mean


def test_a_run_that_finished_its_schedule_reaches_its_end(tmp_path):
    # 976 updates of 512 steps end at 499,712, short of a schedule of 500,000: the run is counted to it.
    write_sitting(tmp_path, [(512 * u, [float(u)]) for u in range(970, 977)])
    record = curves.read_record(tmp_path, schedule=500_000)
    assert record.end == 500_000
    assert curves.score_at(record, 500_000, 2) == 975.5
    assert curves.seconds_at(record, 500_000) == pytest.approx(7.0)
    assert curves.read_record(tmp_path, schedule=600_000).end == 499_712


def test_resumed_sittings_give_the_curve_of_one_run(tmp_path):
    write_sitting(tmp_path / "one", counting_updates(1, 30))
    # Three sittings. The first was killed after update 12, its last checkpoint at update 10: the
    # second resumes from there and logs updates 11 and 12 again. What the first logged for them
    # (scores of -1000) must be dropped. The first sitting lasts 1,200 s, the second starts a few
    # milliseconds after the first opened (as if the pause had been long), and lasts 10 s.
    chunked = tmp_path / "chunked"
    write_sitting(chunked, counting_updates(1, 10) + counting_updates(11, 12, value=-1000.0), seconds_per_update=100)
    write_sitting(chunked, counting_updates(11, 20))
    write_sitting(chunked, counting_updates(21, 30))
    one, resumed = curves.read_record(tmp_path / "one", 10_000), curves.read_record(chunked, 10_000)
    assert resumed.score_steps == one.score_steps and resumed.scores == one.scores
    grid = dict(budget=3000, points=30, window=100)
    assert curves.make_curve({"s": resumed}, **grid).scores == curves.make_curve({"s": one}, **grid).scores
    # Training time: the sittings end to end, each counted from its own first event, pauses left out.
    assert curves.seconds_at(resumed, 1000) == pytest.approx(1000.0)
    assert curves.seconds_at(resumed, 1100) == pytest.approx(1201.0)
    assert curves.seconds_at(resumed, 2000) == pytest.approx(1210.0)
    assert curves.seconds_at(resumed, 3000) == pytest.approx(1220.0)


def test_each_agent_of_a_ppo_jax_run_is_a_curve_and_their_mean_is_not_read(tmp_path):
    task = curves.Task("jax", "ppo_jax.py", "CartPole-v1", schedule=10_000, budget=500, seeds=(1,), unit="updates")
    run_dir = tmp_path / "jax" / "seed-1"
    write_sitting(run_dir, [(100 * u, [999.0]) for u in range(1, 6)])  # the mean over agents
    for agent in [0, 2, 10]:
        # ppo_jax.py logs, per update, the mean return of the episodes that ended in it (and, since it
        # keeps them, the mean of its last 100: not here, as in a run from before).
        write_sitting(run_dir / f"agent-{agent}", [(100 * u, [float(agent + u)]) for u in range(1, 6)])
    records = curves.records_of(task, tmp_path, [1])
    assert list(records) == ["seed_1_agent_0", "seed_1_agent_2", "seed_1_agent_10"]
    curve = curves.make_curve(records, budget=500, points=1, window=3)
    assert curve.steps == [500]
    assert [curve.scores[name][0] for name in records] == [4.0, 6.0, 14.0]  # updates 3, 4, 5 of each agent
    assert curve.mean == [8.0]
    assert curves.describe_curves(list(records)) == "3 agents of seed 1"


def test_a_ppo_jax_point_is_its_own_mean_of_the_last_100_episodes(tmp_path):
    # Updates 1 to 6 log their episodes' mean (u) and the mean of the last 100 (10 u), but not update
    # 4, in which no episode ended: a point is the last mean of the last 100 logged up to it,
    # whatever the window.
    means = {100 * u: 10.0 * u for u in (1, 2, 3, 5, 6)}
    write_sitting(tmp_path / "one", [(100 * u, [float(u)] if u != 4 else []) for u in range(1, 7)], means=means)
    record = curves.read_record(tmp_path / "one", 10_000)
    assert record.averaged
    assert [curves.score_at(record, step, window) for step, window in [(100, 100), (300, 100), (450, 2), (600, 100)]] \
        == [10.0, 30.0, 30.0, 60.0]
    # Resumed, after a first sitting without those means (a run from before): the episodes' means are
    # read throughout, averaged over the window.
    write_sitting(tmp_path / "two", [(100 * u, [float(u)]) for u in range(1, 4)])
    write_sitting(tmp_path / "two", [(100 * u, [float(u)]) for u in range(4, 7)], means=means)
    record = curves.read_record(tmp_path / "two", 10_000)
    assert not record.averaged and curves.score_at(record, 600, 3) == 5.0


def two_seeds(tmp_path):
    """Seed 1: 10 updates of 100 steps, one score each, 1..10. Seed 2: 5 updates, a score from the
    second on, 10 times the update's number."""
    write_sitting(tmp_path / "seed-1", [(100 * u, [float(u)]) for u in range(1, 11)])
    write_sitting(tmp_path / "seed-2", [(100 * u, [10.0 * u] if u >= 2 else []) for u in range(1, 6)])
    records = {f"seed_{seed}": curves.read_record(tmp_path / f"seed-{seed}", 10_000) for seed in (1, 2)}
    return curves.make_curve(records, budget=1000, points=5, window=100)


def test_the_csv_holds_each_seed_the_mean_and_the_times(tmp_path):
    curve = two_seeds(tmp_path)
    path = tmp_path / "task.csv"
    curves.write_csv(curve, path)
    # The mean needs every run at the step: seed 2 stopped at 500.
    assert path.read_text() == ("step,seed_1,seed_2,mean,seconds_seed_1,seconds_seed_2\n"
                                "200,1.5,20.0,10.75,2.0,2.0\n"
                                "400,2.5,30.0,16.25,4.0,4.0\n"
                                "600,3.5,,,6.0,\n"
                                "800,4.5,,,8.0,\n"
                                "1000,5.5,,,10.0,\n")
    again = curves.read_csv(path)
    assert (again.steps, again.scores, again.mean) == (curve.steps, curve.scores, curve.mean)
    assert again.seconds == {"seed_1": [2.0, 4.0, 6.0, 8.0, 10.0], "seed_2": [2.0, 4.0, None, None, None]}
    (tmp_path / "bad.csv").write_text("step,seed_1\n1,2\n")
    with pytest.raises(curves.UsageError, match="not a learning-curve CSV"):
        curves.read_csv(tmp_path / "bad.csv")


def test_the_plots_are_written(tmp_path):
    task = curves.TASKS["breakout"]
    for name, curve in [("some", two_seeds(tmp_path)), ("none", curves.Curve([1, 2], {"seed_1": [None, None]},
                                                                             {"seed_1": [None, None]}, [None, None]))]:
        curves.plot_steps(curve, task, 100, tmp_path / f"{name}.png")
        curves.plot_time(curve, task, 100, tmp_path / f"{name}_time.png")
        for path in [tmp_path / f"{name}.png", tmp_path / f"{name}_time.png"]:
            data = path.read_bytes()
            assert data.startswith(b"\x89PNG") and len(data) > 10_000


def test_a_task_is_drawn_beside_the_curve_of_another_script_up_to_its_own_budget(tmp_path, monkeypatch, capsys):
    peer = two_seeds(tmp_path)                      # steps 200..1000; both seeds up to 400
    own = curves.Curve([100, 200, 300], {"seed_1": [1.0, 2.0, 3.0]}, {"seed_1": [1.0, 2.0, 3.0]}, [1.0, 2.0, 3.0])
    task = curves.replace(curves.TASKS["breakout-jax"], budget=300)
    assert task.beside == ("breakout",)
    drawn = {}
    monkeypatch.setattr(curves, "finish", lambda figure, axes, *rest: drawn.update(
        {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in axes.get_lines()}))
    curves.plot_steps(own, task, 100, tmp_path / "own.png", {"breakout": peer})
    assert drawn["ppo_atari.py (breakout --precision bf16), mean over 2 seeds"] == ([200], [10.75])
    curves.report(task, own, {"breakout": peer})
    assert "ppo_atari.py (breakout --precision bf16), mean over 2 seeds: 10.8 at step 200" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["breakot"], "unknown task 'breakot' (did you mean breakout or breakout-jax?)"),
    (["breakout", "--budget", "20M"], "--budget 20,000,000 is past the schedule of 10,000,000 steps"),
    (["breakout", "--script", "ppo_jax.py"], "a task name ('breakout') and --script cannot be used together"),
    (["--script", "vpg_continuous.py", "--env", "Pendulum-v1"], "name a task (see --list) or give --schedule"),
    (["--script", "nothing.py", "--env", "Pong", "--schedule", "1M"], "no script 'nothing.py'"),
    (["halfcheetah", "--seeds", "1", "1"], "--seeds must be distinct"),
    # A name with a / once trained the runs first, then failed to write its CSV with a traceback.
    (["--script", "vpg_continuous.py", "--env", "Pendulum-v1", "--schedule", "1M", "--name", "a/b", "--plot-only"],
     "--name 'a/b': a task's name names a directory and files"),
])
def test_bad_input_is_one_line_and_status_2(argv, message, tmp_path, capsys):
    assert curves.main([*argv, "--runs", str(tmp_path), "--results", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and error.startswith("learning_curves.py: error: ") and message in error


def test_runs_and_results_that_cannot_be_written_are_refused_before_anything_runs(tmp_path, capsys):
    # Under a regular file: each was a traceback, --results only once the runs had trained.
    (tmp_path / "file").write_text("")
    write_sitting(tmp_path / "runs" / "halfcheetah" / "seed-1", counting_updates(1, 10))
    for flag, extra in [("--runs", []), ("--results", ["--plot-only"])]:
        paths = {"--runs": tmp_path / "runs", "--results": tmp_path / "results", flag: tmp_path / "file" / "under"}
        argv = ["halfcheetah", "--seeds", "1", "--budget", "1000", *extra,
                "--runs", str(paths["--runs"]), "--results", str(paths["--results"])]
        assert curves.main(argv) == 2
        error = capsys.readouterr().err
        assert error == f"learning_curves.py: error: {flag} {tmp_path / 'file' / 'under'}: cannot write there, " \
                        f"{tmp_path / 'file'} is not a directory\n"
    assert not (tmp_path / "results").exists()


def test_a_damaged_csv_is_one_line_that_names_it(tmp_path, capsys):
    curves.write_csv(two_seeds(tmp_path), tmp_path / "task.csv")
    whole = (tmp_path / "task.csv").read_bytes()
    for damaged, words in [(whole[:-10], "line 6: damaged"),  # cut short: a row of fewer cells
                           (whole.replace(b"2.5", b"x"), "line 3: damaged"),
                           (b"\xff\xfe" + whole, "is not a learning-curve CSV")]:
        (tmp_path / "task.csv").write_bytes(damaged)
        with pytest.raises(curves.UsageError, match=words):
            curves.read_csv(tmp_path / "task.csv")
    (tmp_path / "halfcheetah.csv").write_bytes(whole[:-10])
    argv = ["halfcheetah", "--plot-only", "--runs", str(tmp_path / "none"), "--results", str(tmp_path)]
    assert curves.main(argv) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (f"learning_curves.py: error: {tmp_path / 'halfcheetah.csv'}, "
                                                        "line 6: damaged (cut short, or a cell that is not a number); "
                                                        "remove it, or remake it from the runs")


def test_more_points_than_steps_give_every_step_once_and_never_step_0():
    assert curves.grid(1000, 5) == [200, 400, 600, 800, 1000]
    assert curves.grid(10, 100) == list(range(1, 11))  # it once began at step 0
    assert curves.grid(3, 7) == [1, 2, 3]


def test_ctrl_c_while_the_libraries_load_is_exit_130_without_a_traceback(tmp_path):
    result = interrupted_while_loading([sys.executable, str(SCRIPT), "--help"], tmp_path)
    assert (result.returncode, result.stderr) == (130, ""), result.stderr  # it was Python's traceback


def test_nothing_to_draw_and_a_run_without_its_checkpoint_are_refused(tmp_path, capsys):
    assert curves.main(["halfcheetah", "--plot-only", "--runs", str(tmp_path), "--results", str(tmp_path)]) == 2
    assert "nothing to draw: no runs of halfcheetah" in capsys.readouterr().err
    write_sitting(tmp_path / "halfcheetah" / "seed-1", [(100, [1.0])])
    assert curves.main(["halfcheetah", "--seeds", "1", "--runs", str(tmp_path), "--results", str(tmp_path)]) == 2
    assert "holds the events of a run but no checkpoint" in capsys.readouterr().err
    for budget, words in [("2 million", "not a number"), ("0", "not a whole, positive number"),
                          ("-2M", "not a whole, positive number"), ("1.5", "not a whole, positive number")]:
        with pytest.raises(SystemExit) as exit:
            curves.main(["breakout", f"--budget={budget}"])
        assert exit.value.code == 2
        assert f"argument --budget: {words} of steps: '{budget}'" in capsys.readouterr().err
    assert curves.parse_steps("2M") == curves.parse_steps("2e6") == curves.parse_steps("2_000_000") == 2_000_000


def test_a_real_run_stops_at_its_budget_and_resumes_past_it(tmp_path):
    """vpg_continuous.py on Pendulum-v1 with a 20,000-step schedule: stopped at 2,048 steps (two
    updates of 4 envs x 256 steps), then resumed to 4,096, then asked again (nothing to do)."""
    runs, results = tmp_path / "runs", tmp_path / "results"

    def run(budget):
        return subprocess.run([sys.executable, str(SCRIPT), "--script", "vpg_continuous.py", "--env", "Pendulum-v1",
                               "--schedule", "20000", "--budget", str(budget), "--name", "pendulum", "--points", "4",
                               "--runs", str(runs), "--results", str(results), "--",
                               "--num-envs", "4", "--num-steps", "256", "--value-epochs", "1"],
                              capture_output=True, text=True, timeout=240)

    def logged(tag):
        events = EventAccumulator(str(runs / "pendulum" / "seed-1"), size_guidance={"scalars": 0})
        events.Reload()  # every event file of the directory, in turn
        return [(event.step, event.value) for event in events.Scalars(tag)]

    first = run(2048)
    assert first.returncode == 0, first.stderr
    assert "the budget of 2,048 steps is reached: SIGINT sent" in first.stderr
    assert (runs / "pendulum" / "seed-1" / "checkpoint.pt").exists()
    # Stopped exactly at the budget, with the learning rate of a 20,000-step schedule (19 updates).
    assert logged("charts/learning_rate")[-1] == (2048, pytest.approx(1e-3 * (1 - 1 / 19)))
    rows = (results / "pendulum.csv").read_text().splitlines()
    assert rows[0] == "step,seed_1,mean,seconds_seed_1"
    assert [row.split(",")[0] for row in rows[1:]] == ["512", "1024", "1536", "2048"]
    assert rows[1].startswith("512,,,") and rows[1].split(",")[3]  # reached, no episode ended yet
    assert all((results / name).stat().st_size > 10_000 for name in ["pendulum.png", "pendulum_time.png"])

    second = run(4096)
    assert second.returncode == 0, second.stderr
    assert "--resume" in second.stderr and len(list((runs / "pendulum" / "seed-1").glob("events.out.*"))) == 2
    assert logged("charts/learning_rate")[-1] == (4096, pytest.approx(1e-3 * (1 - 3 / 19)))
    resumed = (results / "pendulum.csv").read_text().splitlines()
    assert resumed[1:3] == [rows[2], rows[4]]  # steps 1024 and 2048, unchanged by the second sitting
    scores = [value for _, value in logged("charts/episodic_return")]
    assert len(scores) < 100  # so the point at 4096 is the mean of them all
    assert float(resumed[4].split(",")[1]) == pytest.approx(sum(scores) / len(scores), abs=1e-3)

    third = run(4096)
    assert third.returncode == 0, third.stderr
    assert "already at step 4,096 (budget 4,096): skipped" in third.stderr
    assert len(list((runs / "pendulum" / "seed-1").glob("events.out.*"))) == 2


def test_a_run_that_logged_nothing_leaves_the_csv_there_as_it_is(tmp_path, capsys):
    # Stopped while it started, a run's directory holds its log alone: `--plot-only` once drew it as
    # an empty curve over the CSV of real runs.
    runs, results = tmp_path / "runs", tmp_path / "results"
    write_sitting(runs / "halfcheetah" / "seed-1", counting_updates(1, 10))
    argv = ["halfcheetah", "--seeds", "1", "--budget", "1000", "--plot-only", "--runs", str(runs), "--results", str(results)]
    assert curves.main(argv) == 0
    written = (results / "halfcheetah.csv").read_text()
    assert "seed_1" in written and ",," not in written.splitlines()[-1]
    for path in (runs / "halfcheetah" / "seed-1").iterdir():
        path.unlink()
    (runs / "halfcheetah" / "seed-1" / "learning_curves.log").write_text("$ python vpg_continuous.py ...\n")
    capsys.readouterr()
    assert curves.main(argv) == 0
    assert "no runs of halfcheetah" in capsys.readouterr().err
    assert (results / "halfcheetah.csv").read_text() == written


def test_a_seed_trained_elsewhere_joins_the_csv_and_a_seed_with_no_runs_here_keeps_its_column(tmp_path, capsys):
    # Seed 1's runs on one machine, seed 2's on another: each CSV remade from runs once replaced the
    # whole file, and the first seed's curve was gone with its runs.
    results = tmp_path / "results"

    def draw(seed, runs, budget="1000", scores=None):
        write_sitting(runs / "halfcheetah" / f"seed-{seed}", counting_updates(1, 10, scores))
        return curves.main(["halfcheetah", "--seeds", str(seed), "--budget", budget, "--points", "5", "--plot-only",
                            "--runs", str(runs), "--results", str(results)])

    assert draw(1, tmp_path / "one", scores=2.0) == 0
    first = curves.read_csv(results / "halfcheetah.csv")
    capsys.readouterr()
    assert draw(2, tmp_path / "two", scores=4.0) == 0
    assert f"{results / 'halfcheetah.csv'}: no runs of seed_1 here; kept from the CSV" in capsys.readouterr().err
    both = curves.read_csv(results / "halfcheetah.csv")
    assert list(both.scores) == ["seed_1", "seed_2"]
    assert (both.scores["seed_1"], both.seconds["seed_1"]) == (first.scores["seed_1"], first.seconds["seed_1"])
    assert both.scores["seed_2"] == [None, 4.0, 4.0, 4.0, 4.0]
    assert both.mean == [None, 3.0, 3.0, 3.0, 3.0]
    # Another grid of steps: the columns cannot be set side by side, and the CSV is the runs' alone.
    assert draw(3, tmp_path / "three", budget="500") == 0
    assert "its seed_1, seed_2 not kept" in capsys.readouterr().err
    assert list(curves.read_csv(results / "halfcheetah.csv").scores) == ["seed_3"]


def test_more_agents_than_ppo_jax_writes_events_for_are_refused(tmp_path, capsys):
    import ppo_jax

    assert curves.AGENT_EVENTS == ppo_jax.AGENT_WRITERS
    argv = ["--runs", str(tmp_path), "--results", str(tmp_path), "breakout-jax", "--", "--num-seeds", "20"]
    assert curves.main(argv) == 2
    assert "--num-seeds 20: ppo_jax.py writes the events of its first 16 agents alone" in capsys.readouterr().err


HANGS_UP = """import signal, sys, time
signal.signal(signal.SIGHUP, signal.SIG_DFL)  # as a shell starts it, whatever the tests run under (nohup)
sys.path.insert(0, {benchmarks!r})
import learning_curves
child = ("import signal, sys, time\\n"
         "signal.signal(signal.SIGINT, lambda *_: (print('saved', flush=True), sys.exit(130)))\\n"
         "print('ready', flush=True)\\n"
         "time.sleep(60)\\n")
print(learning_curves.run_sitting([sys.executable, "-c", child], None, learning_curves.Path({log!r}), "x"), flush=True)
"""


def test_a_hang_up_stops_the_script_under_way_rather_than_leaving_it_alone(tmp_path):
    # The script runs in a session of its own, so a terminal that goes hangs up this process alone:
    # it asks the script to save and stop, as for Ctrl-C, rather than dying and leaving it to train on.
    code = HANGS_UP.format(benchmarks=str(ROOT / "benchmarks"), log=str(tmp_path / "log"))
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in process.stderr:
            if "[x] ready" in line:
                break
        process.send_signal(signal.SIGHUP)
        out, _ = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 0 and out.strip() == "(130, False, True)", out
    assert "saved" in (tmp_path / "log").read_text()
