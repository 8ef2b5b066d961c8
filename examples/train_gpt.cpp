// The training demo: a character-level GPT trained on a real text — the GPL under
// /usr/share/common-licenses (present on every Debian machine) or any file given by --data —
// or a GPT trained on a file of token ids (nanoGPT's train.bin), under a parallel layout chosen
// by flags, on in-process ranks (threads; the default), under mpirun with --backend mpi, or
// as one process a rank under strata_run (or any launcher that sets torchrun's RANK,
// WORLD_SIZE, MASTER_ADDR and MASTER_PORT) with --backend gloo.
//
//   strata_train_gpt [--dp N] [--tp N] [--pp N] [--zero S] [--schedule gpipe|1f1b|interleaved]
//                    [--micro-batches M] [--precision fp32|bf16|fp16]
//                    [--recompute none|full|selective|every:K|offload]
//                    [--backend local|mpi|gloo] [--checkpoint DIR] [--checkpoint-every N]
//                    [--loss-log FILE] [--plan] [--memory GIB] [--devices-per-node N]
//                    [--machine FILE]
//                    [--data FILE] [--data-dtype auto|u16|u32] [--vocab V] [--steps N]
//                    [--batch B] [--seq T] [--layers L] [--features D] [--heads H] [--lr LR]
//                    [--seed S] [--eval-every N] [--csv FILE] [--svg FILE]
//                    [--expect-margin NATS] [--generate N] [--temperature T] [--prompt TEXT]
//                    [--profile DIR] [--timers N]
//
// --plan prints the planner's estimate of the layout the flags give (memory by kind on each
// pipeline rank, each group's collectives a step, the bubble) and the layouts it suggests for
// dp x tp x pp devices (--memory GIB a device, --devices-per-node N), then exits: nothing is
// trained, no data is read (the vocabulary is --vocab, else 256, a byte text's).
//
// --machine FILE (a machine profile strata_calibrate wrote) prints, after training, the
// planner's estimated step time beside the measured median step and the error.
//
// --data takes a text file (character-level ids) or a token file: flat little-endian u16 or
// u32 ids, mapped and read on demand. It is a token file when --data-dtype gives its width,
// when it has a strata index beside it (FILE.idx, which gives the width, the vocabulary and
// the documents), or when its name ends in .bin (then without an index --data-dtype must say
// the width). --vocab sets the vocabulary of a token file (default: its index's, else the
// largest id + 1). The first 90% of the ids train, the rest validate (at most 20 batches).
//
// The default layout is hybrid, on 4 ranks: dp 2 x pp 2 (1F1B, 4 micro-batches), data
// parallel. --zero S (1, 2, 3) shards the data-parallel state (ZeRO-S); --tp N splits every
// block over N ranks (the vocabulary is padded to a multiple of N). World = dp x tp x pp.
// A layout the library cannot run (heads that do not divide by --tp, more stages than
// layers, ...) stops with the library's own message.
//
// Prints one line per step (step, loss, tokens/s, the step's time, the largest peak memory of
// any rank), the validation loss every --eval-every steps, and at the end the validation loss
// beside the text's unigram entropy (a model that only learns letter frequencies reaches that
// entropy; one that learns more goes below it), the time in compute against exposed
// communication, a CSV of the metrics (--csv) and the loss curve as an SVG file (--svg). With
// --expect-margin m it exits 1 unless the final validation loss is below the entropy minus m
// nats.
//
// Every --timers N steps (default 50; 0: never) it prints the timers block: forward, backward,
// optimizer, communication waits, pipeline bubble and the step, each the (min, max) over the
// ranks of its mean over the interval (profile::timers: one all_gather an interval). With
// --profile DIR (a build with nlohmann_json) it records steps 6 to 8 with the profiler (a
// warm-up step first), writes each rank's Chrome trace into DIR, merges them into
// DIR/trace.json and prints where to open it (docs/profiling.md).
//
// With --backend gloo the world is the launcher's (WORLD_SIZE processes) and --dp, when not
// given, is WORLD_SIZE / (tp x pp): under strata_run's elastic rendezvous the same command runs
// on whatever number of nodes the round formed, with --batch (the global batch) kept. Each
// process reports its steps to the agent (elastic::progress_reporter: the section timeout and
// the straggler report) and writes an error file that the agent quotes when it fails
// (elastic::run_recorded); a collective that fails (a peer died) is printed with the time.
//
// With --checkpoint DIR the run starts from DIR's newest complete checkpoint when there is one
// (the model, the optimizer, the step and the data loader's place: any layout, any number of
// ranks) and saves one every --checkpoint-every N steps (0: only at the end). --loss-log FILE
// appends a line a step from rank 0: "step S loss L world W restart R unix_ms T", L in C's
// hexadecimal floating point (exact), R TORCHELASTIC_RESTART_COUNT, T the step's end.
//
// With --generate N, after training it continues --prompt (default: the first 32 tokens of the
// validation text) by N tokens, one trainer.predict a token on the last --seq tokens: the
// argmax (greedy) by default, or with --temperature T > 0 a sample from softmax(logits / T)
// drawn by a generator seeded with --seed. It prints the prompt and its continuation as
// text; for data without an alphabet (token files) as token ids.
#include <strata/comm/local.hpp>
#include <strata/comm/mesh.hpp>
#include <strata/data/loader.hpp>
#include <strata/data/sampler.hpp>
#include <strata/data/text_dataset.hpp>
#include <strata/data/token_file.hpp>
#include <strata/data/token_file_dataset.hpp>
#include <strata/elastic/worker.hpp>
#include <strata/models/gpt.hpp>
#include <strata/optim/adamw.hpp>
#include <strata/optim/schedule.hpp>
#include <strata/plan/planner.hpp>
#include <strata/plan/time.hpp>
#include <strata/profile/profiler.hpp>
#include <strata/profile/timers.hpp>
#include <strata/train/trainer.hpp>
#if STRATA_DEMO_MPI
#include <strata/comm/mpi.hpp>
#endif
#if STRATA_DEMO_GLOO
#include <strata/comm/gloo.hpp>
#endif
#if STRATA_DEMO_PROFILE
#include <strata/profile/chrome_trace.hpp>
#endif
#if STRATA_DEMO_CHECKPOINT
#include <strata/io/trainer_checkpoint.hpp>
#endif

