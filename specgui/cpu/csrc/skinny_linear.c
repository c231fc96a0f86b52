/* y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for a few rows m: SpecGUI's CPU verify kernel.
 *
 * Why (specgui/kernels.py has the measurements): a decoding step multiplies 1-64 rows by every weight
 * matrix once, so it is bound by streaming the weights from memory, and a forward over a few rows could
 * cost about what one row costs. BLAS libraries tuned for large products handle these skinny shapes as
 * separate matrix-vector products or with packing overheads, so their cost grows with every row. Here
 * each block of weight rows is read from memory once (then stays in L2) and up to 12 input rows (AVX-512; 32 with
 * AVX2's fp32, `F32_PASSES`) are multiplied against it in one pass, in register tiles of R weight rows x M input rows, one
 * vector wide
 * (16 floats with AVX-512, 8 with AVX2 + FMA), while the weight rows two tiles ahead are prefetched into L2. The
 * tiles keep only accumulators and the current weight vectors in registers and read the input rows again at every
 * step, from L1. Prefetching into L2 two tiles ahead instead of into L1 one tile ahead (AMD EPYC, two threads,
 * all products of a forward, least of 10): 1 row 21.6 -> 19.8 ms, 4 rows 24.0 -> 20-22, 8 rows 26.6 -> 20-26;
 * whole forwards at a 128-token context, two builds alternating in one process: 8 rows 1.13x one row where
 * prefetching into L1 from 7 rows on gave 1.48x. Before AVX-512 (same machine, every product of a SmolLM2-135M
 * forward, fp32) AVX2's 16 registers allowed one weight row per tile from 7 rows on (an input load for every
 * multiply-add): 8 rows cost 24 ms against one row's 15; AVX-512's 32 registers take 3 weight rows at 8 rows: 21.7 ms.
 * AVX2 now takes 7 rows or more in groups of at most 4 against 3 weight rows, a piece of the input width at a time
 * (`GROUPED`): the input rows stay in L1 and one pass takes up to 32 rows.
 *
 * The vector form is the build's: kernels.py builds one library per form (`SPECGUI_SIMD`, else the best the CPU
 * has), so an AVX-512 machine can run and test the AVX2 form a laptop runs.
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
 * A whole decoder layer (`layer_attention_in`, `layer_attention_out`, `layer_mlp`, at the end of this file) runs on
 * these products with the rest of the layer in C, over the target's fp32 weights or Fractal's int8 copy: see there.
 *
 * Threads: OpenMP over weight-row blocks; loaded into a process where torch already holds libgomp, it
 * shares torch's thread pool.
 */
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define BLOCK 24 /* every tile width (8, 6, 4, 3, 2, 1) divides it */
#define MAX_HEAD_DIM 256 /* the widest attention head the C layer takes (specgui/cpu_layers.py checks it) */

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
/* whether an M x R tile holds each weight vector in a register (see `TILE`): where all of them fit */
#define PINNED(M, R) ((M) > 1 && (R) * ((M) + 1) + 1 <= 32)
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
/* The sums of LANES vectors, one a lane, each in `hsum`'s order (bit-equal to it: tested): halves of 256 bits, of
   128, pairs, neighbours, four vectors' worth a shuffle. Inputs taken in the order that leaves column j in lane j. */
