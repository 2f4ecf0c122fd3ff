"""Write benchmark/results/dqn_movetobeacon_learning.{md,csv} from one learning run's own files.

Usage: python benchmark/dqn_learning_report.py RUN_DIR benchmark/results "COMMAND"
(RUN_DIR is {save_path}/{run_id} of the run; every figure comes from its config.json and eval/ files.)
"""
import csv, json, os, shutil, sys

run = sys.argv[1]  # the run folder: {save_path}/{run_id}
out = sys.argv[2]  # benchmark/results
command = sys.argv[3]
cfg = json.load(open(os.path.join(run, "config.json")))
test = json.load(open(os.path.join(run, "eval", "test_results.json")))
rows = list(csv.DictReader(open(os.path.join(run, "eval", "curve.csv"))))
shutil.copyfile(os.path.join(run, "eval", "curve.csv"), os.path.join(out, "dqn_movetobeacon_learning.csv"))
shutil.copyfile(os.path.join(run, "eval", "test_results.json"),
                os.path.join(out, "dqn_movetobeacon_learning_test_results.json"))
history = json.load(open(os.path.join(out, "dqn_movetobeacon_learning_history.json")))
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "unknown")
a = cfg["args"]
tests = [float(r["test_score_mean"]) for r in rows]
first20 = next((r for r in rows if float(r["test_score_mean"]) >= 20), None)
late = [r for r in rows if float(r["epsilon"]) <= a["end_e"] + 1e-9]
late_tests = [float(r["test_score_mean"]) for r in late]
L = []
L.append("# Built-in MoveToBeacon, split-head Double DQN, default hyperparameters\n")
L.append("Command (from the repository root; `--time-limit-min 20` stops training after 20 minutes of wall time, "
         "then runs the final greedy test; every other value is the default):\n")
L.append("```\n" + command + "\n```\n")
L.append(f"Machine: {os.cpu_count()} CPU cores ({cpu}), no GPU, Python {cfg['python']}, torch {cfg['torch']}, "
         f"`--torch-num-threads {a['torch_num_threads']}`. The two cores were shared with other jobs "
         "(training runs and test suites) during the run, for its first 15 minutes also with the run of the last "
         "history line below, and in its last 4 minutes with a short diagnostic run, so the wall times are "
         "pessimistic.\n")
L.append(f"Episodes are {cfg['episode_steps']} agent steps (120 game seconds of 16 game loops at step_mul "
         f"{a['step_mul']}); n-step returns with n = {a['n_step']}, gamma {a['gamma']}, lr {a['learning_rate']:g}, "
         f"batch {cfg['batch_size_used']}, replay {a['buffer_size']}, epsilon {a['start_e']:g} -> {a['end_e']:g} "
         f"over {a['exploration_steps']} steps, target update every {a['target_network_frequency']} steps.\n")
L.append(f"Final greedy test ({test['num_test_episodes']} episodes, epsilon {test.get('test_epsilon', 0.0):g}): "
         f"mean **{test['mean']:.2f}** (std {test['std']:.2f}, min {test['min']:g}, max {test['max']:g}) after "
         f"{test['episodes']} training episodes, {test['global_steps']} agent steps, "
         f"{test['train_wall_time_s'] / 60:.1f} min of training (stopped by {test['stopped_by']}).\n")
if first20:
    L.append(f"First periodic greedy test at or above 20: episode {first20['episode']} "
             f"({float(first20['wall_time_s']) / 60:.1f} min, epsilon {float(first20['epsilon']):.3f}).\n")
else:
    L.append("First periodic greedy test at or above 20: none within the run.\n")
L.append(f"Periodic greedy tests (5 episodes each): {sum(t >= 20 for t in tests)} of {len(tests)} at or above 20; "
         + (f"after epsilon reached {a['end_e']:g}: mean {sum(late_tests) / len(late_tests):.2f} over "
            f"{len(late_tests)} tests, lowest {min(late_tests):.2f}.\n" if late_tests else
            f"epsilon did not reach {a['end_e']:g} within the run.\n"))
