/* Fused element-wise loops for hf_zeroone's CPU step and its 1-bit allreduce (see _cpu_kernels.py).
 *
 * Each function walks a list of n float32 tensors (pointers and element counts), or one flat vector
 * in segments (the compression loops), and does in one pass what torch does in several. Signs are
 * read from and written to bits, as compression.pack_signs lays them out. Every operation is IEEE float32 arithmetic that torch's own
 * CPU kernels also round exactly (division, multiplication, addition, comparison), in torch's
 * order, so the results are torch's bit for bit: the build turns off contraction into fused
 * multiply-adds (-ffp-contract=off), and _cpu_kernels.py checks the bits once per process before
 * it uses a loaded library. Square roots of tensors stay in torch (its vectorised sqrt is not
 * always the correctly rounded one a C sqrtf gives); a norm's one square root is torch's scalar
 * std::sqrt, correctly rounded as sqrtf is. Where torch itself fuses (its lerp is one fused
 * multiply-add), the loop calls fmaf, which rounds once as the instruction does.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* The bits of a float (memcpy: reading them through a cast pointer is undefined in C++). */
static inline uint32_t bits_of(float x) {
    uint32_t b;
    memcpy(&b, &x, sizeof b);
    return b;
}

/* torch.minimum / torch.maximum of float32 on the CPU: NaN wins, otherwise (a < b) ? a : b, which
 * on equal values (+0 and -0) returns b, as the vectorised kernels' min/max instructions do. Two
 * differences, neither of which reaches a result: torch's scalar loop over a vector's remainder
 * returns a on a tie, which differs only for a zero bound (eps = 0 and v = 0 there), and torch
 * writes its own NaN where this passes the input's on (a step with a NaN is skipped). */
static inline float nan_min(float a, float b) { return (a != a) ? a : ((b != b) ? b : (a < b ? a : b)); }
static inline float nan_max(float a, float b) { return (a != a) ? a : ((b != b) ? b : (a > b ? a : b)); }

/* From roots = sqrt(v): plain = roots / root_c2 + eps (new), and roots = roots * scale[t] + eps in place. */
void hz_split_denominators(int64_t n, float **roots, float **plain, const int64_t *numel, float root_c2,
                           const float *scale, float eps) {
    for (int64_t t = 0; t < n; t++) {
        float *r = roots[t], *p = plain[t];
        const float s = scale[t];
        for (int64_t i = 0; i < numel[t]; i++) {
            const float x = r[i];
            p[i] = x / root_c2 + eps;
            r[i] = x * s + eps;
        }
    }
}

/* out = a * factor[t] - b (0/1 Adam's displacement u = decay_prod * sync_param - p, and the sync's
 * p = decay_prod * sync_param - u): torch's copy, multiplication by the factor and subtraction. */
void hz_scaled_difference(int64_t n, float **out, float **a, float **b, const int64_t *numel, const float *factor) {
    for (int64_t t = 0; t < n; t++) {
        float *o = out[t];
        const float *x = a[t], *y = b[t];
        const float f = factor[t];
        for (int64_t i = 0; i < numel[t]; i++) o[i] = x[i] * f - y[i];
    }
}

/* 1 when no element of any tensor is NaN or infinite (an exponent of all ones), else 0. */
int hz_all_finite(int64_t n, float **tensors, const int64_t *numel) {
    uint32_t special = 0;
    for (int64_t t = 0; t < n; t++) {
        const float *x = tensors[t];
        uint32_t found = 0;
        for (int64_t i = 0; i < numel[t]; i++) found |= (uint32_t)((bits_of(x[i]) & 0x7f800000u) == 0x7f800000u);
        special |= found;
        if (special) return 0;
    }
    return 1;
}

/* roots = roots / root_c2 + eps, in place (no scale: the plain denominators alone). */
void hz_plain_denominators(int64_t n, float **roots, const int64_t *numel, float root_c2, float eps) {
    for (int64_t t = 0; t < n; t++) {
        float *r = roots[t];
        for (int64_t i = 0; i < numel[t]; i++) r[i] = r[i] / root_c2 + eps;
    }
}

