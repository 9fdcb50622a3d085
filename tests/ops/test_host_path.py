"""The host path's caches: a call key stands for everything the checks and the launch derive
from the arguments, and nothing a check refuses is let through by a key seen before."""
import pytest
import torch

import flashflow
from flashflow.ops.common import call_key, contiguous_strides
from flashflow.reference.attention import attention_naive
from flashflow.reference.metrics import rel_l2



def test_call_key_tells_kinds_apart():
    t = torch.zeros(2, 3)
    base = call_key((t, True, 1.0, "NHD", None, (-1, -1)))
    assert base is not None and base == call_key((torch.ones(2, 3), True, 1.0, "NHD", None, (-1, -1)))
    for other in ((t, 1, 1.0, "NHD", None, (-1, -1)),          # True and 1 hash alike
                  (t, True, 1, "NHD", None, (-1, -1)),           # 1.0 and 1 too
                  (t, True, 1.0, "NHD", None, (-1, 0)),
                  (t.t(), True, 1.0, "NHD", None, (-1, -1)),      # strides
                  (t.double(), True, 1.0, "NHD", None, (-1, -1)),
                  (t.requires_grad_(False).clone().requires_grad_(), True, 1.0, "NHD", None, (-1, -1))):
        assert call_key(other) != base
    with torch.no_grad():
        assert call_key((t, True, 1.0, "NHD", None, (-1, -1))) != base
    assert call_key(([1, 2],)) is None                       # a list: checked in full, never cached
    assert call_key(((-1.0, -1.0),)) is None                  # a window of floats
    # a module's weight is a plain tensor to the kernels: keyed as one (its requires_grad included)
    weight = torch.nn.Parameter(torch.zeros(2, 3), requires_grad=False)
    assert call_key((weight,)) == call_key((torch.zeros(2, 3),))
    assert call_key((torch.nn.Parameter(torch.zeros(2, 3)),)) != call_key((torch.zeros(2, 3),))

    class Sub(torch.Tensor):
        pass

    assert call_key((t.as_subclass(Sub),)) is None              # a tensor subclass: checked in full


def test_call_key_alignment_flag():
    buf = torch.zeros(64, dtype=torch.float16)
    assert call_key((buf[:16],))[-1] is True
    assert call_key((buf[1:17],))[-1] is False                # 2 bytes past a 16-byte boundary


@pytest.mark.parametrize("shape", [(2, 3, 4), (1, 5, 1, 7), (0, 3), (4, 0, 2), ()])
def test_contiguous_strides_are_torchs(shape):
    assert contiguous_strides(shape) == torch.empty(shape).stride()


def _qkv(device, shape=(2, 37, 4, 16), dtype=torch.float32, gen=None):
    return [torch.randn(shape, dtype=dtype, generator=gen).to(device) for _ in range(3)]


