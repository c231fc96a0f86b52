/* y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for a few rows m: SpecGUI's CPU verify kernel.
 *
 * Why (specgui/kernels.py has the measurements): a decoding step multiplies 1-64 rows by every weight
 * matrix once, so it is bound by streaming the weights from memory, and a forward over a few rows could
 * cost about what one row costs. BLAS libraries tuned for large products handle these skinny shapes as
 * separate matrix-vector products or with packing overheads, so their cost grows with every row. Here
 * each block of weight rows is read from memory once (then stays in L2) and up to 12 input rows are
 * multiplied against it in one pass, in register tiles of R weight rows x M input rows, one vector wide
 * (16 floats with AVX-512, 8 with AVX2 + FMA), while the next tile's weight rows are prefetched. The tiles
 * keep only accumulators and the current weight vectors in registers and read the input rows again at every
 * step, from L1. On an AMD EPYC (two threads, every product of a SmolLM2-135M forward, fp32) AVX2's 16
 * registers allowed one weight row per tile from 7 rows on (an input load for every multiply-add): 8 rows
 * cost 24 ms against one row's 15; AVX-512's 32 registers take 3 weight rows at 8 rows: 21.7 ms.
 *
 * Every output is summed in the same order whatever the number of rows or threads (a vector's lanes over k, then
 * the lanes, then the tail), so a row's result does not depend on which other rows share the call: a
 * verify forward's rows equal plain steps' bit for bit through these products.
 *
 * bfloat16 weights (`skinny_linear_bf16`, a bf16 model on a CPU): widened exactly to fp32 by a shift, half of
 * fp32's weight bytes streamed, the same tiles and summation order.
 *
 * int8 weights (`skinny_linear_i8`, Fractal's compressed copy on a CPU): the same tiles over int8 weight rows with one
 * float scale per row, widened to floats in registers; activations stay fp32 (no quantization of the inputs, as
 * torch's dynamic int8 linear does). A quarter of fp32's weight bytes streamed, the same summation order.
 *
 * Fractal's compressed decoder layer (`draft_layer_in`, `draft_layer_out`, at the end of this file) runs the int8 copy's
 * layers on these products with the rest of each layer in C: see there.
 *
 * Threads: OpenMP over weight-row blocks; loaded into a process where torch already holds libgomp, it
 * shares torch's thread pool.
 */
#include <immintrin.h>
#include <math.h>

#define BLOCK 24 /* every tile width (8, 6, 4, 3, 2, 1) divides it */
#define CHUNK 12 /* input rows per pass over a block */

/* The sum of 8 floats' lanes, pairwise. */
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The vector layer: 16 floats in 32 registers where the compiler targets AVX-512 (kernels.py adds -mavx512f on
   CPUs that have it), else 8 floats in 16 registers (AVX2). One build uses one of them for every call, so a
   row's summation order is the same in every call on a machine. */
#ifdef __AVX512F__
typedef __m512 vec;
#define LANES 16
#define vzero _mm512_setzero_ps
#define vfma _mm512_fmadd_ps
#define vload _mm512_loadu_ps
static inline vec load_f32(const float *w) { return _mm512_loadu_ps(w); }
static inline vec load_i8(const signed char *w) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)w)));
}
static inline vec load_bf16(const unsigned short *w) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)w)), 16));
}
static inline float hsum(vec v) {
    return hsum8(_mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
}
#define MM(op) _mm512_##op
#define vbits _mm512_castsi512_ps
static inline vec vround(vec x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vec vzero_at_minus_inf(vec y, vec x) {
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ), y);
}
#else
typedef __m256 vec;
#define LANES 8
#define vzero _mm256_setzero_ps
#define vfma _mm256_fmadd_ps
#define vload _mm256_loadu_ps
static inline vec load_f32(const float *w) { return _mm256_loadu_ps(w); }
static inline vec load_i8(const signed char *w) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)w)));
}
static inline vec load_bf16(const unsigned short *w) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)w)), 16));
}
static inline float hsum(vec v) { return hsum8(v); }
#define MM(op) _mm256_##op
#define vbits _mm256_castsi256_ps
static inline vec vround(vec x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vec vzero_at_minus_inf(vec y, vec x) {
    return _mm256_and_ps(y, _mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ));
}
#endif
#define vset1 MM(set1_ps)
#define vstore MM(storeu_ps)
#define vadd MM(add_ps)
#define vmul MM(mul_ps)
#define vmax MM(max_ps)
static inline vec vpow2(vec n) { /* 2^n for whole n in [-126, 127], built as the float's exponent bits */
    return vbits(MM(slli_epi32)(MM(add_epi32)(MM(cvtps_epi32)(n), MM(set1_epi32)(127)), 23));
}