/* roots = roots * scale[t] + eps, in place (the scaled denominators alone). */
void hz_scaled_denominators(int64_t n, float **roots, const int64_t *numel, const float *scale, float eps) {
    for (int64_t t = 0; t < n; t++) {
        float *r = roots[t];
        const float s = scale[t];
        for (int64_t i = 0; i < numel[t]; i++) r[i] = r[i] * s + eps;
    }
}

/* out = maximum(minimum(g, b), -b) with b = d * bound (new tensors out). */
void hz_clip_to_bounds(int64_t n, float **grads, float **dens, float **out, const int64_t *numel, float bound) {
    for (int64_t t = 0; t < n; t++) {
        const float *g = grads[t], *d = dens[t];
        float *o = out[t];
        for (int64_t i = 0; i < numel[t]; i++) {
            const float b = d[i] * bound;
            o[i] = nan_max(nan_min(g[i], b), -b);
        }
    }
}

/* out = g / d, set to 0 where d < floor[t] when masked[t] (new tensors out). */
void hz_masked_ratios(int64_t n, float **grads, float **dens, float **out, const int64_t *numel,
                      const float *floor, const uint8_t *masked) {
    for (int64_t t = 0; t < n; t++) {
        const float *g = grads[t], *d = dens[t];
        float *o = out[t];
        const float f = floor[t];
        if (masked[t]) {
            for (int64_t i = 0; i < numel[t]; i++) {
                const float r = g[i] / d[i];
                o[i] = d[i] < f ? 0.0f : r;
            }
        } else {
            for (int64_t i = 0; i < numel[t]; i++) o[i] = g[i] / d[i];
        }
    }
}

/* Elements a fused loop writes into a block of the stack before it reduces them, while they are in the
 * first-level cache: a multiple of 8, so the norm's lanes run on across blocks as over one array. */
#define HZ_BLOCK 2048

/* The 2-norm of x[0..n) in the order torch's CPU kernel reduces float32 (torch.linalg.vector_norm of a
 * contiguous tensor, as found on torch 2.13.0's x86 CPU build): eight lanes each summing the squares of every
 * eighth element (product, then sum: two roundings), the lanes folded left to right, then the
 * remainder of fewer than eight elements into that sum, by fours as product and sum, the last ones
 * fused (fmaf), then the square root. A single element's norm is its magnitude, as torch takes it
 * (no square to underflow or overflow). Another torch build may order it otherwise: _cpu_kernels.py
 * uses this only after checking it against torch's norm in the running process. */
typedef float hz_lanes8 __attribute__((vector_size(32))); /* eight floats, each rounded on its own */

/* lanes[k] += x[i] * x[i] for every i = k mod 8 of x[0..n), n a multiple of 8 (product, then sum). */
static inline hz_lanes8 hz_lanes_add(hz_lanes8 acc, const float *x, int64_t n) {
    hz_lanes8 v;
    for (int64_t i = 0; i + 8 <= n; i += 8) { /* one vector register: the loop runs at torch's speed */
        memcpy(&v, x + i, sizeof v);
        acc = acc + v * v;
    }
    return acc;
}

/* The norm from the lanes of an array's first elements and its last `rest` (< 8) elements at `tail`. */
static inline float hz_norm2_finish(hz_lanes8 acc, const float *tail, int64_t rest) {
    float lane[8];
    memcpy(lane, &acc, sizeof lane);
    float sum = lane[0];
    for (int j = 1; j < 8; j++) sum = sum + lane[j];
    int64_t i = 0;
    for (; i + 4 <= rest; i += 4)
        for (int j = 0; j < 4; j++) sum = sum + tail[i + j] * tail[i + j];
    for (; i < rest; i++) sum = fmaf(tail[i], tail[i], sum);
    return sqrtf(sum);
}

static const hz_lanes8 hz_no_lanes = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};

float hz_norm2(const float *x, int64_t n) {
    if (n == 1) return fabsf(x[0]);
    const int64_t body = n - n % 8;
    return hz_norm2_finish(hz_lanes_add(hz_no_lanes, x, body), x + body, n - body);
}

/* A norm in hz_norm2's order, of an array written a block at a time by a fused loop and reduced block by
 * block while the block is in cache: feed each block (at a multiple of 8 from the array's start) once written,
 * then end with the whole array, whose last n % 8 elements are summed as hz_norm2 sums them. */
