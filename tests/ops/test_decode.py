"""Decode attention against a KV cache, through Triton's interpreter, against float64."""
import pytest
import torch

import flashflow
from flashflow.ops.decode import DecodePlan, _check_values, num_splits_heuristic
from flashflow.reference.decode import (kvcache_attention_ref, merge_attention_states_ref, to_ft_k,
                                        to_ft_v)
from flashflow.tuning.decode import DecodeConfig
from flashflow.reference.metrics import rel_l2

pytestmark = pytest.mark.kernels
TOL = 5e-3


def make_cache(batch, capacity, kv_heads, d, page=None, dtype=torch.float16, *, device):
    """Contiguous cache, or a paged one with a shuffled block table (pages not in order)."""
    if page is None:
        k = torch.randn(batch, capacity, kv_heads, d, dtype=dtype, device=device)
        return k, torch.randn_like(k), None
    per_seq = capacity // page
    num_blocks = batch * per_seq + 3
    k = torch.randn(num_blocks, page, kv_heads, d, dtype=dtype, device=device)
    table = torch.randperm(num_blocks, device=device)[:batch * per_seq].reshape(batch, per_seq).int()
    return k, torch.randn_like(k), table


def run_case(lens, heads=8, kv_heads=2, d=64, capacity=1024, seqlen_q=1, n_new=0, page=None, causal=True,
             window=(-1, -1), softcap=0.0, num_splits=0, kv_layout="NHD", dtype=torch.float16, config=None,
             poison=False, *, device):
    """``poison``: the cache rows past each sequence's length hold NaN (a reused page may)."""
    batch = len(lens)
    k_cache, v_cache, table = make_cache(batch, capacity, kv_heads, d, page, dtype, device=device)
    if poison:
        for c in (k_cache, v_cache):
            for i, n in enumerate(lens):
                pos = torch.arange(n, capacity, device=device)
                if page is None:
                    c[i, pos] = float("nan")
                else:
                    c[table[i, pos // page].long(), pos % page] = float("nan")
    if kv_layout == "FT":
        k_cache, v_cache = to_ft_k(k_cache), to_ft_v(v_cache)
    q = torch.randn(batch, seqlen_q, heads, d, dtype=dtype, device=device)
    k = torch.randn(batch, n_new, kv_heads, d, dtype=dtype, device=device) if n_new else None
    v = torch.randn_like(k) if n_new else None
    seqlens = torch.tensor(lens, dtype=torch.int32, device=device)
    ref, ref_lse, ref_k, ref_v = kvcache_attention_ref(
        q.double(), k_cache.double(), v_cache.double(), None if k is None else k.double(),
        None if v is None else v.double(), seqlens, table, causal=causal, window_size=window,
        softcap=softcap, kv_layout=kv_layout)
    plan = None if config is None else DecodePlan(
        batch, heads, kv_heads, d, capacity, seqlen_q=seqlen_q, device=device, num_splits=num_splits, config=config)
    out, lse = flashflow.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=seqlens, block_table=table, causal=causal,
        window_size=window, softcap=softcap, num_splits=num_splits, return_softmax_lse=True, kv_layout=kv_layout,
        plan=plan)
    assert torch.isfinite(out).all()
    assert rel_l2(out, ref) < (2e-2 if dtype == torch.bfloat16 else TOL), rel_l2(out, ref)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    fin = torch.isfinite(ref_lse)
    assert (lse.double()[fin] - ref_lse[fin]).abs().max() < 1e-2
    # the append landed where the reference put it, and nothing else changed
    assert all(torch.allclose(c.double(), r, rtol=0, atol=0, equal_nan=True)
               for c, r in ((k_cache, ref_k), (v_cache, ref_v)))


@pytest.mark.parametrize("num_splits", [1, 3, 7])
def test_ragged_lengths(device, num_splits):
    run_case([1, 17, 1000], num_splits=num_splits, device=device)


@pytest.mark.parametrize("page", [16, 24, 64])  # 24: not a power of two, rows gathered one by one
@pytest.mark.parametrize("num_splits", [1, 4])
def test_paged_shuffled(device, page, num_splits):
    run_case([5, 300, 1000], page=page, num_splits=num_splits, device=device)


@pytest.mark.parametrize("seqlen_q", [1, 3])
def test_paged_tile_spanning_pages(device, seqlen_q):
    # a configured 64-token tile over 16-token pages: 4 table entries per tile, rows gathered;
    # GQA group 4 × seqlen_q rows of a 16-row tile, so the merge sees padded rows too
    run_case([5, 300, 1000], page=16, num_splits=5, seqlen_q=seqlen_q, config=DecodeConfig(64, 4, 1), device=device)


@pytest.mark.parametrize("page", [None, 16, 32, 64])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_rows_past_the_end_hold_nan(device, page, num_splits):
    # a reused page (or an unwritten cache row) may hold NaN past a sequence's length: the last
    # tile reads those rows' addresses, and they must not reach the output (p = 0 there, 0·NaN
    # is not 0). Pages of one tile or more (table entry read a tile ahead) and tiles over
    # several pages (rows gathered: config 64 over 16/32-token pages)
    run_case([5, 300, 1000, 64], page=page, num_splits=num_splits, poison=True, device=device)
    run_case([100, 900], window=(64, 0), page=page, num_splits=num_splits, poison=True, d=48,
             config=DecodeConfig(64, 4, 1), device=device)


@pytest.mark.parametrize("page", [None, 32])
@pytest.mark.parametrize("n_new", [1, 3])
def test_append_new_tokens(device, page, n_new):
    run_case([0, 40, 700], n_new=n_new, seqlen_q=n_new, page=page, num_splits=3, device=device)


@pytest.mark.parametrize("num_splits", [1, 5])
def test_fastertransformer_layout(device, num_splits):
    run_case([1, 17, 1000], kv_layout="FT", num_splits=num_splits, device=device)
    run_case([3, 200], kv_layout="FT", n_new=2, seqlen_q=2, num_splits=num_splits, device=device)


@pytest.mark.parametrize("causal", [True, False])
def test_several_query_tokens(device, causal):
    run_case([10, 333], seqlen_q=4, causal=causal, num_splits=2, device=device)


def test_window_and_softcap(device):
    run_case([100, 900], window=(64, 0), num_splits=3, device=device)
    run_case([100, 900], softcap=5.0, num_splits=2, seqlen_q=2, device=device)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 1), (6, 2)])
