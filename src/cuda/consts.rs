//! Constants the kernels share with Rust, defined once (here or in the Rust module named
//! beside each) and generated into the NVRTC header `dsv4_consts.cuh`, which common.cuh
//! includes. No .cu/.cuh file may `#define` one of these names by hand (a test checks it),
//! so a value changed in Rust changes the kernels too (and, through the header text, the
//! CUBIN cache key).

use super::kernels::{
    attention, batch, compressor, fast_attention, fast_dense, fast_fp8_gemm, fast_indexer,
    fast_moe, fast_moe_gemm, fast_moe_wide, indexer, linear, mhc, moe, norm_rope,
};
use super::kv_pages;
use super::smoke;
use crate::config::ScoringFunc;
use crate::error::Status;
use crate::model::batch::{FAULT_RECORD_INTS, Field, PAD_SLOT, Rule};
use crate::weights::qmatrix::FP4_BLOCK;
use crate::weights::quant::{E2M1_MAX, E4M3_MAX};
use linear::StorageFormat;
use std::sync::OnceLock;

/// The name kernels include: `#include "dsv4_consts.cuh"` (common.cuh does).
pub const HEADER_NAME: &str = "dsv4_consts.cuh";

/// A constant's value as the kernels see it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Value {
    /// An `int` literal (parenthesised when negative).
    Int(i64),
    /// A `float` literal (`448.0f`): the exact f32, printed round-trip.
    F32(f32),
}

/// One shared constant: its CUDA name, value, and where Rust defines it (for the header's
/// comment and for readers grepping either side).
pub struct Shared {
    pub name: &'static str,
    pub value: Value,
    pub rust: &'static str,
}

macro_rules! shared {
    ($($name:literal = $kind:ident($v:expr) from $rust:literal;)*) => {
        &[$(Shared { name: $name, value: Value::$kind($v), rust: $rust },)*]
    };
}

