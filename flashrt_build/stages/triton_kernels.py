"""The package's own Triton kernels: the GEMV (gemv.py, gemv_fusion.py) and
the decode attention's split and merge (decode_attention.py, rotary_fusion.py).

One module that imports Triton, imported by their ops on first use, so
flashrt_build imports without it. AOTInductor compiles a user kernel's
source into the package together with the module-level `@triton.jit`
functions it calls (`step_ready`, `weight_tile`, `row_sums`, `merged_head`,
`merge_if_last`), which is why they live at module level.
A kernel whose name starts `flashrt_pdl_` is one the pdl pass may launch as
a programmatic dependent (pdl.py): each calls `step_ready` before it reads
or writes anything another kernel of the step touches.
"""

import triton
import triton.language as tl


@triton.jit
def step_ready(PDL: tl.constexpr):
    """0, once the kernel before this one has ended (PDL: the pdl pass's
    launch; without it, at once). Every pointer to the step's data is offset
    by it, so no load or store of it can move above the wait: the wait is
    pure inline asm (torch's mutation analysis gives up on impure asm and
    takes every input for written) whose value is used; x16 keeps the
    pointers' alignment and vector loads.

    It also lets the kernel after this one launch (launch_dependents; that
    one waits in turn): PDL=1 once this one's wait is over, PDL=2 before it
    (the next kernel's programs may then start, and load their weights,
    while this one still waits: pdl.MODE, as bench/gemv_fusion_probe.py
    timed both)."""
    ready = 0
    if PDL:
        order: tl.constexpr = ("griddepcontrol.wait; griddepcontrol.launch_dependents;" if PDL == 1 else
                               "griddepcontrol.launch_dependents; griddepcontrol.wait;")  # fmt: skip
        ready = tl.inline_asm_elementwise(order + " mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=True,
                                          pack=1) * 16  # fmt: skip
    return ready


@triton.jit
def weight_tile(rows, cols, in_rows, K, EVICT: tl.constexpr):
    """The weight's `rows` (pointers to their starts) at `cols`, zeros past
    K (no traffic); loaded evict-first with EVICT (read once a step)."""
    evict: tl.constexpr = "evict_first" if EVICT else ""
    return tl.load(rows + cols[None, :], mask=in_rows & (cols[None, :] < K), other=0.0, eviction_policy=evict)


