"""The attention and decode config lookups: one entry per shape class from the JSON tables, the
rules that used to be edits after the lookup (bias, long streams, small pages) among its inputs."""
import pytest

from flashflow.tuning import families, table
from flashflow.tuning.attention import AttentionConfig, attention_config, shipped_entries
from flashflow.tuning.decode import DecodeConfig, decode_config


def test_every_family_has_a_config_for_every_head_dim():
    for family in families("attention"):
        for d in (16, 32, 64, 128, 256):
            for causal in (False, True):
                for bias in (False, True):
                    assert isinstance(attention_config(d, causal, family, bias), AttentionConfig)
    for family in families("decode"):
        for d in (16, 64, 128, 256):
            assert isinstance(decode_config(family, d), DecodeConfig)
    assert families("attention") == ["sm90", "sm80", "interpreter"] == families("decode")


def test_attention_bias_entries_keep_the_tile_in_shared_memory():
    # sm90 with a bias: at most 64-key tiles (32 at head_dim 256), 2 stages, no warp
    # specialisation; the families without TMA take their usual entry
    for d in (64, 128, 256):
        for causal in (False, True):
            plain, biased = attention_config(d, causal, "sm90"), attention_config(d, causal, "sm90", bias=True)
            assert biased.use_tma and biased.BLOCK_M == plain.BLOCK_M and biased.num_warps == plain.num_warps
            assert biased.BLOCK_N == min(plain.BLOCK_N, 64 if d <= 128 else 32)
            assert biased.num_stages == min(plain.num_stages, 2) and not biased.warp_specialize
            assert attention_config(d, causal, "sm80", bias=True) == attention_config(d, causal, "sm80")
    assert attention_config(128, False, "sm90").warp_specialize


def test_attention_lookup_errors_and_entries():
    with pytest.raises(ValueError, match="no attention configs for GPU family 'sm70'"):
        attention_config(64, False, "sm70")
    with pytest.raises(ValueError, match="no attention config for head_dim 512"):
        attention_config(512, False, "sm90")
    rows = shipped_entries("sm90")
    assert [r["family"] for r in rows] == ["sm90"] * len(table("attention")["sm90"])
    with pytest.raises(ValueError, match="family must be one of"):
        shipped_entries("tpu")


def test_decode_tiles():
    assert decode_config("sm90", 128) == DecodeConfig(64, 4, 3)
    assert decode_config("sm90", 256) == DecodeConfig(32, 4, 3)
    assert decode_config("sm80", 64) == DecodeConfig(64, 4, 3)
    assert decode_config("interpreter", 256) == DecodeConfig(32, 4, 1)


def test_decode_long_stream_rule():
    # more (sequence, KV head) programs than SMs, one split, long caches: 128-token tiles, sm90 only
    long = dict(programs=64 * 8, num_sms=132, max_seqlen_k=4096)
    assert decode_config("sm90", 128, **long) == DecodeConfig(128, 4, 3)
    assert decode_config("sm90", 128, **long, num_splits=1) == DecodeConfig(128, 4, 3)
    assert decode_config("sm90", 128, **long, num_splits=2) == DecodeConfig(64, 4, 3)     # asked to split
    assert decode_config("sm90", 256, **long) == DecodeConfig(32, 4, 3)                   # head_dim 256
    assert decode_config("sm90", 128, **{**long, "max_seqlen_k": 1024}) == DecodeConfig(64, 4, 3)
    assert decode_config("sm90", 128, **{**long, "programs": 132}) == DecodeConfig(64, 4, 3)
    assert decode_config("sm80", 128, **long) == DecodeConfig(64, 4, 3)


def test_decode_small_page_rule():
    # pages (a power of two, >= 16 tokens) smaller than the tile: page-sized tiles, one more stage
    assert decode_config("sm90", 128, page_size=16) == DecodeConfig(16, 4, 4)
    assert decode_config("sm90", 128, page_size=32) == DecodeConfig(32, 4, 4)
    assert decode_config("sm90", 128, page_size=64) == DecodeConfig(64, 4, 3)     # a tile per page already
    assert decode_config("sm90", 128, page_size=24) == DecodeConfig(64, 4, 3)     # not a power of two
    assert decode_config("sm90", 128, page_size=8) == DecodeConfig(64, 4, 3)      # too small
    long = dict(programs=64 * 8, num_sms=132, max_seqlen_k=8192)
    assert decode_config("sm90", 128, **long, page_size=64) == DecodeConfig(64, 4, 4)
    assert decode_config("interpreter", 64, page_size=16) == DecodeConfig(16, 4, 2)
    with pytest.raises(ValueError, match="no decode configs for GPU family"):
        decode_config("sm70", 128)
