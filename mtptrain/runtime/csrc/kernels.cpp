// The runtime's CPU kernels as one translation unit, the file mtptrain/runtime/native_kernels.py compiles: each
// source includes torch/extension.h, whose parsing is most of a source's compile time (about 24 s of the 25 s each
// took on a 2-core AMD EPYC), so one unit of the three builds in about a third of the time of three. Each source
// keeps its helpers in an anonymous namespace of its own names; decode_attention.cpp holds the Python bindings.
#include "decode_attention.cpp"
#include "layer_ops.cpp"
#include "blocked_linear.cpp"
