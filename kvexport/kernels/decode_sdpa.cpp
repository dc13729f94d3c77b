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
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <limits>
#include <utility>
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

#if defined(__AVX512F__)
// A decode step's few query rows over a float cache score sixteen positions at a time: each
// position's products summed lane-wise in one vector of 16, then the sixteen vectors folded into
// one vector of their sixteen sums (four rounds of two-vector shuffles and adds), where dot()
// ends each product in a reduction across its lanes that costs more than its multiplications.
// Only where a vector of 16 floats is one register: elsewhere (AVX2, NEON) the compiler splits its
// shuffles into many, and the fold cost several times what it saved.
#define KVEXPORT_FOLDS_SCORES 1
typedef float Floats16 __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t Ints16 __attribute__((vector_size(kLanes * sizeof(int32_t))));

static inline Floats16 load16(const float* p) {
  Floats16 x;
  std::memcpy(&x, p, sizeof x);
  return x;
}

// Sixteen int8 values as floats: one sign extension and one conversion (GCC converts a vector
// extension type of int8 an element at a time).
static inline Floats16 load16(const int8_t* p) {
  return Floats16(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
}

// Lane o of the fold of a and b, each `groups` groups of `width` lanes (a group: one position's
// partial sums), is lane o % (width / 2) of group o / (width / 2), a's groups before b's, plus the
// lane width / 2 after it: twice the groups, half as wide.
constexpr int fold_lane(int groups, int width, int o) {
  return (o / (width / 2) < groups ? 0 : kLanes) + (o / (width / 2)) % groups * width + o % (width / 2);
}
template <int Groups, int Width, int... O>
static inline Floats16 fold(Floats16 a, Floats16 b, std::integer_sequence<int, O...>) {
#ifdef __clang__
  return __builtin_shufflevector(a, b, fold_lane(Groups, Width, O)...) +
         __builtin_shufflevector(a, b, (fold_lane(Groups, Width, O) + Width / 2)...);
#else
  return __builtin_shuffle(a, b, Ints16{fold_lane(Groups, Width, O)...}) +
         __builtin_shuffle(a, b, Ints16{(fold_lane(Groups, Width, O) + Width / 2)...});
#endif
}

// The sums of sixteen positions' partial-sum vectors; the first `count` of them to scores.
static inline void fold16(const Floats16* part, int64_t count, float* scores) {
  using Lanes = std::make_integer_sequence<int, kLanes>;
  Floats16 half[8], quarter[4], eighth[2];
  for (int j = 0; j < 8; ++j) half[j] = fold<1, 16>(part[2 * j], part[2 * j + 1], Lanes{});
  for (int j = 0; j < 4; ++j) quarter[j] = fold<2, 8>(half[2 * j], half[2 * j + 1], Lanes{});
  for (int j = 0; j < 2; ++j) eighth[j] = fold<4, 4>(quarter[2 * j], quarter[2 * j + 1], Lanes{});
  const Floats16 sums = fold<8, 2>(eighth[0], eighth[1], Lanes{});
  std::memcpy(scores, &sums, count * sizeof(float));
}
#endif

// Positions whose rows are asked for ahead of their use: the CPU's own prefetchers keep too few
// reads in flight for a call whose few rows leave the loads far apart.
constexpr int64_t kAhead = 8;

// Asks for the cache lines of `count` values from p on (a position's rows, every KV head). Called
// behind its caller's bounds check (GCC dropped the prefetches of a lambda that returned early).
template <typename T>
static inline void prefetch_values(const T* p, int64_t count) {
  const char* bytes = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < count * int64_t(sizeof(T)); b += 64) __builtin_prefetch(bytes + b);
}

// A float cache's rows: row r (position p, KV head h: r = p * kv_heads + h) is k + r * d.
struct FloatRows {
  using Key = float;
  using Value = float;
  const float* k;
  const float* v;
  int64_t d;
  // The score from q . (row r's keys as stored).
  float finish(float raw, float, int64_t) const { return raw; }
  // Weight w of value row r becomes the weight of its values as stored, and what it adds to the sum
  // to be subtracted from the accumulated values at the end (none).
  static constexpr bool kOffsets = false;
  float value_weight(float w, int64_t) const { return w; }
  float value_offset(float, int64_t) const { return 0.f; }
};

