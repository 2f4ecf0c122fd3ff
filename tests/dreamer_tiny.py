"""Tiny dreamer_atari.py sizes shared by the Dreamer tests: real Pong frames, a model that trains in ms.

The sizes suit both models: the default (dreamerv3: single 64x64 frames, three convolutions down to 8x8) and
`model="nature"` (4 stacked 84x84 frames), which the tests about frame stacks use."""

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


def tiny_args(**overrides) -> da.Args:
    """Args with the tiny sizes, 2 sync envs and AMP off; keyword arguments override any field."""
    return da.Args(**{**TINY, "num_envs": 2, "vector_mode": "sync", "amp": "off", **overrides})


def dreamerv3_initial_state(rssm: da.RSSM) -> tuple[torch.Tensor, torch.Tensor]:
    """DreamerV3's learned initial state, written from its formulas: deter = tanh(w) (1, D); stoch the prior's mode
    from it, each latent's most likely class one-hot (1, S), with no gradient through the mode."""
    deter = torch.tanh(rssm.initial_deter).unsqueeze(0)
    logits = rssm.prior_net(deter).unflatten(-1, (rssm.stoch_dim, rssm.classes))
    stoch = torch.nn.functional.one_hot(logits.argmax(-1), rssm.classes).to(deter.dtype).flatten(1)
    return deter, stoch