def test_mha_gqa_mqa(device, heads, kv_heads):
    run_case([33, 257], heads=heads, kv_heads=kv_heads, d=32, capacity=512, num_splits=2, device=device)


def test_head_dim_80_fp32(device):
    run_case([31, 200], d=80, capacity=256, dtype=torch.float32, num_splits=2, device=device)


@pytest.mark.parametrize("case", [
    dict(lens=[1, 17, 1000], num_splits=7),                            # GQA 4 rows, splits not a power of two
    dict(lens=[10, 333], seqlen_q=4, causal=False, num_splits=16),     # 16 rows, 16 partials
    dict(lens=[100, 900], window=(64, 0), num_splits=3, poison=True),  # splits left empty by the window
    dict(lens=[100, 900], softcap=5.0, num_splits=2, seqlen_q=2, kv_layout="FT"),
    dict(lens=[33, 257], heads=6, kv_heads=2, d=80, capacity=512, num_splits=5, dtype=torch.float32),
    dict(lens=[33, 257], heads=4, kv_heads=4, d=256, capacity=512, num_splits=4),   # MHA: 1 row, d 256
])
def test_split_merges(device, case):
    run_case(**case, device=device)


def test_plan_kv_dtype(device):
    """A plan is made for 16/32-bit caches (kv_dtype None) or FP8 ones: the other kind is refused
    by name, and the FP8 plan takes its own split count."""
    with pytest.raises(TypeError, match="kv_dtype must be None"):
        DecodePlan(1, 4, 2, 32, 64, device=device, kv_dtype=torch.int8)
    q = torch.randn(1, 1, 4, 32, dtype=torch.float16, device=device)
    kc = torch.randn(1, 64, 2, 32, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match="this plan is for an FP8 cache"):
        DecodePlan(1, 4, 2, 32, 64, device=device, kv_dtype=torch.float8_e4m3fn).run(q, kc, kc, cache_seqlens=40)
    with pytest.raises(ValueError, match="this plan is for a 16/32-bit cache"):
        DecodePlan(1, 4, 2, 32, 64, device=device).run(q, kc.to(torch.float8_e4m3fn), kc.to(torch.float8_e4m3fn),
                                                       cache_seqlens=40)


def test_plan_reused_across_steps_and_counters_reset(device):
    batch, heads, kv_heads, d, cap = 2, 4, 2, 32, 256
    plan = DecodePlan(batch, heads, kv_heads, d, cap, device=device, num_splits=4)
    k_cache = torch.randn(batch, cap, kv_heads, d, dtype=torch.float16, device=device)
    v_cache = torch.randn_like(k_cache)
    seqlens = torch.tensor([10, 100], dtype=torch.int32, device=device)
    for step in range(3):  # each step appends one token and attends; counters must return to 0
        q = torch.randn(batch, 1, heads, d, dtype=torch.float16, device=device)
        k = torch.randn(batch, 1, kv_heads, d, dtype=torch.float16, device=device)
        v = torch.randn_like(k)
        ref, _, ref_k, ref_v = kvcache_attention_ref(q.double(), k_cache.double(), v_cache.double(),
                                                     k.double(), v.double(), seqlens)
        out = plan.run(q, k_cache, v_cache, k, v, cache_seqlens=seqlens)
        assert rel_l2(out, ref) < TOL
        assert torch.equal(k_cache.double(), ref_k)
        assert (plan.counters == 0).all()
        seqlens += 1