// An int8 cache's rows as kvexport's --kv-cache int8 writes them (ExecuTorch's per-token scheme):
// row r's value x is (x_q - zero_point[r]) * scale[r]. q . k = scale (q . k_q - zero_point sum(q)),
// and w * value = w scale v_q - w scale zero_point, the second term summed once per row.
struct Int8Rows {
  using Key = int8_t;
  using Value = int8_t;
  const int8_t* k;
  const float* k_scales;
  const int8_t* k_zero_points;
  const int8_t* v;
  const float* v_scales;
  const int8_t* v_zero_points;
  int64_t d;
  float finish(float raw, float q_sum, int64_t r) const {
    return k_scales[r] * (raw - static_cast<float>(k_zero_points[r]) * q_sum);
  }
  static constexpr bool kOffsets = true;
  float value_weight(float w, int64_t r) const { return w * v_scales[r]; }
  float value_offset(float w, int64_t r) const { return w * v_scales[r] * static_cast<float>(v_zero_points[r]); }
};

// A KV head's query rows in a call (its group's heads in each of the T tokens) score a block over a
// transposed copy of its keys once there are enough of them, rather than each summing its own
// products (fold16, or dot()): over transposed keys every multiply-add serves as many positions as
// a vector holds and nothing is reduced across lanes, but the copy costs about d operations a
// position. So at least d / 8 rows (8 for a head of 64, 32 for 256), which a decode step's few
// rows never are.
constexpr int64_t kTransposeSaving = 8;
// Rows that add the values a tile at a time (below) rather than each value row once for all rows.
constexpr int64_t kTiledRows = 8;
constexpr int64_t kTransposed = 64;  // positions per transposed copy (d x 64 floats)
constexpr int64_t kTile = 16;  // positions whose values a query row adds at a time
constexpr int64_t kChunk = 64;  // values of a query row's sums held in registers while it does

