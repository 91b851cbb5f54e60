#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <condition_variable>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <numeric>
#include <thread>
#include <type_traits>
#include <sys/mman.h>
#include <unistd.h>
#include <utility>
#include <vector>
#if defined(__AVX2__) || defined(__FMA__)
#include <immintrin.h>
#endif

// The kernels are one translation unit split by operation (as ggml-cpu is split), each part in kernels/cpu/
// using those before it; what is specific to an instruction set sits beside them (cpu/x86/, and the bf16
// units in cpu/bf16.h, chosen at run time). The build copies them beside this file (`kernels/native.py`).
#include "cpu/pool.h"
#include "cpu/vectors.h"
#include "cpu/kv_rows.h"
#include "cpu/attention_decode.h"
#include "cpu/panels.h"
#include "cpu/int8.h"
#include "cpu/linear.h"
#include "cpu/attention_prefill.h"
#include "cpu/layers.h"
#include "cpu/head_screen.h"
#include "cpu/decoder.h"

// The kernels run without the GIL, so the engine's event loop goes on while a forward computes.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("paged_decode", &paged_decode, nogil);
  m.def("paged_prefill", &paged_prefill, nogil);
  m.def("quantize_kv", &quantize_kv, nogil);
  m.def("pack_panels", &pack_panels);
  m.def("pack_panels_gated", &pack_panels_gated);
  m.def("pack_panels_int8", &pack_panels_int8);
  m.def("int8_rows", &int8_rows);
  m.def("int8_from_panels", &int8_from_panels);
  m.def("pack_panels_w8a8", &pack_panels_w8a8);
  m.def("vnni_panels", &vnni_panels);
  m.def("bf16_unit", &bf16_unit, py::arg("set") = py::none());
  m.def("bf16_why_not_amx", &bf16_why_not_amx);
  m.def("panel_linear", &panel_linear, py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("b"), py::arg("gated") = false,
        py::arg("act") = 0, nogil);
  m.def("rms_norm", &rms_norm, nogil);
  m.def("rotary_", &rotary_, nogil);
  m.def("head_norm_", &head_norm_, nogil);
  m.def("gated_act", &gated_act, py::arg("gu"), py::arg("act") = 0, nogil);
  m.def("argmax_rows", &argmax_rows, nogil);
  m.def("screened_argmax_rows", &screened_argmax_rows, nogil);
  m.def("has_vnni", [] {  // whether int8 products run on AVX-512 VNNI here (else `a8_rows` is scalar code)
#ifdef __AVX512VNNI__
    return true;
#else
    return false;
#endif
  });
  py::class_<FusedDecoder>(m, "FusedDecoder")
      .def(py::init<std::vector<std::vector<torch::Tensor>>, std::vector<double>, std::vector<int64_t>, int64_t, int64_t,
                    int64_t, double, torch::Tensor, double, torch::Tensor, int64_t, torch::Tensor, bool, int64_t,
                    std::vector<int64_t>, double, double, double, double, double>(),
           py::arg("layers"), py::arg("eps"), py::arg("windows"), py::arg("heads"), py::arg("kv_heads"), py::arg("dim"),
           py::arg("scaling"), py::arg("norm"), py::arg("norm_eps"), py::arg("head"), py::arg("vocab"), py::arg("head_bias"),
           py::arg("gated") = false, py::arg("act") = 0, py::arg("rope_of_layer") = std::vector<int64_t>(),
           py::arg("softcap") = 0.0, py::arg("final_softcap") = 0.0, py::arg("embed_scale") = 1.0,
           py::arg("residual_scale") = 1.0, py::arg("logit_divisor") = 1.0)
      .def("forward", &FusedDecoder::forward, py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("keys"),
           py::arg("values"), py::arg("tables"), py::arg("group_of_layer"), py::arg("ctx"), py::arg("block_size"),
           py::arg("greedy") = false, nogil)
      .def("step", &FusedDecoder::step, py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("keys"), py::arg("values"),
           py::arg("tables"), py::arg("group_of_layer"), py::arg("ctx"), py::arg("qlens"), py::arg("decodes"),
           py::arg("keep"), py::arg("block_size"), py::arg("greedy") = false, nogil)
      .def("screen", &FusedDecoder::screen)
      .def_property_readonly("screen_rest", &FusedDecoder::screen_rest)
      .def("propose", &FusedDecoder::propose, nogil)
      .def_readonly("attention_seconds", &FusedDecoder::attention_s_);
}
