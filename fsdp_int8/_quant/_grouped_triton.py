"""The Triton kernels of :mod:`.grouped_gemm` (its docstring says what they compute).

Imported only where they run (CUDA with Triton, or ``TRITON_INTERPRET=1``): ``triton.jit``
decides between compiling and interpreting when this module is imported. Triton resolves
the helpers a kernel calls among this module's globals. The kernels use Triton's builtins
only, none of its standard library (``tl.zeros``, ``tl.minimum``, ``tl.sum``): those are
jitted functions that the interpreter can run only if it was on when Triton was first
imported, which a test process cannot promise.
"""

import triton
import triton.language as tl


@triton.jit
def _min(a, b):
    return tl.where(a < b, a, b)


@triton.jit
def experts_before(offs_ptr, experts, row, SEARCH_STEPS: tl.constexpr):
    # how many experts end at or before ``row`` (the offsets never decrease): a binary
    # search of SEARCH_STEPS halvings
    lo = row * 0
    hi = lo + experts
    for _ in tl.static_range(SEARCH_STEPS):
        active = lo < hi
        mid = (lo + hi) // 2
        end = tl.load(offs_ptr + mid, mask=active, other=0)
        lo = tl.where(active & (end <= row), mid + 1, lo)
        hi = tl.where(active & (end > row), mid, hi)
    return lo


@triton.jit
def rows_kernel(a_ptr, b_ptr, offs_ptr, row_scale_ptr, col_scale_ptr, out_ptr,
                rows, cols, inner, experts,
                stride_am, stride_ai, stride_be, stride_bi, stride_bj, stride_ce, stride_om,
                HAS_COL_SCALE: tl.constexpr, SEARCH_STEPS: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # One tile of rows x columns; its rows may span several experts: each expert with
    # rows in the tile runs its own dot over the tile's masked rows. Offsets into the
    # tensors are int64: rows x features or experts x out x in can pass 2**31.
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m64 = m.to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    first_row = tl.program_id(0) * BLOCK_M
    last_row = _min(first_row + BLOCK_M, rows) - 1
    first_expert = experts_before(offs_ptr, experts, first_row, SEARCH_STEPS)
    last_expert = _min(experts_before(offs_ptr, experts, last_row, SEARCH_STEPS), experts - 1)
    row_scale = tl.load(row_scale_ptr + m, mask=m < rows, other=0.0)
    result = tl.full((BLOCK_M, BLOCK_N), 0, tl.float32)
    e64 = first_expert.to(tl.int64)  # e, counted alongside in int64
    for e in range(first_expert, last_expert + 1):
        start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0)
        end = tl.load(offs_ptr + e)
        in_expert = (m >= start) & (m < end)
        expert = b_ptr + e64 * stride_be
        acc = tl.full((BLOCK_M, BLOCK_N), 0, tl.int32)
        for i0 in range(0, inner, BLOCK_K):
            i = i0 + tl.arange(0, BLOCK_K)
            a = tl.load(a_ptr + m64[:, None] * stride_am + i[None, :] * stride_ai,
                        mask=in_expert[:, None] & (i[None, :] < inner), other=0)
            b = tl.load(expert + i[:, None] * stride_bi + n[None, :] * stride_bj,
                        mask=(i[:, None] < inner) & (n[None, :] < cols), other=0)
            acc += tl.dot(a, b, out_dtype=tl.int32)
        scaled = acc.to(tl.float32) * row_scale[:, None]
        if HAS_COL_SCALE:
            col_scale = tl.load(col_scale_ptr + e * stride_ce + n, mask=n < cols, other=0.0)
            scaled = scaled * col_scale[None, :]
        result = tl.where(in_expert[:, None], scaled, result)
        e64 += 1
    tl.store(out_ptr + m64[:, None] * stride_om + n[None, :], result.to(out_ptr.dtype.element_ty),
             mask=(m[:, None] < rows) & (n[None, :] < cols))


@triton.jit
def sums_kernel(a_ptr, b_ptr, offs_ptr, scale_a_ptr, scale_b_ptr, out_ptr, n_size, k_size,
                stride_am, stride_an, stride_bm, stride_bk, stride_sa, stride_sb, stride_oe, stride_on,
                HAS_B_SCALE: tl.constexpr, CHUNK: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # One expert's [N, K] tile: a sum over that expert's rows, in int32 chunks of at
    # most CHUNK rows, each scaled and added in fp32; int64 offsets, as above.
    e = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.program_id(2) * BLOCK_K + tl.arange(0, BLOCK_K)
    start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0)
    end = tl.load(offs_ptr + e)
    scale = tl.load(scale_a_ptr + e * stride_sa + n, mask=n < n_size, other=0.0)[:, None]
    if HAS_B_SCALE:
        scale_b = tl.load(scale_b_ptr + e * stride_sb + k, mask=k < k_size, other=0.0)
    total = tl.full((BLOCK_N, BLOCK_K), 0, tl.float32)
    for c0 in range(start, end, CHUNK):
        c1 = _min(c0 + CHUNK, end)
        acc = tl.full((BLOCK_N, BLOCK_K), 0, tl.int32)
        for r0 in range(c0, c1, BLOCK_M):
            r = r0 + tl.arange(0, BLOCK_M)
            r64 = r.to(tl.int64)
            a = tl.load(a_ptr + r64[None, :] * stride_am + n[:, None] * stride_an,
                        mask=(r[None, :] < c1) & (n[:, None] < n_size), other=0)
            b = tl.load(b_ptr + r64[:, None] * stride_bm + k[None, :] * stride_bk,
                        mask=(r[:, None] < c1) & (k[None, :] < k_size), other=0)
            acc += tl.dot(a, b, out_dtype=tl.int32)
        part = acc.to(tl.float32) * scale
        if HAS_B_SCALE:
            part = part * scale_b[None, :]
        total += part
    tl.store(out_ptr + e.to(tl.int64) * stride_oe + n[:, None] * stride_on + k[None, :],
             total.to(out_ptr.dtype.element_ty),
             mask=(n[:, None] < n_size) & (k[None, :] < k_size))
