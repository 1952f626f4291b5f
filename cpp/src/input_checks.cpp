// Every call's inputs against the manifest, before the compiled code reads
// them: count, dtype, device, rank, static sizes, dynamic ranges, dims shared
// between inputs, declared value ranges (a token id at the vocabulary size
// would make the compiled code abort the process). Messages mirror
// flashrt_build/runtime/call.py's.
#include "internal.h"

#include <ATen/ATen.h>

#include <algorithm>

namespace flashrt {

using detail::shape_str;

void Method::check_inputs(const std::vector<at::Tensor>& inputs) const {
  check_shapes(inputs);
  check_values(inputs);
}

void Method::check_shapes(const std::vector<at::Tensor>& inputs) const {
  const Impl& p = *impl_;
  const auto& specs = p.spec->inputs;
  const c10::Device device = p.shared->device;
  if (inputs.size() != specs.size()) {
    throw Error(Error::Kind::Input, "the package takes " + std::to_string(specs.size()) + " inputs (" +
                                        detail::join(p.input_names) + "), got " + std::to_string(inputs.size()));
  }
  // Per dynamic dim name: the first size seen and the input it was seen on.
  // On the stack for the usual few dims: a call allocates nothing here.
  constexpr size_t kFew = 8;
  std::pair<int64_t, size_t> few[kFew];
  std::vector<std::pair<int64_t, size_t>> many(p.n_dims > kFew ? p.n_dims : 0);
  std::pair<int64_t, size_t>* seen = p.n_dims > kFew ? many.data() : few;
  std::fill(seen, seen + p.n_dims, std::pair<int64_t, size_t>{-1, 0});
  for (size_t i = 0; i < specs.size(); ++i) {
    const InputSpec& spec = specs[i];
    const at::Tensor& value = inputs[i];
    const std::string& name = spec.name;
    if (!value.defined()) {
      throw Error(Error::Kind::Input, "input '" + name + "' must be a tensor, got an undefined one");
    }
    if (value.scalar_type() != spec.dtype) {
      throw Error(Error::Kind::Input, "input '" + name + "' has dtype " + dtype_name(value.scalar_type()) +
                                          "; the package takes " + dtype_name(spec.dtype));
    }
    if (!detail::same_device(value.device(), device)) {
      throw Error(Error::Kind::Input,
                  "input '" + name + "' is on " + value.device().str() + "; the package runs on " + device.str());
    }
    const auto shape = value.sizes();
    if (shape.size() != spec.shape.size()) {
      throw Error(Error::Kind::Input, "input '" + name + "' has " + std::to_string(shape.size()) + " dims " +
                                          shape_str(shape.vec()) + "; expected " + std::to_string(spec.shape.size()) +
                                          " like " + shape_str(spec.shape));
    }
    for (const auto& [axis, size] : p.static_axes[i]) {
      if (shape[axis] != size) {
        // A batch axis, or a sequence of token ids, may well be made dynamic; a channel cannot.
        const bool may_vary = axis == 0 || !at::isFloatingType(spec.dtype);
        const std::string hint = may_vary ? "; if the model takes other sizes there, build with module.inputs." +
                                                name + ".dynamic." + std::to_string(axis)
                                          : "";
        throw Error(Error::Kind::Input, "input '" + name + "' has size " + std::to_string(shape[axis]) +
                                            " on axis " + std::to_string(axis) + "; the package was built for " +
                                            std::to_string(size) + " there (a static axis)" + hint);
      }
    }
    for (size_t k = 0; k < spec.dynamic.size(); ++k) {
      const DynamicDim& d = spec.dynamic[k];
      const int64_t size = shape[d.axis];
      if (size < d.min || size > d.max) {
        throw Error(Error::Kind::Input, "input '" + name + "' has size " + std::to_string(size) + " on axis " +
                                            std::to_string(d.axis) + " ('" + d.name + "'); the package accepts " +
                                            std::to_string(d.min) + " to " + std::to_string(d.max));
      }
      auto& first = seen[p.dim_ids[i][k]];
      if (first.first < 0) {
        first = {size, i};
      } else if (first.first != size) {
        throw Error(Error::Kind::Input, "inputs '" + specs[first.second].name + "' and '" + name + "' share dim '" +
                                            d.name + "' but have sizes " + std::to_string(first.first) + " and " +
                                            std::to_string(size));
      }
    }
  }
}

void Method::check_values(const std::vector<at::Tensor>& inputs) const {
  const Impl& p = *impl_;
  const auto& specs = p.spec->inputs;
  // One pass over each ranged input and one copy to the host for all: a decode
  // step on a GPU waits for the device once, not twice per input.
  std::vector<size_t> ranged;
  std::vector<at::Tensor> bounds;
  for (size_t i = 0; i < specs.size(); ++i) {
    if ((!specs[i].low && !specs[i].high) || inputs[i].numel() == 0) continue;
    const auto [smallest, largest] = at::aminmax(inputs[i]);
    ranged.push_back(i);
    bounds.push_back(at::stack({smallest, largest}).to(at::kLong));
  }
  if (ranged.empty()) return;
  const at::Tensor host = at::stack(bounds).cpu();
  const auto values = host.accessor<int64_t, 2>();
  const std::string key = p.spec->kwargs_key.substr(0, p.spec->kwargs_key.size() - std::string(".kwargs").size());
  for (size_t k = 0; k < ranged.size(); ++k) {
    const InputSpec& spec = specs[ranged[k]];
    const int64_t smallest = values[k][0], largest = values[k][1];
    if ((spec.low && smallest < *spec.low) || (spec.high && largest >= *spec.high)) {
      const std::string accepted = (spec.low ? std::to_string(*spec.low) : "-inf") + " to " +
                                   (spec.high ? std::to_string(*spec.high - 1) : "inf");
      throw Error(Error::Kind::Input, "input '" + spec.name + "' holds values from " + std::to_string(smallest) +
                                          " to " + std::to_string(largest) + "; the package accepts " + accepted +
                                          " (" + key + ".inputs." + spec.name +
                                          ".low/high): a value outside would make its code read out of bounds");
    }
  }
}

}  // namespace flashrt