def test_num_splits_heuristic():
    s = num_splits_heuristic(8, 8192, 132, 64)                # batch 1, GQA 8 KV heads: fill the SMs
    assert 8 * s <= 132 < 8 * (s + 1)
    assert num_splits_heuristic(64 * 8, 4096, 132, 64) == 1   # enough programs already
    assert num_splits_heuristic(8, 64, 132, 64) == 1          # too short to split
    # an FP8 cache: about two programs per SM, at most 16 splits, down to one block a split,
    # none from 1.5 programs per SM on
    assert num_splits_heuristic(8, 8192, 132, 128, kv_fp8=True) == 16
    assert num_splits_heuristic(8, 1024, 132, 128, kv_fp8=True) == 8
    assert num_splits_heuristic(64, 8192, 132, 64, kv_fp8=True) == 4
    assert num_splits_heuristic(128, 16384, 132, 64, kv_fp8=True) == 2
    assert num_splits_heuristic(256, 4096, 132, 64, kv_fp8=True) == 1


def test_merge_attention_states(device):
    a, b = (torch.randn(2, 5, 4, 48, device=device) for _ in range(2))
    la, lb = (torch.randn(2, 4, 5, device=device) for _ in range(2))
    la[0, 1, 2] = lb[0, 1, 2] = float("-inf")   # no key on either side
    la[1, 0, 0] = float("-inf")                  # one side empty
    out, lse = flashflow.merge_attention_states(a, la, b, lb)
    ref, ref_lse = merge_attention_states_ref(a.double(), la.double(), b.double(), lb.double())
    assert (out.double() - ref).abs().max() < 1e-5
    fin = torch.isfinite(ref_lse)
    assert (lse.double()[fin] - ref_lse[fin]).abs().max() < 1e-5
    assert torch.isneginf(lse[0, 1, 2]) and (out[0, 2, 1] == 0).all()


def test_merge_of_two_halves_equals_whole(device):
    q = torch.randn(1, 7, 4, 32, dtype=torch.float16, device=device)
    k = torch.randn(1, 90, 2, 32, dtype=torch.float16, device=device)
    v = torch.randn_like(k)
    oa, la = flashflow.flash_attn_func(q, k[:, :40], v[:, :40], return_lse=True)
    ob, lb = flashflow.flash_attn_func(q, k[:, 40:], v[:, 40:], return_lse=True)
    out, lse = flashflow.merge_attention_states(oa, la, ob, lb)
    whole, whole_lse = flashflow.flash_attn_func(q, k, v, return_lse=True)
    assert rel_l2(out, whole.double()) < TOL and (lse - whole_lse).abs().max() < 1e-3


def test_calls_without_a_plan_reuse_one_and_stay_correct(device):
    # the eager path keeps its plan (workspace, merge counters) for the next call of the same
    # layout: back-to-back split calls with other lengths, appends and caches stay correct
    from flashflow.ops import decode as od
    od._EAGER_PLANS.clear()
    for lens, n_new in (([3, 200, 77], 0), ([150, 1, 9], 2), ([0, 31, 250], 1)):
        run_case(lens, capacity=256, n_new=n_new, num_splits=3, device=device)
    assert len(od._EAGER_PLANS) == 1
    run_case([5, 6, 7], capacity=256, num_splits=2, device=device)     # another split count: another plan
    assert len(od._EAGER_PLANS) == 2


# --- bad inputs -------------------------------------------------------------------------------


def test_length_beyond_capacity(device):
    k_cache = torch.randn(2, 64, 2, 32, dtype=torch.float16, device=device)
    q = torch.randn(2, 1, 4, 32, dtype=torch.float16, device=device)
    new = torch.randn(2, 1, 2, 32, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 64 plus 1 new tokens exceeds the cache capacity"):
        flashflow.flash_attn_with_kvcache(q, k_cache, k_cache, new, new,
                                          cache_seqlens=torch.tensor([3, 64], dtype=torch.int32, device=device))


def test_block_table_out_of_range(device):
    k_cache, v_cache, table = make_cache(2, 64, 2, 32, page=16, device=device)
    table[1, 0] = k_cache.shape[0] + 5
    q = torch.randn(2, 1, 4, 32, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match=r"block_table\[1\] holds page indices outside"):
        flashflow.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=10, block_table=table)


