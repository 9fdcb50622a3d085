"""Ulysses FP8 attention with the exchange inside the quantize pass
(flashflow.ops.attention_fp8.UlyssesFp8Plan), every rank simulated in one process.

On GPUs each rank's kernels write into every rank's buffer (peer memory); here every rank's
buffer is a slice of one CPU tensor and the kernels get the same offsets between them. The ranks'
launches run one phase after the other (every rank's statistics, then every rank's quantize pass,
then every rank's attention): what the buffers hold once the barriers between phases have passed.
Buffers start as 0xFF bytes (NaN as float32), so anything a rank misses shows.

What must hold: every rank's 8-bit inputs are one process's over the whole sequence (the same
Q, V and scales; K up to the rounding of its mean, which is summed in another order), key blocks
shared between two ranks included, so the output is one process's FP8 attention over the whole
sequence for the rank's heads.
"""
from __future__ import annotations

import pytest
import torch

from flashflow.distributed.exchange import expand_masks
from flashflow.ops.attention_fp8 import UlyssesFp8Plan, flash_attn_fp8_func, quantize_attention_inputs
from flashflow.reference import attention_naive
from flashflow.tuning.attention_fp8 import attention_fp8_config


def _inputs(b, s, h, hk, d, layout, gen):
    """q, k, v (b, s, ·, d) bf16 with outlier channels and offsets (K's mean matters), in ``layout``."""
    def draw(heads):
        x = torch.randn(b, s, heads, d, generator=gen, dtype=torch.float64)
        x[..., 3] *= 8.0                                   # an outlier channel
        x += torch.randn(1, 1, heads, d, generator=gen, dtype=torch.float64)   # per-channel offsets
        return x.to(torch.bfloat16)
    q, k, v = draw(h), draw(hk), draw(hk)
    if layout == "transposed":
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    elif layout == "strided":   # q/k/v as views of one fused buffer, the processor's joint projection
        qkv = torch.cat([q, k, v], dim=2)
        q, k, v = qkv[:, :, :h], qkv[:, :, h:h + hk], qkv[:, :, h + hk:]
    return q, k, v


def _run_ranks(q, k, v, world, masks, qk_format="int8", return_lse=False, per_destination=False):
    """Every rank's (out, lse, buffer views), the ranks simulated one phase at a time.
    ``per_destination``: one quantize launch a destination rank (this rank's last), not one in all."""
    s_local = q.shape[1] // world
    pieces = [tuple(t[:, r * s_local:(r + 1) * s_local] for t in (q, k, v)) for r in range(world)]
    recv_mask = expand_masks(masks, s_local)
    plans = [UlyssesFp8Plan(*pieces[r], masks[r], recv_mask, world, r, qk_format, return_lse) for r in range(world)]
    n = plans[0].nbytes
    assert all(p.nbytes == n for p in plans)
    memory = torch.full((world * n,), 0xFF, dtype=torch.uint8)
    raw = [memory[r * n:(r + 1) * n] for r in range(world)]
    bufs = [plans[r].views(raw[r]) for r in range(world)]
    dest = [torch.tensor(plans[r].peer_bytes(raw), dtype=torch.int64) for r in range(world)]
    assert dest[1].tolist()[:2] == [-n, 0]
    scale = q.shape[-1] ** -0.5
    for r in range(world):
        plans[r].statistics(None, bufs[r], dest[r], pieces[r][1], pieces[r][2], masks[r])
    for r in range(world):
        if per_destination:
            for g in [*range(r + 1, world), *range(r + 1)]:
                plans[r].quantize(None, bufs[r], dest[r], *pieces[r], masks[r], scale, g, 1)
        else:
            plans[r].quantize(None, bufs[r], dest[r], *pieces[r], masks[r], scale)
    results = [plans[r].attend(None, bufs[r], recv_mask) for r in range(world)]
    for r in range(world if not return_lse else 0):   # the same rows a source rank at a time: the same bits
        out = results[r][0]
        rows = torch.full((out.shape[0], s_local, out.shape[2] + 1, out.shape[3]), float("nan"), dtype=out.dtype)
        for p in range(world):
            plans[r].attend_rows(None, bufs[r], recv_mask, p, rows[:, :, 1:])   # a strided output view
            got, want = rows[:, :, 1:], out[:, p * s_local:(p + 1) * s_local]
            assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num()), (r, p)
    return results, bufs, recv_mask