static inline vec hsums(const vec *w) {
    vec v[16], a[8], b[4], c[2];
    for (int i = 0; i < 16; i++) v[i] = w[(i % 4) * 4 + i / 4];
    for (int i = 0; i < 8; i++)
        a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44), _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
}
/* The last steps of `transpose_lanes`: 128-bit quarters of t moved into place in r, twice */
static inline void transpose_quarters(vec *r, vec *t) {
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0x88);
        t[4 + i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0xDD);
        t[8 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0x88);
        t[12 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0xDD);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
        r[4 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0x88);
        r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xDD);
        r[12 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0xDD);
    }
}
#define MM(op) _mm512_##op
#define vbits _mm512_castsi512_ps
static inline vec vround(vec x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
#else
typedef __m256 vec;
#define LANES 8
#define PINNED(M, R) 0 /* measured slower at 2 rows with AVX2 (see `TILE`) */
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
static inline vec hsums(const vec *w) {
    vec v[8], a[4], b[2];
    for (int i = 0; i < 8; i++) v[i] = w[(i % 2) * 4 + i / 2];
    for (int i = 0; i < 4; i++)
        a[i] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x20),
                             _mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x31));
    for (int i = 0; i < 2; i++)
        b[i] = _mm256_add_ps(_mm256_shuffle_ps(a[2 * i], a[2 * i + 1], 0x44), _mm256_shuffle_ps(a[2 * i], a[2 * i + 1], 0xEE));
    return _mm256_add_ps(_mm256_shuffle_ps(b[0], b[1], 0x88), _mm256_shuffle_ps(b[0], b[1], 0xDD));
}
/* The last step of `transpose_lanes`: 128-bit halves of r swapped into place */
static inline void transpose_quarters(vec *r, vec *t) {
    for (int i = 0; i < 4; i++) {
        t[i] = _mm256_permute2f128_ps(r[i], r[4 + i], 0x20);
        t[4 + i] = _mm256_permute2f128_ps(r[i], r[4 + i], 0x31);
    }
    for (int i = 0; i < 8; i++) r[i] = t[i];
}
#define MM(op) _mm256_##op
#define vbits _mm256_castsi256_ps
static inline vec vround(vec x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
#endif
#define vset1 MM(set1_ps)
#define vstore MM(storeu_ps)
#define vadd MM(add_ps)
#define vmul MM(mul_ps)
#define vmax MM(max_ps)
#define vmin MM(min_ps)
#define vsub MM(sub_ps)
#define vdiv MM(div_ps)
/* In place: r[c] lane l -> r[l] lane c, a LANES x LANES block transposed: neighbouring pairs, then quads within each
   128 bits, then the 128-bit parts (`transpose_quarters`, per vector width) */
static inline void transpose_lanes(vec *r) {
    vec t[LANES];
    for (int i = 0; i < LANES / 2; i++) {
        t[2 * i] = MM(unpacklo_ps)(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = MM(unpackhi_ps)(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < LANES / 4; i++) {
        r[4 * i] = MM(shuffle_ps)(t[4 * i], t[4 * i + 2], 0x44);
        r[4 * i + 1] = MM(shuffle_ps)(t[4 * i], t[4 * i + 2], 0xEE);
        r[4 * i + 2] = MM(shuffle_ps)(t[4 * i + 1], t[4 * i + 3], 0x44);
        r[4 * i + 3] = MM(shuffle_ps)(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    transpose_quarters(r, t);
}
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

/* One tile: R weight rows from w (row stride K, element type T) times M input rows from x (row stride K), into y
   (row stride ldy: a product may fill some columns of a wider output). The input rows are read again at every step
   (12 rows of K floats at most: L1 or L2), which leaves the registers to R x M accumulators and R weight vectors.
   Each input vector is loaded once into a register for its R multiply-adds: left to itself GCC folds the load into
   every multiply-add instead (an 8-row tile then issued 24 loads of inputs per step where 8 do), and on an AMD EPYC
   (two threads, the embedded model at a 128-token context, two builds alternating in one process, medians of 12)
   a forward over 8 rows cost 29.95 ms with the folded loads and 22.60 with one load each, 12 rows 43.52 and 35.55,
   a compressed 8-row pass 25.66 and 20.62; one row 18.09 and 18.26. The same numbers bit for bit. Each weight vector
   is likewise held in a register for its M multiply-adds wherever the tile's registers hold them all: GCC folded the
   3-row tile's weight loads into its multiply-adds (three loads of each weight vector a step), and on an AMD EPYC (two
   threads, builds alternating in one process, the embedded model at a 150-token context, five runs) a 3-row forward
   cost 15.0-16.6 ms against 13.1-14.5 with one load each; other row counts as before. One row keeps the folded load
   (each weight meets one multiply-add), and so does the AVX2 build (`PINNED`), where the held weights made a 2-row
   forward slower on the same machine (15.1-15.7 ms against 16.2-16.5). */
#define TILE(T, LOAD, M, R)                                                                              \
    static void tile_##LOAD##_##M##_##R(const float *x, const T *w, float *y, long K, long ldy, long kv) { \
        vec acc[R][M];                                                                                   \
        for (int r = 0; r < R; r++)                                                                      \
            for (int m = 0; m < M; m++) acc[r][m] = vzero();                                             \
        for (long k = 0; k < kv; k += LANES) {                                                           \
            vec wv[R];                                                                                   \
            for (int r = 0; r < R; r++) {                                                                \
                _mm_prefetch((const char *)(w + (r + 2 * R) * K + k), _MM_HINT_T1);                       \
                wv[r] = LOAD(w + r * K + k);                                                             \
                if (PINNED(M, R)) __asm__("" : "+v"(wv[r])); /* see above the macro */                      \
            }                                                                                            \
            for (int m = 0; m < M; m++) {                                                                \
                vec xv = vload(x + m * K + k);                                                           \
                __asm__("" : "+v"(xv)); /* held in a register: see above the macro */                  \
                for (int r = 0; r < R; r++) acc[r][m] = vfma(wv[r], xv, acc[r][m]);                      \
            }                                                                                            \
        }                                                                                                \
        for (int r = 0; r < R; r++)                                                                      \
            for (int m = 0; m < M; m++) {                                                                \
                float s = hsum(acc[r][m]);                                                               \
                for (long k = kv; k < K; k++) s += x[m * K + k] * one_##LOAD(w[r * K + k]);            \
                y[m * ldy + r] = s;                                                                      \
            }                                                                                            \
    }

/* Per input-row count M (1..TILE_ROWS), the widest tile whose R x M accumulators, R weight vectors and one input
   vector fit the registers (R dividing BLOCK): WIDE_* names them, NARROW_* the one-weight-row tiles for a block's
   leftover rows. AVX-512 has 32 registers: 8 rows x 3 weight rows take 28 of them, where AVX2's 16 allow 8 x 1,
   which loads an input vector for every multiply-add; AVX2 therefore takes fp32 products of 7 rows or more in
   groups instead (`GROUPED`), and its fp32 tables stop at 6 rows. A weight type's tables run to the most rows it
   takes in tiles (`KERNELS`' TILED: 6 or 12), each table's names listed by `*_NAMES_6` or `*_NAMES_12`. */
#define TILE_ROWS 12
#define ALL_TILES TILE_ROWS, TILE_ROWS, NO_GROUPS /* KERNELS' passes: every pass in tiles */
#define NARROW_6(T, LOAD)                                                                                        \
    TILE(T, LOAD, 1, 1) TILE(T, LOAD, 2, 1) TILE(T, LOAD, 3, 1) TILE(T, LOAD, 4, 1) TILE(T, LOAD, 5, 1)          \
    TILE(T, LOAD, 6, 1)
#define NARROW_12(T, LOAD)                                                                                       \
    NARROW_6(T, LOAD) TILE(T, LOAD, 7, 1) TILE(T, LOAD, 8, 1) TILE(T, LOAD, 9, 1) TILE(T, LOAD, 10, 1)           \
    TILE(T, LOAD, 11, 1) TILE(T, LOAD, 12, 1)
#define NARROW_NAMES_6(LOAD)                                                                                     \
    tile_##LOAD##_1_1, tile_##LOAD##_2_1, tile_##LOAD##_3_1, tile_##LOAD##_4_1, tile_##LOAD##_5_1, tile_##LOAD##_6_1
#define NARROW_NAMES_12(LOAD)                                                                                    \
    NARROW_NAMES_6(LOAD), tile_##LOAD##_7_1, tile_##LOAD##_8_1, tile_##LOAD##_9_1, tile_##LOAD##_10_1,           \
        tile_##LOAD##_11_1, tile_##LOAD##_12_1
#ifdef __AVX512F__
#define WIDE_TILES(T, LOAD)                                                                                      \
    TILE(T, LOAD, 1, 8) TILE(T, LOAD, 2, 8) TILE(T, LOAD, 3, 6) TILE(T, LOAD, 4, 6) TILE(T, LOAD, 5, 4)          \
    TILE(T, LOAD, 6, 4) TILE(T, LOAD, 7, 3) TILE(T, LOAD, 8, 3) TILE(T, LOAD, 9, 3) TILE(T, LOAD, 10, 2)         \
    TILE(T, LOAD, 11, 2) TILE(T, LOAD, 12, 2)
#define WIDE_NAMES_12(LOAD)                                                                                      \
    tile_##LOAD##_1_8, tile_##LOAD##_2_8, tile_##LOAD##_3_6, tile_##LOAD##_4_6, tile_##LOAD##_5_4,               \
        tile_##LOAD##_6_4, tile_##LOAD##_7_3, tile_##LOAD##_8_3, tile_##LOAD##_9_3, tile_##LOAD##_10_2,          \
        tile_##LOAD##_11_2, tile_##LOAD##_12_2
static const int WIDTH[TILE_ROWS + 1] = {0, 8, 8, 6, 6, 4, 4, 3, 3, 3, 2, 2, 2};
#define F32_PASSES ALL_TILES
#else
#define WIDE_TILES(T, LOAD)                                                                                      \
    TILE(T, LOAD, 1, 8) TILE(T, LOAD, 2, 4) TILE(T, LOAD, 3, 3) TILE(T, LOAD, 4, 3) TILE(T, LOAD, 5, 2)          \
    TILE(T, LOAD, 6, 2)
#define WIDE_NAMES_6(LOAD)                                                                                       \
    tile_##LOAD##_1_8, tile_##LOAD##_2_4, tile_##LOAD##_3_3, tile_##LOAD##_4_3, tile_##LOAD##_5_2, tile_##LOAD##_6_2
#define WIDE_NAMES_12(LOAD)                                                                                      \
    WIDE_NAMES_6(LOAD), tile_##LOAD##_7_1, tile_##LOAD##_8_1, tile_##LOAD##_9_1, tile_##LOAD##_10_1,             \
        tile_##LOAD##_11_1, tile_##LOAD##_12_1
static const int WIDTH[TILE_ROWS + 1] = {0, 8, 4, 3, 3, 2, 2, 1, 1, 1, 1, 1, 1};
/* fp32: tiles up to 6 rows, groups in passes of up to 32 rows from 7 on (a verify of up to 32 rows reads each weight
   from memory once, where passes of at most 12 rows in 8 x 1 or 12 x 1 tiles read them again from 13 rows on) */
#define F32_PASSES 6, GROUPED_ROWS, GROUPED_PASS
#endif
#define NO_GROUPS(LOAD, x, w, y, M, K, ldy, kv, n0, n1) /* never reached: passes are no wider than the tiles */

#ifndef __AVX512F__
/* AVX2 from 7 input rows on: a tile of 3 weight rows takes the rows in groups of at most GROUP_ROWS (as even as
   they go: 8 as 4 + 4, 7 as 4 + 3), each group a 4 x 3 register tile at most (12 accumulators, 3 weight vectors
   and one input vector: the 16 registers), one group after another over a piece of the input width, the
   accumulators kept in memory between pieces and reduced by the last piece's call, 8 at a time (`hsums`, each in
   `hsum`'s order); the weight rows' piece is read from memory by the first group and from L1 by the others. A
   piece is as wide as lets all the tile's input rows fill half of L1 (`input_piece`), so inputs are read from L1,
   not L2, however wide the rows (the down product's 1536) and however many (up to 32). Every output's lanes still
   add its k in order, piece after piece: the same sums as a tile over the whole width, bit for bit (tested against
   one-row products).
   Measured on an Intel Xeon (AVX-512 machine, AVX2 build): with 8 x 1 or 12 x 1 tiles, then 8 x 1 twice for 16 rows,
   against groups (one thread, weights in L2, vector multiply-adds a second): 96 x 1536 weights 3.5 -> 4.1 G at
   8 rows, 2.7-2.8 -> 4.1-4.4 at 12, 3.6 -> 4.2-4.4 at 16. Groups of 6 x 2 instead of 4 x 3: slower (1536 x 576 and
   576 x 1536 weights from memory at 8, 12 and 16 rows, one thread: 2.2 against 2.3 ms in all); passes of 4 or 6
   rows over the block instead of groups: a 16-row forward's products 80 -> 99 and 87 ms. No tile shape that fits 16 registers passes
   ~5.3 G a second on that CPU (4 x 3, 6 x 2, 3 x 4 holding the inputs, in L1), where multiply-adds alone reach 8.8:
   16 rows are bound by arithmetic, ~4.5 G a thread with the weights in L2, less from memory (below). The same
   groups for AVX-512 (8 x 3, from 13 rows on) were slower than its passes of tiles: 96 x 576 at 16 rows
   3.4 -> 2.7 G, so AVX-512 keeps them.
   Prefetching: the weight rows two tiles ahead, into L2, each 64-byte line once a tile, not a prefetch a step: a
   line a step (one thread, every product of a forward, medians of 7) cost 82.9 against 76.6 ms at 16 rows, 53.5
   against 47.8 at 8. With three groups or more, group g fetches the lines j with j % groups == g; with two, both
   fetch every line. On the same machine, 1536 x 576 weights from memory (one thread, least of 5): 16 rows 0.47 ms
   with every group fetching every line, 0.43 with each line fetched once; 8 rows 0.28 against 0.34, the other way;
   whole 16-row forwards at a 128-token context (two threads, least of 12, builds alternating): 44.3 -> 39.2 ms,
   12 rows 34.0 -> 30.7, one row 22.7 -> 22.5. Prefetching further ahead (1-16 tiles), into L1, a line in two or
   four, in address order rather than row by row, in bursts at a group's start, or copying the tile's piece into a
   buffer first: none faster.
   Why 16 rows stay above 1.6 one-row forwards on that Xeon (two threads, weights aligned by specgui/arena.py): one row
   streams the weights at a core's limit (plain vector loads over 538 MB: 14-16 GB/s on one thread, 29-30 on two; a
   one-row forward's products 26-28 GB/s), and 16 rows at the FMA units' peak (2 x 8 floats a cycle) consume 4 bytes
   of weights a cycle, ~14 GB/s: both at their limit at once. A loop of 16 multiply-adds a streamed weight vector
   (12 accumulators, no input loads at all) ran 6.9 G a second with its weights in L1 and 5.2 streamed, prefetched
   ahead into L2 or L1. Timed inside a 16-row forward at a 128-token context, its products took 35.2 ms (layers 28.3,
   head 6.9) against 22.0 for the whole one-row forward, attention 2.6 and SiLU 0.5 more. */
#define GROUP_ROWS 4
#define GROUPED_ROWS 32 /* the most input rows of a grouped pass (`F32_PASSES`) */
#define LINE_FLOATS (64 / (long)sizeof(float))
/* What one group's call covers: the vector part [k0, k1) of the input width K (kv its vector part: the call whose
   k1 is kv reduces), the accumulators' row stride lda, the output's ldy, and the lines it prefetches: those j with
   j % every == phase */
struct span {
    long K, kv, k0, k1, lda, ldy, phase, every;
};
#define GROUP(T, LOAD, M, R)                                                                             \
    static void group_##LOAD##_##M##_##R(const float *x, const T *w, vec *acc, float *y,                \
                                         const struct span *s) {                                         \
        long K = s->K, k1 = s->k1, every = s->every, line = (s->k0 + LINE_FLOATS - 1) / LINE_FLOATS;     \
        long fetch = (line + ((s->phase - line) % every + every) % every) * LINE_FLOATS; /* its next */  \
        vec a[R][M];                                                                                     \
        if (s->k0 == 0)                                                                                  \
            for (int r = 0; r < R; r++)                                                                  \
                for (int m = 0; m < M; m++) a[r][m] = vzero();                                           \
        else                                                                                             \
            for (int r = 0; r < R; r++)                                                                  \
                for (int m = 0; m < M; m++) a[r][m] = acc[r * s->lda + m];                               \
        for (long k = s->k0; k < k1; k += LANES) {                                                       \
            int ahead = k == fetch;                                                                      \
            fetch += ahead ? LINE_FLOATS * every : 0;                                                    \
            vec wv[R];                                                                                   \
            for (int r = 0; r < R; r++) {                                                                \
                if (ahead) _mm_prefetch((const char *)(w + (r + 2 * R) * K + k), _MM_HINT_T2);           \
                wv[r] = LOAD(w + r * K + k);                                                             \
                __asm__("" : "+v"(wv[r])); /* one load a step: see above `TILE` */                        \
            }                                                                                            \
            for (int m = 0; m < M; m++) {                                                                \
                vec xv = vload(x + m * K + k);                                                           \
                __asm__("" : "+v"(xv));                                                                  \
                for (int r = 0; r < R; r++) a[r][m] = vfma(wv[r], xv, a[r][m]);                          \
            }                                                                                            \
        }                                                                                                \
        if (k1 < s->kv) {                                                                                \
            for (int r = 0; r < R; r++)                                                                  \
                for (int m = 0; m < M; m++) acc[r * s->lda + m] = a[r][m];                               \
            return;                                                                                      \
        }                                                                                                \
        enum { SUMS = (R * M + LANES - 1) / LANES * LANES };                                             \
        vec v[SUMS];                                                                                     \
        float sums[SUMS];                                                                                \
        for (int i = 0; i < SUMS; i++) v[i] = i < R * M ? a[i / M][i % M] : vzero();                     \
        for (int i = 0; i < SUMS; i += LANES) vstore(sums + i, hsums(v + i));                            \
        for (int r = 0; r < R; r++)                                                                      \
            for (int m = 0; m < M; m++) {                                                                \
                float sum = sums[r * M + m];                                                             \
                for (long k = s->kv; k < K; k++) sum += x[m * K + k] * one_##LOAD(w[r * K + k]);        \
                y[m * s->ldy + r] = sum;                                                                 \
            }                                                                                            \
    }
/* R weight rows (3, or 1 for a block's leftover rows) times M input rows (6 < M <= GROUPED_ROWS) */
#define GROUPED(T, LOAD, R)                                                                              \
    GROUP(T, LOAD, 1, R) GROUP(T, LOAD, 2, R) GROUP(T, LOAD, 3, R) GROUP(T, LOAD, 4, R)                  \
    static void (*const GROUPS_##LOAD##_##R[GROUP_ROWS + 1])(const float *, const T *, vec *, float *,  \
                                                              const struct span *) = {                   \
        0, group_##LOAD##_1_##R, group_##LOAD##_2_##R, group_##LOAD##_3_##R, group_##LOAD##_4_##R};     \
    static void grouped_##LOAD##_##R(const float *x, const T *w, float *y, long M, long K, long ldy, long kv) { \
        vec acc[R * GROUPED_ROWS];                                                                       \
        long piece = input_piece(M, kv), groups = (M + GROUP_ROWS - 1) / GROUP_ROWS;                      \
        long size = (M + groups - 1) / groups;                                                           \
        struct span s = {K, kv, 0, 0, M, ldy, 0, groups > 2 ? groups : 1};                               \
        do { /* at least once: a row narrower than a vector is all tail */                               \
            s.k1 = s.k0 + piece < kv ? s.k0 + piece : kv;                                                \
            for (long m0 = 0; m0 < M; m0 += size) {                                                      \
                s.phase = groups > 2 ? m0 / size : 0;                                                    \
                GROUPS_##LOAD##_##R[M - m0 < size ? M - m0 : size](x + m0 * K, w, acc + m0, y + m0 * ldy, &s); \
            }                                                                                            \
            s.k0 = s.k1;                                                                                 \
        } while (s.k0 < kv);                                                                             \
    }

/* The width of a piece of the input rows (`GROUPED`): the whole vector part kv in as few equal pieces (whole
   vectors) as keep M rows of it within half of L1 (the other half for the weight rows' piece and what streams
   through: an AMD EPYC's 32 KB L1 holds 8 rows of 512 floats). Half of Intel's 48 KB, 24 KB, measured 2-5% faster
   than 16 KB there (the Intel Xeon above), and 1-2% faster than the whole width (36 KB at 16 rows of 576). */
static long half_l1; /* bytes, set by `run` before its threads start (sysconf; 32 KB where it does not say) */
static long input_piece(long M, long kv) {
    long most = half_l1 / (long)sizeof(float) / M / LANES * LANES;
    if (kv < 1 || most < LANES) return LANES;
    long pieces = (kv + most - 1) / most;
    return ((kv + pieces - 1) / pieces + LANES - 1) / LANES * LANES;
}
#endif

/* The tiles and the block of a weight type: products of TILED input rows or fewer in tiles, of more in GROUPS (a
   pass macro), in passes of at most PASS rows */
#define KERNELS(T, LOAD, TILED, PASS, GROUPS)                                                                    \
    NARROW_##TILED(T, LOAD)                                                                                      \
    typedef void (*tile_##LOAD)(const float *, const T *, float *, long, long, long);                          \
    WIDE_TILES(T, LOAD)                                                                                          \
    static const tile_##LOAD WIDE_##LOAD[TILED + 1] = {0, WIDE_NAMES_##TILED(LOAD)};                            \
    static const tile_##LOAD NARROW_##LOAD[TILED + 1] = {0, NARROW_NAMES_##TILED(LOAD)};                        \
    /* Rows [n0, n1) of the output for all M input rows, in the fewest passes of at most PASS input rows, as     \
       even as they go: 13 rows as 7 + 6, not 12 + 1 (all the products of a forward, AMD EPYC, two threads,      \
       AVX-512: 35.8 ms as 12 + 1, 32.8 as 7 + 6, 31.5 for 12 rows); a pass of `narrow` input rows or fewer in   \
       one-weight-row tiles (`narrow_rows`). */                                                                 \
    static void block_##LOAD(const float *x, const T *w, float *y, long M, long K, long ldy, long n0, long n1,     \
                              int narrow) {                                                                     \
        long kv = K - K % LANES;                                                                                 \
        long passes = (M + PASS - 1) / PASS, chunk = (M + passes - 1) / passes;                                  \
        for (long m0 = 0; m0 < M; m0 += chunk) {                                                                 \
            int m = M - m0 < chunk ? (int)(M - m0) : (int)chunk;                                                 \
            const float *xm = x + m0 * K;                                                                        \
            float *ym = y + m0 * ldy;                                                                            \
            if (m > TILED) {                                                                                     \
                GROUPS(LOAD, xm, w, ym, m, K, ldy, kv, n0, n1)                                                   \
                continue;                                                                                        \
            }                                                                                                    \
            long n = n0;                                                                                         \
            for (; m > narrow && n + WIDTH[m] <= n1; n += WIDTH[m]) WIDE_##LOAD[m](xm, w + n * K, ym + n, K, ldy, kv);\
            for (; n < n1; n++) NARROW_##LOAD[m](xm, w + n * K, ym + n, K, ldy, kv);                            \
        }                                                                                                        \
    }
#define KERNELS_OF(...) KERNELS(__VA_ARGS__) /* the passes' macro expanded into its three arguments first */

#ifndef __AVX512F__
GROUPED(float, load_f32, 3)
GROUPED(float, load_f32, 1)
#define GROUPED_PASS(LOAD, x, w, y, M, K, ldy, kv, n0, n1)                                              \
    {                                                                                                    \
        long n = n0;                                                                                     \
        for (; n + 3 <= n1; n += 3) grouped_##LOAD##_3(x, w + n * K, y + n, M, K, ldy, kv);              \
        for (; n < n1; n++) grouped_##LOAD##_1(x, w + n * K, y + n, M, K, ldy, kv);                      \
    }
#endif
KERNELS_OF(float, load_f32, F32_PASSES)
/* bf16 and int8 weights keep AVX2's tiles and passes of 12: their groups widened each weight vector once a group
   instead of once a tile, and all the products of a forward (Intel Xeon, AVX2 build, one thread, least of 5) cost
   more at 8 and 12 rows: bf16 40.9 -> 43.4 ms and 56.2 -> 60.4, int8 35.3 -> 38.5 and 54.2 -> 57.0. */
KERNELS_OF(signed char, load_i8, ALL_TILES)
KERNELS_OF(unsigned short, load_bf16, ALL_TILES)

/* Blocks of 24, 48 or 96 weight rows (every tile width divides them): the largest that still gives each thread
   four blocks, so that a 192-row projection splits evenly over two threads. */
static long block_rows(long N, int threads) {
    long size = BLOCK;
    while (size < 4 * BLOCK && N / (2 * size) >= 4L * threads) size *= 2;
    return size;
}

/* Each output row's scale (int8 weights; none for fp32), then its bias. */
static void finish(float *y, const float *scale, const float *bias, long M, long ldy, long n0, long n1) {
    for (long m = 0; m < M; m++)
        for (long n = n0; n < n1; n++) {
            if (scale) y[m * ldy + n] *= scale[n];
            if (bias) y[m * ldy + n] += bias[n];
        }
}

enum weights { F32, I8, BF16 };

/* Input rows up to which a product streams one weight row a tile (`block_*`), where the tile tables would hold several
   (AMD EPYC, two threads, builds alternating in one process):
   * one row of fp32 or bf16 weights: a one-row forward of the embedded model 13.9-14.5 ms with 8 weight rows a tile,
     12.4-13.0 with one (AVX2 build: 10.8-11.0 and 9.5), plain decoding of 7 held-out prompts x 48 tokens 7.6-8.3 s
     and 7.4-7.6, every bf16 product of a forward 4.1 against 3.5-3.6 ms; at 2 rows one weight row a tile was slower
     (a forward 13.1-13.4 against 11.8-12.1 ms);
   * up to STREAM_ROWS rows of a weight of at least STREAM_WEIGHTS elements (in practice the LM head: SmolLM2's 28M, a
     layer's largest 0.9M): the head alone 1.80 -> 1.48 ms at 2 rows, 2.07 -> 1.68 at 3, 2.11 -> 1.94 at 4, whole
     forwards of 2-4 rows 1-4% faster in both of the machine's speed phases, where every weight so made 3- and 4-row
     forwards 20-40% slower;
   * int8 weights, widened in registers, none: one weight row a tile made their one-row products slower (2.7 ms
     against 1.9-2.0). */
#define STREAM_WEIGHTS (8L << 20)
#define STREAM_ROWS 4
static int narrow_rows(enum weights type, long N, long K) {
    if (type == I8) return 0;
    return N * K >= STREAM_WEIGHTS ? STREAM_ROWS : 1;
}

/* y = x w^T for M input rows and N weight rows (y's rows ldy apart), over blocks of weight rows spread across
   threads, then scales and bias. */
static int run(enum weights type, const float *x, const void *w, const float *scale, const float *bias, float *y,
               long M, long K, long N, long ldy, int threads) {
    if (M < 1 || K < 1 || N < 1) return -1;
    long size = block_rows(N, threads), blocks = (N + size - 1) / size;
    int narrow = narrow_rows(type, N, K);
#ifndef __AVX512F__
    if (!half_l1) {
        long l1 = sysconf(_SC_LEVEL1_DCACHE_SIZE);
        half_l1 = (l1 > 0 ? l1 : 32768) / 2;
    }
#endif
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long b = 0; b < blocks; b++) {
        long n0 = b * size, n1 = n0 + size < N ? n0 + size : N;
        if (type == I8)
            block_load_i8(x, w, y, M, K, ldy, n0, n1, narrow);
        else if (type == BF16)
            block_load_bf16(x, w, y, M, K, ldy, n0, n1, narrow);
        else
            block_load_f32(x, w, y, M, K, ldy, n0, n1, narrow);
        finish(y, scale, bias, M, ldy, n0, n1);
    }
    return 0;
}

int skinny_linear(const float *x, const float *w, const float *bias, float *y, long M, long K, long N, int threads) {
    return run(F32, x, w, 0, bias, y, M, K, N, N, threads);
}

/* y[m, n] = scale[n] * sum_k x[m, k] * w[n, k] (+ bias[n]) with int8 weights w. */
int skinny_linear_i8(const float *x, const signed char *w, const float *scale, const float *bias, float *y, long M,
                     long K, long N, int threads) {
    return run(I8, x, w, scale, bias, y, M, K, N, N, threads);
}

/* y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) with bfloat16 weights w (the upper half of an fp32, widened exactly by
   a shift): half of fp32's weight bytes streamed, products and sums in fp32, the same summation order. */
int skinny_linear_bf16(const float *x, const unsigned short *w, const float *bias, float *y, long M, long K, long N,
                       int threads) {
    return run(BF16, x, w, 0, bias, y, M, K, N, N, threads);
}

/* ---- A decoder layer on a CPU, in three calls --------------------------------------------------------------
 *
 * Why: over a few rows the products of a decoder layer are most of the arithmetic, yet as torch modules the layer's
 * ~25 small operations (norms, rotary, grouped attention, SiLU, residuals, each 3-50 us of dispatch) cost about a
 * third of a forward of SmolLM2-135M on an AMD EPYC (two threads): ~11 ms of ~32 for one row, before any product.
 * Here a pre-norm Llama layer is three calls, each a sub-layer or half of one:
 *   layer_attention_in   norm, q/k/v products, rotary: the caller hands the new keys and values to its cache
 *   layer_attention_out  attention over the cache, output product, residual
 *   layer_mlp            norm, gate/up products, SiLU, down product, residual
 *   layer_forward        the three, the new keys and values written into the cache's buffers in between
 *   layers_forward       consecutive layers' layer_forward in one call (what Python calls)
 * over weights of any of the products' types: the target model's own fp32 weights (specgui/cpu_layers.py installs it
 * on the model's decoder layers) and Fractal's int8 copy. Formulas are transformers' Llama ones (RMSNorm,
 * rotate-half rotary, softmax attention over grouped key/value heads, SiLU-gated MLP); sums are in this file's order.
 *
 * Every row's result depends only on its own input and the keys and values it sees, in column order: the products
 * are row-independent (above), norms and rotary work a row at a time, and attention first lists the columns a row
 * sees and then sums over that list, so a masked column changes nothing, not even which lane a later column lands
 * in. A verify forward's rows therefore equal the plain steps that would have produced the same tokens, bit for
 * bit, trees included: greedy speculative decoding reproduces plain decoding exactly. */

struct linear { /* one product of a layer: y = (x w^T) * scale + bias over `out` weight rows */
    int type; /* enum weights */
    const void *w;
    const float *scale; /* per weight row (int8), or none */
    const float *bias;  /* or none */
    long out;
};

struct layer {
    const float *in_norm, *post_norm;
    float in_eps, post_eps, scaling;
    long hidden, heads, kv_heads, head_dim, inner;
    struct linear q, k, v, o, gate, up, down;
};

/* Scratch memory per calling thread, grown as needed and kept: calls from different threads (two decodes side by
   side) never share it; the OpenMP workers of one call only read and write through its pointers. Arena 0 is a unit's
   own work space, arena 1 what `layer_forward` keeps between its units (a unit may grow arena 0 and move it). */
static __thread char *arenas[2];
static __thread size_t arena_bytes[2];
static void *scratch(int which, size_t bytes) {
    if (bytes > arena_bytes[which]) {
        free(arenas[which]);
        arenas[which] = malloc(bytes);
        arena_bytes[which] = arenas[which] ? bytes : 0;
    }
    return arenas[which];
}

static int apply(const struct linear *l, const float *x, float *y, long M, long K, long ldy, int threads) {
    return run((enum weights)l->type, x, l->w, l->scale, l->bias, y, M, K, l->out, ldy, threads);
}

/* e^x for finite x below 88 (below -87 taken as -87), a vector at a time: 2^n e^r with n = round(x / ln 2) and
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
    return vmul(p, vpow2(n));
}

static float dot(const float *a, const float *b, long n) {
    long nv = n - n % LANES;
    vec acc = vzero();
    for (long i = 0; i < nv; i += LANES) acc = vfma(vload(a + i), vload(b + i), acc);
    float s = hsum(acc);
    for (long i = nv; i < n; i++) s += a[i] * b[i];
    return s;
}

/* The LANES keys keys[0..LANES) lane by lane: kt[d LANES + c] = keys[c][d] for every d below D (a block of
   `scores`' layout) */
static void keys_by_lane(const float *const *keys, long D, float *kt) {
    long d = 0;
    for (; d + LANES <= D; d += LANES) {
        vec r[LANES];
        for (int c = 0; c < LANES; c++) r[c] = vload(keys[c] + d);
        transpose_lanes(r);
        for (int l = 0; l < LANES; l++) vstore(kt + (d + l) * LANES, r[l]);
    }
    for (; d < D; d++)
        for (int c = 0; c < LANES; c++) kt[d * LANES + c] = keys[c][d];
}

/* Attention scores in register tiles: s[p][b LANES + c] = scaling * (sum over d of q[p][d] k[d]) for NP queries
   against NB blocks of LANES keys (block b at kt + b D LANES, `keys_by_lane`'s layout), each key's sum one lane
   adding d in order (fused multiply-adds): a score depends on its query and key alone, whatever shares the tile. A
   tile holds NP x NB sums, NB key vectors and a query's broadcast in registers, and loads NB + NP values a step for
   NP x NB multiply-adds, where one query against one block of keys loaded two (a broadcast and a key vector) for
   each, in `hsum`'s order (lanes of d, then a tree). Intel Xeon, two threads, 30 layers' attention jobs alone (C
   harness, SmolLM2's heads): AVX2 over 1024 cached columns 16 rows 15.0 -> 11.2 ms, 8 rows 7.7 -> 5.9, one row
   1.62 -> 1.50, 16 rows over 128 columns 2.13 -> 1.79; AVX-512 over 1024, 16 rows 8.3 -> 6.9, 8 rows 4.6 -> 4.0.
   Whole forwards over 1024 cached tokens (builds alternating in one process, medians of 11): AVX2 16 rows
   59.6 -> 54.6 ms, 8 rows 37.6 -> 35.5; AVX-512 16 rows 46.1 -> 43.8, 8 rows 32.0 -> 31.5; over 128, within noise. */
#ifdef __AVX512F__
#define SCORE_PAIRS 8
#else
#define SCORE_PAIRS 4
#endif
#define SCORE_BLOCKS 3
#define SCORES(NP, NB)                                                                                       \
    static void scores_##NP##_##NB(const float *const *q, const float *kt, long D, float scaling,          \
                                   float (*s)[SCORE_BLOCKS * LANES]) {                                     \
        vec acc[NP][NB];                                                                                     \
        for (int p = 0; p < NP; p++)                                                                         \
            for (int b = 0; b < NB; b++) acc[p][b] = vzero();                                                \
        for (long d = 0; d < D; d++) {                                                                       \
            vec k[NB];                                                                                       \
            for (int b = 0; b < NB; b++) k[b] = vload(kt + (b * D + d) * LANES);                             \
            for (int p = 0; p < NP; p++) {                                                                   \
                vec qv = vset1(q[p][d]);                                                                     \
                for (int b = 0; b < NB; b++) acc[p][b] = vfma(qv, k[b], acc[p][b]);                          \
            }                                                                                                \
        }                                                                                                    \
        for (int p = 0; p < NP; p++)                                                                         \
            for (int b = 0; b < NB; b++) vstore(s[p] + b * LANES, vmul(acc[p][b], vset1(scaling)));          \
    }
#define SCORES_NB(NP) SCORES(NP, 1) SCORES(NP, 2) SCORES(NP, 3)
#define SCORES_NAMES(NP) {scores_##NP##_1, scores_##NP##_2, scores_##NP##_3}
SCORES_NB(1) SCORES_NB(2) SCORES_NB(3) SCORES_NB(4)
#if SCORE_PAIRS == 8
SCORES_NB(5) SCORES_NB(6) SCORES_NB(7) SCORES_NB(8)
#endif
typedef void (*scores_fn)(const float *const *, const float *, long, float, float (*)[SCORE_BLOCKS * LANES]);
static const scores_fn SCORES_OF[SCORE_PAIRS + 1][SCORE_BLOCKS] = {
    {0}, SCORES_NAMES(1), SCORES_NAMES(2), SCORES_NAMES(3), SCORES_NAMES(4),
#if SCORE_PAIRS == 8
    SCORES_NAMES(5), SCORES_NAMES(6), SCORES_NAMES(7), SCORES_NAMES(8),
#endif
};

/* The scores of np pairs (their queries, their rows of scores) against the n columns from j on of keys k, listed by
   `list` (none: consecutive), in tiles of up to SCORE_PAIRS pairs and SCORE_BLOCKS blocks of LANES keys; a short
   last block repeats its first column. */
static void score_span(const float *const *queries, float *const *rows, long np, const float *k, const long *list,
                       long j, long n, long D, float scaling) {
    const float *keys[SCORE_BLOCKS * LANES];
    float kt[SCORE_BLOCKS * MAX_HEAD_DIM * LANES], out[SCORE_PAIRS][SCORE_BLOCKS * LANES];
    long blocks = (n + LANES - 1) / LANES;
    for (long i = 0; i < blocks * LANES; i++) {
        long column = j + (i < n ? i : 0);
        keys[i] = k + (list ? list[column] : column) * D;
    }
    for (long b = 0; b < blocks; b++) keys_by_lane(keys + b * LANES, D, kt + b * D * LANES);
    for (long q0 = 0; q0 < np; q0 += SCORE_PAIRS) {
        int tile = np - q0 < SCORE_PAIRS ? (int)(np - q0) : SCORE_PAIRS;
        SCORES_OF[tile][blocks - 1](queries + q0, kt, D, scaling, out);
        for (int i = 0; i < tile; i++) {
            float *to = rows[q0 + i] + j;
            long c = 0;
            for (; c + LANES <= n; c += LANES) vstore(to + c, vload(out[i] + c));
            for (; c < n; c++) to[c] = out[i][c];
        }
    }
}

/* In place: s[0..n) -> softmax(s), a vector at a time (max and division are exact in any order) */
static void softmax(float *s, long n) {
    long j = 0, nv = n - n % LANES;
    float top = -INFINITY, total, lanes[LANES];
    vec tops = vset1(-INFINITY);
    for (; j < nv; j += LANES) tops = vmax(tops, vload(s + j));
    vstore(lanes, tops);
    for (int l = 0; l < LANES; l++) top = lanes[l] > top ? lanes[l] : top;
    for (; j < n; j++) top = s[j] > top ? s[j] : top;
    vec sums = vzero(), shift = vset1(-top);
    for (j = 0; j < nv; j += LANES) {
        vec e = vexp(vadd(vload(s + j), shift));
        vstore(s + j, e);
        sums = vadd(sums, e);
    }
    total = hsum(sums);
    for (; j < n; j++) {
        s[j] = expf(s[j] - top);
        total += s[j];
    }
    vec totals = vset1(total);
    for (j = 0; j < nv; j += LANES) vstore(s + j, vdiv(vload(s + j), totals));
    for (; j < n; j++) s[j] /= total;
}

/* o[i][d] += p[i][j] v_j[d] for NP outputs over columns j in [j0, j1) in order (v_j = v + (list ? list[j] : j) D):
   each value vector is read once for all NP outputs (heads and rows sharing the column) and streamed in column
   order, prefetched a few columns ahead, while the NP outputs' sums stay in registers, SPAN vectors of d at a time
   (a 64-wide head in one span with AVX-512), then single vectors, then a scalar tail. Every o[i][d] is summed over
   j in order. */
#ifdef __AVX512F__
#define SPAN 4
#define VALUE_GROUP 5
#else
#define SPAN 2
#define VALUE_GROUP 4
#endif
#define VALUE_AHEAD 8 /* columns */
#define VALUE_COLUMN(j) (v + (list ? list[j] : (j)) * D)
/* the sums over d in [d, d + S LANES) of NP outputs, S vectors wide; d advances past them */
#define VALUE_SPANS(NP, S)                                                                                   \
    for (; d + S * LANES <= D; d += S * LANES) {                                                             \
        vec acc[NP][S];                                                                                      \
        for (int i = 0; i < NP; i++)                                                                         \
            for (int c = 0; c < S; c++) acc[i][c] = vload(o[i] + d + c * LANES);                             \
        for (long j = j0; j < j1; j++) {                                                                     \
            if (j + VALUE_AHEAD < j1)                                                                        \
                for (int c = 0; c < S * LANES; c += 16)                                                      \
                    _mm_prefetch((const char *)(VALUE_COLUMN(j + VALUE_AHEAD) + d + c), _MM_HINT_T0);        \
            vec x[S];                                                                                        \
            for (int c = 0; c < S; c++) x[c] = vload(VALUE_COLUMN(j) + d + c * LANES);                             \
            for (int i = 0; i < NP; i++) {                                                                   \
                vec pv = vset1(p[i][j]);                                                                     \
                for (int c = 0; c < S; c++) acc[i][c] = vfma(pv, x[c], acc[i][c]);                           \
            }                                                                                                \
        }                                                                                                    \
        for (int i = 0; i < NP; i++)                                                                         \
            for (int c = 0; c < S; c++) vstore(o[i] + d + c * LANES, acc[i][c]);                             \
    }
#define VALUE_SUMS(NP)                                                                                       \
    static void value_sums_##NP(float *const *o, const float *const *p, const float *v, const long *list,    \
                                long j0, long j1, long D) {                                                \
        long d = 0;                                                                                          \
        VALUE_SPANS(NP, SPAN)                                                                                \
        VALUE_SPANS(NP, 1)                                                                                   \
        for (; d < D; d++)                                                                                   \
            for (long j = j0; j < j1; j++)                                                                   \
                for (int i = 0; i < NP; i++) o[i][d] += p[i][j] * VALUE_COLUMN(j)[d];                              \
    }