def test_block_table_padding_past_each_sequence_is_not_checked(device):
    # serving engines pad a block table's unused tail (-1 here); only the pages a sequence
    # uses are checked and read, so the call succeeds and matches the reference
    lens = [5, 40, 0, 33]
    page, capacity = 16, 64
    k_cache, v_cache, table = make_cache(len(lens), capacity, 2, 32, page=page, device=device)
    for i, n in enumerate(lens):
        table[i, -(-(n + 1) // page):] = -1          # +1: the appended token's page is used
    q = torch.randn(len(lens), 1, 4, 32, dtype=torch.float16, device=device)
    new = torch.randn(len(lens), 1, 2, 32, dtype=torch.float16, device=device)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=device)
    ref, *_ = kvcache_attention_ref(q.double(), k_cache.double(), v_cache.double(), new.double(),
                                    new.double(), seqlens, table.clamp(min=0))
    out = flashflow.flash_attn_with_kvcache(q, k_cache, v_cache, new, new, cache_seqlens=seqlens,
                                            block_table=table)
    assert rel_l2(out, ref) < TOL
    # one page too few for row 2 once its appended token counts: checked, and the row named
    table[2, 0] = -1
    with pytest.raises(ValueError, match=r"block_table\[2\] holds page indices outside \[0, \d+\).*\[-1\]"):
        flashflow.flash_attn_with_kvcache(q, k_cache, v_cache, new, new, cache_seqlens=seqlens,
                                          block_table=table)


@pytest.mark.parametrize("bad", ["length", "page", None])
def test_value_checks_read_the_device_once(device, monkeypatch, bad):
    # a host read per row would stall the launch queue batch times per call: the lengths and
    # the block table are checked on the device and read back in one transfer
    batch, page, capacity = 24, 16, 64
    k_cache, v_cache, table = make_cache(batch, capacity, 2, 32, page=page, device=device)
    lens = torch.randint(0, capacity, (batch,), dtype=torch.int32, device=device)
    if bad == "length":
        lens[batch - 3] = capacity + 1
    elif bad == "page":
        lens[batch - 5] = capacity
        table[batch - 5, capacity // page - 1] = k_cache.shape[0]
    reads = []
    for name in ("tolist", "item", "__int__", "__bool__", "__index__", "cpu", "numpy"):
        orig = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name,
                            lambda self, *a, _o=orig, _n=name, **k: (reads.append(_n), _o(self, *a, **k))[1])
    q = torch.randn(batch, 1, 4, 32, dtype=torch.float16, device=device)
    if bad is None:
        _check_values(lens, 0, capacity, table, k_cache.shape[0], page, batch)
        assert reads == ["tolist"]
    else:
        row = batch - 3 if bad == "length" else batch - 5
        what = "cache_seqlens" if bad == "length" else "block_table"
        with pytest.raises(ValueError, match=rf"{what}\[{row}\]"):
            flashflow.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, block_table=table)


def test_wrong_head_counts(device):
    k_cache = torch.randn(2, 64, 3, 32, dtype=torch.float16, device=device)
    q = torch.randn(2, 1, 4, 32, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match=r"heads of q \(4\) must be a multiple of kv_heads of the cache \(3\)"):
        flashflow.flash_attn_with_kvcache(q, k_cache, k_cache, cache_seqlens=5)


def test_bad_layouts_and_types(device):
    q = torch.randn(2, 1, 4, 32, dtype=torch.float16, device=device)
    kc = torch.randn(2, 64, 2, 32, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match="kv_layout"):
        flashflow.flash_attn_with_kvcache(q, kc, kc, kv_layout="HND")
    with pytest.raises(TypeError, match="cache_seqlens"):
        flashflow.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=torch.tensor([1, 2], device=device))
    with pytest.raises(TypeError, match="k_cache must have q's dtype"):
        flashflow.flash_attn_with_kvcache(q, kc.float(), kc.float())
    with pytest.raises(ValueError, match="FT layout"):
        flashflow.flash_attn_with_kvcache(q, kc, kc, kv_layout="FT")
    with pytest.raises(ValueError, match="both k and v"):
        flashflow.flash_attn_with_kvcache(q, kc, kc, k=kc[:, :1], cache_seqlens=3)
    with pytest.raises(ValueError, match="this plan is for"):
        DecodePlan(2, 4, 2, 32, 64, device=device).run(torch.randn(1, 1, 4, 32, dtype=torch.float16,
                                                                   device=device), kc[:1], kc[:1])


@pytest.mark.parametrize("bad", ["shape", "list", "float"])
def test_bad_seqlens_form_named_before_values_are_read(device, bad):
    # with a block table, the lengths' values are checked on the device: their form first
    q = torch.randn(2, 1, 4, 32, dtype=torch.float16, device=device)
    kc = torch.randn(8, 16, 2, 32, dtype=torch.float16, device=device)
    table = torch.arange(8, dtype=torch.int32, device=device).view(2, 4)
    lens = {"shape": torch.tensor([3, 4, 5], dtype=torch.int32, device=device), "list": [3, 4], "float": 3.0}[bad]
    with pytest.raises(TypeError, match=r"cache_seqlens must be an int or an int32 tensor of shape \(2,\)"):
        flashflow.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=lens, block_table=table)


# --- bf16, grad, scale, empty batches ------------------------------------------------------------


@pytest.mark.parametrize("case", [
    dict(lens=[1, 17, 1000], num_splits=3),
    dict(lens=[0, 40, 700], n_new=2, seqlen_q=2, page=32, num_splits=3, softcap=5.0),
    dict(lens=[100, 900], window=(64, 0), num_splits=1, kv_layout="FT"),
])
def test_bf16_against_float64(device, case):
    # the interpreter's bf16 tl.dot is wrong: the kernel converts the tiles to fp32 there
    run_case(**case, dtype=torch.bfloat16, device=device)


def test_bf16_merge_attention_states(device):
    a, b = (torch.randn(2, 5, 4, 48, device=device, dtype=torch.bfloat16) for _ in range(2))
    la, lb = (torch.randn(2, 4, 5, device=device) for _ in range(2))
    out, lse = flashflow.merge_attention_states(a, la, b, lb)
    ref, ref_lse = merge_attention_states_ref(a.double(), la.double(), b.double(), lb.double())
    assert out.dtype == torch.bfloat16 and rel_l2(out, ref) < 1e-2
    assert (lse.double() - ref_lse).abs().max() < 1e-5


