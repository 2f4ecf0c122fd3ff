"""The changes `docs/dreamer_atari.md` walks through ("Modifying this script"), made as the page says on a copy of
dreamer_atari.py, each in at most four places, and trained for a few updates on the CPU with every fast path a CPU
runs asked for (`CPU_PATHS`: by default a CPU trains Part 1 alone, and the paths' copies are what an edit could
miss), and with CUDA's paths, their kernels interpreted: the page's code is the code that runs, each change does what
it claims, and Part 1 stays within the length that tests/test_script_parts.py allows."""

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dreamer_tiny import CPU_PATHS, TINY, import_copy

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "dreamer_atari.md"
CHANGES = {
    "kl_schedule": "### A KL schedule",
    "resnet": "### A ResNet encoder",
    "next_reward": "### An auxiliary head: the next reward from `deter`",
    "mingru": "### A new transition: minGRU",
    "recent_windows": "### Recent windows more often",
    "slow_critic_pull": "### A slow-critic pull that fades",
    "gru_gate": "### A slower GRU state",
}


def places(heading: str) -> list[tuple[str, str, list[str]]]:
    """The code blocks under `heading` (until the next heading): (where: before, after or replace; the text the line
    starts with; the lines to put there)."""
    text = DOCS.read_text()
    section = text[text.index(heading) + len(heading) :]
    section = section[: re.search(r"\n(##+ |\*\*)", section).start()]  # the next heading or paragraph title
    found = []
    for block in re.findall(r"```python\n(.*?)```", section, re.DOTALL):
        first, *lines = block.split("\n")
        where, anchor = re.fullmatch(r"# (before|after|replace): (.+)", first).groups()
        found.append((where, anchor, lines))
    return found


def apply(source: str, where: str, anchor: str, lines: list[str]) -> str:
    """`lines` before, after or in place of the one line of `source` that starts with `anchor`, at its indentation."""
    rows = source.split("\n")
    matches = [i for i, row in enumerate(rows) if row.strip().startswith(anchor)]
    assert len(matches) == 1, f"{len(matches)} lines start with {anchor!r}"
    i = matches[0]
    indent = rows[i][: len(rows[i]) - len(rows[i].lstrip())]
    new = [indent + line if line else line for line in lines]
    if where == "before":
        rows[i:i] = new
    elif where == "after":
        rows[i + 1 : i + 1] = new
    else:
        rows[i : i + 1] = [line for line in new if line.strip()]
    return "\n".join(rows)


def changed_source(name: str) -> str:
    """dreamer_atari.py's text with the change `name` made as the page says."""
    blocks = places(CHANGES[name])
    assert 1 <= len(blocks) <= 4, f"{name}: {len(blocks)} places"
    source = (ROOT / "dreamer_atari.py").read_text()
    for block in blocks:
        source = apply(source, *block)
    return source


def changed_script(name: str, tmp_path: Path, monkeypatch):
    """dreamer_atari.py with the change `name` made as the page says, imported from a copy in `tmp_path`."""
    return import_copy(changed_source(name), tmp_path / f"dreamer_{name}.py", monkeypatch)


def tiny_catch(module, **overrides):
    """A few updates of a tiny agent on Catch, on the CPU with `CPU_PATHS`, ending with a checkpoint."""
    return module.Args(
        **{
            **TINY,
            **CPU_PATHS,
            "env_id": module.CATCH_ID,
            "num_envs": 1,
            "vector_mode": "sync",
            "cuda": False,
            "total_timesteps": 60,
            "learning_starts": 20,
            "train_ratio": 16.0,
            "log_interval": 20,
            "save_model": True,
            **overrides,
        }
    )


def trained(module, args) -> tuple[dict, dict]:
    """Train; returns the final counters and the checkpoint's world-model weights."""
    counters = module.main(args)
    checkpoint = torch.load(Path(counters["run_dir"]) / "checkpoint.pt", weights_only=True)
    assert counters["updates"] > 0 and counters["nonfinite_updates"] == 0
    return counters, checkpoint["models"]["world_model"]


def test_a_kl_schedule_raises_the_dynamics_kl_weight_from_zero(tmp_path, monkeypatch):
    module = changed_script("kl_schedule", tmp_path, monkeypatch)
    set_values = []

    def spying(real_set):
        def spy(self, name, value):
            if name == "kl_dyn_scale":
                set_values.append(value)
            real_set(self, name, value)

        return spy

    monkeypatch.setattr(module.Settings, "set", spying(vars(module.Settings)["set"]))
    args = tiny_catch(module, kl_warmup_steps=40)
    trained(module, args)
    assert set_values[0] == 0.0 and set_values[-1] == args.kl_dyn_scale
    assert set_values == sorted(set_values) and 0 < set_values[10] < args.kl_dyn_scale


