/* y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for a few rows m: SpecGUI's CPU verify kernel.
 *
 * Why (specgui/kernels.py has the measurements): a decoding step multiplies 1-64 rows by every weight
 * matrix once, so it is bound by streaming the weights from memory, and a forward over a few rows could
 * cost about what one row costs. BLAS libraries tuned for large products handle these skinny shapes as
 * separate matrix-vector products or with packing overheads, so their cost grows with every row. Here
 * each block of weight rows is read from memory once (then stays in L2) and up to 12 input rows are
 * multiplied against it in one pass, in register tiles of R weight rows x M input rows, 8 floats wide
 * (AVX2 + FMA), while the next tile's weight rows are prefetched. The tiles keep only accumulators and the
 * current weight vectors in registers and read the input rows again at every step, from L1: AVX2's 16
 * registers then hold 8-12 rows' accumulators instead of 4 rows' with their inputs. On an AMD EPYC (two
 * threads, every product of a SmolLM2-135M forward) 8 rows cost 26 ms against one row's 24 (35 ms when
 * rows went in passes of 4), 16 rows 43 ms (55).
 *
 * Every output is summed in the same order whatever the number of rows or threads (8 lanes over k, then
 * the lanes, then the tail), so a row's result does not depend on which other rows share the call: a
 * verify forward's rows equal plain steps' bit for bit through these products.
 *
 * int8 weights (`skinny_linear_i8`, Fractal's compressed copy on a CPU): the same tiles over int8 weight rows with one
 * float scale per row, widened to floats in registers; activations stay fp32 (no quantization of the inputs, as
 * torch's dynamic int8 linear does). A quarter of fp32's weight bytes streamed, the same summation order.
 *
 * Threads: OpenMP over weight-row blocks; loaded into a process where torch already holds libgomp, it
 * shares torch's thread pool.
 */
#include <immintrin.h>

#define BLOCK 24 /* every tile width (8, 4, 3, 2, 1) divides it */
#define CHUNK 12 /* input rows per pass over a block: 12 accumulators, a weight and an input vector */

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 8 weights as floats: fp32 as they are, int8 widened (the row's scale is applied to the finished sum) */
static inline __m256 load_f32(const float *w) { return _mm256_loadu_ps(w); }
static inline __m256 load_i8(const signed char *w) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)w)));
}

/* One tile: R weight rows from w (row stride K, element type T) times M input rows from x (row stride K). The
   input rows are read again at every step (12 rows of K floats at most: L1), which leaves the registers to
   R x M accumulators. */
#define TILE(T, LOAD, M, R)                                                                              \
    static void tile_##LOAD##_##M##_##R(const float *x, const T *w, float *y, long K, long N, long kv) { \
        __m256 acc[R][M];                                                                                \
        for (int r = 0; r < R; r++)                                                                      \
            for (int m = 0; m < M; m++) acc[r][m] = _mm256_setzero_ps();                                 \
        for (long k = 0; k < kv; k += 8) {                                                               \
            __m256 wv[R];                                                                                \
            for (int r = 0; r < R; r++) {                                                                \
                _mm_prefetch((const char *)(w + (r + R) * K + k + 64), _MM_HINT_T0);                       \
                wv[r] = LOAD(w + r * K + k);                                                             \
            }                                                                                            \
            for (int m = 0; m < M; m++) {                                                                \
                __m256 xv = _mm256_loadu_ps(x + m * K + k);                                              \
                for (int r = 0; r < R; r++) acc[r][m] = _mm256_fmadd_ps(wv[r], xv, acc[r][m]);           \
            }                                                                                            \
        }                                                                                                \
        for (int r = 0; r < R; r++)                                                                      \
            for (int m = 0; m < M; m++) {                                                                \
                float s = hsum(acc[r][m]);                                                               \
                for (long k = kv; k < K; k++) s += x[m * K + k] * (float)w[r * K + k];                   \
                y[m * N + r] = s;                                                                        \
            }                                                                                            \
    }

/* R x M accumulators + R weight vectors + one input vector fit AVX2's 16 registers; per weight type, the wide
   tiles by input rows (WIDE), the one-weight-row tiles for a block's leftover rows (NARROW) and their widths */