def test_forward_plans_follow_flags_and_layouts(device):
    """One shape, calls that differ only in a flag, a window or the layout: each gets its own
    plan (a reused plan would compute the wrong mask or read the wrong strides)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = _qkv(device, gen=gen)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)   # (b, h, s, d) storage, same shape
    for _ in range(2):   # the second round runs on the cached plans
        for kw in (dict(), dict(causal=True), dict(window_size=(5, 3)), dict(softcap=2.0), dict(causal=True)):
            for qq in (q, qt):
                out = flashflow.flash_attn_func(qq, k, v, **kw)
                ref = attention_naive(q.double(), k.double(), v.double(), **kw)
                assert rel_l2(out, ref) < 1e-5, kw


def test_flash_attn_func_entry_runs_a_seen_key_on_new_values(device):
    """A call key seen before launches its recorded plan: right on fresh inputs, and one entry
    per key (scale, flags and layout each make their own)."""
    from flashflow.ops import attention as attn_ops

    gen = torch.Generator().manual_seed(1)
    attn_ops._ENTRIES.clear()
    for scale in (None, 0.3, None):
        for _ in range(2):
            q, k, v = _qkv(device, gen=gen)
            out, lse = flashflow.flash_attn_func(q, k, v, softmax_scale=scale, return_lse=True)
            ref = attention_naive(q.double(), k.double(), v.double(), softmax_scale=scale)
            assert rel_l2(out, ref) < 1e-5, scale
            assert torch.isfinite(lse).all()
    assert len(attn_ops._ENTRIES) == 2
    q, k, v = _qkv(device, gen=gen)
    flashflow.flash_attn_func(q, k, v, softmax_scale=0.3)      # return_lse False: a key of its own
    assert len(attn_ops._ENTRIES) == 3


def test_flash_attn_func_entry_lets_nothing_refused_through(device):
    q, k, v = _qkv(device)
    flashflow.flash_attn_func(q, k, v, causal=True)
    flashflow.flash_attn_func(q, k, v, causal=True)
    with pytest.raises(TypeError, match="causal"):
        flashflow.flash_attn_func(q, k, v, causal=1)
    with pytest.raises(TypeError, match="deterministic"):
        flashflow.flash_attn_func(q, k, v, causal=True, deterministic="yes")
    with pytest.raises(ValueError, match="softmax_scale"):
        flashflow.flash_attn_func(q, k, v, causal=True, softmax_scale=float("nan"))
    with pytest.raises(TypeError, match="one dtype"):
        flashflow.flash_attn_func(q, k.half(), v, causal=True)


def test_flash_attn_func_entry_keeps_autograd(device):
    """A key seen without gradients is not the key of the same call with inputs that require
    them: that call records its backward."""
    q, k, v = _qkv(device)
    flashflow.flash_attn_func(q, k, v)
    qg = q.clone().requires_grad_()
    out = flashflow.flash_attn_func(qg, k, v)
    out.sum().backward()
    assert qg.grad is not None and torch.isfinite(qg.grad).all()
    with torch.no_grad():   # the same tensors under no_grad: a key of its own, no graph
        assert not flashflow.flash_attn_func(qg, k, v).requires_grad


def _fwd_bwd(q, k, v, needs, dout, dlse, **kw):
    """flash_attn_func with gradients for the inputs ``needs`` names; the output, LSE and grads."""
    ins = [t.clone().requires_grad_(name in needs) for name, t in zip("qkv", (q, k, v))]
    out, lse = flashflow.flash_attn_func(*ins, return_lse=True, **kw)
    torch.autograd.backward([out, lse], [dout, dlse])
    return out.detach(), lse.detach(), [t.grad for t in ins]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_flash_attn_func_entry_records_autograd_calls(device, causal, monkeypatch):
    """A call that records autograd has entries of its own: a second call of its key launches
    the recorded plan (no checks, no dispatch) and gives the first call's output, LSE and
    gradients bit for bit, right against float64; frozen k and v are another key, whose call
    computes no dK/dV."""
    from flashflow.ops import attention as attn_ops

    attn_ops._ENTRIES.clear()
    gen = torch.Generator().manual_seed(3)
    q, k, v = _qkv(device, gen=gen)
    dout = torch.randn(q.shape, generator=gen).to(device)
    dlse = torch.randn(q.shape[0], q.shape[2], q.shape[1], generator=gen).to(device)
    first = _fwd_bwd(q, k, v, "qkv", dout, dlse, causal=causal)
    assert len(attn_ops._ENTRIES) == 1
    monkeypatch.setattr(attn_ops, "_attention_fwd_impl", None)   # a call not from its entry would fail
    monkeypatch.setattr(attn_ops, "check_qkv", None)
    second = _fwd_bwd(q, k, v, "qkv", dout, dlse, causal=causal)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    for a, b in zip(first[2], second[2]):
        assert torch.equal(a, b)
    refs = [t.double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = attention_naive(*refs, causal=causal, return_lse=True)
    want = torch.autograd.grad([ref, ref_lse], refs, [dout.double(), dlse.double()])
    assert rel_l2(second[0], ref) < 1e-5
    for a, b in zip(second[2], want):
        assert rel_l2(a, b) < 1e-5
    monkeypatch.undo()
    frozen = _fwd_bwd(q, k, v, "q", dout, dlse, causal=causal)
    assert len(attn_ops._ENTRIES) == 2
    assert frozen[2][1] is None and frozen[2][2] is None and torch.equal(frozen[2][0], first[2][0])


def test_flash_attn_func_entries_follow_the_kernel_registry(device, monkeypatch):
    """A forward kernel registered first takes the calls it supports, keys seen before included."""
    from flashflow.ops import attention as attn_ops

    q, k, v = _qkv(device)
    flashflow.flash_attn_func(q, k, v)
    flashflow.flash_attn_func(q, k, v)
    assert attn_ops._ENTRIES
    calls = []

    def launch(q, k, v, **kw):
        calls.append(kw)
        return attn_ops._portable_forward(q, k, v, **kw)
    monkeypatch.setattr(attn_ops, "_FORWARD_KERNELS", list(attn_ops._FORWARD_KERNELS))
    attn_ops.register_forward_kernel("stand-in", lambda q, k, v, **kw: True, launch, first=True)
    assert not attn_ops._ENTRIES
    out = flashflow.flash_attn_func(q, k, v)
    flashflow.flash_attn_func(q, k, v)
    assert len(calls) == 2 and not attn_ops._ENTRIES
    assert rel_l2(out, attention_naive(q.double(), k.double(), v.double())) < 1e-5


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "strided", "expanded", "packed"])
def test_flash_attn_func_entry_on_every_layout(device, layout):
    """Each layout twice with fresh values: the second call of a unit-stride layout (a
    transposed view, a stride-0 expansion, a slice along heads) runs from its recorded entry;
    a non-unit last stride is never recorded. Every call against float64."""
    from flashflow.ops import attention as attn_ops
    from layout_cases import make

    gen = torch.Generator().manual_seed(5)
    b, sq, sk, h, hk, d = 2, 19, 23, 4, 2, 24
    attn_ops._ENTRIES.clear()
    for _ in range(2):
        q = make((b, sq, h, d), layout, torch.float32, device, gen)
        k, v = (make((b, sk, hk, d), layout, torch.float32, device, gen) for _ in range(2))
        out = flashflow.flash_attn_func(q, k, v, causal=True)
        ref = attention_naive(q.double(), k.double(), v.double(), causal=True)
        assert rel_l2(out, ref) < 1e-5, layout
    assert len(attn_ops._ENTRIES) == (0 if layout == "strided" else 1)


@pytest.mark.parametrize("bad", ["nan", "inf"])
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_flash_attn_func_entry_carries_non_finite_inputs(device, which, bad):
    """A NaN or inf in q, k or v reaches exactly the rows exact math says, on the call that
    records the key and on the one that runs from it."""
    from flashflow.ops import attention as attn_ops
    from nonfinite_cases import check_attention_forward

    attn_ops._ENTRIES.clear()
    for seed in (0, 1):
        check_attention_forward(which, bad, False, device, torch.float32, seed=seed)
    assert len(attn_ops._ENTRIES) == 1


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "strided", "expanded", "packed"])
def test_flash_attn_func_autograd_entry_on_every_layout(device, layout):
    """Forward and backward with q, k, v and dout laid out as ``layout``, twice with fresh values:
    the second call of a unit-stride layout runs from its autograd entry; a non-unit last stride
    is never recorded. Every call's output and gradients against float64."""
    from flashflow.ops import attention as attn_ops
    from layout_cases import check_attention

    attn_ops._ENTRIES.clear()
    for seed in (0, 1):
        check_attention("func", (layout,) * 4, torch.float32, device, 1e-5, seed=seed)
    assert len(attn_ops._ENTRIES) == (0 if layout == "strided" else 1)