def test_a_resnet_encoder_is_one_row_and_its_classes(tmp_path, monkeypatch):
    module = changed_script("resnet", tmp_path, monkeypatch)
    args = tiny_catch(module, model="resnet")
    assert args.image_size == 64 and args.frame_stack == 1  # DreamerV3's sizes, from the row it copies
    _, weights = trained(module, args)
    assert any(key.startswith("encoder.2.net.1") for key in weights)  # a residual block's convolution
    assert "decoder.linear.weight" in weights


def test_an_auxiliary_head_trains_on_the_next_reward_within_episodes(tmp_path, monkeypatch):
    module = changed_script("next_reward", tmp_path, monkeypatch)
    args = tiny_catch(module)
    counters, weights = trained(module, args)
    assert weights["next_reward_head.6.weight"].abs().sum() > 0  # started at zero, trained since
    events = EventAccumulator(str(tmp_path / counters["run_dir"])).Reload()
    logged = [event.value for event in events.Scalars("losses/next_reward")]
    assert logged and all(value > 0 for value in logged)


def test_the_next_reward_loss_leaves_out_pairs_that_cross_an_episode_boundary(tmp_path, monkeypatch):
    """A step whose next step starts another episode adds nothing: its reward is the other episode's."""
    module = changed_script("next_reward", tmp_path, monkeypatch)
    args = tiny_catch(module, stochastic_classes=4)
    torch.manual_seed(0)
    agent = module.build_agent(args, (1, 64, 64), 3, "cpu")
    with torch.no_grad():  # off its zero start, where every reward would cost the same
        for p in agent.world_model.next_reward_head.parameters():
            p.add_(0.5 * torch.randn_like(p))
    B, T = 1, 4
    data = {
        "image": torch.zeros(B, T, 1, 64, 64),
        "action": torch.zeros(B, T, 3),
        "reward": torch.tensor([[0.0, 0.0, 5.0, 0.0]]),
        "is_first": torch.tensor([[True, False, False, False]]),
        "is_terminal": torch.zeros(B, T, dtype=torch.bool),
    }
    with torch.no_grad():
        base = module.world_model_loss(agent, data, args)[1]["losses/next_reward"]
        data["is_first"][0, 2] = True  # step 2 now starts an episode: the pair (1, 2) is left out
        data["reward"][0, 2] = -5.0  # and its reward, whatever it is, changes nothing
        crossed = module.world_model_loss(agent, data, args)[1]["losses/next_reward"]
        data["reward"][0, 2] = 5.0
        same = module.world_model_loss(agent, data, args)[1]["losses/next_reward"]
    torch.testing.assert_close(crossed, same)
    assert not torch.allclose(base, same)


@pytest.mark.parametrize("name", list(CHANGES))
def test_each_change_touches_at_most_four_places(name):
    assert 1 <= len(places(CHANGES[name])) <= 4


@pytest.mark.parametrize("name", list(CHANGES))
def test_each_change_leaves_part_1_within_the_repositorys_length_limit(name):
    from test_script_parts import PART_1_MAX_LINES, part_1_lines

    assert part_1_lines(changed_source(name)) <= PART_1_MAX_LINES


def test_a_kl_warm_up_of_zero_steps_is_none_and_a_negative_one_is_refused(tmp_path, monkeypatch, capsys):
    module = changed_script("kl_schedule", tmp_path, monkeypatch)
    assert trained(module, tiny_catch(module, kl_warmup_steps=0))[0]["updates"] > 0
    with pytest.raises(SystemExit) as refused:
        module.main(tiny_catch(module, kl_warmup_steps=-5))
    assert refused.value.code == 2
    assert (
        capsys.readouterr().err.strip() == "error: --kl-warmup-steps must be a number of 0 or more, got -5."
    )


def test_a_new_transition_is_one_row_and_its_class_and_trains_on_the_cpus_paths(
    tmp_path, monkeypatch, capsys
):
    module = changed_script("mingru", tmp_path, monkeypatch)
    args = tiny_catch(module, model="mingru")
    assert args.fast_observe == "on" and args.observe_backward == "hand-written"
    _, weights = trained(module, args)
    assert weights["rssm.gru.linear.weight"].shape[0] == 2 * args.deterministic_dim  # the new cell trained
    said = capsys.readouterr().out
    assert "the observe scan's hand-written backward does not apply (its cell is MinGRUCell" in said


