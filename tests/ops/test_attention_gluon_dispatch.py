"""Which attention forward kernel takes a call: the Gluon kernel's rule (flashflow.ops.attention_gluon)
seen on the CPU with the GPU family stood in for, its override by FLASHFLOW_ATTENTION_KERNEL, its
config table and launch rule. The kernel itself runs only on a Hopper GPU
(tests/gpu/test_gpu_attention_gluon.py)."""
import dataclasses

import pytest
import torch

import flashflow
from flashflow.ops import attention as attn_ops
from flashflow.ops import attention_gluon as ag
from flashflow.reference import attention_naive
from flashflow.reference.metrics import rel_l2
from flashflow.tuning.attention_gluon import CONFIGS, GluonAttentionConfig, gluon_attention_config, last_wave_pieces


@pytest.fixture
def hopper(monkeypatch):
    """CPU tensors taken for an sm90 GPU's by the Gluon kernel's rule (nothing launches)."""
    monkeypatch.setattr(ag, "interpreting", lambda: False)
    monkeypatch.setattr(ag, "on_gpu", lambda device: True)
    monkeypatch.setattr(ag, "gpu_family", lambda device: "sm90")


def _qkv(d=128, dtype=torch.bfloat16, b=2, s=2100, h=4, hk=4):
    return (torch.randn(b, s, h, d, dtype=dtype), torch.randn(b, s, hk, d, dtype=dtype),
            torch.randn(b, s, hk, d, dtype=dtype))


def test_takes_the_hot_calls(hopper):
    q, k, v = _qkv()
    assert ag.unsupported_reason(q, k, v) is None
    assert ag.unsupported_reason(q, k, v, window_right=0) is None                  # causal
    assert ag.unsupported_reason(*_qkv(dtype=torch.float16)) is None
    assert ag.unsupported_reason(*_qkv(hk=2)) is None                                # GQA
    assert ag.unsupported_reason(*_qkv(d=256)) is None                               # head_dim 256
    assert ag.unsupported_reason(*_qkv(d=64)) is None                                # head_dim 64, 2048 keys on
    assert ag.unsupported_reason(*_qkv(d=64), window_right=0) is None                # causal too
    sdpa = [torch.randn(2, 4, 2100, 128, dtype=torch.bfloat16).transpose(1, 2) for _ in range(3)]
    assert ag.unsupported_reason(*sdpa) is None                                      # SDPA's layout
    fused = torch.randn(2, 2100, 3, 4, 128, dtype=torch.bfloat16).unbind(2)
    assert ag.unsupported_reason(*fused) is None                                     # one q/k/v buffer
    assert attn_ops.forward_kernel_name(q, k, v, softmax_scale=0.1) == ag.GLUON


def test_a_config_with_auto_off_runs_only_when_forced(hopper, monkeypatch):
    """A shipped entry with ``auto`` off leaves the call to the portable kernel unless
    FLASHFLOW_ATTENTION_KERNEL=gluon forces it."""
    shipped = ag.gluon_attention_config
    monkeypatch.setattr(ag, "gluon_attention_config", lambda *a: dataclasses.replace(shipped(*a), auto=False))
    q, k, v = _qkv()
    assert "portable kernel measured faster" in ag.unsupported_reason(q, k, v)
    assert ag.unsupported_reason(q, k, v, forced=True) is None


