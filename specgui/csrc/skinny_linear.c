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

/* One tile: R weight rows from w (row stride K) times M input rows from x (row stride K). The input rows are
   read again at every step (12 rows of K floats at most: L1), which leaves the registers to R x M accumulators. */
#define TILE(M, R)                                                                                  \
    static void tile_##M##_##R(const float *x, const float *w, float *y, long K, long N, long kv) { \
        __m256 acc[R][M];                                                                           \
        for (int r = 0; r < R; r++)                                                                 \
            for (int m = 0; m < M; m++) acc[r][m] = _mm256_setzero_ps();                            \
        for (long k = 0; k < kv; k += 8) {                                                          \
            __m256 wv[R];                                                                           \
            for (int r = 0; r < R; r++) {                                                           \
                _mm_prefetch((const char *)(w + (r + R) * K + k + 64), _MM_HINT_T0);                  \
                wv[r] = _mm256_loadu_ps(w + r * K + k);                                             \
            }                                                                                       \
            for (int m = 0; m < M; m++) {                                                           \
                __m256 xv = _mm256_loadu_ps(x + m * K + k);                                         \
                for (int r = 0; r < R; r++) acc[r][m] = _mm256_fmadd_ps(wv[r], xv, acc[r][m]);      \
            }                                                                                       \
        }                                                                                           \
        for (int r = 0; r < R; r++)                                                                 \
            for (int m = 0; m < M; m++) {                                                           \
                float s = hsum(acc[r][m]);                                                          \
                for (long k = kv; k < K; k++) s += x[m * K + k] * w[r * K + k];                     \
                y[m * N + r] = s;                                                                   \
            }                                                                                       \
    }

/* R x M accumulators + R weight vectors + one input vector fit AVX2's 16 registers */
TILE(1, 8) TILE(1, 1) TILE(2, 4) TILE(2, 1) TILE(3, 3) TILE(3, 1) TILE(4, 3) TILE(4, 1)
TILE(5, 2) TILE(5, 1) TILE(6, 2) TILE(6, 1) TILE(7, 1) TILE(8, 1) TILE(9, 1) TILE(10, 1) TILE(11, 1) TILE(12, 1)

typedef void (*tile_fn)(const float *, const float *, float *, long, long, long);
static const tile_fn WIDE[CHUNK + 1] = {0, tile_1_8, tile_2_4, tile_3_3, tile_4_3, tile_5_2, tile_6_2, tile_7_1, tile_8_1,
                                        tile_9_1, tile_10_1, tile_11_1, tile_12_1};
static const tile_fn NARROW[CHUNK + 1] = {0, tile_1_1, tile_2_1, tile_3_1, tile_4_1, tile_5_1, tile_6_1, tile_7_1, tile_8_1,
                                          tile_9_1, tile_10_1, tile_11_1, tile_12_1};
static const int WIDTH[CHUNK + 1] = {0, 8, 4, 3, 3, 2, 2, 1, 1, 1, 1, 1, 1};

/* Rows [n0, n1) of the output for all M input rows, in chunks of at most 12 input rows. */
static void block(const float *x, const float *w, float *y, long M, long K, long N, long n0, long n1) {
    long kv = K - K % 8;
    for (long m0 = 0; m0 < M; m0 += CHUNK) {
        int m = M - m0 < CHUNK ? (int)(M - m0) : CHUNK;
        const float *xm = x + m0 * K;
        float *ym = y + m0 * N;
        long n = n0;
        for (; n + WIDTH[m] <= n1; n += WIDTH[m]) WIDE[m](xm, w + n * K, ym + n, K, N, kv);
        for (; n < n1; n++) NARROW[m](xm, w + n * K, ym + n, K, N, kv);
    }
}

int skinny_linear(const float *x, const float *w, const float *bias, float *y, long M, long K, long N,
                  int threads) {
    if (M < 1 || K < 1 || N < 1) return -1;
    /* blocks of 24, 48 or 96 weight rows (every tile width divides them): the largest that still gives each
       thread four blocks, so that a 192-row projection splits evenly over two threads */
    long size = BLOCK;
    while (size < 4 * BLOCK && N / (2 * size) >= 4L * threads) size *= 2;
    long blocks = (N + size - 1) / size;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long b = 0; b < blocks; b++) {
        long n0 = b * size, n1 = n0 + size < N ? n0 + size : N;
        block(x, w, y, M, K, N, n0, n1);
        if (bias)
            for (long m = 0; m < M; m++)
                for (long n = n0; n < n1; n++) y[m * N + n] += bias[n];
    }
    return 0;
}
