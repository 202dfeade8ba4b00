// batch.cu — the device-side check of a forward batch, and the logits fix-up that ends a forward.
//
// On CUDA the batch arrays live in device memory: the host cannot read them without a sync,
// so nothing on the host may trust them (DESIGN.md §3). `batch_check_kernel` runs first in every
// forward. It applies exactly the rules of the CPU backend (src/model/batch.rs `plan`), records
// the first fault in a sticky device-side error record, and writes SANITIZED copies of the batch
// arrays that every later kernel reads instead of the host's. A bad batch is turned into an
// all-padding batch over safe values, so no later kernel can index outside the engine's buffers
// or touch a slot's state; `logits_finish_kernel` then fills its logits rows with NaN.
// Padding sequences (slot DSV4_PAD_SLOT) read and write no state; their logits rows are zeros.
//
// The numeric codes (DSV4_PAD_SLOT, BATCH_STATUS_*, BATCH_FIELD_*, BATCH_RULE_*,
// BATCH_RECORD_INTS) come from dsv4_consts.cuh, generated from src/model/batch.rs and
// src/error.rs. Rules: RANGE value outside [0, expected); DUPLICATE slot already used by
// sequence `expected`; NOT_INCREASING query_start[index] <= query_start[index-1] = expected;
// ENDPOINT query_start[0] != 0 or query_start[S] != T (= expected); NOT_CONSECUTIVE position !=
// expected; NOT_CONTINUING first position is neither 0 nor the slot's length (= expected).
// Error record: BATCH_RECORD_INTS int32 at a fixed device address (dsv4_device_error): status,
// field, index, value, rule, expected, seq (-1: none), slot (seq_slots[seq]).
#include "common.cuh"

// A fault is ordered by the key (stage, sequence, rule within the sequence, index): the smallest
// key is the fault the CPU backend reports, since it checks in that order and stops at the first.
// stage 0: query_start's end points; 1: token ids; 2: per sequence (sub 0 slot range, 1 duplicate,
// 2 query_start step, 3 positions: low = 2*i + (0 range | 1 consecutive), 4 continuation);
// 3: logits_rows.
#define BATCH_NO_FAULT 0xffffffffffffffffull
DSV4_INLINE unsigned long long batch_key(unsigned stage, unsigned seq, unsigned sub, unsigned low) {
  return ((unsigned long long)stage << 60) | ((unsigned long long)seq << 32) |
         ((unsigned long long)sub << 28) | (unsigned long long)low;
}

