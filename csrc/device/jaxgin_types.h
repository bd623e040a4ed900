// The device library's data layouts that code outside it shares: the context the runtime fills
// and kernels receive, the fault record, the op tags, the heap's reserved layout, lines. For host
// code (the runtime, kernels' launchers, FFI handlers): it brings NCCL's device communicator type,
// which the context embeds, but none of NCCL's device functions (jaxgin_inline.h has those).
#pragma once
#include "impl/context__types.h"
#include "impl/line__types.h"
