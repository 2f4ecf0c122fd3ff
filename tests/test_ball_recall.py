"""Ball fidelity: finding Pong's ball in a frame and scoring how well a model's frame draws it (`ball_scores`).

Synthetic frames with a known ball (drawn, missing, displaced, two balls, none, a paddle, a band) for the
definitions, and real ALE Pong frames for what the score must say about a model: the truth scores F1 1, and
no ball, speckle, a bright band or a displaced ball score about 0, however bright; a faint ball still counts.
"""

import numpy as np
import pytest
import torch

import dreamer_atari as da
import dreamer_tiny

SIDE = 64
BACKGROUND, WALL, PADDLE, BALL = 87, 236, 147, 236


def pong_frame(balls=((30, 20),), side=SIDE, ball_level=BALL) -> np.ndarray:
    """A Pong-like (S, S) grey frame: background, walls, score digits above the top wall, both paddles, and a 2x2
    ball at each (row, column) of `balls`."""
    frame = np.full((side, side), BACKGROUND, np.uint8)
    rows = da.pong_playfield(side)
    frame[rows.start - 3 : rows.start] = WALL  # top wall
    frame[rows.stop :] = WALL  # bottom wall
    frame[1:5, 10:13] = 200  # a score digit, above the wall
    frame[20:26, 6:8] = PADDLE  # opponent's paddle
    frame[35:41, 56:58] = PADDLE  # player's paddle
    for row, column in balls:
        frame[row : row + 2, column : column + 2] = ball_level
    return frame


def test_finds_the_ball_and_nothing_else():
    mask, background = da.find_balls(pong_frame(balls=((30, 20),)))
    assert background == BACKGROUND
    assert sorted(map(tuple, np.argwhere(mask))) == [(30, 20), (30, 21), (31, 20), (31, 21)]
    # no ball in play: the paddles, walls and score are not balls
    assert not da.find_balls(pong_frame(balls=()))[0].any()


def test_two_balls_are_both_found():
    mask, _ = da.find_balls(pong_frame(balls=((30, 20), (45, 40))))
    assert mask.sum() == 8


def test_a_paddle_mostly_hidden_behind_a_wall_is_not_a_ball():
    """Its visible rows are ball-sized and as bright as a ball drawn at half its contrast: its columns tell."""
    frame = pong_frame(balls=())
    frame[20:26, 6:8] = BACKGROUND
    top = da.pong_playfield(SIDE).start
    frame[top : top + 2, 6:8] = PADDLE
    assert not da.find_balls(frame)[0].any()
    # the same patch away from the paddles' columns is a ball
    frame[top : top + 2, 20:22] = PADDLE
    assert da.find_balls(frame)[0].sum() == 4


def test_a_bright_object_larger_than_the_ball_is_not_a_ball():
    frame = pong_frame(balls=())
    frame[30:36, 20:26] = BALL
    assert not da.find_balls(frame)[0].any()
    band = pong_frame(balls=())
    band[30:32] = BALL  # a band along a row, as tall as the ball
    assert not da.find_balls(band)[0].any()


def test_scores_pool_pixels_over_frames():
    """Two balls drawn one of two, then one of one: recall 8 / 12 pooled (a mean over frames would say 0.75).
    A ball drawn where the truth has none counts against precision, a frame with no ball either way adds
    nothing, and the centroid distance is taken where both have a ball."""
    truth = np.stack(
        [
            pong_frame(balls=((30, 20), (45, 40))),
            pong_frame(balls=((30, 20),)),
            pong_frame(balls=()),
            pong_frame(balls=()),
        ]
    )
    model = np.stack(
        [
            pong_frame(balls=((30, 20),)),
            pong_frame(balls=((30, 20),)),
            pong_frame(balls=((40, 30),)),  # drawn where the truth has none
            pong_frame(balls=()),
        ]
    )
    scores = da.ball_scores(truth, model)
    assert scores["precision"] == pytest.approx(8 / 12)
    assert scores["recall"] == pytest.approx(8 / 12)
    assert scores["f1"] == pytest.approx(8 / 12)
    # frame 0: the truth's centroid is between its two balls, (38, 30.5) against the model's (30.5, 20.5)
    assert scores["centroid_px"] == pytest.approx(np.hypot(7.5, 10) / 2)
    # the same frames as one batch (n, T, S, S) score the same
    assert da.ball_scores(truth.reshape(2, 2, SIDE, SIDE), model.reshape(2, 2, SIDE, SIDE)) == scores