/* One weight as a float (a row's tail past the last full vector) */
static inline float one_load_f32(float w) { return w; }
static inline float one_load_i8(signed char w) { return (float)w; }
static inline float one_load_bf16(unsigned short w) {
    union { unsigned int bits; float value; } u = {(unsigned int)w << 16};
    return u.value;
}

/* One tile: R weight rows from w (row stride K, element type T) times M input rows from x (row stride K). The
   input rows are read again at every step (12 rows of K floats at most: L1 or L2), which leaves the registers to
   R x M accumulators and R weight vectors. */
#define TILE(T, LOAD, M, R)                                                                              \
    static void tile_##LOAD##_##M##_##R(const float *x, const T *w, float *y, long K, long N, long kv) { \
        vec acc[R][M];                                                                                   \
        for (int r = 0; r < R; r++)                                                                      \
            for (int m = 0; m < M; m++) acc[r][m] = vzero();                                             \
        for (long k = 0; k < kv; k += LANES) {                                                           \
            vec wv[R];                                                                                   \
            for (int r = 0; r < R; r++) {                                                                \
                _mm_prefetch((const char *)(w + (r + R) * K + k + 64), _MM_HINT_T0);                       \
                wv[r] = LOAD(w + r * K + k);                                                             \
            }                                                                                            \
            for (int m = 0; m < M; m++) {                                                                \
                vec xv = vload(x + m * K + k);                                                           \
                for (int r = 0; r < R; r++) acc[r][m] = vfma(wv[r], xv, acc[r][m]);                      \
            }                                                                                            \
        }                                                                                                \
        for (int r = 0; r < R; r++)                                                                      \
            for (int m = 0; m < M; m++) {                                                                \
                float s = hsum(acc[r][m]);                                                               \
                for (long k = kv; k < K; k++) s += x[m * K + k] * one_##LOAD(w[r * K + k]);            \
                y[m * N + r] = s;                                                                        \
            }                                                                                            \
    }

/* Per input-row count M (1..CHUNK), the widest tile whose R x M accumulators, R weight vectors and one input
   vector fit the registers (R dividing BLOCK): WIDE_* names them, NARROW_* the one-weight-row tiles for a block's
   leftover rows. AVX-512 has 32 registers: 8 rows x 3 weight rows take 28 of them, where AVX2's 16 allow 8 x 1,
   which loads an input vector for every multiply-add. */
#ifdef __AVX512F__
#define WIDE_TILES(T, LOAD)                                                                                      \
    TILE(T, LOAD, 1, 8) TILE(T, LOAD, 2, 8) TILE(T, LOAD, 3, 6) TILE(T, LOAD, 4, 6) TILE(T, LOAD, 5, 4)          \
    TILE(T, LOAD, 6, 4) TILE(T, LOAD, 7, 3) TILE(T, LOAD, 8, 3) TILE(T, LOAD, 9, 3) TILE(T, LOAD, 10, 2)         \
    TILE(T, LOAD, 11, 2) TILE(T, LOAD, 12, 2)                                                                    \
    static const tile_##LOAD WIDE_##LOAD[CHUNK + 1] = {                                                          \
        0, tile_##LOAD##_1_8, tile_##LOAD##_2_8, tile_##LOAD##_3_6, tile_##LOAD##_4_6, tile_##LOAD##_5_4,        \
        tile_##LOAD##_6_4, tile_##LOAD##_7_3, tile_##LOAD##_8_3, tile_##LOAD##_9_3, tile_##LOAD##_10_2,         \
        tile_##LOAD##_11_2, tile_##LOAD##_12_2};
static const int WIDTH[CHUNK + 1] = {0, 8, 8, 6, 6, 4, 4, 3, 3, 3, 2, 2, 2};
#else
#define WIDE_TILES(T, LOAD)                                                                                      \
    TILE(T, LOAD, 1, 8) TILE(T, LOAD, 2, 4) TILE(T, LOAD, 3, 3) TILE(T, LOAD, 4, 3) TILE(T, LOAD, 5, 2)          \
    TILE(T, LOAD, 6, 2)                                                                                          \
    static const tile_##LOAD WIDE_##LOAD[CHUNK + 1] = {                                                          \
        0, tile_##LOAD##_1_8, tile_##LOAD##_2_4, tile_##LOAD##_3_3, tile_##LOAD##_4_3, tile_##LOAD##_5_2,        \
        tile_##LOAD##_6_2, tile_##LOAD##_7_1, tile_##LOAD##_8_1, tile_##LOAD##_9_1, tile_##LOAD##_10_1,          \
        tile_##LOAD##_11_1, tile_##LOAD##_12_1};
