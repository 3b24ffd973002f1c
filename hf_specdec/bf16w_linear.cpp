// y[m, n] = sum_k x[m, k] * float(w[n, k]) + bias[n]: weights stored in bfloat16, arithmetic in float32.
//
// A decode step or a verification multiplies a few rows by each weight; on a CPU that is bound by
// reading the weights, so the rows should cost what one row costs. Weight rows are read in pairs,
// once, and kept in L1 while every block of up to 6 input rows passes over them; a weight is widened
// to float32 in a register (bf16 is float32's upper half) and the products are float32 FMAs, so a CPU
// without bf16 arithmetic (AVX2, AVX-512 without BF16) runs it at float32 speed on half the bytes.
// A pair's two rows are interleaved in blocks of 8 (`pack`), so a thread reads one stream.
//
// Every output is summed in one fixed order (8 lanes over k, then the lanes), whatever the number of
// rows beside it: a row's result is bit-identical at any width or batch, so a verification of k + 1
// tokens computes exactly what k + 1 one-token steps would, and a prompt's forward what the prompt's
// positions compute beside drafts or other requests. A wide forward (a prompt) walks its rows in
// tiles that stay in L2 while a group of weight pairs that stays there too passes over them: the
// same sums in another order of outputs.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <immintrin.h>

namespace {

constexpr int64_t ROW_BLOCK = 6;  // input rows a pass over a weight pair serves: 12 of AVX2's 16 registers
// weights fetched this far ahead of their use (8 KB): on 2-core Xeon/EPYC VMs one core's stream stalls on
// its misses without it (1536 -> 8960 at one row: 1.48 ms with it, 1.90 without; oneDNN float32 2.61)
constexpr int64_t PREFETCH = 4096;
// a wide forward's blocking: weight pairs a group holds, and input rows a tile holds (a multiple of
// ROW_BLOCK), each about this many bytes
constexpr int64_t WEIGHT_GROUP_BYTES = 256 * 1024;
constexpr int64_t ROW_TILE_BYTES = 128 * 1024;

__attribute__((target("avx2,fma"))) inline float lanes_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

__attribute__((target("avx2,fma"))) inline __m256 widen(const uint16_t* w) {
  __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

// x [R, K] (row stride K) by N rows of weights w, interleaved by 8 -> y [R, N] (row stride ldy)
template <int R, int N>
__attribute__((target("avx2,fma"))) void block(const float* x, const uint16_t* w, float* y, int64_t K, int64_t ldy) {
  __m256 acc[R][N];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < N; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wk[N];
    _mm_prefetch(reinterpret_cast<const char*>(w + k * N + PREFETCH), _MM_HINT_T0);
    for (int j = 0; j < N; ++j) wk[j] = widen(w + k * N + j * 8);
    for (int r = 0; r < R; ++r) {
      __m256 xk = _mm256_loadu_ps(x + r * K + k);
      for (int j = 0; j < N; ++j) acc[r][j] = _mm256_fmadd_ps(xk, wk[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < N; ++j) y[r * ldy + j] = lanes_sum(acc[r][j]);
}

template <int N>
void rows(const float* x, const uint16_t* w, float* y, int64_t M, int64_t K, int64_t ldy) {
  int64_t r = 0;
  for (; r + ROW_BLOCK <= M; r += ROW_BLOCK) block<ROW_BLOCK, N>(x + r * K, w, y + r * ldy, K, ldy);
  switch (M - r) {
    case 5: block<5, N>(x + r * K, w, y + r * ldy, K, ldy); break;
    case 4: block<4, N>(x + r * K, w, y + r * ldy, K, ldy); break;
    case 3: block<3, N>(x + r * K, w, y + r * ldy, K, ldy); break;
    case 2: block<2, N>(x + r * K, w, y + r * ldy, K, ldy); break;
    case 1: block<1, N>(x + r * K, w, y + r * ldy, K, ldy); break;
  }
}

}  // namespace

// weight [N, K] bfloat16, K a multiple of 8 -> the same numbers with each pair of rows interleaved in
// blocks of 8 (a last odd row as it is), the layout `linear` reads
torch::Tensor pack(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kBFloat16 && weight.size(1) % 8 == 0,
              "weight must be a bfloat16 matrix [N, K] with K a multiple of 8");
  const int64_t N = weight.size(0), K = weight.size(1), pairs = N / 2;
  auto paired = weight.narrow(0, 0, 2 * pairs).reshape({pairs, 2, K / 8, 8}).transpose(1, 2).reshape({2 * pairs, K});
  return torch::cat({paired, weight.narrow(0, 2 * pairs, N - 2 * pairs)}).contiguous();
}

// x [M, K] float32, packed weight [N, K] (`pack`), bias [N] float32 or None -> [M, N] float32
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "x must be a contiguous float32 matrix [M, K]");
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == torch::kBFloat16 && packed.is_contiguous() &&
                  packed.size(1) == x.size(1) && x.size(1) % 8 == 0,
              "packed must be a packed bfloat16 weight [N, K] with x's K, a multiple of 8");
  TORCH_CHECK(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"), "this CPU has no AVX2 and FMA");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  const int64_t group = std::max<int64_t>(1, WEIGHT_GROUP_BYTES / (4 * K));                  // pairs
  const int64_t tile = std::max<int64_t>(1, ROW_TILE_BYTES / (4 * K) / ROW_BLOCK) * ROW_BLOCK;  // rows
  // 64 pairs of rows (384 KB at K = 1536) the least a thread takes
  at::parallel_for(0, (N + 1) / 2, 64, [&](int64_t begin, int64_t end) {
    for (int64_t g = 2 * begin; g < std::min(2 * end, N); g += 2 * group) {
      const int64_t g_end = std::min({g + 2 * group, 2 * end, N});
      for (int64_t r = 0; r < M; r += tile) {
        const int64_t rows_here = std::min(tile, M - r);
        for (int64_t n = g; n < g_end; n += 2) {
          if (n + 1 < N)
            rows<2>(xp + r * K, wp + n * K, yp + r * N + n, rows_here, K, N);
          else
            rows<1>(xp + r * K, wp + n * K, yp + r * N + n, rows_here, K, N);
        }
      }
    }
  });
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack);
  m.def("linear", &linear);
}