@pytest.mark.parametrize("bad", ["nan", "inf"])
@pytest.mark.parametrize("which", ["q", "k", "v", "dout"])
def test_flash_attn_func_autograd_entry_carries_non_finite_inputs(device, which, bad):
    """A NaN or inf in q, k, v or the output gradient reaches every gradient entry exact math
    says, on the call that records the autograd entry and on the one that runs from it."""
    from flashflow.ops import attention as attn_ops
    from nonfinite_cases import check_attention_backward

    attn_ops._ENTRIES.clear()
    for seed in (0, 1):
        check_attention_backward(which, bad, device, torch.float32, seed=seed)
    assert len(attn_ops._ENTRIES) == 1


def test_decode_key_seen_before_still_refuses_bad_flags(device):
    q = torch.randn(2, 1, 4, 32, device=device)
    kc, vc = (torch.randn(2, 64, 2, 32, device=device) for _ in range(2))
    plan = flashflow.plan_decode(2, 4, 2, 32, 64, device=device)
    plan.run(q, kc, vc, cache_seqlens=30, causal=True)
    with pytest.raises(TypeError, match="causal"):
        plan.run(q, kc, vc, cache_seqlens=30, causal=1)
    with pytest.raises(ValueError, match="exceeds the cache capacity"):
        plan.run(q, kc, vc, cache_seqlens=65, causal=True)
    with pytest.raises(ValueError, match="requires grad"):
        plan.run(q.clone().requires_grad_(), kc, vc, cache_seqlens=30, causal=True)