@pytest.mark.parametrize("which", ["q", "k_cache", "v_cache", "k", "v"])
def test_inputs_requiring_grad_are_refused(device, which):
    q = torch.randn(1, 1, 4, 32, dtype=torch.float32, device=device)
    kc, vc = (torch.randn(1, 64, 2, 32, dtype=torch.float32, device=device) for _ in range(2))
    k, v = (torch.randn(1, 1, 2, 32, dtype=torch.float32, device=device) for _ in range(2))
    args = dict(q=q, k_cache=kc, v_cache=vc, k=k, v=v)
    args[which] = args[which].clone().requires_grad_(True)
    with pytest.raises(ValueError, match=rf"flash_attn_with_kvcache: {which} requires grad"):
        flashflow.flash_attn_with_kvcache(**args, cache_seqlens=10)
    plan = DecodePlan(1, 4, 2, 32, 64, device=device)
    with pytest.raises(ValueError, match=rf"{which} requires grad"):
        plan.run(**args, cache_seqlens=10)
    with torch.no_grad():
        flashflow.flash_attn_with_kvcache(**args, cache_seqlens=10)


@pytest.mark.parametrize("which", ["out_a", "lse_a", "out_b", "lse_b"])
def test_merge_states_inputs_requiring_grad_are_refused(device, which):
    args = dict(out_a=torch.randn(1, 3, 2, 16, device=device), lse_a=torch.randn(1, 2, 3, device=device),
                out_b=torch.randn(1, 3, 2, 16, device=device), lse_b=torch.randn(1, 2, 3, device=device))
    args[which].requires_grad_(True)
    with pytest.raises(ValueError, match=rf"merge_attention_states: {which} requires grad"):
        flashflow.merge_attention_states(**args)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), 0.0, -1.0])
def test_bad_softmax_scale_and_softcap(device, scale):
    q = torch.randn(1, 1, 4, 32, dtype=torch.float16, device=device)
    kc = torch.randn(1, 64, 2, 32, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match=rf"softmax_scale must be a finite number > 0, got {scale}"):
        flashflow.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=10, softmax_scale=scale)
    if scale != scale or abs(scale) == float("inf"):
        with pytest.raises(ValueError, match="softcap must be a finite number"):
            flashflow.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=10, softcap=scale)


@pytest.mark.parametrize("append", [False, True])
@pytest.mark.parametrize("page", [None, 16])
def test_empty_batch_gives_empty_output(device, append, page):
    # as torch returns for an empty batch: an empty output (and lse), no launch, no error
    q = torch.randn(0, 1, 4, 32, dtype=torch.float16, device=device)
    if page:
        kc = torch.randn(4, page, 2, 32, dtype=torch.float16, device=device)
        table = torch.zeros(0, 4, dtype=torch.int32, device=device)
    else:
        kc, table = torch.randn(0, 64, 2, 32, dtype=torch.float16, device=device), None
    new = torch.randn(0, 1, 2, 32, dtype=torch.float16, device=device) if append else None
    lens = torch.zeros(0, dtype=torch.int32, device=device)
    out, lse = flashflow.flash_attn_with_kvcache(q, kc, kc, new, new, cache_seqlens=lens, block_table=table,
                                                 return_softmax_lse=True)
    assert out.shape == (0, 1, 4, 32) and lse.shape == (0, 4, 1)
    out = flashflow.flash_attn_with_kvcache(q, kc, kc, new, new, cache_seqlens=0 if append else None,
                                            block_table=table)
    assert out.shape == (0, 1, 4, 32)
    assert num_splits_heuristic(0, 1024, 132, 64) == 1


def test_zero_query_tokens_still_append(device):
    # seqlen_q = 0 with new tokens: nothing to attend, but the new tokens land in the cache
    kc, vc = (torch.zeros(2, 64, 2, 32, dtype=torch.float16, device=device) for _ in range(2))
    new = torch.randn(2, 3, 2, 32, dtype=torch.float16, device=device)
    lens = torch.tensor([5, 20], dtype=torch.int32, device=device)
    q = torch.randn(2, 0, 4, 32, dtype=torch.float16, device=device)
    out = flashflow.flash_attn_with_kvcache(q, kc, vc, new, new, cache_seqlens=lens)
    assert out.shape == (2, 0, 4, 32)
    assert torch.equal(kc[0, 5:8], new[0]) and torch.equal(vc[1, 20:23], new[1])
    assert flashflow.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens).shape == (2, 0, 4, 32)


