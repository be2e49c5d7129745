// torch binding of the Gefen CUDA kernels: checks what it is handed, launches on the stream it
// is given (Python passes torch.cuda.current_stream(device).cuda_stream). The segment table is
// built in Python (gefen_dist/native_cuda.py) because it changes every step (gradients may be new
// tensors) and is a few hundred rows. Only torch/extension.h and the CUDA runtime are included,
// so the binding also compiles against a CPU build of torch (CI's syntax check).
#include <torch/extension.h>

#include "gefen_cuda.h"

namespace {

void check_table(const at::Tensor& meta, const at::Tensor& hyp, const at::Tensor& prefix) {
  TORCH_CHECK(meta.is_cuda() && hyp.is_cuda() && prefix.is_cuda(),
              "gefen_cuda: meta, hyp and prefix must be CUDA tensors");
  TORCH_CHECK(meta.scalar_type() == at::kLong && meta.dim() == 2 &&
                  meta.size(1) == gefen::kMetaCols && meta.is_contiguous(),
              "gefen_cuda: meta must be contiguous int64 (segments, ", gefen::kMetaCols, ")");
  TORCH_CHECK(hyp.scalar_type() == at::kFloat && hyp.dim() == 2 &&
                  hyp.size(1) == gefen::kHypCols && hyp.size(0) == meta.size(0) &&
                  hyp.is_contiguous(),
              "gefen_cuda: hyp must be contiguous float32 (segments, ", gefen::kHypCols, ")");
  TORCH_CHECK(prefix.scalar_type() == at::kLong && prefix.dim() == 1 &&
                  prefix.size(0) == meta.size(0) + 1 && prefix.is_contiguous(),
              "gefen_cuda: prefix must be contiguous int64 (segments + 1,)");
}

void blocks(const at::Tensor& meta, const at::Tensor& hyp, const at::Tensor& prefix,
            int64_t n_items, int64_t team, int64_t stream) {
  check_table(meta, hyp, prefix);
  const cudaError_t err = gefen::launch_blocks(
      meta.data_ptr<int64_t>(), hyp.data_ptr<float>(), prefix.data_ptr<int64_t>(),
      static_cast<int>(meta.size(0)), n_items, static_cast<int>(team),
      reinterpret_cast<cudaStream_t>(stream));
  TORCH_CHECK(err == cudaSuccess, "gefen_cuda blocks launch: ", cudaGetErrorString(err));
}

void dense(const at::Tensor& meta, const at::Tensor& hyp, const at::Tensor& prefix,
           int64_t n_tiles, int64_t stream) {
  check_table(meta, hyp, prefix);
  const cudaError_t err = gefen::launch_dense(meta.data_ptr<int64_t>(), hyp.data_ptr<float>(),
                                              prefix.data_ptr<int64_t>(),
                                              static_cast<int>(meta.size(0)), n_tiles,
                                              reinterpret_cast<cudaStream_t>(stream));
  TORCH_CHECK(err == cudaSuccess, "gefen_cuda dense launch: ", cudaGetErrorString(err));
}

int dtype_code(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return 0;
    case at::kBFloat16: return 1;
    case at::kHalf: return 2;
    default: TORCH_CHECK(false, "gefen_cuda: unsupported dtype ", t.scalar_type());
  }
  return -1;
}

void histogram(const at::Tensor& g, int64_t start, int64_t block, double head_amax,
               double tail_amax, at::Tensor& counts, int64_t stream) {
  TORCH_CHECK(g.is_cuda() && g.is_contiguous() && g.dim() == 1,
              "gefen_cuda histogram: g must be a contiguous 1-D CUDA tensor");
  TORCH_CHECK(counts.is_cuda() && counts.scalar_type() == at::kLong && counts.dim() == 1 &&
                  counts.is_contiguous() && counts.device() == g.device(),
              "gefen_cuda histogram: counts must be int64 (bins,) on g's device");
  TORCH_CHECK(block >= 1, "gefen_cuda histogram: block must be >= 1");
  const int bins = static_cast<int>(counts.size(0));
  TORCH_CHECK(bins >= 2 && bins <= 8192, "gefen_cuda histogram: 2..8192 bins");
  const cudaError_t err = gefen::launch_histogram(
      g.data_ptr(), dtype_code(g), start, g.numel(), block, static_cast<float>(head_amax),
      static_cast<float>(tail_amax),
      reinterpret_cast<unsigned long long*>(counts.data_ptr<int64_t>()), bins,
      reinterpret_cast<cudaStream_t>(stream));
  TORCH_CHECK(err == cudaSuccess, "gefen_cuda histogram launch: ", cudaGetErrorString(err));
}

