// flashrt-api-probe: drives the library's API for tests/test_cpp.py, which
// makes the assertions (against flashrt_build.load on the same package).
//
//   flashrt-api-probe run DIR IN OUT [--map CKPT] [--calls N] [--edit NAME]
//       Opens DIR (with --map: binding CKPT's tensors as the caller's own,
//       copied into memory this process owns), calls it N times and writes
//       every call's outputs ("call<i>.<output>"), the package's state
//       ("state.<fqn>") and, with --map, the caller's tensors afterwards
//       ("given.<name>"). --edit NAME then adds 1 to the caller's tensor NAME
//       in place and calls once more ("edited.<output>"). Prints how many
//       bound tensors share the caller's storage.
//   flashrt-api-probe errors DIR IN CKPT
//       Tries weights and inputs the package must refuse; prints one
//       "<case>: <message>" line each (or "<case>: accepted").
//   flashrt-api-probe strided DIR IN OUT
//       Calls DIR (a package of one input) on IN's tensor of that input's name
//       in layouts that are not row-major: "transposed" (its values, the last
//       two axes swapped in memory), "expanded" (its first row repeated,
//       stride 0) and "sliced" (its values inside a buffer twice as wide).
//       Writes "<case>.<output>" and prints "<case>: contiguous <yes|no>",
//       of the view passed, for each.
#include <flashrt/package.h>

#include <ATen/ATen.h>

#include <functional>
#include <iostream>
#include <string>
#include <vector>

using flashrt::Package;
using flashrt::TensorMap;

