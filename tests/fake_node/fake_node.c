// For CPU tests of jaxgin.doctor only: the entry points of the CUDA driver (libcuda.so.1), NVML
// (libnvidia-ml.so.1), libibverbs and libmlx5 that jaxgin.node calls, answering from the text
// files of a prepared node image (the directory $JAXGIN_FAKE_NODE) instead of hardware.
// tests/test_doctor.py compiles it once per library name, with a version script for the rdma-core
// ones (the symbol versions are what the doctor checks there).
//
// Files of the image (absent: no such thing on that node):
//   cuinit        the CUresult cuInit returns (default 0; 100 = no device)
//   cuda_version  what cuDriverGetVersion reports, e.g. 13000
//   driver        the driver version NVML reports, e.g. 580.159.04
//   gpus          a line per GPU, tab-separated: name, cc major, cc minor, PCI bus id, VMM (0/1), dma-buf (0/1),
//                 GPUDirect RDMA on VMM memory (0/1)
//   p2p           a line per GPU pair, tab-separated: a, b, peer access (0/1), NVLink (0/1)
//   ibv_devices   a line per RDMA device libibverbs lists
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GPUS 16
#define MAX_DEVICES 16

typedef struct {
  char name[128];
  int major, minor;
  char bus[64];
  int vmm, dma_buf, gdr_vmm;
} gpu_t;

static FILE* open_file(const char* name) {
  const char* dir = getenv("JAXGIN_FAKE_NODE");
  if (!dir) return NULL;
  char path[1024];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  return fopen(path, "r");
}

static int read_int(const char* name, int fallback) {
  FILE* f = open_file(name);
  if (!f) return fallback;
  int value = fallback;
  if (fscanf(f, "%d", &value) != 1) value = fallback;
  fclose(f);
  return value;
}

static int load_gpus(gpu_t* gpus) {
  FILE* f = open_file("gpus");
  if (!f) return 0;
  int n = 0;
  char line[512];
  while (n < MAX_GPUS && fgets(line, sizeof line, f)) {
    gpu_t* g = &gpus[n];
    if (sscanf(line, "%127[^\t]\t%d\t%d\t%63[^\t]\t%d\t%d\t%d", g->name, &g->major, &g->minor, g->bus, &g->vmm,
               &g->dma_buf, &g->gdr_vmm) == 7)
      n++;
  }
  fclose(f);
  return n;
}

// 1: GPUs a and b have the capability in `column` (2: peer access, 3: NVLink), in either order.
static int pair_has(int a, int b, int column) {
  FILE* f = open_file("p2p");
  if (!f) return 0;
  int x, y, access, nvlink, found = 0;
  while (fscanf(f, "%d\t%d\t%d\t%d", &x, &y, &access, &nvlink) == 4)
    if ((x == a && y == b) || (x == b && y == a)) found = column == 2 ? access : nvlink;
  fclose(f);
  return found;
}

