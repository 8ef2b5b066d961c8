// A character-level GPT trained on one rank on a real text: the GPL under
// /usr/share/common-licenses (present on every Debian machine) or any file given by --data.
//
//   strata_train_gpt [--data FILE] [--steps N] [--batch B] [--seq T] [--layers L]
//                    [--features D] [--heads H] [--lr LR] [--micro-batches M] [--seed S]
//                    [--eval-every N] [--expect-margin NATS]
//
// Prints one line per step (step, loss, tokens/s, peak memory), the validation loss every
// --eval-every steps, and at the end the validation loss beside the text's unigram entropy:
// a model that only learns letter frequencies reaches that entropy, one that learns more goes
// below it. With --expect-margin m it exits 1 unless the final validation loss is below the
// entropy minus m nats.
#include <strata/data/loader.hpp>
#include <strata/data/sampler.hpp>
#include <strata/data/text_dataset.hpp>
#include <strata/models/gpt.hpp>
#include <strata/optim/adamw.hpp>
#include <strata/optim/schedule.hpp>
#include <strata/train/trainer.hpp>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <string_view>

namespace st = strata;

namespace {

struct options {
  std::string data = "/usr/share/common-licenses/GPL-3";
  std::size_t steps = 300, batch = 8, seq = 64, layers = 8, features = 64, heads = 4;
  std::size_t micro_batches = 1, eval_every = 50;
  double lr = 5e-3, expect_margin = -1;
  std::uint64_t seed = 1234;
};

[[noreturn]] void usage(std::string const& why) {
  std::fprintf(stderr,
               "strata_train_gpt: %s\n"
               "usage: strata_train_gpt [--data FILE] [--steps N] [--batch B] [--seq T] "
               "[--layers L] [--features D] [--heads H] [--lr LR] [--micro-batches M] "
               "[--seed S] [--eval-every N] [--expect-margin NATS]\n",
               why.c_str());
  std::exit(2);
}

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    std::string_view const a = argv[i];
    if (i + 1 >= argc)
      usage("option " + std::string(a) + " needs a value");
    std::string const v = argv[++i];
    auto number = [&](auto& out) {
      char* end = nullptr;
      double const x = std::strtod(v.c_str(), &end);
      if (end == v.c_str() || *end != '\0' || x < 0)
        usage("option " + std::string(a) + " takes a number >= 0, got \"" + v + "\"");
      out = static_cast<std::remove_reference_t<decltype(out)>>(x);
    };
    if (a == "--data")
      o.data = v;
    else if (a == "--steps")
      number(o.steps);
    else if (a == "--batch")
      number(o.batch);
    else if (a == "--seq")
      number(o.seq);
    else if (a == "--layers")
      number(o.layers);
    else if (a == "--features")
      number(o.features);
    else if (a == "--heads")
      number(o.heads);
    else if (a == "--lr")
      number(o.lr);
    else if (a == "--micro-batches")
      number(o.micro_batches);
    else if (a == "--seed")
      number(o.seed);
    else if (a == "--eval-every")
      number(o.eval_every);
    else if (a == "--expect-margin")
      number(o.expect_margin);
    else
      usage("unknown option " + std::string(a));
  }
  return o;
}

double mib(std::size_t bytes) {
  return static_cast<double>(bytes) / (1024.0 * 1024.0);
}

} // namespace

int main(int argc, char** argv) try {
  options const o = parse(argc, argv);
  st::data::text_dataset const text(o.data, o.seq, st::data::text_encoding::character);
  auto const [train, val] = text.split(0.9);
  double const entropy = text.unigram_entropy();
  std::printf("data: %s, %zu characters, vocabulary %zu, unigram entropy %.3f nats\n",
              o.data.c_str(), text.tokens().size(), text.vocab(), entropy);

  st::models::gpt_model<float> const model{{.vocab = text.vocab(),
                                            .seq = o.seq,
                                            .features = o.features,
                                            .heads = o.heads,
                                            .layers = o.layers}};
  st::optim::warmup_cosine_schedule const schedule(
      {.max_lr = o.lr,
       .min_lr = o.lr / 10,
       .warmup_steps = std::min<std::int64_t>(20, static_cast<std::int64_t>(o.steps)),
       .total_steps = static_cast<std::int64_t>(o.steps)});
  st::trainer<st::models::gpt_model<float>> trainer(
      model, st::engine::use<st::optim::adamw<float>>({.weight_decay = 0.1}),
      {.lr = schedule, .clip = 1.0, .seed = o.seed, .micro_batches = o.micro_batches});
  std::printf("model: GPT, %zu blocks, d %zu, %zu heads, %zu parameters; batch %zu x %zu "
              "tokens, %zu micro-batches\n",
              o.layers, o.features, o.heads, trainer.parameter_count(), o.batch, o.seq,
              trainer.micro_batches());

  st::data::loader train_loader(train,
                                st::data::distributed_sampler(train.size(), 1, 0, {.seed = o.seed}),
                                {.batch = o.batch});
  st::data::loader val_loader(val,
                              st::data::distributed_sampler(val.size(), 1, 0, {.shuffle = false}),
                              {.batch = std::min(o.batch, val.size())});
  std::size_t const val_batches = val_loader.batches_per_epoch();
  auto validate = [&] {
    double sum = 0;
    for (std::size_t i = 0; i < val_batches; ++i)
      sum += trainer.evaluate(val_loader.next());
    return sum / static_cast<double>(val_batches);
  };

  for (std::size_t s = 1; s <= o.steps; ++s) {
    auto const r = trainer.step(train_loader.next());
    double const tokens = static_cast<double>(o.batch * o.seq);
    std::printf(
        "step %4zu  loss %.4f  norm %.3f  lr %.2e  %8.0f tokens/s  %6.1f ms  peak %.2f MiB\n", s,
        r.loss, r.grad_norm, r.lr, tokens / r.seconds, r.seconds * 1e3,
        mib(trainer.ledger().peak()));
    if (o.eval_every && s % o.eval_every == 0 && s != o.steps)
      std::printf("step %4zu  validation loss %.4f\n", s, validate());
  }
  double const final_loss = validate();
  std::printf("final: validation loss %.4f nats, unigram entropy %.4f nats (%+.4f)\n", final_loss,
              entropy, final_loss - entropy);
  std::printf("%s", trainer.ledger().report().c_str());
  if (o.expect_margin >= 0 && !(final_loss < entropy - o.expect_margin)) {
    std::fprintf(stderr,
                 "strata_train_gpt: the validation loss %.4f is not below the unigram entropy "
                 "%.4f minus %.2f nats: the model learned no more than letter frequencies\n",
                 final_loss, entropy, o.expect_margin);
    return 1;
  }
  return 0;
} catch (std::exception const& e) {
  std::fprintf(stderr, "strata_train_gpt: %s\n", e.what());
  return 1;
}