/// Every shared constant, grouped by the kernel files that use them.
pub const SHARED: &[Shared] = shared! {
    // common.cuh: number formats.
    "DSV4_E4M3_MAX" = F32(E4M3_MAX) from "weights::quant::E4M3_MAX";
    "DSV4_E2M1_MAX" = F32(E2M1_MAX) from "weights::quant::E2M1_MAX";
    // gemm_core.cuh, linear.cu, moe.cu: weight formats and GEMM tiling.
    "WFMT_F32" = Int(StorageFormat::F32 as i64) from "linear::StorageFormat::F32";
    "WFMT_BF16" = Int(StorageFormat::Bf16 as i64) from "linear::StorageFormat::Bf16";
    "WFMT_FP8" = Int(StorageFormat::Fp8 as i64) from "linear::StorageFormat::Fp8";
    "WFMT_FP4" = Int(StorageFormat::Fp4 as i64) from "linear::StorageFormat::Fp4";
    "FP4_SCALE_BLOCK" = Int(FP4_BLOCK as i64) from "weights::qmatrix::FP4_BLOCK";
    "GEMM_THREADS" = Int(linear::LINEAR_THREADS as i64) from "linear::LINEAR_THREADS";
    "GT_BM" = Int(linear::TILE_T as i64) from "linear::TILE_T";
    "GS_MAXR" = Int(linear::SKINNY_T as i64) from "linear::SKINNY_T";
    "GS_BN" = Int(linear::SKINNY_N as i64) from "linear::SKINNY_N";
    "LIN_SKINNY_MAX_T" = Int(linear::SKINNY_MAX_T as i64) from "linear::SKINNY_MAX_T";
    "LIN_BN" = Int(linear::TILE_N as i64) from "linear::TILE_N";
    "ACT_BLOCK" = Int(linear::ACT_BLOCK as i64) from "linear::ACT_BLOCK";
    // moe.cu.
    "SCORE_SQRTSOFTPLUS" = Int(moe::scoring_code(ScoringFunc::SqrtSoftplus) as i64)
        from "moe::scoring_code";
    "SCORE_SOFTMAX" = Int(moe::scoring_code(ScoringFunc::Softmax) as i64) from "moe::scoring_code";
    "SCORE_SIGMOID" = Int(moe::scoring_code(ScoringFunc::Sigmoid) as i64) from "moe::scoring_code";
    "ROUTER_MAX_K" = Int(moe::MAX_TOPK as i64) from "moe::MAX_TOPK";
    "ROUTER_TOKENS" = Int(moe::ROUTER_TOKENS as i64) from "moe::ROUTER_TOKENS";
    "PLAN_THREADS" = Int(moe::PLAN_THREADS as i64) from "moe::PLAN_THREADS";
    "PLAN_WARPS" = Int(moe::PLAN_WARPS as i64) from "moe::PLAN_WARPS";
    "PLAN_CHUNK" = Int(moe::PLAN_CHUNK as i64) from "moe::PLAN_CHUNK";
    "PLAN_WIDE_MAX_EXPERTS" = Int(moe::PLAN_WIDE_MAX_EXPERTS as i64) from "moe::PLAN_WIDE_MAX_EXPERTS";
    "MOE_UP_BNS" = Int(moe::UP_GRID_N as i64) from "moe::UP_GRID_N";
    "MOE_DOWN_BNS" = Int(moe::DOWN_GRID_N as i64) from "moe::DOWN_GRID_N";
    // fast_moe.cu, fast_moe_gemm.cu.
    "FMOE_LOGIT_WARPS" = Int(fast_moe::LOGIT_WARPS as i64) from "fast_moe::LOGIT_WARPS";
    "FMOE_LOGIT_EXPERTS" = Int(fast_moe::LOGIT_EXPERTS as i64) from "fast_moe::LOGIT_EXPERTS";
    "FMOE_LOGIT_SPLIT" = Int(fast_moe::LOGIT_SPLIT as i64) from "fast_moe::LOGIT_SPLIT";
    "FMOE_LOGIT_TOKENS" = Int(fast_moe::LOGIT_TOKENS as i64) from "fast_moe::LOGIT_TOKENS";
    "FMOE_LOGIT_GROUP" = Int(fast_moe::LOGIT_GROUP as i64) from "fast_moe::LOGIT_GROUP";
    "FMOE_TC_TOKENS" = Int(fast_moe::TC_TOKENS as i64) from "fast_moe::TC_TOKENS";
    "FMOE_TC_WG_EXPERTS" = Int(fast_moe::TC_WG_EXPERTS as i64) from "fast_moe::TC_WG_EXPERTS";
    "FMOE_TC_SLOTS" = Int(fast_moe::TC_SLOTS as i64) from "fast_moe::TC_SLOTS";
    "FMOE_TC_PRODUCERS" = Int(fast_moe::TC_PRODUCERS as i64) from "fast_moe::TC_PRODUCERS";
    "FMOE_TC_MAX_STAGES" = Int(fast_moe::TC_MAX_STAGES as i64) from "fast_moe::TC_MAX_STAGES";
    "FMOE_GATE_TILE" = Int(fast_moe::GATE_TILE as i64) from "fast_moe::GATE_TILE";
    "FMOE_TC_SMEM_BYTES" = Int(fast_moe::TC_SMEM_BYTES as i64) from "fast_moe::TC_SMEM_BYTES";
    "FMOE_SELECT_WARPS" = Int(fast_moe::SELECT_WARPS as i64) from "fast_moe::SELECT_WARPS";
    "FMOE_MAX_EPL" = Int(fast_moe::MAX_EPL as i64) from "fast_moe::MAX_EPL";
    "FMOE_TOKENS" = Int(fast_moe_gemm::TOKENS as i64) from "fast_moe_gemm::TOKENS";
    "FMOE_WARPGROUPS" = Int(fast_moe_gemm::WARPGROUPS as i64) from "fast_moe_gemm::WARPGROUPS";
    "FMOE_STAGES" = Int(fast_moe_gemm::STAGES as i64) from "fast_moe_gemm::STAGES";
    "FMOE_SMEM_BYTES" = Int(fast_moe_gemm::SMEM_BYTES as i64) from "fast_moe_gemm::SMEM_BYTES";
    "FMOE_UP_J" = Int(fast_moe_gemm::UP_J as i64) from "fast_moe_gemm::UP_J";
    "FMOE_DOWN_ROWS" = Int(fast_moe_gemm::DOWN_ROWS as i64) from "fast_moe_gemm::DOWN_ROWS";
    "FMOE_MAP_BYTES" = Int(fast_moe_gemm::MAP_BYTES as i64) from "fast_moe_gemm::MAP_BYTES";
    "FMOE_MAPS_PER_EXPERT" = Int(fast_moe_gemm::MAPS_PER_EXPERT as i64)
        from "fast_moe_gemm::MAPS_PER_EXPERT";
    "FMOE_MAP_W1" = Int(fast_moe_gemm::Map::W1 as i64) from "fast_moe_gemm::Map::W1";
    "FMOE_MAP_W3" = Int(fast_moe_gemm::Map::W3 as i64) from "fast_moe_gemm::Map::W3";
    "FMOE_MAP_W2" = Int(fast_moe_gemm::Map::W2 as i64) from "fast_moe_gemm::Map::W2";
    "FMOE_MAP_S1" = Int(fast_moe_gemm::Map::S1 as i64) from "fast_moe_gemm::Map::S1";
    "FMOE_MAP_S3" = Int(fast_moe_gemm::Map::S3 as i64) from "fast_moe_gemm::Map::S3";
    "FMOE_MAP_S2" = Int(fast_moe_gemm::Map::S2 as i64) from "fast_moe_gemm::Map::S2";
    // fast_fp8_gemm.cu.
    "FFG_STAGES_M128_N128" = Int(fast_fp8_gemm::TileShape::M128N128.stages() as i64) from "fast_fp8_gemm::TileShape::stages";
    "FFG_STAGES_M128_N256" = Int(fast_fp8_gemm::TileShape::M128N256.stages() as i64) from "fast_fp8_gemm::TileShape::stages";
    "FFG_STAGES_M192_N128" = Int(fast_fp8_gemm::TileShape::M192N128.stages() as i64) from "fast_fp8_gemm::TileShape::stages";
    "FFG_SMEM_BYTES" = Int(fast_fp8_gemm::SMEM_BYTES as i64) from "fast_fp8_gemm::SMEM_BYTES";
    "FFG_OUT_F32" = Int(fast_fp8_gemm::OutMode::F32 as i64) from "fast_fp8_gemm::OutMode::F32";
    "FFG_OUT_F32_ROUNDED" = Int(fast_fp8_gemm::OutMode::F32Rounded as i64) from "fast_fp8_gemm::OutMode::F32Rounded";
    "FFG_OUT_BF16" = Int(fast_fp8_gemm::OutMode::Bf16 as i64) from "fast_fp8_gemm::OutMode::Bf16";
    // fast_moe_wide.cu.
    "FMW_TOKENS" = Int(fast_moe_wide::TOKENS as i64) from "fast_moe_wide::TOKENS";
    "FMW_STAGES" = Int(fast_moe_wide::STAGES as i64) from "fast_moe_wide::STAGES";
    "FMW_SMEM_BYTES" = Int(fast_moe_wide::SMEM_BYTES as i64) from "fast_moe_wide::SMEM_BYTES";
    "FMW_NARROW_TOKENS" = Int(fast_moe_wide::NARROW_TOKENS as i64) from "fast_moe_wide::NARROW_TOKENS";
    "FMW_NARROW_STAGES" = Int(fast_moe_wide::NARROW_STAGES as i64) from "fast_moe_wide::NARROW_STAGES";
    "FMW_NARROW_SMEM_BYTES" = Int(fast_moe_wide::NARROW_SMEM_BYTES as i64) from "fast_moe_wide::NARROW_SMEM_BYTES";
    "FMW_HBOX" = Int(fast_moe_wide::ACT_BOX_ROWS as i64) from "fast_moe_wide::ACT_BOX_ROWS";
    // fast_dense.cu.
    "FD_WARPS" = Int(fast_dense::WARPS as i64) from "fast_dense::WARPS";
    "FD_LT_ITEMS" = Int(fast_dense::LT_ITEMS as i64) from "fast_dense::LT_ITEMS";
    "FD_TOKENS" = Int(fast_dense::TOKENS as i64) from "fast_dense::TOKENS";
    "FD_MAX_SLICES" = Int(fast_dense::MAX_SLICES as i64) from "fast_dense::MAX_SLICES";
    "FD_MAX_SLICE" = Int(fast_dense::MAX_SLICE as i64) from "fast_dense::MAX_SLICE";
    "FD_GROUP_MAX" = Int(fast_dense::GROUP_MAX as i64) from "fast_dense::GROUP_MAX";
    "FD_ACT_QUANT" = Int(fast_dense::ActMode::Quant as i64) from "fast_dense::ActMode::Quant";
    "FD_ACT_F16" = Int(fast_dense::ActMode::F16 as i64) from "fast_dense::ActMode::F16";
    "FD_ACT_BF16" = Int(fast_dense::ActMode::Bf16 as i64) from "fast_dense::ActMode::Bf16";
    // fast_attention.cu.
    "FA_THREADS" = Int(fast_attention::THREADS as i64) from "fast_attention::THREADS";
    "FA_TILE_KEYS" = Int(fast_attention::TILE_KEYS as i64) from "fast_attention::TILE_KEYS";
    "FA_MAX_HEADS" = Int(fast_attention::MAX_HEADS as i64) from "fast_attention::MAX_HEADS";
    "FA_MAX_HD" = Int(fast_attention::MAX_HD as i64) from "fast_attention::MAX_HD";
    "FA_MAX_SPLITS" = Int(fast_attention::MAX_SPLITS as i64) from "fast_attention::MAX_SPLITS";
    "FA_CLUSTER_MAX_SPLITS" = Int(fast_attention::CLUSTER_MAX_SPLITS as i64) from "fast_attention::CLUSTER_MAX_SPLITS";
    "FA_WS_KBUF" = Int(fast_attention::WS_K_TILES as i64) from "fast_attention::WS_K_TILES";
    "FA_WS_RAW" = Int(fast_attention::WS_RAW_TILES as i64) from "fast_attention::WS_RAW_TILES";
    "FA_WS_ADDR" = Int(fast_attention::WS_ADDR_SLOTS as i64) from "fast_attention::WS_ADDR_SLOTS";
    "FA_WS_CONSUMER_REGS" = Int(fast_attention::WS_CONSUMER_REGS as i64) from "fast_attention::WS_CONSUMER_REGS";
    "FA_WS_PRODUCER_REGS" = Int(fast_attention::WS_PRODUCER_REGS as i64) from "fast_attention::WS_PRODUCER_REGS";
    // fast_indexer.cu.
    "FI_THREADS" = Int(fast_indexer::THREADS as i64) from "fast_indexer::THREADS";
    "FI_TILE_KEYS" = Int(fast_indexer::TILE_KEYS as i64) from "fast_indexer::TILE_KEYS";
    "FI_CHUNK_KEYS" = Int(fast_indexer::CHUNK_KEYS as i64) from "fast_indexer::CHUNK_KEYS";
    "FI_MAX_HEADS" = Int(fast_indexer::MAX_HEADS as i64) from "fast_indexer::MAX_HEADS";
    "FI_MAX_DIM" = Int(fast_indexer::MAX_DIM as i64) from "fast_indexer::MAX_DIM";
    "FI_TOPK_THREADS" = Int(fast_indexer::TOPK_THREADS as i64) from "fast_indexer::TOPK_THREADS";
    "FI_TOPK_CLUSTER" = Int(fast_indexer::TOPK_CLUSTER as i64) from "fast_indexer::TOPK_CLUSTER";
    "FI_FOLD_DIM" = Int(fast_indexer::FOLD_DIM as i64) from "fast_indexer::FOLD_DIM";
    "FI_STREAM_WGS" = Int(fast_indexer::STREAM_WGS as i64) from "fast_indexer::STREAM_WGS";
    "FI_STREAM_SLOTS" = Int(fast_indexer::STREAM_SLOTS as i64) from "fast_indexer::STREAM_SLOTS";
    "FI_STREAM_THREADS" = Int(fast_indexer::STREAM_THREADS as i64) from "fast_indexer::STREAM_THREADS";
    "FI_STREAM_SMEM" = Int(fast_indexer::STREAM_SMEM as i64) from "fast_indexer::STREAM_SMEM";
    "FI_FUSED_MAX_CLUSTER" = Int(fast_indexer::FUSED_MAX_CLUSTER as i64) from "fast_indexer::FUSED_MAX_CLUSTER";
    // attention.cu, compressor.cu, indexer.cu, mhc.cu.
    "ATTN_MAX_CPT" = Int(attention::ATTN_MAX_CHANNELS_PER_THREAD as i64)
        from "attention::ATTN_MAX_CHANNELS_PER_THREAD";
    "COMP_THREADS" = Int(compressor::THREADS as i64) from "compressor::THREADS";
    "IDX_TILE" = Int(indexer::TILE as i64) from "indexer::TILE";
    "HC_MAX_N" = Int(mhc::MAX_STREAMS as i64) from "mhc::MAX_STREAMS";
    // kv_pages.cuh: the KV state's rows and pages.
    "KV_PAGE" = Int(kv_pages::KV_PAGE as i64) from "kv_pages::KV_PAGE";
    "KV_FP8_BLOCK" = Int(kv_pages::KV_FP8_BLOCK as i64) from "kv_pages::KV_FP8_BLOCK";
    "KV_FP4_BLOCK" = Int(kv_pages::KV_FP4_BLOCK as i64) from "kv_pages::KV_FP4_BLOCK";
    "KV_ROW_ALIGN" = Int(kv_pages::KV_ROW_ALIGN as i64) from "kv_pages::KV_ROW_ALIGN";
    "KV_SCALE_ALIGN" = Int(kv_pages::KV_SCALE_ALIGN as i64) from "kv_pages::KV_SCALE_ALIGN";
    // norm_rope.cu.
    "HADAMARD_MAX" = Int(norm_rope::HADAMARD_MAX as i64) from "norm_rope::HADAMARD_MAX";
    "HP_MAX_PAIRS" = Int(norm_rope::HEAD_PREP_MAX_PAIRS as i64) from "norm_rope::HEAD_PREP_MAX_PAIRS";
    "RN_VALS" = Int(norm_rope::RMSNORM_VALUES as i64) from "norm_rope::RMSNORM_VALUES";
    "RN_ROWS_VALS" = Int(norm_rope::RMSNORM_ROWS_VALUES as i64) from "norm_rope::RMSNORM_ROWS_VALUES";
    "RN_ROWS_THREADS" = Int(norm_rope::RMSNORM_ROWS_THREADS as i64) from "norm_rope::RMSNORM_ROWS_THREADS";
    "ROPE_HEADS" = Int(norm_rope::ROPE_HEADS as i64) from "norm_rope::ROPE_HEADS";
    "HP_ROWS_WARPS" = Int(norm_rope::HEAD_PREP_ROWS_WARPS as i64) from "norm_rope::HEAD_PREP_ROWS_WARPS";
    "HP_ROWS_LANE_PAIRS" = Int(norm_rope::HEAD_PREP_ROWS_LANE_PAIRS as i64) from "norm_rope::HEAD_PREP_ROWS_LANE_PAIRS";
    "ROPE_ROWS_MAX_PAIRS" = Int(norm_rope::ROPE_ROWS_MAX_PAIRS as i64) from "norm_rope::ROPE_ROWS_MAX_PAIRS";
    // batch.cu: the codes of the fault record (model::batch, error::Status).
    "BATCH_CHECK_THREADS" = Int(batch::CHECK_THREADS as i64) from "batch::CHECK_THREADS";
    "DSV4_PAD_SLOT" = Int(PAD_SLOT as i64) from "model::batch::PAD_SLOT";
    "BATCH_STATUS_INVALID_ARGUMENT" = Int(Status::InvalidArgument as i64)
        from "error::Status::InvalidArgument";
    "BATCH_STATUS_CAPACITY" = Int(Status::Capacity as i64) from "error::Status::Capacity";
    "BATCH_FIELD_TOKEN_IDS" = Int(Field::TokenIds as i64) from "model::batch::Field";
    "BATCH_FIELD_POSITIONS" = Int(Field::Positions as i64) from "model::batch::Field";
    "BATCH_FIELD_SEQ_SLOTS" = Int(Field::SeqSlots as i64) from "model::batch::Field";
    "BATCH_FIELD_QUERY_START" = Int(Field::QueryStart as i64) from "model::batch::Field";
    "BATCH_FIELD_LOGITS_ROWS" = Int(Field::LogitsRows as i64) from "model::batch::Field";
    "BATCH_RULE_RANGE" = Int(Rule::Range as i64) from "model::batch::Rule";
    "BATCH_RULE_DUPLICATE" = Int(Rule::Duplicate as i64) from "model::batch::Rule";
    "BATCH_RULE_NOT_INCREASING" = Int(Rule::NotIncreasing as i64) from "model::batch::Rule";
    "BATCH_RULE_ENDPOINT" = Int(Rule::Endpoint as i64) from "model::batch::Rule";
    "BATCH_RULE_NOT_CONSECUTIVE" = Int(Rule::NotConsecutive as i64) from "model::batch::Rule";
    "BATCH_RULE_NOT_CONTINUING" = Int(Rule::NotContinuing as i64) from "model::batch::Rule";
    "BATCH_RECORD_INTS" = Int(FAULT_RECORD_INTS as i64) from "model::batch::FAULT_RECORD_INTS";
    // smoke.cu.
    "SMOKE_COLS" = Int(smoke::ROUNDTRIP_COLS as i64) from "smoke::ROUNDTRIP_COLS";
};