// ---- CUDA driver
int cuInit(unsigned flags) {
  (void)flags;
  gpu_t gpus[MAX_GPUS];
  int code = read_int("cuinit", 0);
  return code == 0 && load_gpus(gpus) == 0 ? 100 : code;
}
int cuDriverGetVersion(int* version) {
  *version = read_int("cuda_version", 0);
  return 0;
}
int cuGetErrorName(int code, const char** name) {
  *name = code == 100 ? "CUDA_ERROR_NO_DEVICE" : code == 803 ? "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH" : "CUDA_ERROR_UNKNOWN";
  return 0;
}
int cuDeviceGetCount(int* count) {
  gpu_t gpus[MAX_GPUS];
  *count = load_gpus(gpus);
  return 0;
}
int cuDeviceGet(int* device, int ordinal) {
  *device = ordinal;
  return 0;
}
int cuDeviceGetName(char* name, int length, int device) {
  gpu_t gpus[MAX_GPUS];
  if (device >= load_gpus(gpus)) return 101;
  snprintf(name, length, "%s", gpus[device].name);
  return 0;
}
int cuDeviceGetPCIBusId(char* bus, int length, int device) {
  gpu_t gpus[MAX_GPUS];
  if (device >= load_gpus(gpus)) return 101;
  snprintf(bus, length, "%s", gpus[device].bus);
  return 0;
}
int cuDeviceGetAttribute(int* value, int attribute, int device) {
  gpu_t gpus[MAX_GPUS];
  if (device >= load_gpus(gpus)) return 101;
  const gpu_t* g = &gpus[device];
  switch (attribute) {
    case 75: *value = g->major; return 0;
    case 76: *value = g->minor; return 0;
    case 102: *value = g->vmm; return 0;
    case 110: *value = g->gdr_vmm; return 0;
    case 124: *value = g->dma_buf; return 0;
    default: return 1;
  }
}
int cuDeviceCanAccessPeer(int* can, int device, int peer) {
  *can = pair_has(device, peer, 2);
  return 0;
}

// ---- NVML (a device handle is its CUDA ordinal + 1)
int nvmlInit_v2(void) {
  gpu_t gpus[MAX_GPUS];
  return load_gpus(gpus) ? 0 : 9;  // NVML_ERROR_DRIVER_NOT_LOADED
}
int nvmlShutdown(void) { return 0; }
const char* nvmlErrorString(int code) { return code == 9 ? "Driver Not Loaded" : "Unknown Error"; }
int nvmlSystemGetDriverVersion(char* version, unsigned length) {
  FILE* f = open_file("driver");
  if (!f) return 999;
  if (!fgets(version, (int)length, f)) version[0] = 0;
  version[strcspn(version, "\n")] = 0;
  fclose(f);
  return 0;
}
int nvmlDeviceGetHandleByPciBusId_v2(const char* bus, void** handle) {
  gpu_t gpus[MAX_GPUS];
  int n = load_gpus(gpus);
  for (int i = 0; i < n; i++)
    if (strcmp(gpus[i].bus, bus) == 0) {
      *handle = (void*)(long)(i + 1);
      return 0;
    }
  return 6;  // NVML_ERROR_NOT_FOUND
}
int nvmlDeviceGetP2PStatus(void* a, void* b, int index, int* status) {
  *status = index == 2 && pair_has((int)(long)a - 1, (int)(long)b - 1, 3) ? 0 : 5;
  return 0;
}

// ---- libibverbs (a device is its name)
typedef struct {
  char name[64];
} verbs_device_t;
static verbs_device_t verbs_devices[MAX_DEVICES];

void** ibv_get_device_list(int* count) {
  void** list = calloc(MAX_DEVICES + 1, sizeof(void*));
  int n = 0;
  FILE* f = open_file("ibv_devices");
  if (f) {
    while (n < MAX_DEVICES && fscanf(f, "%63s", verbs_devices[n].name) == 1) {
      list[n] = &verbs_devices[n];
      n++;
    }
    fclose(f);
  }
  if (count) *count = n;
  return list;
}
const char* ibv_get_device_name(void* device) { return ((verbs_device_t*)device)->name; }
void ibv_free_device_list(void** list) { free(list); }
void* ibv_reg_dmabuf_mr(void* pd, unsigned long offset, size_t length, unsigned long iova, int fd, int access) {
  (void)pd, (void)offset, (void)length, (void)iova, (void)fd, (void)access;
  return NULL;
}

// ---- libmlx5
int mlx5dv_query_device(void* context, void* attributes) {
  (void)context, (void)attributes;
  return 0;
}
void* mlx5dv_reg_dmabuf_mr(void* pd, unsigned long offset, size_t length, unsigned long iova, int fd, int access,
                           int mlx5_access) {
  (void)pd, (void)offset, (void)length, (void)iova, (void)fd, (void)access, (void)mlx5_access;
  return NULL;
}
