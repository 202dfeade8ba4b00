// attn_keys.cuh — where one query's attention keys are (MODEL.md §6.5): its window, then its
// compressed entries. Shared by attention.cu (the reference) and fast_attention.cu.
#pragma once
#include "common.cuh"
#include "kv_pages.cuh"

// Where a query's keys are: window positions before the sequence's first position in this
// batch come from the slot's ring (row pos % W), later ones from this batch's f32 kv rows,
// then the compressed entries (HCA: 0, 1, ...; CSA: the indexer's selection).
struct AttnKeys {
  KvRowFmt batch, state;  // f32 rows of `kv`; the stored rows (ring and entries)
  const float* kv;
  const unsigned char* ring;
  const unsigned char* entries;
  const int* etable;
  int epps, slot, lo, p0, t0, nw, W;
  const int* sel;  // CSA selection in shared memory, NULL for HCA
};

// The j-th key row's bytes; `stored` says whether it is a stored row (else an f32 batch row).
DSV4_INLINE KvRowPtr attn_key(const AttnKeys& k, int j, bool* stored) {
  if (j < k.nw) {
    const int pos = k.lo + j;
    if (pos < k.p0) {
      *stored = true;
      return kv_row(k.state, k.ring, 0, kv_ring_pages(k.W), k.slot, pos % k.W);
    }
    *stored = false;
    KvRowPtr p;
    p.row = (unsigned char*)(k.kv + (long long)(k.t0 + pos - k.p0) * k.batch.dim);
    p.sc = 0;
    return p;
  }
  *stored = true;
  const int e = k.sel != 0 ? k.sel[j - k.nw] : j - k.nw;
  return kv_row(k.state, k.entries, k.etable, k.epps, k.slot, e);
}


// The keys of token t (sequence s, slot >= 0; kernels/SPEC.md attention_kernel): window
// positions max(0, p-W+1) .. p, then compressed entries: HCA (selected == NULL, ratio > 0) every
// w < (p+1)/ratio (at most maxe), CSA selected[t][0 .. nsel[t]] (at most topk; k->sel points
// there). Fills *k and returns the key count.
DSV4_INLINE int attn_keys_init(AttnKeys* k, int t, int s, int slot, const float* kv,
                               const unsigned char* ring, const unsigned char* entries,
                               const int* etable, int epps, const int* selected, const int* nsel,
                               const int* positions, const int* query_start, int hd, int nope, int W,
                               int ratio, int maxe, int topk, int official) {
  const int p = positions[t];
  const int t0 = query_start[s];
  const int lo = p - W + 1 > 0 ? p - W + 1 : 0;
  int nc = 0;
  if (ratio > 0) {
    if (selected != 0) {
      nc = nsel[t];
      if (nc > topk) nc = topk;
    } else {
      nc = (p + 1) / ratio;
      if (nc > maxe) nc = maxe;
    }
    if (nc < 0) nc = 0;
  }
  k->batch = kv_fmt_kv(hd, nope, 0);
  k->state = kv_fmt_kv(hd, nope, official);
  k->kv = kv;
  k->ring = ring;
  k->entries = entries;
  k->etable = etable;
  k->epps = epps;
  k->slot = slot;
  k->lo = lo;
  k->p0 = positions[t0];
  k->t0 = t0;
  k->nw = p - lo + 1;
  k->W = W;
  k->sel = (ratio > 0 && selected != 0) ? selected + (long long)t * topk : 0;
  return k->nw + nc;
}
