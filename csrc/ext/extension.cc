// jaxgin's Python extension. Built at install time with a plain C++ compiler: it needs neither CUDA
// nor NCCL headers. It loads the CUDA backend library (built on first use against the NCCL that is
// loaded in the process, see jaxgin/build.py) and exposes its C ABI (csrc/runtime/backend_api.h)
// to Python, releasing the GIL around calls that block on other ranks.
#include <dlfcn.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "../runtime/backend_api.h"

namespace nb = nanobind;

namespace {

// Raised as jaxgin._jaxgin_ext.DeviceFaultError: a kernel failed on the device.
struct DeviceFault : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The backend's entry points, resolved once per library.
struct BackendApi {
  decltype(&jaxgin_backend_abi) backend_abi;
  decltype(&jaxgin_nccl_versions) nccl_versions;
  decltype(&jaxgin_last_error) last_error;
  decltype(&jaxgin_unique_id) unique_id;
  decltype(&jaxgin_device_memory) device_memory;
  decltype(&jaxgin_runtime_create) runtime_create;
  decltype(&jaxgin_runtime_device_info) runtime_device_info;
  decltype(&jaxgin_runtime_destroy) runtime_destroy;
  decltype(&jaxgin_selftest_exchange) selftest_exchange;
  decltype(&jaxgin_wait_signal_on_device) wait_signal_on_device;
  decltype(&jaxgin_ffi_calls) ffi_calls;
  decltype(&jaxgin_device_faults) device_faults;
  decltype(&jaxgin_communicator_errors) communicator_errors;
  decltype(&jaxgin_heap_clear) heap_clear;
  decltype(&jaxgin_runtime_settle) runtime_settle;
  decltype(&jaxgin_exchange_latency) exchange_latency;
};

template <typename F>
void resolve(void* handle, const char* name, F& out, const std::string& path) {
  out = reinterpret_cast<F>(dlsym(handle, name));
  if (out == nullptr)
    throw std::runtime_error("jaxgin backend " + path + " does not export " + name +
                             "; it is stale or not a jaxgin backend (delete it to rebuild)");
}

class Runtime;

class Backend {
 public:
  explicit Backend(const std::string& path) : path_(path) {
    // Never unloaded: the library registers CUDA kernels and holds NCCL state for the process.
    handle_ = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle_ == nullptr) throw std::runtime_error("cannot load jaxgin backend " + path + ": " + dlerror());
    resolve(handle_, "jaxgin_backend_abi", api_.backend_abi, path);
    resolve(handle_, "jaxgin_nccl_versions", api_.nccl_versions, path);
    resolve(handle_, "jaxgin_last_error", api_.last_error, path);
    resolve(handle_, "jaxgin_unique_id", api_.unique_id, path);
    resolve(handle_, "jaxgin_device_memory", api_.device_memory, path);
    resolve(handle_, "jaxgin_runtime_create", api_.runtime_create, path);
    resolve(handle_, "jaxgin_runtime_device_info", api_.runtime_device_info, path);
    resolve(handle_, "jaxgin_runtime_destroy", api_.runtime_destroy, path);
    resolve(handle_, "jaxgin_selftest_exchange", api_.selftest_exchange, path);
    resolve(handle_, "jaxgin_wait_signal_on_device", api_.wait_signal_on_device, path);
    resolve(handle_, "jaxgin_ffi_calls", api_.ffi_calls, path);
    resolve(handle_, "jaxgin_device_faults", api_.device_faults, path);
    resolve(handle_, "jaxgin_communicator_errors", api_.communicator_errors, path);
    resolve(handle_, "jaxgin_heap_clear", api_.heap_clear, path);
    resolve(handle_, "jaxgin_runtime_settle", api_.runtime_settle, path);
    resolve(handle_, "jaxgin_exchange_latency", api_.exchange_latency, path);
    if (api_.backend_abi() != JAXGIN_BACKEND_ABI)
      throw std::runtime_error("jaxgin backend " + path + " has ABI " + std::to_string(api_.backend_abi()) +
                               ", this extension expects " + std::to_string(JAXGIN_BACKEND_ABI) +
                               " (delete the stale cache entry to rebuild)");
  }

  const BackendApi& api() const { return api_; }
  const std::string& path() const { return path_; }