// One piece of work: every query row of the call (T tokens x H heads, row r = t * H + h, token t
// attending causally up to position ends[t] - 1) over positions [p0, p1), reading each key and
// value row (all KV heads, contiguous: a piece per KV head would read every third stretch of memory,
// which the CPU's prefetchers serve far worse) once for all of them. Per query row, its scores' max,
// the sum of exp(score - max) and the exp-weighted sum of values; a row none of whose positions
// are in the block gets max -inf and zeros.
template <typename Rows>
static void attend_block(const Rows& rows, const float* q, const float* q_sums, const int64_t* ends, int64_t tokens,
                         int64_t heads, int64_t kv_heads, int64_t d, int64_t p0, int64_t p1, float scale,
                         float* max_out, float* sum_out, float* acc) {
  const int64_t group = heads / kv_heads, n_rows = tokens * heads, block = p1 - p0;
  const int64_t n = std::max<int64_t>(std::min(p1, ends[tokens - 1]) - p0, 0);  // the last token reaches furthest
  // Scratch kept between calls, one per thread, used through plain pointers (a thread_local reached
  // inside a loop can cost a call to find it on every iteration).
  static thread_local std::vector<float> scratch, key_scratch;
  static thread_local std::vector<int64_t> kv_scratch;
  scratch.resize(n_rows * (block + 1));
  float* const scores = scratch.data();  // [n_rows, block]: positions [0, n) written before read
  float* const offsets = scores + n_rows * block;
  std::fill(offsets, offsets + n_rows, 0.f);
  kv_scratch.resize(n_rows);
  int64_t* const kv_of = kv_scratch.data();  // each query row's KV head (no division in the loops)
  for (int64_t r = 0; r < n_rows; ++r) kv_of[r] = (r % heads) / group;
  std::fill(acc, acc + n_rows * d, 0.f);
  auto row_end = [&](int64_t r) { return std::max<int64_t>(std::min(p1, ends[r / heads]) - p0, 0); };
  auto cache_row = [&](int64_t p, int64_t kv_head) { return (p0 + p) * kv_heads + kv_head; };
  // Position p's rows, every KV head's, contiguous from here.
  auto position_rows = [&](const auto* base, int64_t p) { return base + cache_row(p, 0) * d; };
  if (tokens * group * kTransposeSaving >= d) {
    key_scratch.resize(d * kTransposed);
    float* const keys = key_scratch.data();  // [d, kTransposed]
    for (int64_t first = 0; first < n; first += kTransposed) {
      const int64_t width = std::min(kTransposed, n - first);
      for (int64_t kv_head = 0; kv_head < kv_heads; ++kv_head) {
        for (int64_t p = 0; p < width; ++p) {
          if (kv_head == 0 && first + p + kAhead < n)
            prefetch_values(position_rows(rows.k, first + p + kAhead), kv_heads * d);
          const typename Rows::Key* k = rows.k + cache_row(first + p, kv_head) * d;
          for (int64_t i = 0; i < d; ++i) keys[i * kTransposed + p] = static_cast<float>(k[i]);
        }
        for (int64_t t = 0; t < tokens; ++t) {
          for (int64_t h = kv_head * group; h < (kv_head + 1) * group; ++h) {
            const float* qr = q + (t * heads + h) * d;
            float total[kTransposed] = {};
            // kLanes values of q at a time in two interleaved sums, then added to the total: a
            // rounding error of a lane-wise dot product's order, and no chain of adds d long.
            for (int64_t i0 = 0; i0 < d; i0 += kLanes) {
              float even[kTransposed] = {}, odd[kTransposed] = {};
              const int64_t i1 = std::min(i0 + kLanes, d);
              for (int64_t i = i0; i + 1 < i1; i += 2) {
                const float qe = qr[i], qo = qr[i + 1];
                const float *ke = keys + i * kTransposed, *ko = ke + kTransposed;
#pragma omp simd
                for (int64_t p = 0; p < kTransposed; ++p) {
                  even[p] += qe * ke[p];
                  odd[p] += qo * ko[p];
                }
              }
              if ((i1 - i0) % 2) {
                const float ql = qr[i1 - 1];
                const float* kl = keys + (i1 - 1) * kTransposed;
#pragma omp simd
                for (int64_t p = 0; p < kTransposed; ++p) even[p] += ql * kl[p];
              }
#pragma omp simd
              for (int64_t p = 0; p < kTransposed; ++p) total[p] += even[p] + odd[p];
            }
            std::copy(total, total + width, scores + (t * heads + h) * block + first);
          }
        }
      }
    }
  } else {
#if defined(KVEXPORT_FOLDS_SCORES)
    // Positions in the order of memory, each key row read once for all query rows; a row's products
    // with sixteen positions folded into their scores at once (fold16). A head's values past the
    // last whole vector of 16 are added to lane 0.
    static thread_local std::vector<Floats16> part_scratch;
    part_scratch.resize(n_rows * kLanes);
    Floats16* const part = part_scratch.data();  // [n_rows, 16 positions]
    const int64_t whole = d - d % kLanes;
    for (int64_t first = 0; first < n; first += kLanes) {
      const int64_t count = std::min(kLanes, n - first);
      for (int64_t j = 0; j < kLanes; ++j) {
        if (first + j + kAhead < n) prefetch_values(position_rows(rows.k, first + j + kAhead), kv_heads * d);
        for (int64_t r = 0; r < n_rows; ++r) {
          Floats16 sum = {};
          if (j < count) {
            const float* qr = q + r * d;
            const typename Rows::Key* k = rows.k + cache_row(first + j, kv_of[r]) * d;
            for (int64_t i = 0; i < whole; i += kLanes) sum += load16(qr + i) * load16(k + i);
            for (int64_t i = whole; i < d; ++i) sum[0] += qr[i] * static_cast<float>(k[i]);
          }
          part[r * kLanes + j] = sum;
        }
      }
      for (int64_t r = 0; r < n_rows; ++r) fold16(part + r * kLanes, count, scores + r * block + first);
    }
#else
    // A dot product a score where vectors of 16 floats are not one register.
    for (int64_t p = 0; p < n; ++p) {
      for (int64_t t = 0; t < tokens; ++t) {
        for (int64_t h = 0; h < heads; ++h) {
          const int64_t r = t * heads + h;
          scores[r * block + p] = dot(q + r * d, rows.k + cache_row(p, kv_of[r]) * d, d);
        }
      }
    }
#endif
  }
  for (int64_t r = 0; r < n_rows; ++r) {
    const int64_t own = row_end(r), kv_head = kv_of[r];
    float* s = scores + r * block;
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < own; ++p) {
      s[p] = rows.finish(s[p], q_sums[r], cache_row(p, kv_head)) * scale;
      top = std::max(top, s[p]);
    }
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t p = 0; p < own; ++p) {
      s[p] = exp_approx(s[p] - top);
      total += s[p];
    }
    std::fill(s + own, s + n, 0.f);  // past the row's own position
    max_out[r] = top;
    sum_out[r] = total;
  }
  if (tokens * group < kTiledRows) {
    // Few rows: each value row once for all of them, in the order of memory.
    for (int64_t p = 0; p < n; ++p) {
      if (p + kAhead < n) prefetch_values(position_rows(rows.v, p + kAhead), kv_heads * d);
      for (int64_t r = 0; r < n_rows; ++r) {
        const float w = scores[r * block + p];
        if (w == 0.f) continue;  // past the row's position, or underflowed
        const int64_t row = cache_row(p, kv_of[r]);
        const float weight = rows.value_weight(w, row);
        const typename Rows::Value* v = rows.v + row * d;
        float* a = acc + r * d;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) a[i] += weight * static_cast<float>(v[i]);
        if constexpr (Rows::kOffsets) offsets[r] += rows.value_offset(w, row);
      }
    }
  } else {
    // Many rows: each adds a tile of positions' values at a time, kChunk of its sums held in registers
    // across the tile (the tile's value rows stay in the L1 cache for the other rows).
    for (int64_t first = 0; first < n; first += kTile) {
      const int64_t last = std::min(first + kTile, n);
      if (last < n) prefetch_values(position_rows(rows.v, last), std::min(kTile, n - last) * kv_heads * d);  // the next tile
      for (int64_t r = 0; r < n_rows; ++r) {
        const int64_t kv_head = kv_of[r];
        const float* w = scores + r * block;
        float* a = acc + r * d;
        for (int64_t i0 = 0; i0 < d; i0 += kChunk) {
          const int64_t len = std::min(kChunk, d - i0);
          if (len == kChunk) {
            float sum[kChunk] = {};
            for (int64_t p = first; p < last; ++p) {
              if (w[p] == 0.f) continue;  // past the row's position, or underflowed
              const int64_t row = cache_row(p, kv_head);
              const float weight = rows.value_weight(w[p], row);
              const typename Rows::Value* v = rows.v + row * d + i0;
#pragma omp simd
              for (int64_t i = 0; i < kChunk; ++i) sum[i] += weight * static_cast<float>(v[i]);
            }
#pragma omp simd
            for (int64_t i = 0; i < kChunk; ++i) a[i0 + i] += sum[i];
          } else {
            for (int64_t p = first; p < last; ++p) {
              if (w[p] == 0.f) continue;
              const int64_t row = cache_row(p, kv_head);
              const float weight = rows.value_weight(w[p], row);
              const typename Rows::Value* v = rows.v + row * d + i0;
              for (int64_t i = 0; i < len; ++i) a[i0 + i] += weight * static_cast<float>(v[i]);
            }
          }
        }
        if constexpr (Rows::kOffsets) {
          for (int64_t p = first; p < last; ++p) {
            if (w[p] != 0.f) offsets[r] += rows.value_offset(w[p], cache_row(p, kv_head));
          }
        }
      }
    }
  }
  for (int64_t r = 0; r < n_rows; ++r) {
    for (int64_t i = 0; i < d; ++i) acc[r * d + i] -= offsets[r];
  }
}

