"""memory_utils' helpers for a run's life, shared by both scripts: its folder, stop signals, out of memory, and
checkpoints verified by a checksum written beside them."""

import json
import multiprocessing
import os
import signal
import weakref

import numpy as np
import pytest
import torch

import memory_utils as mu
from conftest import flip_200_bytes_inside_a_tensor


def claim_in_a_process(parent: str, name: str, queue) -> None:
    queue.put(mu.claim_run_dir(parent, name, say=lambda line: None)[1])


def test_runs_that_want_one_folder_at_once_each_get_their_own(tmp_path):
    """Eight processes claim the same name at the same moment: eight folders, the name and seven suffixes."""
    context = multiprocessing.get_context("fork")
    queue, start = context.Queue(), context.Event()

    def claim_when_told(q):
        start.wait()
        claim_in_a_process(str(tmp_path / "runs"), "Pong__dreamer__1__1800000000", q)

    processes = [context.Process(target=claim_when_told, args=(queue,)) for _ in range(8)]
    for process in processes:
        process.start()
    start.set()
    names = sorted(queue.get(timeout=60) for _ in processes)
    for process in processes:
        process.join(timeout=60)
    base = "Pong__dreamer__1__1800000000"
    assert sorted(names) == sorted([base] + [f"{base}-{i}" for i in range(2, 9)])
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == sorted(names)


def test_a_taken_name_is_said_in_one_line(tmp_path):
    said = []
    assert mu.claim_run_dir(tmp_path, "run", say=said.append) == (str(tmp_path / "run"), "run")
    assert said == []
    assert mu.claim_run_dir(tmp_path, "run", say=said.append) == (str(tmp_path / "run-2"), "run-2")
    assert said == [f"run folder {tmp_path / 'run'} is taken; this run writes to {tmp_path / 'run-2'}"]


def test_stop_signals_are_recorded_not_raised_and_the_old_handlers_come_back():
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    with mu.StopSignals() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.received == [signal.SIGTERM, signal.SIGINT]
        assert stop.name == "SIGTERM" and stop.exit_code == 128 + signal.SIGTERM
    # the handlers in force before (pytest's worker processes ignore SIGINT; a plain Python raises
    # KeyboardInterrupt), whatever they were
    assert {sig: signal.getsignal(sig) for sig in before} == before


def failing_step(alive: dict):
    activations = torch.ones(256, 256)  # stands for the failed step's tensors
    alive["ref"] = weakref.ref(activations)
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")


def test_out_of_memory_names_the_line_frees_the_step_then_reports(tmp_path, monkeypatch):
    alive, order = {}, []
    real_report = mu.write_oom_report

    def report(run_dir, exc, last_report, **kwargs):
        order.append(("report", alive["ref"]() is None))
        return real_report(run_dir, exc, last_report, **kwargs)

    monkeypatch.setattr(mu, "write_oom_report", report)
    try:
        failing_step(alive)
    except torch.OutOfMemoryError as exc:
        held_elsewhere = exc.__traceback__  # as a logger or a debugger may hold it: the frames must still go
        oom = mu.out_of_memory(
            exc,
            __file__,
            str(tmp_path),
            advice="Lower --batch-size.",
            release=lambda: order.append(("release", None)),
        )
        del held_elsewhere
    assert oom.where.startswith("in failing_step, line ")
    assert order == [("release", None), ("report", True)], "the step's tensors were alive at the report"
    assert oom.error.__traceback__ is None and "Tried to allocate" in str(oom.error)
    assert (tmp_path / "oom" / "report.json").exists() and "asked for 20 MiB more" in oom.diagnosis
    assert oom.diagnosis.endswith("Lower --batch-size.")  # the calling script's own advice


