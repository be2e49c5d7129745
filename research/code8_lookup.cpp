// The 8-bit coding's level lookup alone, three ways, on one core: code8_lookup.py builds and
// runs this and checks every exact way's codes against codes.quantize. Why: the 8-bit step
// misses fused AdamW on one thread, and the question is whether a lookup without gathers could
// close the gap. The kernel's way is the kernel's own code: its source is included here (build
// with -I csrc). Input (binary, from the script): 256 fp32 levels, 255 fp32 midpoints, int32 n,
// n fp32 values in [-1, 1]; args: input path, output path (each way's n int32 codes, in turn),
// rounds. Prints one line per way: name, ns per element (median of rounds).
#include "gefen_cpu.cpp"

#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

namespace code8 {

// the kernel's way: requantize_range's 8-bit coding (two 8-lane gathers of (base, next
// midpoint) per 16 elements from Levels8's 8192-cell grid, reach <= 1), scale 1, no prefetch
void kernel(const float* x, int64_t n, const Levels8& l8, int32_t* out) {
  const float* none = nullptr;
  requantize_range<false>(x, nullptr, 1.0f, n, false, &l8, 0, 0, out, Prefetch(none, none, 0),
                          nullptr);
}

// No memory lookups: a branch-free binary search for the count of midpoints below x, the 255
// midpoints (and +inf) held in registers as the search tree's eight levels (t[s]: level s's
// 2^s nodes), built once per codebook as the kernel's tables are
struct Tree {
  alignas(64) float t[8][128] = {};
  explicit Tree(const std::vector<float>& mids) {
    float tab[256];
    for (int i = 0; i < 256; ++i) tab[i] = i < static_cast<int>(mids.size()) ? mids[i] : INFINITY;
    for (int s = 0; s < 8; ++s) {
      const int bit = 128 >> s;
      for (int j = 0; j < (1 << s); ++j) t[s][j] = tab[j * 2 * bit + bit - 1];
    }
  }
};

void search(const float* x, int64_t n, const Tree& tree, int32_t* out) {
  const auto& t = tree.t;
  const __m512 t0 = _mm512_set1_ps(t[0][0]), t1 = _mm512_loadu_ps(t[1]);
  const __m512 t2 = _mm512_loadu_ps(t[2]), t3 = _mm512_loadu_ps(t[3]), t4 = _mm512_loadu_ps(t[4]);
  const __m512 t5a = _mm512_loadu_ps(t[5]), t5b = _mm512_loadu_ps(t[5] + 16);
  __m512 t6[4], t7[8];
  for (int k = 0; k < 4; ++k) t6[k] = _mm512_loadu_ps(t[6] + 16 * k);
  for (int k = 0; k < 8; ++k) t7[k] = _mm512_loadu_ps(t[7] + 16 * k);
  const __m512i inc = _mm512_set1_epi32(1), b5 = _mm512_set1_epi32(32), b6 = _mm512_set1_epi32(64);
  auto down = [&](__m512i j, __m512 node, __m512 v) {  // one level: j = 2 j + (node < v)
    const __m512i twice = _mm512_add_epi32(j, j);
    return _mm512_mask_add_epi32(twice, _mm512_cmp_ps_mask(node, v, _CMP_LT_OQ), twice, inc);
  };
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    __m512i j = _mm512_maskz_mov_epi32(_mm512_cmp_ps_mask(t0, v, _CMP_LT_OQ), inc);
    j = down(j, _mm512_permutexvar_ps(j, t1), v);
    j = down(j, _mm512_permutexvar_ps(j, t2), v);
    j = down(j, _mm512_permutexvar_ps(j, t3), v);
    j = down(j, _mm512_permutexvar_ps(j, t4), v);
    j = down(j, _mm512_permutex2var_ps(t5a, j, t5b), v);
    const __mmask16 h6 = _mm512_test_epi32_mask(j, b5);
    j = down(j,
             _mm512_mask_blend_ps(h6, _mm512_permutex2var_ps(t6[0], j, t6[1]),
                                  _mm512_permutex2var_ps(t6[2], j, t6[3])),
             v);
    const __mmask16 h7 = _mm512_test_epi32_mask(j, b5), h7b = _mm512_test_epi32_mask(j, b6);
    const __m512 a0 = _mm512_mask_blend_ps(h7, _mm512_permutex2var_ps(t7[0], j, t7[1]),
                                           _mm512_permutex2var_ps(t7[2], j, t7[3]));
    const __m512 a1 = _mm512_mask_blend_ps(h7, _mm512_permutex2var_ps(t7[4], j, t7[5]),
                                           _mm512_permutex2var_ps(t7[6], j, t7[7]));
    j = down(j, _mm512_mask_blend_ps(h7b, a0, a1), v);
    _mm512_storeu_si512(out + i, j);
  }
}

