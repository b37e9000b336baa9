// Torch bindings of block_diag.cu and graph_fills.cu (registered by bindings.cpp's module,
// `register_tensor`). block_diag.cu:
// block_diag's forward into y (the arena's planned bytes, or a new tensor) and its
// backward into one new contiguous tensor per block. runtime/cuda/train_kernels.py
// `BlockDiag` calls them with contiguous CUDA matrices of one 2- or 4-byte dtype; other
// calls go to the reference kernel there, so a failing check here is a caller's bug.
#include <c10/cuda/CUDAGuard.h>

#include "bindings_common.h"

namespace modulec {
namespace bind {
namespace {

// Where each block starts in y: zero_rows[0] rows, block 0, zero_rows[1] rows, block 1, ...
// (zero_rows empty: none), columns one block after another.
Blocks place(const std::vector<std::vector<int64_t>>& shapes,
             const std::vector<int64_t>& zero_rows, int64_t* rows, int64_t* cols) {
  const int64_t n = static_cast<int64_t>(shapes.size());
  TORCH_CHECK(n >= 1 && n <= kMaxBlocks, "block_diag takes 1 to ", kMaxBlocks,
              " matrices, got ", n);
  TORCH_CHECK(zero_rows.empty() || static_cast<int64_t>(zero_rows.size()) == n + 1,
              "zero_rows has ", zero_rows.size(), " entries; ", n + 1, " expected");
  Blocks blocks{};
  blocks.n = static_cast<int>(n);
  int64_t row = zero_rows.empty() ? 0 : zero_rows[0], col = 0, start = 0;
  for (int64_t b = 0; b < n; ++b) {
    TORCH_CHECK(shapes[b].size() == 2, "block_diag matrix ", b, " is not 2-D");
    blocks.row[b] = row;
    blocks.col[b] = col;
    blocks.rows[b] = shapes[b][0];
    blocks.cols[b] = shapes[b][1];
    blocks.start[b] = start;
    start += shapes[b][0] * shapes[b][1];
    row += shapes[b][0] + (zero_rows.empty() ? 0 : zero_rows[b + 1]);
    col += shapes[b][1];
  }
  blocks.start[n] = start;
  *rows = row;
  *cols = col;
  return blocks;
}

void check_bits(const Tensor& t, const char* name, const Tensor& like) {
  check(t, name, like.scalar_type(), like);
  TORCH_CHECK(t.element_size() == 2 || t.element_size() == 4,
              name, ": block_diag's kernels take 2- and 4-byte dtypes, got ", t.scalar_type());
}

Tensor block_diag_forward(const std::vector<Tensor>& xs, const std::vector<int64_t>& zero_rows,
                          const std::optional<Tensor>& out) {
  TORCH_CHECK(!xs.empty(), "block_diag takes at least one matrix");
  std::vector<std::vector<int64_t>> shapes;
  for (const Tensor& x : xs) {
    check_bits(x, "xs", xs[0]);
    shapes.push_back(x.sizes().vec());
  }
  int64_t rows = 0, cols = 0;
  Blocks blocks = place(shapes, zero_rows, &rows, &cols);
  for (size_t b = 0; b < xs.size(); ++b) blocks.ptr[b] = const_cast<void*>(xs[b].data_ptr());
  const c10::cuda::CUDAGuard guard(xs[0].device());
  Tensor y = output({out}, 0, {rows, cols}, xs[0].options());
  check_launch(launch_block_diag_forward(static_cast<int>(xs[0].element_size()), blocks,
                                         y.data_ptr(), rows, cols, stream()),
               "block_diag forward");
  return y;
}

std::vector<Tensor> block_diag_backward(const Tensor& d_y,
                                        const std::vector<std::vector<int64_t>>& shapes,
                                        const std::vector<int64_t>& zero_rows) {
  check_bits(d_y, "d_y", d_y);
  int64_t rows = 0, cols = 0;
  Blocks blocks = place(shapes, zero_rows, &rows, &cols);
  TORCH_CHECK(d_y.dim() == 2 && d_y.size(0) == rows && d_y.size(1) == cols, "d_y is ",
              d_y.sizes(), ", the blocks make [", rows, ", ", cols, "]");
  const c10::cuda::CUDAGuard guard(d_y.device());
  std::vector<Tensor> grads;
  for (size_t b = 0; b < shapes.size(); ++b) {
    grads.push_back(at::empty(shapes[b], d_y.options()));
    blocks.ptr[b] = grads.back().data_ptr();
  }
  check_launch(launch_block_diag_backward(static_cast<int>(d_y.element_size()), blocks,
                                          d_y.data_ptr(), cols, stream()),
               "block_diag backward");
  return grads;
}

// A captured graph's memset nodes as fill kernel nodes (kernels/graph_fills.cu): `graph`
// the cudaGraph_t torch's CUDAGraph(keep_graph=True).raw_cuda_graph() gives, before it is
// instantiated. Returns how many were replaced.
int64_t graph_memsets_to_kernels(int64_t graph) {
  int replaced = 0;
  check_launch(modulec::graph_memsets_to_kernels(reinterpret_cast<cudaGraph_t>(graph), &replaced),
               "graph_memsets_to_kernels");
  return replaced;
}

// scaled_copies.cu: the copies of `table` (uint8, `count` ScaledCopy rows, on the device
// the copies' tensors are on; the caller checked their shapes, strides and alignment)
void scaled_copies(const Tensor& table, int64_t count, int64_t most_pieces) {
  TORCH_CHECK(table.is_cuda() && table.scalar_type() == at::kByte && table.is_contiguous() &&
                  table.numel() == count * static_cast<int64_t>(sizeof(ScaledCopy)),
              "scaled_copies: the table must be ", count, " rows of ", sizeof(ScaledCopy),
              " bytes on the GPU");
  const c10::cuda::CUDAGuard guard(table.device());
  check_launch(launch_scaled_copies(reinterpret_cast<const ScaledCopy*>(table.data_ptr()),
                                    static_cast<int>(count), most_pieces, stream()),
               "scaled_copies");
}

}  // namespace

void register_tensor(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("scaled_copies", &scaled_copies,
        "(table [count x 56 bytes on the GPU], count, most_pieces): dst = alpha src each",
        py::arg("table"), py::arg("count"), py::arg("most_pieces"));
  m.def("graph_memsets_to_kernels", &graph_memsets_to_kernels,
        "(cudaGraph_t as an int) -> how many memset nodes became fill kernel nodes",
        py::arg("graph"));
  m.def("block_diag_forward", &block_diag_forward,
        "(xs [2-D, one dtype], zero_rows [n + 1 ints or none], out=None): the matrices along "
        "y's diagonal, zero_rows[i] rows of zeros before matrix i (the last after them all)",
        py::arg("xs"), py::arg("zero_rows"), py::arg("out") = py::none());
  m.def("block_diag_backward", &block_diag_backward,
        "(d_y, shapes, zero_rows): each block of d_y in a new contiguous tensor",
        py::arg("d_y"), py::arg("shapes"), py::arg("zero_rows"));
}

}  // namespace bind
}  // namespace modulec
