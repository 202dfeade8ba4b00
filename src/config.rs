//! `config.json` -> [`ModelConfig`].
//!
//! Accepts the names transformers writes (`num_hidden_layers`, `layer_types` +
//! `compress_rates`, `mlp_layer_types`, `rope_parameters`) and the upstream/legacy ones
//! (`compress_ratios`, `num_hash_layers`, `qk_rope_head_dim`, `rope_scaling`, and the
//! official `ModelArgs` names `dim`, `n_layers`, ...). Every validation error names the
//! field and the rule it breaks.

use serde_json::{Map, Value};

use crate::error::{Error, Result, Status};

/// Attention kind of one layer (MODEL.md §6.5).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnKind {
    /// Sliding window only (ratio 0).
    Sliding,
    /// Compressed sparse attention: ratio 4, overlapping compressor + lightning indexer.
    Csa,
    /// Heavily compressed attention: ratio r (128 in the release), no overlap, no indexer.
    Hca,
}

/// Router score function (`scoring_func`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScoringFunc {
    SqrtSoftplus,
    Softmax,
    Sigmoid,
}

/// YaRN parameters, applied to the rope of compressed layers only (MODEL.md §3.2).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Yarn {
    pub factor: f64,
    pub original_max_position: f64,
    pub beta_fast: f64,
    pub beta_slow: f64,
}

/// How the checkpoint stores quantized weights (`quantization_config`, `expert_dtype`).
#[derive(Clone, Debug, PartialEq)]
pub struct QuantConfig {
    /// Block shape of the FP8 dense-weight scales ([128, 128] in the release).
    pub weight_block: [usize; 2],
    /// `"fp4"` or `"fp8"`: storage of routed experts.
    pub expert_dtype: String,
}

/// Per-layer facts derived from the config.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerSpec {
    pub attn: AttnKind,
    /// Compression ratio r (0 for sliding layers).
    pub ratio: usize,
    /// Hash-routed MoE (expert ids from `tid2eid[token]`).
    pub hash: bool,
}

/// Everything the forward needs to know about a DeepSeek-V4 model's shape.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub head_dim: usize,
    pub rope_dim: usize,
    pub q_lora_rank: usize,
    pub o_groups: usize,
    pub o_lora_rank: usize,
    pub sliding_window: usize,
    pub layers: Vec<LayerSpec>,
    pub rope_theta: f64,
    pub compress_rope_theta: f64,
    pub yarn: Option<Yarn>,
    pub index_n_heads: usize,
    pub index_head_dim: usize,
    pub index_topk: usize,
    pub n_routed_experts: usize,
    pub n_shared_experts: usize,
    pub experts_per_tok: usize,
    pub moe_inter: usize,
    pub scoring_func: ScoringFunc,
    pub routed_scaling_factor: f32,
    pub norm_topk_prob: bool,
    pub swiglu_limit: f32,
    pub hc_mult: usize,
    pub hc_sinkhorn_iters: usize,
    pub hc_eps: f32,
    pub rms_norm_eps: f32,
    pub max_position_embeddings: usize,
    pub bos_token_id: i64,
    pub eos_token_id: i64,
    pub quant: Option<QuantConfig>,
}

/// Typed access to a JSON object with field-naming errors.
struct Fields<'a> {
    map: &'a Map<String, Value>,
}

impl<'a> Fields<'a> {
    /// First present key among `names` (aliases), or None.
    fn find(&self, names: &[&str]) -> Option<(&'a str, &'a Value)> {
        for n in names {
            if let Some((k, v)) = self.map.get_key_value(*n)
                && !v.is_null()
            {
                return Some((k.as_str(), v));
            }
        }
        None
    }

    fn usize_opt(&self, names: &[&str]) -> Result<Option<usize>> {
        match self.find(names) {
            None => Ok(None),
            Some((k, v)) => match v.as_u64() {
                Some(x) => Ok(Some(x as usize)),
                None => Err(Error::new(
                    Status::Config,
                    format!("config field `{k}` must be a non-negative integer, got {v}"),
                )),
            },
        }
    }

    fn usize_req(&self, names: &[&str]) -> Result<usize> {
        self.usize_opt(names)?.ok_or_else(|| missing(names))
    }

    fn usize_or(&self, names: &[&str], default: usize) -> Result<usize> {
        Ok(self.usize_opt(names)?.unwrap_or(default))
    }