typedef struct {
    hz_lanes8 acc;
    int64_t n, body;
} hz_norm_run;

static inline hz_norm_run hz_norm_begin(int64_t n) {
    hz_norm_run r = {hz_no_lanes, n, n - n % 8};
    return r;
}

static inline void hz_norm_feed(hz_norm_run *r, const float *block, int64_t start, int64_t count) {
    const int64_t end = start + count < r->body ? start + count : r->body;
    if (end > start) r->acc = hz_lanes_add(r->acc, block, end - start);
}

/* hz_norm_end where only the array's last block is at hand (on the stack): block holds elements start .. n - 1. */
static inline float hz_norm_end_in_block(const hz_norm_run *r, const float *block, int64_t start) {
    if (r->n == 1) return fabsf(block[0]);
    return hz_norm2_finish(r->acc, block + (r->body - start), r->n - r->body);
}

static inline float hz_norm_end(const hz_norm_run *r, const float *x) { return hz_norm_end_in_block(r, x, 0); }

/* hz_norm2 of g / d (0 where d < floor, when masked) without writing the ratios out: made a block at a time
 * on the stack and reduced there, in the same order (hz_masked_ratios' values, hz_norm2's sum). */
float hz_masked_ratio_norm2(const float *g, const float *d, int64_t n, float floor, uint8_t masked) {
    float block[HZ_BLOCK];
    hz_norm_run run = hz_norm_begin(n);
    for (int64_t start = 0; start < n; start += HZ_BLOCK) {
        int64_t count = n - start < HZ_BLOCK ? n - start : HZ_BLOCK;
        const float *gs = g + start, *ds = d + start;
        float *out = block;
        hz_masked_ratios(1, (float **)&gs, (float **)&ds, &out, &count, &floor, &masked);
        hz_norm_feed(&run, block, start, count);
        if (start + count == n) return hz_norm_end_in_block(&run, block, start);
    }
    return 0.0f; /* no elements */
}

/* Adam's update of parameters and momentum, as torch's _foreach_lerp_, _foreach_mul_ and
 * _foreach_addcdiv_ make it: m = m + w (g - m) rounded once (torch's lerp for w < 0.5),
 * p = p * decay when has_decay, p = p + (value * m) / d. With divisor (else NULL), each gradient is
 * first divided by its tensor's divisor[t], as torch's division by a 0-dim float32 tensor rounds it. */
void hz_adam_update(int64_t n, float **params, float **grads, float **exp_avgs, float **dens, const int64_t *numel,
                    float weight, int has_decay, float decay, float value, const float *divisor) {
    for (int64_t t = 0; t < n; t++) {
        float *p = params[t], *m = exp_avgs[t];
        const float *g = grads[t], *d = dens[t];
        const float q = divisor ? divisor[t] : 1.0f;
#define HZ_ADAM_LOOP(G, P)                                 \
    for (int64_t i = 0; i < numel[t]; i++) {               \
        const float mi = fmaf(weight, (G) - m[i], m[i]);   \
        m[i] = mi;                                         \
        p[i] = (P) + (value * mi) / d[i];                  \
    }
        if (divisor && has_decay) {
            HZ_ADAM_LOOP(g[i] / q, p[i] * decay)
        } else if (divisor) {
            HZ_ADAM_LOOP(g[i] / q, p[i])
        } else if (has_decay) {
            HZ_ADAM_LOOP(g[i], p[i] * decay)
        } else {
            HZ_ADAM_LOOP(g[i], p[i])
        }
#undef HZ_ADAM_LOOP
    }
}

/* torch.lerp(start, end, weight) of float32 on the CPU: one fused multiply-add, from the start when
 * |weight| < 0.5 and from the end otherwise (torch chooses on the float32 weight). */
static inline float torch_lerp(float start, float end, float weight) {
    return fabsf(weight) < 0.5f ? fmaf(weight, end - start, start) : fmaf(weight - 1.0f, end - start, end);
}

/* A 1-bit message in units of the update (Messages.write): g clipped to clip_dens * bound (when
 * clip_dens is given), lerped from the momentum by weight (when exp_avgs is given: 1-bit Adam's
 * momentum message), times the tensor's mean denominator, over the element's plain denominator:
 * torch's clip, lerp, multiplication by a 0-dim mean and division, in one pass into out. */
