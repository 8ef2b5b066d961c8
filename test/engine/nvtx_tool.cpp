// A stand-in NVTX tool for engine.nvtx: a shared library that nvtx3 loads from
// NVTX_INJECTION64_PATH (as it loads Nsight Systems' own) and that records the ranges pushed
// and popped on each thread, without allocating (fixed arrays), for the test to read back
// through the strata_nvtx_tool_* functions.
#define NVTX_NO_IMPL // a tool: the types and callback ids, not the API's implementation
#include <nvtx3/nvToolsExt.h>

#include <atomic>
#include <cstddef>
#include <cstring>
#include <mutex>

namespace {

constexpr std::size_t capacity = 1 << 16;
constexpr std::size_t name_length = 64;
constexpr int max_depth = 32;

// A range that ended: its thread (numbered from 0 in order of first use), its depth (0: a
// range opened with none open on its thread) and its name.
struct range {
  int thread = 0;
  int depth = 0;
  char name[name_length] = {};
};

range ranges[capacity];
std::size_t count = 0;
std::mutex mu;
std::atomic<int> threads{0};
std::atomic<long> open_ranges{0};
std::atomic<std::size_t> unbalanced{0}, foreign{0}, overflow{0}, domains_made{0};
std::atomic<bool> initialized{false};
char domain_name[name_length] = {};
char const domain_tag = 0; // the one domain's handle: this object's address

thread_local int thread_id = -1;
thread_local int depth = 0;
thread_local char stack[max_depth][name_length];

int this_thread() noexcept {
  if (thread_id < 0)
    thread_id = threads.fetch_add(1);
  return thread_id;
}

void copy(char* to, char const* from) noexcept {
  std::strncpy(to, from ? from : "", name_length - 1);
  to[name_length - 1] = '\0';
}

int push(char const* name) noexcept {
  this_thread();
  if (depth < max_depth)
    copy(stack[depth], name);
  open_ranges.fetch_add(1);
  return depth++;
}

int pop() noexcept {
  if (depth == 0) {
    unbalanced.fetch_add(1);
    return -1;
  }
  --depth;
  open_ranges.fetch_sub(1);
  std::lock_guard lock(mu);
  if (count == capacity) {
    overflow.fetch_add(1);
    return depth;
  }
  range& r = ranges[count++];
  r.thread = this_thread();
  r.depth = depth;
  copy(r.name, depth < max_depth ? stack[depth] : "(too deep)");
  return depth;
}

nvtxDomainHandle_t NVTX_API domain_create(char const* name) {
  domains_made.fetch_add(1);
  copy(domain_name, name);
  return reinterpret_cast<nvtxDomainHandle_t>(const_cast<char*>(&domain_tag));
}

bool ours(nvtxDomainHandle_t d) noexcept {
  return d == reinterpret_cast<nvtxDomainHandle_t>(const_cast<char*>(&domain_tag));
}

int NVTX_API domain_push(nvtxDomainHandle_t d, nvtxEventAttributes_t const* a) {
  if (!ours(d) || !a || a->messageType != NVTX_MESSAGE_TYPE_ASCII) {
    foreign.fetch_add(1);
    return push("(foreign)");
  }
  return push(a->message.ascii);
}

int NVTX_API domain_pop(nvtxDomainHandle_t d) {
  if (!ours(d))
    foreign.fetch_add(1);
  return pop();
}

// Ranges of the default domain: strata pushes none.
int NVTX_API plain_push(char const* name) {
  foreign.fetch_add(1);
  return push(name);
}
int NVTX_API plain_pop() {
  return pop();
}

bool set(NvtxExportTableCallbacks const* cb, NvtxCallbackModule module, unsigned id,
         NvtxFunctionPointer f) {
  NvtxFunctionTable table = nullptr;
  unsigned size = 0;
  if (!cb->GetModuleFunctionTable(module, &table, &size) || !table || id >= size || !table[id])
    return false;
  *table[id] = f;
  return true;
}

template <class F>
NvtxFunctionPointer fp(F f) noexcept {
  return reinterpret_cast<NvtxFunctionPointer>(f);
}

} // namespace

extern "C" {

// nvtx3 calls this once, at the process's first NVTX call: take over the calls strata makes.
__attribute__((visibility("default"))) int InitializeInjectionNvtx2(NvtxGetExportTableFunc_t get) {
  auto const* cb = static_cast<NvtxExportTableCallbacks const*>(get(NVTX_ETID_CALLBACKS));
  if (!cb || cb->struct_size < sizeof(NvtxExportTableCallbacks))
    return 0;
  bool ok = set(cb, NVTX_CB_MODULE_CORE2, NVTX_CBID_CORE2_DomainCreateA, fp(&domain_create)) &&
            set(cb, NVTX_CB_MODULE_CORE2, NVTX_CBID_CORE2_DomainRangePushEx, fp(&domain_push)) &&
            set(cb, NVTX_CB_MODULE_CORE2, NVTX_CBID_CORE2_DomainRangePop, fp(&domain_pop)) &&
            set(cb, NVTX_CB_MODULE_CORE, NVTX_CBID_CORE_RangePushA, fp(&plain_push)) &&
            set(cb, NVTX_CB_MODULE_CORE, NVTX_CBID_CORE_RangePop, fp(&plain_pop));
  initialized.store(ok);
  return ok ? 1 : 0;
}

// What the test reads.
__attribute__((visibility("default"))) int strata_nvtx_tool_initialized() {
  return initialized.load() ? 1 : 0;
}
__attribute__((visibility("default"))) char const* strata_nvtx_tool_domain() {
  return domain_name;
}
__attribute__((visibility("default"))) int strata_nvtx_tool_thread() {
  return this_thread();
}
__attribute__((visibility("default"))) std::size_t strata_nvtx_tool_count() {
  std::lock_guard lock(mu);
  return count;
}
// The i-th range that ended (in the order they ended): its thread, depth and name.
__attribute__((visibility("default"))) char const* strata_nvtx_tool_range(std::size_t i,
                                                                          int* thread, int* d) {
  std::lock_guard lock(mu);
  if (i >= count)
    return nullptr;
  *thread = ranges[i].thread;
  *d = ranges[i].depth;
  return ranges[i].name;
}
// Ranges still open on any thread, pops with none open, calls outside strata's domain,
// ranges past the capacity.
__attribute__((visibility("default"))) long strata_nvtx_tool_open() {
  return open_ranges.load();
}
__attribute__((visibility("default"))) std::size_t strata_nvtx_tool_unbalanced() {
  return unbalanced.load();
}
__attribute__((visibility("default"))) std::size_t strata_nvtx_tool_foreign() {
  return foreign.load();
}
__attribute__((visibility("default"))) std::size_t strata_nvtx_tool_overflow() {
  return overflow.load();
}
}