    fn f64_opt(&self, names: &[&str]) -> Result<Option<f64>> {
        match self.find(names) {
            None => Ok(None),
            Some((k, v)) => match v.as_f64() {
                Some(x) if x.is_finite() => Ok(Some(x)),
                _ => Err(Error::new(
                    Status::Config,
                    format!("config field `{k}` must be a finite number, got {v}"),
                )),
            },
        }
    }

    fn f64_or(&self, names: &[&str], default: f64) -> Result<f64> {
        Ok(self.f64_opt(names)?.unwrap_or(default))
    }

    fn bool_or(&self, names: &[&str], default: bool) -> Result<bool> {
        match self.find(names) {
            None => Ok(default),
            Some((k, v)) => v.as_bool().ok_or_else(|| {
                Error::new(
                    Status::Config,
                    format!("config field `{k}` must be a boolean, got {v}"),
                )
            }),
        }
    }

    fn str_opt(&self, names: &[&str]) -> Result<Option<&'a str>> {
        match self.find(names) {
            None => Ok(None),
            Some((k, v)) => v.as_str().map(Some).ok_or_else(|| {
                Error::new(
                    Status::Config,
                    format!("config field `{k}` must be a string, got {v}"),
                )
            }),
        }
    }
}

fn missing(names: &[&str]) -> Error {
    Error::new(
        Status::Config,
        format!("config field `{}` is required but missing", names[0]),
    )
}

fn cfg_err(msg: String) -> Error {
    Error::new(Status::Config, msg)
}

impl ModelConfig {
    /// Reads and validates `config.json` at `path` (a file, or a directory holding one).
    pub fn from_path(path: &std::path::Path) -> Result<Self> {
        let file = if path.is_dir() {
            path.join("config.json")
        } else {
            path.to_path_buf()
        };
        let text = std::fs::read_to_string(&file).map_err(|e| {
            Error::new(
                Status::Io,
                format!("cannot read config `{}`: {e}", file.display()),
            )
        })?;
        Self::from_json_str(&text).map_err(|e| e.context(format!("config `{}`", file.display())))
    }

    /// Parses and validates a config.json text.
    pub fn from_json_str(text: &str) -> Result<Self> {
        let value: Value = serde_json::from_str(text)
            .map_err(|e| cfg_err(format!("config is not valid JSON: {e}")))?;
        // Composite configs (V4 text model inside a wrapper) keep the model under text_config.
        let obj = match value.get("text_config") {
            Some(Value::Object(m)) => m,
            _ => value
                .as_object()
                .ok_or_else(|| cfg_err("config must be a JSON object".into()))?,
        };
        let cfg = Self::parse(&Fields { map: obj })?;
        cfg.validate()?;
        Ok(cfg)
    }