void hz_update_unit_messages(int64_t n, float **grads, float **clip_dens, float **exp_avgs, float **dens, float **out,
                             const int64_t *numel, float bound, float weight, const float *means) {
    for (int64_t t = 0; t < n; t++) {
        const float *g = grads[t], *c = clip_dens ? clip_dens[t] : 0, *m = exp_avgs ? exp_avgs[t] : 0, *d = dens[t];
        float *o = out[t];
        const float mean = means[t];
        for (int64_t i = 0; i < numel[t]; i++) {
            float x = g[i];
            if (c) {
                const float b = c[i] * bound;
                x = nan_max(nan_min(x, b), -b);
            }
            if (m) x = torch_lerp(m[i], x, weight);
            o[i] = (x * mean) / d[i];
        }
    }
}

/* hz_update_unit_messages, and from the same pass each gradient's norm (when g_norms is given) and the norm of
 * its masked ratios g / d (hz_masked_ratio_norm2: 0 where d < floor[t] when masked[t]), both in hz_norm2's
 * order, a block at a time while the block is in cache. */
void hz_update_unit_messages_norms(int64_t n, float **grads, float **clip_dens, float **exp_avgs, float **dens,
                                   float **out, const int64_t *numel, float bound, float weight, const float *means,
                                   const float *floor, const uint8_t *masked, float *g_norms, float *r_norms) {
    float block[HZ_BLOCK];
    for (int64_t t = 0; t < n; t++) {
        const int64_t size = numel[t];
        hz_norm_run g_run = hz_norm_begin(size), r_run = hz_norm_begin(size);
        for (int64_t start = 0; start < size; start += HZ_BLOCK) {
            int64_t count = size - start < HZ_BLOCK ? size - start : HZ_BLOCK;
            float *g = grads[t] + start, *d = dens[t] + start, *o = out[t] + start;
            float *c = clip_dens ? clip_dens[t] + start : 0, *m = exp_avgs ? exp_avgs[t] + start : 0;
            hz_update_unit_messages(1, &g, clip_dens ? &c : 0, exp_avgs ? &m : 0, &d, &o, &count, bound, weight,
                                    means + t);
            if (g_norms) hz_norm_feed(&g_run, g, start, count);
            float *r = block;
            hz_masked_ratios(1, &g, &d, &r, &count, floor + t, masked + t);
            hz_norm_feed(&r_run, block, start, count);
            if (start + count == size) r_norms[t] = hz_norm_end_in_block(&r_run, block, start);
        }
        if (size == 0) r_norms[t] = 0.0f;
        if (g_norms) g_norms[t] = hz_norm_end(&g_run, grads[t]);
    }
}

/* The combined message out of the units of the update, in place: v = (v * d) / mean (torch's
 * multiplication and division by a 0-dim mean); then, when exp_avgs is given, the gradient a
 * combined momentum implies, v = lerp(m, v, weight) with weight 1 / (1 - beta1). */
void hz_from_update_units(int64_t n, float **values, float **dens, float **exp_avgs, const int64_t *numel,
                          const float *means, float weight) {
    for (int64_t t = 0; t < n; t++) {
        float *v = values[t];
        const float *d = dens[t], *m = exp_avgs ? exp_avgs[t] : 0;
        const float mean = means[t];
        for (int64_t i = 0; i < numel[t]; i++) {
            const float x = (v[i] * d[i]) / mean;
            v[i] = m ? torch_lerp(m[i], x, weight) : x;
        }
    }
}

/* hz_from_update_units, and the norm of each result (hz_norm2's order) from the same pass, a block at a time. */
void hz_from_update_units_norms(int64_t n, float **values, float **dens, float **exp_avgs, const int64_t *numel,
                                const float *means, float weight, float *norms) {
    for (int64_t t = 0; t < n; t++) {
        hz_norm_run run = hz_norm_begin(numel[t]);
        for (int64_t start = 0; start < numel[t]; start += HZ_BLOCK) {
            int64_t count = numel[t] - start < HZ_BLOCK ? numel[t] - start : HZ_BLOCK;
            float *v = values[t] + start, *d = dens[t] + start, *m = exp_avgs ? exp_avgs[t] + start : 0;
            hz_from_update_units(1, &v, &d, exp_avgs ? &m : 0, &count, means + t, weight);
            hz_norm_feed(&run, v, start, count);
        }
        norms[t] = hz_norm_end(&run, values[t]);
    }
}

