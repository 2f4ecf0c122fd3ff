"""memory_utils' helpers for a run's life, shared by both scripts: its folder, stop signals, out of memory, and
checkpoints verified by a checksum written beside them."""

import multiprocessing
import os
import signal
import weakref

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
