"""A change a researcher makes to Part 1 of a copy of dreamer_atari.py is never silently dropped: on every path the
copy can run on this CPU (the default flags, frames on the device) it takes effect, or the path that cannot carry
it steps aside in one line and Part 1 trains (an edit of the GRU cell: tests/test_modifying_dreamer.py). A cell or
layer the fast paths do not know falls back to the readable code, said in one line. (The CUDA-only paths: tests/test_dreamer_cuda.py.)"""

from pathlib import Path

import pytest

from dreamer_tiny import TINY, import_copy

ROOT = Path(__file__).resolve().parent.parent


def changed_copy(tmp_path: Path, monkeypatch, *replacements: tuple[str, str]):
    """dreamer_atari.py with each (old, new) text replaced once and a list `CALLS`, imported from a copy in
    `tmp_path` (the working folder from then on)."""
    source = (ROOT / "dreamer_atari.py").read_text()
    # CALLS: where a changed function can say that it ran
    source = source.replace("import memory_utils as mu\n", "import memory_utils as mu\n\nCALLS = []\n", 1)
    for old, new in replacements:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    return import_copy(source, tmp_path / "dreamer_copy.py", monkeypatch)


def tiny_catch(module, **overrides):
    """A few updates of a tiny agent on Catch with the default flags, on the CPU."""
    schedule = dict(total_timesteps=40, learning_starts=20, train_ratio=16.0, log_interval=20)
    return module.Args(
        **{**TINY, "env_id": "Catch-v0", "num_envs": 1, "vector_mode": "sync", **schedule, **overrides}
    )


COUNTED_SAMPLE = (
    """        return self.fill(self.draw_windows(batch_size, sequence_length, rng), sequence_length)""",
    """        CALLS.append("sample")
        return self.fill(self.draw_windows(batch_size, sequence_length, rng), sequence_length)""",
)


@pytest.mark.parametrize("frames", ["host", "device"])
def test_a_change_to_sampling_takes_effect_with_the_frames_anywhere(tmp_path, monkeypatch, frames):
    module = changed_copy(tmp_path, monkeypatch, COUNTED_SAMPLE)
    counters = module.main(tiny_catch(module, replay_frames=frames))
    assert counters["updates"] > 0 and module.CALLS.count("sample") >= counters["updates"]


def test_an_augmentation_of_the_frames_trains_on_the_host_and_keeps_the_frames_there_when_asked_for_the_device(
    tmp_path, monkeypatch, capsys
):
    """A change `sample` makes to the frames cannot reach frames gathered on the device: Part 1 changed, so the frames
    stay in host memory, said in one line (no exit 7)."""
    shifted = (
        COUNTED_SAMPLE[0],
        """        batch = self.fill(self.draw_windows(batch_size, sequence_length, rng), sequence_length)
        batch["obs"] = np.roll(batch["obs"], 1, axis=-1)  # a one-pixel shift
        return batch""",
    )
    module = changed_copy(tmp_path, monkeypatch, shifted)
    assert module.main(tiny_catch(module, replay_frames="device"))["updates"] > 0
    said = [line for line in capsys.readouterr().out.splitlines() if "FrameStoreReplay.fill" in line]
    assert len(said) == 1 and "Part 1 changed, so the frames stay in host memory" in said[0], said
    assert module.main(tiny_catch(module, replay_frames="host"))["updates"] > 0


def test_a_change_to_acting_takes_effect(tmp_path, monkeypatch):
    counted = (
        """        return action.cpu().numpy()""",
        """        CALLS.append("act")
        return action.cpu().numpy()""",
    )
    module = changed_copy(tmp_path, monkeypatch, counted)
    args = tiny_catch(module, preallocate=False)  # the preflight times acting too
    module.main(args)
    assert module.CALLS.count("act") == args.total_timesteps - args.learning_starts


def test_a_layer_the_hand_written_backward_does_not_know_falls_back_to_autograds(
    tmp_path, monkeypatch, capsys
):
    """An RMSNorm in place of the RSSM's LayerNorms: the fast observe still runs its loop, the hand-written backward
    steps aside in one line, and the run trains."""
    rms = ("norm=nn.LayerNorm(hidden_dim, eps=NORM_EPS))", "norm=nn.RMSNorm(hidden_dim, eps=NORM_EPS))")
    module = changed_copy(tmp_path, monkeypatch, rms)
    assert module.main(tiny_catch(module, fast_observe="on"))["updates"] > 0  # on CUDA by default
    said = capsys.readouterr().out
    assert "hand-written backward does not apply (RSSM.img_in is Linear, RMSNorm, SiLU" in said, said
