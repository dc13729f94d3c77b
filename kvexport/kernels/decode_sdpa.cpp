// kvexport::decode_sdpa.out and decode_sdpa_int8.out: the attention of a short call's T query rows
// (a decode step, a verification: q [1, T, H, D], the rows positions end - T .. end - 1, each
// attending causally up to its own) over the first `end` rows of a sequence-major KV cache (k and v
// [1, S, KV heads, D], float32, or int8 with a float32 scale and an int8 zero point per row), the
// work split over blocks of positions and query rows (flash-decoding): each block reads its key and
// value rows for every query head of a row, and the blocks' partial softmaxes are joined at the
// end. ExecuTorch's llama::custom_sdpa splits by query head instead, reading each KV head's rows
// once per query head of its group (docs/performance.md#kvexports-decode-kernel).
// Registered into ExecuTorch's kernel registry when the library loads (kvexport/kernels/__init__.py).
#include <executorch/extension/kernel_util/make_boxed_from_unboxed_functor.h>
#include <executorch/runtime/kernel/kernel_includes.h>
#include <executorch/runtime/kernel/thread_parallel_interface.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace kvexport {

using executorch::aten::Tensor;
using executorch::runtime::KernelRuntimeContext;

constexpr int64_t kBlock = 256;  // positions one piece of work reads

// exp(x) for the softmax, in operations a compiler vectorises (libm's expf is a call per element):
// x = n ln2 + y with n = rint(x / ln2), |y| <= ln2 / 2, e^y by its Taylor series to y^7 (within
// float32 rounding), times 2^n through the exponent bits. x below -87 gives e^-87 (~1.6e-38).
static inline float exp_approx(float x) {
  x = std::max(x, -87.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float y = (x - n * 0.693145751953125f) - n * 1.42860682030941723e-6f;
  float p = 1.0f / 5040;
  p = p * y + 1.0f / 720;
  p = p * y + 1.0f / 120;
  p = p * y + 1.0f / 24;
  p = p * y + 1.0f / 6;
  p = p * y + 0.5f;
  p = p * y + 1.0f;
  p = p * y + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &p, sizeof bits);
  bits += static_cast<int32_t>(n) * (1 << 23);
  std::memcpy(&p, &bits, sizeof bits);
  return p;
}

// q . k over d values (k float, or int8 read as its integer values), summed lane-wise then as a
// tree: a plain reduction compiles to a serial chain of scalar adds per product, which stalls the
// loads of the next keys behind it.
constexpr int64_t kLanes = 16;
template <typename T>
static inline float dot(const float* q, const T* k, int64_t d) {
  float part[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) part[l] += q[i + l] * static_cast<float>(k[i + l]);
  float tail = 0.f;
  for (; i < d; ++i) tail += q[i] * static_cast<float>(k[i]);
  for (int64_t width = kLanes / 2; width >= 1; width /= 2)
    for (int64_t l = 0; l < width; ++l) part[l] += part[l + width];
  return part[0] + tail;
}

template <typename T>
static inline void add_scaled(float* acc, float w, const T* v, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) acc[i] += w * static_cast<float>(v[i]);
}

// A float cache's rows: row r (position p, KV head h: r = p * kv_heads + h) is k + r * d.
struct FloatRows {
  const float* k;
  const float* v;
  int64_t d;
  float score(const float* q, float, int64_t r) const { return dot(q, k + r * d, d); }
  // acc += w * value row r; `offset` gathers what is to be subtracted from acc at the end (none).
  void add_value(float* acc, float w, int64_t r, float&) const { add_scaled(acc, w, v + r * d, d); }
};

// An int8 cache's rows as kvexport's --kv-cache int8 writes them (ExecuTorch's per-token scheme):
// row r's value x is (x_q - zero_point[r]) * scale[r]. q . k = scale (q . k_q - zero_point sum(q)),
// and w * value = w scale v_q - w scale zero_point, the second term summed once per row.
struct Int8Rows {
  const int8_t* k;
  const float* k_scales;
  const int8_t* k_zero_points;
  const int8_t* v;
  const float* v_scales;
  const int8_t* v_zero_points;
  int64_t d;
  float score(const float* q, float q_sum, int64_t r) const {
    return k_scales[r] * (dot(q, k + r * d, d) - static_cast<float>(k_zero_points[r]) * q_sum);
  }
  void add_value(float* acc, float w, int64_t r, float& offset) const {
    const float scaled = w * v_scales[r];
    add_scaled(acc, scaled, v + r * d, d);
    offset += scaled * static_cast<float>(v_zero_points[r]);
  }
};

