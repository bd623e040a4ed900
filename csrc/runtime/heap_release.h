// Unmapping the symmetric heaps of a GPU whose CUDA context broke (a kernel trapped), when the
// record of NCCL's virtual-memory calls (vmm_ledger.h, which undoes all of them) is unavailable.
//
// The heap is a CUDA virtual-memory allocation: ncclMemAlloc maps it at the heap's address, and
// NCCL's window maps it once more, next to every LSA peer's heap (imported), in NCCL's flat
// address range. Such mappings belong to the process, not to the context: a device reset leaves
// them, and NCCL cannot undo them in a context in error. An import keeps its peer's memory alive,
// so a survivor of a dead peer would hold that peer's whole heap on the dead peer's GPU until it
// exits. After the reset the driver's virtual-memory calls still work (measured on H200), so the
// runtime unmaps every mapping itself, which returns the peers' heaps.
//
// This GPU's own heap is also held by allocation-handle references that NCCL keeps and would have
// dropped in ncclMemFree and ncclCommWindowDeregister (neither can run in a broken context). The
// physical memory comes back only once those are released too, so the runtime releases them.
#pragma once
#include <stddef.h>
#include <stdint.h>
#include <string>
#include <vector>

namespace jaxgin {

struct heap_mapping {
  uintptr_t base = 0;
  size_t bytes = 0;  // 0: not a virtual-memory mapping (cudaMalloc'd, which the reset returns)
};

// The mappings of heap memory in this process, read at setup while the context is healthy
// (unmapping needs each mapping's exact extent): the heap's own, and NCCL's mapping of each LSA
// rank's heap (`lsa_heaps`, nullptr entries skipped).
struct heap_mappings {
  heap_mapping own;
  std::vector<heap_mapping> window;
  int own_handle_references = 0;  // held by NCCL on the heap's allocation, besides its mappings
};
// `own_handle_references`: how many handle references NCCL holds on the heap's allocation (see
// NCCL_HEAP_HANDLE_REFERENCES in runtime.cu).
heap_mappings mappings_of_heap(void* heap, const std::vector<char*>& lsa_heaps, int own_handle_references);

// After cudaDeviceReset: unmaps every mapping in `m`, releases NCCL's handle references on the
// heap's allocation, then frees the heap's address range. Returns "" or what failed.
std::string unmap_heaps_after_reset(const heap_mappings& m);

}  // namespace jaxgin