    fn parse(f: &Fields) -> Result<Self> {
        let num_layers = f.usize_req(&["num_hidden_layers", "n_layers"])?;
        let num_heads = f.usize_req(&["num_attention_heads", "n_heads"])?;
        let hidden_size = f.usize_req(&["hidden_size", "dim"])?;
        let head_dim = f.usize_or(&["head_dim"], 512)?;
        // transformers derives the rope width from `partial_rotary_factor` when present.
        let rope_dim = match f.f64_opt(&["partial_rotary_factor"])? {
            Some(p) if p > 0.0 && p <= 1.0 => (p * head_dim as f64) as usize,
            Some(p) => {
                return Err(cfg_err(format!(
                    "config field `partial_rotary_factor` = {p} must be in (0, 1]"
                )));
            }
            None => match f.usize_opt(&["qk_rope_head_dim", "rope_head_dim"])? {
                Some(r) => r,
                None => head_dim * 64 / 512,
            },
        };
        if let Some(kv) = f.usize_opt(&["num_key_value_heads"])?
            && kv != 1
        {
            return Err(cfg_err(format!(
                "config field `num_key_value_heads` must be 1 (one shared K=V head), got {kv}"
            )));
        }

        let kinds = parse_layer_kinds(f, num_layers)?;
        let hash = parse_hash_layers(f, num_layers)?;
        let layers = kinds
            .into_iter()
            .zip(hash)
            .map(|((attn, ratio), hash)| LayerSpec { attn, ratio, hash })
            .collect();

        let (rope_theta, compress_rope_theta, yarn) = parse_rope(f)?;

        let scoring = f
            .str_opt(&["scoring_func", "score_func"])?
            .unwrap_or("sqrtsoftplus");
        let scoring_func = match scoring {
            "sqrtsoftplus" => ScoringFunc::SqrtSoftplus,
            "softmax" => ScoringFunc::Softmax,
            "sigmoid" => ScoringFunc::Sigmoid,
            other => {
                return Err(cfg_err(format!(
                    "config field `scoring_func` must be sqrtsoftplus, softmax or sigmoid, got \"{other}\""
                )));
            }
        };
        if let Some(act) = f.str_opt(&["hidden_act"])?
            && act != "silu"
        {
            return Err(cfg_err(format!(
                "config field `hidden_act` must be \"silu\", got \"{act}\""
            )));
        }

        let quant = parse_quant(f)?;

        Ok(ModelConfig {
            vocab_size: f.usize_req(&["vocab_size"])?,
            hidden_size,
            num_layers,
            num_heads,
            head_dim,
            rope_dim,
            q_lora_rank: f.usize_req(&["q_lora_rank"])?,
            o_groups: f.usize_req(&["o_groups"])?,
            o_lora_rank: f.usize_req(&["o_lora_rank"])?,
            sliding_window: f.usize_or(&["sliding_window", "window_size"], 128)?,
            layers,
            rope_theta,
            compress_rope_theta,
            yarn,
            index_n_heads: f.usize_or(&["index_n_heads"], 64)?,
            index_head_dim: f.usize_or(&["index_head_dim"], 128)?,
            index_topk: f.usize_or(&["index_topk"], 512)?,
            n_routed_experts: f.usize_req(&["n_routed_experts"])?,
            n_shared_experts: f.usize_or(&["n_shared_experts"], 1)?,
            experts_per_tok: f.usize_req(&["num_experts_per_tok", "n_activated_experts"])?,
            moe_inter: f.usize_req(&["moe_intermediate_size", "moe_inter_dim"])?,
            scoring_func,
            routed_scaling_factor: f.f64_or(&["routed_scaling_factor", "route_scale"], 1.0)? as f32,
            norm_topk_prob: f.bool_or(&["norm_topk_prob"], true)?,
            swiglu_limit: f.f64_or(&["swiglu_limit"], 0.0)? as f32,
            hc_mult: f.usize_or(&["hc_mult"], 4)?,
            hc_sinkhorn_iters: f.usize_or(&["hc_sinkhorn_iters"], 20)?,
            hc_eps: f.f64_or(&["hc_eps"], 1e-6)? as f32,
            rms_norm_eps: f.f64_or(&["rms_norm_eps", "norm_eps"], 1e-6)? as f32,
            max_position_embeddings: f.usize_or(&["max_position_embeddings"], 1 << 20)?,
            bos_token_id: f
                .find(&["bos_token_id"])
                .and_then(|(_, v)| v.as_i64())
                .unwrap_or(0),
            eos_token_id: f
                .find(&["eos_token_id"])
                .and_then(|(_, v)| v.as_i64())
                .unwrap_or(1),
            quant,
        })
    }