  void check(int status) const {
    if (status == JAXGIN_STATUS_DEVICE_FAULT) throw DeviceFault(api_.last_error());
    if (status != 0) throw std::runtime_error(api_.last_error());
  }

  std::pair<int, int> nccl_versions() const {
    int32_t loaded = 0, compiled = 0;
    check(api_.nccl_versions(&loaded, &compiled));
    return {loaded, compiled};
  }

  nb::bytes unique_id() const {
    char id[JAXGIN_UNIQUE_ID_BYTES];
    check(api_.unique_id(id));
    return nb::bytes(id, sizeof(id));
  }

  // Address of an exported XLA FFI handler (jaxgin_ffi_*), for registration with XLA.
  uint64_t ffi_handler(const std::string& name) const {
    if (name.rfind("jaxgin_ffi_", 0) != 0) throw std::invalid_argument("not a jaxgin FFI handler: " + name);
    void* symbol = dlsym(handle_, name.c_str());
    if (symbol == nullptr) throw std::runtime_error("jaxgin backend " + path_ + " does not export " + name);
    return reinterpret_cast<uint64_t>(symbol);
  }

  // Value returned by an exported `void* jaxgin_ffi_*(void)` getter: the address of an FFI type id
  // or type info, for registration with XLA.
  uint64_t ffi_address(const std::string& name) const {
    using Getter = void* (*)();
    return reinterpret_cast<uint64_t>(reinterpret_cast<Getter>(ffi_handler(name))());
  }

  nb::dict ffi_calls() const {
    uint64_t exchange = 0, put = 0, wait = 0;
    check(api_.ffi_calls(&exchange, &put, &wait));
    nb::dict d;
    d["exchange"] = exchange;
    d["put"] = put;
    d["wait"] = wait;
    return d;
  }

  std::pair<uint64_t, uint64_t> device_memory(int device) const {
    uint64_t free_bytes = 0, total_bytes = 0;
    check(api_.device_memory(device, &free_bytes, &total_bytes));
    return {free_bytes, total_bytes};
  }

 private:
  std::string path_;
  void* handle_ = nullptr;
  BackendApi api_{};
};

// jaxgin's state on this process's GPUs; destroy() must be called explicitly (teardown is
// collective across ranks, so it must not happen at an arbitrary garbage-collection point).
class Runtime {
 public:
  Runtime(const Backend& backend, int world_size, const std::vector<int32_t>& devices,
          const std::vector<int32_t>& ranks, const nb::bytes& unique_id, uint64_t heap_bytes,
          uint32_t signal_count, uint32_t barrier_slots, bool force_gin, uint64_t timeout_ns,
          uint32_t channel_lanes, uint32_t channel_slots, uint64_t channel_slot_bytes, int64_t generation,
          bool record_vmm_calls)
      : backend_(backend), local_count_((int)devices.size()), world_size_(world_size) {
    if (devices.size() != ranks.size() || devices.empty())
      throw std::invalid_argument("devices and ranks must be non-empty lists of equal length");
    if (unique_id.size() != JAXGIN_UNIQUE_ID_BYTES)
      throw std::invalid_argument("unique_id must be " + std::to_string(JAXGIN_UNIQUE_ID_BYTES) + " bytes");
    std::string id(static_cast<const char*>(unique_id.data()), unique_id.size());
    jaxgin_runtime_config config{};
    config.world_size = world_size;
    config.local_count = local_count_;
    config.devices = devices.data();
    config.ranks = ranks.data();
    config.unique_id = id.data();
    config.heap_bytes = heap_bytes;
    config.signal_count = signal_count;
    config.barrier_slots = barrier_slots;
    config.force_gin = force_gin ? 1 : 0;
    config.timeout_ns = timeout_ns;
    config.channel_lanes = channel_lanes;
    config.channel_slots = channel_slots;
    config.channel_slot_bytes = channel_slot_bytes;
    config.generation = generation;
    config.record_vmm_calls = record_vmm_calls ? 1 : 0;
    int status;
    {
      nb::gil_scoped_release release;  // blocks until every rank joined
      status = backend_.api().runtime_create(&config, &rt_);
    }
    backend_.check(status);
  }

