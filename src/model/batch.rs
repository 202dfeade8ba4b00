//! Validation of a forward batch (DESIGN.md §3), shared by every backend: the rules, the
//! fault they report and its message.
//!
//! The CPU backend checks a batch here on the host and turns it into per-sequence ranges, so it
//! never sees an out-of-range index. The CUDA backend cannot read device arrays without a sync:
//! kernels/batch.cu applies the same rules on the device, in the same order, and records the
//! first fault as a [`BatchFault`] record; [`BatchFault::message`] words both the same way.

use crate::backend::Batch;
use crate::config::ModelConfig;
use crate::error::{Error, Result, Status};
use crate::options::EngineOptions;

/// `seq_slots` value of a padding sequence (DSV4_PAD_SLOT): it reads and writes no state, its
/// tokens' logits rows are zeros, and its positions may hold any values.
pub const PAD_SLOT: i32 = -1;

/// One sequence of the batch: tokens `[token_start, token_start + len)` at positions
/// `[first_pos, first_pos + len)` in slot `slot`. A padding sequence has `pad` set, `slot` =
/// `usize::MAX` and `first_pos` = 0 (its positions are not used).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqRange {
    pub slot: usize,
    pub token_start: usize,
    pub len: usize,
    pub first_pos: usize,
    pub pad: bool,
}

/// The batch array a fault is in (DSV4_FIELD_*; kernels/batch.cu BATCH_FIELD_*).
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Field {
    TokenIds = 1,
    Positions = 2,
    SeqSlots = 3,
    QueryStart = 4,
    LogitsRows = 5,
}

impl Field {
    pub fn name(self) -> &'static str {
        match self {
            Field::TokenIds => "token_ids",
            Field::Positions => "positions",
            Field::SeqSlots => "seq_slots",
            Field::QueryStart => "query_start",
            Field::LogitsRows => "logits_rows",
        }
    }

    fn from_code(v: i32) -> Option<Field> {
        [
            Field::TokenIds,
            Field::Positions,
            Field::SeqSlots,
            Field::QueryStart,
            Field::LogitsRows,
        ]
        .into_iter()
        .find(|f| *f as i32 == v)
    }
}

/// The rule a fault breaks (DSV4_RULE_*; kernels/batch.cu BATCH_RULE_*). `expected` of the
/// fault is the rule's bound or expected value.
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rule {
    /// The value is outside [0, expected).
    Range = 1,
    /// The slot is already used by sequence `expected` of this batch.
    Duplicate = 2,
    /// `query_start[index]` is not above `query_start[index - 1]` = expected.
    NotIncreasing = 3,
    /// `query_start[0]` must be 0 and `query_start[num_seqs]` must be num_tokens (= expected).
    Endpoint = 4,
    /// The position is not the previous one + 1 (= expected).
    NotConsecutive = 5,
    /// The first position is neither 0 nor the slot's length (= expected).
    NotContinuing = 6,
}

impl Rule {
    fn from_code(v: i32) -> Option<Rule> {
        [
            Rule::Range,
            Rule::Duplicate,
            Rule::NotIncreasing,
            Rule::Endpoint,
            Rule::NotConsecutive,
            Rule::NotContinuing,
        ]
        .into_iter()
        .find(|r| *r as i32 == v)
    }
}

/// Int32 words of the device error record (dsv4_device_error).
pub const FAULT_RECORD_INTS: usize = 8;

/// The first fault of a bad batch: what the CPU backend returns as its error and what the
/// CUDA backend's device record holds (`[status, field, index, value, rule, expected, seq,
/// slot]`; seq -1 when the fault belongs to no sequence).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchFault {
    pub status: Status,
    pub field: Field,
    pub rule: Rule,
    /// Index into the field's array.
    pub index: i64,
    /// The value found there.
    pub value: i64,
    /// The rule's bound or expected value (see [`Rule`]).
    pub expected: i64,
    /// The sequence (index into seq_slots) the fault belongs to, if any, and its slot value
    /// (DSV4_PAD_SLOT for padding).
    pub seq: Option<(usize, i32)>,
}

impl BatchFault {
    fn new(status: Status, field: Field, rule: Rule, index: usize, value: i64) -> BatchFault {
        BatchFault {
            status,
            field,
            rule,
            index: index as i64,
            value,
            expected: 0,
            seq: None,
        }
    }

    fn expect(mut self, expected: i64) -> BatchFault {
        self.expected = expected;
        self
    }

    fn in_seq(mut self, q: usize, slot: i32) -> BatchFault {
        self.seq = Some((q, slot));
        self
    }