@pytest.mark.parametrize("case, reason", [
    ("fp32", "dtype"), ("d64-causal-short", "fewer than 2048 keys"), ("d64-short", "fewer than 2048 keys"),
    ("d96", "no Gluon config"), ("varlen", "varlen"), ("bias", "bias"), ("softcap", "softcap"),
    ("window", "window"), ("config", "portable config"), ("empty", "empty"), ("out-strided", "out"),
    ("last-stride", "TMA"), ("misaligned", "TMA"), ("expanded", "row view"), ("k-v-differ", "row view"),
    ("short", "fewer than 256 keys"), ("short-causal", "fewer than 512 keys"), ("scale-zero", "softmax_scale"), ("scale-negative", "softmax_scale"),
    ("scale-inf", "softmax_scale"),
])
def test_leaves_the_rest_to_the_portable_kernel(hopper, case, reason):
    q, k, v = _qkv()
    kw = {}
    if case == "fp32":
        q, k, v = _qkv(dtype=torch.float32)
    elif case == "d96":
        q, k, v = _qkv(d=96)
    elif case == "d64-causal-short":
        q, k, v = _qkv(d=64, s=2000)
        kw["window_right"] = 0
    elif case == "d64-short":
        q, k, v = _qkv(d=64, s=2000)
    elif case == "varlen":
        kw["cu_seqlens_q"] = torch.tensor([0, 2100], dtype=torch.int32)
    elif case == "bias":
        kw["bias"] = torch.zeros(2100, 2100)
    elif case == "softcap":
        kw["softcap"] = 30.0
    elif case == "window":
        kw.update(window_left=16, window_right=0)
    elif case == "config":
        kw["config"] = attn_ops.pick_config(q, causal=False)
    elif case == "empty":
        q, k, v = _qkv(s=0)
    elif case == "short":
        q, k, v = _qkv(s=200)
    elif case == "short-causal":
        q, k, v = _qkv(s=500)
        kw["window_right"] = 0
    elif case.startswith("scale-"):
        kw["softmax_scale"] = {"scale-zero": 0.0, "scale-negative": -0.1, "scale-inf": float("inf")}[case]
    elif case == "out-strided":
        kw["out"] = torch.empty(2, 2100, 4, 256, dtype=torch.bfloat16)[..., ::2]
    elif case == "last-stride":
        q = torch.randn(2, 2100, 4, 256, dtype=torch.bfloat16)[..., ::2]
    elif case == "misaligned":
        q = torch.randn(2 * 2100 * 4 * 128 + 1, dtype=torch.bfloat16)[1:].view(2, 2100, 4, 128)
    elif case == "expanded":
        k = torch.randn(2, 2100, 1, 128, dtype=torch.bfloat16).expand(2, 2100, 4, 128)
    elif case == "k-v-differ":
        v = torch.randn(2, 4, 2100, 128, dtype=torch.bfloat16).transpose(1, 2)
    got = ag.unsupported_reason(q, k, v, **kw)
    assert got is not None and reason in got, got
    assert not ag.supports(q, k, v, **kw)


def test_not_on_the_interpreter_or_another_family(monkeypatch):
    q, k, v = _qkv()
    assert "CUDA" in ag.unsupported_reason(q, k, v)
    monkeypatch.setattr(ag, "interpreting", lambda: False)
    monkeypatch.setattr(ag, "on_gpu", lambda device: True)
    monkeypatch.setattr(ag, "gpu_family", lambda device: "sm80")
    assert "sm80" in ag.unsupported_reason(q, k, v)


def test_the_override(hopper, monkeypatch):
    q, k, v = _qkv()
    q64 = _qkv(d=64)
    monkeypatch.setenv(ag.KERNEL_ENV, "portable")
    assert not ag.supports(q, k, v)
    monkeypatch.setenv(ag.KERNEL_ENV, "gluon")
    assert ag.supports(q, k, v) and ag.supports(*q64)      # forced: the config's auto off too
    assert ag.supports(*_qkv(s=100))                       # and short sequences
    with pytest.raises(ValueError, match="FLASHFLOW_ATTENTION_KERNEL=gluon.*softcap"):
        ag.supports(q, k, v, softcap=5.0)
    monkeypatch.setenv(ag.KERNEL_ENV, "fastest")
    with pytest.raises(ValueError, match="FLASHFLOW_ATTENTION_KERNEL must be one of auto, gluon, portable"):
        ag.supports(q, k, v)
    monkeypatch.setenv(ag.KERNEL_ENV, " AUTO ")
    assert ag.supports(q, k, v)


