/* CPU kernels for fused arrays of sweep-sized models: narrow attention and layer norm,
 * and Adam's step in place.
 *
 * A fused array calls each layer kernel once for all B models, so a call holds thousands
 * of tiny problems (a 16 x 16 attention block, a 16-wide layer-norm row). torch's CPU
 * kernels spend most of their time per problem there, not per element. These kernels keep
 * one problem in registers and vectorise across it. Sizes are compile-time constants
 * (plait.fused.native.build compiles one library per size), so every inner loop has a
 * fixed trip count that the compiler unrolls and vectorises.
 *
 * Threads: the loops use OpenMP, linked against the OpenMP runtime torch already loaded,
 * with the thread count torch uses passed in.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int64_t i64;

#ifndef SEQ
#define SEQ 16 /* attention: sequence length T (= S, self-attention) */
#endif
#ifndef HEAD
#define HEAD 8 /* attention: head width d */
#endif
#ifndef WIDTH
#define WIDTH 16 /* layer norm: normalised size */
#endif

/* exp(x) for x <= 0: x = n ln2 + r with |r| <= ln2 / 2 (Cody-Waite, ln2 split in two),
 * then a degree-7 Taylor polynomial in r (error below r^8 / 8! ~ 5e-9 relative), scaled by
 * 2^n through the exponent bits. Written without branches or calls so that loops calling
 * it vectorise. */
