"""A shortened learning proof in CI: dreamer_atari.py's own loop on Catch-v0 (benchmark/learning_proof.py).

The full proof (3,000 env steps, about seven minutes on a 2-core CPU; results in
benchmark/results/learning_proof/) does not fit beside the rest of the suite, so CI trains 1,500 env steps and
asserts the part of the learning that has happened by then: the world model predicts the game's reward from
pixels (the sign of real catches and misses) and its image loss has fallen a long way."""

import pytest

from benchmark import bench_utils
from benchmark import learning_proof as lp


@pytest.mark.slow
def test_the_world_model_learns_catch_through_the_scripts_own_loop(tmp_path):
    out = lp.main(lp.Args(json=str(tmp_path / "proof.json"), seed=3, total_timesteps=1_500, eval_episodes=30,
                          work_dir=str(tmp_path / "work")))
    assert out["env_steps"] == 1_500 and out["updates"] >= 900 and out["behavior_updates"] == out["updates"]
    (run_dir,) = (tmp_path / "work" / "runs").iterdir()
    scalars = bench_utils.read_scalars(str(run_dir), ["charts/reward_sign_accuracy", "losses/image"])
    accuracy = scalars["charts/reward_sign_accuracy"]
    assert accuracy[max(accuracy)] >= 0.9, accuracy  # catches and misses told apart from pixels
    image = scalars["losses/image"]
    assert image[max(image)] < 0.2 * image[min(image)], image
    assert -1.0 <= out["final_return"] <= 1.0 and out["optimal_return"] == 1.0