#include <algorithm>
#include <any>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <vector>

namespace st = strata;

namespace {

struct options {
  std::string data = "/usr/share/common-licenses/GPL-3";
  std::string data_dtype = "auto"; // a token file's id width: auto (its index), u16, u32
  std::size_t vocab = 0;           // a token file's vocabulary: 0 = the index's or max id + 1
  std::size_t steps = 300, batch = 8, seq = 64, layers = 8, features = 64, heads = 4;
  std::size_t micro_batches = 4, eval_every = 50;
  int dp = 2, tp = 1, pp = 2, zero = 0;
  std::string schedule = "1f1b", precision = "fp32", recompute = "none", backend = "local";
  std::string csv = "strata_train_gpt.csv", svg = "strata_train_gpt.svg";
  double lr = 5e-3, expect_margin = -1;
  std::uint64_t seed = 1234;
  std::size_t generate = 0;         // tokens to generate after training
  double temperature = 0;           // 0: greedy
  std::string prompt;               // empty: the start of the validation text
  bool tie = false;                 // the head reads the token table (GPT-2's tied embeddings)
  std::string profile;              // a directory for the Chrome traces; empty: no profiler
  std::size_t timers = 50;          // the timers block every N steps (0: never)
  bool dp_given = false;            // --dp was given (with gloo, else WORLD_SIZE / (tp x pp))
  std::string checkpoint;           // a checkpoint root to resume from and save into; empty: none
  std::size_t checkpoint_every = 0; // steps between saves (0: at the end only)
  std::string loss_log;             // rank 0's step losses, exact, appended; empty: none
  bool plan = false;                // print the estimate and the suggestions, run nothing
  double memory_gib = 80;           // --plan: memory a device
  int devices_per_node = 8;         // --plan: tp stays within a node
  std::string machine;              // a machine profile: the estimated step beside the measured
};

[[noreturn]] void usage(std::string const& why) {
  std::fprintf(stderr,
               "strata_train_gpt: %s\n"
               "usage: strata_train_gpt [--dp N] [--tp N] [--pp N] [--zero S] "
               "[--schedule gpipe|1f1b|interleaved] [--micro-batches M] "
               "[--precision fp32|bf16|fp16] [--recompute none|full|selective|every:K|offload] "
               "[--backend local|mpi|gloo] [--data FILE] [--data-dtype auto|u16|u32] [--vocab V] "
               "[--steps N] [--batch B] [--seq T] "
               "[--layers L] [--features D] [--heads H] [--lr LR] [--seed S] [--eval-every N] "
               "[--csv FILE] [--svg FILE] [--expect-margin NATS] [--generate N] "
               "[--temperature T] [--prompt TEXT] [--tie-embeddings 0|1] [--profile DIR] "
               "[--timers N] [--checkpoint DIR] [--checkpoint-every N] [--loss-log FILE]\n",
               why.c_str());
  std::exit(2);
}

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    std::string_view const a = argv[i];
    if (a == "--plan") { // a flag: no value
      o.plan = true;
      continue;
    }
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
    auto one_of = [&](std::initializer_list<std::string_view> allowed) {
      for (auto x : allowed)
        if (v == x)
          return v;
      std::string list;
      for (auto x : allowed)
        list += (list.empty() ? "" : ", ") + std::string(x);
      usage("option " + std::string(a) + " takes one of " + list + ", got \"" + v + "\"");
    };
    if (a == "--data")
      o.data = v;
    else if (a == "--data-dtype")
      o.data_dtype = one_of({"auto", "u16", "u32"});
    else if (a == "--vocab")
      number(o.vocab);
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
    else if (a == "--dp") {
      number(o.dp);
      o.dp_given = true;
    } else if (a == "--tp")
      number(o.tp);
    else if (a == "--pp")
      number(o.pp);
    else if (a == "--zero")
      number(o.zero);
    else if (a == "--schedule")
      o.schedule = one_of({"gpipe", "1f1b", "interleaved"});
    else if (a == "--precision")
      o.precision = one_of({"fp32", "bf16", "fp16"});
    else if (a == "--backend")
      o.backend = one_of({"local", "mpi", "gloo"});
    else if (a == "--recompute") {
      if (v.rfind("every:", 0) != 0)
        o.recompute = one_of({"none", "full", "selective", "offload"});
      else
        o.recompute = v;
    } else if (a == "--generate")
      number(o.generate);
    else if (a == "--temperature")
      number(o.temperature);
    else if (a == "--tie-embeddings")
      o.tie = one_of({"0", "1"}) == "1";
    else if (a == "--prompt")
      o.prompt = v;
    else if (a == "--profile") {
#if STRATA_DEMO_PROFILE
      o.profile = v;
#else
      usage("--profile needs a build with nlohmann_json (the trace's JSON)");
#endif
    } else if (a == "--timers")
      number(o.timers);
    else if (a == "--checkpoint") {
#if STRATA_DEMO_CHECKPOINT
      o.checkpoint = v;
#else
      usage("--checkpoint needs a build with nlohmann_json (the checkpoint's index)");
#endif
    } else if (a == "--checkpoint-every")
      number(o.checkpoint_every);
    else if (a == "--loss-log")
      o.loss_log = v;
    else if (a == "--machine")
      o.machine = v;
    else if (a == "--memory")
      number(o.memory_gib);
    else if (a == "--devices-per-node")
      number(o.devices_per_node);
    else if (a == "--csv")
      o.csv = v;
    else if (a == "--svg")
      o.svg = v;
    else
      usage("unknown option " + std::string(a));
  }
  if (o.dp < 1 || o.tp < 1 || o.pp < 1)
    usage("--dp, --tp and --pp take sizes >= 1");
  if (o.zero > 3)
    usage("--zero takes 0 (data parallel), 1, 2 or 3");
  if (o.checkpoint_every != 0 && o.checkpoint.empty())
    usage("--checkpoint-every needs --checkpoint DIR");
  if (o.backend != "gloo" && o.batch % static_cast<std::size_t>(o.dp) != 0)
    usage("--batch " + std::to_string(o.batch) + " does not split over --dp " +
          std::to_string(o.dp) + ": give a multiple of it");
  return o;
}

