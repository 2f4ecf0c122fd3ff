"""What a run says of its progress: both scripts' status line every 30 s of wall time (a fake clock here), with where
the run is, how fast it goes, when it ends, the last return and the loss, on the terminal and under `status/*` in
TensorBoard; and dreamer_atari.py's preflight, which says what the whole run takes at the rate it timed."""

import dataclasses
import itertools
import re
import threading

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.tensorboard import SummaryWriter

import dqn_starcraft_split as dqn
import dreamer_atari as da
import dreamer_tiny
import memory_utils as mu
from dqn_tiny import TINY_FLAGS

UPDATE, SAY = dqn.update, dqn.say_status


class FakeClock:
    """`seconds_per_read` seconds pass each time the loop's status line reads the clock (once per iteration); the
    thread that watches for long iterations (`keep_alive`) reads the time the loop last read."""

    def __init__(self, seconds_per_read: float):
        self.now, self.step = 1000.0, seconds_per_read

    def __call__(self) -> float:
        if threading.current_thread() is threading.main_thread():
            self.now += self.step
        return self.now


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.set_num_threads(1)
    return tmp_path


def read_scalars(run_dir) -> dict[str, dict[int, float]]:
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def status_lines(text: str) -> list[str]:
    """The status lines of stdout or train.log (whose lines begin with their time)."""
    lines = (re.sub(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ", "", line) for line in text.splitlines())
    return [line for line in lines if line.startswith("status: ")]


def test_the_status_line_takes_its_rates_over_recent_lines_within_a_phase(tmp_path):
    """The rates and the ETA from a fake clock: the prefill's fast steps are not the training rate, and a time limit
    caps the ETA. Scalars that are not known are not written."""
    said = []
    writer = SummaryWriter(str(tmp_path))
    status = mu.StatusLine(writer, "td_loss", every_s=10, phase_starts=(100,), window=2, say=said.append)
    status.clock = FakeClock(1.0)  # one tick a second
    lines, step = {}, 0
    while step < 300:
        step += (
            5 if step < 100 else 1
        )  # 5 steps a second in the prefill, then 1 a second with one update each
        updates = max(0, step - 100)
        if status.tick(step, updates):
            lines[step] = status.emit(step, updates, remaining_steps=1000 - step, last_return=-1.5, loss=0.25)
    writer.close()
    assert said == list(lines.values())
    assert (
        lines[55]
        == "status: step 55  5 env steps/s  0 updates/s  ETA -- (prefill)  return -1.5  td_loss 0.25"
    )
    training = [step for step in lines if step > 100]
    assert training == list(range(101, 300, 10))  # every 10 s, the first 1 s after the phase began
    assert all("  1 env steps/s  1 updates/s  " in lines[step] for step in training)
    assert all(f"ETA {mu.duration_text(1000 - step)}" in lines[step] for step in training)
    scalars = read_scalars(tmp_path)
    assert set(scalars[mu.KEY_STATUS_SPS]) == set(lines) == {55, *training}
    assert set(scalars[mu.KEY_STATUS_ETA_S]) == set(training)  # none in the prefill
    assert all(scalars[mu.KEY_STATUS_ETA_S][step] == pytest.approx(1000 - step) for step in training)
    assert all(value == 0.25 for value in scalars["status/td_loss"].values())
    assert "ETA 60 s  return --  td_loss --" in status.emit(step, 200, remaining_steps=700, time_left_s=60)
    assert "ETA --  " in status.emit(step, 200, remaining_steps=None)
    # a line due just as training begins: the rates since the last line, and no training rate for an ETA yet
    status = mu.StatusLine(None, "loss", every_s=10, phase_starts=(100,), say=said.append)
    status.clock = FakeClock(14.0)
    assert not status.tick(1, 0) and status.tick(100, 1)
    assert status.emit(100, 1, remaining_steps=900).startswith(
        "status: step 100  7.07 env steps/s  0.0714 updates/s  ETA --  "
    )


def test_a_long_iteration_still_gets_a_line_every_30_seconds():
    """While one loop iteration outlasts the interval (an update on a slow machine), `busy_line` says how long the
    loop has been busy, every 30 s; a loop that ticks often never needs it."""
    said = []
    status = mu.StatusLine(None, "loss", every_s=30, say=said.append)
    status.clock = iter([1000.0, 1001.0, 1020.0, 1031.5, 1040.0, 1062.0, 1070.0]).__next__
    assert not status.tick(1, 0) and not status.tick(2, 0)  # 1000, 1001
    assert status.busy_line() is None  # 1020: 20 s since the run's first tick
    expected = (
        "status: step 2  busy for {} in one loop iteration (an update, a checkpoint); updates so far: 0"
    )
    assert status.busy_line() == expected.format("30 s")  # 1031.5
    assert status.busy_line() is None  # 1040: said 8.5 s ago
    assert status.busy_line() == expected.format("61 s")  # 1062
    assert status.tick(3, 1)  # 1070: the loop is back, and its own line is due
    status.clock = FakeClock(1.0)  # a tick a second: never busy
    for step in range(4, 100):
        status.tick(step, 1)
        assert status.busy_line() is None


def test_keep_alive_says_the_busy_line_from_its_thread_and_stops_with_it():
    lines, said = [], threading.Event()
    status = mu.StatusLine(None, every_s=30, say=lambda line: (lines.append(line), said.set()))
    status.clock = itertools.chain(
        [1000.0], itertools.repeat(2000.0)
    ).__next__  # the loop ticks, then is busy
    status.tick(5, 2)
    with status.keep_alive(poll_s=0.01) as thread:
        assert said.wait(timeout=60)
    assert not thread.is_alive()
    assert lines == [
        "status: step 5  busy for 17 min in one loop iteration (an update, a checkpoint); updates so far: 2"
    ]


def test_update_log_reads_the_loss_since_the_last_status_line_and_leaves_the_log_interval_whole():
    log = mu.UpdateLog("cpu")
    healthy, faulty = torch.tensor(True), torch.tensor(False)
    assert log.recent("losses/world_model") is None
    for value, ok in ((1.0, healthy), (3.0, healthy), (100.0, faulty)):
        log.add({"losses/world_model": torch.tensor(value), "losses/kl": torch.tensor(0.5)}, ok)
    assert log.recent("losses/world_model") == 2.0  # the faulty update is left out, as in the log's means
    assert log.recent("losses/world_model") is None  # nothing since
    log.add({"losses/world_model": torch.tensor(6.0), "losses/kl": torch.tensor(0.5)}, healthy)
    assert log.recent("losses/world_model") == 6.0
    means, skipped, _, _ = log.pop()
    assert means == {"losses/world_model": 10.0 / 3, "losses/kl": 0.5} and skipped == 0
    log.add({"losses/world_model": torch.tensor(4.0), "losses/kl": torch.tensor(0.5)}, healthy)
    assert log.recent("losses/world_model") == 4.0  # a new interval starts from its own sums


def test_a_dreamer_run_says_its_status_every_30_seconds_and_logs_it(in_tmp, monkeypatch, capsys):
    """10 s of fake time per env step: a line every 3 env steps from the first on, with the figures the clock and the
    run's counters give, and the same figures under status/* in TensorBoard."""
    monkeypatch.setattr(mu.StatusLine, "clock", staticmethod(FakeClock(10.0)))
    watched, keep_alive = [], mu.StatusLine.keep_alive  # the loop runs with the thread for long iterations
    monkeypatch.setattr(mu.StatusLine, "keep_alive", lambda self: watched.append(self) or keep_alive(self))
    args = dreamer_tiny.tiny_args(
        env_id=da.CATCH_ID,
        num_envs=1,
        total_timesteps=150,
        learning_starts=60,
        train_ratio=8.0,  # at 2 x 12: an update every 3 env steps
        sequence_length=12,
        log_interval=1000,
    )
    result = da.main(args)
    assert len(watched) == 1 and "status-line" not in {thread.name for thread in threading.enumerate()}
    lines = status_lines(capsys.readouterr().out)
    scalars = read_scalars(in_tmp / result["run_dir"])
    steps = sorted(scalars[mu.KEY_STATUS_SPS])
    assert steps == list(range(4, 150, 3)) and len(lines) == len(steps)  # the clock starts at step 1
    for line, step in zip(lines, steps):
        assert re.match(rf"status: step {step}/150  0.1 env steps/s  \S+ updates/s  ETA ", line), line
        assert scalars[mu.KEY_STATUS_SPS][step] == pytest.approx(0.1)
    prefill = [step for step in steps if step < 60]
    training = [step for step in steps if step >= 60]
    assert all("ETA -- (prefill)" in lines[steps.index(step)] for step in prefill)
    assert set(scalars[mu.KEY_STATUS_ETA_S]) == set(training)
    for step in training:
        assert scalars[mu.KEY_STATUS_ETA_S][step] == pytest.approx((150 - step) * 10.0)
        if step >= 60 + 13:  # a window of 4 lines (12 env steps, 4 updates) inside training
            assert scalars[mu.KEY_STATUS_UPDATES_PER_S][step] == pytest.approx(1 / 30)
    assert all(scalars[mu.KEY_STATUS_UPDATES_PER_S][step] == 0 for step in prefill)
    returns = scalars["charts/episodic_return"]
    assert scalars[mu.KEY_STATUS_RETURN]
    for step, value in scalars[mu.KEY_STATUS_RETURN].items():
        assert value == returns[max(s for s in returns if s <= step)]  # the last episode's
    losses = scalars["status/world_model_loss"]
    assert {step for step in training if step >= 64} <= set(losses) <= set(training)  # once updates have run
    assert all(value > 0 for value in losses.values())
    assert all("world_model_loss --" in lines[steps.index(step)] for step in prefill)


def test_a_dqn_run_says_its_status_every_30_seconds_and_logs_it(tmp_path, monkeypatch):
    """1 s of fake time per agent step: a line every 30 steps in train.log, with the ETA from the episodes left at
    the episode's length, and the same figures under status/* in TensorBoard."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(mu.StatusLine, "clock", staticmethod(FakeClock(1.0)))
    made, made_by, starting = (
        [],
        {},
        [],
    )  # the training updates; how many by each agent step; in the preallocation
    monkeypatch.setattr(
        dqn, "update", lambda *a, **k: (None if starting else made.append(1)) or UPDATE(*a, **k)
    )
    real_preallocate = dqn.preallocate

    def preallocate(*a, **k):  # its one update, on a dummy batch, is undone: not a training update
        starting.append(1)
        try:
            return real_preallocate(*a, **k)
        finally:
            starting.clear()

    monkeypatch.setattr(dqn, "preallocate", preallocate)
    monkeypatch.setattr(
        dqn, "say_status", lambda run, step: made_by.update({step: len(made)}) or SAY(run, step)
    )
    argv = [*TINY_FLAGS, "--num-episodes", "8", "--run-id", "status", "--eval-every-episodes", "0"]
    args, sources = dqn.parse_args(argv, {})
    assert dqn.main(args, sources) == 0
    lines = status_lines((tmp_path / "results" / "status" / "train.log").read_text())
    scalars = read_scalars(tmp_path / "runs" / "status")
    steps = sorted(scalars[mu.KEY_STATUS_SPS])
    episode_steps = dqn.episode_steps(128)  # 15 agent steps at --step-mul 128: 8 episodes are 120 steps
    assert len(lines) == len(steps) and steps == [31, 61, 91]  # the clock starts at step 1
    for line, step in zip(lines, steps):
        episode = step // episode_steps + 1
        assert line.startswith(f"status: episode {episode}/8 step {step}  1 env steps/s  "), line
        assert scalars[mu.KEY_STATUS_ETA_S][step] == pytest.approx(120 - step)
        assert f"ETA {mu.duration_text(120 - step)}" in line
    # the count the rates are taken from is the loop's, at every step
    assert len(made_by) == 120 and all(dqn.updates_made(args, step) == n for step, n in made_by.items())
    rates = scalars[mu.KEY_STATUS_UPDATES_PER_S]
    assert rates[61] == pytest.approx((dqn.updates_made(args, 61) - dqn.updates_made(args, 10)) / 51)
    assert rates[91] == pytest.approx((dqn.updates_made(args, 91) - dqn.updates_made(args, 10)) / 81)
    returns = scalars["charts/episodic_return"]
    for step, value in scalars[mu.KEY_STATUS_RETURN].items():
        assert value == returns[max(s for s in returns if s <= step)]
    td = scalars["losses/td_loss"]
    assert set(scalars["status/td_loss"]) == set(steps)
    for step, value in scalars["status/td_loss"].items():
        assert value == pytest.approx(td[max(s for s in td if s <= step)])  # the last logged TD loss


def test_the_dqn_eta_stops_at_the_time_limit(tmp_path, monkeypatch):
    """--time-limit-min 1 caps the ETA at the minute's rest (60 s of fake time), before the episodes would end."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(mu.StatusLine, "clock", staticmethod(FakeClock(1.0)))
    argv = [*TINY_FLAGS, "--num-episodes", "8", "--run-id", "limit", "--time-limit-min", "1"]
    argv += ["--eval-every-episodes", "0"]
    assert dqn.main(*dqn.parse_args(argv, {})) == 0
    eta = read_scalars(tmp_path / "runs" / "limit")[mu.KEY_STATUS_ETA_S]
    assert eta == {31: pytest.approx(30.0), 61: 0.0, 91: 0.0}  # episodes alone: 89, 59, 29


def test_the_whole_run_is_its_updates_and_its_acting():
    """`run_seconds`: the updates --train-ratio owes after --learning-starts (behaviour ones after --warmup-steps too)
    and one policy step per vector step."""
    args = dreamer_tiny.tiny_args(
        total_timesteps=1_000, learning_starts=100, warmup_steps=300, train_ratio=32.0
    )
    # 2 x 8 per batch: 2 updates per env step; 900 env steps trained, 600 of them with behaviour; 2 envs
    assert da.run_seconds(args, 3.0, 5.0, 7.0) == pytest.approx(1_800 * 3.0 + 1_200 * 5.0 + 450 * 7.0)


def test_the_preflight_says_the_whole_run_and_on_a_long_cpu_run_how_to_see_learning(monkeypatch, capsys):
    monkeypatch.setattr(da, "time_acting", lambda *a: 0.004)
    monkeypatch.setattr(da, "catch_seconds", lambda: 185.0)
    agent = da.build_agent(dreamer_tiny.tiny_args(), (1, 64, 64), 6, "cpu")
    args = da.Args(total_timesteps=100_000)  # the default run: 99,000 updates
    da.say_run_time(agent, args, (1, 64, 64), {"world_model": 4.0, "behavior": 3.0})
    first, second = capsys.readouterr().out.splitlines()
    days = mu.duration_text(99_000 * (7.0 + 0.004))
    assert first == (
        "preflight: an update of 16 x 64 takes 7.0 s here and acting 4 ms an env step: this run, 100,000 env "
        f"steps with 99,000 updates, takes about {days} at that rate. To see learning on this machine, --env-id "
        "Catch-v0 at a small size learns in about 3 min here:"
    )
    assert second == "  " + da.catch_command()
    short = dataclasses.replace(args, total_timesteps=1_400)  # 400 updates: 47 min
    da.say_run_time(agent, short, (1, 64, 64), {"world_model": 4.0, "behavior": 3.0})
    (line,) = capsys.readouterr().out.splitlines()
    assert line.endswith("this run, 1,400 env steps with 400 updates, takes about 47 min at that rate")


def test_the_catch_minutes_are_timed_here(monkeypatch):
    """`catch_seconds` is the Catch run at the rate of its own update and policy step, timed on this machine: with a
    clock that moves 0.25 s per reading, every timed part takes 0.25 s."""
    readings = iter(range(10_000))
    monkeypatch.setattr(da.time, "perf_counter", lambda: 0.25 * next(readings))
    catch = da.Args(**da.CATCH_ON_CPU)
    assert da.catch_seconds() == pytest.approx(da.run_seconds(catch, 0.25, 0.25, 0.25))


def test_a_tiny_run_says_what_it_takes_before_it_trains(in_tmp, capsys):
    da.main(
        dreamer_tiny.tiny_args(total_timesteps=60, learning_starts=20, train_ratio=8.0, vector_mode="sync")
    )
    out = capsys.readouterr().out
    (line,) = [line for line in out.splitlines() if line.startswith("preflight: an update")]
    # 40 env steps trained at 8 / (2 x 8) = 0.5 updates each
    assert re.fullmatch(
        r"preflight: an update of 2 x 8 takes \d+ ms here and acting \d+ ms an env step: this run, 60 env steps "
        r"with 20 updates, takes about \d+ s at that rate",
        line,
    ), line
    assert out.index(line) < out.index("replay: up to")  # said before the run starts
