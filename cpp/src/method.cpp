// Method: one entry point of a package. Its inputs checked against the
// manifest, the compiled code called with its threaded state (if any), and
// on a CUDA package with graphs on, each input shape captured once and
// replayed. The checks mirror flashrt_build/runtime/call.py, messages included.
#include "internal.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#ifdef FLASHRT_WITH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <algorithm>

namespace flashrt {

namespace detail {

struct Graph {
#ifdef FLASHRT_WITH_CUDA
  std::unique_ptr<at::cuda::CUDAGraph> graph;
#endif
  std::vector<at::Tensor> inputs;  // the run()'s inputs are copied into these
  std::vector<at::Tensor> outputs;  // what the graph writes: copied out on every replay
};

}  // namespace detail

using detail::shape_str;

Method::Impl::Impl() = default;
Method::Impl::~Impl() = default;

void Method::Impl::plan() {
  const auto& inputs = spec->inputs;
  for (const auto& s : inputs) input_names.push_back(s.name);
  const std::string prefix = std::string(detail::kStateKwarg) + ".";
  for (const auto& name : call.order) {
    if (name.rfind(prefix, 0) == 0) {
      slots.push_back(-1 - static_cast<int>(state_in.size()));
      state_in.push_back(shared->state.at(name.substr(prefix.size())));
      continue;
    }
    auto it = std::find_if(inputs.begin(), inputs.end(), [&](const InputSpec& s) { return s.name == name; });
    slots.push_back(static_cast<int>(it - inputs.begin()));
  }
  for (const auto& name : call.state_outputs) state_out.push_back(shared->state.at(name));
  std::vector<std::string> dims;
  for (const auto& input : inputs) {
    static_axes.emplace_back();
    for (size_t axis = 0; axis < input.shape.size(); ++axis) {
      const bool dynamic = std::any_of(input.dynamic.begin(), input.dynamic.end(),
                                       [&](const DynamicDim& d) { return d.axis == static_cast<int64_t>(axis); });
      if (!dynamic) static_axes.back().emplace_back(axis, input.shape[axis]);
    }
    dim_ids.emplace_back();
    for (const auto& d : input.dynamic) {
      auto it = std::find(dims.begin(), dims.end(), d.name);
      dim_ids.back().push_back(static_cast<int>(it - dims.begin()));
      if (it == dims.end()) dims.push_back(d.name);
    }
  }
  n_dims = dims.size();
}

void Method::Impl::drop_graphs() {
  graphs.clear();
  warmed.clear();
  said_full = false;
}

namespace {

// The compiled code's flat inputs: run()'s, with the threaded state in its slots.
// The code reads each input with row-major strides: a non-contiguous one (a
// transpose, an expand) is copied to row-major first; a contiguous one is not.
std::vector<at::Tensor> flat_inputs(const Method::Impl& m, const std::vector<at::Tensor>& inputs) {
  std::vector<at::Tensor> flat;
  flat.reserve(m.slots.size());
  for (int slot : m.slots) flat.push_back(slot >= 0 ? inputs[slot].contiguous() : m.state_in[-1 - slot]);
  return flat;
}

std::vector<int64_t> shape_key(const std::vector<at::Tensor>& inputs) {
  std::vector<int64_t> key;
  for (const auto& t : inputs) {
    const auto sizes = t.sizes();
    key.insert(key.end(), sizes.begin(), sizes.end());
  }
  return key;
}

#ifdef FLASHRT_WITH_CUDA
// Records one call of the compiled code on a side stream. Kernels are
// recorded, not run: the state is not written until the graph is replayed.
std::unique_ptr<detail::Graph> capture(Method::Impl& m, const std::vector<at::Tensor>& inputs) {
  auto g = std::make_unique<detail::Graph>();
  for (const auto& t : inputs) g->inputs.push_back(t.clone(at::MemoryFormat::Contiguous));
  const c10::DeviceIndex index = m.shared->device.index();
  c10::cuda::getCurrentCUDAStream(index).synchronize();  // the copies above, before another stream reads them
  c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(false, index);
  {
    c10::cuda::CUDAStreamGuard guard(side);
    g->graph = std::make_unique<at::cuda::CUDAGraph>();
    // Thread-local: other threads' CUDA work (outside this package's lock) does not break the capture.
    g->graph->capture_begin({0, 0}, cudaStreamCaptureModeThreadLocal);
    try {
      g->outputs = m.loader->boxed_run(flat_inputs(m, g->inputs));
    } catch (...) {
      g->graph->capture_end();
      throw;
    }
    g->graph->capture_end();
  }
  side.synchronize();
  return g;
}
#endif

}  // namespace

std::vector<at::Tensor> Method::Impl::invoke(const std::vector<at::Tensor>& inputs) {
  if (!shared->graphs) return loader->boxed_run(flat_inputs(*this, inputs));
#ifdef FLASHRT_WITH_CUDA
  const auto key = shape_key(inputs);
  auto found = graphs.find(key);
  if (found == graphs.end()) {
    const bool room = graphs.size() < shared->max_graphs;
    if (!room || warmed.insert(key).second) {  // the first call of a shape runs plain: the warm-up
      if (!room && !said_full) {
        said_full = true;
        TORCH_WARN("flashrt: method ", spec->name, " holds ", graphs.size(),
                   " CUDA graphs (serve.max_graphs); inputs of other shapes run without one");
      }
      return loader->boxed_run(flat_inputs(*this, inputs));
    }
    found = graphs.emplace(key, capture(*this, inputs)).first;
  }
  detail::Graph& g = *found->second;
  for (size_t i = 0; i < inputs.size(); ++i) g.inputs[i].copy_(inputs[i], /*non_blocking=*/true);
  g.graph->replay();
  std::vector<at::Tensor> out;
  out.reserve(g.outputs.size());
  for (const auto& t : g.outputs) out.push_back(t.clone());  // the next replay overwrites the graph's own
  return out;
#else
  return loader->boxed_run(flat_inputs(*this, inputs));
#endif
}

Method::Method(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Method::~Method() = default;

std::vector<at::Tensor> Method::run(const std::vector<at::Tensor>& inputs) {
  check_inputs(inputs);
  return call(inputs);
}

std::vector<at::Tensor> Method::run_trusted(const std::vector<at::Tensor>& inputs) {
  check_shapes(inputs);
  return call(inputs);
}

std::vector<at::Tensor> Method::run(const TensorMap& inputs) { return run(ordered(inputs)); }
std::vector<at::Tensor> Method::run_trusted(const TensorMap& inputs) { return run_trusted(ordered(inputs)); }

std::vector<at::Tensor> Method::call(const std::vector<at::Tensor>& inputs) {
  Impl& p = *impl_;
  std::lock_guard<std::mutex> lock(p.shared->calls);
  std::vector<at::Tensor> out = p.invoke(inputs);
  if (!p.state_out.empty()) {
    const size_t n = out.size() - p.state_out.size();
    at::NoGradGuard no_grad;  // the caller's buffers may belong to a module that tracks gradients
    for (size_t i = 0; i < p.state_out.size(); ++i) p.state_out[i].copy_(out[n + i]);
    out.resize(n);
  }
  return out;
}

std::vector<at::Tensor> Method::ordered(const TensorMap& inputs) const {
  const auto& names = impl_->input_names;
  for (const auto& [key, _] : inputs) {
    if (std::find(names.begin(), names.end(), key) != names.end()) continue;
    const auto& constants = impl_->spec->constant_kwargs;
    if (std::find(constants.begin(), constants.end(), key) != constants.end()) {
      throw Error(Error::Kind::Input, "'" + key + "' is a constant keyword argument fixed at build time (" +
                                          impl_->spec->kwargs_key + "." + key + "), not an input");
    }
    throw Error(Error::Kind::Input,
                "input '" + key + "' is not an input of the package; inputs: " + detail::join(names));
  }
  std::vector<at::Tensor> ordered;
  std::vector<std::string> missing;
  for (const auto& name : names) {
    auto it = inputs.find(name);
    if (it == inputs.end()) {
      missing.push_back(name);
    } else {
      ordered.push_back(it->second);
    }
  }
  if (!missing.empty()) throw Error(Error::Kind::Input, "missing inputs: " + detail::join(missing));
  return ordered;
}

const std::string& Method::name() const { return impl_->spec->name; }
const std::vector<InputSpec>& Method::inputs() const { return impl_->spec->inputs; }
const std::vector<std::string>& Method::output_names() const { return impl_->call.outputs; }
std::vector<std::string> Method::constant_fqns() const { return impl_->loader->get_constant_fqns(); }
size_t Method::graphs() const { return impl_->graphs.size(); }

}  // namespace flashrt
