"""Ball recall: finding Pong's ball in a frame and scoring how much of it a model draws.

Synthetic frames with a known ball (drawn, missing, displaced, two balls, none, a paddle, a grey wash), and real ALE
Pong frames checked against the emulator's own record of whether the ball is in play.
"""

import numpy as np
import pytest

import dreamer_atari as da

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


def test_a_dim_patch_the_size_of_the_ball_is_not_a_ball():
    # a paddle's shade (61 above the background) at the ball's size: a paddle mostly hidden behind a wall
    assert not da.find_balls(pong_frame(balls=((30, 20),), ball_level=PADDLE))[0].any()


def test_a_bright_object_larger_than_the_ball_is_not_a_ball():
    frame = pong_frame(balls=())
    frame[30:36, 20:26] = BALL
    assert not da.find_balls(frame)[0].any()


@pytest.mark.parametrize(
    "model_balls, hits",
    [
        (((30, 20),), 4),  # drawn
        ((), 0),  # missing
        (((30, 40),), 0),  # displaced
    ],
)
def test_hits_drawn_missing_displaced(model_balls, hits):
    truth = pong_frame(balls=((30, 20),))
    assert da.ball_hits(truth[None], pong_frame(balls=model_balls)[None]) == (hits, 4)


def test_two_balls_one_drawn_is_half():
    truth = pong_frame(balls=((30, 20), (45, 40)))
    assert da.ball_hits(truth[None], pong_frame(balls=((30, 20),))[None]) == (4, 8)


def test_no_ball_in_the_frame_counts_no_pixels():
    truth = pong_frame(balls=())
    assert da.ball_hits(truth[None], truth[None]) == (0, 0)


def test_faint_or_washed_out_drawings_are_misses():
    truth = pong_frame(balls=((30, 20),))
    contrast = BALL - BACKGROUND
    faint = pong_frame(balls=((30, 20),), ball_level=BACKGROUND + contrast // 2 - 2)
    assert da.ball_hits(truth[None], faint[None]) == (0, 4)
    just_enough = pong_frame(balls=((30, 20),), ball_level=BACKGROUND + contrast // 2 + 2)
    assert da.ball_hits(truth[None], just_enough[None]) == (4, 4)
    # a frame drawn all at about the ball's level is close to the truth on the ball, but draws no ball
    washed = np.full_like(truth, BALL - 20)
    assert da.ball_hits(truth[None], washed[None]) == (0, 4)


def test_recall_scores_observed_and_open_loop_frames_apart():
    context = da.OPEN_LOOP_CONTEXT
    T = context + 11
    truth = np.stack([pong_frame(balls=((30, 10 + t),)) for t in range(T)])[None]  # (1, T, S, S)
    model = np.stack([pong_frame(balls=()) for _ in range(T)])[None]
    model[0, :context] = truth[0, :context]  # the observed frames drawn with their ball
    model[0, context - 1 + 10] = truth[0, context - 1 + 10]  # and the frame 10 steps open loop
    recall = da.ball_recall(truth, model, context)
    assert recall == {
        "world_model/ball_recall_observed": 1.0,
        "world_model/ball_recall_open_loop_5": 0.0,
        "world_model/ball_recall_open_loop_10": 1.0,
    }
    # a sequence too short for 10 steps open loop, and frames without a ball, leave their figures out
    short = da.ball_recall(truth[:, : context + 5], model[:, : context + 5], context)
    assert set(short) == {"world_model/ball_recall_observed", "world_model/ball_recall_open_loop_5"}
    empty = np.stack([pong_frame(balls=()) for _ in range(T)])[None]
    assert da.ball_recall(empty, empty, context) == {}


@pytest.mark.parametrize("side, rgb", [(64, False), (84, False), (64, True)], ids=["64", "84", "64 colour"])
def test_real_pong_frames_agree_with_the_emulator(side, rgb):
    """On real frames, a ball is found where the emulator's RAM says one is in play, and not elsewhere (they
    disagree where the ball touches a paddle and for a frame at each serve). Colour frames (--rgb) are scored in
    grey (`da.grey`), as the open-loop predictions are."""
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
            frame = da.grey(obs[-1]) if rgb else obs[-1]
            agree += ball_in_play == da.find_balls(frame)[0].any()
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
