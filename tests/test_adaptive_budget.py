"""adaptive_infinipot_v: AdaReTaKe's time-adaptive budget (eq. 8-9) on top of InfiniPot-V's scores."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import edgekv
from edgekv.policies import make_policy
from edgekv.policies.adaptive_infinipot_v import pair_distance, stretch_quotas

FPS = 2.0


def test_quotas_follow_the_weights_and_never_exceed_what_a_stretch_holds():
    quota = stretch_quotas(torch.tensor([30, 10, 100]), torch.tensor([[40, 40], [5, 40], [5, 7]]),
                           torch.tensor([1.0, 2.0]))
    assert quota.tolist() == [[10, 20], [3, 7], [5, 7]]  # eq. 9 split; a full stretch hands over; all held
    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        held = torch.randint(0, 30, (4, 6), generator=generator)
        budget = torch.randint(0, 120, (4,), generator=generator)
        quota = stretch_quotas(budget, held, torch.rand(6, generator=generator) + 0.01)
        assert bool((quota <= held).all()) and bool((quota >= 0).all())
        assert quota.sum(-1).tolist() == torch.minimum(budget, held.sum(-1)).tolist()


def test_distance_is_one_minus_the_mean_cosine_and_the_floor_holds():
    tokens = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    assert pair_distance(tokens, tokens) == pytest.approx(0.0, abs=1e-6)
    assert pair_distance(tokens, -tokens) == pytest.approx(2.0)
    policy = make_policy("adaptive_infinipot_v", chunk_pairs=4, floor=0.25)
    policy.distances = {1: 0.0, 2: 0.0, 5: 0.8, 6: 0.4}  # stretch 0 static, stretch 1 changing
    weights = policy.stretch_weights(3)
    mean = (0.0 + 0.6) / 2
    assert weights.tolist() == pytest.approx([0.25 * mean, 0.6, mean])  # floored; unmeasured = the mean
    with pytest.raises(ValueError, match="cache.adaptive_floor must be in"):
        make_policy("adaptive_infinipot_v", floor=0.0)


def _bursty_frames(pairs: int, period: int, seed: int = 0) -> list[np.ndarray]:
    """Stretches of ``period`` pairs alternate: one still frame, then a new random frame every frame."""
    rng = np.random.default_rng(seed)
    still = rng.integers(0, 256, (56, 56, 3), dtype=np.uint8)
    frames = []
    for pair in range(pairs):
        burst = (pair // period) % 2 == 1
        frames += [rng.integers(0, 256, (56, 56, 3), dtype=np.uint8) if burst else still for _ in range(2)]
    return frames


def test_a_bursty_stream_keeps_more_of_its_bursts_and_every_stretch_survives(tiny_checkpoint):
    frames = _bursty_frames(60, period=10)
    kept = {}
    for policy in ("infinipot_v", "adaptive_infinipot_v"):
        runtime = edgekv.Runtime.from_pretrained(
            tiny_checkpoint, model={"dtype": "fp32", "device": "cpu"}, video={"resolution": [56, 56], "fps": FPS},
            cache={"policy": policy, "max_tokens": 140, "text_reserve_tokens": 32, "adaptive_chunk_pairs": 10})
        session = runtime.session()
        for index, frame in enumerate(frames):
            session.ingest(frame, t=index / FPS)
        assert session.stats()["compressions"] >= 3
        n = session.cache.length
        frame = session.cache.frame[:, :, :n].long()
        vision = session.cache.kind[:, :, :n] == 2
        old = vision & (frame < 50)  # the stretches a compression had to choose between
        kept[policy] = (int((old & ((frame // 10) % 2 == 1)).sum()), int((old & ((frame // 10) % 2 == 0)).sum()))
        if policy == "adaptive_infinipot_v":
            for stretch in range(0, 5, 2):  # static stretches: squeezed, never gone, in every (layer, head)
                assert bool(((old & (frame // 10 == stretch)).sum(-1) >= 1).all())
            restored = make_policy("adaptive_infinipot_v")
            restored.load_state(session.policy.state())
            assert restored.distances == session.policy.distances
    assert kept["adaptive_infinipot_v"][0] > kept["infinipot_v"][0]
    assert kept["adaptive_infinipot_v"][1] < kept["infinipot_v"][1]
