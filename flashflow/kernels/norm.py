"""Row-wise normalisation kernels of a diffusion transformer block (Qwen-Image, Flux-style
double-stream DiT): LayerNorm + AdaLN modulation, gated residual add (optionally fused with the
next LayerNorm + modulation), and the q/k RMSNorm fused with the rotary embedding: per tensor,
or for the joint [text, image] q, k and v of both streams in one launch.

Every kernel is memory-bound: a row is read once into registers (``BLOCK_D`` = the next power
of two of its width), reduced and transformed in fp32, and written once. Token (b, l) takes its
modulation row (shift / scale / gate) from row ``b``, or, with an ``index`` tensor, from row
``b`` where ``index[b, l] == 0`` and row ``B + b`` elsewhere (diffusers' ``_modulate(..., index)``
of zero_cond_t models). Row bases are computed in int64, so tensors of more than 2^31 elements
address correctly.

With ``FP8_OUT`` the LayerNorm + modulation kernels write their modulated rows as e4m3 with one
float32 scale per token (:func:`flashflow.kernels.quant.quantize_row_fp8`), the A operand of a
row-scaled FP8 GEMM: quantized from the fp32 row already in registers (one more reduction, its
amax), never rounded to x's dtype.
"""
import triton
import triton.language as tl

from flashflow.kernels.quant import quantize_row_fp8


@triton.jit
def modulation_row(index_ptr, b, l, B, stride_ib, stride_il, HAS_INDEX: tl.constexpr):
    """The row of shift / scale / gate that token (b, l) uses."""
    if HAS_INDEX:
        second = tl.load(index_ptr + b * stride_ib + l * stride_il) != 0
        return tl.where(second, b + B, b)
    else:
        return b


@triton.jit
def layernorm_row(x, mask, D, eps):
    """LayerNorm without affine of one fp32 row (masked lanes hold 0): the mean first, then the
    variance of ``x - mean`` (torch's two statistics, not E[x²] - mean², which cancels)."""
    mean = tl.sum(x, axis=0) / D
    xc = tl.where(mask, x - mean, 0.0)
    var = tl.sum(xc * xc, axis=0) / D
    return xc * tl.math.rsqrt(var + eps)