def test_the_interpreter_runs_the_portable_kernel(monkeypatch):
    """On the CPU the portable kernel takes every call, whatever the override asks short of
    forcing the Gluon kernel (which then names why it cannot)."""
    q, k, v = (t.float() for t in _qkv(b=1, s=37, h=2, hk=2, d=32))
    ref = attention_naive(q.double(), k.double(), v.double())
    for choice in ("auto", "portable"):
        monkeypatch.setenv(ag.KERNEL_ENV, choice)
        assert attn_ops.forward_kernel_name(q, k, v, softmax_scale=0.1) == attn_ops.PORTABLE
        assert rel_l2(flashflow.flash_attn_func(q, k, v), ref) < 1e-5
    monkeypatch.setenv(ag.KERNEL_ENV, "gluon")
    with pytest.raises(ValueError, match="not on a CUDA device"):
        flashflow.flash_attn_func(q, k, v)


def test_config_table_and_rules():
    assert CONFIGS.problems() == []
    hot = gluon_attention_config(128, False, "sm90", 4096)
    assert hot.auto and hot.split_warpgroups and hot.persistent and not hot.pingpong and hot.min_seqlen_k == 256
    assert hot.overlap_tiles
    for keys in (512, 8192, 8193, 65536):   # causal: persistent, tiles by ticket, at every length
        causal = gluon_attention_config(128, True, "sm90", keys)
        assert causal.auto and causal.min_seqlen_k == 512 and causal.persistent and causal.dynamic
        assert causal.overlap_tiles and not causal.pingpong
    wide = gluon_attention_config(256, False, "sm90", 4096)   # 64-key blocks, persistent with one Q buffer
    assert wide.auto and wide.BLOCK_N == 64 and wide.persistent and wide.dynamic and wide.q_buffers == 1
    assert wide.overlap_tiles
    for keys in (512, 4096, 32768):   # causal: the same tile, persistent, by ticket, overlapped
        wide = gluon_attention_config(256, True, "sm90", keys)
        assert wide.auto and wide.BLOCK_N == 64 and wide.persistent and wide.dynamic and wide.q_buffers == 1
        assert wide.overlap_tiles and not wide.pingpong and wide.min_seqlen_k == 512
    # head_dim 64 without a causal mask: 192 rows in three partitions from 2048 keys; causal: the
    # head_dim-128 causal tile from 2048 keys
    d64 = gluon_attention_config(64, False, "sm90", 4096)
    assert d64.auto and d64.BLOCK_M == 192 and d64.partitions == 3 and d64.q_rows == 64 and d64.min_seqlen_k == 2048
    assert d64.persistent and d64.dynamic and d64.overlap_tiles and d64.split_last_wave
    d64c = gluon_attention_config(64, True, "sm90", 4096)
    assert d64c.auto and d64c.BLOCK_M == 128 and d64c.partitions == 2 and d64c.min_seqlen_k == 2048
    assert d64c.persistent and d64c.dynamic and d64c.overlap_tiles and not d64c.pingpong and not d64c.split_last_wave
    # the tiles past the last full wave in key pieces: the persistent entries without a causal mask
    for d in (128, 256):
        assert gluon_attention_config(d, False, "sm90", 4096).split_last_wave
        assert not gluon_attention_config(d, True, "sm90", 4096).split_last_wave


def test_last_wave_pieces():
    """The rule for key pieces (132 CTAs): the tiles left after the full waves, ``ctas // T``
    pieces each, at least min_piece_blocks blocks a piece, at most max_pieces; none for a causal
    call, full waves, or a config without it."""
    hot = gluon_attention_config(128, False, "sm90", 4096)
    assert (hot.min_piece_blocks, hot.max_pieces) == (4, 8)
    assert last_wave_pieces(hot, False, 816, 132, 34) == 5    # Qwen-Image 1024px: 24 tiles past 6 waves
    assert last_wave_pieces(hot, False, 408, 132, 34) == 8    # 12 heads: 12 past 3 waves, at most 8
    assert last_wave_pieces(hot, False, 1584, 132, 66) == 1   # Qwen-Image-Edit: 12 full waves
    assert last_wave_pieces(hot, False, 2048, 132, 16) == 1   # 68 past 15 waves: 132 // 68 = 1
    assert last_wave_pieces(hot, False, 16, 132, 8) == 2      # fewer tiles than CTAs: 4 blocks a piece
    assert last_wave_pieces(hot, False, 16, 132, 7) == 1
    assert last_wave_pieces(hot, True, 816, 132, 34) == 1
    assert last_wave_pieces(dataclasses.replace(hot, split_last_wave=False), False, 816, 132, 34) == 1
    wide = gluon_attention_config(256, False, "sm90", 4096)   # 64-key blocks: 8 a piece
    assert last_wave_pieces(wide, False, 272, 132, 68) == 8
    assert last_wave_pieces(wide, False, 272, 132, 40) == 5
    assert last_wave_pieces(hot, False, 182, 132, 34) == 2      # 50 past the wave: 132 // 50


