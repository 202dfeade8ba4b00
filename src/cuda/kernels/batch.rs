//! Rust side of the `batch` kernel family (kernels/batch.cu): the device-side check of a
//! forward batch that runs first in every CUDA forward, and the logits fix-up that ends it.
//! The rules and the fault record are `model::batch`'s; see kernels/SPEC.md "batch.cu".

use crate::cuda::kernels::{need, to_i32};
use crate::cuda::stream::BorrowedStream;
use crate::cuda::{Context, DevicePtr};
use crate::error::{Error, Result, Status};
use crate::model::batch::FAULT_RECORD_INTS;
use std::ffi::c_void;

crate::kernel_family! {
    /// The family as the registry compiles and loads it.
    pub const SOURCE = "batch", include_str!("../../../kernels/batch.cu");

    /// The host's arrays (`tokens` .. `logits_rows`, NULL: every token), the limits, then the
    /// state it reads (`slot_len`) and every buffer it writes.
    #[pdl(true)]
    fn batch_check_kernel(
        tokens: *const i32, positions: *const i32, seq_slots: *const i32,
        query_start: *const i32, logits_rows: Option<*const i32>, t: i32, s: i32, r: i32,
        vocab: i32, max_seq_len: i32, num_slots: i32, slot_len: *const i32, claim: *mut i32,
        record: *mut i32, verdict: *mut i32, tok_out: *mut i32, pos_out: *mut i32,
        slot_out: *mut i32, qs_out: *mut i32, seq_of: *mut i32, rows_out: *mut i32,
    );
    /// `logits` is f32, or bf16 when `bf16`.
    #[pdl(true)]
    fn logits_finish_kernel(
        verdict: *const i32, rows: *const i32, seq_of: *const i32, seq_slots: *const i32,
        r: i32, v: i32, bf16: bool, logits: *mut c_void,
    );
}

const FAMILY: &str = "batch";
/// One block checks the whole batch (no grid-wide sync needed); its threads stride over
/// tokens and sequences.
pub(crate) const CHECK_THREADS: u32 = 1024;
const FINISH_THREADS: u32 = 256;

/// The host's batch as the forward received it: device addresses nothing has checked yet.
#[derive(Clone, Copy, Debug)]
pub struct RawBatch {
    pub tokens: DevicePtr,
    pub positions: DevicePtr,
    pub seq_slots: DevicePtr,
    pub query_start: DevicePtr,
    /// None: every token gives a logits row (num_logits == num_tokens).
    pub logits_rows: Option<DevicePtr>,
    pub num_tokens: usize,
    pub num_seqs: usize,
    pub num_logits: usize,
}

/// The engine's buffers the check reads and writes (fixed addresses in the arena).
#[derive(Clone, Copy, Debug)]
pub struct CheckedBatch {
    /// Sanitized copies, the only batch values later kernels read: tokens, positions and
    /// seq_of `[T]`, seq_slots `[S]`, query_start `[S+1]`, logits rows `[R]`.
    pub tokens: DevicePtr,
    pub positions: DevicePtr,
    pub seq_of: DevicePtr,
    pub seq_slots: DevicePtr,
    pub query_start: DevicePtr,
    pub rows: DevicePtr,
    /// int: 1 when the batch passed, 0 when it was bad (and became all padding).
    pub verdict: DevicePtr,
    /// Scratch int `[num_slots]`.
    pub claim: DevicePtr,
    /// The sticky error record, int [FAULT_RECORD_INTS] (state: survives forwards).
    pub record: DevicePtr,
}

/// Capacities and model sizes the rules check against.
#[derive(Clone, Copy, Debug)]
pub struct BatchLimits {
    pub vocab: usize,
    pub max_seq_len: usize,
    pub num_slots: usize,
    /// slot_len `[num_slots]`: the slots' current lengths (state).
    pub slot_len: DevicePtr,
}

crate::launchers! {
    /// The family's entry points, resolved from a loaded registry.
    pub struct BatchKernels {
        check: batch_check_kernel,
        finish: logits_finish_kernel,
    }
}

