"""Autotune selection logic (the timing itself needs a GPU; here it is a stand-in function)."""
import pytest

from flashflow.tuning import autotune
from flashflow.tuning.attention import AttentionConfig


def test_picks_fastest_skips_failures_and_caches():
    autotune.clear()
    base = AttentionConfig(128, 128, 8, 3, use_tma=True, warp_specialize=True)
    cands = autotune.candidates(base)
    assert cands[0] == base and len(cands) == len(set(cands)) >= 4
    calls = []

    def fake_time(cfg):
        calls.append(cfg)
        if cfg.BLOCK_N == 64:
            raise RuntimeError("out of resources")
        return 1.0 if cfg.num_stages == 2 else 2.0

    best = autotune.pick(("k",), cands, fake_time)
    assert best.num_stages == 2
    n = len(calls)
    assert autotune.pick(("k",), cands, fake_time) == best and len(calls) == n  # cached
    with pytest.raises(RuntimeError, match="every candidate config failed"):
        autotune.pick(("other",), cands, lambda c: (_ for _ in ()).throw(RuntimeError("x")))
    autotune.clear()


def test_seqlen_bucket_and_switch(monkeypatch):
    assert [autotune.seqlen_bucket(s) for s in (1, 2, 3, 4352, 8192)] == [1, 2, 4, 8192, 8192]
    monkeypatch.setenv("FLASHFLOW_AUTOTUNE", "1")
    assert autotune.enabled()
    monkeypatch.setenv("FLASHFLOW_AUTOTUNE", "0")
    assert not autotune.enabled()
