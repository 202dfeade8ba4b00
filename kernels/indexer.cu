// indexer kernel family: see kernels/SPEC.md.
#include "common.cuh"
