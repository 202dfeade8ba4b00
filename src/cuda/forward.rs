//! The CUDA forward, written once against the kernel-set interface (kernel_sets/mod.rs):
//! the batch check, then embed -> per layer (boundary, attention, boundary, MoE) -> slot
//! commit -> head -> logits fix-up. Launches only on the host's stream; no allocation, no
//! host synchronization, no host-visible branching on device values: the launch sequence
//! depends only on (num_tokens, num_seqs, num_logits), the config and the kernel set, so a
//! host can capture it in a CUDA graph.

use crate::backend::DeviceBatch;
use crate::cuda::arena::DevicePtr;
use crate::cuda::backend::CudaBackend;
use crate::cuda::kernel_sets::{Branch, LogitsTarget, Step};
use crate::cuda::kernels::attention::BatchMeta;
use crate::cuda::kernels::batch::{BatchKernels, BatchLimits, RawBatch};
use crate::cuda::stream::BorrowedStream;
use crate::error::Result;

/// A device array the host passed in a batch (its extent known from the counts).
fn host_buf(addr: u64, bytes: usize) -> DevicePtr {
    // SAFETY: the host guarantees `bytes` accessible bytes at `addr` for the call (DESIGN.md
    // §3); kernels only touch that range.
    unsafe { DevicePtr::from_raw(addr, bytes) }
}

/// One forward step on the device (DESIGN.md §3).
pub fn forward(be: &CudaBackend, b: &DeviceBatch, st: BorrowedStream) -> Result<()> {
    let (ctx, cfg, opts, model, chk, set) = be.parts()?;
    let checker: &BatchKernels = be.batch_kernels()?;
    let _g = ctx.enter()?;
    let (t, s) = (b.num_tokens, b.num_seqs);
    // First the device-side check (kernels/batch.cu): from here on every kernel reads the
    // sanitized batch, never the host's arrays; a bad batch has become all padding.
    let raw = RawBatch {
        tokens: host_buf(b.token_ids, t * 4),
        positions: host_buf(b.positions, t * 4),
        seq_slots: host_buf(b.seq_slots, s * 4),
        query_start: host_buf(b.query_start, (s + 1) * 4),
        logits_rows: (b.logits_rows != 0).then(|| host_buf(b.logits_rows, b.num_logits * 4)),
        num_tokens: t,
        num_seqs: s,
        num_logits: b.num_logits,
    };
    let limits = BatchLimits {
        vocab: cfg.vocab_size,
        max_seq_len: opts.max_seq_len,
        num_slots: opts.max_num_seqs,
        slot_len: model.slot_len,
    };
    checker.check(ctx, &raw, &limits, chk, st)?;
    let step = Step {
        ctx,
        stream: st,
        cfg,
        opts,
        model,
        meta: BatchMeta {
            positions: chk.positions,
            query_start: chk.query_start,
            seq_slots: chk.seq_slots,
            seq_of: chk.seq_of,
            num_tokens: t,
            num_seqs: s,
        },
        tokens: chk.tokens,
        rows: chk.rows,
    };

    set.embed(&step)?;
    let mut done = None;
    for l in 0..cfg.num_layers {
        set.boundary(&step, done, Branch::Attention(l))?;
        set.attention(&step, l)?;
        set.boundary(&step, Some(Branch::Attention(l)), Branch::Moe(l))?;
        set.moe(&step, l)?;
        done = Some(Branch::Moe(l));
    }
    set.commit_slots(&step)?;

    let rows = b.num_logits;
    if rows == 0 {
        return Ok(());
    }
    let v = cfg.vocab_size;
    let elem = if b.logits_bf16 { 2 } else { 4 };
    let out = LogitsTarget {
        ptr: host_buf(b.logits, rows * v * elem),
        rows,
        bf16: b.logits_bf16,
    };
    set.head(&step, done, &out)?;
    // Padding rows become zeros; every row of a bad batch NaN.
    checker.finish_logits(ctx, chk, rows, v, b.logits_bf16, out.ptr, st)
}
