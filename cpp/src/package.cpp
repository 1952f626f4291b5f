// Package: open (digests, weights checked and bound), run (inputs checked,
// state threaded). The checks mirror flashrt_build's Python loader
// (flashrt_build/runtime/load.py and checkpoint.py), messages included.
#include "package_impl.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <set>

namespace flashrt {

using detail::Clock;
using detail::join;
using detail::Manifest;
using detail::since;
using detail::Source;
using detail::WeightEntry;

void Package::Impl::load_methods(const std::filesystem::path& package) {
  const Manifest& m = manifest();
  const c10::DeviceIndex index = shared.device.is_cuda() ? shared.device.index() : -1;
  for (const auto& spec : m.methods) {
    auto impl = std::make_unique<Method::Impl>();
    impl->spec = &spec;
    impl->shared = &shared;
    try {
      // One runner; single-threaded when graphs are captured (the default one cannot be).
      impl->loader = std::make_unique<torch::inductor::AOTIModelPackageLoader>(package.string(), spec.model,
                                                                               shared.graphs, 1, index);
    } catch (const c10::Error& e) {
      throw Error(Error::Kind::Artifact,
                  package.string() + " cannot be loaded by libtorch: " + e.what_without_backtrace());
    }
    // The manifest lists exactly the tensors the compiled code binds (and the state it writes in place).
    const auto fqns = impl->loader->get_constant_fqns();
    std::set<std::string> binds, listed;
    for (const auto& fqn : fqns) {
      if (!(m.state_in_place && std::any_of(m.state.begin(), m.state.end(), [&](const auto& e) { return e.fqn == fqn; }))) {
        binds.insert(fqn);
      }
    }
    for (const auto& e : m.weights) {
      if (const std::string* name = e.bound_by(spec.name)) listed.insert(*name);
    }
    if (binds != listed) {
      std::vector<std::string> extra, absent;
      std::set_difference(binds.begin(), binds.end(), listed.begin(), listed.end(), std::back_inserter(extra));
      std::set_difference(listed.begin(), listed.end(), binds.begin(), binds.end(), std::back_inserter(absent));
      throw Error(Error::Kind::Artifact, package.string() + " (" + spec.name + ") binds other tensors than " +
                                             m.path.string() + " lists: not listed: " + join(extra) +
                                             "; not bound: " + join(absent));
    }
    impl->call = detail::parse_call_spec(impl->loader->get_call_spec(), spec, m);
    methods.push_back(std::make_unique<Method>(std::move(impl)));
    method_names.push_back(spec.name);
    if (spec.name == m.default_method) default_method = methods.back().get();
  }
}

std::unique_ptr<Package::Impl> Package::Impl::open(const std::filesystem::path& dir, const Options& options,
                                                   const TensorMap* given, const std::filesystem::path* checkpoint) {
  const auto start = Clock::now();
  auto impl = std::make_unique<Impl>();
  Impl& p = *impl;
  p.shared.dir = dir;
  p.shared.manifest = detail::read_manifest(dir);
  const Manifest& m = p.shared.manifest;
  p.shared.device = detail::resolve_device(m, options.device);
  const bool graphs = options.cuda_graphs.value_or(m.cuda_graphs);
  if (graphs && !p.shared.device.is_cuda()) {
    if (options.cuda_graphs) {
      throw Error(Error::Kind::Input, "CUDA graphs need a CUDA package; " + dir.string() + " runs on " +
                                          p.shared.device.str());
    }
  } else {
    p.shared.graphs = graphs;
  }
#ifndef FLASHRT_WITH_CUDA
  if (p.shared.graphs) throw Error(Error::Kind::Input, "this flashrt library was built without CUDA: no CUDA graphs");
#endif
  p.shared.max_graphs = options.max_graphs.value_or(m.max_graphs);

  // The package's digest before any of its code is loaded.
  const auto package = detail::listed_file(dir, m.package);
  auto t = Clock::now();
  detail::check_digest(package, m.package, "the package");
  detail::check_contract(package, m);
  p.stats.package_hash_s = since(t);
  p.stats.package_bytes = std::filesystem::file_size(package);

  // The weights, read and checked before the package is loaded: a file that
  // does not fit fails fast. The caller's tensors are borrowed as they are.
  std::optional<Source> source;
  if (given != nullptr) {
    source = Source{"the given tensors", *given, true};
  } else if (checkpoint != nullptr) {
    source = p.file_source(*checkpoint);
  } else if (m.external) {
    source = p.sidecar_source();
  }
  TensorMap bound;
  if (source) {
    t = Clock::now();
    const double reading = p.stats.weights_read_s + p.stats.weights_hash_s;
    bound = p.check(std::move(*source));
    p.stats.bind_s += since(t) - (p.stats.weights_read_s + p.stats.weights_hash_s - reading);
  }
  p.init_state(given);

  t = Clock::now();
  detail::load_libraries(m);
  p.load_methods(package);
  p.stats.load_s = since(t);
  t = Clock::now();
  p.bind_all(std::move(bound));
  p.stats.bind_s += since(t);
  for (auto& method : p.methods) method->impl().plan();
  if (p.shared.device.is_cuda() && m.target_dtype == "float32") {
    // cuBLAS and cuDNN read these on every call; process-wide in C++.
    at::globalContext().setAllowTF32CuBLAS(m.tf32.value_or(false));
    at::globalContext().setAllowTF32CuDNN(m.tf32.value_or(false));
  }
  p.stats.total_s = since(start);
  return impl;
}

Package::Package(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Package::Package(Package&&) noexcept = default;
Package& Package::operator=(Package&&) noexcept = default;
Package::~Package() = default;

Package Package::open(const std::filesystem::path& dir, std::optional<c10::Device> device) {
  return Package(Impl::open(dir, Options{device, {}, {}}, nullptr, nullptr));
}

Package Package::open(const std::filesystem::path& dir, const Options& options) {
  return Package(Impl::open(dir, options, nullptr, nullptr));
}

Package Package::open(const std::filesystem::path& dir, std::optional<c10::Device> device, const TensorMap& weights) {
  return Package(Impl::open(dir, Options{device, {}, {}}, &weights, nullptr));
}

Package Package::open(const std::filesystem::path& dir, const Options& options, const TensorMap& weights) {
  return Package(Impl::open(dir, options, &weights, nullptr));
}

Package Package::open(const std::filesystem::path& dir, std::optional<c10::Device> device,
                      const std::filesystem::path& checkpoint) {
  return Package(Impl::open(dir, Options{device, {}, {}}, nullptr, &checkpoint));
}

Package Package::open(const std::filesystem::path& dir, const Options& options,
                      const std::filesystem::path& checkpoint) {
  return Package(Impl::open(dir, options, nullptr, &checkpoint));
}

void Package::bind(const TensorMap& weights) {
  const OpenStats opened = impl_->stats;  // they describe the open
  impl_->bind({"the given tensors", weights, true});
  impl_->stats = opened;
}

void Package::bind(const std::filesystem::path& checkpoint) {
  const OpenStats opened = impl_->stats;
  impl_->bind(impl_->file_source(checkpoint));
  impl_->stats = opened;
}

void Package::reset_state() {
  if (impl_->shared.manifest.state.empty()) return;
  TensorMap initial = impl_->initial_state();
  std::lock_guard<std::mutex> lock(impl_->shared.calls);
  at::NoGradGuard no_grad;
  for (auto& [fqn, t] : impl_->shared.state) t.copy_(initial.at(fqn));
}

Method& Package::method(const std::string& name) {
  const auto& names = impl_->method_names;
  auto it = std::find(names.begin(), names.end(), name);
  if (it == names.end()) {
    throw Error(Error::Kind::Input, impl_->shared.dir.string() + " has no method '" + name + "'; its methods: " +
                                        join(names));
  }
  return *impl_->methods[it - names.begin()];
}

const std::vector<std::string>& Package::method_names() const { return impl_->method_names; }
const std::string& Package::default_method() const { return impl_->default_method->name(); }

std::vector<at::Tensor> Package::run(const std::vector<at::Tensor>& inputs) { return impl_->default_method->run(inputs); }
std::vector<at::Tensor> Package::run(const TensorMap& inputs) { return impl_->default_method->run(inputs); }
void Package::check_inputs(const std::vector<at::Tensor>& inputs) const { impl_->default_method->check_inputs(inputs); }
const std::vector<InputSpec>& Package::inputs() const { return impl_->default_method->inputs(); }
const std::vector<std::string>& Package::output_names() const { return impl_->default_method->output_names(); }
std::vector<std::string> Package::constant_fqns() const { return impl_->default_method->constant_fqns(); }

const std::string& Package::name() const { return impl_->shared.manifest.name; }
const std::filesystem::path& Package::dir() const { return impl_->shared.dir; }
c10::Device Package::device() const { return impl_->shared.device; }
bool Package::external() const { return impl_->shared.manifest.external; }
bool Package::cuda_graphs() const { return impl_->shared.graphs; }
const std::string& Package::state_mode() const {
  static const std::string none, in_place = "in_place", threaded = "threaded";
  const Manifest& m = impl_->shared.manifest;
  return m.state.empty() ? none : m.state_in_place ? in_place : threaded;
}
const TensorMap& Package::weights() const { return impl_->weights; }
const TensorMap& Package::state() const { return impl_->shared.state; }
const OpenStats& Package::open_stats() const { return impl_->stats; }

}  // namespace flashrt