    /// Checks the rules the forward relies on. Each error names the field and the rule.
    pub fn validate(&self) -> Result<()> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_layers),
            ("num_attention_heads", self.num_heads),
            ("head_dim", self.head_dim),
            ("qk_rope_head_dim", self.rope_dim),
            ("q_lora_rank", self.q_lora_rank),
            ("o_groups", self.o_groups),
            ("o_lora_rank", self.o_lora_rank),
            ("sliding_window", self.sliding_window),
            ("n_routed_experts", self.n_routed_experts),
            ("num_experts_per_tok", self.experts_per_tok),
            ("moe_intermediate_size", self.moe_inter),
            ("hc_mult", self.hc_mult),
            ("hc_sinkhorn_iters", self.hc_sinkhorn_iters),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        for (name, v) in positive {
            if v == 0 {
                return Err(cfg_err(format!("config field `{name}` must be > 0")));
            }
        }
        // Guard against absurd sizes that would overflow allocation arithmetic.
        let huge = 1usize << 24;
        for (name, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("head_dim", self.head_dim),
            ("num_attention_heads", self.num_heads),
            ("n_routed_experts", self.n_routed_experts),
            ("moe_intermediate_size", self.moe_inter),
            ("num_hidden_layers", self.num_layers),
        ] {
            if v > huge {
                return Err(cfg_err(format!(
                    "config field `{name}` = {v} is unreasonably large"
                )));
            }
        }
        // (The CUDA attention kernels read KV rows in channel pairs.)
        if !self.head_dim.is_multiple_of(2) {
            return Err(cfg_err(format!(
                "config field `head_dim` = {} must be even",
                self.head_dim
            )));
        }
        if !self.rope_dim.is_multiple_of(2) || self.rope_dim > self.head_dim {
            return Err(cfg_err(format!(
                "config field `qk_rope_head_dim` = {} must be even and <= head_dim = {}",
                self.rope_dim, self.head_dim
            )));
        }
        if !self.num_heads.is_multiple_of(self.o_groups) {
            return Err(cfg_err(format!(
                "config field `o_groups` = {} must divide num_attention_heads = {}",
                self.o_groups, self.num_heads
            )));
        }
        if self.experts_per_tok > self.n_routed_experts {
            return Err(cfg_err(format!(
                "config field `num_experts_per_tok` = {} must be <= n_routed_experts = {}",
                self.experts_per_tok, self.n_routed_experts
            )));
        }
        if self.n_shared_experts > 1 {
            return Err(cfg_err(format!(
                "config field `n_shared_experts` = {} is unsupported: DeepSeek-V4 has 0 or 1 shared expert",
                self.n_shared_experts
            )));
        }
        if self.hc_mult > 64 || self.hc_sinkhorn_iters > 1000 {
            return Err(cfg_err(
                "config fields `hc_mult` (<= 64) / `hc_sinkhorn_iters` (<= 1000) out of range"
                    .into(),
            ));
        }
        // NaN fails too.
        let bad = |x: f32| x.is_nan() || x < 0.0;
        if bad(self.hc_eps) || bad(self.rms_norm_eps) {
            return Err(cfg_err(
                "config fields `hc_eps` and `rms_norm_eps` must be >= 0".into(),
            ));
        }
        if self.swiglu_limit < 0.0 {
            return Err(cfg_err(format!(
                "config field `swiglu_limit` = {} must be >= 0",
                self.swiglu_limit
            )));
        }
        if self.layers.iter().any(|l| l.attn == AttnKind::Csa) {
            let d = self.index_head_dim;
            if d == 0 || !d.is_power_of_two() || d < self.rope_dim {
                return Err(cfg_err(format!(
                    "config field `index_head_dim` = {d} must be a power of two >= qk_rope_head_dim = {}",
                    self.rope_dim
                )));
            }
            if self.index_n_heads == 0 || self.index_topk == 0 {
                return Err(cfg_err(
                    "config fields `index_n_heads` and `index_topk` must be > 0".into(),
                ));
            }
        }
        if self.rope_theta <= 0.0 || self.compress_rope_theta <= 0.0 {
            return Err(cfg_err(
                "config fields `rope_theta` and `compress_rope_theta` must be > 0".into(),
            ));
        }
        if let Some(y) = self.yarn
            && (y.factor < 1.0
                || y.original_max_position <= 0.0
                || y.beta_fast <= 0.0
                || y.beta_slow <= 0.0)
        {
            return Err(cfg_err(format!(
                "config field `rope_scaling` (yarn) needs factor >= 1 and positive original_max_position_embeddings/beta_fast/beta_slow, got {y:?}"
            )));
        }
        Ok(())
    }

    /// Number of query heads per output group.
    pub fn heads_per_group(&self) -> usize {
        self.num_heads / self.o_groups
    }

    /// Number of leading (non-rotated) channels of a head.
    pub fn nope_dim(&self) -> usize {
        self.head_dim - self.rope_dim
    }

    /// Width of the mHC mixing projection output: (2 + N) * N.
    pub fn hc_mix_dim(&self) -> usize {
        (2 + self.hc_mult) * self.hc_mult
    }

    /// The embedded default model of `dsv4 demo` and the tests: every feature at tiny size.
    pub fn tiny_default() -> Self {
        Self::from_json_str(TINY_DEFAULT_JSON).expect("embedded tiny config is valid")
    }
}

