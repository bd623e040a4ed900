// The device library as jaxgin's own CUDA kernels use it: the inline functions of impl/ (signals,
// puts, lines, the exchange channel, the barrier), compiled into each kernel rather than called
// through jaxgin_device.h's extern functions, which cost a call per use. Kernels include this
// header, never impl/ itself, as NCCL's users include nccl_device.h (tests/test_csrc_layers.py).
#pragma once
#include "jaxgin_types.h"
#include "impl/barrier__funcs.h"
#include "impl/channel__funcs.h"
#include "impl/fault__funcs.h"
#include "impl/line__funcs.h"
#include "impl/put__funcs.h"
#include "impl/signal__funcs.h"
#include "impl/transport__funcs.h"
