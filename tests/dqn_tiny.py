"""Tiny dqn_starcraft_split.py flags shared by the DQN tests: 8-pixel built-in minigames, a run in seconds."""

TINY_FLAGS = [
    "--res",
    "8",
    "--step-mul",
    "128",
    "--buffer-size",
    "200",
    "--learning-starts",
    "10",
    "--eval-every-episodes",
    "1",
    "--num-eval-episodes",
    "1",
    "--num-test-episodes",
    "2",
    "--memory-log-every",
    "10",
    "--leak-warmup-steps",
    "0",
    "--log-every-steps",
    "5",
]