/* out = x - copysign(scale_s, x) on each segment s = [bounds[s], bounds[s + 1]) (compression_error), then
 * times mask when one is given (the two-stage allreduce's masked elements: torch's mul_ by the 0/1 uint8 mask,
 * which it promotes to float32). */
void hz_compression_error(const float *x, int64_t segments, const int64_t *bounds, const float *scales,
                          const uint8_t *mask, float *out) {
    for (int64_t s = 0; s < segments; s++) {
        const float scale = scales[s];
        if (mask) {
            for (int64_t i = bounds[s]; i < bounds[s + 1]; i++) out[i] = (x[i] - copysignf(scale, x[i])) * (float)mask[i];
        } else {
            for (int64_t i = bounds[s]; i < bounds[s + 1]; i++) out[i] = x[i] - copysignf(scale, x[i]);
        }
    }
}

/* x = (x + e) * mask, in place: the worker's y = x + e_w with its masked elements zeroed (torch's add_, mul_). */
void hz_add_masked(float *x, const float *e, const uint8_t *mask, int64_t count) {
    for (int64_t i = 0; i < count; i++) x[i] = (x[i] + e[i]) * (float)mask[i];
}

/* The signs of x packed eight to a byte, first element in the most significant bit, bit 1 where
 * the sign bit is clear (compression.pack_signs); count is a multiple of 8. */
void hz_pack_signs(const float *x, int64_t count, uint8_t *out) {
    for (int64_t j = 0; j < count / 8; j++) {
        uint32_t byte = 0;
        for (int k = 0; k < 8; k++) byte = (byte << 1) | ((~bits_of(x[8 * j + k])) >> 31);
        out[j] = (uint8_t)byte;
    }
}

/* Packs the signs of x as they are written, a block at a time while the block is in cache (hz_pack_signs' bytes):
 * x is cut into chunks of `chunk` elements (a multiple of 8), the signs of chunk k go to row k of out (row_bytes
 * apart), and each call packs every whole byte of x[0 .. written) not packed yet. Blocks are written in order,
 * and a chunk's last block ends at the chunk's end, so no call spans two chunks. */
typedef struct {
    uint8_t *out;
    int64_t chunk, row_bytes, packed;
} hz_sign_run;

static inline void hz_signs_feed(hz_sign_run *r, const float *x, int64_t written) {
    const int64_t upto = written - written % 8;
    if (!r->out || upto <= r->packed) return;
    uint8_t *row = r->out + (r->packed / r->chunk) * r->row_bytes;
    hz_pack_signs(x + r->packed, upto - r->packed, row + (r->packed % r->chunk) / 8);
    r->packed = upto;
}

/* The worker's y = x + e_w in place, segment by segment, and each segment's norm (hz_norm2's order) from the
 * same pass: times mask when one is given (hz_add_masked), else x + e with every element from zero_from on
 * set to 0 (torch's add_, then zero_ of the padding). With signs (else NULL), y's signs are packed into it in
 * the same pass (hz_sign_run: chunks of `chunk` elements, rows row_bytes apart). */
void hz_add_masked_norms(float *x, const float *e, const uint8_t *mask, int64_t zero_from, int64_t segments,
                         const int64_t *bounds, float *norms, uint8_t *signs, int64_t chunk, int64_t row_bytes) {
    hz_sign_run packing = {signs, chunk, row_bytes, 0};
    for (int64_t s = 0; s < segments; s++) {
        const int64_t a = bounds[s], n = bounds[s + 1] - a;
        hz_norm_run run = hz_norm_begin(n);
        for (int64_t start = 0; start < n; start += HZ_BLOCK) {
            const int64_t count = n - start < HZ_BLOCK ? n - start : HZ_BLOCK, first = a + start;
            float *y = x + first;
            if (mask) {
                hz_add_masked(y, e + first, mask + first, count);
            } else {
                for (int64_t i = 0; i < count; i++) y[i] = first + i < zero_from ? x[first + i] + e[first + i] : 0.0f;
            }
            hz_norm_feed(&run, y, start, count);
            hz_signs_feed(&packing, x, first + count);
        }
        norms[s] = hz_norm_end(&run, x + a);
    }
}