    /// The message naming the field, index and value (the same on every backend).
    pub fn message(&self) -> String {
        let (i, v, x) = (self.index, self.value, self.expected);
        let seq = match self.seq {
            Some((q, PAD_SLOT)) => format!(" (sequence {q}, padding)"),
            Some((q, slot)) => format!(" (sequence {q}, slot {slot})"),
            None => String::new(),
        };
        let slot = self.seq.map_or(-1, |(_, slot)| slot);
        match (self.field, self.rule) {
            (Field::QueryStart, Rule::Endpoint) => format!(
                "batch.query_start[{i}] = {v}: query_start must start at 0 and end at num_tokens (expected {x})"
            ),
            (Field::QueryStart, Rule::NotIncreasing) => format!(
                "batch.query_start[{i}] = {v}: query_start must be strictly increasing (previous entry {x}){seq}"
            ),
            (Field::QueryStart, _) => format!(
                "batch.query_start[{i}] = {v} is past num_tokens = {}{seq}",
                x - 1
            ),
            (Field::SeqSlots, Rule::Duplicate) => {
                format!("batch.seq_slots[{i}] = {v} appears twice in one batch (also sequence {x})")
            }
            (Field::SeqSlots, _) => format!(
                "batch.seq_slots[{i}] = {v} is outside [0, max_num_seqs = {x}) and is not DSV4_PAD_SLOT (-1)"
            ),
            (Field::Positions, Rule::Range) => {
                format!("batch.positions[{i}] = {v} is outside [0, max_seq_len = {x}){seq}")
            }
            (Field::Positions, Rule::NotConsecutive) => format!(
                "batch.positions[{i}] = {v}: positions of a sequence must be consecutive (expected {x}){seq}"
            ),
            (Field::Positions, _) => format!(
                "batch.positions[{i}] = {v}: sequence {} starts at position {v} but slot {slot} holds {x} tokens (continue at {x} or restart at 0)",
                self.seq.map_or(0, |(q, _)| q)
            ),
            (Field::TokenIds, _) => {
                format!("batch.token_ids[{i}] = {v} is outside [0, vocab_size = {x})")
            }
            (Field::LogitsRows, _) => {
                format!("batch.logits_rows[{i}] = {v} is outside [0, num_tokens = {x})")
            }
        }
    }

    pub fn to_error(&self) -> Error {
        Error::new(self.status, self.message())
    }

    /// The device record of this fault.
    pub fn to_record(&self) -> [i32; FAULT_RECORD_INTS] {
        let c = |v: i64| v.clamp(i32::MIN as i64, i32::MAX as i64) as i32;
        [
            self.status as i32,
            self.field as i32,
            c(self.index),
            c(self.value),
            self.rule as i32,
            c(self.expected),
            self.seq.map_or(-1, |(q, _)| q as i32),
            self.seq.map_or(0, |(_, slot)| slot),
        ]
    }

    /// Reads a device record: None when it holds no fault (status 0). A record the kernel
    /// cannot have written is an INTERNAL error.
    pub fn from_record(r: &[i32; FAULT_RECORD_INTS]) -> Result<Option<BatchFault>> {
        if r[0] == 0 {
            return Ok(None);
        }
        let status = match r[0] {
            1 => Status::InvalidArgument,
            8 => Status::Capacity,
            _ => return Err(corrupt(r)),
        };
        let field = Field::from_code(r[1]).ok_or_else(|| corrupt(r))?;
        let rule = Rule::from_code(r[4]).ok_or_else(|| corrupt(r))?;
        Ok(Some(BatchFault {
            status,
            field,
            rule,
            index: r[2] as i64,
            value: r[3] as i64,
            expected: r[5] as i64,
            seq: usize::try_from(r[6]).ok().map(|q| (q, r[7])),
        }))
    }
}

fn corrupt(r: &[i32; FAULT_RECORD_INTS]) -> Error {
    Error::new(
        Status::Internal,
        format!("the device error record holds an unknown fault {r:?}"),
    )
}

fn invalid(msg: String) -> Error {
    Error::new(Status::InvalidArgument, msg)
}

/// Validates `batch` against capacities and the slots' current lengths (`slot_len[s]` =
/// next position expected in slot s). Returns the sequences in batch order, padding included.
pub fn plan(
    cfg: &ModelConfig,
    opts: &EngineOptions,
    slot_len: &[usize],
    batch: &Batch,
) -> Result<Vec<SeqRange>> {
    let t = batch.token_ids.len();
    if t == 0 {
        return Err(invalid("batch.num_tokens must be > 0".into()));
    }
    if t > opts.max_num_tokens {
        return Err(Error::new(
            Status::Capacity,
            format!(
                "batch.num_tokens = {t} exceeds max_num_tokens = {}",
                opts.max_num_tokens
            ),
        ));
    }
    if batch.positions.len() != t {
        return Err(invalid(format!(
            "batch.positions has {} entries, num_tokens = {t}",
            batch.positions.len()
        )));
    }
    let s = batch.seq_slots.len();
    if s == 0 || s > opts.max_num_seqs {
        return Err(Error::new(
            if s == 0 {
                Status::InvalidArgument
            } else {
                Status::Capacity
            },
            format!(
                "batch.num_seqs = {s} must be in [1, max_num_seqs = {}]",
                opts.max_num_seqs
            ),
        ));
    }
    if batch.query_start.len() != s + 1 {
        return Err(invalid(format!(
            "batch.query_start has {} entries, expected num_seqs + 1 = {}",
            batch.query_start.len(),
            s + 1
        )));
    }
    let rows = batch.logits_rows.map_or(t, |r| r.len());
    if batch.logits.len() != rows * cfg.vocab_size {
        return Err(invalid(format!(
            "logits buffer holds {} values, expected num_logits x vocab_size = {rows} x {}",
            batch.logits.len(),
            cfg.vocab_size
        )));
    }
    check_values(cfg, opts, slot_len, batch).map_err(|f| f.to_error())
}