def test_decode_cached_int_lengths_follow_the_value(device):
    """An int ``cache_seqlens`` is part of the call key: a cached step of 30 tokens is not
    reused for 40."""
    q = torch.randn(1, 1, 2, 32, device=device)
    kc, vc = (torch.randn(1, 64, 1, 32, device=device) for _ in range(2))
    plan = flashflow.plan_decode(1, 2, 1, 32, 64, device=device)
    from flashflow.reference.decode import kvcache_attention_ref

    for n in (30, 40, 30):
        out = plan.run(q, kc, vc, cache_seqlens=n)
        ref, *_ = kvcache_attention_ref(q.double(), kc.double(), vc.double(), cache_seqlens=n)
        assert rel_l2(out, ref) < 1e-5, n


def test_fused_mlp_key_seen_before_still_refuses(device):
    x = torch.randn(3, 32, device=device)
    w1 = torch.randn(2 * 48, 32, device=device) * 0.1
    w2 = torch.randn(32, 48, device=device) * 0.1
    a = flashflow.fused_mlp(x, w1, w2)
    assert torch.equal(a, flashflow.fused_mlp(x, w1, w2))   # the cached path gives the same bits
    with pytest.raises(ValueError, match="requires grad"):
        flashflow.fused_mlp(x, w1.clone().requires_grad_(), w2)
    with pytest.raises(ValueError, match="policy"):
        flashflow.fused_mlp(x, w1, w2, policy="nope")


class _FakeCompiled:
    """What Triton's compiled kernel offers the cached path: handles and a launcher."""

    def __init__(self, launches):
        self.function, self.packed_metadata, self.launches = "fn", "meta", launches

    def _init_handles(self):
        pass

    def run(self, *call):
        self.launches.append(call)


class _FakeKernel:
    """A jit function of parameters (a, b, C: constexpr, D: constexpr = 7) that records how it was
    launched: through Triton's path (``kernel[grid](...)``) or the compiled kernel's ``run``."""

    def __init__(self):
        import inspect

        class P:
            def __init__(self, name, default):
                self.name, self.default = name, default
        self.params = [P("a", inspect.Parameter.empty), P("b", inspect.Parameter.empty),
                       P("C", inspect.Parameter.empty), P("D", 7)]
        self.__name__ = "fake_kernel"
        self.slow, self.fast = [], []
        self.compiled = _FakeCompiled(self.fast)

    def __getitem__(self, grid):
        def launch(*args, **constexprs):
            self.slow.append((grid, args, constexprs))
            return self.compiled
        return launch


class _Cuda:
    is_cuda = True