// The sequence of token i: the largest q < S with query_start[q] <= i (query_start valid).
DSV4_INLINE int batch_seq_of(const int* query_start, int S, int i) {
  int lo = 0, hi = S - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (query_start[mid] <= i) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Position i of real sequence q (first token a): inside [0, max_seq_len), and consecutive.
DSV4_INLINE void batch_check_position(const int* positions, int a, int i, int q, int max_seq_len,
                                      unsigned long long* first) {
  const int p = positions[i];
  if (p < 0 || p >= max_seq_len) atomicMin(first, batch_key(2, q, 3, 2u * (unsigned)i));
  if ((long long)p != (long long)positions[a] + (i - a))
    atomicMin(first, batch_key(2, q, 3, 2u * (unsigned)i + 1u));
}

// One block (blockDim a multiple of 32, at most 1024). Host-side counts T (num_tokens >= S),
// S (num_seqs >= 1), R (num_logits) are already checked against the capacities; every value
// read from the host's arrays is checked here. logits_rows may be NULL (identity, R == T).
// claim [num_slots]: scratch. record [8]: sticky, written only while record[0] == 0.
// Outputs: *verdict (1 ok, 0 bad), tok_out/pos_out/seq_of [T], slot_out [S], qs_out [S+1],
// rows_out [R]. For a good batch they equal the inputs, except that a padding sequence's
// positions become 0, 1, ...; for a bad batch: tokens 0, every sequence padding with one token
// (the last takes the rest), rows 0.
extern "C" __global__ void __launch_bounds__(BATCH_CHECK_THREADS)
    batch_check_kernel(const int* tokens, const int* positions, const int* seq_slots,
                       const int* query_start, const int* logits_rows, int T, int S, int R,
                       int vocab, int max_seq_len, int num_slots, const int* slot_len, int* claim,
                       int* record, int* verdict, int* tok_out, int* pos_out, int* slot_out,
                       int* qs_out, int* seq_of, int* rows_out) {
  dsv4_pdl_begin();
  __shared__ unsigned long long first;
  __shared__ int qs_ok;
  const int tid = threadIdx.x, nt = blockDim.x;
  if (tid == 0) {
    first = BATCH_NO_FAULT;
    qs_ok = 1;
  }
  for (int i = tid; i < num_slots; i += nt) claim[i] = 0x7fffffff;
  __syncthreads();

  // query_start, slot ranges, claims (the lowest sequence of each slot keeps it).
  if (tid == 0) {
    if (query_start[0] != 0) {
      atomicMin(&first, batch_key(0, 0, 0, 0));
      qs_ok = 0;
    } else if (query_start[S] != T) {
      atomicMin(&first, batch_key(0, 0, 0, 1));
      qs_ok = 0;
    }
  }
  for (int q = tid; q < S; q += nt) {
    const int slot = seq_slots[q];
    if (slot != DSV4_PAD_SLOT) {
      if (slot < 0 || slot >= num_slots) atomicMin(&first, batch_key(2, q, 0, 0));
      else atomicMin(&claim[slot], q);
    }
    const int a = query_start[q], b = query_start[q + 1];
    if (b <= a) atomicMin(&first, batch_key(2, q, 2, 0));
    else if (b > T) atomicMin(&first, batch_key(2, q, 2, 1));
    if (b <= a || b > T || a < 0) qs_ok = 0;
  }
  __syncthreads();

  // Duplicates and continuation (per sequence), token ids (per token), positions: per token
  // when query_start is valid everywhere, else per sequence over the sequences whose own range
  // is valid (the CPU reports an earlier sequence's bad position before a later bad range).
  for (int q = tid; q < S; q += nt) {
    const int slot = seq_slots[q];
    if (slot == DSV4_PAD_SLOT || slot < 0 || slot >= num_slots) continue;
    if (claim[slot] != q) atomicMin(&first, batch_key(2, q, 1, 0));
    const int a = query_start[q], b = query_start[q + 1];
    if (a < 0 || b <= a || b > T) continue;
    const int p0 = positions[a];
    if (p0 != 0 && p0 != slot_len[slot]) atomicMin(&first, batch_key(2, q, 4, 0));
    if (qs_ok) continue;
    for (int i = a; i < b; ++i) batch_check_position(positions, a, i, q, max_seq_len, &first);
  }
  for (int i = tid; i < T; i += nt) {
    const int tok = tokens[i];
    if (tok < 0 || tok >= vocab) atomicMin(&first, batch_key(1, 0, 0, (unsigned)i));
    if (!qs_ok) continue;
    const int q = batch_seq_of(query_start, S, i);
    if (seq_slots[q] == DSV4_PAD_SLOT) continue;  // padding: any positions
    batch_check_position(positions, query_start[q], i, q, max_seq_len, &first);
  }
  if (logits_rows != 0)
    for (int r = tid; r < R; r += nt) {
      const int row = logits_rows[r];
      if (row < 0 || row >= T) atomicMin(&first, batch_key(3, 0, 0, (unsigned)r));
    }
  __syncthreads();

  const unsigned long long f = first;
  const bool ok = f == BATCH_NO_FAULT;
  if (tid == 0) {
    *verdict = ok ? 1 : 0;
    if (!ok && record[0] == 0) {
      const int stage = (int)(f >> 60), q = (int)((f >> 32) & 0x0fffffffu);
      const int sub = (int)((f >> 28) & 0xfu), low = (int)(f & 0x0fffffffu);
      int status = BATCH_STATUS_INVALID_ARGUMENT, field = 0, rule = 0, index = 0, value = 0,
          expected = 0, seq = -1;
      if (stage == 0) {
        field = BATCH_FIELD_QUERY_START;
        rule = BATCH_RULE_ENDPOINT;
        index = low ? S : 0;
        value = query_start[index];
        expected = low ? T : 0;
      } else if (stage == 1) {
        field = BATCH_FIELD_TOKEN_IDS;
        rule = BATCH_RULE_RANGE;
        index = low;
        value = tokens[low];
        expected = vocab;
      } else if (stage == 2) {
        seq = q;
        const int slot = seq_slots[q];
        if (sub == 0 || sub == 1) {
          field = BATCH_FIELD_SEQ_SLOTS;
          index = q;
          value = slot;
          rule = sub == 0 ? BATCH_RULE_RANGE : BATCH_RULE_DUPLICATE;
          expected = sub == 0 ? num_slots : claim[slot];
        } else if (sub == 2) {
          field = BATCH_FIELD_QUERY_START;
          index = q + 1;
          value = query_start[q + 1];
          rule = low == 0 ? BATCH_RULE_NOT_INCREASING : BATCH_RULE_RANGE;
          expected = low == 0 ? query_start[q] : T + 1;
        } else if (sub == 3) {
          field = BATCH_FIELD_POSITIONS;
          index = low >> 1;
          value = positions[index];
          if ((low & 1) == 0) {
            status = BATCH_STATUS_CAPACITY;
            rule = BATCH_RULE_RANGE;
            expected = max_seq_len;
          } else {
            const int a = query_start[q];
            rule = BATCH_RULE_NOT_CONSECUTIVE;
            expected = positions[a] + (index - a);
          }
        } else {
          field = BATCH_FIELD_POSITIONS;
          rule = BATCH_RULE_NOT_CONTINUING;
          index = query_start[q];
          value = positions[index];
          expected = slot_len[slot];
        }
      } else {
        field = BATCH_FIELD_LOGITS_ROWS;
        rule = BATCH_RULE_RANGE;
        index = low;
        value = logits_rows[low];
        expected = T;
      }
      record[1] = field;
      record[2] = index;
      record[3] = value;
      record[4] = rule;
      record[5] = expected;
      record[6] = seq;
      record[7] = seq >= 0 ? seq_slots[seq] : 0;
      __threadfence();
      record[0] = status;  // last: a record with a status is complete
    }
  }

  // Sanitized copies: the only batch values later kernels read.
  for (int q = tid; q <= S; q += nt) {
    qs_out[q] = ok ? query_start[q] : (q < S ? q : T);
    if (q < S) slot_out[q] = ok ? seq_slots[q] : DSV4_PAD_SLOT;
  }
  for (int i = tid; i < T; i += nt) {
    if (ok) {
      const int q = batch_seq_of(query_start, S, i);
      const bool pad = seq_slots[q] == DSV4_PAD_SLOT;
      tok_out[i] = tokens[i];
      seq_of[i] = q;
      pos_out[i] = pad ? i - query_start[q] : positions[i];
    } else {
      const int q = i < S ? i : S - 1;
      tok_out[i] = 0;
      seq_of[i] = q;
      pos_out[i] = i - q;
    }
  }
  for (int r = tid; r < R; r += nt) rows_out[r] = ok ? (logits_rows != 0 ? logits_rows[r] : r) : 0;
}

// Ends a forward: the logits rows of a bad batch become NaN, those of padding tokens zeros;
// every other row is left as the head wrote it. One block per logits row; `rows`, `seq_of` and
// `seq_slots` are the sanitized arrays of batch_check_kernel. bf16: logits hold bf16 patterns.
extern "C" __global__ void logits_finish_kernel(const int* verdict, const int* rows,
                                                const int* seq_of, const int* seq_slots, int R,
                                                int V, int bf16, void* logits) {
  dsv4_pdl_begin();
  const int r = blockIdx.x;
  if (r >= R) return;
  const bool ok = *verdict != 0;
  if (ok && seq_slots[seq_of[rows[r]]] != DSV4_PAD_SLOT) return;
  const long long base = (long long)r * V;
  if (bf16) {
    unsigned short* out = (unsigned short*)logits + base;
    const unsigned short v = ok ? (unsigned short)0 : (unsigned short)0x7fc0;
    for (int c = threadIdx.x; c < V; c += blockDim.x) out[c] = v;
  } else {
    float* out = (float*)logits + base;
    const float v = ok ? 0.0f : DSV4_F32_NAN;
    for (int c = threadIdx.x; c < V; c += blockDim.x) out[c] = v;
  }
}
