// Package::Impl: what an open package holds (its shared state, its methods,
// the weights bound), shared by package.cpp (opening, the public API) and
// binding.cpp (weights and state checked and bound); and the checks both use
// (checks.cpp).
#pragma once

#include "internal.h"

#include <chrono>

namespace flashrt {
namespace detail {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point start);

// Refuses a file the manifest lists unless its bytes are the build's; `what` says which ("the package").
void check_digest(const std::filesystem::path& path, const FileRecord& record, const char* what);
// A file the manifest lists, which must be there.
std::filesystem::path listed_file(const std::filesystem::path& dir, const FileRecord& record);
// The device a package runs on: the caller's, or the build's target; a GPU of the build's architecture.
c10::Device resolve_device(const Manifest& m, std::optional<c10::Device> requested);
// Problems as the Python side's WeightsMismatch prints them.
std::string mismatch(const std::string& source,
                     const std::vector<std::pair<std::string, std::vector<std::string>>>& problems);
// A tensor read from a file as the package reads it (strides, floating dtype); a copy only where either differs.
at::Tensor laid_out(const at::Tensor& t, const WeightEntry& entry);
// The libraries of the custom operators the package calls, opened unless their operators are there.
void load_libraries(const Manifest& m);

// Weights to bind: the caller's tensors (borrowed, on the device already) or a file's.
struct Source {
  std::string description;
  TensorMap tensors;
  bool in_memory = false;  // the caller's: checked for their device, never moved
};

}  // namespace detail

struct Package::Impl {
  detail::Shared shared;  // what every method reads: the manifest, device, state, the call lock
  std::vector<std::unique_ptr<Method>> methods;  // in the manifest's order
  std::vector<std::string> method_names;
  Method* default_method = nullptr;
  TensorMap weights;  // what is bound, kept alive for the package
  std::shared_ptr<SafetensorsFile> sidecar;  // read (and its digest checked) when first needed
  OpenStats stats;

  const detail::Manifest& manifest() const { return shared.manifest; }

  const SafetensorsFile& read_sidecar();

  detail::Source file_source(const std::filesystem::path& checkpoint);

  detail::Source sidecar_source();

  // Checks `source` against the manifest: the tensors to bind, by FQN.
  TensorMap check(detail::Source source);

  // Binds `bound` (and the state the package writes in place) into every
  // method's model, each by the names it binds them by: one copy for all.
  void bind_all(TensorMap bound);

  void bind(detail::Source source);

  // The state file's tensors, checked against the manifest.
  TensorMap initial_state();

  // The state buffers: the caller's (updated in place), or state.safetensors's initial values.
  void init_state(const TensorMap* given);

  void load_methods(const std::filesystem::path& package);

  static std::unique_ptr<Impl> open(const std::filesystem::path& dir, const Options& options, const TensorMap* given,
                                    const std::filesystem::path* checkpoint);
};

}  // namespace flashrt