def test_zero_heads_and_bad_plan_sizes_are_named(device):
    kc = torch.randn(1, 64, 2, 32, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match=r"at least one head each, got 0 heads of q"):
        flashflow.flash_attn_with_kvcache(torch.randn(1, 1, 0, 32, dtype=torch.float16, device=device), kc, kc)
    with pytest.raises(ValueError, match=r"at least one head each, got 4 heads of q and 0 kv_heads"):
        DecodePlan(1, 4, 0, 32, 64, device=device)
    with pytest.raises(ValueError, match=r"batch must be an int >= 0, got -1"):
        DecodePlan(-1, 4, 2, 32, 64, device=device)
    with pytest.raises(ValueError, match=r"head_dim must be between 1 and 256, got 0"):
        DecodePlan(1, 4, 2, 0, 64, device=device)
    with pytest.raises(ValueError, match=r"num_splits must be an int >= 0"):
        DecodePlan(1, 4, 2, 32, 64, device=device, num_splits=-2)


def test_plan_uses_the_lookup_for_paged_caches(device, monkeypatch):
    # the tiles of a paged launch are decode_config's for that page size; a given config is kept
    from flashflow.ops import decode as od
    seen = []
    real = od.decode_config
    monkeypatch.setattr(od, "decode_config", lambda **kw: seen.append(kw.get("page_size")) or real(**kw))
    plan = DecodePlan(3, 8, 2, 64, 1024, device=device, num_splits=2)
    assert plan.config_for(16) == real(**plan._lookup, page_size=16) and plan.config_for(None) is plan.config
    assert seen == [None, 16]
    given = DecodePlan(3, 8, 2, 64, 1024, device=device, config=DecodeConfig(64, 4, 1))
    assert given.config_for(16) == DecodeConfig(64, 4, 1)


# --- memory layouts of q, k, v and out ----------------------------------------------------------

LAYOUTS = ["last-stride-2", "transposed", "expanded", "packed-qkv"]


def _laid_out(how, q, k, v, kv_heads):
    """q, k, v (k, v may be None) in another memory layout, with the values the kernel must see:
    every other element of a wider buffer (last stride 2: the kernel's unit-stride head_dim
    read them wrong), (b, h, s, d) storage seen as (b, s, h, d), one batch row / one head
    broadcast by ``expand`` (stride 0), or slices of one packed (b, s, h + 2·kv_heads, d) buffer."""
    if how == "last-stride-2":
        def wide(t):
            buf = torch.randn(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
            buf[..., 1::2] = t
            return buf[..., 1::2]
        return tuple(None if t is None else wide(t) for t in (q, k, v))
    if how == "transposed":
        return tuple(None if t is None else t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    if how == "expanded":   # q: one head for all; k, v: one sequence for the whole batch
        return (q[:, :, :1].expand_as(q),) + tuple(None if t is None else t[:1].expand_as(t) for t in (k, v))
    b, s, h, d = q.shape
    qkv = torch.randn(b, s, h + 2 * kv_heads, d, dtype=q.dtype, device=q.device)
    q, k_part, v_part = qkv.split([h, kv_heads, kv_heads], dim=2)
    return q, (None if k is None else k_part), (None if v is None else v_part)


@pytest.mark.parametrize("page", [None, 16])
@pytest.mark.parametrize("append", [False, True])
@pytest.mark.parametrize("how", LAYOUTS)
def test_q_k_v_in_any_layout(device, how, append, page):
    # the planned and the unplanned path, with and without the append: the output and the
    # cache after the append are the reference's (a wrong append spoils every later step)
    lens, heads, kv_heads, d, sq = [5, 40], 4, 2, 32, 2
    k_cache, v_cache, table = make_cache(len(lens), 64, kv_heads, d, page, device=device)
    q = torch.randn(len(lens), sq, heads, d, dtype=torch.float16, device=device)
    k = torch.randn(len(lens), sq, kv_heads, d, dtype=torch.float16, device=device) if append else None
    q, k, v = _laid_out(how, q, k, None if k is None else torch.randn_like(k), kv_heads)
    assert q.stride(-1) != 1 or how != "last-stride-2"
    seqlens = torch.tensor(lens, dtype=torch.int32, device=device)
    ref, _, ref_k, ref_v = kvcache_attention_ref(q.double(), k_cache.double(), v_cache.double(),
                                                 None if k is None else k.double(), None if v is None else v.double(),
                                                 seqlens, table, causal=True)
    plan = DecodePlan(len(lens), heads, kv_heads, d, 64, seqlen_q=sq, device=device, num_splits=2)
    for run in (lambda kc, vc: flashflow.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens,
                                                                 block_table=table, causal=True, num_splits=2),
                lambda kc, vc: plan.run(q, kc, vc, k, v, seqlens, table, causal=True)):
        kc, vc = k_cache.clone(), v_cache.clone()
        assert rel_l2(run(kc, vc), ref) < TOL
        assert torch.equal(kc.double(), ref_k) and torch.equal(vc.double(), ref_v)


def test_out_in_another_layout_and_bad_outs(device):
    # out= may have any strides with a unit last one: the kernel writes through them
    q = torch.randn(2, 3, 4, 32, dtype=torch.float16, device=device)
    kc, vc, _ = make_cache(2, 64, 2, 32, device=device)
    plan = DecodePlan(2, 4, 2, 32, 64, seqlen_q=3, device=device)
    ref, *_ = kvcache_attention_ref(q.double(), kc.double(), vc.double(), cache_seqlens=30, causal=False)
    buf = torch.full((2, 4, 3, 32), float("nan"), dtype=torch.float16, device=device)
    out = buf.transpose(1, 2)   # (b, h, s, d) storage
    assert plan.run(q, kc, vc, cache_seqlens=30, out=out) is out
    assert rel_l2(buf.transpose(1, 2), ref) < TOL
    wide = torch.empty(2, 3, 4, 64, dtype=torch.float16, device=device)
    for bad, err, match in ((wide[..., ::2], ValueError, "unit stride in its last dimension"),
                            (torch.empty_like(q[:1]).expand_as(q), ValueError, "no two elements at one address"),
                            (q.float(), ValueError, "out must be a torch.float16 tensor of q's shape"),
                            (q[:1], ValueError, r"q's shape \(2, 3, 4, 32\)"),
                            ("out", TypeError, "out must be")):
        with pytest.raises(err, match=match):
            plan.run(q, kc, vc, cache_seqlens=30, out=bad)


def test_cache_layouts_that_cannot_take_the_append(device):
    # one cache broadcast over the batch may be read, but the append would write every
    # sequence's token to one address
    q = torch.randn(2, 1, 4, 32, dtype=torch.float16, device=device)
    kc = torch.randn(1, 64, 2, 32, dtype=torch.float16, device=device).expand(2, 64, 2, 32)
    ref, *_ = kvcache_attention_ref(q.double(), kc.double(), kc.double(), cache_seqlens=20)
    assert rel_l2(flashflow.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=20), ref) < TOL
    new = torch.randn(2, 1, 2, 32, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match="k_cache has elements sharing an address"):
        flashflow.flash_attn_with_kvcache(q, kc, kc, new, new, cache_seqlens=20)
    # a cache is written in place, so one with a non-unit last stride is refused, not copied
    wide = torch.randn(2, 64, 2, 64, dtype=torch.float16, device=device)[..., ::2]
    with pytest.raises(ValueError, match="v_cache must have a unit stride in its last dimension"):
        flashflow.flash_attn_with_kvcache(q, kc.contiguous(), wide, cache_seqlens=20)


