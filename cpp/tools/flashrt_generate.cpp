// flashrt-generate: generation from a package of a prefill and a decode method
// over a static KV cache, the loop a serving process runs: greedy, or sampled
// as `python -m flashrt_build.generate` samples (the same tokens for a seed on
// the CPU: the same operations on the same generator).
//
//   flashrt-generate DIR --prompt 1,2,3 --tokens 64 [--device cuda:0] [--cuda-graphs]
//                    [--temperature T --top-k K --top-p P --seed S]
//                    [--prefill NAME] [--decode NAME] [--position NAME] [--weights FILE] [--json]
//
// Prints the new tokens, then where the time went. Exit codes as flashrt-run's:
// 0 done; 1 the package, its weights or the prompt were refused, or a call
// failed; 2 the command line is wrong.
#include <flashrt/package.h>

#include "command_line.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <chrono>
#include <cstdlib>
#include <iostream>
#include <limits>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace {

const char* kUsage =
    "usage: flashrt-generate DIR (--prompt IDS | --random-prompt N) --tokens N [--device DEVICE] [--cuda-graphs] "
    "[--temperature T] [--top-k K] [--top-p P] [--prefill NAME] [--decode NAME] [--position NAME] [--weights FILE] "
    "[--seed S] [--warmup N] [--json]\n"
    "  DIR              a flashrt_build output directory of a prefill and a decode method\n"
    "  --prompt         the prompt's token ids, comma-separated (1,2,3)\n"
    "  --random-prompt  a prompt of N token ids drawn below the prefill's declared high (seeded by --seed)\n"
    "  --tokens         how many new tokens: one from the prefill, the rest one decode step each\n"
    "  --temperature    0 (the default): greedy; above, sample from the logits over T, seeded by --seed\n"
    "  --top-k, --top-p sample from the K likeliest, the fewest reaching P (as transformers and generate do)\n"
    "  --prefill, --decode  the methods (default prefill, decode); --position: decode's position input\n"
    "  --cuda-graphs    replay each step from a CUDA graph (default: the manifest's serve.cuda_graphs)\n"
    "  --warmup         generate N times first, untimed (first calls, graph captures), resetting the state after each\n"
    "  --json           print one JSON object (tokens, prefill_ms, decode_ms_per_token, tokens_per_s)\n";

const flashrt::tools::Tool kTool{"flashrt-generate", kUsage};

struct Args {
  flashrt::tools::PackageArgs package;
  std::string prefill = "prefill", decode = "decode", position = "position";
  std::vector<int64_t> prompt;
  long random_prompt = 0, tokens = 0, seed = 0, warmup = 0, top_k = 0;
  double temperature = 0, top_p = 1;
  bool json = false, seeded = false;
};