/// Config of the embedded demo model (sliding + CSA + HCA, hash and top-k MoE, YaRN).
pub const TINY_DEFAULT_JSON: &str = r#"{
  "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
  "vocab_size": 1024, "hidden_size": 256, "num_hidden_layers": 4,
  "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 128, "qk_rope_head_dim": 64,
  "q_lora_rank": 128, "o_groups": 2, "o_lora_rank": 128, "sliding_window": 16,
  "layer_types": ["sliding_attention", "compressed_sparse_attention",
                  "heavily_compressed_attention", "compressed_sparse_attention"],
  "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
  "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"],
  "index_n_heads": 16, "index_head_dim": 128, "index_topk": 4,
  "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 128,
  "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5, "swiglu_limit": 1.5, "norm_topk_prob": true,
  "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6,
  "rope_theta": 10000, "compress_rope_theta": 160000,
  "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                   "beta_fast": 32, "beta_slow": 1},
  "max_position_embeddings": 1048576, "num_nextn_predict_layers": 0, "tie_word_embeddings": false
}"#;

/// The first `num_layers` entries of per-layer list field `key` (a list of `what`); upstream
/// configs append one entry per MTP/draft layer after the decoder layers.
fn layer_entries<'a>(
    key: &str,
    v: &'a Value,
    what: &str,
    num_layers: usize,
) -> Result<&'a [Value]> {
    let list = v
        .as_array()
        .ok_or_else(|| cfg_err(format!("config field `{key}` must be a list of {what}")))?;
    if list.len() < num_layers {
        return Err(cfg_err(format!(
            "config field `{key}` has {} entries but num_hidden_layers = {num_layers}",
            list.len()
        )));
    }
    Ok(&list[..num_layers])
}

/// Per-layer attention kind and ratio, from `layer_types` + `compress_rates` or `compress_ratios`.
fn parse_layer_kinds(f: &Fields, num_layers: usize) -> Result<Vec<(AttnKind, usize)>> {
    if let Some((key, v)) = f.find(&["layer_types"]) {
        let list = layer_entries(key, v, "strings", num_layers)?;
        let rates = f.find(&["compress_rates"]).map(|(_, v)| v);
        let rate = |name: &str, default: usize| -> Result<usize> {
            match rates.and_then(|r| r.get(name)) {
                None => Ok(default),
                Some(v) => v.as_u64().map(|x| x as usize).ok_or_else(|| {
                    cfg_err(format!(
                        "config field `compress_rates.{name}` must be a positive integer, got {v}"
                    ))
                }),
            }
        };
        let csa = match f.usize_opt(&["compress_rate_csa"])? {
            Some(r) => r,
            None => rate("compressed_sparse_attention", 4)?,
        };
        let hca = match f.usize_opt(&["compress_rate_hca"])? {
            Some(r) => r,
            None => rate("heavily_compressed_attention", 128)?,
        };
        if csa != 4 {
            return Err(cfg_err(format!(
                "config field `compress_rates.compressed_sparse_attention` = {csa} is unsupported: CSA layers use ratio 4 (overlapping compressor)"
            )));
        }
        if hca < 2 {
            return Err(cfg_err(format!(
                "config field `compress_rates.heavily_compressed_attention` = {hca} must be >= 2"
            )));
        }
        return list
            .iter()
            .enumerate()
            .map(|(i, t)| match t.as_str() {
                Some("sliding_attention") => Ok((AttnKind::Sliding, 0)),
                Some("compressed_sparse_attention") => Ok((AttnKind::Csa, csa)),
                Some("heavily_compressed_attention") => Ok((AttnKind::Hca, hca)),
                _ => Err(cfg_err(format!(
                    "config field `layer_types[{i}]` = {t} must be sliding_attention, compressed_sparse_attention or heavily_compressed_attention"
                ))),
            })
            .collect();
    }
    let Some((key, v)) = f.find(&["compress_ratios"]) else {
        // transformers' default schedule (V4-Pro): two HCA layers, then CSA/HCA alternating.
        let hca = f.usize_or(&["compress_rate_hca"], 128)?;
        return Ok((0..num_layers)
            .map(|i| {
                if i >= 2 && i % 2 == 1 {
                    (AttnKind::Csa, 4)
                } else {
                    (AttnKind::Hca, hca)
                }
            })
            .collect());
    };
    layer_entries(key, v, "integers", num_layers)?
        .iter()
        .enumerate()
        .map(|(i, r)| match r.as_u64() {
            Some(0) => Ok((AttnKind::Sliding, 0)),
            Some(4) => Ok((AttnKind::Csa, 4)),
            Some(r) if r >= 2 => Ok((AttnKind::Hca, r as usize)),
            _ => Err(cfg_err(format!(
                "config field `compress_ratios[{i}]` = {r} must be 0 (sliding), 4 (CSA) or >= 2 (HCA)"
            ))),
        })
        .collect()
}