  void destroy() {
    if (rt_ == nullptr) return;
    jaxgin_runtime* rt = rt_;
    rt_ = nullptr;
    int status;
    {
      nb::gil_scoped_release release;
      status = backend_.api().runtime_destroy(rt);
    }
    backend_.check(status);
  }

  bool alive() const { return rt_ != nullptr; }

  nb::dict device_info(int local_index) const {
    jaxgin_device_info info{};
    backend_.check(backend_.api().runtime_device_info(live(), local_index, &info));
    nb::dict d;
    d["device"] = info.device;
    d["rank"] = info.rank;
    d["world_size"] = info.world_size;
    d["lsa_rank"] = info.lsa_rank;
    d["lsa_size"] = info.lsa_size;
    d["gin_type"] = info.gin_type;
    d["gin_contexts"] = info.gin_contexts;
    d["force_gin"] = info.force_gin != 0;
    d["heap_bytes"] = info.heap_bytes;
    d["user_offset"] = info.user_offset;
    d["heap_base"] = info.heap_base;
    d["context"] = info.context;
    d["timeout_ns"] = info.timeout_ns;
    d["signal_count"] = info.signal_count;
    d["barrier_slots"] = info.barrier_slots;
    d["channel_lanes"] = info.channel_lanes;
    d["channel_slots"] = info.channel_slots;
    d["channel_slot_bytes"] = info.channel_slot_bytes;
    d["vmm_ledger_unavailable"] = std::string(info.vmm_ledger_unavailable);
    return d;
  }

  std::vector<uint64_t> selftest_exchange(int rounds, uint64_t block_bytes, uint32_t seed, uint64_t heap_offset,
                                         uint32_t signal_base) {
    std::vector<uint64_t> mismatches((size_t)local_count_ * world_size_, 0);
    int status;
    {
      nb::gil_scoped_release release;
      status = backend_.api().selftest_exchange(live(), rounds, block_bytes, seed, heap_offset, signal_base,
                                                mismatches.data());
    }
    backend_.check(status);
    return mismatches;
  }

  std::string device_faults() const { return text_from(backend_.api().device_faults); }

  std::string communicator_errors() const { return text_from(backend_.api().communicator_errors); }

  void heap_clear(uint64_t offset, uint64_t bytes) {
    int status;
    {
      nb::gil_scoped_release release;
      status = backend_.api().heap_clear(live(), offset, bytes);
    }
    backend_.check(status);
  }

  void settle() {
    int status;
    {
      nb::gil_scoped_release release;
      status = backend_.api().runtime_settle(live());
    }
    backend_.check(status);
  }

  std::vector<double> exchange_latency(uint64_t bytes, int iterations, bool use_graph, bool generic_kernel) {
    std::vector<double> us((size_t)local_count_, 0.0);
    int status;
    {
      nb::gil_scoped_release release;
      status = backend_.api().exchange_latency(live(), bytes, iterations, use_graph ? 1 : 0,
                                                generic_kernel ? 1 : 0, us.data());
    }
    backend_.check(status);
    return us;
  }

  void wait_signal(int local_index, uint32_t signal, uint64_t value) {
    int status;
    {
      nb::gil_scoped_release release;
      status = backend_.api().wait_signal_on_device(live(), local_index, signal, value);
    }
    backend_.check(status);
  }

 private:
  jaxgin_runtime* live() const {
    if (rt_ == nullptr) throw std::runtime_error("this jaxgin runtime was destroyed (finalize() ran)");
    return rt_;
  }

  // What one of the backend's text reports (device_faults, communicator_errors) says, '' when nothing.
  std::string text_from(int (*report)(const jaxgin_runtime*, char*, uint64_t)) const {
    std::vector<char> text(1 << 16, 0);
    backend_.check(report(live(), text.data(), text.size()));
    return std::string(text.data());
  }

  const Backend& backend_;
  int local_count_;
  int world_size_;
  jaxgin_runtime* rt_ = nullptr;
};

}  // namespace

