//! Rust side of the `batch` kernel family (kernels/batch.cu): the device-side check of a
//! forward batch that runs first in every CUDA forward, and the logits fix-up that ends it.
//! The rules and the fault record are `model::batch`'s; see kernels/SPEC.md "batch.cu".

use crate::cuda::kernels::{need, to_i32};
use crate::cuda::registry::{Kernel, KernelFn, KernelSource, Registry};
use crate::cuda::stream::{BorrowedStream, KernelArgs, launch};
use crate::cuda::{Context, DevicePtr};
use crate::error::{Error, Result, Status};
use crate::model::batch::FAULT_RECORD_INTS;

/// The family as the registry compiles and loads it.
pub const SOURCE: KernelSource = KernelSource {
    family: "batch",
    source: include_str!("../../../kernels/batch.cu"),
    functions: &[
        KernelFn::new("batch_check_kernel"),
        KernelFn::new("logits_finish_kernel"),
    ],
};

const FAMILY: &str = "batch";
/// One block checks the whole batch (no grid-wide sync needed); its threads stride over
/// tokens and sequences.
const CHECK_THREADS: u32 = 1024;
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
    /// seq_of [T], seq_slots [S], query_start [S+1], logits rows [R].
    pub tokens: DevicePtr,
    pub positions: DevicePtr,
    pub seq_of: DevicePtr,
    pub seq_slots: DevicePtr,
    pub query_start: DevicePtr,
    pub rows: DevicePtr,
    /// int: 1 when the batch passed, 0 when it was bad (and became all padding).
    pub verdict: DevicePtr,
    /// Scratch int [num_slots].
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
    /// slot_len [num_slots]: the slots' current lengths (state).
    pub slot_len: DevicePtr,
}

/// The family's entry points, resolved from a loaded registry.
pub struct BatchKernels {
    check: Kernel,
    finish: Kernel,
}

fn bad(msg: String) -> Error {
    Error::new(Status::Internal, format!("{FAMILY}: {msg}"))
}

impl BatchKernels {
    pub fn new(reg: &Registry) -> Result<BatchKernels> {
        Ok(BatchKernels {
            check: reg.get(FAMILY, "batch_check_kernel")?,
            finish: reg.get(FAMILY, "logits_finish_kernel")?,
        })
    }

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
        let mut a = KernelArgs::new();
        a.ptr(raw.tokens)
            .ptr(raw.positions)
            .ptr(raw.seq_slots)
            .ptr(raw.query_start)
            .u64(raw.logits_rows.map_or(0, |p| p.addr()))
            .i32(i("num_tokens", t)?)
            .i32(i("num_seqs", s)?)
            .i32(i("num_logits", r)?)
            .i32(i("vocab", lim.vocab)?)
            .i32(i("max_seq_len", lim.max_seq_len)?)
            .i32(i("num_slots", lim.num_slots)?)
            .ptr(lim.slot_len)
            .ptr(out.claim)
            .ptr(out.record)
            .ptr(out.verdict)
            .ptr(out.tokens)
            .ptr(out.positions)
            .ptr(out.seq_slots)
            .ptr(out.query_start)
            .ptr(out.seq_of)
            .ptr(out.rows);
        // SAFETY: matches `batch_check_kernel` of kernels/batch.cu in order and type; the
        // engine's buffers were size-checked above; the host's arrays hold the counts it
        // stated (DESIGN.md §3), and the kernel reads them only below those counts.
        unsafe { launch(&self.check, 1, CHECK_THREADS, 0, stream, &a) }
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
        let mut a = KernelArgs::new();
        a.ptr(b.verdict)
            .ptr(b.rows)
            .ptr(b.seq_of)
            .ptr(b.seq_slots)
            .i32(to_i32(FAMILY, "rows", rows)?)
            .i32(to_i32(FAMILY, "vocab", vocab)?)
            .i32(bf16 as i32)
            .ptr(logits);
        // SAFETY: matches `logits_finish_kernel(const int*, const int*, const int*, const int*,
        // int, int, int, void*)`; sizes checked; `rows`, `seq_of` and `seq_slots` hold the
        // sanitized values batch_check_kernel wrote, all in range.
        unsafe { launch(&self.finish, rows as u32, FINISH_THREADS, 0, stream, &a) }
    }
}

#[cfg(test)]
mod tests {
    use crate::error::Status;
    use crate::model::batch::{Field, PAD_SLOT, Rule};

    /// The numeric codes batch.cu defines by hand equal the Rust ones.
    #[test]
    fn codes_match_the_kernel_source() {
        let src = super::SOURCE.source;
        let define = |name: &str| -> i32 {
            let line = src
                .lines()
                .find(|l| l.starts_with(&format!("#define {name} ")))
                .unwrap_or_else(|| panic!("batch.cu defines no {name}"));
            let v = line.split_whitespace().nth(2).unwrap();
            v.trim_matches(|c| c == '(' || c == ')').parse().unwrap()
        };
        assert_eq!(define("DSV4_PAD_SLOT"), PAD_SLOT);
        assert_eq!(
            define("BATCH_STATUS_INVALID_ARGUMENT"),
            Status::InvalidArgument as i32
        );
        assert_eq!(define("BATCH_STATUS_CAPACITY"), Status::Capacity as i32);
        for (n, f) in [
            ("TOKEN_IDS", Field::TokenIds),
            ("POSITIONS", Field::Positions),
            ("SEQ_SLOTS", Field::SeqSlots),
            ("QUERY_START", Field::QueryStart),
            ("LOGITS_ROWS", Field::LogitsRows),
        ] {
            assert_eq!(define(&format!("BATCH_FIELD_{n}")), f as i32, "{n}");
        }
        for (n, r) in [
            ("RANGE", Rule::Range),
            ("DUPLICATE", Rule::Duplicate),
            ("NOT_INCREASING", Rule::NotIncreasing),
            ("ENDPOINT", Rule::Endpoint),
            ("NOT_CONSECUTIVE", Rule::NotConsecutive),
            ("NOT_CONTINUING", Rule::NotContinuing),
        ] {
            assert_eq!(define(&format!("BATCH_RULE_{n}")), r as i32, "{n}");
        }
        assert_eq!(
            define("BATCH_RECORD_INTS") as usize,
            crate::model::batch::FAULT_RECORD_INTS
        );
    }
}