namespace {

TensorMap owned(const std::filesystem::path& file) {
  TensorMap out;
  for (auto& [name, t] : flashrt::SafetensorsFile(file).tensors()) out.emplace(name, t.clone());
  return out;
}

void add_outputs(std::vector<std::pair<std::string, at::Tensor>>& out, const std::string& prefix, const Package& pkg,
                 const std::vector<at::Tensor>& values) {
  for (size_t i = 0; i < values.size(); ++i) out.emplace_back(prefix + pkg.output_names().at(i), values[i]);
}

int run(int argc, char** argv) {
  const std::filesystem::path dir = argv[2], in = argv[3], out_path = argv[4];
  std::optional<std::filesystem::path> map;
  int calls = 1;
  std::string edit;
  for (int i = 5; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--map") map = argv[i + 1];
    if (flag == "--calls") calls = std::stoi(argv[i + 1]);
    if (flag == "--edit") edit = argv[i + 1];
  }
  TensorMap given = map ? owned(*map) : TensorMap{};
  Package pkg = map ? Package::open(dir, std::nullopt, given) : Package::open(dir);
  TensorMap inputs = flashrt::SafetensorsFile(in).tensors();
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (int c = 0; c < calls; ++c) add_outputs(out, "call" + std::to_string(c) + ".", pkg, pkg.run(inputs));
  for (const auto& [fqn, t] : pkg.state()) out.emplace_back("state." + fqn, t);
  if (map) {
    int shared = 0;
    for (const auto& [fqn, t] : pkg.weights()) {
      for (const auto& [name, mine] : given) shared += t.data_ptr() == mine.data_ptr() ? 1 : 0;
    }
    std::cout << "borrowed: " << shared << " of " << pkg.weights().size() << "\n";
    if (!edit.empty()) {
      given.at(edit).add_(1);
      add_outputs(out, "edited.", pkg, pkg.run(inputs));
    }
    for (const auto& [name, t] : given) out.emplace_back("given." + name, t);
  }
  flashrt::save_safetensors(out_path, out);
  return 0;
}

// One refusal: its message, or "accepted" when nothing was thrown.
void expect_refusal(const std::string& label, const std::function<void()>& attempt) {
  try {
    attempt();
    std::cout << label << ": accepted\n";
  } catch (const flashrt::Error& e) {
    std::cout << label << ": " << e.what() << "\n";
  }
}

int errors(char** argv) {
  const std::filesystem::path dir = argv[2], in = argv[3], ckpt = argv[4];
  Package pkg = Package::open(dir);
  const at::Tensor x = flashrt::SafetensorsFile(in).tensor("x");
  const at::Tensor before = pkg.run({x}).at(0);

  TensorMap bad = owned(ckpt);
  bad.erase("fc1.weight");
  bad["fc2.weight"] = at::zeros({8, 63});
  bad["norm.bias"] = bad["norm.bias"].to(at::kDouble);
  bad["output_scale"] = at::empty({8}, at::TensorOptions().device(at::kMeta));
  bad["extra.weight"] = at::zeros({2});
  expect_refusal("bind", [&] { pkg.bind(bad); });
  std::cout << "unchanged after refusal: " << (at::equal(pkg.run({x}).at(0), before) ? "yes" : "no") << "\n";
  expect_refusal("open with tensors", [&] { Package::open(dir, std::nullopt, bad); });
  // The right shape in another layout: the compiled code would read it wrong.
  TensorMap strided = owned(ckpt);
  strided["fc1.weight"] = strided["fc1.weight"].t().contiguous().t();
  expect_refusal("strides", [&] { pkg.bind(strided); });

  expect_refusal("no inputs", [&] { pkg.run(std::vector<at::Tensor>{}); });
  expect_refusal("undefined", [&] { pkg.run({at::Tensor()}); });
  expect_refusal("rank", [&] { pkg.run({x.flatten()}); });
  expect_refusal("static size", [&] { pkg.run({at::zeros({5, 17})}); });
  expect_refusal("dynamic range", [&] { pkg.run({at::zeros({0, 16})}); });
  expect_refusal("dtype", [&] { pkg.run({x.to(at::kHalf)}); });
  expect_refusal("device", [&] { pkg.run({at::empty({5, 16}, at::TensorOptions().device(at::kMeta))}); });
  expect_refusal("unknown name", [&] { pkg.run(TensorMap{{"x", x}, {"y", x}}); });
  expect_refusal("missing name", [&] { pkg.run(TensorMap{}); });
  expect_refusal("valid", [&] { pkg.run(TensorMap{{"x", x}}); });
  return 0;
}

int strided(char** argv) {
  const std::filesystem::path dir = argv[2], in = argv[3], out_path = argv[4];
  Package pkg = Package::open(dir);
  const at::Tensor x = flashrt::SafetensorsFile(in).tensor(pkg.inputs().at(0).name).clone();
  std::vector<int64_t> wide = x.sizes().vec();
  wide.back() *= 2;
  const std::vector<std::pair<std::string, at::Tensor>> views = {
      {"transposed", x.transpose(-2, -1).contiguous().transpose(-2, -1)},
      {"expanded", x.narrow(0, 0, 1).expand(x.sizes())},
      {"sliced", at::zeros(wide, x.options()).narrow(-1, x.size(-1) / 2, x.size(-1)).copy_(x)},
  };
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& [label, view] : views) {
    std::cout << label << ": contiguous " << (view.is_contiguous() ? "yes" : "no") << "\n";
    add_outputs(out, label + ".", pkg, pkg.run({view}));
  }
  flashrt::save_safetensors(out_path, out);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  try {
    if (mode == "run" && argc >= 5) return run(argc, argv);
    if (mode == "errors" && argc == 5) return errors(argv);
    if (mode == "strided" && argc == 5) return strided(argv);
  } catch (const flashrt::Error& e) {
    std::cerr << "flashrt-api-probe: error: " << e.what() << "\n";
    return 1;
  }
  std::cerr << "usage: flashrt-api-probe run DIR IN OUT [--map CKPT] [--calls N] [--edit NAME]\n"
               "       flashrt-api-probe errors DIR IN CKPT\n"
               "       flashrt-api-probe strided DIR IN OUT\n";
  return 2;
}