def all_weights(run_dir) -> dict:
    """Every model's weights in the checkpoint of `run_dir`."""
    models = torch.load(Path(run_dir) / "checkpoint.pt", weights_only=True)["models"]
    return {f"{model}.{name}": value for model, weights in models.items() for name, value in weights.items()}


def pinned_line(said: str) -> str:
    """The one line that names the paths stepping aside for a change to the code they are pinned to."""
    lines = [line for line in said.splitlines() if "Part 1 changed where these paths are pinned" in line]
    assert len(lines) == 1, said
    return lines[0]


@pytest.mark.parametrize(
    "name, stepped_aside, same_as",
    [
        # no path holds a copy of the losses: nothing steps aside, and the shared heads train the edit
        ("slow_critic_pull", None, None),
        ("gru_gate", "--observe-backward (LayerNormGRUCell.forward)", dict(observe_backward="autograd")),
    ],
)
def test_an_edit_in_place_steps_its_paths_aside_in_one_line_and_trains_exactly(
    name, stepped_aside, same_as, tmp_path, monkeypatch, capsys
):
    """An edit of Part 1 code, with the CPU's paths asked for. Where a path holds a copy of the edited code, one line
    at start names the paths that step aside (no exit 7, no flag to find), and the run trains the edit: the same
    weights, to the bit, as the copy trained with those paths switched off by their flags. Where none does, no line,
    and every path trains the edit. Either way other weights than the unedited script's."""
    module = changed_script(name, tmp_path, monkeypatch)
    set_values = []
    real_set = vars(module.Settings)["set"]

    def spy(self, setting, value):
        set_values.append((setting, value))
        real_set(self, setting, value)

    monkeypatch.setattr(module.Settings, "set", spy)
    agents, real_speed_up = [], module.speed_up_agent
    monkeypatch.setattr(
        module, "speed_up_agent", lambda agent, args: (real_speed_up(agent, args), agents.append(agent))
    )
    counters, _ = trained(module, tiny_catch(module))
    said = capsys.readouterr().out
    edited, pulls = (
        all_weights(counters["run_dir"]),
        [value for setting, value in set_values if setting == "slow_critic_pull"],
    )
    if stepped_aside is None:
        assert "Part 1 changed where these paths are pinned" not in said, said
        assert type(agents[0].imagined_heads).__name__ == "FastHeads"  # the shared heads trained the edit
    else:
        line = pinned_line(said)
        assert stepped_aside in line and "python dreamer_kernels.py pin PATH" in line, line
        counters, _ = trained(module, tiny_catch(module, **same_as))
        assert "Part 1 changed where these paths are pinned" not in capsys.readouterr().out
        assert all(torch.equal(value, all_weights(counters["run_dir"])[key]) for key, value in edited.items())
    import dreamer_atari as original

    counters, _ = trained(original, tiny_catch(original, **(same_as or {})))
    unedited = all_weights(counters["run_dir"])
    assert not all(torch.equal(value, unedited[key]) for key, value in edited.items())
    if name == "slow_critic_pull":  # the factor fell during the edited run
        assert pulls[0] == 1.0 > pulls[-1] > 0 and pulls == sorted(pulls, reverse=True)


def test_recent_windows_are_drawn_more_often_on_both_samplers(tmp_path, monkeypatch):
    module = changed_script("recent_windows", tmp_path, monkeypatch)
    rng = np.random.default_rng(0)
    replays = [
        module.EpisodeReplay(1000, 1, seed=0, chunk_size=16),
        module.FrameStoreReplay(1000, 1, seed=0, chunk_size=16, frames_device="cpu"),
    ]
    frames = rng.integers(0, 255, (400, 1, 8, 8), np.uint8)
    for replay in replays:
        replay.start_episode(0, frames[0])
        for t in range(1, 400):
            replay.add_step(0, frames[t][-1], 0, 0.0, False, False)
    starts = [[pieces[0][1] for pieces in replay.draw_windows(2000, 8)] for replay in replays]  # one episode
    assert starts[0] == starts[1]  # the same draws, whichever sampler
    newest = np.mean(np.array(starts[0]) >= 400 - 40)
    assert 0.5 < newest < 0.6  # half the windows, and the uniform draws that land there: 0.55
    args = tiny_catch(module)
    assert trained(module, args)[0]["updates"] > 0