void columns(const at::Tensor& meta, const at::Tensor& hyp, int64_t numel, int64_t period,
             int64_t rows_per_chunk, at::Tensor& part_sum, at::Tensor& part_max,
             at::Tensor& denom, at::Tensor& amax_new, at::Tensor& absmax, int64_t bits,
             int64_t stream) {
  TORCH_CHECK(meta.is_cuda() && hyp.is_cuda() && meta.size(0) == 1 && hyp.size(0) == 1 &&
                  meta.scalar_type() == at::kLong && hyp.scalar_type() == at::kFloat &&
                  meta.size(1) == gefen::kMetaCols && hyp.size(1) == gefen::kHypCols &&
                  meta.is_contiguous() && hyp.is_contiguous(),
              "gefen_cuda columns: meta and hyp must be one contiguous table row on the GPU");
  TORCH_CHECK(period >= 1 && numel >= 0 && rows_per_chunk >= 1,
              "gefen_cuda columns: period and rows_per_chunk must be >= 1");
  const int64_t nb = numel < period ? numel : period;
  const int64_t chunks = part_sum.numel() / (nb ? nb : 1);
  TORCH_CHECK(part_sum.scalar_type() == at::kDouble && part_max.scalar_type() == at::kFloat &&
                  part_max.numel() == part_sum.numel() && chunks * nb == part_sum.numel() &&
                  denom.numel() == nb && amax_new.numel() == nb && absmax.numel() == nb &&
                  denom.scalar_type() == at::kFloat && amax_new.scalar_type() == at::kFloat &&
                  absmax.scalar_type() == at::kFloat,
              "gefen_cuda columns: scratch must be double/float (chunks x columns) and float "
              "(columns,)");
  TORCH_CHECK(bits == 4 || bits == 8, "gefen_cuda columns: bits must be 4 or 8");
  const cudaError_t err = gefen::launch_columns(
      meta.data_ptr<int64_t>(), hyp.data_ptr<float>(), numel, period, rows_per_chunk,
      static_cast<int>(chunks), part_sum.data_ptr<double>(), part_max.data_ptr<float>(),
      denom.data_ptr<float>(), amax_new.data_ptr<float>(), absmax.data_ptr<float>(), bits == 4,
      reinterpret_cast<cudaStream_t>(stream));
  TORCH_CHECK(err == cudaSuccess, "gefen_cuda columns launch: ", cudaGetErrorString(err));
}

void cross(const at::Tensor& meta, const at::Tensor& hyp, int64_t n_rows_seg,
           const at::Tensor& row_prefix, int64_t row_items, const at::Tensor& pos_prefix,
           int64_t pos_items, const at::Tensor& col_prefix, int64_t col_items, at::Tensor& part,
           int64_t stream) {
  TORCH_CHECK(meta.is_cuda() && meta.scalar_type() == at::kLong && meta.dim() == 2 &&
                  meta.size(1) == gefen::kXCols && meta.is_contiguous(),
              "gefen_cuda cross: meta must be contiguous int64 (segments, ", gefen::kXCols,
              ") on the GPU");
  TORCH_CHECK(hyp.is_cuda() && hyp.scalar_type() == at::kFloat && hyp.dim() == 2 &&
                  hyp.size(0) == meta.size(0) && hyp.size(1) == gefen::kCrossHypCols &&
                  hyp.is_contiguous(),
              "gefen_cuda cross: hyp must be contiguous float32 (segments, ",
              gefen::kCrossHypCols, ") on the GPU");
  const int64_t n_seg = meta.size(0);
  TORCH_CHECK(n_rows_seg >= 0 && n_rows_seg <= n_seg,
              "gefen_cuda cross: n_rows_seg must be in [0, segments]");
  for (const at::Tensor* t : {&row_prefix, &pos_prefix, &col_prefix})
    TORCH_CHECK(t->is_cuda() && t->scalar_type() == at::kLong && t->dim() == 1 &&
                    t->is_contiguous(),
                "gefen_cuda cross: prefixes must be contiguous int64 on the GPU");
  TORCH_CHECK(row_prefix.size(0) == n_rows_seg + 1 && pos_prefix.size(0) == n_rows_seg + 1 &&
                  col_prefix.size(0) == n_seg - n_rows_seg + 1,
              "gefen_cuda cross: prefixes must have one entry per segment of their kind, plus 1");
  TORCH_CHECK(part.is_cuda() && part.scalar_type() == at::kDouble && part.is_contiguous(),
              "gefen_cuda cross: part must be contiguous float64 on the GPU");
  const cudaError_t err = gefen::launch_cross(
      meta.data_ptr<int64_t>(), hyp.data_ptr<float>(), static_cast<int>(n_seg),
      static_cast<int>(n_rows_seg), row_prefix.data_ptr<int64_t>(), row_items,
      pos_prefix.data_ptr<int64_t>(), pos_items, col_prefix.data_ptr<int64_t>(), col_items,
      part.data_ptr<double>(), reinterpret_cast<cudaStream_t>(stream));
  TORCH_CHECK(err == cudaSuccess, "gefen_cuda cross launch: ", cudaGetErrorString(err));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("blocks", &blocks, "Blocked segments of one step (segment table)");
  m.def("dense", &dense, "B = 1 segments of one step (segment table)");
  m.def("columns", &columns, "One column segment (block size -P) of one step");
  m.def("cross", &cross, "The factor's sums, and factors, of every factored segment of a step");
  m.def("histogram", &histogram, "Add one segment's block-normalised g0 to int64 counts");
  m.attr("META_COLS") = static_cast<int>(gefen::kMetaCols);
  m.attr("HYP_COLS") = static_cast<int>(gefen::kHypCols);
  m.attr("DENSE_TILE") = gefen::kDenseTile;
}
