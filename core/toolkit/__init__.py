"""The backend author's toolkit: stable building blocks a backend may import.

- ``pagedkv.toolkit.kv_write``: write new K/V rows into any layout's logical views by
  slot mapping (16-bit and fp8 caches, bit-identical on every device), a writer kept
  per pair of views (``cache_writer``), quantise and dequantise fp8 cache values.
- ``pagedkv.toolkit.triton_kv_write``: the Triton kernel behind the writer on CUDA
  (imports triton).
- ``pagedkv.toolkit.triton_helpers``: ``@triton.jit`` helpers (fp32 -> fp8 bits,
  ``LOG2E``) and the interpreter loop-bound fix (imports triton).
- ``pagedkv.toolkit.interpreter``: the one check for Triton's CPU interpreter.
- ``pagedkv.toolkit.split_kv``: the split-KV policy (how many programs share one
  sequence's keys), the SM count of a device, the log-sum-exp merge of partial
  attention results, and the split-KV combinator: slices of long decodes as extra
  requests of one backend call, for any impl with ``attend_with_lse``.
- ``pagedkv.toolkit.triton_lse_merge``: the Triton kernel behind the merge on CUDA,
  and its weighting step (``lse_weights``) for other kernels' merges (imports triton).
- ``pagedkv.toolkit.launch``: a planned kernel launch with keyword arguments, and
  whether a device takes programmatic dependent launches.
- ``pagedkv.toolkit.numerics``: constants shared by every kernel language (``LOG2E``).

Nothing here is imported by ``import pagedkv``; each module imports only what it needs.
"""