@pytest.mark.parametrize(
    "offset, precision_recall",
    [((0, 1), 1.0), ((1, 1), 1.0), ((0, 2), 0.5), ((0, 3), 0.0), ((3, 3), 0.0)],
    ids=["1 px", "1 px diagonal", "2 px", "3 px", "3 px diagonal"],
)
def test_a_ball_pixel_matches_within_one_pixel(offset, precision_recall):
    """A 2x2 ball drawn `offset` (rows, columns) away: a model pixel matches a true one at most 1 pixel away."""
    truth = pong_frame(balls=((30, 20),))
    model = pong_frame(balls=((30 + offset[0], 20 + offset[1]),))
    scores = da.ball_scores(truth, model)
    assert scores["precision"] == scores["recall"] == scores["f1"] == pytest.approx(precision_recall)
    assert scores["centroid_px"] == pytest.approx(np.hypot(*offset))


def test_scores_with_nothing_to_count_are_left_out():
    ball, empty = pong_frame(balls=((30, 20),)), pong_frame(balls=())
    assert da.ball_scores(empty, empty) == {}
    assert da.ball_scores(ball, empty) == {"recall": 0.0, "f1": 0.0}  # the ball left out
    assert da.ball_scores(empty, ball) == {"precision": 0.0, "f1": 0.0}  # a ball where none is


def test_open_loop_scores_each_horizon_beside_its_chance_level():
    """Observed frames and 5 and 10 steps open loop apart; chance: the model's frames against the next
    sequence's truth, whose ball is elsewhere."""
    context = da.OPEN_LOOP_CONTEXT
    T = context + 11
    truth = np.stack(
        [[pong_frame(balls=((row, 10 + 2 * t),)) for t in range(T)] for row in (15, 45)]
    )  # (2, T, S, S)
    model = np.stack([[pong_frame(balls=()) for _ in range(T)] for _ in range(2)])
    model[:, :context] = truth[:, :context]  # the observed frames drawn with their ball
    model[:, context - 1 + 10] = truth[:, context - 1 + 10]  # and the frame 10 steps open loop
    scores = da.open_loop_ball_scores(truth, model, context)
    assert scores == {
        "world_model/ball_precision_observed": 1.0,
        "world_model/ball_recall_observed": 1.0,
        "world_model/ball_f1_observed": 1.0,
        "world_model/ball_centroid_px_observed": 0.0,
        "world_model/ball_f1_chance_observed": 0.0,
        "world_model/ball_recall_open_loop_5": 0.0,
        "world_model/ball_f1_open_loop_5": 0.0,
        "world_model/ball_f1_chance_open_loop_5": 0.0,
        "world_model/ball_precision_open_loop_10": 1.0,
        "world_model/ball_recall_open_loop_10": 1.0,
        "world_model/ball_f1_open_loop_10": 1.0,
        "world_model/ball_centroid_px_open_loop_10": 0.0,
        "world_model/ball_f1_chance_open_loop_10": 0.0,
    }
    # a sequence too short for 10 steps open loop leaves those figures out; one sequence has no chance level
    short = da.open_loop_ball_scores(truth[:1, : context + 5], model[:1, : context + 5], context)
    assert set(short) == {
        "world_model/ball_precision_observed",
        "world_model/ball_recall_observed",
        "world_model/ball_f1_observed",
        "world_model/ball_centroid_px_observed",
        "world_model/ball_recall_open_loop_5",
        "world_model/ball_f1_open_loop_5",
    }
    empty = np.stack([[pong_frame(balls=()) for _ in range(T)] for _ in range(2)])
    assert da.open_loop_ball_scores(empty, empty, context) == {}