// One piece of work: one query row's heads over positions [p0, p1) (none where p1 <= p0), reading
// each key and value row (all KV heads, contiguous) once: per query head, its scores' max, the sum of
// exp(score - max), and the exp-weighted sum of values.
template <typename Rows>
static void attend_block(const Rows& rows, const float* q, const float* q_sums, int64_t heads, int64_t kv_heads,
                         int64_t d, int64_t p0, int64_t p1, float scale, float* max_out, float* sum_out, float* acc) {
  const int64_t n = std::max<int64_t>(p1 - p0, 0), group = heads / kv_heads;
  std::fill(acc, acc + heads * d, 0.f);
  if (n == 0) {
    std::fill(max_out, max_out + heads, -std::numeric_limits<float>::infinity());
    std::fill(sum_out, sum_out + heads, 0.f);
    return;
  }
  static thread_local std::vector<float> scores, offsets;
  scores.resize(heads * kBlock);
  offsets.assign(heads, 0.f);
  for (int64_t p = 0; p < n; ++p) {
    for (int64_t h = 0; h < heads; ++h) {
      scores[h * kBlock + p] = rows.score(q + h * d, q_sums[h], (p0 + p) * kv_heads + h / group) * scale;
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    float* s = scores.data() + h * kBlock;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < n; ++p) m = std::max(m, s[p]);
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t p = 0; p < n; ++p) {
      s[p] = exp_approx(s[p] - m);
      total += s[p];
    }
    max_out[h] = m;
    sum_out[h] = total;
  }
  for (int64_t p = 0; p < n; ++p) {
    for (int64_t h = 0; h < heads; ++h) {
      rows.add_value(acc + h * d, scores[h * kBlock + p], (p0 + p) * kv_heads + h / group, offsets[h]);
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t i = 0; i < d; ++i) acc[h * d + i] -= offsets[h];
  }
}

// The attention of q [1, T, H, D] (rows at positions end - T .. end - 1) over `rows` into out: a
// piece of work per block of kBlock positions and query row over the threadpool, then each row's
// partial softmaxes joined, rescaled to the largest max (flash-decoding's reduction).
template <typename Rows>
static void attend(const Rows& rows, const float* q, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t d,
                   int64_t end, float scale, float* out) {
  const int64_t width = heads * d;  // one query row
  std::vector<float> q_sums(tokens * heads, 0.f);
  for (int64_t r = 0; r < tokens * heads; ++r) {
    for (int64_t i = 0; i < d; ++i) q_sums[r] += q[r * d + i];
  }
  const int64_t blocks = (end + kBlock - 1) / kBlock, pieces = blocks * tokens;
  std::vector<float> maxes(pieces * heads), sums(pieces * heads), accs(pieces * width);
  executorch::extension::parallel_for(0, pieces, 1, [&](int64_t first, int64_t last) {
    for (int64_t piece = first; piece < last; ++piece) {
      const int64_t b = piece / tokens, t = piece % tokens, row_end = end - tokens + t + 1;  // causal
      attend_block(rows, q + t * width, q_sums.data() + t * heads, heads, kv_heads, d, b * kBlock,
                   std::min(row_end, (b + 1) * kBlock), scale, maxes.data() + piece * heads, sums.data() + piece * heads,
                   accs.data() + piece * width);
    }
  });
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t b = 0; b < blocks; ++b) m = std::max(m, maxes[(b * tokens + t) * heads + h]);
      float total = 0.f;
      float* row = out + t * width + h * d;
      std::fill(row, row + d, 0.f);
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t piece = b * tokens + t;
        const float w = std::exp(maxes[piece * heads + h] - m);  // 0 for a block past the row's end
        total += w * sums[piece * heads + h];
        const float* a = accs.data() + piece * width + h * d;
        for (int64_t i = 0; i < d; ++i) row[i] += w * a[i];
      }
      for (int64_t i = 0; i < d; ++i) row[i] /= total;
    }
  }
}