static const int WIDTH[CHUNK + 1] = {0, 8, 4, 3, 3, 2, 2, 1, 1, 1, 1, 1, 1};
#endif

#define KERNELS(T, LOAD)                                                                                         \
    TILE(T, LOAD, 1, 1) TILE(T, LOAD, 2, 1) TILE(T, LOAD, 3, 1) TILE(T, LOAD, 4, 1) TILE(T, LOAD, 5, 1)          \
    TILE(T, LOAD, 6, 1) TILE(T, LOAD, 7, 1) TILE(T, LOAD, 8, 1) TILE(T, LOAD, 9, 1) TILE(T, LOAD, 10, 1)         \
    TILE(T, LOAD, 11, 1) TILE(T, LOAD, 12, 1)                                                                    \
    typedef void (*tile_##LOAD)(const float *, const T *, float *, long, long, long);                          \
    WIDE_TILES(T, LOAD)                                                                                          \
    static const tile_##LOAD NARROW_##LOAD[CHUNK + 1] = {                                                        \
        0, tile_##LOAD##_1_1, tile_##LOAD##_2_1, tile_##LOAD##_3_1, tile_##LOAD##_4_1, tile_##LOAD##_5_1,        \
        tile_##LOAD##_6_1, tile_##LOAD##_7_1, tile_##LOAD##_8_1, tile_##LOAD##_9_1, tile_##LOAD##_10_1,          \
        tile_##LOAD##_11_1, tile_##LOAD##_12_1};                                                                 \
    /* Rows [n0, n1) of the output for all M input rows, in the fewest passes of at most CHUNK input rows, as   \
       even as they go: 13 rows as 7 + 6, not 12 + 1 (all the products of a forward, AMD EPYC, two threads: 35.8 ms\
       as 12 + 1, 32.8 as 7 + 6, 31.5 for 12 rows). */                                                         \
    static void block_##LOAD(const float *x, const T *w, float *y, long M, long K, long N, long n0, long n1) {  \
        long kv = K - K % LANES;                                                                                 \
        long passes = (M + CHUNK - 1) / CHUNK, chunk = (M + passes - 1) / passes;                                \
        for (long m0 = 0; m0 < M; m0 += chunk) {                                                                 \
            int m = M - m0 < chunk ? (int)(M - m0) : (int)chunk;                                                 \
            const float *xm = x + m0 * K;                                                                        \
            float *ym = y + m0 * N;                                                                              \
            long n = n0;                                                                                         \
            for (; n + WIDTH[m] <= n1; n += WIDTH[m]) WIDE_##LOAD[m](xm, w + n * K, ym + n, K, N, kv);          \
            for (; n < n1; n++) NARROW_##LOAD[m](xm, w + n * K, ym + n, K, N, kv);                              \
        }                                                                                                        \
    }

KERNELS(float, load_f32)
KERNELS(signed char, load_i8)
KERNELS(unsigned short, load_bf16)

/* Blocks of 24, 48 or 96 weight rows (every tile width divides them): the largest that still gives each thread
   four blocks, so that a 192-row projection splits evenly over two threads. */
static long block_rows(long N, int threads) {
    long size = BLOCK;
    while (size < 4 * BLOCK && N / (2 * size) >= 4L * threads) size *= 2;
    return size;
}

/* Each output row's scale (int8 weights; none for fp32), then its bias. */
static void finish(float *y, const float *scale, const float *bias, long M, long N, long n0, long n1) {
    for (long m = 0; m < M; m++)
        for (long n = n0; n < n1; n++) {
            if (scale) y[m * N + n] *= scale[n];
            if (bias) y[m * N + n] += bias[n];
        }
}

enum weights { F32, I8, BF16 };

/* y = x w^T for M input rows, over blocks of weight rows spread across threads, then scales and bias. */
static int run(enum weights type, const float *x, const void *w, const float *scale, const float *bias, float *y,
               long M, long K, long N, int threads) {
    if (M < 1 || K < 1 || N < 1) return -1;
    long size = block_rows(N, threads), blocks = (N + size - 1) / size;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long b = 0; b < blocks; b++) {
        long n0 = b * size, n1 = n0 + size < N ? n0 + size : N;
        if (type == I8)
            block_load_i8(x, w, y, M, K, N, n0, n1);
        else if (type == BF16)
            block_load_bf16(x, w, y, M, K, N, n0, n1);
        else
            block_load_f32(x, w, y, M, K, N, n0, n1);
        finish(y, scale, bias, M, N, n0, n1);
    }
    return 0;
}

