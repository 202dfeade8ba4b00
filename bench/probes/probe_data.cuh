// probe_data.cuh — the pseudo-random stage contents the probes in bench/probes/ share (they are built with
// nvcc alone, so the kernels' headers do not have these).
#pragma once

// Word i of random weight codes (any bit pattern: FP4 codes have no NaN).
__device__ __forceinline__ unsigned probe_weight_word(int i) {
  unsigned x = (unsigned)i * 2654435761u ^ 0x9e3779b9u;
  x ^= x >> 13;
  return x * 0x2c1b3c6du;
}

// Byte i of random e4m3 token codes: any code but the two NaNs (0x7f, 0xff), so every product is finite.
__device__ __forceinline__ unsigned char probe_token_code(int i) {
  const unsigned r = ((unsigned)i * 2246822519u) >> 24;
  return (unsigned char)((r & 0x7f) == 0x7f ? r - 1 : r);
}