# --- FlashAttention's conventions ---------------------------------------------------------------

FA2_SIGNATURE = [   # flash_attn/flash_attn_interface.py, flash_attn_with_kvcache
    ("q", None), ("k_cache", None), ("v_cache", None), ("k", None), ("v", None), ("rotary_cos", None),
    ("rotary_sin", None), ("cache_seqlens", None), ("cache_batch_idx", None), ("cache_leftpad", None),
    ("block_table", None), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
    ("softcap", 0.0), ("rotary_interleaved", True), ("alibi_slopes", None), ("num_splits", 0),
    ("return_softmax_lse", False)]


def test_signature_is_flash_attentions():
    # code ported from FlashAttention passes arguments by position and relies on the defaults
    import inspect
    params = list(inspect.signature(flashflow.flash_attn_with_kvcache).parameters.values())
    positional = [(p.name, None if p.default is p.empty else p.default) for p in params
                  if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert positional == FA2_SIGNATURE
    assert [p.name for p in params if p.kind == p.KEYWORD_ONLY] == ["kv_layout", "plan", "k_scale", "v_scale"]
    run = [p for p in inspect.signature(DecodePlan.run).parameters.values() if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert [p.name for p in run][1:] == ["q", "k_cache", "v_cache", "k", "v", "cache_seqlens", "block_table",
                                         "softmax_scale", "causal", "window_size", "softcap", "return_lse"]
    assert next(p.default for p in run if p.name == "causal") is False


def test_default_is_not_causal(device):
    # several query tokens: FlashAttention's default (causal=False) lets each see every key
    lens = [10, 50]
    q = torch.randn(2, 3, 4, 32, dtype=torch.float16, device=device)
    kc, vc, _ = make_cache(2, 64, 2, 32, device=device)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=device)
    full, *_ = kvcache_attention_ref(q.double(), kc.double(), vc.double(), cache_seqlens=seqlens, causal=False)
    masked, *_ = kvcache_attention_ref(q.double(), kc.double(), vc.double(), cache_seqlens=seqlens, causal=True)
    assert rel_l2(masked, full) > 10 * TOL   # the two differ here
    assert rel_l2(flashflow.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens), full) < TOL
    plan = DecodePlan(2, 4, 2, 32, 64, seqlen_q=3, device=device)
    assert rel_l2(plan.run(q, kc, vc, cache_seqlens=seqlens), full) < TOL
    # positionally, as FlashAttention's callers write it: cache_seqlens is the 8th argument
    assert rel_l2(flashflow.flash_attn_with_kvcache(q, kc, vc, None, None, None, None, seqlens), full) < TOL


@pytest.mark.parametrize("name", ["rotary_cos", "rotary_sin", "cache_batch_idx", "cache_leftpad", "alibi_slopes"])
def test_unimplemented_flash_attention_arguments_are_refused(device, name):
    q = torch.randn(2, 1, 4, 32, dtype=torch.float16, device=device)
    kc = torch.randn(2, 64, 2, 32, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match=f"flashflow does not implement {name}"):
        flashflow.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=10, **{name: torch.zeros(2, device=device)})


