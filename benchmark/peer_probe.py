"""An Atari wrapper that records the host memory of the process every few environment steps.

SheepRL builds its Atari environments from the Hydra target `env.wrapper._target_`; the soak points that target
here. With `env.sync_env=True` the environments step in the training process, so the samples are that process's
USS, taken inside SheepRL's own training loop without touching its code.
"""

from __future__ import annotations

from typing import ClassVar

import gymnasium as gym

import memory_utils as mu
from benchmark import bench_utils


class MemoryProbedAtariPreprocessing(gym.wrappers.AtariPreprocessing):
    """`AtariPreprocessing` plus one `(env steps of all envs, USS MB)` sample every `every` steps of all envs, and
    beside it resident anonymous memory (`anon_samples`, Linux), the figure our soak judges."""

    every = 250
    steps = 0
    samples: ClassVar[list[tuple[int, float]]] = []
    anon_samples: ClassVar[list[tuple[int, float]]] = []

    def step(self, action):
        out = super().step(action)
        cls = MemoryProbedAtariPreprocessing
        cls.steps += 1
        if cls.steps % cls.every == 0:
            bench_utils.trim_host_memory()  # live memory: no garbage, no cached free pages (as for ours)
            cls.samples.append((cls.steps, mu.process_uss_mb()))
            anon = mu.process_anon_mb()
            if anon is not None:
                cls.anon_samples.append((cls.steps, anon))
        return out