@pytest.fixture
def stream_1234(monkeypatch):
    """Triton's driver as the cached path asks it: device 0, its current stream 1234."""
    import flashflow.ops.common as common

    class Driver:
        class active:
            get_current_device = staticmethod(lambda: 0)
            get_current_stream = staticmethod(lambda device: 1234)
    monkeypatch.setattr(common, "_driver", Driver)


def test_launcher_caches_a_key_and_passes_every_parameter_in_order(monkeypatch, stream_1234):
    import flashflow.ops.common as common

    monkeypatch.setattr(common.Launcher, "_specialisation", lambda self, args, constexprs: "spec")
    kernel = _FakeKernel()
    launch = common.Launcher(kernel)
    x = _Cuda()
    launch("k", (3, 1, 1), (x, 5), dict(C=2, num_warps=4))
    assert len(kernel.slow) == 1 and not kernel.fast          # a first key: Triton's path
    launch("k", (4, 2, 1), (x, 6), dict(C=2, num_warps=4))
    assert len(kernel.slow) == 1 and len(kernel.fast) == 1    # a seen key: the compiled kernel
    grid_x, grid_y, grid_z, stream, function, metadata, *hooks_and_args = kernel.fast[0]
    assert (grid_x, grid_y, grid_z, stream, function, metadata) == (4, 2, 1, 1234, "fn", "meta")
    # no launch hooks, then every parameter in the kernel's order: positional, constexprs, defaults
    assert hooks_and_args == [None, None, None, x, 6, 2, 7]
    launch(None, (1, 1, 1), (x, 5), dict(C=2, num_warps=4))   # no key: always Triton's path
    launch("other", (1, 1, 1), (object(), 5), dict(C=2))      # CPU arguments are never cached
    launch("other", (1, 1, 1), (object(), 5), dict(C=2))
    assert len(kernel.slow) == 4 and len(kernel.fast) == 1


def test_launcher_check_refuses_a_key_that_misses_a_specialisation(monkeypatch, stream_1234):
    import flashflow.ops.common as common

    specs = iter(["int 5 as i32", "int 1 as a constant"])
    monkeypatch.setattr(common.Launcher, "_specialisation", lambda self, args, constexprs: next(specs))
    kernel = _FakeKernel()
    launch = common.Launcher(kernel)
    previous = common.check_launch_keys(True)
    try:
        launch("k", (1, 1, 1), (_Cuda(), 5), dict(C=2))
        with pytest.raises(RuntimeError, match="does not determine Triton's specialisation"):
            launch("k", (1, 1, 1), (_Cuda(), 1), dict(C=2))
    finally:
        common.check_launch_keys(previous)
    assert not kernel.fast


def test_stream_scratch_is_kept_per_owner_and_grows():
    """The zeroed int32 words a kernel family leaves zeroed (ops/common.stream_scratch): one
    buffer per owner, device, stream and dtype, the same tensor on a later call, a larger one when a
    call needs more words (never smaller), another owner's never shared."""
    from flashflow.ops import common

    for key in [key for key in common._SCRATCH if key[0] in ("test-a", "test-b")]:
        del common._SCRATCH[key]
    a = common.stream_scratch("test-a", 3, "cpu")
    assert a.dtype == torch.int32 and a.numel() >= 3 and int(a.count_nonzero()) == 0
    assert common.stream_scratch("test-a", 2, "cpu") is a
    b = common.stream_scratch("test-b", 3, "cpu")
    assert b.data_ptr() != a.data_ptr()
    grown = common.stream_scratch("test-a", 100, "cpu")
    assert grown.numel() >= 100 and grown is not a
    assert common.stream_scratch("test-a", 5, "cpu") is grown
    # another dtype (the attention forward's rows of key pieces, fp32) is a buffer of its own
    rows = common.stream_scratch("test-a", 5, "cpu", torch.float32)
    assert rows.dtype == torch.float32 and rows.numel() >= 5 and rows.data_ptr() != grown.data_ptr()
    assert common.stream_scratch("test-a", 4, "cpu", torch.float32) is rows
    assert common.stream_scratch("test-a", 5, "cpu") is grown
