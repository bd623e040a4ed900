// The slice of NCCL's RMA plugin interface (version 14, loaded by NCCL 2.30 - 2.32 through
// NCCL_RMA_PLUGIN) that jaxgin's host transport implements. Written from NCCL's public plugin
// documentation; the layouts must match NCCL's exactly, so every field is spelled out.
#pragma once

#include <cstddef>
#include <cstdint>

extern "C" {

typedef enum {
  rmaSuccess = 0,
  rmaUnhandledCudaError = 1,
  rmaSystemError = 2,
  rmaInternalError = 3,
  rmaInvalidArgument = 4,
  rmaInvalidUsage = 5,
  rmaRemoteError = 6,
} rmaResult_t;  // values of ncclResult_t

typedef enum { RMA_LOG_NONE = 0, RMA_LOG_VERSION = 1, RMA_LOG_WARN = 2, RMA_LOG_INFO = 3, RMA_LOG_ABORT = 4,
               RMA_LOG_TRACE = 5 } rmaLogLevel_t;
constexpr unsigned long RMA_LOG_SUBSYS_NET = 16;  // NCCL_NET: shows with NCCL_DEBUG_SUBSYS=NET
typedef void (*rmaLogger_t)(rmaLogLevel_t level, unsigned long flags, const char* file, int line, const char* fmt,
                            ...);

constexpr int RMA_PTR_HOST = 0x1;
constexpr int RMA_PTR_CUDA = 0x2;
constexpr int RMA_HANDLE_MAXSIZE = 128;      // NCCL_NET_HANDLE_MAXSIZE
constexpr int RMA_MAX_REQUESTS = 32;         // NCCL_NET_MAX_REQUESTS: NCCL sizes its queues by it
constexpr uint32_t RMA_SIGNAL_OP_INC = 0x1;  // add 1
constexpr uint32_t RMA_SIGNAL_OP_ADD = 0x2;  // add the given value
constexpr int RMA_DEVICE_GIN_PROXY = 2;      // NCCL_NET_DEVICE_GIN_PROXY: a CPU proxy thread posts for the GPU

typedef struct {
  int ndevs;
  int devs[8];
} rmaVirtualDeviceProps_t;  // ncclNetVDeviceProps_v12_t

typedef struct {
  char* name;
  char* pciPath;
  uint64_t guid;
  int ptrSupport;
  int regIsGlobal;
  int forceFlush;
  int speed;  // Mbps
  int port;
  float latency;
  int maxComms;
  int maxRecvs;
  int netDeviceType;
  int netDeviceVersion;
  rmaVirtualDeviceProps_t vProps;
  size_t maxP2pBytes;
  size_t maxCollBytes;
  int maxMultiRequestSize;
  int16_t railId;
  int16_t planeId;
} rmaProperties_t;  // ncclNetProperties_v12_t

typedef struct {
  int nContexts;
  int trafficClass;
  int rankStride;
} rmaConfig_t;  // ncclRmaConfig_v14_t

typedef struct {
  const char* name;
  rmaResult_t (*init)(void** ctx, uint64_t commId, rmaLogger_t logFunction);
  rmaResult_t (*devices)(int* ndev);
  rmaResult_t (*getProperties)(int dev, rmaProperties_t* props);
  rmaResult_t (*listen)(void* ctx, int dev, void* handle, void** listenComm);
  rmaResult_t (*connect)(void* ctx, void* handles[], int nranks, int rank, void* listenComm, void** collComm);
  rmaResult_t (*createContext)(void* collComm, rmaConfig_t* config, void** rmaCtx);
  rmaResult_t (*regMrSym)(void* collComm, void* data, size_t size, int type, uint64_t mrFlags, void** mhandle);
  rmaResult_t (*regMrSymDmaBuf)(void* collComm, void* data, size_t size, int type, uint64_t offset, int fd,
                                uint64_t mrFlags, void** mhandle);
  rmaResult_t (*deregMrSym)(void* collComm, void* mhandle);
  rmaResult_t (*destroyContext)(void* rmaCtx);
  rmaResult_t (*closeColl)(void* collComm);
  rmaResult_t (*closeListen)(void* listenComm);
  rmaResult_t (*iput)(void* rmaCtx, int context, uint64_t srcOff, void* srcMhandle, size_t size, uint64_t dstOff,
                      void* dstMhandle, uint32_t rank, void** request);
  rmaResult_t (*iputSignal)(void* rmaCtx, int context, uint64_t srcOff, void* srcMhandle, size_t size,
                            uint64_t dstOff, void* dstMhandle, uint32_t rank, uint64_t signalOff,
                            void* signalMhandle, uint64_t signalValue, uint32_t signalOp, bool isStrongSignal,
                            void** request);
  rmaResult_t (*iget)(void* rmaCtx, int context, uint64_t remoteOff, void* remoteMhandle, size_t size,
                      uint64_t localOff, void* localMhandle, uint32_t rank, void** request);
  rmaResult_t (*iflush)(void* rmaCtx, int context, void* mhandle, uint32_t rank, void** request);
  rmaResult_t (*test)(void* collComm, void* request, int* done);
  rmaResult_t (*rmaProgress)(void* rmaCtx);
  rmaResult_t (*queryLastError)(void* rmaCtx, bool* hasError);
  rmaResult_t (*finalize)(void* ctx);
} rmaPlugin_v14_t;  // ncclRma_v14_t

}  // extern "C"
