"""A shortened learning proof in CI: dreamer_atari.py's own loop on Catch-v0 (benchmark/learning_proof.py).

The full proof (2,500 env steps, four to five minutes on a 2-core CPU; results in
benchmark/results/learning_proof/) does not fit beside the rest of the suite, so CI trains 1,000 env steps and
asserts the learning that has happened by then: the world model has learned to draw the game and to predict its
reward from pixels (both losses far below where they started, the sign of some real rewards predicted), its
latents carry information about the frames (KL above the free-nats floor, not collapsed onto the prior), and
the actor and critic trained alongside. Whether the policy learns is the full proof's question, not this test's."""

import pytest

from benchmark import bench_utils
from benchmark import learning_proof as lp


@pytest.mark.slow
def test_the_world_model_learns_catch_through_the_scripts_own_loop(tmp_path):
    out = lp.main(lp.Args(json=str(tmp_path / "proof.json"), seed=3, total_timesteps=1_000, eval_episodes=20,
                          work_dir=str(tmp_path / "work")))
    assert out["env_steps"] == 1_000 and out["updates"] >= 450 and out["behavior_updates"] == out["updates"]
    assert out["optimal_return"] == 1.0 and out["random_return"] < 0 and len(out["final_returns"]) == 20
    (run_dir,) = (tmp_path / "work" / "runs").iterdir()
    scalars = bench_utils.read_scalars(str(run_dir), ["losses/image", "losses/reward", "losses/actor", "losses/kl",
                                                      "charts/reward_sign_accuracy"])
    for key in ("losses/image", "losses/reward"):
        series = scalars[key]  # {env step: mean over the log interval}
        assert series[max(series)] < 0.2 * series[min(series)], (key, series)
    kl, accuracy = scalars["losses/kl"], scalars["charts/reward_sign_accuracy"]
    assert kl[max(kl)] > lp.da.Args().free_nats, kl
    assert accuracy[max(accuracy)] > accuracy[min(accuracy)], accuracy
    assert len(scalars["losses/actor"]) >= 2  # the behaviour was trained from the first log interval on