/// Which layers are hash-routed, from `mlp_layer_types` or `num_hash_layers`.
fn parse_hash_layers(f: &Fields, num_layers: usize) -> Result<Vec<bool>> {
    if let Some((key, v)) = f.find(&["mlp_layer_types"]) {
        return layer_entries(key, v, "strings", num_layers)?
            .iter()
            .enumerate()
            .map(|(i, t)| match t.as_str() {
                Some("hash_moe") => Ok(true),
                Some("moe") => Ok(false),
                _ => Err(cfg_err(format!(
                    "config field `mlp_layer_types[{i}]` = {t} must be \"hash_moe\" or \"moe\""
                ))),
            })
            .collect();
    }
    // transformers' default: the first 3 layers are hash-routed.
    let n = f
        .usize_or(&["num_hash_layers", "n_hash_layers"], 3)?
        .min(num_layers);
    Ok((0..num_layers).map(|i| i < n).collect())
}

/// (main theta, compress theta, YaRN) from `rope_theta`/`compress_rope_theta`/`rope_scaling`
/// or transformers' `rope_parameters` (flat, or keyed by layer kind).
fn parse_rope(f: &Fields) -> Result<(f64, f64, Option<Yarn>)> {
    let mut theta = f.f64_opt(&["rope_theta"])?;
    let mut ctheta = f.f64_opt(&["compress_rope_theta"])?;
    let mut scaling: Option<&Map<String, Value>> = None;
    if let Some((_, Value::Object(rs))) = f.find(&["rope_scaling"]) {
        scaling = Some(rs);
    }
    if let Some((key, rp)) = f.find(&["rope_parameters"]) {
        let rp = rp
            .as_object()
            .ok_or_else(|| cfg_err(format!("config field `{key}` must be an object")))?;
        let nested = rp.values().any(|v| v.is_object());
        if nested {
            // {"main": {...}, "compress": {...}} (keys may name layer kinds).
            for (k, v) in rp {
                let Some(sub) = v.as_object() else { continue };
                // The nested per-rope-type dicts win over the top-level thetas (as in transformers).
                let t = sub.get("rope_theta").and_then(Value::as_f64);
                if k.contains("compress") {
                    ctheta = t.or(ctheta);
                    scaling = Some(sub);
                } else {
                    theta = t.or(theta);
                }
            }
        } else {
            theta = theta.or(rp.get("rope_theta").and_then(Value::as_f64));
            if is_yarn(rp) && scaling.is_none() {
                scaling = Some(rp);
            }
        }
    }
    let yarn = match scaling {
        Some(s) if is_yarn(s) => {
            let num = |k: &str, d: f64| -> Result<f64> {
                match s.get(k) {
                    None | Some(Value::Null) => Ok(d),
                    Some(v) => v.as_f64().ok_or_else(|| {
                        cfg_err(format!(
                            "config field `rope_scaling.{k}` must be a number, got {v}"
                        ))
                    }),
                }
            };
            Some(Yarn {
                factor: num("factor", 1.0)?,
                original_max_position: num("original_max_position_embeddings", 65536.0)?,
                beta_fast: num("beta_fast", 32.0)?,
                beta_slow: num("beta_slow", 1.0)?,
            })
        }
        Some(s) => {
            let kind = s
                .get("type")
                .or_else(|| s.get("rope_type"))
                .cloned()
                .unwrap_or(Value::Null);
            if kind.as_str() != Some("default") {
                return Err(cfg_err(format!(
                    "config field `rope_scaling.type` = {kind} is unsupported (only \"yarn\")"
                )));
            }
            None
        }
        None => None,
    };
    Ok((theta.unwrap_or(10000.0), ctheta.unwrap_or(160000.0), yarn))
}

fn is_yarn(m: &Map<String, Value>) -> bool {
    let t = m
        .get("type")
        .or_else(|| m.get("rope_type"))
        .and_then(Value::as_str);
    t == Some("yarn")
}

