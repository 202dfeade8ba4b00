//! Backend-neutral description of the forward: which weights each layer uses (resolved
//! once to indices into the [`WeightTable`]) and the RoPE frequency tables.

pub mod batch;
pub mod hc_fold;
pub mod rope;

use crate::config::{AttnKind, LayerSpec, ModelConfig};
use crate::error::Result;
use crate::weights::table::WeightTable;

/// One mHC site: mixing projection, bias and the 3 (or 1, for the head) scales.
#[derive(Clone, Copy, Debug)]
pub struct HcSite {
    pub proj: usize,
    pub base: usize,
    pub scale: usize,
}

/// A compressor's weights (main: d_c = head_dim; indexer: d_c = index_head_dim).
#[derive(Clone, Copy, Debug)]
pub struct CompressorWeights {
    pub wkv: usize,
    pub wgate: usize,
    pub norm: usize,
    pub ape: usize,
}

#[derive(Clone, Copy, Debug)]
pub struct IndexerWeights {
    pub wq_b: usize,
    pub weights_proj: usize,
    pub compressor: CompressorWeights,
}

/// Gate (w1), down (w2), up (w3) projections of one expert.
#[derive(Clone, Copy, Debug)]
pub struct ExpertWeights {
    pub w1: usize,
    pub w2: usize,
    pub w3: usize,
}

#[derive(Clone, Debug)]
pub struct LayerWeights {
    pub spec: LayerSpec,
    pub attn_norm: usize,
    pub ffn_norm: usize,
    pub hc_attn: HcSite,
    pub hc_ffn: HcSite,
    pub wq_a: usize,
    pub q_norm: usize,
    pub wq_b: usize,
    pub wkv: usize,
    pub kv_norm: usize,
    pub wo_a: usize,
    pub wo_b: usize,
    pub sink: usize,
    pub compressor: Option<CompressorWeights>,
    pub indexer: Option<IndexerWeights>,
    pub gate: usize,
    pub gate_bias: Option<usize>,
    pub tid2eid: Option<usize>,
    pub shared: Option<ExpertWeights>,
    pub experts: Vec<ExpertWeights>,
}

#[derive(Clone, Debug)]
pub struct ModelWeights {
    pub embed: usize,
    pub head: usize,
    pub norm: usize,
    pub hc_head: HcSite,
    pub layers: Vec<LayerWeights>,
}

impl ModelWeights {
    /// Resolves every weight the forward reads to its index in `store`.
    pub fn resolve(cfg: &ModelConfig, store: &WeightTable) -> Result<Self> {
        let r = |n: &str| store.require(n);
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for (l, spec) in cfg.layers.iter().enumerate() {
            let p = |x: &str| format!("layers.{l}.{x}");
            let site = |s: &str| -> Result<HcSite> {
                Ok(HcSite {
                    proj: r(&p(&format!("hc_{s}_fn")))?,
                    base: r(&p(&format!("hc_{s}_base")))?,
                    scale: r(&p(&format!("hc_{s}_scale")))?,
                })
            };
            let comp = |prefix: &str| -> Result<CompressorWeights> {
                Ok(CompressorWeights {
                    wkv: r(&p(&format!("{prefix}.wkv.weight")))?,
                    wgate: r(&p(&format!("{prefix}.wgate.weight")))?,
                    norm: r(&p(&format!("{prefix}.norm.weight")))?,
                    ape: r(&p(&format!("{prefix}.ape")))?,
                })
            };
            let expert = |prefix: &str| -> Result<ExpertWeights> {
                Ok(ExpertWeights {
                    w1: r(&p(&format!("{prefix}.w1.weight")))?,
                    w2: r(&p(&format!("{prefix}.w2.weight")))?,
                    w3: r(&p(&format!("{prefix}.w3.weight")))?,
                })
            };
            layers.push(LayerWeights {
                spec: *spec,
                attn_norm: r(&p("attn_norm.weight"))?,
                ffn_norm: r(&p("ffn_norm.weight"))?,
                hc_attn: site("attn")?,
                hc_ffn: site("ffn")?,
                wq_a: r(&p("attn.wq_a.weight"))?,
                q_norm: r(&p("attn.q_norm.weight"))?,
                wq_b: r(&p("attn.wq_b.weight"))?,
                wkv: r(&p("attn.wkv.weight"))?,
                kv_norm: r(&p("attn.kv_norm.weight"))?,
                wo_a: r(&p("attn.wo_a.weight"))?,
                wo_b: r(&p("attn.wo_b.weight"))?,
                sink: r(&p("attn.attn_sink"))?,
                compressor: match spec.attn {
                    AttnKind::Sliding => None,
                    _ => Some(comp("attn.compressor")?),
                },
                indexer: match spec.attn {
                    AttnKind::Csa => Some(IndexerWeights {
                        wq_b: r(&p("attn.indexer.wq_b.weight"))?,
                        weights_proj: r(&p("attn.indexer.weights_proj.weight"))?,
                        compressor: comp("attn.indexer.compressor")?,
                    }),
                    _ => None,
                },
                gate: r(&p("ffn.gate.weight"))?,
                gate_bias: if spec.hash {
                    None
                } else {
                    Some(r(&p("ffn.gate.bias"))?)
                },
                tid2eid: if spec.hash {
                    Some(r(&p("ffn.gate.tid2eid"))?)
                } else {
                    None
                },
                shared: if cfg.n_shared_experts > 0 {
                    Some(expert("ffn.shared_experts")?)
                } else {
                    None
                },
                experts: (0..cfg.n_routed_experts)
                    .map(|e| expert(&format!("ffn.experts.{e}")))
                    .collect::<Result<_>>()?,
            });
        }
        Ok(ModelWeights {
            embed: r("embed.weight")?,
            head: r("head.weight")?,
            norm: r("norm.weight")?,
            hc_head: HcSite {
                proj: r("hc_head_fn")?,
                base: r("hc_head_base")?,
                scale: r("hc_head_scale")?,
            },
            layers,
        })
    }
}