// The layout as options by name, each option's settings parsed from the flags (no plan type
// per layout): the trainer builds each through its option_traits, as it does a plan<...>'s.
st::runtime_layout layout_of(options const& o) {
  st::runtime_layout l;
  l.micro_batches = o.micro_batches;
  if (o.zero == 0) {
    l.add<st::data_parallel<>>();
  } else {
    auto z = st::option_traits<st::sharded<st::zero<1>>>::options(); // the defaults
    z.stage = o.zero;
    l.add("sharded", z);
  }
  l.add<st::tensor_parallel<>>();
  if (o.pp > 1) {
    st::plan_descriptor::pipeline_desc p{};
    p.enabled = true;
    p.schedule = o.schedule == "gpipe" ? 0 : o.schedule == "1f1b" ? 1 : 2;
    p.chunks = o.schedule == "interleaved" ? 2 : 1;
    l.add("pipeline_parallel", p);
  }
  st::recompute_options r{};
  if (o.recompute == "full")
    r.every = 1;
  else if (o.recompute == "selective")
    r.selective = true;
  else if (o.recompute == "offload")
    r.every = 1, r.offload = true;
  else if (o.recompute.rfind("every:", 0) == 0)
    r.every = std::strtoul(o.recompute.c_str() + 6, nullptr, 10);
  if (r.every > 0 || r.selective)
    l.add("recompute", r);
  return l;
}

// The GPT of the flags, its vocabulary padded to a multiple of tp (for the split).
st::models::gpt_model<float> model_of(options const& o, std::size_t vocab) {
  std::size_t const tp = static_cast<std::size_t>(o.tp);
  return {{.vocab = (vocab + tp - 1) / tp * tp,
           .seq = o.seq,
           .features = o.features,
           .heads = o.heads,
           .layers = o.layers,
           .tie_embeddings = o.tie}};
}

long long unix_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

double mib(std::size_t bytes) {
  return static_cast<double>(bytes) / (1024.0 * 1024.0);
}

struct step_row {
  std::size_t step;
  double loss, tokens_per_s, step_ms, compute_ms, comm_ms, peak_mib;
};

void write_csv(std::string const& path, std::vector<step_row> const& rows) {
  std::ofstream f(path);
  f << "step,loss,tokens_per_s,step_ms,compute_ms,exposed_comm_ms,peak_mib_max_rank\n";
  for (auto const& r : rows)
    f << r.step << ',' << r.loss << ',' << r.tokens_per_s << ',' << r.step_ms << ',' << r.compute_ms
      << ',' << r.comm_ms << ',' << r.peak_mib << '\n';
}

