"""Tiny dreamer_atari.py sizes shared by the Dreamer tests: real Pong frames, a model that trains in ms.

The sizes suit both models: the default (dreamerv3: single 64x64 frames, three convolutions down to 8x8) and
`model="nature"` (4 stacked 84x84 frames), which the tests about frame stacks use."""

import importlib.util
import sys
from pathlib import Path

import torch

import dreamer_atari as da

torch.set_num_threads(1)  # tiny models: threads only contend on a shared 2-core machine

TINY = dict(
    encoder_channels=(4, 8, 8),
    embed_dim=32,
    decoder_base_channels=4,
    decoder_mid_channels=4,
    deterministic_dim=16,
    stochastic_dim=4,
    stochastic_classes=4,
    hidden_dim=16,
    batch_size=2,
    sequence_length=8,
    imagination_horizon=5,
)


def _flag(name: str, value) -> list[str]:
    values = value if isinstance(value, tuple) else (value,)
    return ["--" + name.replace("_", "-"), *(str(v) for v in values)]


TINY_FLAGS = [part for name, value in TINY.items() for part in _flag(name, value)]


def obs_shape(args: da.Args) -> tuple[int, ...]:
    """(frame stack, side, side), or (frame stack, 3, side, side) with --rgb: one observation of the model `args`
    describes."""
    colour = (3,) if args.rgb else ()
    return (args.frame_stack, *colour, args.image_size, args.image_size)


# The fast paths a CPU runs where a flag asks for them: `auto` leaves every one off on the CPU (none saved 5 % of an
# update there), so that a CPU run trains Part 1; the tests of the paths ask for them, as a GPU's defaults would
CPU_PATHS = dict(
    fast_observe="on", fast_imagine="on", imagine_gathers="on", fast_heads="on", channels_last="on"
)


def tiny_args(**overrides) -> da.Args:
    """Args with the tiny sizes, 2 sync envs, AMP off and the CPU's fast paths asked for (`CPU_PATHS`); keyword
    arguments override any field."""
    return da.Args(
        **{**TINY, **CPU_PATHS, "num_envs": 2, "vector_mode": "sync", "precision": "float32", **overrides}
    )


def dreamerv3_initial_state(rssm: da.RSSM) -> tuple[torch.Tensor, torch.Tensor]:
    """DreamerV3's learned initial state, written from its formulas: deter = tanh(w) (1, D); stoch the prior's mode
    from it, each latent's most likely class one-hot (1, S), with no gradient through the mode."""
    deter = torch.tanh(rssm.initial_deter).unsqueeze(0)
    logits = rssm.prior_net(deter).unflatten(-1, (rssm.stoch_dim, rssm.classes))
    stoch = torch.nn.functional.one_hot(logits.argmax(-1), rssm.classes).to(deter.dtype).flatten(1)
    return deter, stoch


def fast_agent(args: da.Args, shape: tuple, num_actions: int, device) -> da.Agent:
    """The agent a run trains: `build_agent`, then Part 2's fast paths in place (`speed_up_agent`, which checks them)."""
    agent = da.build_agent(args, shape, num_actions, device)
    da.speed_up_agent(agent, args)
    return agent


def float64_agent(args: da.Args, num_actions: int = 6, head_noise: float = 0.05) -> da.Agent:
    """A seeded float64 agent for the equality tests, with what starts at zero moved off it (heads that start at zero,
    and a learned initial state at tanh(0), would hide their gradients): the learned initial vector, the critic, the
    reward and the continue heads."""
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        agent = da.build_agent(args, obs_shape(args), num_actions, "cpu")
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        rssm = agent.world_model.rssm
        if rssm.initial_deter is not None:
            rssm.initial_deter.add_(0.5 * torch.randn_like(rssm.initial_deter))
        for module in (agent.critic, agent.world_model.reward_head, agent.world_model.continue_head):
            for p in module.parameters():
                p.add_(head_noise * torch.randn_like(p))
    return agent


def import_copy(source: str, path: Path, monkeypatch):
    """A changed dreamer_atari.py (`source`) written to `path` and imported under its stem, as a researcher's copy
    beside memory_utils.py runs; the working folder is `path`'s from then on."""
    path.write_text(source)
    monkeypatch.syspath_prepend(str(Path(da.__file__).parent))  # memory_utils.py, which a copy takes along
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, path.stem, module)
    spec.loader.exec_module(module)
    monkeypatch.chdir(path.parent)
    return module


def replay_of(run_dir, args: da.Args, capacity: int = 500, num_envs: int = 2) -> da.EpisodeReplay:
    """The replay a checkpoint in `run_dir` holds, rebuilt from its files on disk as a resumed run does."""
    state = torch.load(Path(run_dir) / "checkpoint.pt", map_location="cpu", weights_only=True)["replay"]
    replay = da.EpisodeReplay(capacity, num_envs, seed=0)
    fields = da.replay_log_fields(obs_shape(args))
    replay.log = da.mu.ReplayLog(Path(run_dir) / "replay", fields, state["log"]["chunk_rows"])
    da.restore_replay(replay, state, args.frame_stack)
    return replay
