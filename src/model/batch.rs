//! Host-side validation of a forward batch (DESIGN.md §3), shared by every backend.
//!
//! Turns the flat batch arrays into per-sequence ranges after checking every capacity
//! and consistency rule, so a backend never sees an out-of-range index.

use crate::config::ModelConfig;
use crate::engine::{Batch, EngineOptions};
use crate::error::{Error, Result, Status};

/// One sequence of the batch: tokens `[token_start, token_start + len)` at positions
/// `[first_pos, first_pos + len)` in slot `slot`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqRange {
    pub slot: usize,
    pub token_start: usize,
    pub len: usize,
    pub first_pos: usize,
}

fn invalid(msg: String) -> Error {
    Error::new(Status::InvalidArgument, msg)
}

/// Validates `batch` against capacities and the slots' current lengths (`slot_len[s]` =
/// next position expected in slot s). Returns the sequences in batch order.
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
    if batch.query_start[0] != 0 || batch.query_start[s] as i64 != t as i64 {
        return Err(invalid(format!(
            "batch.query_start must start at 0 and end at num_tokens = {t} (got {} .. {})",
            batch.query_start[0], batch.query_start[s]
        )));
    }
    for (i, &tok) in batch.token_ids.iter().enumerate() {
        if tok < 0 || tok as usize >= cfg.vocab_size {
            return Err(invalid(format!(
                "batch.token_ids[{i}] = {tok} is outside [0, vocab_size = {})",
                cfg.vocab_size
            )));
        }
    }
    let mut seen = vec![false; opts.max_num_seqs];
    let mut seqs = Vec::with_capacity(s);
    for q in 0..s {
        let slot = batch.seq_slots[q];
        if slot < 0 || slot as usize >= opts.max_num_seqs {
            return Err(invalid(format!(
                "batch.seq_slots[{q}] = {slot} is outside [0, max_num_seqs = {})",
                opts.max_num_seqs
            )));
        }
        let slot = slot as usize;
        if std::mem::replace(&mut seen[slot], true) {
            return Err(invalid(format!(
                "batch.seq_slots[{q}] = {slot} appears twice in one batch"
            )));
        }
        let (a, b) = (batch.query_start[q], batch.query_start[q + 1]);
        if b <= a {
            return Err(invalid(format!(
                "batch.query_start must be strictly increasing (sequence {q} has {a} .. {b})"
            )));
        }
        let (a, b) = (a as usize, b as usize);
        let first = batch.positions[a];
        for i in a..b {
            let p = batch.positions[i];
            if p < 0 || p as usize >= opts.max_seq_len {
                return Err(Error::new(
                    Status::Capacity,
                    format!(
                        "batch.positions[{i}] = {p} is outside [0, max_seq_len = {})",
                        opts.max_seq_len
                    ),
                ));
            }
            if p as i64 != first as i64 + (i - a) as i64 {
                return Err(invalid(format!(
                    "batch.positions[{i}] = {p}: positions of sequence {q} must be consecutive from {first}"
                )));
            }
        }
        let first = first as usize;
        if first != 0 && first != slot_len[slot] {
            return Err(invalid(format!(
                "sequence {q} starts at position {first} but slot {slot} holds {} tokens (continue at {} or restart at 0)",
                slot_len[slot], slot_len[slot]
            )));
        }
        seqs.push(SeqRange {
            slot,
            token_start: a,
            len: b - a,
            first_pos: first,
        });
    }
    let rows = match batch.logits_rows {
        Some(r) => {
            for (i, &row) in r.iter().enumerate() {
                if row < 0 || row as usize >= t {
                    return Err(invalid(format!(
                        "batch.logits_rows[{i}] = {row} is outside [0, num_tokens = {t})"
                    )));
                }
            }
            r.len()
        }
        None => t,
    };
    if batch.logits.len() != rows * cfg.vocab_size {
        return Err(invalid(format!(
            "logits buffer holds {} values, expected num_logits x vocab_size = {rows} x {}",
            batch.logits.len(),
            cfg.vocab_size
        )));
    }
    Ok(seqs)
}