// The training loss by step as a polyline, with the unigram entropy as a dashed line.
void write_svg(std::string const& path, std::vector<step_row> const& rows, double entropy,
               std::string const& title) {
  double const w = 720, h = 360, l = 60, r = 20, t = 40, b = 40;
  double hi = entropy, lo = entropy;
  for (auto const& x : rows)
    hi = std::max(hi, x.loss), lo = std::min(lo, x.loss);
  lo = std::max(0.0, lo - 0.1);
  hi += 0.1;
  double const n = static_cast<double>(std::max<std::size_t>(rows.size(), 2) - 1);
  auto px = [&](double i) { return l + (w - l - r) * i / n; };
  auto py = [&](double v) { return t + (h - t - b) * (hi - v) / (hi - lo); };
  std::ofstream f(path);
  f << "<svg xmlns='http://www.w3.org/2000/svg' width='" << w << "' height='" << h
    << "' font-family='sans-serif' font-size='12'>\n<rect width='100%' height='100%' "
       "fill='white'/>\n<text x='"
    << l << "' y='20'>" << title << "</text>\n";
  f << "<line x1='" << l << "' y1='" << h - b << "' x2='" << w - r << "' y2='" << h - b
    << "' stroke='black'/><line x1='" << l << "' y1='" << t << "' x2='" << l << "' y2='" << h - b
    << "' stroke='black'/>\n";
  for (int k = 0; k <= 4; ++k) {
    double const v = lo + (hi - lo) * k / 4;
    f << "<text x='5' y='" << py(v) + 4 << "'>" << static_cast<int>(v * 100) / 100.0 << "</text>\n";
  }
  f << "<text x='" << w / 2 << "' y='" << h - 10 << "'>step (1 to " << rows.size()
    << ")</text>\n<text x='" << l + 5 << "' y='" << py(entropy) - 5
    << "' fill='gray'>unigram entropy</text>\n<line x1='" << l << "' y1='" << py(entropy)
    << "' x2='" << w - r << "' y2='" << py(entropy)
    << "' stroke='gray' stroke-dasharray='4 4'/>\n<polyline fill='none' stroke='steelblue' "
       "stroke-width='1.5' points='";
  for (std::size_t i = 0; i < rows.size(); ++i)
    f << px(static_cast<double>(i)) << ',' << py(rows[i].loss) << ' ';
  f << "'/>\n</svg>\n";
}

// What the demo trains on: the training and validation views of one dataset (text or token
// file), its vocabulary, the unigram entropy to beat, what to print of it, and how many
// validation batches to read at most.
template <class Dataset>
struct training_data {
  Dataset train, validation;
  std::size_t vocab;
  double entropy;
  std::string line;
  std::size_t max_val_batches;
};

// --data is a token file when --data-dtype gives its width, when it has an index, or when its
// name ends in .bin.
bool token_file(options const& o) {
  std::error_code ec;
  return o.data_dtype != "auto" ||
         std::filesystem::exists(st::data::token_index_path(o.data), ec) ||
         std::filesystem::path(o.data).extension() == ".bin";
}

// A token file, mapped: the width from --data-dtype or its index; the vocabulary from --vocab,
// its index or its largest id; the entropy over its first 2^24 ids.
training_data<st::data::token_file_dataset> token_data(options const& o) {
  namespace sd = st::data;
  std::filesystem::path const index = sd::token_index_path(o.data);
  std::error_code ec;
  if (o.data_dtype == "auto" && !std::filesystem::exists(index, ec))
    throw st::config_error("--data " + o.data + " has no index '" + index.string() +
                           "' to say the width of its ids; give --data-dtype u16 (nanoGPT's "
                           "train.bin) or --data-dtype u32");
  sd::token_file_options const options{.sample_tokens = o.seq,
                                       .vocab = o.vocab,
                                       .dtype = o.data_dtype == "u16" ? sd::token_dtype::u16
                                                : o.data_dtype == "u32"
                                                    ? sd::token_dtype::u32
                                                    : sd::token_dtype::from_index};
  sd::token_file_dataset const tokens(o.data, options);
  auto [train, validation] = tokens.split(0.9);
  std::size_t const entropy_ids = std::min<std::size_t>(tokens.token_count(), 1u << 24);
  std::string line =
      o.data + ", " + std::to_string(tokens.token_count()) + " " + sd::to_string(tokens.dtype()) +
      " ids (" +
      (tokens.indexed() ? "index " + index.string() : std::string("no index: read once")) +
      "; documents " + std::to_string(tokens.documents()) + ")";
  double const entropy = tokens.unigram_entropy(entropy_ids);
  if (entropy_ids < tokens.token_count())
    line += " [entropy over the first " + std::to_string(entropy_ids) + " ids]";
  return {std::move(train), std::move(validation), tokens.vocab(), entropy, std::move(line), 20};
}

// A text file, character-level ids.
training_data<st::data::text_dataset> text_data(options const& o) {
  st::data::text_dataset const text(o.data, o.seq, st::data::text_encoding::character);
  auto [train, validation] = text.split(0.9);
  return {std::move(train),
          std::move(validation),
          text.vocab(),
          text.unigram_entropy(),
          o.data + ", " + std::to_string(text.tokens().size()) + " characters",
          std::numeric_limits<std::size_t>::max()};
}

// How generated tokens are read and shown: a character alphabet, or none (token ids).
struct token_text {
  std::function<std::int32_t(char)> encode; // empty: the prompt is token ids
  std::function<char(std::int32_t)> decode;
};

// The prompt's ids: its characters through the alphabet, or (no alphabet) the ids it lists.
std::vector<std::int32_t> prompt_ids(std::string const& prompt, token_text const& text) {
  std::vector<std::int32_t> ids;
  if (text.encode) {
    for (char c : prompt)
      ids.push_back(text.encode(c));
    return ids;
  }
  char const* p = prompt.c_str();
  for (char* end = nullptr;; p = end) {
    long const id = std::strtol(p, &end, 10);
    if (end == p)
      break;
    ids.push_back(static_cast<std::int32_t>(id));
    while (*end == ',' || *end == ' ')
      ++end;
  }
  return ids;
}