int skinny_linear(const float *x, const float *w, const float *bias, float *y, long M, long K, long N, int threads) {
    return run(F32, x, w, 0, bias, y, M, K, N, threads);
}

/* y[m, n] = scale[n] * sum_k x[m, k] * w[n, k] (+ bias[n]) with int8 weights w. */
int skinny_linear_i8(const float *x, const signed char *w, const float *scale, const float *bias, float *y, long M,
                     long K, long N, int threads) {
    return run(I8, x, w, scale, bias, y, M, K, N, threads);
}

/* y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) with bfloat16 weights w (the upper half of an fp32, widened exactly by
   a shift): half of fp32's weight bytes streamed, products and sums in fp32, the same summation order. */
int skinny_linear_bf16(const float *x, const unsigned short *w, const float *bias, float *y, long M, long K, long N,
                       int threads) {
    return run(BF16, x, w, 0, bias, y, M, K, N, threads);
}

/* ---- Fractal's compressed decoder layer on a CPU, in two calls ------------------------------------------------
 *
 * Why: a compressed pass runs every decoder layer of the int8 copy over 3-5 rows. Its products take ~9 ms a pass on
 * an AMD EPYC (two threads), but as torch modules the layer's ~25 small operations (norms, rotary, grouped
 * attention, SiLU, residuals, each 3-50 us of dispatch for a few rows) took another ~11 ms, more than the products.
 * Here a layer is two calls: `draft_layer_in` (norm, fused q/k/v product, rotary) and, after the caller has handed the
 * new keys and values to its cache, `draft_layer_out` (attention over the cache, output product, residual, norm,
 * gate/up product, SiLU, down product, residual). Only the draft reads these numbers (the full model verifies every
 * token), so sums need not match torch's order; they match its formulas (Llama: RMSNorm, rotate-half rotary,
 * softmax attention with grouped key/value heads, SiLU-gated MLP). */


/* y = x / sqrt(mean(x^2) + eps) * w over each of T rows of width H */
static void rms_norm(const float *x, const float *w, float eps, float *y, long T, long H) {
    for (long t = 0; t < T; t++) {
        const float *xr = x + t * H;
        float sum = 0.0f;
        for (long i = 0; i < H; i++) sum += xr[i] * xr[i];
        float inv = 1.0f / sqrtf(sum / (float)H + eps);
        for (long i = 0; i < H; i++) y[t * H + i] = xr[i] * inv * w[i];
    }
}

/* Rotate-half rotary on `heads` heads of width D in a row: x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin */
static void rotary(float *x, const float *cos_t, const float *sin_t, long heads, long D) {
    long half = D / 2;
    for (long h = 0; h < heads; h++) {
        float *xh = x + h * D;
        for (long i = 0; i < half; i++) {
            float x1 = xh[i], x2 = xh[i + half];
            xh[i] = x1 * cos_t[i] - x2 * sin_t[i];
            xh[i + half] = x2 * cos_t[i + half] + x1 * sin_t[i + half];
        }
    }
}

/* e^x for x <= 0, a vector at a time, 0 where x is -inf (a masked score): 2^n e^r with n = round(x / ln 2) and
   |r| <= ln(2) / 2, e^r by Cephes' degree-6 polynomial (within ~2 ulp of expf). The softmax of a long cache spent
   ~40% of its time in scalar expf: a 5-row pass over 1024 cached tokens 22.8 ms, 18.4 with no exp at all. */
static inline vec vexp(vec x) {
    vec clamped = vmax(x, vset1(-87.0f));
    vec n = vround(vmul(clamped, vset1(1.44269504088896341f)));
    vec r = vfma(n, vset1(-0.693359375f), clamped);
    r = vfma(n, vset1(2.12194440e-4f), r);
    vec p = vset1(1.9875691500e-4f);
    p = vfma(p, r, vset1(1.3981999507e-3f));
    p = vfma(p, r, vset1(8.3334519073e-3f));
    p = vfma(p, r, vset1(4.1665795894e-2f));
    p = vfma(p, r, vset1(1.6666665459e-1f));
    p = vfma(p, r, vset1(5.0000001201e-1f));
    p = vfma(p, vmul(r, r), vadd(r, vset1(1.0f)));
    return vzero_at_minus_inf(vmul(p, vpow2(n)), x);
}