/* Eight ints, and eight floats loaded from memory (any alignment) or from eight 0/1 mask bytes. */
typedef int32_t hz_ints8 __attribute__((vector_size(32)));
static inline hz_lanes8 hz_load8(const float *x) {
    hz_lanes8 v;
    memcpy(&v, x, sizeof v);
    return v;
}
static inline hz_lanes8 hz_mask8(const uint8_t *mask) {
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 9)
    const hz_ints8 m = {mask[0], mask[1], mask[2], mask[3], mask[4], mask[5], mask[6], mask[7]};
    return __builtin_convertvector(m, hz_lanes8); /* one widening and one conversion instruction */
#else /* older compilers: the same values, built a lane at a time */
    const hz_lanes8 m = {(float)mask[0], (float)mask[1], (float)mask[2], (float)mask[3],
                         (float)mask[4], (float)mask[5], (float)mask[6], (float)mask[7]};
    return m;
#endif
}

/* One sign as unpack_signs gives it: +1.0 where bit k (from the most significant) of byte is set, else -1.0. */
static inline float sign_of(unsigned byte, int k) { return (float)((int)((byte >> (7 - k)) & 1u) * 2 - 1); }

/* One segment of signs, as unpack_signs then a multiplication by the scale give them (+-1.0 * scale),
 * for elements first .. first + count of the packed signs: written to out, or added to base (out =
 * base + value; base may be out: the server's sum), then times mask when one is given. Whole bytes at
 * a time between a ragged head and tail, without branches on the signs (random signs defeat a branch
 * predictor). */
static inline void decompress_span(const uint8_t *packed, int64_t first, int64_t count, float scale,
                                   const float *base, const uint8_t *mask, float *out) {
    int64_t i = 0;
    for (; i < count && ((first + i) & 7); i++) {
        float v = sign_of(packed[(first + i) >> 3], (int)((first + i) & 7)) * scale;
        v = base ? base[i] + v : v;
        out[i] = mask ? v * (float)mask[i] : v;
    }
    const uint8_t *bytes = packed + ((first + i) >> 3);
    const int64_t whole = (count - i) / 8;
    /* the whole bytes, eight lanes a byte: each lane's +-1.0 from its bit (the sign bit set where the bit is
     * clear), then the same products and sums as above, each lane rounded on its own; one loop per form of out */
    const hz_ints8 lane_bit = {128, 64, 32, 16, 8, 4, 2, 1};
    const hz_ints8 one_bits = {0x3f800000, 0x3f800000, 0x3f800000, 0x3f800000,
                               0x3f800000, 0x3f800000, 0x3f800000, 0x3f800000};
#define HZ_WHOLE_BYTES(EXPR)                                                      \
    for (int64_t b = 0; b < whole; b++, i += 8) {                                 \
        const hz_ints8 clear = (lane_bit & (int32_t)bytes[b]) == 0; /* -1 or 0 */ \
        const hz_ints8 sign_bits = one_bits | (clear & INT32_MIN);                \
        hz_lanes8 v, w;                                                           \
        memcpy(&v, &sign_bits, sizeof v);                                         \
        v = v * scale;                                                            \
        w = (EXPR);                                                               \
        memcpy(out + i, &w, sizeof w);                                            \
    }
    if (base && mask) {
        HZ_WHOLE_BYTES((hz_load8(base + i) + v) * hz_mask8(mask + i))
    } else if (base) {
        HZ_WHOLE_BYTES(hz_load8(base + i) + v)
    } else if (mask) {
        HZ_WHOLE_BYTES(v * hz_mask8(mask + i))
    } else {
        HZ_WHOLE_BYTES(v)
    }
#undef HZ_WHOLE_BYTES
    for (; i < count; i++) {
        float v = sign_of(packed[(first + i) >> 3], (int)((first + i) & 7)) * scale;
        v = base ? base[i] + v : v;
        out[i] = mask ? v * (float)mask[i] : v;
    }
}