// A DLPack-exportable view of device memory jaxgin owns (symmetric-heap buffers), so CuPy,
// PyTorch or JAX can use it without a copy. `owner` is kept alive as long as the view.
nb::ndarray<nb::array_api> device_array(uint64_t address, const std::vector<size_t>& shape, uint8_t dtype_code,
                           uint8_t dtype_bits, int32_t device_id, nb::handle owner) {
  return nb::ndarray<nb::array_api>(reinterpret_cast<void*>(address), shape.size(), shape.data(), owner, nullptr,
                       nb::dlpack::dtype{dtype_code, dtype_bits, 1}, nb::device::cuda::value, device_id);
}

NB_MODULE(_jaxgin_ext, m) {
  m.doc() = "Loader and bindings for jaxgin's CUDA backend library (C ABI in csrc/runtime/backend_api.h).";
  m.attr("BACKEND_ABI") = JAXGIN_BACKEND_ABI;
  nb::exception<DeviceFault>(m, "DeviceFaultError", PyExc_RuntimeError);
  m.def("device_array", &device_array, nb::arg("address"), nb::arg("shape"), nb::arg("dtype_code"),
        nb::arg("dtype_bits"), nb::arg("device_id"), nb::arg("owner"),
        "DLPack-exportable view of CUDA memory at `address` (DLPack dtype code and bits), kept alive by `owner`");
  nb::class_<Backend>(m, "Backend")
      .def(nb::init<const std::string&>(), nb::arg("path"))
      .def_prop_ro("path", &Backend::path)
      .def("nccl_versions", &Backend::nccl_versions,
           "(NCCL version loaded in the process, NCCL version the backend was compiled against)")
      .def("unique_id", &Backend::unique_id)
      .def("device_memory", &Backend::device_memory, nb::arg("device"), "(free, total) bytes of a CUDA device")
      .def("ffi_handler", &Backend::ffi_handler, nb::arg("name"), "address of an exported XLA FFI handler")
      .def("ffi_address", &Backend::ffi_address, nb::arg("name"),
           "value of an exported jaxgin_ffi_* address getter (FFI type ids)")
      .def("ffi_calls", &Backend::ffi_calls, "host-side calls of each FFI handler family so far");
  nb::class_<Runtime>(m, "Runtime")
      .def(nb::init<const Backend&, int, const std::vector<int32_t>&, const std::vector<int32_t>&,
                    const nb::bytes&, uint64_t, uint32_t, uint32_t, bool, uint64_t, uint32_t, uint32_t, uint64_t,
                    int64_t, bool>(),
           nb::arg("backend"), nb::arg("world_size"), nb::arg("devices"), nb::arg("ranks"), nb::arg("unique_id"),
           nb::arg("heap_bytes"), nb::arg("signal_count"), nb::arg("barrier_slots"), nb::arg("force_gin"),
           nb::arg("timeout_ns"), nb::arg("channel_lanes"), nb::arg("channel_slots"), nb::arg("channel_slot_bytes"),
           nb::arg("generation"), nb::arg("record_vmm_calls"), nb::keep_alive<1, 2>())
      .def("destroy", &Runtime::destroy)
      .def_prop_ro("alive", &Runtime::alive)
      .def("device_info", &Runtime::device_info, nb::arg("local_index"))
      .def("selftest_exchange", &Runtime::selftest_exchange, nb::arg("rounds"), nb::arg("block_bytes"),
           nb::arg("seed"), nb::arg("heap_offset"), nb::arg("signal_base"))
      .def("exchange_latency", &Runtime::exchange_latency, nb::arg("bytes"), nb::arg("iterations"),
           nb::arg("use_graph"), nb::arg("generic_kernel") = false,
           "us per ring exchange of a chain, per local GPU (diagnostic, no XLA)")
      .def("device_faults", &Runtime::device_faults, "descriptions of recorded device faults, '' when none")
      .def("communicator_errors", &Runtime::communicator_errors,
           "one line per local GPU whose NCCL communicator reports an asynchronous error, '' when none")
      .def("heap_clear", &Runtime::heap_clear, nb::arg("offset"), nb::arg("bytes"),
           "free a heap range: zero it on every local GPU once every rank's puts to it landed (a collective)")
      .def("settle", &Runtime::settle,
           "meet every rank once this process's GPU work is done; nothing sent earlier is still in flight (a collective)")
      .def("wait_signal", &Runtime::wait_signal, nb::arg("local_index"), nb::arg("signal"), nb::arg("value"));
}