// The checks both kernels make: shapes, every query row a position of the cache; `out` resized.
static bool check_call(KernelRuntimeContext& ctx, const Tensor& q, const Tensor& k, const Tensor& v, int64_t end,
                       Tensor& out) {
  using executorch::aten::ScalarType;
  ET_KERNEL_CHECK(ctx, q.scalar_type() == ScalarType::Float && out.scalar_type() == ScalarType::Float,
                  InvalidArgument, false);
  ET_KERNEL_CHECK(ctx, q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.size(0) == 1, InvalidArgument, false);
  const int64_t heads = q.size(2), d = q.size(3), slots = k.size(1), kv_heads = k.size(2);
  ET_KERNEL_CHECK(ctx, k.size(3) == d && v.size(1) == slots && v.size(2) == kv_heads && v.size(3) == d, InvalidArgument,
                  false);
  ET_KERNEL_CHECK(ctx, heads % kv_heads == 0 && end >= q.size(1) && end <= slots, InvalidArgument, false);
  // A program of dynamic shapes plans `out` at its largest; it takes the query's shape here.
  ET_KERNEL_CHECK(ctx, executorch::runtime::resize_tensor(out, q.sizes()) == executorch::runtime::Error::Ok,
                  InvalidArgument, false);
  return true;
}

Tensor& decode_sdpa_out(KernelRuntimeContext& ctx, const Tensor& q, const Tensor& k, const Tensor& v, int64_t end,
                        double scale, Tensor& out) {
  using executorch::aten::ScalarType;
  ET_KERNEL_CHECK(ctx, k.scalar_type() == ScalarType::Float && v.scalar_type() == ScalarType::Float, InvalidArgument, out);
  if (!check_call(ctx, q, k, v, end, out)) return out;
  const FloatRows rows{k.const_data_ptr<float>(), v.const_data_ptr<float>(), q.size(3)};
  attend(rows, q.const_data_ptr<float>(), q.size(1), q.size(2), k.size(2), q.size(3), end, float(scale), out.mutable_data_ptr<float>());
  return out;
}

Tensor& decode_sdpa_int8_out(KernelRuntimeContext& ctx, const Tensor& q, const Tensor& k, const Tensor& k_scales,
                             const Tensor& k_zero_points, const Tensor& v, const Tensor& v_scales,
                             const Tensor& v_zero_points, int64_t end, double scale, Tensor& out) {
  using executorch::aten::ScalarType;
  ET_KERNEL_CHECK(ctx, k.scalar_type() == ScalarType::Char && v.scalar_type() == ScalarType::Char &&
                  k_scales.scalar_type() == ScalarType::Float && v_scales.scalar_type() == ScalarType::Float &&
                  k_zero_points.scalar_type() == ScalarType::Char && v_zero_points.scalar_type() == ScalarType::Char,
                  InvalidArgument, out);
  // One scale and zero point per row: [1, S, KV, 1].
  const int64_t per_row = k.size(1) * k.size(2);
  ET_KERNEL_CHECK(ctx, k_scales.numel() == per_row && v_scales.numel() == per_row && k_zero_points.numel() == per_row &&
                  v_zero_points.numel() == per_row, InvalidArgument, out);
  if (!check_call(ctx, q, k, v, end, out)) return out;
  const Int8Rows rows{k.const_data_ptr<int8_t>(), k_scales.const_data_ptr<float>(), k_zero_points.const_data_ptr<int8_t>(),
                      v.const_data_ptr<int8_t>(), v_scales.const_data_ptr<float>(), v_zero_points.const_data_ptr<int8_t>(),
                      q.size(3)};
  attend(rows, q.const_data_ptr<float>(), q.size(1), q.size(2), k.size(2), q.size(3), end, float(scale), out.mutable_data_ptr<float>());
  return out;
}

}  // namespace kvexport

EXECUTORCH_LIBRARY(kvexport, "decode_sdpa.out", kvexport::decode_sdpa_out);
EXECUTORCH_LIBRARY(kvexport, "decode_sdpa_int8.out", kvexport::decode_sdpa_int8_out);