#define KERNELS(T, LOAD)                                                                                         \
    TILE(T, LOAD, 1, 8) TILE(T, LOAD, 1, 1) TILE(T, LOAD, 2, 4) TILE(T, LOAD, 2, 1) TILE(T, LOAD, 3, 3)          \
    TILE(T, LOAD, 3, 1) TILE(T, LOAD, 4, 3) TILE(T, LOAD, 4, 1) TILE(T, LOAD, 5, 2) TILE(T, LOAD, 5, 1)          \
    TILE(T, LOAD, 6, 2) TILE(T, LOAD, 6, 1) TILE(T, LOAD, 7, 1) TILE(T, LOAD, 8, 1) TILE(T, LOAD, 9, 1)          \
    TILE(T, LOAD, 10, 1) TILE(T, LOAD, 11, 1) TILE(T, LOAD, 12, 1)                                               \
    typedef void (*tile_##LOAD)(const float *, const T *, float *, long, long, long);                          \
    static const tile_##LOAD WIDE_##LOAD[CHUNK + 1] = {                                                          \
        0, tile_##LOAD##_1_8, tile_##LOAD##_2_4, tile_##LOAD##_3_3, tile_##LOAD##_4_3, tile_##LOAD##_5_2,        \
        tile_##LOAD##_6_2, tile_##LOAD##_7_1, tile_##LOAD##_8_1, tile_##LOAD##_9_1, tile_##LOAD##_10_1,          \
        tile_##LOAD##_11_1, tile_##LOAD##_12_1};                                                                 \
    static const tile_##LOAD NARROW_##LOAD[CHUNK + 1] = {                                                        \
        0, tile_##LOAD##_1_1, tile_##LOAD##_2_1, tile_##LOAD##_3_1, tile_##LOAD##_4_1, tile_##LOAD##_5_1,        \
        tile_##LOAD##_6_1, tile_##LOAD##_7_1, tile_##LOAD##_8_1, tile_##LOAD##_9_1, tile_##LOAD##_10_1,          \
        tile_##LOAD##_11_1, tile_##LOAD##_12_1};                                                                 \
    /* Rows [n0, n1) of the output for all M input rows, in chunks of at most 12 input rows. */                 \
    static void block_##LOAD(const float *x, const T *w, float *y, long M, long K, long N, long n0, long n1) {  \
        long kv = K - K % 8;                                                                                     \
        for (long m0 = 0; m0 < M; m0 += CHUNK) {                                                                 \
            int m = M - m0 < CHUNK ? (int)(M - m0) : CHUNK;                                                      \
            const float *xm = x + m0 * K;                                                                        \
            float *ym = y + m0 * N;                                                                              \
            long n = n0;                                                                                         \
            for (; n + WIDTH[m] <= n1; n += WIDTH[m]) WIDE_##LOAD[m](xm, w + n * K, ym + n, K, N, kv);          \
            for (; n < n1; n++) NARROW_##LOAD[m](xm, w + n * K, ym + n, K, N, kv);                              \
        }                                                                                                        \
    }

static const int WIDTH[CHUNK + 1] = {0, 8, 4, 3, 3, 2, 2, 1, 1, 1, 1, 1, 1};
KERNELS(float, load_f32)
KERNELS(signed char, load_i8)

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

int skinny_linear(const float *x, const float *w, const float *bias, float *y, long M, long K, long N,
                  int threads) {
    if (M < 1 || K < 1 || N < 1) return -1;
    long size = block_rows(N, threads), blocks = (N + size - 1) / size;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long b = 0; b < blocks; b++) {
        long n0 = b * size, n1 = n0 + size < N ? n0 + size : N;
        block_load_f32(x, w, y, M, K, N, n0, n1);
        finish(y, 0, bias, M, N, n0, n1);
    }
    return 0;
}

/* y[m, n] = scale[n] * sum_k x[m, k] * w[n, k] (+ bias[n]) with int8 weights w. */
int skinny_linear_i8(const float *x, const signed char *w, const float *scale, const float *bias, float *y, long M,
                     long K, long N, int threads) {
    if (M < 1 || K < 1 || N < 1) return -1;
    long size = block_rows(N, threads), blocks = (N + size - 1) / size;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long b = 0; b < blocks; b++) {
        long n0 = b * size, n1 = n0 + size < N ? n0 + size : N;
        block_load_i8(x, w, y, M, K, N, n0, n1);
        finish(y, scale, bias, M, N, n0, n1);
    }
    return 0;
}