fn parse_quant(f: &Fields) -> Result<Option<QuantConfig>> {
    let expert_dtype = f.str_opt(&["expert_dtype"])?.map(str::to_owned);
    let Some((key, q)) = f.find(&["quantization_config"]) else {
        return Ok(expert_dtype.map(|e| QuantConfig {
            weight_block: [128, 128],
            expert_dtype: e,
        }));
    };
    let q = q
        .as_object()
        .ok_or_else(|| cfg_err(format!("config field `{key}` must be an object")))?;
    let block = match q.get("weight_block_size") {
        None | Some(Value::Null) => [128, 128],
        Some(v) => {
            let a = v
                .as_array()
                .filter(|a| a.len() == 2)
                .and_then(|a| Some([a[0].as_u64()? as usize, a[1].as_u64()? as usize]));
            match a {
                Some(b) if b[0] > 0 && b[1] > 0 => b,
                _ => {
                    return Err(cfg_err(format!(
                        "config field `quantization_config.weight_block_size` must be two positive integers, got {v}"
                    )));
                }
            }
        }
    };
    let expert = expert_dtype
        .or_else(|| {
            q.get("expert_dtype")
                .and_then(Value::as_str)
                .map(str::to_owned)
        })
        .unwrap_or_else(|| "fp4".to_owned());
    if expert != "fp4" && expert != "fp8" {
        return Err(cfg_err(format!(
            "config field `expert_dtype` = \"{expert}\" must be \"fp4\" or \"fp8\""
        )));
    }
    Ok(Some(QuantConfig {
        weight_block: block,
        expert_dtype: expert,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiny_default_parses() {
        let c = ModelConfig::tiny_default();
        assert_eq!(c.num_layers, 4);
        assert_eq!(
            c.layers[1],
            LayerSpec {
                attn: AttnKind::Csa,
                ratio: 4,
                hash: true
            }
        );
        assert_eq!(
            c.layers[2],
            LayerSpec {
                attn: AttnKind::Hca,
                ratio: 16,
                hash: false
            }
        );
        assert!(c.yarn.is_some());
    }

    #[test]
    fn legacy_names_parse() {
        let text = r#"{"vocab_size": 64, "dim": 128, "n_layers": 3, "n_heads": 2, "head_dim": 128,
            "rope_head_dim": 64, "q_lora_rank": 128, "o_groups": 1, "o_lora_rank": 128,
            "window_size": 8, "compress_ratios": [0, 4, 128, 0], "n_hash_layers": 1,
            "n_routed_experts": 4, "n_activated_experts": 2, "moe_inter_dim": 128}"#;
        let c = ModelConfig::from_json_str(text).unwrap();
        assert_eq!(
            c.layers[2],
            LayerSpec {
                attn: AttnKind::Hca,
                ratio: 128,
                hash: false
            }
        );
        assert!(c.layers[0].hash && !c.layers[1].hash);
        assert_eq!(c.sliding_window, 8);
    }

    #[test]
    fn errors_name_the_field() {
        let base: Value = serde_json::from_str(TINY_DEFAULT_JSON).unwrap();
        let cases: &[(&str, Value, &str)] = &[
            ("o_groups", Value::from(3), "o_groups"),
            (
                "num_experts_per_tok",
                Value::from(99),
                "num_experts_per_tok",
            ),
            ("qk_rope_head_dim", Value::from(7), "qk_rope_head_dim"),
            ("head_dim", Value::from(129), "head_dim"),
            ("hidden_size", Value::from(0), "hidden_size"),
            ("hidden_size", Value::from("big"), "hidden_size"),
            (
                "layer_types",
                Value::from(vec!["sliding_attention"]),
                "layer_types",
            ),
            (
                "mlp_layer_types",
                serde_json::json!(["hash_moe", "dense", "moe", "moe"]),
                "mlp_layer_types[1]",
            ),
            ("scoring_func", Value::from("relu"), "scoring_func"),
            ("index_head_dim", Value::from(96), "index_head_dim"),
            ("num_key_value_heads", Value::from(4), "num_key_value_heads"),
        ];
        for (field, val, needle) in cases {
            let mut v = base.clone();
            v[*field] = val.clone();
            let e = ModelConfig::from_json_str(&v.to_string()).unwrap_err();
            assert_eq!(e.status, Status::Config, "{field}");
            assert!(e.message.contains(needle), "{field}: {}", e.message);
        }
        let mut v = base.clone();
        v.as_object_mut().unwrap().remove("q_lora_rank");
        let e = ModelConfig::from_json_str(&v.to_string()).unwrap_err();
        assert!(e.message.contains("q_lora_rank"), "{}", e.message);
        assert_eq!(
            ModelConfig::from_json_str("{not json").unwrap_err().status,
            Status::Config
        );
    }
}
