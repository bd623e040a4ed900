"""The Triton side of jaxgin's device library: the device functions Triton kernels call
(``language``, over the extern stubs in ``_externs``) and the link step that resolves them against
the device library (``link``).

Users reach them as ``tritongin.language``; jaxgin's own Triton kernels (``jaxgin.fused``,
``jaxgin.moe``) import them from here, so jaxgin never imports tritongin, which sits on top of
jaxgin. Importing ``jaxgin.triton_device.language`` needs Triton, an optional dependency.
"""
