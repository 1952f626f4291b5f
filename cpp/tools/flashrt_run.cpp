// flashrt-run: one call of a flashrt_build package, inputs and outputs as safetensors.
//
//   flashrt-run DIR --inputs in.safetensors --out out.safetensors [--method NAME]
//               [--device cuda:0] [--weights checkpoint.safetensors] [--calls N] [--cuda-graphs]
//
// Exit codes: 0 the outputs are written; 1 the package, its weights or the
// inputs were refused (one line on stderr says why), or the call failed;
// 2 the command line is wrong.
#include <flashrt/package.h>

#include "command_line.h"

#include <ATen/ATen.h>

#include <cstdlib>
#include <iostream>
#include <optional>
#include <string>

namespace {

const char* kUsage =
    "usage: flashrt-run DIR --inputs IN.safetensors --out OUT.safetensors [--method NAME] [--device DEVICE] "
    "[--weights CHECKPOINT.safetensors] [--calls N] [--cuda-graphs]\n"
    "  DIR        a flashrt_build output directory (model.pt2, manifest.json, ...)\n"
    "  --inputs   the inputs by name, as the manifest lists them\n"
    "  --out      written with the outputs by path in the output tree ('output' for a lone tensor)\n"
    "  --method   the method to call (default: the package's default, its forward)\n"
    "  --device   default: the build's target device\n"
    "  --weights  bind this checkpoint instead of the package's own weights\n"
    "  --calls    call N times (a stateful module advances its state); the last outputs are written\n"
    "  --cuda-graphs  replay each call from a CUDA graph (CUDA packages; default: the manifest's serve.cuda_graphs)\n";

const flashrt::tools::Tool kTool{"flashrt-run", kUsage};

struct Args {
  flashrt::tools::PackageArgs package;
  std::string inputs, out, method;
  long calls = 1;
};

Args parse(int argc, char** argv) {
  Args args;
  args.package = flashrt::tools::parse(argc, argv, kTool, [&](const std::string& arg, const auto& value) {
    if (arg == "--inputs") {
      args.inputs = value();
    } else if (arg == "--out") {
      args.out = value();
    } else if (arg == "--method") {
      args.method = value();
    } else if (arg == "--calls") {
      args.calls = flashrt::tools::integer(kTool, arg, value(), 1);
    } else {
      return false;
    }
    return true;
  });
  if (args.inputs.empty()) flashrt::tools::usage_error(kTool, "--inputs is required");
  if (args.out.empty()) flashrt::tools::usage_error(kTool, "--out is required");
  return args;
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse(argc, argv);
  return flashrt::tools::run(kTool, [&] {
    flashrt::Package pkg = flashrt::tools::open_package(kTool, args.package);
    flashrt::Method& method = pkg.method(args.method.empty() ? pkg.default_method() : args.method);
    flashrt::TensorMap inputs;
    for (auto& [name, tensor] : flashrt::SafetensorsFile(args.inputs).tensors()) {
      inputs.emplace(name, tensor.to(pkg.device()));
    }
    std::vector<at::Tensor> outputs;
    for (long i = 0; i < args.calls; ++i) outputs = method.run(inputs);
    std::vector<std::pair<std::string, at::Tensor>> named;
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (outputs[i].defined()) named.emplace_back(method.output_names().at(i), outputs[i]);  // a None leaf: no tensor
    }
    flashrt::save_safetensors(args.out, named);
    std::cout << pkg.name() << (pkg.method_names().size() > 1 ? "." + method.name() : "") << " on " << pkg.device()
              << ": " << args.calls << (args.calls == 1 ? " call" : " calls");
    for (const auto& [name, t] : named) {
      std::cout << ", " << name << " " << t.sizes() << " " << flashrt::dtype_name(t.scalar_type());
    }
    std::cout << " -> " << args.out << "\n";
    return 0;
  });
}