Args parse(int argc, char** argv) {
  using flashrt::tools::integer;
  Args args;
  args.package = flashrt::tools::parse(argc, argv, kTool, [&](const std::string& arg, const auto& value) {
    if (arg == "--prompt") {
      std::stringstream ids(value());
      for (std::string id; std::getline(ids, id, ',');) args.prompt.push_back(integer(kTool, arg, id, 0));
    } else if (arg == "--random-prompt") {
      args.random_prompt = integer(kTool, arg, value(), 1);
    } else if (arg == "--tokens") {
      args.tokens = integer(kTool, arg, value(), 1);
    } else if (arg == "--warmup") {
      args.warmup = integer(kTool, arg, value(), 0);
    } else if (arg == "--temperature") {
      args.temperature = flashrt::tools::number(kTool, arg, value(), 0, 1e300, "a finite number >= 0 (0: greedy)");
    } else if (arg == "--top-k") {
      args.top_k = integer(kTool, arg, value(), 1);
    } else if (arg == "--top-p") {
      args.top_p = flashrt::tools::number(kTool, arg, value(), 1e-300, 1, "a number in (0, 1]");
    } else if (arg == "--seed") {
      args.seed = integer(kTool, arg, value(), 0);
      args.seeded = true;
    } else if (arg == "--prefill") {
      args.prefill = value();
    } else if (arg == "--decode") {
      args.decode = value();
    } else if (arg == "--position") {
      args.position = value();
    } else if (arg == "--json") {
      args.json = true;
    } else {
      return false;
    }
    return true;
  });
  if (args.prompt.empty() == (args.random_prompt == 0)) {
    flashrt::tools::usage_error(kTool, "give one of --prompt and --random-prompt");
  }
  if (args.tokens == 0) flashrt::tools::usage_error(kTool, "--tokens is required");
  if (args.temperature > 0 && !args.seeded) {  // each run its own tokens, as generate samples; said, to repeat one
    args.seed = static_cast<long>(std::random_device{}() >> 1);
  }
  return args;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// How the next token of each sequence, [batch, 1], is chosen from the last
// position's logits: the argmax, or a draw as runtime/sampling.py draws it
// (float64 scores less their largest over the temperature, the top-k and
// top-p cuts, a multinomial on the host's generator seeded by --seed).
struct Chooser {
  double temperature, top_p;
  long top_k;
  at::Generator generator;

  Chooser(const Args& args)
      : temperature(args.temperature), top_p(args.top_p), top_k(args.top_k),
        generator(at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(args.seed))) {}

  at::Tensor operator()(const std::vector<at::Tensor>& outputs) const {
    const at::Tensor last = outputs.at(0).select(1, -1);
    if (temperature == 0) return last.argmax(-1, true);
    const double inf = std::numeric_limits<double>::infinity();
    at::Tensor scores = last.to(at::kCPU, at::kDouble).nan_to_num(-inf, std::numeric_limits<double>::max(), -inf);
    scores = (scores - std::get<0>(scores.max(-1, true))) / temperature;
    if (top_k > 0) {
      const at::Tensor kth = std::get<0>(scores.topk(std::min<int64_t>(top_k, scores.size(-1)), -1)).narrow(-1, -1, 1);
      scores = scores.masked_fill(scores < kth, -inf);
    }
    if (top_p < 1) {
      auto [ordered, order] = scores.sort(-1, true);
      const at::Tensor probability = ordered.softmax(-1);
      at::Tensor cut = (probability.cumsum(-1) - probability) >= top_p;
      cut.select(-1, 0).fill_(false);  // the most likely one always stays
      scores = at::full_like(scores, -inf).scatter(-1, order, ordered.masked_fill(cut, -inf));
    }
    return at::multinomial(scores.softmax(-1), 1, false, generator).to(last.device());
  }
};

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse(argc, argv);
  return flashrt::tools::run(kTool, [&] {
    flashrt::Package pkg = flashrt::tools::open_package(kTool, args.package);
    flashrt::Method& prefill = pkg.method(args.prefill);
    flashrt::Method& decode = pkg.method(args.decode);
    const flashrt::InputSpec& ids = prefill.inputs().at(0);
    at::Tensor prompt;
    if (args.random_prompt) {
      at::manual_seed(args.seed);
      prompt = at::randint(ids.low.value_or(0), ids.high.value_or(2), {1, args.random_prompt}, at::kLong);
    } else {
      prompt = at::tensor(args.prompt, at::kLong).unsqueeze(0);
    }
    prompt = prompt.to(pkg.device(), ids.dtype);
    const int64_t length = prompt.size(1);
    for (const auto& spec : decode.inputs()) {  // room in the cache for every position, before any call
      if (spec.name == args.position && spec.high && length + args.tokens - 1 >= *spec.high) {
        throw flashrt::Error(flashrt::Error::Kind::Input,
                             "the prompt and the new tokens need positions up to " +
                                 std::to_string(length + args.tokens - 1) + "; " + args.decode + " accepts " +
                                 args.position + " below " + std::to_string(*spec.high));
      }
    }
    const flashrt::InputSpec& token_spec = decode.inputs().at(0);
    const std::string token_name = token_spec.name;

    struct Run {
      at::Tensor tokens;  // [1, n] on the host
      double prefill_s, decode_s;
    };
    auto generate = [&]() -> Run {
      auto start = std::chrono::steady_clock::now();
      const Chooser next_token(args);  // each generation from the seed: a warm-up does not shift the draws
      const std::vector<at::Tensor> first = prefill.run(flashrt::TensorMap{{ids.name, prompt}});
      at::Tensor token = next_token(first).to(ids.dtype);
      token.item();  // the first token is on the host: what a user waits for first
      const double prefill_s = seconds_since(start);
      // Every later token is one of the logits' positions: within decode's range when they are no wider.
      const bool trusted = !token_spec.high || first.at(0).size(-1) <= *token_spec.high;
      std::vector<at::Tensor> tokens{token};
      start = std::chrono::steady_clock::now();
      for (long step = 1; step < args.tokens; ++step) {
        at::Tensor position = at::full({1}, length + step - 1, at::TensorOptions(at::kLong).device(pkg.device()));
        // In range by construction (a position of the logits, a counted position): no wait for the device.
        const flashrt::TensorMap step_inputs{{token_name, token}, {args.position, position}};
        token = next_token(trusted ? decode.run_trusted(step_inputs) : decode.run(step_inputs)).to(ids.dtype);
        tokens.push_back(token);
      }
      const at::Tensor generated = at::cat(tokens, 1).cpu();  // waits for the last step
      return {generated, prefill_s, args.tokens > 1 ? seconds_since(start) : 0};
    };
    for (long i = 0; i < args.warmup; ++i) {
      generate();
      pkg.reset_state();  // the build's initial cache again, in place: captured graphs stay valid
    }
    const Run run = generate();
    const at::Tensor& generated = run.tokens;
    const double prefill_s = run.prefill_s, decode_s = run.decode_s;
    const double per_token_ms = args.tokens > 1 ? 1e3 * decode_s / (args.tokens - 1) : 0;
    const double tokens_per_s = args.tokens / (prefill_s + decode_s);

    std::ostringstream ids_text;
    for (int64_t i = 0; i < generated.size(1); ++i) ids_text << (i ? args.json ? "," : " " : "") << generated[0][i].item<int64_t>();
    if (args.json) {
      std::cout << "{\"tokens\": [" << ids_text.str() << "], \"prompt_length\": " << length
                << ", \"prefill_ms\": " << 1e3 * prefill_s << ", \"decode_ms_per_token\": " << per_token_ms
                << ", \"tokens_per_s\": " << tokens_per_s << ", \"cuda_graphs\": " << (pkg.cuda_graphs() ? "true" : "false")
                << ", \"seed\": " << (args.temperature > 0 ? std::to_string(args.seed) : "null") << "}\n";
    } else {
      std::cout << ids_text.str() << "\n"
                << pkg.name() << " on " << pkg.device() << (pkg.cuda_graphs() ? " (CUDA graphs)" : "") << ": prompt "
                << length << ", " << args.tokens << " new tokens; prefill " << 1e3 * prefill_s << " ms, decode "
                << per_token_ms << " ms/token, " << tokens_per_s << " tokens/s\n";
      if (args.temperature > 0) std::cout << "seed: " << args.seed << " (--seed " << args.seed << " repeats these tokens)\n";
    }
    return 0;
  });
}