@triton.jit
def layernorm_modulate_kernel(
    x_ptr, shift_ptr, scale_ptr, index_ptr, y_ptr, row_scale_ptr,
    B, L, D,
    stride_xb, stride_xl, stride_shift, stride_scale, stride_ib, stride_il, stride_yb, stride_yl,
    eps,
    HAS_INDEX: tl.constexpr, FP8_OUT: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """``y = LayerNorm(x)·(1 + scale) + shift`` over rows of D; one program per token (B·L
    programs), the row held in registers. With ``FP8_OUT``, y is e4m3 and
    ``row_scale_ptr[b·L + l]`` its token's float32 scale (not read otherwise).

    Bytes: x read once, y written once (2·B·L·D elements; B·L·D bytes plus a float a token for
    y with ``FP8_OUT``); shift/scale rows come from L2. FLOPs: about 8 per element (about 12
    with ``FP8_OUT``).
    """
    row = tl.program_id(0).to(tl.int64)
    b = row // L
    l = row % L
    d = tl.arange(0, BLOCK_D)
    mask = d < D
    x = tl.load(x_ptr + b * stride_xb + l * stride_xl + d, mask=mask, other=0.0).to(tl.float32)
    m = modulation_row(index_ptr, b, l, B, stride_ib, stride_il, HAS_INDEX)
    shift = tl.load(shift_ptr + m * stride_shift + d, mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr + m * stride_scale + d, mask=mask, other=0.0).to(tl.float32)
    y = layernorm_row(x, mask, D, eps) * (1.0 + scale) + shift
    if FP8_OUT:
        y, row_scale = quantize_row_fp8(y)      # masked lanes hold 0
        tl.store(row_scale_ptr + row, row_scale)
    tl.store(y_ptr + b * stride_yb + l * stride_yl + d, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def gated_residual_row(res_ptr, y_ptr, gate_ptr, index_ptr, b, l, d, mask, B, stride_rb, stride_rl, stride_yb,
                       stride_yl, stride_gate, stride_ib, stride_il, HAS_INDEX: tl.constexpr):
    """``residual + gate·y`` of columns ``d`` of token (b, l) in fp32, and the modulation row used."""
    r = tl.load(res_ptr + b * stride_rb + l * stride_rl + d, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + b * stride_yb + l * stride_yl + d, mask=mask, other=0.0).to(tl.float32)
    m = modulation_row(index_ptr, b, l, B, stride_ib, stride_il, HAS_INDEX)
    gate = tl.load(gate_ptr + m * stride_gate + d, mask=mask, other=0.0).to(tl.float32)
    return r + gate * y, m


@triton.jit
def gate_residual_kernel(
    res_ptr, y_ptr, gate_ptr, index_ptr, out_ptr,
    B, L, D,
    stride_rb, stride_rl, stride_yb, stride_yl, stride_gate, stride_ib, stride_il, stride_ob, stride_ol,
    HAS_INDEX: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """``out = residual + gate·y``; grid (B·L tokens, D / BLOCK_D column blocks): nothing is
    reduced, so rows of any width split into blocks.

    Bytes: residual and y read once, out written once (3·B·L·D elements). FLOPs: 2 per element.
    """
    row = tl.program_id(0).to(tl.int64)
    b = row // L
    l = row % L
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = d < D
    out, m = gated_residual_row(res_ptr, y_ptr, gate_ptr, index_ptr, b, l, d, mask, B, stride_rb, stride_rl,
                                stride_yb, stride_yl, stride_gate, stride_ib, stride_il, HAS_INDEX)
    tl.store(out_ptr + b * stride_ob + l * stride_ol + d, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def gate_residual_layernorm_modulate_kernel(
    res_ptr, y_ptr, gate_ptr, shift_ptr, scale_ptr, index_ptr, new_res_ptr, mod_ptr, row_scale_ptr,
    B, L, D,
    stride_rb, stride_rl, stride_yb, stride_yl, stride_gate, stride_shift, stride_scale,
    stride_ib, stride_il, stride_nb, stride_nl, stride_mb, stride_ml,
    eps,
    HAS_INDEX: tl.constexpr, FP8_OUT: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """``new_res = residual + gate·y`` and ``mod = LayerNorm(new_res)·(1 + scale) + shift`` in
    one pass; one program per token, the row in registers. With ``FP8_OUT``, mod is e4m3 and
    ``row_scale_ptr[b·L + l]`` its token's float32 scale (not read otherwise); new_res is
    residual's dtype either way.

    The LayerNorm reads the new residual as stored (rounded to its dtype), as the unfused block
    normalises the tensor it just wrote, so the two outputs agree with each other exactly.

    Bytes: residual and y read once, new_res and mod written once (4·B·L·D elements, against
    6·B·L·D for the two unfused passes; mod one byte an element with ``FP8_OUT``). FLOPs:
    about 10 per element (about 14 with ``FP8_OUT``).
    """
    row = tl.program_id(0).to(tl.int64)
    b = row // L
    l = row % L
    d = tl.arange(0, BLOCK_D)
    mask = d < D
    new_res, m = gated_residual_row(res_ptr, y_ptr, gate_ptr, index_ptr, b, l, d, mask, B, stride_rb, stride_rl,
                                    stride_yb, stride_yl, stride_gate, stride_ib, stride_il, HAS_INDEX)
    new_res = new_res.to(new_res_ptr.dtype.element_ty)
    tl.store(new_res_ptr + b * stride_nb + l * stride_nl + d, new_res, mask=mask)
    h = tl.where(mask, new_res.to(tl.float32), 0.0)
    shift = tl.load(shift_ptr + m * stride_shift + d, mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr + m * stride_scale + d, mask=mask, other=0.0).to(tl.float32)
    mod = layernorm_row(h, mask, D, eps) * (1.0 + scale) + shift
    if FP8_OUT:
        mod, row_scale = quantize_row_fp8(mod)      # masked lanes hold 0
        tl.store(row_scale_ptr + row, row_scale)
    tl.store(mod_ptr + b * stride_mb + l * stride_ml + d, mod.to(mod_ptr.dtype.element_ty), mask=mask)


@triton.jit
def head_tile(tok, head_block, S, H, D, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Token ``tok`` of B·S as (b, s), heads ``h`` of its ``head_block``, the pair index ``i`` and
    lane ``j``, the (BLOCK_HALF, 2) columns ``col`` with their mask, and the
    (BLOCK_H, BLOCK_HALF, 2) tile mask."""
    b = tok // S
    s = tok % S
    h = (head_block * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    j = tl.arange(0, 2)
    col = (2 * i)[:, None] + j[None, :]
    col_mask = col < D
    mask = (h < H)[:, None, None] & col_mask[None, :, :]
    return b, s, h, i, j, col, col_mask, mask


@triton.jit
def head_tile_ptrs(ptr, b, s, h, col, stride_b, stride_s, stride_h):
    """Pointers of the (BLOCK_H, BLOCK_HALF, 2) tile of heads ``h`` of token (b, s)."""
    return ptr + b * stride_b + s * stride_s + h[:, None, None] * stride_h + col[None, :, :]


@triton.jit
def rmsnorm_rope_tile(x_ptrs, w_ptrs, f_ptrs, mask, col_mask, D, eps, HAS_WEIGHT: tl.constexpr):
    """RMSNorm then RoPE of a (BLOCK_H, BLOCK_HALF, 2) tile of head rows, returned in fp32.

    ``w_ptrs`` / ``f_ptrs`` point at the weight's pairs and the token's frequencies as
    (BLOCK_HALF, 2) tiles (``f``: the float32 view of the complex64 frequencies), shared by the
    tile's heads; ``w_ptrs`` is not read without a weight. Rounding follows diffusers' RMSNorm:
    with a fp16/bf16 weight the normalised row is rounded to the weight's dtype before and after
    the multiply; without a weight, to x's dtype. The rotation is in fp32 (the caller rounds once
    to the output's dtype)."""
    x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    re, im = tl.split(x)                                                  # (BLOCK_H, BLOCK_HALF)
    ms = tl.sum(re * re + im * im, axis=1) / D
    rstd = tl.math.rsqrt(ms + eps)[:, None]
    re = re * rstd
    im = im * rstd
    if HAS_WEIGHT:
        w_dtype = w_ptrs.dtype.element_ty
        w_re, w_im = tl.split(tl.load(w_ptrs, mask=col_mask, other=0.0).to(tl.float32))
        re = (re.to(w_dtype).to(tl.float32) * w_re[None, :]).to(w_dtype).to(tl.float32)
        im = (im.to(w_dtype).to(tl.float32) * w_im[None, :]).to(w_dtype).to(tl.float32)
    else:
        x_dtype = x_ptrs.dtype.element_ty
        re = re.to(x_dtype).to(tl.float32)
        im = im.to(x_dtype).to(tl.float32)
    cos, sin = tl.split(tl.load(f_ptrs, mask=col_mask, other=0.0))
    out_re = re * cos[None, :] - im * sin[None, :]
    out_im = re * sin[None, :] + im * cos[None, :]
    return tl.join(out_re, out_im)


@triton.jit
def rmsnorm_rope_kernel(
    x_ptr, w_ptr, f_ptr, out_ptr,
    S, H, D,
    stride_xb, stride_xs, stride_xh, stride_fs, stride_fi, stride_ob, stride_os, stride_oh,
    eps,
    HAS_WEIGHT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    """Per head row of D: RMSNorm (fp32 statistics, optional weight), then the rotary embedding
    with pairs ``(x[2i], x[2i+1])`` taken as one complex number times ``freqs[s, i]``
    (:func:`rmsnorm_rope_tile`, which states the rounding).

    Grid (B·S tokens, H / BLOCK_H head blocks): a program holds BLOCK_H heads of one token as a
    (BLOCK_H, D/2, 2) tile, split into the pairs' real and imaginary halves, and loads the
    token's D/2 frequencies once for all its heads. ``f_ptr`` is the float32 view of the complex
    frequencies, (S, D/2, 2).

    Bytes: x read once, out written once (2·B·S·H·D elements) plus S·D floats of frequencies.
    FLOPs: about 10 per element.
    """
    b, s, h, i, j, col, col_mask, mask = head_tile(tl.program_id(0).to(tl.int64), tl.program_id(1), S, H, D,
                                                   BLOCK_H, BLOCK_HALF)
    out = rmsnorm_rope_tile(head_tile_ptrs(x_ptr, b, s, h, col, stride_xb, stride_xs, stride_xh), w_ptr + col,
                            f_ptr + s * stride_fs + i[:, None] * stride_fi + j[None, :], mask, col_mask, D, eps,
                            HAS_WEIGHT)
    o_ptrs = head_tile_ptrs(out_ptr, b, s, h, col, stride_ob, stride_os, stride_oh)
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def joint_qkv_norm_rope_kernel(
    tq_ptr, tk_ptr, tv_ptr, iq_ptr, ik_ptr, iv_ptr,
    wtq_ptr, wtk_ptr, wiq_ptr, wik_ptr, tf_ptr, if_ptr,
    q_ptr, k_ptr, v_ptr,
    S_TXT, S, H, D,
    stride_tqb, stride_tqs, stride_tqh, stride_tkb, stride_tks, stride_tkh, stride_tvb, stride_tvs, stride_tvh,
    stride_iqb, stride_iqs, stride_iqh, stride_ikb, stride_iks, stride_ikh, stride_ivb, stride_ivs, stride_ivh,
    stride_tfs, stride_tfi, stride_ifs, stride_ifi, stride_ob, stride_os, stride_oh,
    eps_tq, eps_tk, eps_iq, eps_ik,
    HAS_WEIGHT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    """The joint [text, image] query, key and value of a double-stream attention in one launch:
    q and k get their stream's RMSNorm and RoPE (:func:`rmsnorm_rope_tile`), v is copied; each
    is written at its token's place in its joint (B, S_TXT + S_IMG, H, D) output, so the
    concatenation of the streams costs no pass of its own.

    Grid (B·S joint tokens, 3 tensors {q, k, v}, H / BLOCK_H head blocks): a program takes the
    text stream's inputs for joint tokens s < S_TXT and the image stream's (at s - S_TXT)
    otherwise, and holds BLOCK_H heads of one token as a (BLOCK_H, D/2, 2) tile, as
    :func:`rmsnorm_rope_kernel`. The stream and tensor are picked by branching on the program's
    indices: every program then runs one path, and the q/k row math is one inlined copy, its
    pointers (tiles of the same type in every branch) and eps chosen before it. ``tf_ptr`` /
    ``if_ptr`` are the float32 views of the complex frequencies, (S_TXT, D/2, 2) and
    (S_IMG, D/2, 2). The three outputs share one layout (``stride_o*``).

    Bytes: q, k, v read once and written once (6·B·S·H·D elements, as the unfused q/k passes
    plus the torch.cat of v), plus S·D floats of frequencies. FLOPs: about 10 per q/k element,
    none for v.
    """
    which = tl.program_id(1)                 # 0: q, 1: k, 2: v
    b, s, h, i, j, col, col_mask, mask = head_tile(tl.program_id(0).to(tl.int64), tl.program_id(2), S, H, D,
                                                   BLOCK_H, BLOCK_HALF)
    if which == 2:
        if s < S_TXT:
            src = head_tile_ptrs(tv_ptr, b, s, h, col, stride_tvb, stride_tvs, stride_tvh)
        else:
            src = head_tile_ptrs(iv_ptr, b, s - S_TXT, h, col, stride_ivb, stride_ivs, stride_ivh)
        # same dtype in and out: an exact copy, as torch.cat
        tl.store(head_tile_ptrs(v_ptr, b, s, h, col, stride_ob, stride_os, stride_oh),
                 tl.load(src, mask=mask), mask=mask)
    else:
        if s < S_TXT:
            f_ptrs = tf_ptr + s * stride_tfs + i[:, None] * stride_tfi + j[None, :]
            if which == 0:
                x_ptrs = head_tile_ptrs(tq_ptr, b, s, h, col, stride_tqb, stride_tqs, stride_tqh)
                w_ptrs = wtq_ptr + col
                eps = eps_tq
            else:
                x_ptrs = head_tile_ptrs(tk_ptr, b, s, h, col, stride_tkb, stride_tks, stride_tkh)
                w_ptrs = wtk_ptr + col
                eps = eps_tk
        else:
            si = s - S_TXT
            f_ptrs = if_ptr + si * stride_ifs + i[:, None] * stride_ifi + j[None, :]
            if which == 0:
                x_ptrs = head_tile_ptrs(iq_ptr, b, si, h, col, stride_iqb, stride_iqs, stride_iqh)
                w_ptrs = wiq_ptr + col
                eps = eps_iq
            else:
                x_ptrs = head_tile_ptrs(ik_ptr, b, si, h, col, stride_ikb, stride_iks, stride_ikh)
                w_ptrs = wik_ptr + col
                eps = eps_ik
        out = rmsnorm_rope_tile(x_ptrs, w_ptrs, f_ptrs, mask, col_mask, D, eps, HAS_WEIGHT)
        if which == 0:
            o_ptrs = head_tile_ptrs(q_ptr, b, s, h, col, stride_ob, stride_os, stride_oh)
        else:
            o_ptrs = head_tile_ptrs(k_ptr, b, s, h, col, stride_ob, stride_os, stride_oh)
        tl.store(o_ptrs, out.to(q_ptr.dtype.element_ty), mask=mask)