def test_old_positions_and_names_are_refused(device):
    # FlashAttention's 6th positional argument is rotary_cos, not cache_seqlens; return_lse is not an alias
    q = torch.randn(2, 1, 4, 32, dtype=torch.float16, device=device)
    kc = torch.randn(2, 64, 2, 32, dtype=torch.float16, device=device)
    lens = torch.tensor([3, 4], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="flashflow does not implement rotary_cos"):
        flashflow.flash_attn_with_kvcache(q, kc, kc, None, None, lens)
    with pytest.raises(TypeError, match="return_lse"):
        flashflow.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=lens, return_lse=True)
    with pytest.raises(TypeError):   # kv_layout and what follows are keyword-only, as in the function
        DecodePlan(2, 4, 2, 32, 64, device=device).run(q, kc, kc, None, None, lens, None, None, False, (-1, -1),
                                                        0.0, False, "NHD")


# --- flags, numbers, devices --------------------------------------------------------------------


@pytest.mark.parametrize("kw", [dict(return_softmax_lse="no"), dict(causal=1), dict(causal=None),
                                dict(rotary_interleaved="yes"), dict(window_size=(1.5, 2)),
                                dict(window_size=(True, 0)), dict(num_splits=1.5), dict(num_splits=True),
                                dict(num_splits="2"), dict(num_splits=-1), dict(cache_seqlens=True)])
def test_flags_and_numbers_must_be_what_they_say(device, kw):
    # a truthy "no" or a float window would otherwise be read as something else
    q = torch.randn(2, 1, 4, 32, dtype=torch.float16, device=device)
    kc = torch.randn(2, 64, 2, 32, dtype=torch.float16, device=device)
    (name, value), = kw.items()
    with pytest.raises((TypeError, ValueError), match=name):
        flashflow.flash_attn_with_kvcache(q, kc, kc, **{"cache_seqlens": 10, name: value})
    if name not in ("rotary_interleaved", "num_splits"):   # DecodePlan's arguments (above)
        name = {"return_softmax_lse": "return_lse"}.get(name, name)
        with pytest.raises((TypeError, ValueError), match=name):
            DecodePlan(2, 4, 2, 32, 64, device=device).run(q, kc, kc, **{"cache_seqlens": 10, name: value})


def test_num_splits_is_capped(device):
    # the output does not depend on the split count: more splits than key blocks only add empty
    # programs (1000 on a 64-token cache ran 102 s in the interpreter)
    plan = DecodePlan(2, 4, 2, 32, 64, device=device, num_splits=1000)
    assert plan.num_splits == -(-64 // plan.config.BLOCK_N)
    assert DecodePlan(2, 4, 2, 32, 1 << 16, device=device, num_splits=1000).num_splits == 32
    assert DecodePlan(2, 4, 2, 32, 1 << 16, device=device, num_splits=7).num_splits == 7
    run_case([5, 64], capacity=64, num_splits=1000, device=device)
    # with a plan, num_splits is the plan's: another value is refused, not ignored
    q = torch.randn(2, 1, 4, 32, dtype=torch.float16, device=device)
    kc = torch.randn(2, 64, 2, 32, dtype=torch.float16, device=device)
    flashflow.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=10, num_splits=1000, plan=plan)
    with pytest.raises(ValueError, match="num_splits is the plan's"):
        flashflow.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=10, num_splits=3, plan=plan)
    with pytest.raises(TypeError, match="plan must be a DecodePlan"):
        flashflow.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=10, plan="plan")


@pytest.mark.parametrize("which", ["q", "k_cache", "v_cache", "k", "block_table", "plan", "merge", "quantize"])
def test_meta_tensors_are_named(device, which):
    # shape-only tensors have no data for a kernel: a ValueError naming them, not torch's error
    q = torch.randn(2, 1, 4, 32, dtype=torch.float16, device=device)
    kc, vc, table = make_cache(2, 64, 2, 32, page=16, device=device)
    new = torch.randn(2, 1, 2, 32, dtype=torch.float16, device=device)
    args = dict(q=q, k_cache=kc, v_cache=vc, k=new, v=new, block_table=table)
    if which in args:
        args[which] = args[which].to("meta")
        with pytest.raises(ValueError, match="meta"):
            flashflow.flash_attn_with_kvcache(**args, cache_seqlens=10)
    elif which == "plan":
        with pytest.raises(ValueError, match="meta"):
            DecodePlan(2, 4, 2, 32, 64, device="meta")
    elif which == "merge":
        o, lse = torch.zeros(1, 2, 4, 32, device="meta"), torch.zeros(1, 4, 2, device="meta")
        with pytest.raises(ValueError, match="meta"):
            flashflow.merge_attention_states(o, lse, o, lse)
    else:
        with pytest.raises(ValueError, match="cache is a meta tensor"):
            flashflow.quantize_kv_cache(kc.to("meta"))