fn bad(msg: String) -> Error {
    Error::new(Status::Internal, format!("{FAMILY}: {msg}"))
}

impl BatchKernels {
    /// Checks `raw` on the device and writes `out`'s sanitized copies, its verdict, and the
    /// first fault into the record if it is empty.
    pub fn check(
        &self,
        ctx: &Context,
        raw: &RawBatch,
        lim: &BatchLimits,
        out: &CheckedBatch,
        stream: BorrowedStream,
    ) -> Result<()> {
        let (t, s, r) = (raw.num_tokens, raw.num_seqs, raw.num_logits);
        if t == 0 || s == 0 || s > t || (raw.logits_rows.is_none() && r != t) {
            return Err(bad(format!(
                "batch of {t} tokens, {s} sequences, {r} logits rows"
            )));
        }
        // (The host's arrays: their extents are the host's promise, not checkable here.)
        need(FAMILY, "tokens out", out.tokens, t * 4)?;
        need(FAMILY, "positions out", out.positions, t * 4)?;
        need(FAMILY, "seq_of", out.seq_of, t * 4)?;
        need(FAMILY, "seq_slots out", out.seq_slots, s * 4)?;
        need(FAMILY, "query_start out", out.query_start, (s + 1) * 4)?;
        need(FAMILY, "rows out", out.rows, r * 4)?;
        need(FAMILY, "verdict", out.verdict, 4)?;
        need(FAMILY, "claim", out.claim, lim.num_slots * 4)?;
        need(FAMILY, "record", out.record, FAULT_RECORD_INTS * 4)?;
        need(FAMILY, "slot_len", lim.slot_len, lim.num_slots * 4)?;
        let i = |what: &str, v: usize| to_i32(FAMILY, what, v);
        let _g = ctx.enter()?;
        // The host's arrays hold the counts it stated (DESIGN.md §3); the kernel reads them
        // only below those counts.
        let args = batch_check_kernel::Args {
            tokens: raw.tokens,
            positions: raw.positions,
            seq_slots: raw.seq_slots,
            query_start: raw.query_start,
            logits_rows: raw.logits_rows,
            t: i("num_tokens", t)?,
            s: i("num_seqs", s)?,
            r: i("num_logits", r)?,
            vocab: i("vocab", lim.vocab)?,
            max_seq_len: i("max_seq_len", lim.max_seq_len)?,
            num_slots: i("num_slots", lim.num_slots)?,
            slot_len: lim.slot_len,
            claim: out.claim,
            record: out.record,
            verdict: out.verdict,
            tok_out: out.tokens,
            pos_out: out.positions,
            slot_out: out.seq_slots,
            qs_out: out.query_start,
            seq_of: out.seq_of,
            rows_out: out.rows,
        };
        self.check.launch(1, CHECK_THREADS, 0, stream, args)
    }

    /// Overwrites the logits rows of padding tokens with zeros, or every row with NaN when
    /// the batch was bad. `logits`: [rows, vocab] f32, or bf16 when `bf16`.
    #[allow(clippy::too_many_arguments)]
    pub fn finish_logits(
        &self,
        ctx: &Context,
        b: &CheckedBatch,
        rows: usize,
        vocab: usize,
        bf16: bool,
        logits: DevicePtr,
        stream: BorrowedStream,
    ) -> Result<()> {
        if rows == 0 {
            return Ok(());
        }
        need(FAMILY, "rows", b.rows, rows * 4)?;
        need(
            FAMILY,
            "logits",
            logits,
            rows * vocab * if bf16 { 2 } else { 4 },
        )?;
        let _g = ctx.enter()?;
        // `rows`, `seq_of` and `seq_slots` hold the sanitized values batch_check_kernel wrote,
        // all in range.
        let args = logits_finish_kernel::Args {
            verdict: b.verdict,
            rows: b.rows,
            seq_of: b.seq_of,
            seq_slots: b.seq_slots,
            r: to_i32(FAMILY, "rows", rows)?,
            v: to_i32(FAMILY, "vocab", vocab)?,
            bf16,
            logits,
        };
        self.finish
            .launch(rows as u32, FINISH_THREADS, 0, stream, args)
    }
}
