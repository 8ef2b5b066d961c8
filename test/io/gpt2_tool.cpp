// The C++ side of the GPT-2 interop test (gpt2_interop.py): imports a GPT-2 checkpoint and
// compares strata's logits with numpy's, or exports a GPT of strata's and writes its logits.
//
//   strata_gpt2_tool import MODEL HEADS REFERENCE OUT
//       MODEL: a GPT-2 .safetensors file or directory; REFERENCE: a safetensors file holding
//       "tokens" (I32 [sequences, seq]) and "logits" (F32 [sequences, seq, vocab], numpy's
//       forward). Builds the gpt_config MODEL implies (io::gpt2::config_of), imports MODEL, writes
//       strata's logits as "logits" to OUT, prints the max |difference| and the logits' scale
//       (max |reference|); exit 0 when the difference is <= 1e-4 of the scale, 1 otherwise.
//   strata_gpt2_tool export DIR TOKENS OUT
//       A tied GPT (vocab 50, seq 16, d 32, 4 heads, 2 blocks), randomly initialised and moved
//       off its init by three AdamW steps on TOKENS ("tokens", I32 [sequences, seq]; targets:
//       each token's successor), exported to DIR; its logits of TOKENS written as "logits" to OUT.
#include <strata/core/error.hpp>
#include <strata/io/gpt2.hpp>
#include <strata/io/safetensors.hpp>
#include <strata/models/gpt.hpp>
#include <strata/optim/adamw.hpp>
#include <strata/train/trainer.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <string>
#include <vector>

namespace st = strata;
namespace sf = strata::io::safetensors;

namespace {

using gpt_trainer = st::trainer<st::models::gpt_model<float>>;

gpt_trainer make_trainer(st::models::gpt_config const& c) {
  return gpt_trainer(st::models::gpt_model<float>{c}, st::engine::use<st::optim::adamw<float>>(),
                     {.lr = [](std::int64_t) { return 1e-2; }, .seed = 24});
}

struct tokens {
  std::vector<std::int32_t> ids, next;
  std::size_t sequences = 0, seq = 0;

  explicit tokens(sf::reader const& r) {
    auto const& t = r.at("tokens");
    if (t.shape.size() != 2)
      throw st::config_error("strata_gpt2_tool: 'tokens' must be [sequences, seq]");
    sequences = t.shape[0], seq = t.shape[1];
    ids = r.values<std::int32_t>("tokens");
    next.resize(ids.size());
    for (std::size_t i = 0; i < ids.size(); ++i)
      next[i] = (i + 1) % seq == 0 ? ids[i] : ids[i + 1];
  }
  st::engine::batch_view<float> view() const { return {sequences, seq, ids, {}, next}; }
};

void write_logits(std::vector<float> const& logits, tokens const& t, std::size_t vocab,
                  std::filesystem::path const& out) {
  sf::writer w;
  w.add("logits", {t.sequences, t.seq, vocab}, logits);
  w.write(out);
}

int import_and_compare(char** argv) {
  std::filesystem::path const model = argv[2];
  std::size_t const heads = std::stoul(argv[3]);
  sf::reader const ref(argv[4]);
  st::models::gpt_config const c = st::io::gpt2::config_of(model, heads);
  std::printf("strata_gpt2_tool: %s implies vocab %zu, seq %zu, features %zu, %zu heads, %zu "
              "layers\n",
              model.c_str(), c.vocab, c.seq, c.features, c.heads, c.layers);
  gpt_trainer t = make_trainer(c);
  st::io::gpt2::import_gpt2(t, model);
  tokens const in(ref);
  std::vector<float> const logits = t.predict(in.view(), {.logits = true}).logits;
  std::vector<float> const want = ref.values<float>("logits");
  write_logits(logits, in, c.vocab, argv[5]);
  if (logits.size() != want.size()) {
    std::fprintf(stderr, "strata_gpt2_tool: %zu logits, the reference has %zu\n", logits.size(),
                 want.size());
    return 1;
  }
  double diff = 0, scale = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    diff = std::max(diff, std::abs(double(logits[i]) - double(want[i])));
    scale = std::max(scale, std::abs(double(want[i])));
  }
  bool const ok = scale > 0 && diff <= 1e-4 * scale;
  std::printf("strata_gpt2_tool: import %s: max |strata - numpy| %.3g, max |numpy| %.3g, relative "
              "%.3g (limit 1e-4): %s\n",
              model.c_str(), diff, scale, scale > 0 ? diff / scale : 0.0, ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}

int export_model(char** argv) {
  st::models::gpt_config const c{
      .vocab = 50, .seq = 16, .features = 32, .heads = 4, .layers = 2, .tie_embeddings = true};
  gpt_trainer t = make_trainer(c);
  sf::reader const r(argv[3]);
  tokens const in(r);
  for (int s = 0; s < 3; ++s)
    t.step(in.view());
  st::io::gpt2::export_gpt2(t, argv[2]);
  write_logits(t.predict(in.view(), {.logits = true}).logits, in, c.vocab, argv[4]);
  std::printf("strata_gpt2_tool: exported to %s\n", argv[2]);
  return 0;
}

} // namespace

int main(int argc, char** argv) {
  try {
    std::string const mode = argc > 1 ? argv[1] : "";
    if (mode == "import" && argc == 6)
      return import_and_compare(argv);
    if (mode == "export" && argc == 5)
      return export_model(argv);
    std::fprintf(stderr, "usage: strata_gpt2_tool import MODEL HEADS REFERENCE OUT\n"
                         "       strata_gpt2_tool export DIR TOKENS OUT\n");
    return 2;
  } catch (std::exception const& e) {
    std::fprintf(stderr, "strata_gpt2_tool: %s\n", e.what());
    return 1;
  }
}