// The attention of q [1, T, H, D] (rows at positions end - T .. end - 1) over `rows` into out: a
// piece of work per block of positions over the threadpool (kBlock, or smaller where that would
// leave a thread idle), then each query row's partial softmaxes joined, rescaled to the largest
// max (flash-decoding's reduction).
template <typename Rows>
static void attend(const Rows& rows, const float* q, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t d,
                   int64_t end, float scale, float* out) {
  const int64_t n_rows = tokens * heads;
  std::vector<float> q_sums(n_rows, 0.f);
  for (int64_t r = 0; r < n_rows; ++r) {
    for (int64_t i = 0; i < d; ++i) q_sums[r] += q[r * d + i];
  }
  std::vector<int64_t> ends(tokens);
  for (int64_t t = 0; t < tokens; ++t) ends[t] = end - tokens + t + 1;  // causal
  const int64_t threads = std::max<int64_t>(executorch::extension::get_thread_count(), 1);
  int64_t block = kBlock;
  while (block > kTransposed && (end + block - 1) / block < 2 * threads) block /= 2;
  const int64_t blocks = (end + block - 1) / block;
  std::vector<float> maxes(blocks * n_rows), sums(blocks * n_rows), accs(blocks * n_rows * d);
  executorch::extension::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      attend_block(rows, q, q_sums.data(), ends.data(), tokens, heads, kv_heads, d, b * block, (b + 1) * block,
                   scale, maxes.data() + b * n_rows, sums.data() + b * n_rows, accs.data() + b * n_rows * d);
    }
  });
  for (int64_t r = 0; r < n_rows; ++r) {
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t b = 0; b < blocks; ++b) top = std::max(top, maxes[b * n_rows + r]);
    float total = 0.f;
    float* result = out + r * d;
    std::fill(result, result + d, 0.f);
    for (int64_t b = 0; b < blocks; ++b) {
      const float w = std::exp(maxes[b * n_rows + r] - top);  // 0 for a block past the row's end
      total += w * sums[b * n_rows + r];
      const float* a = accs.data() + (b * n_rows + r) * d;
      for (int64_t i = 0; i < d; ++i) result[i] += w * a[i];
    }
    for (int64_t i = 0; i < d; ++i) result[i] /= total;
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