/* out = C[x] from packed signs and segment scales (compression.decompress), times mask when one is given. */
void hz_decompress(const uint8_t *packed, int64_t segments, const int64_t *bounds, const float *scales,
                   const uint8_t *mask, float *out) {
    for (int64_t s = 0; s < segments; s++)
        decompress_span(packed, bounds[s], bounds[s + 1] - bounds[s], scales[s], 0, mask ? mask + bounds[s] : 0,
                        out + bounds[s]);
}

/* The server's sum of its chunk (the two-stage allreduce): out = C_0 + error, then + C_1, ... + C_{p-1}
 * in rank order, C_r decompressed from row r of packed (row_bytes apart) with scales[r * segments + s],
 * then times mask when one is given: torch's copies[0].add_(error), then copies[0].add_(copies[r]) row by
 * row, then mul_ by the mask, the same roundings. */
void hz_decompress_sum(const uint8_t *packed, int64_t rows, int64_t row_bytes, int64_t segments, const int64_t *bounds,
                       const float *scales, const float *error, const uint8_t *mask, float *out) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t s = 0; s < segments; s++) {
            const int64_t a = bounds[s];
            decompress_span(packed + r * row_bytes, a, bounds[s + 1] - a, scales[r * segments + s],
                            r == 0 ? error + a : out + a, (mask && r == rows - 1) ? mask + a : 0, out + a);
        }
}

/* hz_decompress_sum a block at a time, every row's copy added into the block while it is in cache (each
 * element sees the same operations in the same order), then, without a mask, 0 from zero_from on (torch's
 * zero_ of the padding), and each segment's norm of the result (hz_norm2's order) into norms. With signs
 * (else NULL), the result's signs are packed into it in the same pass (one chunk: the whole of out). */
void hz_decompress_sum_norms(const uint8_t *packed, int64_t rows, int64_t row_bytes, int64_t segments,
                             const int64_t *bounds, const float *scales, const float *error, const uint8_t *mask,
                             int64_t zero_from, float *out, float *norms, uint8_t *signs) {
    hz_sign_run packing = {signs, bounds[segments] > 0 ? bounds[segments] : 1, 0, 0};
    for (int64_t s = 0; s < segments; s++) {
        const int64_t a = bounds[s], n = bounds[s + 1] - a;
        hz_norm_run run = hz_norm_begin(n);
        for (int64_t start = 0; start < n; start += HZ_BLOCK) {
            const int64_t count = n - start < HZ_BLOCK ? n - start : HZ_BLOCK, first = a + start;
            for (int64_t r = 0; r < rows; r++)
                decompress_span(packed + r * row_bytes, first, count, scales[r * segments + s],
                                r == 0 ? error + first : out + first, (mask && r == rows - 1) ? mask + first : 0,
                                out + first);
            if (!mask)
                for (int64_t i = zero_from > first ? zero_from - first : 0; i < count; i++) out[first + i] = 0.0f;
            hz_norm_feed(&run, out + first, start, count);
            hz_signs_feed(&packing, out, first + count);
        }
        norms[s] = hz_norm_end(&run, out + a);
    }
}

/* 0/1 Adam's sync (_local_phase.apply_sync) in one pass: p = synced * decay[t] - u (torch's copy, mul_
 * and sub_, as hz_scaled_difference); where moved[t], the momentum re-estimated, m = 0 + (scale[t] * u) * d
 * (torch's zero_ then addcmul_, whose multiply-add is fused: one rounding, and a product that
 * underflows to -0 stays -0); and last synced = p (the copy of the new synced parameters). */
void hz_apply_sync(int64_t n, float **params, float **synced, float **us, float **exp_avgs, float **dens,
                   const int64_t *numel, const float *decay, const float *scale, const uint8_t *moved) {
    for (int64_t t = 0; t < n; t++) {
        float *p = params[t], *s = synced[t], *m = exp_avgs[t];
        const float *u = us[t], *d = dens[t];
        const float f = decay[t], c = scale[t];
        if (moved[t]) {
            for (int64_t i = 0; i < numel[t]; i++) {
                const float x = s[i] * f - u[i];
                m[i] = fmaf(c * u[i], d[i], 0.0f);
                p[i] = x;
                s[i] = x;
            }
        } else {
            for (int64_t i = 0; i < numel[t]; i++) {
                const float x = s[i] * f - u[i];
                p[i] = x;
                s[i] = x;
            }
        }
    }
}