/// The value rules, in the order kernels/batch.cu ranks faults: query_start's end points,
/// token ids, then per sequence its slot, duplicates, its query_start step, its positions
/// (range, then consecutive, per token) and the continuation of its slot; then logits_rows.
fn check_values(
    cfg: &ModelConfig,
    opts: &EngineOptions,
    slot_len: &[usize],
    batch: &Batch,
) -> std::result::Result<Vec<SeqRange>, BatchFault> {
    use {Field as F, Rule as R, Status as S};
    let t = batch.token_ids.len();
    let s = batch.seq_slots.len();
    let qs = batch.query_start;
    if qs[0] != 0 {
        return Err(BatchFault::new(
            S::InvalidArgument,
            F::QueryStart,
            R::Endpoint,
            0,
            qs[0] as i64,
        ));
    }
    if qs[s] as i64 != t as i64 {
        return Err(BatchFault::new(
            S::InvalidArgument,
            F::QueryStart,
            R::Endpoint,
            s,
            qs[s] as i64,
        )
        .expect(t as i64));
    }
    for (i, &tok) in batch.token_ids.iter().enumerate() {
        if tok < 0 || tok as usize >= cfg.vocab_size {
            return Err(
                BatchFault::new(S::InvalidArgument, F::TokenIds, R::Range, i, tok as i64)
                    .expect(cfg.vocab_size as i64),
            );
        }
    }
    let mut owner: Vec<Option<usize>> = vec![None; opts.max_num_seqs];
    let mut seqs = Vec::with_capacity(s);
    for q in 0..s {
        let slot = batch.seq_slots[q];
        let fault = |field, rule, index: usize, value: i32| {
            BatchFault::new(S::InvalidArgument, field, rule, index, value as i64).in_seq(q, slot)
        };
        let pad = slot == PAD_SLOT;
        if !pad {
            if slot < 0 || slot as usize >= opts.max_num_seqs {
                return Err(fault(F::SeqSlots, R::Range, q, slot).expect(opts.max_num_seqs as i64));
            }
            if let Some(prev) = owner[slot as usize].replace(q) {
                return Err(fault(F::SeqSlots, R::Duplicate, q, slot).expect(prev as i64));
            }
        }
        let (a, b) = (qs[q], qs[q + 1]);
        if b <= a {
            return Err(fault(F::QueryStart, R::NotIncreasing, q + 1, b).expect(a as i64));
        }
        if b as i64 > t as i64 {
            return Err(fault(F::QueryStart, R::Range, q + 1, b).expect(t as i64 + 1));
        }
        let (a, b) = (a as usize, b as usize);
        if pad {
            seqs.push(SeqRange {
                slot: usize::MAX,
                token_start: a,
                len: b - a,
                first_pos: 0,
                pad: true,
            });
            continue;
        }
        let first = batch.positions[a];
        for i in a..b {
            let p = batch.positions[i];
            if p < 0 || p as usize >= opts.max_seq_len {
                return Err(
                    BatchFault::new(S::Capacity, F::Positions, R::Range, i, p as i64)
                        .expect(opts.max_seq_len as i64)
                        .in_seq(q, slot),
                );
            }
            let want = first as i64 + (i - a) as i64;
            if p as i64 != want {
                return Err(fault(F::Positions, R::NotConsecutive, i, p).expect(want));
            }
        }
        let (slot, first) = (slot as usize, first as usize);
        if first != 0 && first != slot_len[slot] {
            return Err(fault(F::Positions, R::NotContinuing, a, first as i32)
                .expect(slot_len[slot] as i64));
        }
        seqs.push(SeqRange {
            slot,
            token_start: a,
            len: b - a,
            first_pos: first,
            pad: false,
        });
    }
    if let Some(r) = batch.logits_rows {
        for (i, &row) in r.iter().enumerate() {
            if row < 0 || row as usize >= t {
                return Err(BatchFault::new(
                    S::InvalidArgument,
                    F::LogitsRows,
                    R::Range,
                    i,
                    row as i64,
                )
                .expect(t as i64));
            }
        }
    }
    Ok(seqs)
}
