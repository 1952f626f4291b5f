// An open package's weights and state: a file's or the caller's tensors
// checked against the manifest (every problem at once, in the Python
// loader's words), then bound in place into every method's model, one copy
// for all; the state buffers the methods write, the caller's or the build's.
#include "package_impl.h"

#include <ATen/ATen.h>

#include <algorithm>

namespace flashrt {

using detail::Clock;
using detail::join;
using detail::Manifest;
using detail::since;
using detail::Source;
using detail::WeightEntry;

const SafetensorsFile& Package::Impl::read_sidecar() {
  if (!sidecar) {
    // The digest first, as for the package: nothing of an altered file is parsed.
    const auto path = detail::listed_file(shared.dir, *manifest().weights_file);
    auto start = Clock::now();
    detail::check_digest(path, *manifest().weights_file, "the weights");
    stats.weights_hash_s += since(start);
    stats.weights_bytes += std::filesystem::file_size(path);
    start = Clock::now();
    sidecar = std::make_shared<SafetensorsFile>(path);
    stats.weights_read_s += since(start);
  }
  return *sidecar;
}

Source Package::Impl::file_source(const std::filesystem::path& checkpoint) {
  if (!std::filesystem::is_regular_file(checkpoint)) {
    throw Error(Error::Kind::Weights, "weights file " + checkpoint.string() + " does not exist");
  }
  auto start = Clock::now();
  SafetensorsFile file(checkpoint);
  stats.weights_read_s += since(start);
  stats.weights_bytes += file.bytes();
  return {checkpoint.string(), file.tensors(), false};
}

Source Package::Impl::sidecar_source() {
  const SafetensorsFile& file = read_sidecar();
  return {file.path().string(), file.tensors(), false};
}

TensorMap Package::Impl::check(Source source) {
  const Manifest& m = manifest();
  const c10::Device device = shared.device;
  for (const auto& e : m.state) source.tensors.erase(e.fqn);  // the state, bound apart
  detail::Table table;
  for (const auto& [name, t] : source.tensors) {
    table[name] = {t.sizes().vec(), t.scalar_type(),
                   source.in_memory ? std::optional<c10::Device>(t.device()) : std::nullopt,
                   source.in_memory ? std::optional<std::vector<int64_t>>(t.strides().vec()) : std::nullopt};
  }
  std::map<std::string, std::string> chosen;
  auto problems = detail::compare(m.weights, table, m.unused, device, chosen);
  if (!problems.empty()) throw Error(Error::Kind::Weights, detail::mismatch(source.description, problems));
  std::map<std::string, const WeightEntry*> by_fqn;
  for (const auto& e : m.weights) by_fqn[e.fqn] = &e;
  TensorMap bound;
  for (const auto& [fqn, name] : chosen) bound.emplace(fqn, detail::laid_out(source.tensors.at(name).to(device), *by_fqn.at(fqn)));
  if (m.external && bound.size() < m.weights.size()) {
    // Constants of the forward's code, non-persistent buffers: the build's values.
    const SafetensorsFile& defaults = read_sidecar();
    std::vector<std::string> absent;
    for (const auto& e : m.weights) {
      if (bound.count(e.fqn)) continue;
      if (!defaults.contains(e.fqn)) {
        absent.push_back(e.fqn);
      } else {
        bound.emplace(e.fqn, detail::laid_out(defaults.tensor(e.fqn).to(device), e));
      }
    }
    if (!absent.empty()) throw Error(Error::Kind::Weights, detail::mismatch(defaults.path().string(), {{"missing", absent}}));
  }
  return bound;
}

void Package::Impl::bind_all(TensorMap bound) {
  const Manifest& m = manifest();
  for (const auto& method : methods) {
    Method::Impl& impl = method->impl();
    TensorMap handles;
    for (const auto& e : m.weights) {
      const std::string* name = e.bound_by(impl.spec->name);
      auto it = bound.find(e.fqn);
      if (name != nullptr && it != bound.end()) handles.emplace(*name, it->second);
    }
    if (m.state_in_place) {
      for (const auto& fqn : impl.loader->get_constant_fqns()) {
        auto it = shared.state.find(fqn);
        if (it != shared.state.end()) handles.emplace(fqn, it->second);
      }
    }
    if (handles.empty()) continue;
    impl.loader->load_constants(handles, /*use_inactive=*/false, /*check_full_update=*/m.external,
                                /*user_managed=*/true);
    impl.drop_graphs();  // they hold the addresses of what was bound before
  }
  if (!bound.empty()) weights = std::move(bound);
}

void Package::Impl::bind(Source source) {
  const auto start = Clock::now();
  const double reading = stats.weights_read_s + stats.weights_hash_s;  // a sidecar read for defaults is not binding
  TensorMap bound = check(std::move(source));
  std::lock_guard<std::mutex> lock(shared.calls);
  bind_all(std::move(bound));
  stats.bind_s += since(start) - (stats.weights_read_s + stats.weights_hash_s - reading);
}

TensorMap Package::Impl::initial_state() {
  const Manifest& m = manifest();
  const auto path = detail::listed_file(shared.dir, *m.state_file);
  detail::check_digest(path, *m.state_file, "the state");
  SafetensorsFile file(path);
  TensorMap out;
  for (const auto& e : m.state) {
    if (!file.contains(e.fqn) || file.shape(e.fqn) != e.shape || file.dtype(e.fqn) != e.dtype) {
      throw Error(Error::Kind::Artifact, path.string() + " does not hold " + e.fqn + " " +
                                             detail::shape_str(e.shape) + " " + dtype_name(e.dtype) +
                                             " as the manifest lists it");
    }
    out[e.fqn] = file.tensor(e.fqn);
  }
  return out;
}

void Package::Impl::init_state(const TensorMap* given) {
  const Manifest& m = manifest();
  if (m.state.empty()) return;
  const c10::Device device = shared.device;
  const bool all_given = given != nullptr && std::all_of(m.state.begin(), m.state.end(), [&](const auto& e) {
                           return given->count(e.fqn) > 0;
                         });
  if (all_given) {
    std::vector<std::string> wrong;
    for (const auto& e : m.state) {
      const at::Tensor& t = given->at(e.fqn);
      if (t.sizes().vec() != e.shape || t.scalar_type() != e.dtype || !detail::same_device(t.device(), device)) {
        wrong.push_back(e.fqn + " " + detail::shape_str(t.sizes().vec()) + " " + dtype_name(t.scalar_type()) +
                        " on " + t.device().str() + " (package expects " + detail::shape_str(e.shape) + " " +
                        dtype_name(e.dtype) + " on " + device.str() + ")");
      } else if (m.state_in_place && !t.is_contiguous()) {
        wrong.push_back(e.fqn + " is not contiguous (the package writes it row-major)");
      }
      shared.state[e.fqn] = t;
    }
    if (!wrong.empty()) {
      throw Error(Error::Kind::Weights, "state from the given tensors does not fit the package: " + join(wrong));
    }
  } else {
    // Owned: written by every call.
    for (auto& [fqn, t] : initial_state()) shared.state[fqn] = t.to(device, /*non_blocking=*/false, /*copy=*/true);
  }
}

}  // namespace flashrt
