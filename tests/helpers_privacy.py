"""Shared by the tests of sealed memory (test_privacy.py, test_rekey.py): a small runtime over the tiny
checkpoint with a ``privacy:`` section, and a session that has seen some random frames."""

from __future__ import annotations

import numpy as np

import edgekv

RES = (56, 84)


def privacy_runtime(model_dir, **privacy) -> edgekv.Runtime:
    return edgekv.Runtime.from_pretrained(model_dir, model={"dtype": "fp32", "device": "cpu"},
                                          video={"resolution": list(RES), "fps": 2.0},
                                          cache={"policy": "infinipot_v", "max_tokens": 120, "text_reserve_tokens": 40},
                                          privacy=privacy)


def seen_session(rt, frames: int = 21):
    session = rt.session()
    for index in range(frames):
        session.ingest(np.random.default_rng(index).integers(0, 256, size=(60, 80, 3), dtype=np.uint8), t=index / 2.0)
    return session
