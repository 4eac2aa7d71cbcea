"""Policies at the edges of their configuration (probes of issue s95): each test failed before its fix."""

from __future__ import annotations

import pytest
import torch

from edgekv.cache import CapTooSmallError, SlotKind
from edgekv.policies import make_policy
from test_policies import PER_PAIR, ToySession


def test_sink_recent_refuses_a_target_that_cannot_hold_the_stream_sinks():
    # prefix 3 + 1 recent pair + the first pair (sink_recent's sink) = 3 + 2 * 6 = 15 slots always kept. A target of
    # 12 passed the base check (prefix + recent = 9) and its compressions then dropped prefix slots by topk's ties.
    session = ToySession(capacity=64, prefix=3, reserve=8)
    policy = make_policy("sink_recent", target_tokens=12, recent_ratio=0.05)
    assert policy.recent_pairs(session) == 1
    with pytest.raises(CapTooSmallError, match="the minimum is 16"):
        policy.check(session)
    roomy = make_policy("sink_recent", target_tokens=16, recent_ratio=0.05)
    roomy.check(session)
    for _ in range(30):
        if session.cache.length + PER_PAIR > session.video_limit:
            roomy.compress(session, PER_PAIR)
            kind = session.cache.kind[:, :, : session.cache.length]
            assert bool((kind[:, :, :3] == int(SlotKind.PREFIX)).all())
            frame = session.cache.frame[:, :, : session.cache.length]
            assert bool((frame == 0).sum(-1).eq(PER_PAIR).all())  # the first pair, whole in every head
        session.add_pair()


@pytest.mark.parametrize("prefix", [3, 10])
def test_infinipot_v_at_tar_ratio_one_keeps_what_tar_keeps(prefix):
    # alpha = 1 is TaR alone (InfiniPot-V Tab. A1). alpha |C| - |recent| TaR picks overflowed the room the prefix
    # leaves, and the surplus picks, all lifted to one score, were dropped by topk's tie order, not by TaR rank.
    a, b = ToySession(capacity=80, prefix=prefix, seed=1), ToySession(capacity=80, prefix=prefix, seed=1)
    tar = make_policy("tar", target_tokens=40, recent_ratio=0.1)
    both = make_policy("infinipot_v", target_tokens=40, recent_ratio=0.1, tar_ratio=1.0)
    for _ in range(11):
        a.add_pair()
        b.add_pair()
    recent = tar.recent_pairs(a)
    assert torch.equal(tar.select(a.view(recent), 40), both.select(b.view(recent), 40))


def test_a_default_target_too_small_is_said_as_a_default_with_what_to_change():
    """An unset cache.target_tokens refused at a small cap was named "cache.target_tokens=42", a key the user never
    set; the error now says where C came from, and what to change: C itself where a larger one fits, else the cap."""
    session = ToySession(capacity=64, prefix=36, reserve=8)  # video_limit 56: default C = 0.75 x 56 = 42
    with pytest.raises(CapTooSmallError) as caught:
        make_policy("infinipot_v").check(session)  # prefix 36 + one recent pair of 6: the minimum is 43
    said = str(caught.value)
    assert said.startswith("the compression target C = 0.75 x (M - text_reserve) = 42 (cache.target_tokens unset)")
    assert said.endswith("; set cache.target_tokens between 43 and 50, or raise cache.max_tokens"), said
    with pytest.raises(CapTooSmallError, match=r"cache\.target_tokens=40 cannot hold .* no target fits under M - "
                                               r"text_reserve = 56: raise cache\.max_tokens"):
        make_policy("infinipot_v", target_tokens=40).check(ToySession(capacity=64, prefix=46, reserve=8))