// not a coding: the same pass's load, cell arithmetic and store without any lookup, the floor
// under every way above
void floor_pass(const float* x, int64_t n, int32_t* out) {
  const __m512 one = _mm512_set1_ps(1.0f), half = _mm512_set1_ps(kCells8 / 2);
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    _mm512_storeu_si512(out + i, _mm512_cvttps_epi32(_mm512_mul_ps(_mm512_add_ps(v, one), half)));
  }
}

template <class F>
double timed(F f, int64_t n, int rounds) {
  std::vector<double> t;
  for (int r = 0; r < rounds; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0)
                    .count() / n);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace code8

int main(int argc, char** argv) {
  using namespace code8;
  if (argc != 4) {
    std::fprintf(stderr, "usage: code8_lookup IN OUT ROUNDS\n");
    return 2;
  }
  FILE* in = std::fopen(argv[1], "rb");
  std::vector<float> levels(256), mids(255);
  int32_t n = 0;
  if (!in || std::fread(levels.data(), 4, 256, in) != 256 ||
      std::fread(mids.data(), 4, 255, in) != 255 || std::fread(&n, 4, 1, in) != 1 || n <= 0 ||
      n % 16) {
    std::fprintf(stderr, "bad input %s\n", argv[1]);
    return 2;
  }
  std::vector<float> x(n);
  if (std::fread(x.data(), 4, n, in) != static_cast<size_t>(n)) return 2;
  std::fclose(in);
  const int rounds = std::atoi(argv[3]);
  Levels8 l8;
  levels8(levels.data(), mids.data(), 255, l8);
  if (l8.reach > 1) {
    std::fprintf(stderr, "the codebook's reach is %d: the kernel would not take the gathers\n",
                 l8.reach);
    return 3;
  }
  const Tree tree(mids);
  // passes over a block-sized slice at a time, as the kernel codes one block's m from L1
  constexpr int64_t kBlock = 2048;
  constexpr int kPasses = 64;  // per timed round: a round of one pass is too short to time
  std::vector<int32_t> out(static_cast<size_t>(n) * 3);
  auto over = [&](auto way, int32_t* dst) {
    return [&, way, dst] {
      for (int k = 0; k < kPasses; ++k)
        for (int64_t a = 0; a < n; a += kBlock)
          way(x.data() + a, std::min<int64_t>(kBlock, n - a), dst + a);
    };
  };
  const int64_t elements = kPasses * static_cast<int64_t>(n);
  const double g = timed(
      over([&](const float* s, int64_t m, int32_t* d) { kernel(s, m, l8, d); }, out.data()),
      elements, rounds);
  const double s = timed(
      over([&](const float* s, int64_t m, int32_t* d) { search(s, m, tree, d); }, out.data() + n),
      elements, rounds);
  const double f = timed(
      over([&](const float* s, int64_t m, int32_t* d) { floor_pass(s, m, d); }, out.data() + 2 * n),
      elements, rounds);
  std::printf("gathers %.4f\nsearch %.4f\nfloor %.4f\n", g, s, f);
  FILE* o = std::fopen(argv[2], "wb");
  std::fwrite(out.data(), 4, out.size(), o);
  std::fclose(o);
  return 0;
}