// Continues `context` by o.generate tokens: each a forward of the last o.seq tokens through
// trainer.predict (collective: every rank calls it, with the same context, and gets the
// same next token). Greedy asks for the top (padding + 1) classes and takes the best real
// one (a class the tp padding added is never a token); a temperature asks for the logits of
// the last position and samples the real classes.
template <class Trainer>
std::vector<std::int32_t> generate(Trainer& trainer, options const& o, std::size_t real_vocab,
                                   std::size_t vocab, std::vector<std::int32_t> context) {
  std::mt19937_64 rng(o.seed);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  std::vector<std::int32_t> window(o.seq), targets(o.seq, 0), out;
  std::vector<double> p(real_vocab);
  for (std::size_t i = 0; i < o.generate; ++i) {
    std::size_t const len = std::min(context.size(), o.seq);
    std::fill(window.begin(), window.end(), 0); // after the last position: causal, unread
    std::copy(context.end() - static_cast<std::ptrdiff_t>(len), context.end(), window.begin());
    st::data::token_batch const b{
        .sequences = 1, .seq = o.seq, .tokens = window, .targets = targets};
    std::size_t const row = len - 1;
    std::int32_t next = 0;
    if (o.temperature > 0) {
      auto const pred = trainer.predict(b, {.logits = true});
      auto const z = pred.logits_of(row);
      double const top = *std::max_element(z.begin(), z.begin() + real_vocab);
      double sum = 0;
      for (std::size_t j = 0; j < real_vocab; ++j)
        sum += p[j] = std::exp((z[j] - top) / o.temperature);
      double u = uniform(rng) * sum;
      next = static_cast<std::int32_t>(real_vocab - 1);
      for (std::size_t j = 0; j < real_vocab; ++j)
        if ((u -= p[j]) < 0) {
          next = static_cast<std::int32_t>(j);
          break;
        }
    } else {
      auto const pred = trainer.predict(b, {.top_k = vocab - real_vocab + 1});
      for (std::int32_t id : pred.top_ids_of(row))
        if (static_cast<std::size_t>(id) < real_vocab) {
          next = id;
          break;
        }
    }
    context.push_back(next);
    out.push_back(next);
  }
  return out;
}

// The tokens as text, or as ids.
std::string show(std::vector<std::int32_t> const& ids, token_text const& text) {
  std::string s;
  for (std::int32_t id : ids)
    s += text.decode ? std::string(1, text.decode(id)) : std::to_string(id) + " ";
  return s;
}