static inline float exp_nonpos(float x) {
    const float log2e = 1.44269504088896341f, ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;
    /* Clamp to -87 (exp(-87) = 1.6e-38, still a normal float) by bit pattern: for x <= 0
     * a larger unsigned pattern is a more negative float, and -inf maps to -87 as well.
     * An integer minimum vectorises where a float select does not. */
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    u = u < 0xC2AE0000u ? u : 0xC2AE0000u;
    float xc;
    memcpy(&xc, &u, sizeof xc);
    const int32_t ni = (int32_t)(xc * log2e - 0.5f); /* round(x / ln2): truncates a value <= -0.5 */
    const float n = (float)ni;
    const float r = xc - n * ln2_hi - n * ln2_lo;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = (ni + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

/* dst[c][i] = src[i * stride + c]: a block's SEQ rows of HEAD, transposed. */
static inline void load_transposed(const float *restrict src, i64 stride,
                                   float dst[restrict HEAD][SEQ]) {
    for (i64 i = 0; i < SEQ; i++)
        for (i64 c = 0; c < HEAD; c++) dst[c][i] = src[i * stride + c];
}

/* Tiles of transposed_product: TILE_J rows of `out` by TILE_I of its columns, whose sums
 * (at most 8 vectors) stay in registers through the HEAD steps, each step loading TILE_I
 * columns of `cols` once for TILE_J rows. */
#if SEQ % 4 == 0
#define TILE_J 4
#elif SEQ % 2 == 0
#define TILE_J 2
#else
#define TILE_J 1
#endif
#if SEQ % 16 == 0
#define TILE_I 16
#elif SEQ % 8 == 0
#define TILE_I 8
#else
#define TILE_I SEQ
#endif

/* out[j][i] = sum_c rows[j * stride + c] * cols[c][i], vectorised over i: one scalar of
 * `rows` times a row of the transposed `cols` per step, a tile of out at a time. */
static inline void transposed_product(const float *restrict rows, i64 stride,
                                      const float cols[restrict HEAD][SEQ],
                                      float out[restrict SEQ][SEQ]) {
    for (i64 j0 = 0; j0 < SEQ; j0 += TILE_J)
        for (i64 i0 = 0; i0 < SEQ; i0 += TILE_I) {
            float a[TILE_J][TILE_I];
            for (i64 jj = 0; jj < TILE_J; jj++) {
#pragma omp simd
                for (i64 ii = 0; ii < TILE_I; ii++) a[jj][ii] = 0.0f;
            }
            for (i64 c = 0; c < HEAD; c++)
                for (i64 jj = 0; jj < TILE_J; jj++) {
                    const float r = rows[(j0 + jj) * stride + c];
#pragma omp simd
                    for (i64 ii = 0; ii < TILE_I; ii++) a[jj][ii] += r * cols[c][i0 + ii];
                }
            for (i64 jj = 0; jj < TILE_J; jj++) {
#pragma omp simd
                for (i64 ii = 0; ii < TILE_I; ii++) out[j0 + jj][i0 + ii] = a[jj][ii];
            }
        }
}

/* Rows of a block's product handled together: their accumulators (ROW_BLOCK x HEAD
 * floats) stay in vector registers through the sum, so each step loads one row of `term`
 * for ROW_BLOCK rows. One row at a time, the accumulators went through memory on every
 * step: 1.6-1.9x slower attention (measured, SEQ 32-64, HEAD 8-16). */
#if HEAD <= 8 && SEQ % 8 == 0
#define ROW_BLOCK 8
#elif HEAD <= 16 && SEQ % 4 == 0
#define ROW_BLOCK 4
#elif HEAD <= 32 && SEQ % 2 == 0
#define ROW_BLOCK 2
#else
#define ROW_BLOCK 1
#endif

/* out[r][c] (+)= sum over `outer` of coef * term, for the SEQ rows r = `row` of a block:
 * one row of `term` (HEAD wide) per step, scaled by a scalar broadcast of `coef`, into
 * ROW_BLOCK rows at a time, stored as rows of `stride` (`keep`: added to what `out`
 * holds). Reading coef from the transposed P or dS this way leaves nothing to transpose
 * back. */
#define ROWS_SUM(out, stride, keep, coef, term, outer, row)                               \
    for (i64 r0_ = 0; r0_ < SEQ; r0_ += ROW_BLOCK) {                                       \
        float a_[ROW_BLOCK][HEAD];                                                         \
        for (i64 b_ = 0; b_ < ROW_BLOCK; b_++) {                                           \
            _Pragma("omp simd") for (i64 c = 0; c < HEAD; c++)                             \
                a_[b_][c] = keep ? out[(r0_ + b_) * stride + c] : 0.0f;                    \
        }                                                                                  \
        for (i64 outer = 0; outer < SEQ; outer++)                                          \
            for (i64 b_ = 0; b_ < ROW_BLOCK; b_++) {                                       \
                const i64 row = r0_ + b_;                                                  \
                const float s_ = coef;                                                     \
                _Pragma("omp simd") for (i64 c = 0; c < HEAD; c++) a_[b_][c] += s_ * term; \
            }                                                                              \
        for (i64 b_ = 0; b_ < ROW_BLOCK; b_++) {                                           \
            _Pragma("omp simd") for (i64 c = 0; c < HEAD; c++)                             \
                out[(r0_ + b_) * stride + c] = a_[b_][c];                                  \
        }                                                                                  \
    }
#define ROWS_PRODUCT(out, stride, coef, term, outer, row) \
    ROWS_SUM(out, stride, 0, coef, term, outer, row)

/* Softmax's backward in place, for a block held transposed: dst[j][i] = dP[i][j] becomes
 * dS[i][j] = P[i][j] (dP[i][j] - sum_j' P[i][j'] dP[i][j']) * scale, P read key-major
 * from pt (pt[j * SEQ + i] = P[i][j]). */
static inline void softmax_backward(const float *restrict pt, float dst[restrict SEQ][SEQ],
                                    float scale) {
    float dot[SEQ];
#pragma omp simd
    for (i64 i = 0; i < SEQ; i++) dot[i] = 0.0f;
    for (i64 j = 0; j < SEQ; j++) {
#pragma omp simd
        for (i64 i = 0; i < SEQ; i++) dot[i] += pt[j * SEQ + i] * dst[j][i];
    }
    for (i64 j = 0; j < SEQ; j++) {
#pragma omp simd
        for (i64 i = 0; i < SEQ; i++) dst[j][i] = pt[j * SEQ + i] * (dst[j][i] - dot[i]) * scale;
    }
}

/* Self-attention over a packed projection: qkv [nb, SEQ, 3E] holds q, k and v in turn, each
 * `heads` heads of HEAD; out [nb, SEQ, E] gets the heads side by side; probs [nb, heads,
 * SEQ, SEQ] keeps the probabilities for the backward, transposed (key-major). `mask` is an
 * optional additive [nb, heads, SEQ, SEQ] mask given by element strides (0 to broadcast).
 *
 * One (sequence, head) block per iteration. Scores are held transposed, st[j][i] for key j
 * and query i, so that every loop runs over the query index: softmax's maximum and sum
 * become element-wise vector updates instead of per-row horizontal reductions, and each
 * product is a chain of independent vector multiply-adds. */
void attention_forward(const float *restrict qkv, const float *restrict mask, i64 m0, i64 m1,
                       i64 m2, i64 m3, float *restrict out, float *restrict probs, i64 nb,
                       i64 heads, float scale, int threads) {
    const i64 e = heads * HEAD, rs = 3 * e;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (i64 blk = 0; blk < nb * heads; blk++) {
        const i64 b = blk / heads, h = blk % heads;
        const float *q = qkv + b * SEQ * rs + h * HEAD, *k = q + e, *v = q + 2 * e;
        float qt[HEAD][SEQ], st[SEQ][SEQ], mx[SEQ], sum[SEQ];
        load_transposed(q, rs, qt);
        transposed_product(k, rs, qt, st); /* st[j][i] = K[j] . Q[i] */
#pragma omp simd
        for (i64 i = 0; i < SEQ; i++) {
            mx[i] = -INFINITY;
            sum[i] = 0.0f;
        }
        for (i64 j = 0; j < SEQ; j++) {
            if (mask) {
                const float *mj = mask + b * m0 + h * m1 + j * m3;
                for (i64 i = 0; i < SEQ; i++) st[j][i] = st[j][i] * scale + mj[i * m2];
            } else {
#pragma omp simd
                for (i64 i = 0; i < SEQ; i++) st[j][i] *= scale;
            }
#pragma omp simd
            for (i64 i = 0; i < SEQ; i++) mx[i] = st[j][i] > mx[i] ? st[j][i] : mx[i];
        }
        for (i64 j = 0; j < SEQ; j++) {
#pragma omp simd
            for (i64 i = 0; i < SEQ; i++) {
                st[j][i] = exp_nonpos(st[j][i] - mx[i]);
                sum[i] += st[j][i];
            }
        }
#pragma omp simd
        for (i64 i = 0; i < SEQ; i++) sum[i] = 1.0f / sum[i];
        float *p = probs + blk * SEQ * SEQ;
        for (i64 j = 0; j < SEQ; j++) {
#pragma omp simd
            for (i64 i = 0; i < SEQ; i++) {
                st[j][i] *= sum[i];
                p[j * SEQ + i] = st[j][i];
            }
        }
        float *o = out + b * SEQ * e + h * HEAD;
        ROWS_PRODUCT(o, e, st[j][i], v[j * rs + c], j, i) /* out[i] = sum_j P[i][j] V[j] */
    }
}

/* The backward of attention_forward: grad [nb, SEQ, E] -> dqkv [nb, SEQ, 3E], with
 * dS = P * (dP - rowsum(P * dP)) * scale, dQ = dS K, dK = dS^T Q and dV = P^T G. dP and dS
 * are formed transposed, as the forward's scores, vectorised over queries. */
void attention_backward(const float *restrict qkv, const float *restrict probs,
                        const float *restrict grad, float *restrict dqkv, i64 nb, i64 heads,
                        float scale, int threads) {
    const i64 e = heads * HEAD, rs = 3 * e;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (i64 blk = 0; blk < nb * heads; blk++) {
        const i64 b = blk / heads, h = blk % heads;
        const float *q = qkv + b * SEQ * rs + h * HEAD, *k = q + e, *v = q + 2 * e;
        const float *pt = probs + blk * SEQ * SEQ;
        const float *g = grad + b * SEQ * e + h * HEAD;
        float *dq = dqkv + b * SEQ * rs + h * HEAD, *dk = dq + e, *dv = dq + 2 * e;
        float gt[HEAD][SEQ], dst[SEQ][SEQ];
        load_transposed(g, e, gt);
        transposed_product(v, rs, gt, dst); /* dst[j][i] = dP[i][j] = V[j] . G[i] */
        softmax_backward(pt, dst, scale);
        /* dQ[i] = sum_j dS[i][j] K[j], dK[j] = sum_i dS[i][j] Q[i], dV[j] = sum_i P[i][j] G[i]:
           each a row of K, Q or G per step into SEQ independent rows, read from the
           transposed dS and P by scalar broadcasts, so nothing is transposed back. */
        ROWS_PRODUCT(dq, rs, dst[j][i], k[j * rs + c], j, i)
        ROWS_PRODUCT(dk, rs, dst[j][i], q[i * rs + c], i, j)
        ROWS_PRODUCT(dv, rs, pt[j * SEQ + i], g[i * e + c], i, j)
    }
}

/* Layer norm of WIDTH-wide rows with each model's own affine: x [models, rows, WIDTH],
 * weight and bias [models, WIDTH] (either may be NULL); keeps each row's mean and
 * 1 / std for the backward. Two passes over the row (mean, then variance about it).
 * Not `centred`, it is RMSNorm: the mean is taken as 0, so the deviation is the root mean
 * square (the mean kept is 0). */
void layer_norm_forward(const float *restrict x, const float *restrict weight,
                        const float *restrict bias, float *restrict y, float *restrict mean,
                        float *restrict rstd, i64 models, i64 rows, float eps, int centred,
                        int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (i64 r = 0; r < models * rows; r++) {
        const i64 m = r / rows;
        const float *xr = x + r * WIDTH;
        float *yr = y + r * WIDTH;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (i64 c = 0; c < WIDTH; c++) s += xr[c];
        const float mu = centred ? s / (float)WIDTH : 0.0f;
        float var = 0.0f;
#pragma omp simd reduction(+ : var)
        for (i64 c = 0; c < WIDTH; c++) var += (xr[c] - mu) * (xr[c] - mu);
        const float rs = 1.0f / sqrtf(var / (float)WIDTH + eps);
        mean[r] = mu;
        rstd[r] = rs;
        const float *w = weight ? weight + m * WIDTH : 0, *bb = bias ? bias + m * WIDTH : 0;
#pragma omp simd
        for (i64 c = 0; c < WIDTH; c++) {
            const float z = (xr[c] - mu) * rs;
            yr[c] = (w ? z * w[c] : z) + (bb ? bb[c] : 0.0f);
        }
    }
}

/* The backward of layer_norm_forward. With xh the normalised row and gw = g * weight:
 * dx = rstd * (gw - mean(gw) - xh * mean(gw * xh)), without the mean(gw) term for
 * RMSNorm (not `centred`); dweight and dbias sum g * xh and g
 * over each model's rows, into per-thread partial sums added up at the end (a model's
 * rows may span threads). */
void layer_norm_backward(const float *restrict grad, const float *restrict x,
                         const float *restrict mean, const float *restrict rstd,
                         const float *restrict weight, float *restrict dx,
                         float *restrict dweight, float *restrict dbias, i64 models, i64 rows,
                         int centred, int threads) {
    const i64 per = models * WIDTH;
    float *part = 0;
    if (dweight || dbias) {
        part = calloc((size_t)(threads * 2 * per), sizeof(float));
        if (!part) abort();
    }
#pragma omp parallel num_threads(threads)
    {
        float *pw = part ? part + (i64)omp_get_thread_num() * 2 * per : 0;
#pragma omp for schedule(static)
        for (i64 r = 0; r < models * rows; r++) {
            const i64 m = r / rows;
            const float *gr = grad + r * WIDTH, *xr = x + r * WIDTH;
            const float *w = weight ? weight + m * WIDTH : 0;
            const float mu = mean[r], rs = rstd[r];
            float xh[WIDTH], gw[WIDTH], s1 = 0.0f, s2 = 0.0f;
#pragma omp simd reduction(+ : s1, s2)
            for (i64 c = 0; c < WIDTH; c++) {
                xh[c] = (xr[c] - mu) * rs;
                gw[c] = w ? gr[c] * w[c] : gr[c];
                s1 += gw[c];
                s2 += gw[c] * xh[c];
            }
            s1 = centred ? s1 / (float)WIDTH : 0.0f; /* RMSNorm's mean is no function of x */
            s2 /= (float)WIDTH;
            float *dr = dx + r * WIDTH;
#pragma omp simd
            for (i64 c = 0; c < WIDTH; c++) dr[c] = rs * (gw[c] - s1 - xh[c] * s2);
            if (pw) {
                float *a = pw + m * WIDTH, *bsum = pw + per + m * WIDTH;
#pragma omp simd
                for (i64 c = 0; c < WIDTH; c++) {
                    a[c] += gr[c] * xh[c];
                    bsum[c] += gr[c];
                }
            }
        }
    }
    if (part) {
        for (i64 i = 0; i < per; i++) {
            float a = 0.0f, bsum = 0.0f;
            for (int t = 0; t < threads; t++) {
                a += part[t * 2 * per + i];
                bsum += part[t * 2 * per + per + i];
            }
            if (dweight) dweight[i] = a;
            if (dbias) dbias[i] = bsum;
        }
        free(part);
    }
}

/* One Adam step for B models whose parameters differ only in learning rate: parameter i
 * is params[i] [models, sizes[i]] with gradient grads[i]; exp_avg and exp_avg_sq are flat
 * [models, total] buffers holding parameter i at column offsets[i]. step_size[b] is model
 * b's lr / (1 - beta1^step), bc2_sqrt is sqrt(1 - beta2^step): torch's Adam update, with
 * each model's rate applied in place. Gradients are read where autograd left them and
 * parameters written where they live, so the step is one pass over its state instead of
 * gathering gradients into a flat buffer and scattering an update back. */
void adam_step(i64 nparams, const i64 *restrict sizes, const i64 *restrict offsets,
               float *const *params, const float *const *grads, float *restrict exp_avg,
               float *restrict exp_avg_sq, i64 models, i64 total,
               const float *restrict step_size, float beta1, float beta2, float eps,
               float bc2_sqrt, int threads) {
#pragma omp parallel for num_threads(threads) collapse(2) schedule(dynamic, 1)
    for (i64 i = 0; i < nparams; i++)
        for (i64 b = 0; b < models; b++) {
            const i64 n = sizes[i];
            float *restrict p = params[i] + b * n;
            const float *restrict g = grads[i] + b * n;
            float *restrict m = exp_avg + b * total + offsets[i];
            float *restrict v = exp_avg_sq + b * total + offsets[i];
            const float lr = step_size[b];
#pragma omp simd
            for (i64 k = 0; k < n; k++) {
                m[k] = beta1 * m[k] + (1.0f - beta1) * g[k];
                v[k] = beta2 * v[k] + (1.0f - beta2) * g[k] * g[k];
                p[k] -= lr * m[k] / (sqrtf(v[k]) / bc2_sqrt + eps);
            }
        }
}

/* A 32-bit integer hash with good avalanche (Wellons' "lowbias32"): each output bit
 * depends on every input bit, so hashing consecutive counters gives independent-looking
 * uniform draws. Multiplies and shifts on 32-bit lanes only, so loops calling it vectorise. */
static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7feb352dU;
    x ^= x >> 15;
    x *= 0x846ca68bU;
    x ^= x >> 16;
    return x;
}

/* Dropout of `models` contiguous blocks of `per_model` elements: element i of block b is
 * kept when the draw hashed from (seed, b * per_model + i) is at least p[b], and scaled by
 * 1 / (1 - p[b]). The mask is a function of the seed and the position, so the backward
 * pass applies the same function to the gradient (the kernel is linear in x) and no mask
 * is stored. A draw is the top 24 bits of the hash, compared with p[b] * 2^24.
 *
 * The inner loop multiplies by a selected factor (scale or 0) rather than choosing
 * between x * scale and 0: a load under a condition is control flow the vectoriser
 * refuses, and the branch-free form runs 8.5x faster on AVX2 (0.7 against 5.9 ns an
 * element, measured). Like torch's dropout it multiplies every element, so a dropped NaN
 * stays NaN. Indices run on 32 bits inside a chunk for the same reason. */
#define DROPOUT_CHUNK 4096
void dropout_apply(const float *restrict x, float *restrict out, i64 models, i64 per_model,
                   const float *restrict p, uint64_t seed, int threads) {
    const uint32_t s0 = (uint32_t)seed, s1 = (uint32_t)(seed >> 32);
    const i64 chunks = (per_model + DROPOUT_CHUNK - 1) / DROPOUT_CHUNK;
#pragma omp parallel for num_threads(threads) collapse(2) schedule(static)
    for (i64 b = 0; b < models; b++)
        for (i64 c = 0; c < chunks; c++) {
            const float q = p[b];
            const uint32_t threshold = (uint32_t)(q * 16777216.0f);
            const float scale = q < 1.0f ? 1.0f / (1.0f - q) : 0.0f;
            const i64 start = c * DROPOUT_CHUNK;
            const i64 stop = start + DROPOUT_CHUNK < per_model ? start + DROPOUT_CHUNK : per_model;
            const int n = (int)(stop - start);
            const float *restrict xb = x + b * per_model + start;
            float *restrict ob = out + b * per_model + start;
            const uint32_t base = (uint32_t)(b * per_model + start);
            for (int i = 0; i < n; i++) {
                const uint32_t h = mix32(mix32((base + (uint32_t)i) ^ s0) + s1);
                const float keep = (h >> 8) >= threshold ? scale : 0.0f;
                ob[i] = xb[i] * keep;
            }
        }
}

/* The factor dropout multiplies a kept probability by: 1 / (1 - p) when the draw hashed
 * from (s0, s1, counter) clears `threshold` (p * 2^24), else 0; dropout_apply's draw. */
static inline float keep_factor(uint32_t counter, uint32_t s0, uint32_t s1, uint32_t threshold,
                                float scale) {
    const uint32_t h = mix32(mix32(counter ^ s0) + s1);
    return (h >> 8) >= threshold ? scale : 0.0f;
}

/* Strides (in elements) of attention_heads_*'s tensors: q, k and v by batch, head and row
 * (their HEAD values contiguous), then the additive mask by batch, head, query, key (the
 * forward), or dq, dk and dv as q, k and v (the backward). */
enum { QS0, QS1, QS2, KS0, KS1, KS2, VS0, VS1, VS2, MS0, MS1, MS2, MS3, NSTRIDES };
enum { DQS0 = MS0, DQS1, DQS2, DKS0, DKS1, DKS2, DVS0, DVS1, DVS2 };

/* Self-attention over separate q [nb, heads, SEQ, HEAD] and k, v [nb, kv_heads, SEQ, HEAD],
 * as a captured model's scaled_dot_product_attention holds them: views of its projections
 * read through `strides`, query head h attending with key/value head h / (heads /
 * kv_heads) (grouped-query attention), `causal` hiding keys after the query, `mask` an
 * optional additive mask, and dropout of the probabilities in the kernel: the rows of
 * model b / per_model drop at p[model] (p NULL: no dropout) with the hash of (seed,
 * position in `probs`), so the backward recomputes the same mask and none is stored.
 *
 * out [nb, SEQ, heads, HEAD] gets the heads side by side, the layout a model reshapes the
 * attention to next (torch sees it transposed to [nb, heads, SEQ, HEAD]); probs [nb,
 * heads, SEQ, SEQ] keeps the probabilities before dropout, key-major, for the backward. A
 * row every key of which is masked gets zero probabilities, as torch's kernel gives.
 * One (sequence, head) block per iteration, scores held transposed as in
 * attention_forward. */
void attention_heads_forward(const float *restrict qp, const float *restrict kp,
                             const float *restrict vp, const float *restrict mask,
                             const i64 *restrict strides, float *restrict out,
                             float *restrict probs, i64 nb, i64 heads, i64 kv_heads, int causal,
                             const float *restrict p, i64 per_model, uint64_t seed, float scale,
                             int threads) {
    const i64 groups = heads / kv_heads, e = heads * HEAD;
    const uint32_t s0 = (uint32_t)seed, s1 = (uint32_t)(seed >> 32);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (i64 blk = 0; blk < nb * heads; blk++) {
        const i64 b = blk / heads, h = blk % heads, kh = h / groups;
        const float *q = qp + b * strides[QS0] + h * strides[QS1];
        const float *k = kp + b * strides[KS0] + kh * strides[KS1];
        const float *v = vp + b * strides[VS0] + kh * strides[VS1];
        float qt[HEAD][SEQ], st[SEQ][SEQ], mx[SEQ], sum[SEQ];
        load_transposed(q, strides[QS2], qt);
        transposed_product(k, strides[KS2], qt, st); /* st[j][i] = K[j] . Q[i] */
#pragma omp simd
        for (i64 i = 0; i < SEQ; i++) {
            mx[i] = -INFINITY;
            sum[i] = 0.0f;
        }
        for (i64 j = 0; j < SEQ; j++) {
            if (mask) {
                const float *mj = mask + b * strides[MS0] + h * strides[MS1] + j * strides[MS3];
                for (i64 i = 0; i < SEQ; i++) st[j][i] = st[j][i] * scale + mj[i * strides[MS2]];
            } else {
#pragma omp simd
                for (i64 i = 0; i < SEQ; i++) st[j][i] *= scale;
            }
            if (causal) {
#pragma omp simd
                for (int i = 0; i < SEQ; i++) st[j][i] = i < (int)j ? -INFINITY : st[j][i];
            }
#pragma omp simd
            for (i64 i = 0; i < SEQ; i++) mx[i] = st[j][i] > mx[i] ? st[j][i] : mx[i];
        }
        /* Conditions below are products with 0 or 1 (a bound hoisted out of the loop, a
         * reciprocal taken before the choice): gcc keeps a loop with a select scalar. */
        for (int j = 0; j < SEQ; j++) {
            const int hidden = causal ? j : 0; /* queries i < j do not see key j */
#pragma omp simd
            for (int i = 0; i < SEQ; i++) { /* 32-bit indices: 8 compares to a vector */
                const float x = exp_nonpos(st[j][i] - mx[i]);
                st[j][i] = x * (float)(i >= hidden);
                sum[i] += st[j][i];
            }
        }
#pragma omp simd
        for (i64 i = 0; i < SEQ; i++) {
            const float inv = 1.0f / sum[i]; /* finite: exp_nonpos is at least 1.6e-38 */
            sum[i] = inv * (float)(mx[i] != -INFINITY);
        }
        float *pb = probs + blk * SEQ * SEQ;
        for (i64 j = 0; j < SEQ; j++) {
#pragma omp simd
            for (i64 i = 0; i < SEQ; i++) {
                st[j][i] *= sum[i];
                pb[j * SEQ + i] = st[j][i];
            }
        }
        if (p) {
            const float q_ = p[b / per_model];
            const uint32_t threshold = (uint32_t)(q_ * 16777216.0f);
            const float keep = q_ < 1.0f ? 1.0f / (1.0f - q_) : 0.0f;
            const uint32_t base = (uint32_t)(blk * SEQ * SEQ);
            for (i64 j = 0; j < SEQ; j++) {
#pragma omp simd
                for (i64 i = 0; i < SEQ; i++)
                    st[j][i] *= keep_factor(base + (uint32_t)(j * SEQ + i), s0, s1, threshold, keep);
            }
        }
        float *o = out + b * SEQ * e + h * HEAD;
        const i64 vs = strides[VS2];
        ROWS_PRODUCT(o, e, st[j][i], v[j * vs + c], j, i) /* out[i] = sum_j P[i][j] V[j] */
    }
}

/* The backward of attention_heads_forward: grad [nb, SEQ, heads, HEAD] (contiguous) ->
 * dq [nb, heads, SEQ, HEAD], dk and dv [nb, kv_heads, SEQ, HEAD], each written through
 * its strides (the caller lays them out as q, k and v are). With D the
 * recomputed dropout factors and Y = P * D the probabilities the forward applied:
 * dP = (G V^T) * D, dS = P * (dP - rowsum(P * dP)) * scale, dQ = dS K, dK = dS^T Q and
 * dV = Y^T G, dK and dV summed over a key/value head's query heads. One (sequence,
 * key/value head) per iteration, so those sums need no atomics. */
void attention_heads_backward(const float *restrict qp, const float *restrict kp,
                              const float *restrict vp, const i64 *restrict strides,
                              const float *restrict probs, const float *restrict grad,
                              float *restrict dqp, float *restrict dkp, float *restrict dvp,
                              i64 nb, i64 heads, i64 kv_heads, const float *restrict p,
                              i64 per_model, uint64_t seed, float scale, int threads) {
    const i64 groups = heads / kv_heads, e = heads * HEAD;
    const uint32_t s0 = (uint32_t)seed, s1 = (uint32_t)(seed >> 32);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (i64 blk = 0; blk < nb * kv_heads; blk++) {
        const i64 b = blk / kv_heads, kh = blk % kv_heads;
        const float *k = kp + b * strides[KS0] + kh * strides[KS1];
        const float *v = vp + b * strides[VS0] + kh * strides[VS1];
        const i64 ks = strides[KS2], vs = strides[VS2], qs = strides[QS2];
        const i64 dqs = strides[DQS2], dks = strides[DKS2], dvs = strides[DVS2];
        float gt[HEAD][SEQ], dst[SEQ][SEQ], yt[SEQ][SEQ];
        float *dk = dkp + b * strides[DKS0] + kh * strides[DKS1];
        float *dv = dvp + b * strides[DVS0] + kh * strides[DVS1];
        float threshold_keep = 0.0f;
        uint32_t threshold = 0;
        if (p) {
            const float q_ = p[b / per_model];
            threshold = (uint32_t)(q_ * 16777216.0f);
            threshold_keep = q_ < 1.0f ? 1.0f / (1.0f - q_) : 0.0f;
        }
        for (i64 g = 0; g < groups; g++) {
            const i64 h = kh * groups + g, qblk = b * heads + h;
            const float *q = qp + b * strides[QS0] + h * strides[QS1];
            const float *pt = probs + qblk * SEQ * SEQ;
            const float *gr = grad + b * SEQ * e + h * HEAD;
            load_transposed(gr, e, gt);
            transposed_product(v, vs, gt, dst); /* dst[j][i] = dY[i][j] = V[j] . G[i] */
            if (p) {
                const uint32_t base = (uint32_t)(qblk * SEQ * SEQ);
                for (i64 j = 0; j < SEQ; j++) {
#pragma omp simd
                    for (i64 i = 0; i < SEQ; i++) {
                        const float d = keep_factor(base + (uint32_t)(j * SEQ + i), s0, s1,
                                                    threshold, threshold_keep);
                        dst[j][i] *= d;
                        yt[j][i] = pt[j * SEQ + i] * d;
                    }
                }
            } else {
                for (i64 j = 0; j < SEQ; j++) {
#pragma omp simd
                    for (i64 i = 0; i < SEQ; i++) yt[j][i] = pt[j * SEQ + i];
                }
            }
            softmax_backward(pt, dst, scale);
            float *dq = dqp + b * strides[DQS0] + h * strides[DQS1];
            /* dQ[i] = sum_j dS[i][j] K[j]; dK[j] += sum_i dS[i][j] Q[i]; dV[j] += sum_i Y[i][j] G[i] */
            ROWS_PRODUCT(dq, dqs, dst[j][i], k[j * ks + c], j, i)
            ROWS_SUM(dk, dks, g > 0, dst[j][i], q[i * qs + c], i, j)
            ROWS_SUM(dv, dvs, g > 0, yt[j][i], gr[i * e + c], i, j)
        }
    }
}

/* GELU in the tanh form, x * sigmoid(2u) with u = sqrt(2 / pi) (x + 0.044715 x^3) (the
 * same as 0.5 x (1 + tanh(u))), from exp_nonpos alone so that its loop vectorises: 1.2-2.1
 * ns an element forward, 1.5 backward, on an AVX2 core, where torch's CPU kernel takes 3.3-3.5
 * (measured). torch's exact (erf) form is faster than a fit of erf written this way (1.1
 * against 2.5 ns), so only this form is served. The backward recomputes from x, so nothing
 * else is kept. */
#define GELU_C 0.7978845608028654f
#define GELU_A 0.044715f

static inline float sigmoid(float z) {
    const float e = exp_nonpos(-fabsf(z));
    const float r = 1.0f / (1.0f + e);
    return z >= 0.0f ? r : e * r;
}

#define GELU_CHUNK 4096
void gelu_tanh_forward(const float *restrict x, float *restrict y, i64 n, int threads) {
    const i64 chunks = (n + GELU_CHUNK - 1) / GELU_CHUNK;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (i64 c = 0; c < chunks; c++) {
        const i64 start = c * GELU_CHUNK;
        const int m = (int)((start + GELU_CHUNK < n ? start + GELU_CHUNK : n) - start);
        const float *restrict xs = x + start;
        float *restrict ys = y + start;
        for (int i = 0; i < m; i++) {
            const float v = xs[i];
            ys[i] = v * sigmoid(2.0f * GELU_C * (v + GELU_A * v * v * v));
        }
    }
}

/* dx = g * (s + x s (1 - s) z'), s = sigmoid(z), z = 2u; s (1 - s) = e / (1 + e)^2 with
 * e = exp(-|z|), not 1 - s, which cancels to nothing where s is near 1. */
void gelu_tanh_backward(const float *restrict g, const float *restrict x, float *restrict dx,
                        i64 n, int threads) {
    const i64 chunks = (n + GELU_CHUNK - 1) / GELU_CHUNK;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (i64 c = 0; c < chunks; c++) {
        const i64 start = c * GELU_CHUNK;
        const int m = (int)((start + GELU_CHUNK < n ? start + GELU_CHUNK : n) - start);
        const float *restrict gs = g + start, *restrict xs = x + start;
        float *restrict ds = dx + start;
        for (int i = 0; i < m; i++) {
            const float v = xs[i];
            const float z = 2.0f * GELU_C * (v + GELU_A * v * v * v);
            const float e = exp_nonpos(-fabsf(z)), r = 1.0f / (1.0f + e);
            const float s = z >= 0.0f ? r : e * r;
            const float dz = 2.0f * GELU_C * (1.0f + 3.0f * GELU_A * v * v);
            ds[i] = gs[i] * (s + v * (e * r * r) * dz);
        }
    }
}

/* Rotary position embedding (rotate-half form, as Llama applies it): out = x * cos +
 * rotate_half(x) * sin over rows of `width` (even), rotate_half(x) = [-x2, x1] for x's
 * halves x1, x2; x [outer, seq, width], cos and sin [seq, width] shared by every outer
 * row. torch runs it as seven operators forward (two slices, a negation, a cat, two
 * products, a sum) and more backward; here one pass each way. */
void rotary_forward(const float *restrict x, const float *restrict cs, const float *restrict sn,
                    float *restrict out, i64 outer, i64 seq, i64 width, int threads) {
    const i64 half = width / 2;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (i64 r = 0; r < outer * seq; r++) {
        const float *xr = x + r * width, *c = cs + (r % seq) * width, *s = sn + (r % seq) * width;
        float *o = out + r * width;
#pragma omp simd
        for (i64 i = 0; i < half; i++) o[i] = xr[i] * c[i] - xr[i + half] * s[i];
#pragma omp simd
        for (i64 i = half; i < width; i++) o[i] = xr[i] * c[i] + xr[i - half] * s[i];
    }
}

/* dx_j = g_j cos_j + g_{j+h} sin_{j+h} (j < h), g_j cos_j - g_{j-h} sin_{j-h} (j >= h). */
void rotary_backward(const float *restrict g, const float *restrict cs, const float *restrict sn,
                     float *restrict dx, i64 outer, i64 seq, i64 width, int threads) {
    const i64 half = width / 2;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (i64 r = 0; r < outer * seq; r++) {
        const float *gr = g + r * width, *c = cs + (r % seq) * width, *s = sn + (r % seq) * width;
        float *d = dx + r * width;
#pragma omp simd
        for (i64 i = 0; i < half; i++) d[i] = gr[i] * c[i] + gr[i + half] * s[i + half];
#pragma omp simd
        for (i64 i = half; i < width; i++) d[i] = gr[i] * c[i] - gr[i - half] * s[i - half];
    }
}