static float dot(const float *a, const float *b, long n) {
    long nv = n - n % LANES;
    vec acc = vzero();
    for (long i = 0; i < nv; i += LANES) acc = vfma(vload(a + i), vload(b + i), acc);
    float s = hsum(acc);
    for (long i = nv; i < n; i++) s += a[i] * b[i];
    return s;
}

/* qkv [T, (Hq + 2 Hkv) D] = rotary(norm(h) Wqkv^T): the caller hands qkv's key and value parts to its cache. */
int draft_layer_in(const float *h, const float *norm_w, float eps, const signed char *qkv_w, const float *qkv_scale,
                   const float *qkv_bias, const float *cos, const float *sin, float *normed, float *qkv, long T, long H,
                   long Hq, long Hkv, long D, int threads) {
    long width = (Hq + 2 * Hkv) * D;
    rms_norm(h, norm_w, eps, normed, T, H);
    if (run(I8, normed, qkv_w, qkv_scale, qkv_bias, qkv, T, H, width, threads)) return -1;
    for (long t = 0; t < T; t++) rotary(qkv + t * width, cos + t * D, sin + t * D, Hq + Hkv, D);
    return 0;
}

/* h += down(silu(gate) * up) of norm(h + o(attention)), in place. keys/values: [Hkv, cols, D] with `head_stride`
   floats between heads (a cache buffer's layout); mask [T, cols] (nonzero: visible) or none (all visible). scores
   [T Hq, cols], attn [T, Hq D], x [T, H], gate_up [T, 2 I] are scratch. */
int draft_layer_out(float *h, const float *qkv, const float *keys, const float *values, long head_stride, long cols,
                    const unsigned char *mask, float scaling, const signed char *o_w, const float *o_scale,
                    const float *o_bias, const float *norm_w, float eps, const signed char *gu_w, const float *gu_scale,
                    const float *gu_bias, const signed char *down_w, const float *down_scale, const float *down_bias,
                    float *scores, float *attn, float *x, float *gate_up, long T, long H, long Hq, long Hkv, long D,
                    long I, int threads) {
    long width = (Hq + 2 * Hkv) * D, group = Hq / Hkv;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long job = 0; job < T * Hq; job++) {
        long t = job / Hq, head = job % Hq;
        const float *q = qkv + t * width + head * D;
        const float *k = keys + (head / group) * head_stride, *v = values + (head / group) * head_stride;
        const unsigned char *visible = mask ? mask + t * cols : 0;
        float *s = scores + job * cols, top = -INFINITY, total = 0.0f;
        for (long c = 0; c < cols; c++) {
            s[c] = (!visible || visible[c]) ? dot(q, k + c * D, D) * scaling : -INFINITY;
            if (s[c] > top) top = s[c];
        }
        long c = 0, cv = cols - cols % LANES;
        vec sums = vzero(), shift = vset1(-top);
        for (; c < cv; c += LANES) {
            vec e = vexp(vadd(vload(s + c), shift));
            vstore(s + c, e);
            sums = vadd(sums, e);
        }
        total = hsum(sums);
        for (; c < cols; c++) {
            s[c] = s[c] == -INFINITY ? 0.0f : expf(s[c] - top);
            total += s[c];
        }
        float *out = attn + t * Hq * D + head * D;
        for (long d = 0; d < D; d++) out[d] = 0.0f;
        for (long c = 0; c < cols; c++) {
            if (s[c] == 0.0f) continue;
            float p = s[c] / total;
            const float *vc = v + c * D;
            for (long d = 0; d < D; d++) out[d] += p * vc[d];
        }
    }
    if (run(I8, attn, o_w, o_scale, o_bias, x, T, Hq * D, H, threads)) return -1;
    for (long i = 0; i < T * H; i++) h[i] += x[i];
    rms_norm(h, norm_w, eps, x, T, H);
    if (run(I8, x, gu_w, gu_scale, gu_bias, gate_up, T, H, 2 * I, threads)) return -1;
    /* silu(gate) * up, row t written at gate_up[t I ...] ([T, I], the down product's input) from its gate at
       [2 t I ...] and up at [2 t I + I ...]: a row's destination ends at (t + 1) I <= 2 t I, before its own
       sources, and row 0 is rewritten element by element in place */
    for (long t = 0; t < T; t++) {
        const float *g = gate_up + t * 2 * I, *u = g + I;
        float *act = gate_up + t * I;
        for (long i = 0; i < I; i++) act[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
    if (run(I8, gate_up, down_w, down_scale, down_bias, x, T, I, H, threads)) return -1;
    for (long i = 0; i < T * H; i++) h[i] += x[i];
    return 0;
}