CASES = [
    # world, batch, seqlen_local, heads, kv_heads, head_dim, layout, mask
    (2, 2, 21, 4, 2, 64, "contiguous", False),    # 16-key blocks: rank 1's slice starts inside one
    (2, 1, 32, 2, 2, 64, "transposed", False),    # slices of whole blocks
    (3, 1, 7, 3, 3, 64, "strided", True),         # a block shared by three ranks, masks
    (2, 2, 19, 4, 4, 64, "contiguous", True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_ranks_get_one_process_quantization_and_output(case):
    world, b, s_local, h, hk, d, layout, with_mask = case
    gen = torch.Generator().manual_seed(CASES.index(case) + 1)
    s = world * s_local
    q, k, v = _inputs(b, s, h, hk, d, layout, gen)
    masks = [None] * world
    if with_mask:   # each rank's mask over its first 3 keys
        masks = [torch.rand(b, 3, generator=gen) > 0.4 for _ in range(world)]
        for m in masks:
            m[:, 0] = True
    # cases 1 and 3: one quantize launch a destination rank; the others one launch for all
    results, bufs, recv_mask = _run_ranks(q, k, v, world, masks, per_destination=CASES.index(case) % 2 == 1)
    scale = d ** -0.5
    cfg = attention_fp8_config(d, False, "interpreter")
    whole = quantize_attention_inputs(q, k, v, scale, cfg.BLOCK_M, cfg.BLOCK_N, "int8",
                                      key_padding_mask=recv_mask)
    want_out = flash_attn_fp8_func(q, k, v, softmax_scale=scale, key_padding_mask=recv_mask)
    exact = attention_naive(q.double(), k.double(), v.double(), scale, key_padding_mask=recv_mask)
    hr, hkr = h // world, hk // world
    for r in range(world):
        got = bufs[r]
        qs, ks = slice(r * hr, (r + 1) * hr), slice(r * hkr, (r + 1) * hkr)
        assert torch.equal(got["q8"].view(whole["q8"][:, qs].shape), whole["q8"][:, qs])
        assert torch.equal(got["q_scale"].view(whole["q_scale"][:, qs].shape), whole["q_scale"][:, qs])
        assert torch.equal(got["vt8"].view(whole["vt8"][:, ks].shape), whole["vt8"][:, ks])
        assert torch.equal(got["v_scale"].view(whole["v_scale"][:, ks].shape), whole["v_scale"][:, ks])
        k_scale = got["k_scale"].view(whole["k_scale"][:, ks].shape)
        torch.testing.assert_close(k_scale, whole["k_scale"][:, ks], rtol=1e-5, atol=0)
        k8 = got["k8"].view(whole["k8"][:, ks].shape).to(torch.int32)
        assert (k8 - whole["k8"][:, ks].to(torch.int32)).abs().max() <= 1
        out, _ = results[r]
        assert not out.isnan().any()
        torch.testing.assert_close(out, want_out[:, :, qs], rtol=2e-2, atol=2e-2)
        err = (out.double() - exact[:, :, qs]).norm() / exact[:, :, qs].norm()
        want_err = (want_out[:, :, qs].double() - exact[:, :, qs]).norm() / exact[:, :, qs].norm()
        assert err < 0.1 and err < 1.2 * want_err + 1e-3, (r, err, want_err)


def test_lse_matches_one_process():
    world, b, s_local, h, d = 2, 1, 21, 2, 64
    gen = torch.Generator().manual_seed(7)
    q, k, v = _inputs(b, world * s_local, h, h, d, "contiguous", gen)
    results, _, _ = _run_ranks(q, k, v, world, [None] * world, return_lse=True)
    _, want_lse = flash_attn_fp8_func(q, k, v, return_lse=True)
    for r in range(world):
        torch.testing.assert_close(results[r][1], want_lse[:, r * (h // world):(r + 1) * (h // world)],
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("where", ["k-shared-block", "k-own-block", "v", "q"])
def test_non_finite_values_mark_what_one_process_marks(where):
    """A NaN in one rank's slice: the NaN pattern of every rank's output equals one process's, a
    NaN in a key block shared by two ranks included (both ranks give the block a NaN scale)."""
    world, b, s_local, h, d = 2, 1, 21, 2, 64
    gen = torch.Generator().manual_seed(11)
    q, k, v = _inputs(b, world * s_local, h, h, d, "contiguous", gen)
    row = {"k-shared-block": 22, "k-own-block": 40, "v": 5, "q": 30}[where]   # block 1 (16-31) is shared
    target = {"q": q, "v": v}.get(where, k)
    target[0, row, 1, 4] = float("nan")
    results, _, _ = _run_ranks(q, k, v, world, [None] * world)
    want = flash_attn_fp8_func(q, k, v)
    for r in range(world):
        out = results[r][0]
        assert torch.equal(out.isnan(), want[:, :, r:r + 1].isnan()), (where, r)
    assert want.isnan().any()


def test_peer_bytes_refuses_what_the_kernels_cannot_store_into():
    world, b, s_local, h, d = 2, 1, 21, 2, 64
    q, k, v = _inputs(b, world * s_local, h, h, d, "contiguous", torch.Generator().manual_seed(3))
    plan = UlyssesFp8Plan(q[:, :s_local], k[:, :s_local], v[:, :s_local], None, None, world, 0)
    n = plan.nbytes
    memory = torch.empty(3 * n + 64, dtype=torch.uint8)
    assert plan.peer_bytes([memory[:n], memory[2 * n:3 * n]]) == [0, 2 * n]
    with pytest.raises(ValueError, match="one buffer a rank"):
        plan.peer_bytes([memory[:n]])
    with pytest.raises(ValueError, match="16 bytes apart"):
        plan.peer_bytes([memory[:n], memory[n + 8:2 * n + 8]])
    with pytest.raises(ValueError, match=f"hold {n} bytes"):
        plan.peer_bytes([memory[:n], memory[n:2 * n - 16]])