def test_out_of_memory_without_a_folder_writes_no_report(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    try:
        failing_step({})
    except torch.OutOfMemoryError as exc:
        oom = mu.out_of_memory(exc, "another_script.py", advice="Lower --batch-size.")
    assert oom.where == "outside this script" and oom.diagnosis is None
    assert list(tmp_path.iterdir()) == []


def save(path, value: float) -> None:
    mu.save_checked(path, lambda f: torch.save({"w": torch.full((64,), value)}, f))


def test_a_checkpoint_verifies_and_a_changed_byte_is_refused(tmp_path):
    path = tmp_path / "checkpoint.pt"
    save(path, 1.0)
    save(path, 2.0)
    assert mu.verify_checkpoint(path) is None
    assert (tmp_path / "checkpoint.pt.sha256").read_text().count("\n") == 1, "the old checksum was kept"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(mu.CheckpointInvalid, match="does not match its checksum"):
        mu.verify_checkpoint(path)


def test_a_checkpoint_without_a_checksum_is_checked_against_its_own_crcs(tmp_path):
    """torch.save writes a zip archive, a CRC-32 with each record: without the .sha256 those still tell a damaged
    tensor, which torch.load reads without a word."""
    path = tmp_path / "checkpoint.pt"
    torch.save({"w": torch.arange(1000.0)}, path)
    assert mu.verify_checkpoint(path) is None
    record = flip_200_bytes_inside_a_tensor(path)
    torch.load(path, weights_only=True)
    damaged = path.read_bytes()
    with pytest.raises(mu.CheckpointInvalid) as refused:
        mu.verify_checkpoint(path)
    assert str(refused.value) == (
        f"{path} is damaged: its record {record} does not match the CRC-32 stored with it (changed since it was "
        f"written); it is left as it is."
    )
    assert path.read_bytes() == damaged


def test_a_checkpoint_neither_check_can_verify_is_said_once_and_a_bad_checksum_file_refused(tmp_path):
    path = tmp_path / "checkpoint.pt"
    torch.save({"w": torch.ones(3)}, path, _use_new_zipfile_serialization=False)  # no zip: no CRC-32s
    assert "could not be verified" in mu.verify_checkpoint(path)
    (tmp_path / "checkpoint.pt.sha256").write_bytes(b"\n")
    with pytest.raises(mu.CheckpointInvalid, match="not a checksum file"):
        mu.verify_checkpoint(path)


@pytest.mark.parametrize("dies", ["before the rename", "after the rename"])
def test_a_process_that_dies_while_writing_leaves_a_checkpoint_that_verifies(tmp_path, monkeypatch, dies):
    """The new checksum joins the old before the file is renamed, the old leaves after: the pair always agrees."""
    path = tmp_path / "checkpoint.pt"
    save(path, 1.0)
    real_write, calls = mu.atomic_write, []

    def dying_write(target, data, needed_bytes=None, before_replace=None):
        calls.append(str(target))
        if dies == "after the rename" and str(target).endswith(".sha256") and len(calls) == 3:
            raise SystemExit("killed")  # the sidecar's last write: old and new are both accepted
        if dies == "before the rename" and before_replace is not None:

            def hook(tmp):
                before_replace(tmp)
                raise SystemExit("killed")

            return real_write(target, data, needed_bytes, hook)
        return real_write(target, data, needed_bytes, before_replace)

    monkeypatch.setattr(mu, "atomic_write", dying_write)
    with pytest.raises(SystemExit):
        save(path, 2.0)
    monkeypatch.setattr(mu, "atomic_write", real_write)
    assert mu.verify_checkpoint(path) is None
    expected = 1.0 if dies == "before the rename" else 2.0
    assert torch.load(path, weights_only=True)["w"][0].item() == expected
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp_")] == []


@pytest.mark.parametrize(
    "name, said",
    [
        ("", "must not be empty"),
        (".", "names a folder that exists already"),
        ("..", "names a folder that exists already"),
        ("a/b", "holds '/', so it would name a path"),
        ("/tmp/x", "holds '/', so it would name a path"),
        ("../../x", "holds '/', so it would name a path"),
        ("a\0b", "holds a NUL byte"),
        ("x" * 250, "is 250 bytes long, and a folder name there can be at most 245 bytes"),
        ("é" * 126, "is 252 bytes long"),  # bytes, not characters, are what the file system counts
    ],
)
def test_a_name_that_would_leave_its_folder_or_not_fit_is_one_sentence(tmp_path, name, said):
    problem = mu.name_problem(name, "--run-id", tmp_path, reserve=10)
    assert problem is not None and said in problem and "\n" not in problem, problem
    assert mu.name_problem("baseline-lr3e-4", "--run-id", tmp_path, reserve=10) is None


def test_a_folder_a_run_cannot_write_is_found_without_leaving_anything(tmp_path):
    (tmp_path / "notes.txt").write_text("a user's file")
    assert mu.folder_problem(tmp_path / "new" / "deeper", "--save-path") is None
    under_a_file = mu.folder_problem(tmp_path / "notes.txt" / "runs", "--log-dir")
    assert (
        under_a_file
        == f"--log-dir '{tmp_path}/notes.txt/runs' is inside {tmp_path}/notes.txt, which is a file, not a folder; give a folder"
    )
    assert "is a file, not a folder" in mu.folder_problem(tmp_path / "notes.txt", "--log-dir")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"], "the probe left something behind"


def test_foreign_entries_tell_a_scripts_run_folder_from_a_users(tmp_path):
    run_files = ("config.json", "train.log", "eval")
    made = mu.make_run_dir(tmp_path, "made", script="dqn_starcraft_split.py")
    assert json.loads((tmp_path / "made" / mu.RUN_MARK).read_text())["script"] == "dqn_starcraft_split.py"
    (tmp_path / "made" / "notes.txt").write_text("x")
    assert mu.foreign_entries(made, run_files) == []  # marked: made by the script
    old = tmp_path / "old"
    (old / "eval").mkdir(parents=True)
    (old / "config.json").write_text("{}")
    assert mu.foreign_entries(old, run_files) == []  # an older version's: its run files alone
    (old / "notes.txt").write_text("x")
    assert mu.foreign_entries(old, run_files) == ["notes.txt"]
    (tmp_path / "users").mkdir()
    (tmp_path / "users" / "eval").mkdir()
    assert mu.foreign_entries(tmp_path / "users", run_files) == [str(tmp_path / "users")]  # no config.json
    with pytest.raises(FileExistsError):
        mu.make_run_dir(tmp_path, "made")


def fake_cgroups(tmp_path, lines: str, limits: dict[str, str]) -> tuple[str, str]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    listing = tmp_path / "cgroup"
    listing.write_text(lines)
    for group, value in limits.items():
        (tmp_path / "fs" / group).mkdir(parents=True, exist_ok=True)
        (
            tmp_path / "fs" / group / ("memory.max" if "memory" not in group else "memory.limit_in_bytes")
        ).write_text(value)
    return str(listing), str(tmp_path / "fs")


def test_the_memory_limit_is_the_lowest_of_the_machine_and_each_cgroup_above(tmp_path):
    total = mu.host_memory_limit(str(tmp_path / "none"))[0]
    assert total == mu.psutil.virtual_memory().total
    listing, root = fake_cgroups(tmp_path, "0::/jobs/job7\n", {"jobs": "4000000000", "jobs/job7": "max"})
    assert mu.host_memory_limit(listing, root) == (4_000_000_000, f"this process's cgroup ({root}/jobs)")
    listing, root = fake_cgroups(
        tmp_path / "v1", "5:memory:/slurm/job\n", {"memory/slurm/job": "2000000000\n"}
    )
    assert mu.host_memory_limit(listing, root) == (2_000_000_000, "this process's cgroup")


def test_a_replay_larger_than_the_machine_is_refused_in_bytes_and_one_larger_than_is_free_warned(monkeypatch):
    limit = mu.host_memory_limit()[0]
    problem, warning = mu.replay_memory_problem(2 * limit, "the replay", lambda n: f"{n} bytes would fit")
    assert warning is None and problem.startswith(f"the replay would take {2 * limit:,} bytes (")
    assert problem.endswith("bytes would fit") and "in all" in problem
    monkeypatch.setattr(
        mu.psutil, "virtual_memory", lambda: type("vm", (), {"total": limit, "available": 1000})()
    )
    problem, warning = mu.replay_memory_problem(5000, "the replay", lambda n: f"{n} bytes would take half")
    assert (
        problem is None
        and warning
        == "warning: the replay would take 5,000 bytes when full, more than the 1,000 bytes available now; 500 bytes would take half"
    )


def test_a_signal_in_the_start_up_raises_at_once_and_is_recorded_after_it():
    with mu.StopSignals() as stop:
        with pytest.raises(mu.Stopped) as stopped, stop.at_once():
            os.kill(os.getpid(), signal.SIGINT)
        assert stopped.value.name == "SIGINT" and stopped.value.exit_code == 130
        os.kill(os.getpid(), signal.SIGTERM)  # outside the block: recorded only
        assert stop.received == [signal.SIGINT, signal.SIGTERM]
        with pytest.raises(mu.Stopped), stop.at_once():  # one received before the block raises at its start
            pass


def test_start_up_discards_what_a_new_run_made_and_keeps_a_resumed_runs(tmp_path):
    closed = []
    made = mu.StartUp(new=True, parents=[tmp_path / "runs"])
    made.run_dir = mu.make_run_dir(tmp_path / "runs", "r")
    made.closers.append(lambda: closed.append("writer"))
    said = made.discard("SIGINT")
    assert closed == ["writer"] and list(tmp_path.iterdir()) == []
    assert said.endswith(f"and the run's folder {made.run_dir} was removed")
    resumed = mu.StartUp(new=False)
    resumed.run_dir = mu.make_run_dir(tmp_path / "runs", "r")
    assert resumed.discard("SIGTERM").endswith("nothing was trained") and (tmp_path / "runs" / "r").is_dir()


def raises_deep_inside():
    raise ValueError("a bad value.\nsecond line")


def test_a_crash_is_one_paragraph_with_its_traceback_in_the_log(tmp_path):
    try:
        raises_deep_inside()
    except ValueError as exc:
        said = mu.crash_report(exc, __file__, str(tmp_path / "crash.log"))
    assert said == (
        f"ValueError: a bad value, raised in raises_deep_inside (test_run_lifecycle.py, line "
        f"{raises_deep_inside.__code__.co_firstlineno + 1}); the traceback is in {tmp_path / 'crash.log'}"
    )
    log = (tmp_path / "crash.log").read_text()
    assert log.startswith("Traceback") and log.rstrip().endswith("second line")


def test_a_file_where_the_runs_folder_goes_is_said_and_never_taken_for_a_name_in_use(tmp_path):
    (tmp_path / "runs").write_text("a user's file")
    with pytest.raises(NotADirectoryError):
        mu.claim_run_dir(tmp_path / "runs", "run", say=lambda line: None)
    assert (tmp_path / "runs").read_text() == "a user's file"


LOG_FIELDS = {"frame": ((3, 4), np.uint8), "reward": ((), np.float32)}


def log_rows(log: "mu.ReplayLog", first: int, count: int) -> None:
    for i in range(first, first + count):
        log.append({"frame": np.full((3, 4), i % 256, np.uint8), "reward": float(i)})


def read_back(log: "mu.ReplayLog", state: dict) -> tuple[list[int], np.ndarray]:
    starts, rewards = [], []
    for start, chunk in log.rows(state):
        starts.append(start)
        rewards.append(chunk["reward"])
        assert np.array_equal(chunk["frame"][:, 0, 0], (start + np.arange(len(chunk["reward"]))) % 256)
    return starts, np.concatenate(rewards)


def test_the_replay_log_gives_back_exactly_the_rows_a_checkpoint_needs_and_keeps_no_others(tmp_path):
    """27 rows in chunks of 8: three files written once, three rows in the checkpoint; the replay still needs rows
    from 10 on, so a committed checkpoint leaves the files of rows 8-23 and reads back rows 10-26 exactly."""
    log = mu.ReplayLog(tmp_path / "replay", LOG_FIELDS, chunk_rows=8)
    log_rows(log, 0, 27)
    assert sorted(p.name for p in (tmp_path / "replay").iterdir()) == [
        f"chunk_{i:08d}.rows" for i in range(3)
    ]
    state = torch.load(
        _saved_state(tmp_path, log.state(keep_from=10)), weights_only=True
    )  # as a checkpoint holds it
    log.commit(state)
    assert sorted(p.name for p in (tmp_path / "replay").iterdir()) == [f"chunk_{i:08d}.rows" for i in (1, 2)]
    starts, rewards = read_back(log, state)
    assert starts == [10, 16, 24] and rewards.tolist() == [float(i) for i in range(10, 27)]


def _saved_state(tmp_path, state: dict):
    path = tmp_path / "state.pt"
    torch.save(state, path)
    return path


def test_a_resumed_log_goes_on_from_the_checkpoint_and_drops_what_a_killed_run_wrote_after_it(tmp_path):
    """A run checkpoints at row 20 and goes on to row 40 before it is killed: the resumed log reads rows 0-19 back,
    removes the files written after the checkpoint, and its next rows land where the killed run's had."""
    log = mu.ReplayLog(tmp_path / "replay", LOG_FIELDS, chunk_rows=8)
    log_rows(log, 0, 20)
    state = log.state(keep_from=0)
    log_rows(log, 20, 20)  # chunks 2-4 written after the checkpoint
    resumed = mu.ReplayLog(tmp_path / "replay", LOG_FIELDS, chunk_rows=8)
    resumed.resume(state)
    assert sorted(p.name for p in (tmp_path / "replay").iterdir()) == [f"chunk_{i:08d}.rows" for i in (0, 1)]
    assert read_back(resumed, state)[1].tolist() == [float(i) for i in range(20)]
    log_rows(resumed, 20, 20)
    assert read_back(resumed, resumed.state(keep_from=0))[1].tolist() == [float(i) for i in range(40)]


def test_a_chunk_file_changed_or_missing_is_one_sentence(tmp_path):
    log = mu.ReplayLog(tmp_path / "replay", LOG_FIELDS, chunk_rows=8)
    log_rows(log, 0, 20)
    state = log.state(keep_from=0)
    data = bytearray((tmp_path / "replay" / "chunk_00000001.rows").read_bytes())
    data[-100] ^= 1
    (tmp_path / "replay" / "chunk_00000001.rows").write_bytes(bytes(data))
    with pytest.raises(mu.ReplayLogInvalid, match="chunk_00000001.rows does not match the CRC-32"):
        read_back(log, state)
    (tmp_path / "replay" / "chunk_00000000.rows").unlink()
    with pytest.raises(mu.ReplayLogInvalid, match="chunk_00000000.rows is missing"):
        read_back(log, state)


def test_tensorboard_gets_the_settings_table_and_a_resumed_run_hides_what_came_after_its_checkpoint(tmp_path):
    """Both scripts open TensorBoard through `mu.open_tensorboard`: the settings as a table (the DQN's with where
    each came from), and a resumed run's writer purges what the stopped run logged after its checkpoint's step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder = tmp_path / "run"
    writer = mu.open_tensorboard(
        str(folder), {"seed": (1, "RL_SEED"), "lr": (3e-4, "default")}, ("value", "source")
    )
    for step in (1, 2, 3):
        writer.add_scalar("x", float(step), step)
    writer.close()
    resumed = mu.open_tensorboard(str(folder), {"seed": 1}, resume_step=1)  # its checkpoint was at step 1
    resumed.add_scalar("x", 20.0, 2)
    resumed.close()
    events = EventAccumulator(str(folder))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("x")] == [(1, 1.0), (2, 20.0)]
    tables = [e.tensor_proto.string_val[0].decode() for e in events.Tensors("hyperparameters/text_summary")]
    assert tables[0] == "|param|value|source|\n|-|-|-|\n|seed|1|RL_SEED|\n|lr|0.0003|default|"
    assert tables[-1] == "|param|value|\n|-|-|\n|seed|1|"
