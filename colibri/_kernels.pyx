# cython: language_level=3
"""colibri._kernels: the compiled MoE kernels (import colibri.kernels, not this module).

Three roles, as in scikit-learn: `def` wrappers check dtypes, shapes, ranges and the byte
bounds of every weight with the GIL held, allocate outputs and scratch, then enter
`with nogil:`; `cdef ... noexcept nogil` workers run the loops; the per-ISA inner loops live
in _simd.h: the row kernel (one weight row against up to COLIBRI_MAX_NT tokens, dequantizing
in registers) and, for prefill, the GEMM path (a panel of rows dequantized once to f32 in
per-thread scratch, then a register-blocked micro-kernel over all the matrix's tokens).
Nothing inside a pool job can fail: every check happens before it.

Paths: a matrix applied to fewer than gemm_min_tokens tokens (linear: T; expert FFN: that
expert's tokens) runs on the row kernel, from that count on on the GEMM path. Both are
exact to the dequantized weights with f32 activations; they sum in different orders.

Determinism: every output element is produced by one kernel call whose inputs do not
depend on the number of threads, and whose arithmetic depends only on the path, not on how
many tokens share the pass, nor on the tiles, panels or token blocks (see _simd.h); the
choice of path depends only on the token count; the expert outputs are combined per token in
k order. So results are bit-identical for any thread count on a given ISA path. A token gets
the same bits alone (decode) or inside any block of fewer than gemm_min_tokens tokens, and
the same bits inside any two blocks of gemm_min_tokens or more; between the two (alone vs a
long prefill) its results may differ in the last bits (both within the f32 dot-product error
bound of the float64 reference).

Threads: the work runs on colibri's thread pool (csrc/pool.h) as jobs of equal work items, which
the caller and the workers claim one at a time; a job returns when every item is done, so a
late worker costs nothing. Work too small to pay for a job runs on fewer threads, down to one
without touching the pool (_team, min_parallel_bytes). The expert FFN runs its stages
(gather, gate/up, down + combine) as three jobs over flat lists of work items.

Activations: with activations="int8" or "int16" a q8/q4 matrix (Wmat.iact) runs the
integer row kernel (_simd.h, "idot") on token rows quantized once per call into an Act (int8
or int16 codes, per
32-block scales and sums, packed as the SIMD bodies want): linear quantizes x before its
parallel loop; the expert FFN quantizes each gathered row (or x once, at T == 1) for gate /
up, and each gate/up work item quantizes the h columns it produced for w_down (its tiles are
then whole 32-blocks). Plain-format matrices keep the f32 path in the same call. The
quantization is bit-identical on every path and the integer dot follows the same
determinism rule as the f32 one. From the ISA path's crossover (igemm_min_tokens, 0: the
path's measured one, csrc/igemm.h colibri_igemm_crossover) such matrices take the integer
GEMM path instead (csrc/igemm.h: a panel of rows decoded once per K-chunk into vpdpbusd /
vpdpwssd order, the same exact block sums, one fused multiply-add per block): the same
determinism rule, with igemm_min_tokens in place of gemm_min_tokens.

Scratch: one grow-only per-process buffer (_take/_give), so a decode step allocates no
scratch arrays; a concurrent second caller (another Python thread) gets a fresh one.

Shapes (the package alphabet): T tokens, D hidden, I expert intermediate, E experts, K experts
per token, R rows (outputs) and C columns (inputs) of a weight matrix, Q group size (called G
in the C bodies), NT tokens per pass.

Sections, in colibri/pyx/, included in this order:
  csrc.pxi             the C layer's declarations (_simd.h, csrc/attend.h, csrc/pool.h)
  weights.pxi          the ISA path; weights checked against their buffer, loaded as a Wmat
  activations.pxi      int8 / int16 activations: the packed token rows, quantize_activations
  runtime.pxi          knobs (min_parallel_bytes, spin_us, gemm_min_tokens), pool, scratch
  linear.pxi           linear
  routing.pxi          route_topk
  group_by_expert.pxi  the (token, k) slots grouped by expert
  expert_ffn.pxi       expert_ffn, swiglu
  dequant.pxi          dequantize
  attention.pxi        attend_decode (one token over a KV cache slice)
  bandwidth.pxi        read_sum
  rowops.pxi           a decode step's row operations: rms_norm_rows, rope_rows, attend_cached
  prepared.pxi         PreparedLinear, PreparedRoute, PreparedExperts
  mla.pxi              PreparedMLA: the absorbed latent-attention decode step (csrc/mla.h)
  biased_experts.pxi   PreparedBiasedExperts: one token's biased / swigluoai experts (GPT-OSS)
  biased_grouped.pxi   PreparedBiasedGrouped: T token rows of them grouped by expert
  decode_families.pxi  the compiled decode step's MLA attention and biased experts (nogil)
  decode_layer.pxi     DecodeLayers, DecodeBinding: every layer of a decode step in one call
                       (or of T <= 33 rows of one sequence: a speculative verification)
  decode_step.pxi      that call's sequence of kernels, layer by layer
"""
from libc.stdlib cimport free, malloc
from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t, uint64_t
from libc.math cimport INFINITY, expf, fabsf

import numpy as np

from colibri.dtypes import BLOCK, DTYPES, MATMUL, QUANTIZED

include "pyx/csrc.pxi"
include "pyx/weights.pxi"
include "pyx/activations.pxi"
include "pyx/runtime.pxi"
include "pyx/linear.pxi"
include "pyx/routing.pxi"
include "pyx/group_by_expert.pxi"
include "pyx/expert_ffn.pxi"
include "pyx/dequant.pxi"
include "pyx/attention.pxi"
include "pyx/bandwidth.pxi"
include "pyx/rowops.pxi"
include "pyx/prepared.pxi"
include "pyx/mla.pxi"
include "pyx/biased_experts.pxi"
include "pyx/biased_grouped.pxi"
include "pyx/decode_families.pxi"
include "pyx/decode_layer.pxi"
include "pyx/decode_step.pxi"