# CUDA's fast paths, installed here on the CPU with their kernels in Triton's interpreter
CUDA_PATHS = dict(CPU_PATHS, fused_scan="on", fused_epilogues="on")
# what each walked change meets on each of them: the path trains the change ("trains"), or steps aside with one line
# for the readable code ("steps aside"), or the run stops at start-up with exit 7 naming its flag ("stops")
ON_CUDAS_PATHS = {
    "kl_schedule": dict(
        fused_scan="trains", gathers="trains", fused_epilogues="trains", shared_heads="trains"
    ),
    "resnet": dict(fused_scan="trains", gathers="trains", fused_epilogues="trains", shared_heads="trains"),
    "next_reward": dict(
        fused_scan="trains", gathers="trains", fused_epilogues="trains", shared_heads="trains"
    ),
    # the scan's kernels compute the LayerNorm GRU: the new cell takes the fast observe's autograd backward; the
    # gathers and the fused epilogues run the cell as it is written
    "mingru": dict(
        fused_scan="steps aside", gathers="trains", fused_epilogues="trains", shared_heads="trains"
    ),
    "recent_windows": dict(
        fused_scan="trains", gathers="trains", fused_epilogues="trains", shared_heads="trains"
    ),
    # in-place edits: the paths that hold their own copy of the edited code step aside (tests/test_dreamer_pins.py);
    # none holds a copy of the losses
    "slow_critic_pull": dict(
        fused_scan="trains", gathers="trains", fused_epilogues="trains", shared_heads="trains"
    ),
    "gru_gate": dict(
        fused_scan="steps aside", gathers="trains", fused_epilogues="steps aside", shared_heads="steps aside"
    ),
}
CHANGE_FLAGS = {
    "kl_schedule": dict(kl_warmup_steps=4),
    "resnet": dict(model="resnet"),
    "mingru": dict(model="mingru"),
}


def what_each_path_did(agent, said: str) -> dict[str, str]:
    """Which of CUDA's paths the run installed on `agent` (and trained with), and which stepped aside in one line."""
    import dreamer_kernels as dk

    def outcome(installed: bool, *named_by: str) -> str:
        stepped_aside = any(name in line for line in said.splitlines() for name in named_by)
        return "trains" if installed else ("steps aside" if stepped_aside else "silently off")

    imagine, heads = agent.imagine, agent.imagined_heads
    return {
        "fused_scan": outcome(isinstance(agent.observe, dk.FusedObserve), "--fused-scan"),
        "gathers": outcome(isinstance(imagine, dk.FastImagine) and imagine.gathers, "one-hot latents"),
        "fused_epilogues": outcome(
            isinstance(imagine, dk.FastImagine) and imagine.fused, "--fused-epilogues"
        ),
        "shared_heads": outcome(
            isinstance(heads, dk.FastHeads) and heads.fused,
            "first layers",
            "--fast-heads (",
            "--fused-epilogues (",
        ),
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CHANGES))
def test_each_change_holds_on_cudas_paths_with_their_kernels_interpreted(name, tmp_path, monkeypatch, capsys):
    """Each walked change, made as the page says, trained with CUDA's paths installed (the fused scan, the gathers,
    the fused epilogues and the shared heads, their Triton kernels interpreted on the CPU): each path trains the
    change, or steps aside with one line, as ON_CUDAS_PATHS states; none trains the old formula without a word (the
    checks at start-up would stop the run with exit 7 first), and the change's own result shows after training."""
    import dreamer_kernels as dk

    if dk.triton_problem(torch.device("cpu")) or not dk.triton_interprets():
        pytest.skip("the kernels run in Triton's interpreter on the CPU")
    module = changed_script(name, tmp_path, monkeypatch)
    monkeypatch.setattr(dk, "FUSED_SCAN_DEVICES", {"cuda", "cpu"})
    agents = []
    real_speed_up = module.speed_up_agent

    def speed_up(agent, args):
        real_speed_up(agent, args)
        agents.append(agent)

    monkeypatch.setattr(module, "speed_up_agent", speed_up)
    schedule = dict(total_timesteps=22, learning_starts=20, log_interval=2, save_model=False)
    args = tiny_catch(module, **CUDA_PATHS, **schedule, **CHANGE_FLAGS.get(name, {}))
    counters = module.main(args)  # exit 7 would raise SystemExit here
    said = capsys.readouterr().out
    assert counters["updates"] > 0 and counters["behavior_updates"] > 0
    assert what_each_path_did(agents[-1], said) == ON_CUDAS_PATHS[name], said
    events = EventAccumulator(str(tmp_path / counters["run_dir"])).Reload()
    if name == "next_reward":
        assert [event.value for event in events.Scalars("losses/next_reward")]
    if name == "mingru":
        assert type(agents[-1].world_model.rssm.gru).__name__ == "MinGRUCell"
    if name == "resnet":
        assert any("ResidualBlock" in type(m).__name__ for m in agents[-1].world_model.encoder.modules())