VALUE_SUMS(1) VALUE_SUMS(2) VALUE_SUMS(3) VALUE_SUMS(4) VALUE_SUMS(5)
typedef void (*value_sums_fn)(float *const *, const float *const *, const float *, const long *, long, long, long);
static const value_sums_fn VALUE_SUMS_OF[] = {0, value_sums_1, value_sums_2, value_sums_3, value_sums_4, value_sums_5};

/* Attention of the (row, query head) pairs [p0, p1) of key/value head `kv`: pair p is row p / G and query head
   g = p % G of the G that share it (keys k, values v of that head, [cols, D]). Row t sees the count[t] columns listed
   at seen + t cols, in order; every row sees columns [0, shared) (its list starts 0, 1, 2, ...), and each of those
   keys and values is read once for all the job's pairs: over a long cache they come from memory, not L2, and a
   verify's rows would otherwise read them once each. Scores come in tiles of up to SCORE_PAIRS pairs and SCORE_BLOCKS
   blocks of LANES keys (`scores_*`: shared columns for all the job's pairs, a row's own for its pairs), then the
   softmax of the row's list, then the values summed in list order for up to VALUE_GROUP pairs at once (of one row
   for its own columns): a pair's result depends only on its query and the columns its row lists.
   scores: [T, Hq, cols]; attn: [T, Hq, D]; pointers: room for two per pair of the job (its queries, its rows of
   scores: worked out once, where a tile's division by G per pair and its copies' `rep movs` took a sixth of the
   job). */