/// The text of `dsv4_consts.cuh`.
pub fn header() -> &'static str {
    static TEXT: OnceLock<String> = OnceLock::new();
    TEXT.get_or_init(|| {
        let mut s = String::from(
            "// dsv4_consts.cuh — GENERATED from Rust (src/cuda/consts.rs) by the registry: the\n\
             // constants kernels share with their Rust wrappers. Not a file on disk; edit the Rust.\n\
             #pragma once\n",
        );
        for c in SHARED {
            let v = match c.value {
                Value::Int(v) if v < 0 => format!("({v})"),
                Value::Int(v) => v.to_string(),
                Value::F32(v) => format!("{v:?}f"),
            };
            s.push_str(&format!("#define {} {v}  // {}\n", c.name, c.rust));
        }
        s
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::registry::{families, headers};

    #[test]
    fn header_defines_each_constant_once_as_a_c_literal() {
        let h = header();
        assert!(h.contains("#define DSV4_PAD_SLOT (-1)  // model::batch::PAD_SLOT\n"));
        assert!(h.contains("#define DSV4_E4M3_MAX 448.0f  //"));
        assert!(h.contains("#define WFMT_FP4 3  //"));
        let mut names = std::collections::HashSet::new();
        for c in SHARED {
            assert!(names.insert(c.name), "{} twice", c.name);
        }
    }

    /// Every shared constant is used by some kernel, and none is still defined by hand.
    #[test]
    fn kernels_use_the_generated_constants_and_define_none() {
        let mut texts: Vec<(String, &str)> = families()
            .iter()
            .map(|f| (format!("{}.cu", f.family), f.source))
            .collect();
        texts.extend(
            headers()
                .iter()
                .filter(|(n, _)| *n != HEADER_NAME)
                .map(|(n, s)| (n.to_string(), *s)),
        );
        for c in SHARED {
            let define = format!("#define {} ", c.name);
            for (file, text) in &texts {
                assert!(
                    !text.lines().any(|l| l.trim_start().starts_with(&define)),
                    "{file} defines {} by hand; it comes from {HEADER_NAME}",
                    c.name
                );
            }
            assert!(
                texts.iter().any(|(_, t)| t.contains(c.name)),
                "no kernel uses {}",
                c.name
            );
        }
    }
}