// One rank's run; every rank runs it, rank 0 prints and writes the files. Returns the exit
// code.
template <class Precision, class C, class Dataset>
int train_on(C& world, options const& o, training_data<Dataset> const& data) {
  st::comm::mesh mesh(world, {.dp = o.dp, .tp = o.tp, .pp = o.pp});
  bool const lead = world.rank() == 0;
  auto const& train_set = data.train;
  auto const& val_set = data.validation;
  double const entropy = data.entropy;
  auto const model = model_of(o, data.vocab);
  std::size_t const vocab = model.config.vocab; // padded for the tp split
  st::optim::warmup_cosine_schedule const schedule(
      {.max_lr = o.lr,
       .min_lr = o.lr / 10,
       .warmup_steps = std::min<std::int64_t>(20, static_cast<std::int64_t>(o.steps)),
       .total_steps = static_cast<std::int64_t>(o.steps)});
  st::trainer<st::models::gpt_model<float>, st::runtime_plan<Precision>> trainer(
      mesh, model, st::engine::use<st::optim::adamw<float>>({.weight_decay = 0.1}),
      {.lr = schedule, .clip = 1.0, .seed = o.seed}, layout_of(o));
  if (lead) {
    std::printf("data: %s, vocabulary %zu (model: %zu), unigram entropy %.3f nats\n",
                data.line.c_str(), data.vocab, vocab, entropy);
    std::string const dp_kind = o.zero ? "ZeRO-" + std::to_string(o.zero) : "data parallel";
    std::printf("layout: %d ranks (%s backend) = dp %d x tp %d x pp %d; %s, %s, %zu "
                "micro-batches, %s, recompute %s\n",
                world.size(), o.backend.c_str(), o.dp, o.tp, o.pp, dp_kind.c_str(),
                o.pp > 1 ? o.schedule.c_str() : "no pipeline", trainer.micro_batches(),
                o.precision.c_str(), o.recompute.c_str());
    std::printf("model: GPT, %zu blocks, d %zu, %zu heads; rank 0 holds %zu parameters; global "
                "batch %zu x %zu tokens\n",
                o.layers, o.features, o.heads, trainer.parameter_count(), o.batch, o.seq);
  }
  int const dp_rank = mesh.coords().dp;
  std::size_t const per = o.batch / static_cast<std::size_t>(o.dp);
  st::data::loader train_loader(
      train_set, st::data::distributed_sampler(train_set.size(), o.dp, dp_rank, {.seed = o.seed}),
      {.batch = per});
  std::size_t const val_per = std::max<std::size_t>(1, std::min(per, val_set.size() / o.dp));
  st::data::loader val_loader(
      val_set, st::data::distributed_sampler(val_set.size(), o.dp, dp_rank, {.shuffle = false}),
      {.batch = val_per});
  std::size_t const val_batches = std::min(val_loader.batches_per_epoch(), data.max_val_batches);
  st::data::loader_state const val_start = val_loader.state();
  auto validate = [&] { // the same batches each time
    val_loader.load(val_start);
    double sum = 0;
    for (std::size_t i = 0; i < val_batches; ++i)
      sum += trainer.evaluate(val_loader.next());
    return sum / static_cast<double>(val_batches);
  };

  std::size_t first = 1; // the first step this run takes
#if STRATA_DEMO_CHECKPOINT
  if (!o.checkpoint.empty()) {
    // Every rank finds the same newest complete checkpoint (no save is in flight at a start);
    // the ranks check that they agree before loading.
    auto const found = st::io::store(o.checkpoint).find_latest();
    std::int64_t const step = found ? found->step : -1;
    std::int64_t range[2] = {-step, step}; // one all-reduce (max) gives the lowest and highest
    world.all_reduce(std::span<std::int64_t>(range, 2), st::comm::reduce_op::max);
    if (-range[0] != range[1])
      throw st::config_error("the ranks found different newest checkpoints under --checkpoint " +
                             o.checkpoint + " (steps " + std::to_string(-range[0]) + " and " +
                             std::to_string(range[1]) + "; -1: none): give every rank the same " +
                             "directory");
    if (found) {
      first = static_cast<std::size_t>(st::io::load(trainer, mesh, found->path)) + 1;
      if (auto const l = st::io::saved_loader_state(found->path))
        train_loader.load(*l);
      if (lead)
        std::printf("resumed from %s (step %lld) on %d ranks\n", found->path.string().c_str(),
                    static_cast<long long>(first - 1), world.size());
    }
  }
#endif
  std::FILE* loss_log = nullptr;
  if (lead && !o.loss_log.empty()) {
    loss_log = std::fopen(o.loss_log.c_str(), "a");
    if (loss_log == nullptr)
      throw st::config_error("--loss-log " + o.loss_log + " cannot be opened for appending");
  }
  struct closer {
    std::FILE* f;
    ~closer() {
      if (f)
        std::fclose(f);
    }
  } const close_log{loss_log};
  int const restart = st::elastic::restart_count();
  st::elastic::progress_reporter progress; // for strata_run's agent; idle without one

  std::vector<step_row> rows;
  double compute_s = 0, comm_s = 0;
  st::profile::timers timers;
#if STRATA_DEMO_PROFILE
  std::filesystem::path const trace_dir = o.profile;
  std::filesystem::path const rank_trace =
      trace_dir / ("rank" + std::to_string(world.rank()) + ".json");
  if (!o.profile.empty() && lead)
    std::filesystem::create_directories(trace_dir);
  std::optional<st::profile::profiler> profiler;
  if (!o.profile.empty())
    profiler.emplace(
        st::profile::schedule{.skip_first = 4, .wait = 0, .warmup = 1, .active = 3, .repeat = 1},
        [&](st::profile::profiler& p) { st::profile::write_chrome_trace(p, rank_trace); },
        st::profile::process_of(mesh));
#endif
  for (std::size_t s = first; s <= o.steps; ++s) {
    auto const r = [&] {
      try {
        return trainer.step(train_loader.next());
      } catch (st::comm_error const& e) {
        // A peer died or timed out: said with the time, for whoever measures the failover.
        std::fprintf(stderr,
                     "strata_train_gpt: rank %d left step %zu's collective at unix_ms %lld: "
                     "%s\n",
                     world.rank(), s, static_cast<long long>(unix_ms()), e.what());
        throw;
      }
    }();
#if STRATA_DEMO_PROFILE
    if (profiler)
      profiler->step(trainer);
#endif
    timers.add(trainer);
    if (auto block =
            timers.report(world, static_cast<std::int64_t>(s), static_cast<std::int64_t>(o.timers));
        block && lead)
      std::printf("%s", block->c_str());
    double peak = static_cast<double>(trainer.ledger().peak()); // the largest of any rank
    world.all_reduce(std::span<double>(&peak, 1), st::comm::reduce_op::max);
    double const compute = r.forward + r.backward + r.optimizer;
    progress.report(static_cast<std::int64_t>(s), compute);
    if (loss_log) {
      std::fprintf(loss_log, "step %zu loss %a world %d restart %d unix_ms %lld\n", s, r.loss,
                   world.size(), restart, static_cast<long long>(unix_ms()));
      std::fflush(loss_log);
    }
#if STRATA_DEMO_CHECKPOINT
    if (!o.checkpoint.empty() &&
        ((o.checkpoint_every != 0 && s % o.checkpoint_every == 0) || s == o.steps))
      st::io::save(trainer, mesh, o.checkpoint, {.loader = train_loader.state()});
#endif
    compute_s += compute;
    comm_s += r.communication;
    double const tokens = static_cast<double>(o.batch * o.seq);
    rows.push_back({s, r.loss, tokens / r.seconds, r.seconds * 1e3, compute * 1e3,
                    r.communication * 1e3, mib(static_cast<std::size_t>(peak))});
    if (lead)
      std::printf("step %4zu  loss %.4f  norm %.3f  lr %.2e  %8.0f tokens/s  %6.1f ms  peak "
                  "%.2f MiB/rank%s\n",
                  s, r.loss, r.grad_norm, r.lr, tokens / r.seconds, r.seconds * 1e3,
                  mib(static_cast<std::size_t>(peak)), r.skipped ? "  (skipped: overflow)" : "");
    if (o.eval_every && s % o.eval_every == 0 && s != o.steps) {
      double const v = validate();
      if (lead)
        std::printf("step %4zu  validation loss %.4f\n", s, v);
    }
  }
  double const final_loss = validate();
#if STRATA_DEMO_PROFILE
  if (profiler) {
    profiler->finish(); // a run shorter than the schedule: what it recorded
    world.barrier();    // every rank's file written
    if (lead) {
      std::vector<std::filesystem::path> files;
      for (int q = 0; q < world.size(); ++q)
        if (auto f = trace_dir / ("rank" + std::to_string(q) + ".json"); std::filesystem::exists(f))
          files.push_back(f);
      if (files.empty())
        std::printf("profile: no step was recorded (the profiler records steps 6 to 8; this "
                    "run had %zu)\n",
                    o.steps);
      else {
        st::profile::merge_chrome_traces(files, trace_dir / "trace.json");
        std::printf("profile: %s (%zu ranks, steps 6 to 8): open it in ui.perfetto.dev (Open "
                    "trace file) or chrome://tracing\n",
                    (trace_dir / "trace.json").string().c_str(), files.size());
      }
    }
  }
#endif
  if (o.generate) {
    token_text codec{}; // a text file's alphabet; a token file's ids as numbers
    if constexpr (requires { val_set.decode(0); })
      codec = {[&](char c) { return val_set.encode(c); },
               [&](std::int32_t id) { return val_set.decode(id); }};
    std::vector<std::int32_t> prompt = prompt_ids(o.prompt, codec);
    if (o.prompt.empty()) { // the first tokens of the validation data
      std::vector<std::int32_t> ids(o.seq), next(o.seq);
      val_set.read(0, ids, next);
      prompt.assign(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(
                                                   std::min<std::size_t>(32, ids.size())));
    }
    auto const tokens = generate(trainer, o, data.vocab, vocab, prompt);
    char how[64] = "greedy";
    if (o.temperature > 0)
      std::snprintf(how, sizeof how, "temperature %g", o.temperature);
    if (lead)
      std::printf("generated (%s, %zu tokens):\n%s%s\n", how, tokens.size(),
                  show(prompt, codec).c_str(), show(tokens, codec).c_str());
  }
  if (!lead)
    return 0;
  std::printf("final: validation loss %.4f nats, unigram entropy %.4f nats (%+.4f)\n", final_loss,
              entropy, final_loss - entropy);
  std::printf("time on rank 0: compute %.2f s, exposed communication %.2f s (%.1f%%; "
              "tensor-parallel collectives run inside the layers and count as compute)\n",
              compute_s, comm_s, 100 * comm_s / std::max(1e-12, compute_s + comm_s));
  if (!o.machine.empty() && !rows.empty()) {
    // The planner's time estimate beside the measured median step.
    std::vector<double> ms;
    for (auto const& r : rows)
      ms.push_back(r.step_ms);
    std::nth_element(ms.begin(), ms.begin() + static_cast<std::ptrdiff_t>(ms.size() / 2), ms.end());
    double const measured = ms[ms.size() / 2];
    auto const t =
        st::estimate_time(trainer.estimate(o.batch / static_cast<std::size_t>(o.dp), o.seq),
                          st::machine_profile::read(o.machine));
    std::printf("planner: %s; measured median step %.4g s (estimate error %+.0f%%)\n",
                t.text().c_str(), measured * 1e-3, 100 * (measured * 1e-3 / t.total - 1));
  }
  std::printf("%s", trainer.ledger().report().c_str());
  write_csv(o.csv, rows);
  write_svg(o.svg, rows, entropy,
            "strata_train_gpt: dp " + std::to_string(o.dp) + " x tp " + std::to_string(o.tp) +
                " x pp " + std::to_string(o.pp) + ", " + o.precision + ", training loss");
  std::printf("wrote %s and %s\n", o.csv.c_str(), o.svg.c_str());
  if (o.expect_margin >= 0 && !(final_loss < entropy - o.expect_margin)) {
    std::fprintf(stderr,
                 "strata_train_gpt: the validation loss %.4f is not below the unigram entropy "
                 "%.4f minus %.2f nats: the model learned no more than letter frequencies\n",
                 final_loss, entropy, o.expect_margin);
    return 1;
  }
  return 0;
}

