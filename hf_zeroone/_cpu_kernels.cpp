// torch bindings of the loops in _cpu_kernels.c (see _cpu_kernels.py): lists of tensors in, checked
// and walked here, so a list of hundreds of tensors costs one call from Python and no Python loop.
//
// Every function first checks that it can take its lists: float32, contiguous, on the CPU, the same
// element counts across the lists it pairs, and (when `limit` > 0) no tensor of `limit` elements or
// more (torch would split those over threads). If not, it writes nothing and returns "not taken"
// (an empty optional, or false), and the caller runs torch's operations.
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "_cpu_kernels.c"

namespace {

using Tensors = std::vector<at::Tensor>;

bool overlaps(const at::Tensor& a, const at::Tensor& b);

// Pointers and element counts of `ts`, or false when one does not qualify (see the file's comment).
bool walk(const Tensors& ts, int64_t limit, std::vector<float*>& ptrs, std::vector<int64_t>& counts) {
    ptrs.clear();
    counts.clear();
    ptrs.reserve(ts.size());
    counts.reserve(ts.size());
    for (const auto& t : ts) {
        // dense CPU float32 storage of its own: no subclass dispatching in Python (DTensor), no sparse
        // layout, no inference tensor (torch refuses writes to those outside inference mode)
        if (!t.defined() || !t.device().is_cpu() || t.layout() != at::kStrided || !t.has_storage() ||
            t.unsafeGetTensorImpl()->is_python_dispatch() || t.is_inference() || t.scalar_type() != at::kFloat ||
            !t.is_contiguous())
            return false;
        if (limit > 0 && t.numel() >= limit) return false;
        ptrs.push_back(t.data_ptr<float>());
        counts.push_back(t.numel());
    }
    return true;
}

// `walk` for a list paired element by element with `counts` (the same number of tensors and elements).
bool walk_paired(const Tensors& ts, int64_t limit, const std::vector<int64_t>& counts, std::vector<float*>& ptrs) {
    std::vector<int64_t> own;
    return ts.size() == counts.size() && walk(ts, limit, ptrs, own) && own == counts;
}

Tensors empty_like_each(const Tensors& ts, std::vector<float*>& ptrs) {
    Tensors out;
    out.reserve(ts.size());
    ptrs.clear();
    for (const auto& t : ts) {
        out.push_back(at::empty_like(t, at::MemoryFormat::Contiguous));
        ptrs.push_back(out.back().data_ptr<float>());
    }
    return out;
}

// What torch's in-place operations do: autograd sees the tensor as written.
void bump_versions(const Tensors& ts) {
    for (const auto& t : ts) t.unsafeGetTensorImpl()->bump_version();
}

// One float32 per tensor of a list, from a CPU float32 vector (no read of it in Python: a hook's
// hot path reads nothing on the host); empty where `values` does not qualify.
std::vector<float> per_tensor(const at::Tensor& values, size_t count) {
    if (!values.defined() || !values.device().is_cpu() || values.layout() != at::kStrided || !values.has_storage() ||
        values.unsafeGetTensorImpl()->is_python_dispatch() || values.scalar_type() != at::kFloat ||
        values.numel() != (int64_t)count)
        return {};
    at::Tensor dense = values.contiguous();
    const float* v = dense.data_ptr<float>();
    return std::vector<float>(v, v + count);
}

std::vector<float> as_floats(const std::vector<double>& values) {
    return std::vector<float>(values.begin(), values.end());  // rounded to nearest, as torch's scalar operands
}

int all_finite(const Tensors& ts, int64_t limit) {
    std::vector<float*> p;
    std::vector<int64_t> n;
    if (ts.empty() || !walk(ts, limit, p, n)) return -1;
    return hz_all_finite((int64_t)ts.size(), p.data(), n.data());
}

std::optional<Tensors> split_denominators(const Tensors& roots, double root_c2, const at::Tensor& scales, double eps,
                                          int64_t limit) {
    std::vector<float*> r, o;
    std::vector<int64_t> n;
    auto s = per_tensor(scales, roots.size());
    if (roots.empty() || s.empty() || !walk(roots, limit, r, n)) return std::nullopt;
    Tensors plain = empty_like_each(roots, o);
    hz_split_denominators((int64_t)roots.size(), r.data(), o.data(), n.data(), (float)root_c2, s.data(), (float)eps);
    bump_versions(roots);
    return plain;
}

bool plain_denominators(const Tensors& roots, double root_c2, double eps, int64_t limit) {
    std::vector<float*> r;
    std::vector<int64_t> n;
    if (roots.empty() || !walk(roots, limit, r, n)) return false;
    hz_plain_denominators((int64_t)roots.size(), r.data(), n.data(), (float)root_c2, (float)eps);
    bump_versions(roots);
    return true;
}

bool scaled_denominators(const Tensors& roots, const at::Tensor& scales, double eps, int64_t limit) {
    std::vector<float*> r;
    std::vector<int64_t> n;
    auto s = per_tensor(scales, roots.size());
    if (roots.empty() || s.empty() || !walk(roots, limit, r, n)) return false;
    hz_scaled_denominators((int64_t)roots.size(), r.data(), n.data(), s.data(), (float)eps);
    bump_versions(roots);
    return true;
}

std::optional<Tensors> clip_to_bounds(const Tensors& grads, const Tensors& dens, double bound, int64_t limit) {
    std::vector<float*> g, d, o;
    std::vector<int64_t> n;
    if (grads.empty() || !walk(grads, limit, g, n) || !walk_paired(dens, limit, n, d)) return std::nullopt;
    Tensors out = empty_like_each(grads, o);
    hz_clip_to_bounds((int64_t)grads.size(), g.data(), d.data(), o.data(), n.data(), (float)bound);
    return out;
}

// The 2-norm of each g / d, set to 0 where d < floor in the masked tensors, as torch computes it, without keeping the
// ratios: with `own_norm` in hz_norm2's order (which the caller has checked against torch's in this process), a block
// at a time on the stack (hz_masked_ratio_norm2); otherwise each is written into one scratch buffer in turn and
// reduced there by torch's own norm (the kernel that torch._foreach_norm runs tensor by tensor on the CPU).
std::optional<at::Tensor> masked_ratio_norms(const Tensors& grads, const Tensors& dens, const at::Tensor& floors_,
                                             const std::vector<bool>& masked, bool own_norm, int64_t limit) {
    std::vector<float*> g, d;
    std::vector<int64_t> n;
    auto floors = per_tensor(floors_, grads.size());
    if (grads.empty() || floors.empty() || masked.size() != grads.size() || !walk(grads, limit, g, n) ||
        !walk_paired(dens, limit, n, d))
        return std::nullopt;
    at::Tensor norms = at::empty({(int64_t)grads.size()}, grads[0].options());
    float* out = norms.data_ptr<float>();
    if (own_norm) {  // no scratch: the ratios are reduced a block at a time as they are made
        for (size_t t = 0; t < grads.size(); t++)
            out[t] = hz_masked_ratio_norm2(g[t], d[t], n[t], floors[t], masked[t]);
        return norms;
    }
    const int64_t largest = *std::max_element(n.begin(), n.end());
    at::Tensor scratch = at::empty({largest}, grads[0].options().memory_format(at::MemoryFormat::Contiguous));
    float* s = scratch.data_ptr<float>();
    for (size_t t = 0; t < grads.size(); t++) {
        const float f = floors[t];
        const uint8_t flag = masked[t] ? 1 : 0;
        hz_masked_ratios(1, &g[t], &d[t], &s, &n[t], &f, &flag);
        out[t] = at::linalg_vector_norm(scratch.narrow(0, 0, n[t]), 2).item<float>();
    }
    return norms;
}

// The 2-norm of each tensor by hz_norm2 (a float32 vector); the caller has checked its order against torch's.
std::optional<at::Tensor> norms(const Tensors& ts, int64_t limit) {
    std::vector<float*> p;
    std::vector<int64_t> n;
    if (ts.empty() || !walk(ts, limit, p, n)) return std::nullopt;
    at::Tensor out = at::empty({(int64_t)ts.size()}, ts[0].options());
    float* o = out.data_ptr<float>();
    for (size_t t = 0; t < ts.size(); t++) o[t] = hz_norm2(p[t], n[t]);
    return out;
}

// divisors (optional): one float32 per tensor, each gradient divided by its own first.
bool adam_update(const Tensors& params, const Tensors& grads, const Tensors& exp_avgs, const Tensors& dens,
                 double weight, double decay, double value, const std::optional<at::Tensor>& divisors,
                 int64_t limit) {
    std::vector<float*> p, g, m, d;
    std::vector<int64_t> n;
    std::vector<float> q = divisors.has_value() ? per_tensor(*divisors, params.size()) : std::vector<float>();
    if (params.empty() || (divisors.has_value() && q.empty()) || !walk(params, limit, p, n) ||
        !walk_paired(grads, limit, n, g) || !walk_paired(exp_avgs, limit, n, m) || !walk_paired(dens, limit, n, d))
        return false;
    hz_adam_update((int64_t)params.size(), p.data(), g.data(), m.data(), d.data(), n.data(), (float)weight,
                   decay != 1.0, (float)decay, (float)value, q.empty() ? nullptr : q.data());
    bump_versions(params);
    bump_versions(exp_avgs);
    return true;
}

// out = a * factor - b (hz_scaled_difference).
bool scaled_difference(const Tensors& outs, const Tensors& a, const Tensors& b, const std::vector<double>& factors,
                       int64_t limit) {
    std::vector<float*> o, x, y;
    std::vector<int64_t> n;
    if (outs.empty() || factors.size() != outs.size() || !walk(outs, limit, o, n) || !walk_paired(a, limit, n, x) ||
        !walk_paired(b, limit, n, y))
        return false;
    auto f = as_floats(factors);
    hz_scaled_difference((int64_t)outs.size(), o.data(), x.data(), y.data(), n.data(), f.data());
    bump_versions(outs);
    return true;
}

// a * factor - b into new tensors (hz_scaled_difference), allocated here: hundreds of small
// allocations cost a third of what torch.empty_like costs from Python.
std::optional<Tensors> scaled_difference_new(const Tensors& a, const Tensors& b, const std::vector<double>& factors,
                                             int64_t limit) {
    std::vector<float*> o, x, y;
    std::vector<int64_t> n;
    if (a.empty() || factors.size() != a.size() || !walk(a, limit, x, n) || !walk_paired(b, limit, n, y))
        return std::nullopt;
    auto f = as_floats(factors);
    Tensors out = empty_like_each(a, o);
    hz_scaled_difference((int64_t)a.size(), o.data(), x.data(), y.data(), n.data(), f.data());
    return out;
}

// The 1-bit message of each gradient or momentum in update units (hz_update_unit_messages); clip_dens and
// exp_avgs may be empty lists (no clipping; a gradient message).
bool update_unit_messages(const Tensors& grads, const Tensors& clip_dens, const Tensors& exp_avgs, const Tensors& dens,
                          const Tensors& outs, double bound, double weight, const at::Tensor& means, int64_t limit) {
    std::vector<float*> g, c, m, d, o;
    std::vector<int64_t> n;
    auto mean = per_tensor(means, grads.size());
    if (grads.empty() || mean.empty() || !walk(grads, limit, g, n) || !walk_paired(dens, limit, n, d) ||
        !walk_paired(outs, limit, n, o) || (!clip_dens.empty() && !walk_paired(clip_dens, limit, n, c)) ||
        (!exp_avgs.empty() && !walk_paired(exp_avgs, limit, n, m)))
        return false;
    hz_update_unit_messages((int64_t)grads.size(), g.data(), c.empty() ? nullptr : c.data(),
                            m.empty() ? nullptr : m.data(), d.data(), o.data(), n.data(), (float)bound, (float)weight,
                            mean.data());
    bump_versions(outs);
    return true;
}

// update_unit_messages, and from the same pass each gradient's norm (with `grad_norms`) and the norm of its masked
// ratios g / d (masked_ratio_norms' own-norm form); the caller has checked hz_norm2's order. Returns (the gradients'
// norms or an undefined tensor, the ratios' norms).
std::optional<std::tuple<at::Tensor, at::Tensor>> update_unit_messages_norms(
    const Tensors& grads, const Tensors& clip_dens, const Tensors& exp_avgs, const Tensors& dens, const Tensors& outs,
    double bound, double weight, const at::Tensor& means, const at::Tensor& floors_, const std::vector<bool>& masked,
    bool grad_norms, int64_t limit) {
    std::vector<float*> g, c, m, d, o;
    std::vector<int64_t> n;
    auto mean = per_tensor(means, grads.size());
    auto floors = per_tensor(floors_, grads.size());
    if (grads.empty() || mean.empty() || floors.empty() || masked.size() != grads.size() ||
        !walk(grads, limit, g, n) || !walk_paired(dens, limit, n, d) || !walk_paired(outs, limit, n, o) ||
        (!clip_dens.empty() && !walk_paired(clip_dens, limit, n, c)) ||
        (!exp_avgs.empty() && !walk_paired(exp_avgs, limit, n, m)))
        return std::nullopt;
    for (size_t t = 0; t < grads.size(); t++)
        if (overlaps(grads[t], outs[t]) || overlaps(dens[t], outs[t]))
            return std::nullopt;  // the ratios read g and d after the message is written
    std::vector<uint8_t> flags(masked.begin(), masked.end());
    at::Tensor r_norms = at::empty({(int64_t)grads.size()}, grads[0].options());
    at::Tensor g_norms = grad_norms ? at::empty({(int64_t)grads.size()}, grads[0].options()) : at::Tensor();
    hz_update_unit_messages_norms((int64_t)grads.size(), g.data(), c.empty() ? nullptr : c.data(),
                                  m.empty() ? nullptr : m.data(), d.data(), o.data(), n.data(), (float)bound,
                                  (float)weight, mean.data(), floors.data(), flags.data(),
                                  grad_norms ? g_norms.data_ptr<float>() : nullptr, r_norms.data_ptr<float>());
    bump_versions(outs);
    return std::make_tuple(g_norms, r_norms);
}

bool from_update_units(const Tensors& values, const Tensors& dens, const Tensors& exp_avgs, const at::Tensor& means,
                       double weight, int64_t limit) {
    std::vector<float*> v, d, m;
    std::vector<int64_t> n;
    auto mean = per_tensor(means, values.size());
    if (values.empty() || mean.empty() || !walk(values, limit, v, n) || !walk_paired(dens, limit, n, d) ||
        (!exp_avgs.empty() && !walk_paired(exp_avgs, limit, n, m)))
        return false;
    hz_from_update_units((int64_t)values.size(), v.data(), d.data(), m.empty() ? nullptr : m.data(), n.data(),
                         mean.data(), (float)weight);
    bump_versions(values);
    return true;
}

// hz_from_update_units and the norm of each result, in one pass (the caller has checked hz_norm2's order).
std::optional<at::Tensor> from_update_units_norms(const Tensors& values, const Tensors& dens, const Tensors& exp_avgs,
                                                  const at::Tensor& means, double weight, int64_t limit) {
    std::vector<float*> v, d, m;
    std::vector<int64_t> n;
    auto mean = per_tensor(means, values.size());
    if (values.empty() || mean.empty() || !walk(values, limit, v, n) || !walk_paired(dens, limit, n, d) ||
        (!exp_avgs.empty() && !walk_paired(exp_avgs, limit, n, m)))
        return std::nullopt;
    at::Tensor norms = at::empty({(int64_t)values.size()}, values[0].options());
    hz_from_update_units_norms((int64_t)values.size(), v.data(), d.data(), m.empty() ? nullptr : m.data(), n.data(),
                               mean.data(), (float)weight, norms.data_ptr<float>());
    bump_versions(values);
    return norms;
}

// A dense contiguous CPU tensor of `dtype` that this file may read or write (see `walk`).
bool plain(const at::Tensor& t, at::ScalarType dtype, int64_t limit) {
    return t.defined() && t.device().is_cpu() && t.layout() == at::kStrided && t.has_storage() &&
           !t.unsafeGetTensorImpl()->is_python_dispatch() && !t.is_inference() && t.scalar_type() == dtype &&
           t.is_contiguous() && !(limit > 0 && t.numel() >= limit);
}

// Whether two tensors' memory overlaps (a kernel that reads one while writing the other elementwise would then
// differ from torch, which may copy first).
bool overlaps(const at::Tensor& a, const at::Tensor& b) {
    if (!a.has_storage() || !b.has_storage() || !a.storage().is_alias_of(b.storage())) return false;
    const auto* a0 = static_cast<const char*>(a.data_ptr());
    const auto* b0 = static_cast<const char*>(b.data_ptr());
    return a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
}

// Segment bounds that run from 0 to `numel`, never decreasing, one more than `scales` holds.
bool valid_bounds(const std::vector<int64_t>& bounds, int64_t numel, int64_t scales) {
    if ((int64_t)bounds.size() != scales + 1 || bounds.front() != 0 || bounds.back() != numel) return false;
    return std::is_sorted(bounds.begin(), bounds.end());
}

std::optional<at::Tensor> pack_signs(const at::Tensor& x, int64_t limit) {
    if (!plain(x, at::kFloat, limit) || x.dim() == 0 || x.size(-1) % 8) return std::nullopt;
    auto shape = x.sizes().vec();
    shape.back() /= 8;
    at::Tensor out = at::empty(shape, x.options().dtype(at::kByte));
    hz_pack_signs(x.data_ptr<float>(), x.numel(), out.data_ptr<uint8_t>());
    return out;
}

// The mask, when given (defined), is uint8 (0/1) and as long as the output; nullptr where none is given.
bool mask_ok(const at::Tensor& mask, int64_t numel, int64_t limit) {
    return !mask.defined() || (plain(mask, at::kByte, limit) && mask.numel() == numel);
}

const uint8_t* mask_ptr(const at::Tensor& mask) { return mask.defined() ? mask.data_ptr<uint8_t>() : nullptr; }

// Where a pass may pack the signs of the numel values it writes (hz_sign_run): an undefined tensor, or rows of
// bytes (rows x row bytes, contiguous), one chunk of numel / rows elements (a multiple of 8) per row, whose signs
// fit in the row and do not overlap the values.
bool signs_ok(const at::Tensor& signs, const at::Tensor& values) {
    if (!signs.defined()) return true;
    if (!plain(signs, at::kByte, 0) || signs.dim() != 2 || signs.size(0) < 1 || overlaps(signs, values)) return false;
    const int64_t chunk = values.numel() / signs.size(0);
    return chunk * signs.size(0) == values.numel() && chunk % 8 == 0 && signs.size(1) * 8 >= chunk;
}

bool compression_error(const at::Tensor& x, const at::Tensor& scales, const std::vector<int64_t>& bounds,
                       const std::optional<at::Tensor>& mask_, const at::Tensor& out, int64_t limit) {
    at::Tensor mask = mask_.value_or(at::Tensor());
    if (!plain(x, at::kFloat, limit) || !plain(out, at::kFloat, limit) || !plain(scales, at::kFloat, 0) ||
        out.numel() != x.numel() || !valid_bounds(bounds, x.numel(), scales.numel()) ||
        !mask_ok(mask, x.numel(), limit) || overlaps(x, out))
        return false;
    hz_compression_error(x.data_ptr<float>(), scales.numel(), bounds.data(), scales.data_ptr<float>(), mask_ptr(mask),
                         out.data_ptr<float>());
    bump_versions({out});
    return true;
}

// packed may be a strided view (the first bytes of each gathered row): its signs are copied together first, an
// eighth of a byte per element.
bool decompress(const at::Tensor& packed, const at::Tensor& scales, const std::vector<int64_t>& bounds,
                const std::optional<at::Tensor>& mask_, const at::Tensor& out, int64_t limit) {
    at::Tensor mask = mask_.value_or(at::Tensor());
    if (!packed.defined() || !plain(out, at::kFloat, limit) || !plain(scales, at::kFloat, 0) ||
        out.numel() != 8 * packed.numel() || !valid_bounds(bounds, out.numel(), scales.numel()) ||
        !mask_ok(mask, out.numel(), limit))
        return false;
    at::Tensor bytes = packed.contiguous();
    if (!plain(bytes, at::kByte, 0)) return false;
    hz_decompress(bytes.data_ptr<uint8_t>(), scales.numel(), bounds.data(), scales.data_ptr<float>(), mask_ptr(mask),
                  out.data_ptr<float>());
    bump_versions({out});
    return true;
}

// Whether the server's sum takes these: rows (P, row bytes), each row's first bytes the packed signs of one copy of
// the chunk; scales: P x segments.
bool sum_takes(const at::Tensor& rows, const at::Tensor& scales, const std::vector<int64_t>& bounds,
               const at::Tensor& error, const at::Tensor& mask, const at::Tensor& out, int64_t limit) {
    return plain(rows, at::kByte, 0) && rows.dim() == 2 && plain(scales, at::kFloat, 0) &&
           plain(error, at::kFloat, limit) && plain(out, at::kFloat, limit) && error.numel() == out.numel() &&
           bounds.size() >= 1 && scales.numel() == rows.size(0) * (int64_t)(bounds.size() - 1) &&
           valid_bounds(bounds, out.numel(), (int64_t)bounds.size() - 1) && rows.size(0) >= 1 &&
           rows.size(1) * 8 >= out.numel() && !overlaps(error, out) && mask_ok(mask, out.numel(), limit);
}

bool decompress_sum(const at::Tensor& rows, const at::Tensor& scales, const std::vector<int64_t>& bounds,
                    const at::Tensor& error, const std::optional<at::Tensor>& mask_, const at::Tensor& out,
                    int64_t limit) {
    at::Tensor mask = mask_.value_or(at::Tensor());
    if (!sum_takes(rows, scales, bounds, error, mask, out, limit)) return false;
    hz_decompress_sum(rows.data_ptr<uint8_t>(), rows.size(0), rows.size(1), (int64_t)bounds.size() - 1, bounds.data(),
                      scales.data_ptr<float>(), error.data_ptr<float>(), mask_ptr(mask), out.data_ptr<float>());
    bump_versions({out});
    return true;
}

// hz_decompress_sum a block at a time, the padding zeroed without a mask, and each segment's norm of the result.
std::optional<at::Tensor> decompress_sum_norms(const at::Tensor& rows, const at::Tensor& scales,
                                               const std::vector<int64_t>& bounds, const at::Tensor& error,
                                               const std::optional<at::Tensor>& mask_, int64_t zero_from,
                                               const at::Tensor& out, const std::optional<at::Tensor>& signs_,
                                               int64_t limit) {
    at::Tensor mask = mask_.value_or(at::Tensor()), signs = signs_.value_or(at::Tensor());
    if (!sum_takes(rows, scales, bounds, error, mask, out, limit) || !signs_ok(signs, out)) return std::nullopt;
    if (signs.defined() && (signs.size(0) != 1 || overlaps(signs, rows) || overlaps(signs, scales) ||
                            overlaps(signs, error) || (mask.defined() && overlaps(signs, mask))))
        return std::nullopt;
    at::Tensor norms = at::empty({(int64_t)bounds.size() - 1}, out.options());
    hz_decompress_sum_norms(rows.data_ptr<uint8_t>(), rows.size(0), rows.size(1), (int64_t)bounds.size() - 1,
                            bounds.data(), scales.data_ptr<float>(), error.data_ptr<float>(), mask_ptr(mask),
                            zero_from, out.data_ptr<float>(), norms.data_ptr<float>(),
                            signs.defined() ? signs.data_ptr<uint8_t>() : nullptr);
    bump_versions({out});
    if (signs.defined()) bump_versions({signs});
    return norms;
}

// x = x + e in place, times the mask when one is given (else 0 from zero_from on), and each segment's norm; with
// signs, x's signs packed into its rows in the same pass (signs_ok), where every chunk's start is a segment's.
std::optional<at::Tensor> add_masked_norms(const at::Tensor& x, const at::Tensor& e,
                                           const std::optional<at::Tensor>& mask_, int64_t zero_from,
                                           const std::vector<int64_t>& bounds, const std::optional<at::Tensor>& signs_,
                                           int64_t limit) {
    at::Tensor mask = mask_.value_or(at::Tensor()), signs = signs_.value_or(at::Tensor());
    if (!plain(x, at::kFloat, limit) || !plain(e, at::kFloat, limit) || e.numel() != x.numel() ||
        !mask_ok(mask, x.numel(), limit) || bounds.size() < 1 ||
        !valid_bounds(bounds, x.numel(), (int64_t)bounds.size() - 1) || overlaps(x, e) || !signs_ok(signs, x) ||
        (signs.defined() && (overlaps(signs, e) || (mask.defined() && overlaps(signs, mask)))))
        return std::nullopt;
    const int64_t rows = signs.defined() ? signs.size(0) : 1, chunk = x.numel() / rows;
    for (int64_t k = 1; signs.defined() && k < rows; k++)  // a block never spans two chunks
        if (!std::binary_search(bounds.begin(), bounds.end(), k * chunk)) return std::nullopt;
    at::Tensor norms = at::empty({(int64_t)bounds.size() - 1}, x.options());
    hz_add_masked_norms(x.data_ptr<float>(), e.data_ptr<float>(), mask_ptr(mask), zero_from,
                        (int64_t)bounds.size() - 1, bounds.data(), norms.data_ptr<float>(),
                        signs.defined() ? signs.data_ptr<uint8_t>() : nullptr, chunk,
                        signs.defined() ? signs.size(1) : 0);
    bump_versions({x});
    if (signs.defined()) bump_versions({signs});
    return norms;
}

// x = (x + e) * mask in place (hz_add_masked).
bool add_masked(const at::Tensor& x, const at::Tensor& e, const at::Tensor& mask, int64_t limit) {
    if (!plain(x, at::kFloat, limit) || !plain(e, at::kFloat, limit) || !plain(mask, at::kByte, limit) ||
        e.numel() != x.numel() || mask.numel() != x.numel())
        return false;
    hz_add_masked(x.data_ptr<float>(), e.data_ptr<float>(), mask.data_ptr<uint8_t>(), x.numel());
    bump_versions({x});
    return true;
}

// 0/1 Adam's sync in one pass (hz_apply_sync); exp_avgs and dens are read and written only where moved.
bool apply_sync(const Tensors& params, const Tensors& synced, const Tensors& us, const Tensors& exp_avgs,
                const Tensors& dens, const std::vector<double>& decays, const std::vector<double>& scales,
                const std::vector<bool>& moved, int64_t limit) {
    std::vector<float*> p, s, u, m, d;
    std::vector<int64_t> n;
    if (params.empty() || decays.size() != params.size() || scales.size() != params.size() ||
        moved.size() != params.size() || !walk(params, limit, p, n) || !walk_paired(synced, limit, n, s) ||
        !walk_paired(us, limit, n, u) || !walk_paired(exp_avgs, limit, n, m) || !walk_paired(dens, limit, n, d))
        return false;
    auto f = as_floats(decays);
    auto c = as_floats(scales);
    std::vector<uint8_t> flags(moved.begin(), moved.end());
    hz_apply_sync((int64_t)params.size(), p.data(), s.data(), u.data(), m.data(), d.data(), n.data(), f.data(),
                  c.data(), flags.data());
    bump_versions(params);
    bump_versions(synced);
    Tensors written;
    for (size_t t = 0; t < exp_avgs.size(); t++)
        if (moved[t]) written.push_back(exp_avgs[t]);
    bump_versions(written);
    return true;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    // Every loop runs with the GIL released: the arguments are converted before and the results
    // after, with the GIL held, and nothing between touches a Python object. The communicator's
    // thread runs the allreduce's loops while the training thread goes on with backward and the
    // hook's Python code; with the GIL held they took turns even where a core was free.
    const auto without_gil = pybind11::call_guard<pybind11::gil_scoped_release>();
    m.def("all_finite", &all_finite, without_gil);
    m.def("split_denominators", &split_denominators, without_gil);
    m.def("plain_denominators", &plain_denominators, without_gil);
    m.def("scaled_denominators", &scaled_denominators, without_gil);
    m.def("clip_to_bounds", &clip_to_bounds, without_gil);
    m.def("masked_ratio_norms", &masked_ratio_norms, without_gil);
    m.def("norms", &norms, without_gil);
    m.def("adam_update", &adam_update, without_gil);
    m.def("scaled_difference", &scaled_difference, without_gil);
    m.def("scaled_difference_new", &scaled_difference_new, without_gil);
    m.def("update_unit_messages", &update_unit_messages, without_gil);
    m.def("from_update_units", &from_update_units, without_gil);
    m.def("pack_signs", &pack_signs, without_gil);
    m.def("compression_error", &compression_error, without_gil);
    m.def("decompress", &decompress, without_gil);
    m.def("decompress_sum", &decompress_sum, without_gil);
    m.def("add_masked", &add_masked, without_gil);
    m.def("apply_sync", &apply_sync, without_gil);
    m.def("from_update_units_norms", &from_update_units_norms, without_gil);
    m.def("decompress_sum_norms", &decompress_sum_norms, without_gil);
    m.def("add_masked_norms", &add_masked_norms, without_gil);
    m.def("update_unit_messages_norms", &update_unit_messages_norms, without_gil);
}
