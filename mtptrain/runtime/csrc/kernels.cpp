// The runtime's CPU kernels as one translation unit, the file mtptrain/runtime/native_kernels.py compiles: torch's
// headers are most of a source's compile time (torch/extension.h took about 24 s of the 25 s each source took on a
// 2-core AMD EPYC), so one unit of the three builds in about a third of the time of three, and the sources include
// only torch_api.h, the part of torch they use (the unit 21.8 s -> 11.7 s on a 2-core Zen 5). Each source keeps
// its helpers in an anonymous namespace of its own names; decode_attention.cpp holds the Python bindings.
#include "decode_attention.cpp"
#include "layer_ops.cpp"
#include "blocked_linear.cpp"
#include "int8_linear.cpp"  // after blocked_linear.cpp: it uses that file's vector helpers