zeros = sum(t == 0 for t in tests)
nomask = [float(r["test_score_mean"]) for r in csv.DictReader(open(os.path.join(out, "dqn_movetobeacon_learning_nomask.csv")))]
late_zeros = sum(float(r["test_score_mean"]) == 0 for r in late)
L.append(f"Periodic greedy tests that scored 0: {zeros} of {len(tests)}, {late_zeros} of them after epsilon reached "
         f"{a['end_e']:g} (without the available actions as a network input, last history line: "
         f"{sum(t == 0 for t in nomask)} of {len(nomask)}).\n")
L.append("For scale: on this built-in map a scripted agent that clicks on the beacon scores about 27 at step_mul 16 "
         "and a random agent about 1 (tests/test_dqn_env.py); SC2LE FullyConv scored 26 on the real map.\n")
ok = test["mean"] >= 20 and test["train_wall_time_s"] <= 20 * 60 + 60
L.append("Verdict: the target of a mean greedy test score of at least 20 within 20 minutes was "
         + ("**reached**.\n" if ok else "**not reached**.\n"))
L.append("Changes since the first attempt (history below): (1) episodes follow the map's timer in normal-speed "
         "game seconds (16 game loops each): 120 agent steps at step_mul 16 instead of 168, with the screen "
         "re-calibrated to 28 world units so that the scripted beacon-clicker still scores about 27 and a random "
         "agent about 1; (2) 3-step returns (`--n-step 3`); (3) the available-actions mask is an input of the "
         "network (player embedding and non-spatial head). (1) and (2) were not measured separately. (3) made no "
         "clear difference on this one seed (compare the last history line, run without it). The seed recipe's "
         "values (lr 5e-5, batch 8, replay 100k, epsilon 1 -> 0.01 over 100k steps, target update every 300 "
         "steps, step_mul 16, res 32, 10000 episodes) are unchanged.\n")
L.append("Why some periodic greedy tests score 0: the network chose no_op in the first state of the episode, "
         "before the marine is selected, and stood still for all 120 steps (checked on the checkpoints of "
         "reproductions of the first 100 episodes without (3) and 125 episodes with (3): every greedy episode "
         "was 120 no_ops). Under a near-random behaviour policy no_op and select_army are worth almost the same "
         "there; once epsilon is low the trained network selects first (20 greedy episodes replayed from each "
         "run's final checkpoint all start with select_army and never no-op).\n")
L.append(f"Curve (`dqn_movetobeacon_learning.csv`, copied from the run's `eval/curve.csv`; the final test is "
         f"`dqn_movetobeacon_learning_test_results.json`): every {a['eval_every_episodes']} episodes, the mean "
         "training score over those episodes (epsilon-greedy) and the mean of 5 greedy test episodes.\n")
L.append("| episode | agent steps | wall min | epsilon | train score | greedy test score |")
L.append("|---:|---:|---:|---:|---:|---:|")
for r in rows:
    L.append(f"| {r['episode']} | {r['global_step']} | {float(r['wall_time_s']) / 60:.1f} | {float(r['epsilon']):.3f} | "
             f"{float(r['train_score_mean']):.2f} | {float(r['test_score_mean']):.2f} |")
L.append("\n## Earlier attempts (same command and machine)\n")
for h in history:
    c = list(csv.DictReader(open(os.path.join(out, h["curve"]))))
    best = max(c, key=lambda r: float(r["test_score_mean"]))
    L.append(f"- {h['name']}; {h['episode_steps']}-step episodes: final greedy test mean {h['final_mean']:.2f} "
             f"(std {h['final_std']:.2f}, min {h['final_min']:g}, max {h['final_max']:g}, {h['test_episodes']} "
             f"episodes) after {h['episodes']} episodes, {h['steps']} agent steps, {h['minutes']:.1f} min; best "
             f"periodic test {float(best['test_score_mean']):.2f} at episode {best['episode']}. Curve: `{h['curve']}`.")
open(os.path.join(out, "dqn_movetobeacon_learning.md"), "w").write("\n".join(L) + "\n")
print("\n".join(L[:12]))