# ---------------------------------------------------------------------------------------------------------
# Real Pong frames: what the score says about a model's frame
# ---------------------------------------------------------------------------------------------------------
def grey_frame(obs: np.ndarray) -> np.ndarray:
    """The newest (S, S) grey frame of a stacked observation, grey or colour."""
    return da.grey(obs[-1]) if obs.ndim == 4 else obs[-1]


@pytest.fixture(scope="module")
def real_frames() -> np.ndarray:
    """(N, 64, 64) uint8: real Pong frames at the default settings, each with the ball in play (the emulator's
    RAM says so) and found (`find_balls`), from a seeded random policy."""
    args = da.Args()
    env = da.make_env("ALE/Pong-v5", 0, False, "", args)()
    frames = []
    try:
        env.reset(seed=3)
        ale, rng = env.unwrapped.ale, np.random.default_rng(0)
        while len(frames) < 32:
            obs, *_ = env.step(int(rng.integers(6)))
            frame = grey_frame(obs)
            if ale.getRAM()[54] != 0 and da.find_balls(frame)[0].any():
                frames.append(frame)
    finally:
        env.close()
    return np.stack(frames)


def without_ball(frame: np.ndarray) -> np.ndarray:
    mask, background = da.find_balls(frame)
    out = frame.copy()
    out[mask] = round(background)
    return out


