// flashrt_test_ops: a custom operator with a C++ kernel, as a user's compiled
// library registers one (TORCH_LIBRARY). The test suite loads it with
// torch.ops.load_library, builds a package that calls it, and serves that
// package from Python and from C++, which open this library first.
#include <ATen/ATen.h>
#include <torch/library.h>

namespace {

at::Tensor scale(const at::Tensor& x, double factor) { return x * factor; }

}  // namespace

TORCH_LIBRARY(flashrt_test_ops, m) { m.def("scale(Tensor x, float factor) -> Tensor"); }

// One kernel for every device and for export's meta tensors.
TORCH_LIBRARY_IMPL(flashrt_test_ops, CompositeExplicitAutograd, m) { m.impl("scale", scale); }