template <class Precision, class C>
int train(C& world, options const& o) {
  if (token_file(o))
    return train_on<Precision>(world, o, token_data(o));
  if (o.vocab != 0)
    throw st::config_error("--vocab sets the vocabulary of a token file, and --data " + o.data +
                           " is read as text (character-level ids); give a token file, or "
                           "--data-dtype u16|u32 to read this one as ids");
  return train_on<Precision>(world, o, text_data(o));
}

template <class C>
int train_any(C& world, options const& o) {
  if (o.precision == "bf16")
    return train<st::precision::bf16>(world, o);
  if (o.precision == "fp16")
    return train<st::precision::fp16>(world, o);
  return train<st::precision::fp32>(world, o);
}

} // namespace

// --plan: the estimate of the flags' layout and the layouts suggested for its device count.
int print_plan(options const& o) {
  auto const model = model_of(o, o.vocab ? o.vocab : 256);
  st::plan_descriptor d;
  d.micro_batches = o.micro_batches;
  d.precision.kind = o.precision == "bf16" ? 1 : o.precision == "fp16" ? 2 : 0;
  for (auto const& x : layout_of(o).options) {
    if (auto const* p = std::any_cast<st::plan_descriptor::data_parallel_desc>(&x.options))
      d.data_parallel = *p, d.data_parallel.enabled = true;
    if (auto const* p = std::any_cast<st::plan_descriptor::sharded_desc>(&x.options))
      d.sharded = *p, d.sharded.enabled = true;
    if (auto const* p = std::any_cast<st::plan_descriptor::pipeline_desc>(&x.options))
      d.pipeline = *p;
    if (auto const* p = std::any_cast<st::recompute_options>(&x.options))
      d.recompute = {p->every, p->selective, p->offload};
  }
  d.tensor_parallel.enabled = true; // layout_of always names it
  std::size_t const per_rank = o.batch / static_cast<std::size_t>(o.dp);
  auto const e = st::estimate(model, d, {.dp = o.dp, .tp = o.tp, .pp = o.pp},
                              {.sequences = per_rank, .seq = o.seq});
  std::printf("the layout of the flags, per rank (AdamW, %zu sequences of %zu tokens per dp "
              "rank):\n%s",
              per_rank, o.seq, e.table().c_str());
  int const world = o.dp * o.tp * o.pp;
  auto const s = st::suggest_layouts(
      model, {.world = world,
              .devices_per_node = o.devices_per_node,
              .memory_per_device = static_cast<std::size_t>(o.memory_gib * 1073741824.0),
              .global_batch = o.batch,
              .seq = o.seq,
              .precision = d.precision.kind});
  std::printf("\nlayouts for %d devices of %.1f GiB (%d a node), fastest first by the planner's "
              "time model (100 TFLOP/s a device, 100 GB/s in a node, 10 GB/s across):\n%s",
              world, o.memory_gib, o.devices_per_node, st::describe(s, 5).c_str());
  return 0;
}

