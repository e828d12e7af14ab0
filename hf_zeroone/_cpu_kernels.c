/* Fused element-wise loops for hf_zeroone's CPU step (see _cpu_kernels.py).
 *
 * Each function walks a list of n float32 tensors (pointers and element counts) and does in one
 * pass what torch does in several. Every operation is IEEE float32 arithmetic that torch's own
 * CPU kernels also round exactly (division, multiplication, addition, comparison), in torch's
 * order, so the results are torch's bit for bit: the build turns off contraction into fused
 * multiply-adds (-ffp-contract=off), and _cpu_kernels.py checks the bits once per process before
 * it uses a loaded library. Square roots stay in torch (its vectorised sqrt is not always the
 * correctly rounded one a C sqrtf gives). Where torch itself fuses (its lerp is one fused
 * multiply-add), the loop calls fmaf, which rounds once as the instruction does.
 */
#include <math.h>
#include <stdint.h>

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

/* out = 0 + (scale[t] * a) * b: torch's zero_ then addcmul_ (a sync's momentum m = c1 d u / sum(lr)),
 * whose multiply-add is fused: one rounding, and a product that underflows to -0 stays -0. */
void hz_scaled_product(int64_t n, float **out, float **a, float **b, const int64_t *numel, const float *scale) {
    for (int64_t t = 0; t < n; t++) {
        float *o = out[t];
        const float *x = a[t], *y = b[t];
        const float s = scale[t];
        for (int64_t i = 0; i < numel[t]; i++) o[i] = fmaf(s * x[i], y[i], 0.0f);
    }
}

/* 1 when no element of any tensor is NaN or infinite (an exponent of all ones), else 0. */
int hz_all_finite(int64_t n, float **tensors, const int64_t *numel) {
    uint32_t special = 0;
    for (int64_t t = 0; t < n; t++) {
        const uint32_t *x = (const uint32_t *)tensors[t];
        uint32_t found = 0;
        for (int64_t i = 0; i < numel[t]; i++) found |= (uint32_t)((x[i] & 0x7f800000u) == 0x7f800000u);
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

/* Adam's update of parameters and momentum, as torch's _foreach_lerp_, _foreach_mul_ and
 * _foreach_addcdiv_ make it: m = m + w (g - m) rounded once (torch's lerp for w < 0.5),
 * p = p * decay when has_decay, p = p + (value * m) / d. */
void hz_adam_update(int64_t n, float **params, float **grads, float **exp_avgs, float **dens, const int64_t *numel,
                    float weight, int has_decay, float decay, float value) {
    for (int64_t t = 0; t < n; t++) {
        float *p = params[t], *m = exp_avgs[t];
        const float *g = grads[t], *d = dens[t];
        if (has_decay) {
            for (int64_t i = 0; i < numel[t]; i++) {
                const float mi = fmaf(weight, g[i] - m[i], m[i]);
                m[i] = mi;
                p[i] = p[i] * decay + (value * mi) / d[i];
            }
        } else {
            for (int64_t i = 0; i < numel[t]; i++) {
                const float mi = fmaf(weight, g[i] - m[i], m[i]);
                m[i] = mi;
                p[i] = p[i] + (value * mi) / d[i];
            }
        }
    }
}