static void attend(const float *qkv, long width, const float *k, const float *v, const long *seen, const long *count,
                   long cols, long shared, long p0, long p1, long kv, long G, long Hq, long D, float scaling,
                   float *scores, float *attn, void **pointers) {
#define ROW(p) ((p) / G)
#define HEAD(p) (ROW(p) * Hq + kv * G + (p) % G) /* the pair's head among all rows' heads */
#define QUERY(p) (qkv + ROW(p) * width + (kv * G + (p) % G) * D)
    const float **queries = (const float **)pointers;
    float **rows = (float **)(pointers + (p1 - p0));
    for (long p = p0; p < p1; p++) { /* each pair's query and row of scores, worked out once */
        queries[p - p0] = QUERY(p);
        rows[p - p0] = scores + HEAD(p) * cols;
    }
    for (long j = 0; j < shared; j += SCORE_BLOCKS * LANES) { /* the shared columns, for every pair */
        long n = shared - j < SCORE_BLOCKS * LANES ? shared - j : SCORE_BLOCKS * LANES;
        for (long i = 0; j + n < shared && i < n * D; i += 16) /* the next keys, while these run */
            _mm_prefetch((const char *)(k + (j + n) * D + i), _MM_HINT_T0);
        score_span(queries, rows, p1 - p0, k, 0, j, n, D, scaling);
    }
    for (long a = p0, e; a < p1; a = e) { /* each row's own columns, for the pairs of that row */
        long t = ROW(a);
        const long *list = seen + t * cols;
        for (e = a; e < p1 && ROW(e) == t; e++) {}
        for (long j = shared; j < count[t]; j += SCORE_BLOCKS * LANES) {
            long n = count[t] - j < SCORE_BLOCKS * LANES ? count[t] - j : SCORE_BLOCKS * LANES;
            score_span(queries + (a - p0), rows + (a - p0), e - a, k, list, j, n, D, scaling);
        }
    }
    for (long p = p0; p < p1; p++) {
        softmax(scores + HEAD(p) * cols, count[ROW(p)]);
        for (long d = 0; d < D; d++) attn[HEAD(p) * D + d] = 0.0f;
    }
    float *outs[VALUE_GROUP];
    const float *probs[VALUE_GROUP];
    for (long p = p0; p < p1;) { /* the shared columns, for any pairs */
        int n = 0;
        for (; n < VALUE_GROUP && p < p1; n++, p++) {
            outs[n] = attn + HEAD(p) * D;
            probs[n] = scores + HEAD(p) * cols;
        }
        VALUE_SUMS_OF[n](outs, probs, v, 0, 0, shared, D);
    }
    for (long p = p0; p < p1;) { /* each row's own columns, for pairs of that row */
        long t = ROW(p);
        int n = 0;
        for (; n < VALUE_GROUP && p < p1 && ROW(p) == t; n++, p++) {
            outs[n] = attn + HEAD(p) * D;
            probs[n] = scores + HEAD(p) * cols;
        }
        VALUE_SUMS_OF[n](outs, probs, v, seen + t * cols, shared, count[t], D);
    }
#undef QUERY
#undef HEAD
#undef ROW
}

