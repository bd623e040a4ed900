#include "vmm_ledger.h"

#include <cupti.h>  // with generated_cuda_meta.h: each driver call's parameter struct
#include <dlfcn.h>

#include <initializer_list>

#include "driver_entry.h"

namespace jaxgin {
namespace {

// The virtual-memory calls that create, map, reserve or release something.
constexpr CUpti_CallbackId kRecordedCalls[] = {
    CUPTI_DRIVER_TRACE_CBID_cuMemCreate,         CUPTI_DRIVER_TRACE_CBID_cuMemImportFromShareableHandle,
    CUPTI_DRIVER_TRACE_CBID_cuMemRetainAllocationHandle, CUPTI_DRIVER_TRACE_CBID_cuMemRelease,
    CUPTI_DRIVER_TRACE_CBID_cuMemMap,            CUPTI_DRIVER_TRACE_CBID_cuMemUnmap,
    CUPTI_DRIVER_TRACE_CBID_cuMemAddressReserve, CUPTI_DRIVER_TRACE_CBID_cuMemAddressFree,
};

struct Cupti {
  decltype(&cuptiSubscribe) subscribe = nullptr;
  decltype(&cuptiEnableCallback) enable_callback = nullptr;
  decltype(&cuptiUnsubscribe) unsubscribe = nullptr;
  decltype(&cuptiGetResultString) result_string = nullptr;
};

std::once_flag loaded;
Cupti cupti;
std::string load_failure;

void* open_cupti() {
  // Already in the process (JAX's profiler loads it) first, then the dynamic linker's search path.
  for (int flags : {RTLD_NOW | RTLD_NOLOAD, RTLD_NOW})
    for (const char* name : {"libcupti.so.13", "libcupti.so.12", "libcupti.so"})
      if (void* handle = dlopen(name, flags)) return handle;
  return nullptr;
}

void load() {
  std::call_once(loaded, [] {
    const VmmDriver& driver = vmm_driver();
    if (!driver.unmap || !driver.release || !driver.address_free) {
      load_failure = "the CUDA driver's virtual-memory calls could not be found";
      return;
    }
    void* handle = open_cupti();
    if (handle == nullptr) {
      load_failure = "CUPTI (libcupti.so.13) is neither loaded in this process nor on the library path "
                     "(pip install nvidia-cuda-cupti provides it)";
      return;
    }
    cupti.subscribe = reinterpret_cast<decltype(cupti.subscribe)>(dlsym(handle, "cuptiSubscribe"));
    cupti.enable_callback = reinterpret_cast<decltype(cupti.enable_callback)>(dlsym(handle, "cuptiEnableCallback"));
    cupti.unsubscribe = reinterpret_cast<decltype(cupti.unsubscribe)>(dlsym(handle, "cuptiUnsubscribe"));
    cupti.result_string = reinterpret_cast<decltype(cupti.result_string)>(dlsym(handle, "cuptiGetResultString"));
    if (!cupti.subscribe || !cupti.enable_callback || !cupti.unsubscribe)
      load_failure = "the loaded CUPTI library lacks its callback API";
  });
}

std::string cupti_error(const char* call, CUptiResult r) {
  const char* text = nullptr;
  if (cupti.result_string == nullptr || cupti.result_string(r, &text) != CUPTI_SUCCESS || text == nullptr) text = "?";
  return std::string(call) + " failed (" + text + ")";
}

void CUPTIAPI record_call(void* ledger, CUpti_CallbackDomain domain, CUpti_CallbackId id, const void* data) {
  const auto* call = static_cast<const CUpti_CallbackData*>(data);
  if (domain != CUPTI_CB_DOMAIN_DRIVER_API || call->callbackSite != CUPTI_API_EXIT) return;
  const auto* result = static_cast<const CUresult*>(call->functionReturnValue);
  if (result == nullptr || *result != CUDA_SUCCESS) return;
  static_cast<VmmLedger*>(ledger)->on_call(call->context, id, call->functionParams);
}

// A release, unmap or free names its object, not the context that made it: NCCL's threads may
// differ from the one that allocated. The calling context's books first, then any that hold it.
template <class Map, class Key>
Map* holder(std::map<CUcontext, VmmLedger::Books>& books, CUcontext context, Map VmmLedger::Books::*which,
            const Key& key) {
  auto own = books.find(context);
  if (own != books.end() && (own->second.*which).count(key)) return &(own->second.*which);
  for (auto& [_, b] : books)
    if ((b.*which).count(key)) return &(b.*which);
  return nullptr;
}

}  // namespace

CUcontext current_context() {
  const VmmDriver& driver = vmm_driver();
  CUcontext context = nullptr;
  if (driver.current_context == nullptr || driver.current_context(&context) != CUDA_SUCCESS) return nullptr;
  return context;
}

std::string VmmLedger::start() {
  load();
  if (!load_failure.empty()) return load_failure;
  std::lock_guard<std::mutex> lock(subscription_mutex_);
  if (recorders_ > 0) {
    recorders_++;
    return "";
  }
  CUpti_SubscriberHandle subscriber = nullptr;
  CUptiResult r = cupti.subscribe(&subscriber, record_call, this);
  if (r != CUPTI_SUCCESS)
    return cupti_error("cuptiSubscribe", r) + "; is a profiler running? Only one CUPTI client can subscribe";
  for (CUpti_CallbackId id : kRecordedCalls) {
    r = cupti.enable_callback(1, subscriber, CUPTI_CB_DOMAIN_DRIVER_API, id);
    if (r != CUPTI_SUCCESS) {
      cupti.unsubscribe(subscriber);
      return cupti_error("cuptiEnableCallback", r);
    }
  }
  subscriber_ = subscriber;
  recorders_ = 1;
  return "";
}

void VmmLedger::stop() {
  std::lock_guard<std::mutex> lock(subscription_mutex_);
  if (recorders_ == 0 || --recorders_ > 0) return;
  auto subscriber = static_cast<CUpti_SubscriberHandle>(subscriber_);
  subscriber_ = nullptr;
  // Unsubscribe only, never cuptiFinalize: finalizing detaches CUPTI from every thread at once,
  // while NCCL's proxy threads and the host transport's threads are inside driver calls (and
  // CUPTI's hooks) all the time, and CUPTI documents no safe way to do that with other threads
  // running. What stays is CUPTI's per-call hook with no callback enabled: a few nanoseconds on
  // driver calls, nothing on kernels.
  cupti.unsubscribe(subscriber);
}

VmmLedger::~VmmLedger() {
  {
    std::lock_guard<std::mutex> lock(subscription_mutex_);
    recorders_ = recorders_ > 0 ? 1 : 0;
  }
  stop();
}

void VmmLedger::on_call(CUcontext context, uint32_t callback_id, const void* params) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto take = [&](CUmemGenericAllocationHandle handle) { books_[context].references[handle]++; };
  switch (callback_id) {
    case CUPTI_DRIVER_TRACE_CBID_cuMemCreate: {
      const auto* p = static_cast<const cuMemCreate_params*>(params);
      take(*p->handle);
      const CUmemLocationType where = p->prop != nullptr ? p->prop->location.type : CU_MEM_LOCATION_TYPE_DEVICE;
      if (where != CU_MEM_LOCATION_TYPE_DEVICE && where != CU_MEM_LOCATION_TYPE_INVALID)
        host_located_.insert(*p->handle);
      break;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuMemImportFromShareableHandle:
      take(*static_cast<const cuMemImportFromShareableHandle_params*>(params)->handle);
      break;
    case CUPTI_DRIVER_TRACE_CBID_cuMemRetainAllocationHandle:
      take(*static_cast<const cuMemRetainAllocationHandle_params*>(params)->handle);
      break;
    case CUPTI_DRIVER_TRACE_CBID_cuMemRelease: {
      const CUmemGenericAllocationHandle handle = static_cast<const cuMemRelease_params*>(params)->handle;
      if (auto* refs = holder(books_, context, &Books::references, handle)) {
        auto it = refs->find(handle);
        if (--it->second == 0) {
          refs->erase(it);
          host_located_.erase(handle);
        }
      }
      break;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuMemMap: {
      const auto* p = static_cast<const cuMemMap_params*>(params);
      books_[context].mappings[p->ptr] = p->size;
      if (host_located_.count(p->handle)) books_[context].host_mappings.insert(p->ptr);
      break;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuMemUnmap: {
      const CUdeviceptr ptr = static_cast<const cuMemUnmap_params*>(params)->ptr;
      if (auto* maps = holder(books_, context, &Books::mappings, ptr)) maps->erase(ptr);
      for (auto& [_, b] : books_) b.host_mappings.erase(ptr);
      break;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuMemAddressReserve: {
      const auto* p = static_cast<const cuMemAddressReserve_params*>(params);
      books_[context].reservations[*p->ptr] = p->size;
      break;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuMemAddressFree: {
      const CUdeviceptr ptr = static_cast<const cuMemAddressFree_params*>(params)->ptr;
      if (auto* ranges = holder(books_, context, &Books::reservations, ptr)) ranges->erase(ptr);
      break;
    }
    default:
      break;
  }
}

std::string VmmLedger::undo(CUcontext context, bool keep_host_memory) {
  Books b;
  std::set<CUmemGenericAllocationHandle> host_handles;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = books_.find(context);
    if (it == books_.end()) return "";
    b = std::move(it->second);
    books_.erase(it);
    host_handles = host_located_;
  }
  if (keep_host_memory) {
    // What stays must stay whole: the mapping, the references that keep its memory, and the
    // reserved range around it.
    for (CUdeviceptr kept : b.host_mappings) b.mappings.erase(kept);
    for (auto it = b.references.begin(); it != b.references.end();)
      it = host_handles.count(it->first) ? b.references.erase(it) : std::next(it);
    for (auto it = b.reservations.begin(); it != b.reservations.end();) {
      bool holds_kept = false;
      for (CUdeviceptr kept : b.host_mappings) holds_kept |= kept >= it->first && kept < it->first + it->second;
      it = holds_kept ? b.reservations.erase(it) : std::next(it);
    }
  }
  const VmmDriver& driver = vmm_driver();
  std::string first;
  auto check = [&](const char* call, CUresult r) {
    if (r != CUDA_SUCCESS && first.empty()) first = driver_failure(call, r);
  };
  // Mappings hold their allocations; an allocation is returned once it is unmapped everywhere and
  // its last handle reference is dropped. Reserved ranges can be freed only once nothing maps them.
  for (const auto& [ptr, bytes] : b.mappings) check("cuMemUnmap", driver.unmap(ptr, bytes));
  for (const auto& [handle, count] : b.references)
    for (int i = 0; i < count; i++) check("cuMemRelease", driver.release(handle));
  for (const auto& [ptr, bytes] : b.reservations) check("cuMemAddressFree", driver.address_free(ptr, bytes));
  return first;
}

}  // namespace jaxgin