@triton.jit
def widened(w, INT8_BITS: tl.constexpr):
    """A weight tile in fp32. int8 through fp32's bits where INT8_BITS:
    w + 0x4B400000 as an integer is the float 1.5 * 2^23 + w (exact: the sum
    stays in [2^23, 2^24), where fp32 steps by one), less 1.5 * 2^23. An
    integer add and a float add issue at four and eight times the rate of
    the int-to-float conversion (16 a clock an SM on sm_90), which would
    otherwise set the pace of a GEMV over int8 rows."""
    if INT8_BITS and w.dtype == tl.int8:
        return (w.to(tl.int32) + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0
    return w.to(tl.float32)


@triton.jit
def row_sums(acc, squares, b_ptr, s_ptr, rows, N, K, eps, NORMED: tl.constexpr, HAS_BIAS: tl.constexpr,
             HAS_SCALE: tl.constexpr):  # fmt: skip
    """A tile of products summed by row, times each row's scale where
    HAS_SCALE (int8 weights), scaled by RMSNorm's rsqrt(mean(x^2) + eps)
    where NORMED (`squares` holds x^2), plus the bias."""
    y = tl.sum(acc, axis=1)
    if HAS_SCALE:
        y = y * tl.load(s_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
    if NORMED:  # eps arrives as fp64 from AOTInductor: the scale stays fp32
        y = y * tl.rsqrt((tl.sum(squares, axis=0) / K + eps).to(tl.float32))
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
    return y


@triton.jit
def flashrt_pdl_gemv(
    w_ptr, x_ptr, v_ptr, b_ptr, r_ptr, y_ptr, s_ptr, N, K, eps,
    PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_SCALE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVICT: tl.constexpr, PDL: tl.constexpr, GLU: tl.constexpr,
    PREFETCH: tl.constexpr, INT8_BITS: tl.constexpr,
):  # fmt: skip
    """y[n] = sum_k w[n, k] p(x)[k] (* s[n]: HAS_SCALE, w int8) (+ b[n]) (+ r[n]):
    BLOCK_N rows a program, K in BLOCK_K steps, summed in fp32. The prologue p:
    x as it is, RMSNorm(x) * v (each program sums x^2 over the K it reads
    anyway and scales its sums once at the end), or SiLU(x) * v. GLU: w holds
    2N rows, gate's then up's, and y[n] = SiLU(gate[n]) * up[n] (a program
    sums its gate rows and the up rows N below them). The first weight
    tile (PREFETCH=2: the first two, then each step loads the tile after the
    next) is loaded before the program waits on the kernel before it (PDL:
    in a package the pdl pass launches as a programmatic dependent): the
    weights do not depend on the step, so they stream in meanwhile."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
    w_rows, w_in, cols = w_ptr + rows[:, None] * K, rows[:, None] < N, tl.arange(0, BLOCK_K)
    w = weight_tile(w_rows, cols, w_in, K, EVICT)
    if GLU:  # up's rows, N below gate's
        acc_up, u_rows = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32), w_rows + N * K
        u = weight_tile(u_rows, cols, w_in, K, EVICT)
    if PREFETCH == 2:  # the second tile too
        w_ahead = weight_tile(w_rows, cols + BLOCK_K, w_in, K, EVICT)
        if GLU:
            u_ahead = weight_tile(u_rows, cols + BLOCK_K, w_in, K, EVICT)
    # what the step wrote (x, the residual) and its output only through pointers offset by `ready`: after the wait
    ready = step_ready(PDL)
    x_ptr, r_ptr, y_ptr = x_ptr + ready, r_ptr + ready, y_ptr + ready
    for k in range(0, K, BLOCK_K):
        cols = k + tl.arange(0, BLOCK_K)
        if PREFETCH == 2:
            if k > 0:  # this step's tile is in; the one after it starts loading
                w, w_ahead = w_ahead, weight_tile(w_rows, cols + BLOCK_K, w_in, K, EVICT)
                if GLU:
                    u, u_ahead = u_ahead, weight_tile(u_rows, cols + BLOCK_K, w_in, K, EVICT)
        elif k > 0:  # the first tile is in
            w = weight_tile(w_rows, cols, w_in, K, EVICT)
            if GLU:
                u = weight_tile(u_rows, cols, w_in, K, EVICT)
        x = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
        if PROLOGUE == 1:
            squares += x * x
            x = x * tl.load(v_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
        elif PROLOGUE == 2:
            x = x * tl.sigmoid(x) * tl.load(v_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
        acc += widened(w, INT8_BITS) * x[None, :]
        if GLU:
            acc_up += widened(u, INT8_BITS) * x[None, :]
    y = row_sums(acc, squares, b_ptr, s_ptr, rows, N, K, eps, PROLOGUE == 1, HAS_BIAS, HAS_SCALE)
    if GLU:  # SiLU(gate) * up
        up = row_sums(acc_up, squares, b_ptr + N, s_ptr + N, rows, N, K, eps, PROLOGUE == 1, HAS_BIAS, HAS_SCALE)
        y = y * tl.sigmoid(y) * up
    if HAS_RESIDUAL:
        y += tl.load(r_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rows < N)


@triton.jit
def flashrt_pdl_attention_split(
    q_ptr, k_ptr, v_ptr, mask_ptr, cos_ptr, sin_ptr, part_ptr, stats_ptr, count_ptr, out_ptr, length, scale,
    sq_b, sq_h, sk_b, sk_h, sk_l, sv_b, sv_h, sv_l, sm_b, sm_l, sc_b, ss_b, so_b, so_h,
    KV_HEADS: tl.constexpr, GROUPS: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    SPLITS: tl.constexpr, CHUNK: tl.constexpr, BLOCK_L: tl.constexpr, HAS_MASK: tl.constexpr,
    ROTARY: tl.constexpr, PDL: tl.constexpr, MERGE: tl.constexpr, S_PAD: tl.constexpr,
):  # fmt: skip
    """One (batch, KV head) pair's query heads over one chunk of the
    cache: the chunk's unnormalised output, its running max and sum.
    The dots take fp32 (TF32 on a GPU: exact for bf16 and fp16): Triton's
    interpreter gets a bf16 dot wrong (3.x). PDL: it waits on the kernel
    before it first (step_ready). ROTARY: it rotates q (rotary_fusion.py).
    MERGE: the pair's last program to finish merges its heads' chunks
    into out (merge_if_last): one kernel, no merge kernel after it."""
    ready = step_ready(PDL)  # every pointer to the step's data offset by it
    q_ptr, k_ptr, v_ptr, mask_ptr = q_ptr + ready, k_ptr + ready, v_ptr + ready, mask_ptr + ready
    cos_ptr, sin_ptr, part_ptr, stats_ptr = cos_ptr + ready, sin_ptr + ready, part_ptr + ready, stats_ptr + ready
    pair, split = tl.program_id(0), tl.program_id(1)
    b, kv = pair // KV_HEADS, pair % KV_HEADS
    g, d = tl.arange(0, G_PAD), tl.arange(0, D_PAD)
    q_at, q_in = q_ptr + b * sq_b + (kv * GROUPS + g)[:, None] * sq_h, (g[:, None] < GROUPS) & (d[None, :] < D)
    q = tl.load(q_at + d[None, :], mask=q_in, other=0.0).to(tl.float32)
    if ROTARY:  # q * cos + rotate_half(q) * sin, kept in fp32 (eager rounds it to q's dtype)
        first, half = d < D // 2, tl.where(d < D // 2, d + D // 2, d - D // 2)  # rotate_half's halves
        q_half = tl.load(q_at + half[None, :], mask=q_in, other=0.0).to(tl.float32)
        cos = tl.load(cos_ptr + b * sc_b + d, mask=d < D, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + b * ss_b + d, mask=d < D, other=0.0).to(tl.float32)
        q = q * cos[None, :] + tl.where(first[None, :], -q_half, q_half) * sin[None, :]
    # TF32 is exact for a bf16 or fp16 q, not for a rotated one (fp32): that dot takes three TF32 products
    precision: tl.constexpr = "tf32x3" if ROTARY else "tf32"
    m_i, l_i = tl.full((G_PAD,), float("-inf"), tl.float32), tl.zeros((G_PAD,), tl.float32)
    acc = tl.zeros((G_PAD, D_PAD), tl.float32)
    for start in range(split * CHUNK, split * CHUNK + CHUNK, BLOCK_L):
        pos = start + tl.arange(0, BLOCK_L)
        seen = pos < length
        if HAS_MASK:
            seen = seen & (tl.load(mask_ptr + b * sm_b + pos * sm_l, mask=pos < length, other=0) != 0)
        if tl.max(seen.to(tl.int32), 0) > 0:  # a block the mask hides (the unfilled cache) reads nothing
            rows = seen[:, None] & (d[None, :] < D)  # a hidden position's row is not read
            k = tl.load(k_ptr + b * sk_b + kv * sk_h + pos[:, None] * sk_l + d[None, :], mask=rows, other=0.0)
            v = tl.load(v_ptr + b * sv_b + kv * sv_h + pos[:, None] * sv_l + d[None, :], mask=rows, other=0.0)
            # fp32 whatever type the scale comes as (AOTInductor passes a Python float as fp64)
            s = (tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=precision) * scale).to(tl.float32)
            s = tl.where(seen[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32))
            m_i = m_new
    at = pair * SPLITS + split
    tl.store(part_ptr + (at * G_PAD + g[:, None]) * D_PAD + d[None, :], acc)
    tl.store(stats_ptr + (at * 2) * G_PAD + g, m_i)
    tl.store(stats_ptr + (at * 2 + 1) * G_PAD + g, l_i)
    if MERGE:
        merge_if_last(part_ptr, stats_ptr, count_ptr + ready, out_ptr + ready, pair, b, kv, so_b, so_h,
                      GROUPS, G_PAD, D, D_PAD, SPLITS, S_PAD)  # fmt: skip


@triton.jit
def merged_head(part_ptr, stats_ptr, pair, g, G_PAD: tl.constexpr, D_PAD: tl.constexpr, SPLITS: tl.constexpr,
                S_PAD: tl.constexpr):  # fmt: skip
    """Query head g of a (batch, KV head) pair: its chunks' outputs merged
    by their maxima, softmax(q k^T) v. Loaded past L1 (.cg): another
    program of this kernel may have written them (merge_if_last)."""
    s, d = tl.arange(0, S_PAD), tl.arange(0, D_PAD)
    at = pair * SPLITS + s
    m_s = tl.load(stats_ptr + (at * 2) * G_PAD + g, mask=s < SPLITS, other=float("-inf"), cache_modifier=".cg")
    l_s = tl.load(stats_ptr + (at * 2 + 1) * G_PAD + g, mask=s < SPLITS, other=0.0, cache_modifier=".cg")
    part = tl.load(part_ptr + (at[:, None] * G_PAD + g) * D_PAD + d[None, :], mask=(s < SPLITS)[:, None], other=0.0,
                   cache_modifier=".cg")  # fmt: skip
    m = tl.max(m_s, 0)
    w = tl.where(m_s == float("-inf"), 0.0, tl.exp(m_s - m))  # a chunk the mask hid counts 0 (not NaN)
    total = tl.sum(l_s * w, 0)
    return tl.sum(part * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)


@triton.jit
def merge_if_last(part_ptr, stats_ptr, count_ptr, out_ptr, pair, b, kv, so_b, so_h, GROUPS: tl.constexpr,
                  G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, SPLITS: tl.constexpr,
                  S_PAD: tl.constexpr):  # fmt: skip
    """Count this program's chunk of the pair done; the last of the pair's
    SPLITS programs merges the group's heads into out and sets the count
    back to 0 for the next call. The barrier has every thread's stores
    issued before the count; the count's acq_rel orders them before the
    last program's loads (the CUDA semaphore pattern: bar.sync, then one
    atomic at GPU scope). Triton's interpreter runs programs one by one:
    it shows the merge and the reset, not the ordering (a GPU's test does)."""
    tl.debug_barrier()
    done = tl.atomic_add(count_ptr + pair, 1, sem="acq_rel", scope="gpu")
    if done == SPLITS - 1:
        d = tl.arange(0, D_PAD)
        for g in tl.static_range(GROUPS):
            out = merged_head(part_ptr, stats_ptr, pair, g, G_PAD, D_PAD, SPLITS, S_PAD)
            tl.store(out_ptr + b * so_b + (kv * GROUPS + g) * so_h + d, out.to(out_ptr.dtype.element_ty), mask=d < D)
        tl.atomic_xchg(count_ptr + pair, 0, sem="relaxed", scope="gpu")


@triton.jit
def flashrt_pdl_attention_merge(
    part_ptr, stats_ptr, out_ptr, so_b, so_h,
    KV_HEADS: tl.constexpr, GROUPS: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    SPLITS: tl.constexpr, S_PAD: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One query head's chunks, all read at once, merged by their
    maxima: softmax(q k^T) v."""
    ready = step_ready(PDL)
    part_ptr, stats_ptr, out_ptr = part_ptr + ready, stats_ptr + ready, out_ptr + ready
    head = tl.program_id(0)
    b, h = head // (KV_HEADS * GROUPS), head % (KV_HEADS * GROUPS)
    d = tl.arange(0, D_PAD)
    out = merged_head(part_ptr, stats_ptr, b * KV_HEADS + h // GROUPS, h % GROUPS, G_PAD, D_PAD, SPLITS, S_PAD)
    tl.store(out_ptr + b * so_b + h * so_h + d, out.to(out_ptr.dtype.element_ty), mask=d < D)