def speckled(frame: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """20 % of the pixels, anywhere, at the ball's grey."""
    out = without_ball(frame)
    out[rng.random(out.shape) < 0.2] = BALL
    return out


def banded(frame: np.ndarray) -> np.ndarray:
    """A band across the whole width, along the ball's rows and at its brightest grey."""
    mask, _ = da.find_balls(frame)
    rows = np.flatnonzero(mask.any(-1))
    out = without_ball(frame)
    out[rows.min() : rows.max() + 1] = frame[mask].max()
    return out


def moved(frame: np.ndarray, columns: int) -> np.ndarray:
    """The ball alone drawn `columns` to the right."""
    mask, _ = da.find_balls(frame)
    out = without_ball(frame)
    out[np.roll(mask, columns, axis=-1)] = frame[mask]
    return out


def faint(frame: np.ndarray) -> np.ndarray:
    """The ball at half its contrast."""
    mask, background = da.find_balls(frame)
    out = frame.copy()
    out[mask] = np.rint(background + (frame[mask] - background) / 2).astype(np.uint8)
    return out


MODEL_FRAMES = {
    "truth": lambda frame, rng: frame,
    "ball removed": lambda frame, rng: without_ball(frame),
    "20% speckle": speckled,
    "bright band": lambda frame, rng: banded(frame),
    "shifted 3 px": lambda frame, rng: np.roll(frame, 3, axis=-1),
    "ball moved 3 px": lambda frame, rng: moved(frame, 3),
    "half contrast": lambda frame, rng: faint(frame),
}


def real_scores(real_frames: np.ndarray, case: str) -> dict[str, float]:
    rng = np.random.default_rng(0)
    model = np.stack([MODEL_FRAMES[case](frame, rng) for frame in real_frames])
    return da.ball_scores(real_frames, model)


@pytest.mark.parametrize(
    "case, lowest, highest",
    [
        ("truth", 0.95, 1.0),
        ("ball removed", 0.0, 0.0),
        ("20% speckle", 0.0, 0.1),
        ("bright band", 0.0, 0.2),
        ("shifted 3 px", 0.0, 0.1),
        ("ball moved 3 px", 0.0, 0.1),
        ("half contrast", 0.9, 1.0),
    ],
)
def test_real_frames_score_the_ball_not_brightness(real_frames, case, lowest, highest):
    """A model's frame scores its ball, not how bright it is near the ball: speckle lights up pixels beside most
    of the ball and a band covers its row, yet neither draws a ball; a ball drawn faint still is one."""
    scores = real_scores(real_frames, case)
    print(case, {key: round(value, 3) for key, value in scores.items()})
    assert lowest <= scores["f1"] <= highest


def test_real_frames_place_the_centroid(real_frames):
    """The truth's ball centroid is where the truth's is, and a ball moved 3 px puts it 3 px away."""
    assert real_scores(real_frames, "truth")["centroid_px"] == 0.0
    assert real_scores(real_frames, "ball moved 3 px")["centroid_px"] == pytest.approx(3.0)


def test_an_untrained_world_model_draws_no_ball():
    """An untrained decoder's noise is bright here and there, near the ball in some frames: it scores no ball
    (the default model's scores F1 0.003-0.011 but takes seconds to build; the tiny one's is checked)."""
    torch.manual_seed(0)
    args = dreamer_tiny.tiny_args()
    env = da.make_env("ALE/Pong-v5", 0, False, "", args)()
    n, T = 8, da.OPEN_LOOP_CONTEXT + 11
    try:
        obs, _ = env.reset(seed=3)
        rng, observations, actions = np.random.default_rng(0), [obs], [0]
        for _ in range(n * T - 1):
            actions.append(int(rng.integers(6)))
            observations.append(env.step(actions[-1])[0])
    finally:
        env.close()
    batch = {
        "obs": np.stack(observations).reshape(n, T, *obs.shape),  # (n, T, 1, S, S) uint8
        "action": np.array(actions, np.uint8).reshape(n, T),
        "reward": np.zeros((n, T), np.float32),
        "is_first": np.arange(T)[None].repeat(n, 0) == 0,
        "is_terminal": np.zeros((n, T), bool),
    }
    agent = da.build_agent(args, obs.shape, 6, torch.device("cpu"))
    scores = da.open_loop_ball_scores(*da.open_loop_predictions(agent, batch))
    print({key: round(value, 3) for key, value in scores.items()})
    for horizon in ("observed", "open_loop_5", "open_loop_10"):
        assert scores[f"world_model/ball_f1_{horizon}"] <= 0.05, horizon


@pytest.mark.parametrize("side, rgb", [(64, False), (84, False), (64, True)], ids=["64", "84", "64 colour"])
def test_real_pong_frames_agree_with_the_emulator(side, rgb):
    """On real frames, a ball is found where the emulator's RAM says one is in play, and not elsewhere (they
    disagree where the ball touches or passes a paddle and for a frame at each serve). Colour frames (--rgb) are
    scored in grey (`da.grey`), as the open-loop predictions are."""
    args = da.Args(image_size=side, frame_stack=1, rgb=rgb)
    env = da.make_env("ALE/Pong-v5", 0, False, "", args)()
    try:
        env.reset(seed=3)
        ale, rng = env.unwrapped.ale, np.random.default_rng(0)
        agree, in_play, steps = 0, 0, 300
        for _ in range(steps):
            obs, *_ = env.step(int(rng.integers(6)))
            ball_in_play = ale.getRAM()[54] != 0
            in_play += ball_in_play
            agree += ball_in_play == da.find_balls(grey_frame(obs))[0].any()
    finally:
        env.close()
    assert in_play > steps / 2
    assert agree >= 0.85 * steps


def test_colour_frames_in_grey_weigh_their_channels_as_opencv_does():
    """`grey` gives the grey level OpenCV's RGB-to-grey conversion (the one grey Atari frames come from) gives."""
    import cv2

    frames = np.random.default_rng(0).integers(0, 256, (2, 5, 3, 16, 16), dtype=np.uint8)  # (n, T, 3, S, S)
    ours = da.grey(frames)
    assert ours.shape == (2, 5, 16, 16) and ours.dtype == np.uint8
    theirs = np.stack(
        [
            cv2.cvtColor(np.ascontiguousarray(f.transpose(1, 2, 0)), cv2.COLOR_RGB2GRAY)
            for f in frames.reshape(-1, 3, 16, 16)
        ]
    )
    assert np.abs(ours.reshape(-1, 16, 16).astype(int) - theirs).max() <= 1
