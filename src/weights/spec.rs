//! The table of every weight a model has: canonical (upstream DeepSeek) name, logical
//! shape and element kind, derived from the config alone.
//!
//! Canonical names are the upstream ones of MODEL.md §9 (`embed.weight`,
//! `layers.0.attn.wq_a.weight`, `layers.3.ffn.experts.7.w2.weight`, `hc_head_fn`). Shapes
//! are logical (unpacked, dequantized): FP4/FP8 storage and scale tensors are a loading
//! concern (see `load.rs`), not part of this table.

use crate::config::{AttnKind, ModelConfig};

/// Element kind of a weight as the engine holds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ElemKind {
    /// Real-valued weight (f32 in the CPU reference).
    Float,
    /// Integer table (hash-routing `tid2eid`, held as i32).
    Index,
}

/// How a weight is stored in the released checkpoint (what scale tensor may accompany it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoredAs {
    /// BF16/F32 in the release, no scale; held in f32.
    Plain,
    /// A BF16 matrix in the release, held in BF16 as stored (the embedding, the LM head, the
    /// compressors' and the indexer's projections): the official model computes with these exact values,
    /// and BF16 halves their bytes. A float source is rounded to BF16 when written.
    Bf16Matrix,
    /// FP8 e4m3 with a `.scale` of 128x128 blocks in the release.
    Fp8Block,
    /// Packed FP4 e2m1 (two per byte) with a `.scale` of 1x32 blocks in the release.
    Fp4Expert,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub kind: ElemKind,
    pub stored: StoredAs,
}

impl TensorSpec {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

fn float(name: String, shape: &[usize], stored: StoredAs) -> TensorSpec {
    TensorSpec {
        name,
        shape: shape.to_vec(),
        kind: ElemKind::Float,
        stored,
    }
}

/// Every weight of the model in a fixed order (globals, then layer by layer).
pub fn tensor_specs(cfg: &ModelConfig) -> Vec<TensorSpec> {
    use StoredAs::*;
    let d = cfg.hidden_size;
    let n = cfg.hc_mult;
    let hd = cfg.head_dim;
    let h = cfg.num_heads;
    let v = cfg.vocab_size;
    let mut s = vec![
        float("embed.weight".into(), &[v, d], Bf16Matrix),
        float("head.weight".into(), &[v, d], Bf16Matrix),
        float("norm.weight".into(), &[d], Plain),
        float("hc_head_fn".into(), &[n, n * d], Plain),
        float("hc_head_base".into(), &[n], Plain),
        float("hc_head_scale".into(), &[1], Plain),
    ];
    for (l, layer) in cfg.layers.iter().enumerate() {
        let p = |x: &str| format!("layers.{l}.{x}");
        s.push(float(p("attn_norm.weight"), &[d], Plain));
        s.push(float(p("ffn_norm.weight"), &[d], Plain));
        for site in ["attn", "ffn"] {
            s.push(float(
                p(&format!("hc_{site}_fn")),
                &[cfg.hc_mix_dim(), n * d],
                Plain,
            ));
            s.push(float(
                p(&format!("hc_{site}_base")),
                &[cfg.hc_mix_dim()],
                Plain,
            ));
            s.push(float(p(&format!("hc_{site}_scale")), &[3], Plain));
        }
        s.push(float(
            p("attn.wq_a.weight"),
            &[cfg.q_lora_rank, d],
            Fp8Block,
        ));
        s.push(float(p("attn.q_norm.weight"), &[cfg.q_lora_rank], Plain));
        s.push(float(
            p("attn.wq_b.weight"),
            &[h * hd, cfg.q_lora_rank],
            Fp8Block,
        ));
        s.push(float(p("attn.wkv.weight"), &[hd, d], Fp8Block));
        s.push(float(p("attn.kv_norm.weight"), &[hd], Plain));
        s.push(float(
            p("attn.wo_a.weight"),
            &[cfg.o_groups * cfg.o_lora_rank, h * hd / cfg.o_groups],
            Fp8Block,
        ));
        s.push(float(
            p("attn.wo_b.weight"),
            &[d, cfg.o_groups * cfg.o_lora_rank],
            Fp8Block,
        ));
        s.push(float(p("attn.attn_sink"), &[h], Plain));
        if layer.attn != AttnKind::Sliding {
            let c = if layer.attn == AttnKind::Csa { 2 } else { 1 };
            s.push(float(
                p("attn.compressor.wkv.weight"),
                &[c * hd, d],
                Bf16Matrix,
            ));
            s.push(float(
                p("attn.compressor.wgate.weight"),
                &[c * hd, d],
                Bf16Matrix,
            ));
            s.push(float(p("attn.compressor.norm.weight"), &[hd], Plain));
            s.push(float(
                p("attn.compressor.ape"),
                &[layer.ratio, c * hd],
                Plain,
            ));
        }
        if layer.attn == AttnKind::Csa {
            let (hi, di) = (cfg.index_n_heads, cfg.index_head_dim);
            s.push(float(
                p("attn.indexer.wq_b.weight"),
                &[hi * di, cfg.q_lora_rank],
                Fp8Block,
            ));
            s.push(float(
                p("attn.indexer.weights_proj.weight"),
                &[hi, d],
                Bf16Matrix,
            ));
            s.push(float(
                p("attn.indexer.compressor.wkv.weight"),
                &[2 * di, d],
                Bf16Matrix,
            ));
            s.push(float(
                p("attn.indexer.compressor.wgate.weight"),
                &[2 * di, d],
                Bf16Matrix,
            ));
            s.push(float(
                p("attn.indexer.compressor.norm.weight"),
                &[di],
                Plain,
            ));
            s.push(float(
                p("attn.indexer.compressor.ape"),
                &[layer.ratio, 2 * di],
                Plain,
            ));
        }
        s.push(float(
            p("ffn.gate.weight"),
            &[cfg.n_routed_experts, d],
            Plain,
        ));
        if layer.hash {
            s.push(TensorSpec {
                name: p("ffn.gate.tid2eid"),
                shape: vec![v, cfg.experts_per_tok],
                kind: ElemKind::Index,
                stored: Plain,
            });
        } else {
            s.push(float(p("ffn.gate.bias"), &[cfg.n_routed_experts], Plain));
        }
        let i = cfg.moe_inter;
        if cfg.n_shared_experts > 0 {
            s.push(float(p("ffn.shared_experts.w1.weight"), &[i, d], Fp8Block));
            s.push(float(p("ffn.shared_experts.w2.weight"), &[d, i], Fp8Block));
            s.push(float(p("ffn.shared_experts.w3.weight"), &[i, d], Fp8Block));
        }
        for e in 0..cfg.n_routed_experts {
            s.push(float(
                p(&format!("ffn.experts.{e}.w1.weight")),
                &[i, d],
                Fp4Expert,
            ));
            s.push(float(
                p(&format!("ffn.experts.{e}.w2.weight")),
                &[d, i],
                Fp4Expert,
            ));
            s.push(float(
                p(&format!("ffn.experts.{e}.w3.weight")),
                &[i, d],
                Fp4Expert,
            ));
        }
    }
    s
}