int main(int argc, char** argv) try {
  options const o = parse(argc, argv);
  if (o.plan)
    return print_plan(o);
  int const world = o.dp * o.tp * o.pp;
  std::atomic<int> rc{0};
  if (o.backend == "gloo") {
#if STRATA_DEMO_GLOO
    // One process a rank, from the launcher's environment; a failure goes to the error file
    // that strata_run quotes.
    return st::elastic::run_recorded([&] {
      auto w = st::comm::gloo::make_world();
      options g = o;
      int const tp_pp = o.tp * o.pp;
      if (!o.dp_given) {
        if (w.size() % tp_pp != 0)
          throw st::config_error("strata_train_gpt: WORLD_SIZE " + std::to_string(w.size()) +
                                 " does not divide by tp x pp = " + std::to_string(tp_pp) +
                                 ": start a multiple of it");
        g.dp = w.size() / tp_pp;
      } else if (w.size() != world) {
        throw st::config_error("strata_train_gpt: the launcher started " +
                               std::to_string(w.size()) +
                               " processes but dp x tp x pp = " + std::to_string(world) +
                               ": leave --dp out to take WORLD_SIZE / (tp x pp)");
      }
      if (g.batch % static_cast<std::size_t>(g.dp) != 0)
        throw st::config_error("strata_train_gpt: --batch " + std::to_string(g.batch) +
                               " does not split over dp " + std::to_string(g.dp) + " (WORLD_SIZE " +
                               std::to_string(w.size()) + "): give a multiple of every dp the " +
                               "job may run at (12 for 2, 3 and 4)");
      return train_any(w, g);
    });
#else
    std::fprintf(stderr, "strata_train_gpt: --backend gloo: this build has no Gloo (install "
                         "libgloo-dev and rebuild)\n");
    return 2;
#endif
  }
  if (o.backend == "mpi") {
#if STRATA_DEMO_MPI
    int const mrc = st::comm::mpi::run(argc, argv, [&](st::comm::mpi::communicator& w) {
      if (w.size() != world)
        throw st::config_error("strata_train_gpt: mpirun started " + std::to_string(w.size()) +
                               " processes but dp x tp x pp = " + std::to_string(world) +
                               ": run mpirun -np " + std::to_string(world));
      rc = std::max(rc.load(), train_any(w, o));
    });
    return mrc != 0 ? mrc : rc.load();
#else
    std::fprintf(stderr, "strata_train_gpt: --backend mpi: this build has no MPI (install "
                         "libopenmpi-dev and rebuild)\n");
    return 2;
#endif
  }
  st::comm::local::run(world, [&](st::comm::local::communicator& w) {
    int const r = train_any(w, o);
    if (r != 0)
      rc = r;
  });
  return rc.load();
} catch (std::exception const& e) {
  std::fprintf(stderr, "strata_train_gpt: %s\n", e.what());
  return 1;
}