/* y = x / sqrt(mean(x^2) + eps) * w over each of T rows of width H */
static void rms_norm(const float *x, const float *w, float eps, float *y, long T, long H) {
    for (long t = 0; t < T; t++) {
        const float *xr = x + t * H;
        float inv = 1.0f / sqrtf(dot(xr, xr, H) / (float)H + eps);
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

/* qkv [T, (heads + 2 kv_heads) head_dim] = rotary(norm(h) [Wq; Wk; Wv]^T), rotary tables cos/sin [T, head_dim] */
int layer_attention_in(const struct layer *L, const float *h, const float *cos, const float *sin, float *qkv, long T,
                       int threads) {
    long H = L->hidden, D = L->head_dim, width = (L->heads + 2 * L->kv_heads) * D;
    float *normed = scratch(0, sizeof(float) * T * H);
    if (!normed || T < 1) return -1;
    rms_norm(h, L->in_norm, L->in_eps, normed, T, H);
    if (apply(&L->q, normed, qkv, T, H, width, threads)
        || apply(&L->k, normed, qkv + L->heads * D, T, H, width, threads)
        || apply(&L->v, normed, qkv + (L->heads + L->kv_heads) * D, T, H, width, threads))
        return -1;
    for (long t = 0; t < T; t++) rotary(qkv + t * width, cos + t * D, sin + t * D, L->heads + L->kv_heads, D);
    return 0;
}

/* out = h + o(attention): keys/values [kv_heads, cols, head_dim] with `head_stride` floats between heads (a cache
   buffer's layout); mask [T, cols] (nonzero: visible) or none (causal: row t sees columns up to cols - T + t).
   out may be h. */
int layer_attention_out(const struct layer *L, const float *h, float *out, const float *qkv, const float *keys,
                        const float *values, long head_stride, long cols, const unsigned char *mask, long T,
                        int threads) {
    long H = L->hidden, Hq = L->heads, Hkv = L->kv_heads, D = L->head_dim, width = (Hq + 2 * Hkv) * D, group = Hq / Hkv;
    char *base = scratch(0, sizeof(float) * (T * Hq * cols + T * Hq * D + T * H) + sizeof(long) * (T * cols + T)
                                + sizeof(void *) * 2 * T * Hq);
    if (!base || T < 1 || cols < 1 || D > MAX_HEAD_DIM) return -1;
    float *scores = (float *)base, *attn = scores + T * Hq * cols, *x = attn + T * Hq * D;
    long *seen = (long *)(x + T * H), *count = seen + T * cols;
    void **pointers = (void **)(count + T); /* two per (row, query head): `attend`'s */
    long shared = cols;
    for (long t = 0; t < T; t++) { /* the columns row t sees, in order; those every row sees first */
        long n = 0, *list = seen + t * cols, lead = 0;
        for (long c = 0; c < cols; c++)
            if (mask ? mask[t * cols + c] != 0 : c <= cols - T + t) list[n++] = c;
        count[t] = n;
        while (lead < n && list[lead] == lead) lead++;
        shared = lead < shared ? lead : shared;
    }
    /* jobs: a key/value head and a part of the rows (with all their query heads of that group); enough parts to give
       every thread work. Not fewer rows a part: a one-row step split by query heads read each key twice, once a
       thread, and cost more than the threads' uneven shares of whole key/value heads (ctx 1024: 4.3 ms against 3.2) */
    long parts = (2 * threads + Hkv - 1) / Hkv;
    parts = parts < 1 ? 1 : parts > T ? T : parts;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long job = 0; job < parts * Hkv; job++) {
        long part = job / Hkv, g = job % Hkv;
        attend(qkv, width, keys + g * head_stride, values + g * head_stride, seen, count, cols, shared,
               T * part / parts * group, T * (part + 1) / parts * group, g, group, Hq, D, L->scaling, scores, attn,
               pointers + 2 * (g * T * group + T * part / parts * group));
    }
    if (apply(&L->o, attn, x, T, Hq * D, H, threads)) return -1;
    for (long i = 0; i < T * H; i++) out[i] = h[i] + x[i];
    return 0;
}

/* out = h + down(silu(gate(norm(h))) * up(norm(h))); out may be h. */
int layer_mlp(const struct layer *L, const float *h, float *out, long T, int threads) {
    long H = L->hidden, I = L->inner;
    float *x = scratch(0, sizeof(float) * (T * H + 2 * T * I)), *gate_up = x + T * H;
    if (!x || T < 1) return -1;
    rms_norm(h, L->post_norm, L->post_eps, x, T, H);
    if (apply(&L->gate, x, gate_up, T, H, 2 * I, threads) || apply(&L->up, x, gate_up + I, T, H, 2 * I, threads))
        return -1;
    /* silu(gate) * up, row t written at gate_up[t I ...] ([T, I], the down product's input) from its gate at
       [2 t I ...] and up at [2 t I + I ...]: a row's destination ends at (t + 1) I <= 2 t I, before its own
       sources, and row 0 is rewritten a vector at a time in place. e^-g by `vexp`, its argument kept below
       e^88's overflow (there silu(g) is g / 1e38: zero to float precision either way). */
    for (long t = 0; t < T; t++) {
        const float *g = gate_up + t * 2 * I, *u = g + I;
        float *act = gate_up + t * I;
        long i = 0, iv = I - I % LANES;
        for (; i < iv; i += LANES) {
            vec gv = vload(g + i), e = vexp(vmin(vsub(vzero(), gv), vset1(87.0f)));
            vstore(act + i, vmul(vdiv(gv, vadd(vset1(1.0f), e)), vload(u + i)));
        }
        for (; i < I; i++) act[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
    if (apply(&L->down, gate_up, x, T, I, H, threads)) return -1;
    for (long i = 0; i < T * H; i++) out[i] = h[i] + x[i];
    return 0;
}

/* The whole layer in one call: layer_attention_in, the new keys and values written into the cache's buffers at columns
   [start, start + T) of every key/value head (keys/values [kv_heads, capacity, head_dim], `head_stride` floats between
   heads), layer_attention_out over columns [0, start + T) and layer_mlp; out may be h. The same numbers as the three
   calls with the cache's own update between them (the same functions in the same order), without what the
   caller spends between calls: on SmolLM2-135M (AMD EPYC, two threads) ~50 us a layer of torch views, the cache's
   slice assignments and argument checks, 1.5 ms of a one-row forward, and as much again in each of Fractal's
   compressed passes, whose int8 products take a quarter of the time. */
static int layer_forward(const struct layer *L, const float *h, float *out, const float *cos, const float *sin,
                         float *keys, float *values, long head_stride, long start, const unsigned char *mask, long T,
                         int threads) {
    long H = L->hidden, Hq = L->heads, Hkv = L->kv_heads, D = L->head_dim, width = (Hq + 2 * Hkv) * D;
    float *qkv = scratch(1, sizeof(float) * T * (width + H)), *mid = qkv + T * width;
    if (!qkv || T < 1 || start < 0 || layer_attention_in(L, h, cos, sin, qkv, T, threads)) return -1;
    for (long g = 0; g < Hkv; g++)
        for (long t = 0; t < T; t++) {
            const float *row = qkv + t * width + (Hq + g) * D;
            memcpy(keys + g * head_stride + (start + t) * D, row, sizeof(float) * D);
            memcpy(values + g * head_stride + (start + t) * D, row + Hkv * D, sizeof(float) * D);
        }
    if (layer_attention_out(L, h, mid, qkv, keys, values, head_stride, start + T, mask, T, threads)) return -1;
    return layer_mlp(L, mid, out, T, threads);
}

/* One layer's part of `layers_forward`: its plan and where its new keys and values go (as `layer_forward` takes them). */
struct layer_call {
    const struct layer *layer;
    float *keys, *values;
    long head_stride, start;
    const unsigned char *mask;
};

/* Consecutive layers in one call, each as `layer_forward`, the first over h and every later one over the output of the
   one before (in place in out); all rows share the rotary tables. The same numbers as a call per layer, without the
   caller's work between them: a layer's call from Python (its checks, the cache's room, ctypes) is ~50 us, ~1.5 ms of
   the embedded model's one-row forward (AMD EPYC, two threads) and more than a quarter of a Fractal lower pass. */
int layers_forward(const struct layer_call *calls, long n, const float *h, float *out, const float *cos,
                   const float *sin, long T, int threads) {
    for (long i = 0; i < n; i++) {
        const struct layer_call *c = calls + i;
        if (layer_forward(c->layer, i ? out : h, out, cos, sin, c->keys, c->values, c->head_stride, c->start, c->mask,
                          T, threads))
            return -1;
    }
    return 0;
}
