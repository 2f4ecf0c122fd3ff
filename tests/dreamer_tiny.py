"""Tiny dreamer_atari.py sizes shared by the Dreamer tests: real Pong frames, a model that trains in ms."""

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


def tiny_args(**overrides) -> da.Args:
    """Args with the tiny sizes, 2 sync envs and AMP off; keyword arguments override any field."""
    return da.Args(**{**TINY, "num_envs": 2, "vector_mode": "sync", "amp": "off", **overrides})