@pytest.mark.parametrize("fields, match", [
    (dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=2), "64 rows a warpgroup"),
    (dict(BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=2, split_warpgroups=True), "needs warp_specialize"),
    (dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=2, persistent=True), "needs warp_specialize"),
    (dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=2, pingpong=True), "pingpong needs split_warpgroups"),
    (dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=2, warp_specialize=True, dynamic=True),
     "dynamic needs persistent"),
    (dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=2, q_buffers=3), "q_buffers must be 1 or 2"),
    (dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=2, warp_specialize=True, overlap_tiles=True),
     "overlap_tiles needs split_warpgroups"),
    (dict(BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=2, warp_specialize=True, split_warpgroups=True,
          persistent=True, split_last_wave=True), "split_last_wave needs overlap_tiles"),
    (dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=2, max_pieces=1), "max_pieces at least 2"),
    (dict(BLOCK_M=192, BLOCK_N=128, num_warps=4, num_stages=2), "64 rows a warpgroup"),
    (dict(BLOCK_M=256, BLOCK_N=128, num_warps=4, num_stages=2, warp_specialize=True, split_warpgroups=True),
     "must be 128 or 192"),
    (dict(BLOCK_M=192, BLOCK_N=128, num_warps=4, num_stages=2, warp_specialize=True, split_warpgroups=True,
          pingpong=True), "pingpong needs split_warpgroups with two partitions"),
])
def test_config_refuses_what_the_kernel_cannot_be(fields, match):
    with pytest.raises(ValueError, match=match):
        GluonAttentionConfig(**fields)


def test_partitions_and_q_boxes(monkeypatch):
    """MMA partitions of 64 rows and the rows of Q's TMA box (a power of two): 192 rows are three
    partitions fed by three 64-row boxes; the launcher sizes the key pieces' scratch by them."""
    three = GluonAttentionConfig(192, 128, 4, 2, True, True, persistent=True, overlap_tiles=True)
    two = GluonAttentionConfig(128, 128, 4, 2, True, True)
    one = GluonAttentionConfig(128, 128, 8, 2, True)
    assert (three.partitions, three.q_rows) == (3, 64)
    assert (two.partitions, two.q_rows) == (2, 128)
    assert (one.partitions, one.q_rows) == (1, 128)
    q = torch.empty(1, 1000, 70, 64, dtype=torch.bfloat16)
    k = torch.empty(1, 1000, 14, 64, dtype=torch.bfloat16)
    cfg = dataclasses.replace(three, dynamic=True, split_last_wave=True, min_piece_blocks=1)
    monkeypatch.setattr(ag, "num_sms", lambda device: 132)   # an H100's or H200's CTAs
    plan = ag.GluonPlan(q, k, k, None, 0, False, True, False, cfg, None)
    assert plan.constexprs["PARTITIONS"] == 3 and plan.constexprs["BLOCK_M"] == 192
    assert plan.descs[0][2] == [64, 64] and plan.descs[1][2] == [128, 64]   # Q's box, K's block
    pieces = plan.ints[-2]
    assert plan.split_tiles == 6 * 70 % 132 and pieces == 132 // 24   # cdiv(1000, 192) row tiles a head, 70 heads
    assert plan.ws_words == plan.split_tiles * (pieces - 1) * 3 * 64 * (64 + 2)   # a slot a partition and piece
